"""What a loss-scale manager costs per step, measured on CPU (issue 16 proxy).

On a GPU, TensorFlow keeps int32 tensors in host memory, so int32 manager state
costs host/device copies in the middle of every step; and every executed op
costs a kernel launch. Neither shows on CPU timings, so these functions count
instead: they build the small two-group GAN of ``tests/models.py`` with
``MultiOptimizerLossScale``, run a few steps, and trace one with
``RunOptions(trace_level=FULL_TRACE)``.

``manager_op_overhead()`` is the number ``make bench`` reports.
"""

import tensorflow.compat.v1 as tf
from tensorflow.core.protobuf import config_pb2

import npu_lossscale as nl
from models import two_group_gan

# Output dtypes a manager op on the per-step path may produce: device data
# (float32, bool) and variable handles/refs. int32 and int64 tensors live in
# host memory on a GPU; a bool *variable* would be state outside the vector.
DEVICE_DTYPES = (tf.float32, tf.bool, tf.resource, tf.float32._as_ref)
# Ops whose int32 constant input TF reads from host memory by design (the
# reduction axis): an int32 Const feeding only these costs no copy.
HOST_INDEX_CONSUMERS = ("All", "Any", "Sum", "Max", "Min", "Prod", "Mean")

MANAGERS = {
    "fixed": lambda: nl.FixedLossScaleManager(2.0 ** 10),
    "dynamic": lambda: nl.DynamicLossScaleManager(initial_scale=2.0 ** 10),
    "exponential": lambda: nl.ExponentialUpdateLossScaleManager(2.0 ** 10, 1000),
}


class RecordingManager(object):
    """Wraps a manager and records every op its methods (and its
    construction) add to the graph."""

    #: It wraps one of this package's managers, whose class declares the
    #: promise (``managers.base.declares_scale_in_range``): the step must
    #: cost what it costs with the manager itself, without a run-time check.
    keeps_scale_in_range = True

    def __init__(self, make):
        graph = tf.get_default_graph()
        before = set(graph.get_operations())
        self._manager = make()
        self.ops = set(graph.get_operations()) - before

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def _recorded(self, method, *args):
        graph = tf.get_default_graph()
        before = set(graph.get_operations())
        result = method(*args)
        self.ops |= set(graph.get_operations()) - before
        return result

    def get_loss_scale(self):
        return self._recorded(self._manager.get_loss_scale)

    def update_loss_scale(self, finite_grads):
        return self._recorded(self._manager.update_loss_scale, finite_grads)


def traced_gan_step(make_manager, warmup_steps=3):
    """Builds the two-group GAN with one shared manager and traces a step.

    Args:
      make_manager: a function returning a fresh manager.
      warmup_steps: steps run before the traced one.

    Returns:
      (names of the executed nodes, the graph, the RecordingManager).
    """
    graph = tf.Graph()
    with graph.as_default():
        tf.set_random_seed(0)
        model = two_group_gan()
        manager = RecordingManager(make_manager)
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars, name="d")
        scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars, name="g")
        train = scaler.build(global_step=tf.train.get_or_create_global_step())
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(warmup_steps):
                sess.run(train.update_op, model.feed)
            options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
            metadata = config_pb2.RunMetadata()
            sess.run(train.update_op, model.feed, options=options, run_metadata=metadata)
    names = [node.node_name for dev in metadata.step_stats.dev_stats
             for node in dev.node_stats]
    names = [name for name in names if name not in ("_SOURCE", "_SINK")]
    return names, graph, manager


def executed_ops_per_step(make_manager):
    """How many nodes one traced step of the two-group GAN executes."""
    return len(traced_gan_step(make_manager)[0])


def manager_op_overhead():
    """Executed ops per step on the two-group GAN, per manager.

    Returns:
      A dict: ``fixed``, ``dynamic``, ``exponential`` (executed ops per step)
      and ``dynamic_extra`` / ``exponential_extra`` (over ``fixed``). Issue 16
      asks for extras <= 30 (58 before the state vector).
    """
    counts = dict((name, executed_ops_per_step(make)) for name, make in MANAGERS.items())
    for name in ("dynamic", "exponential"):
        counts[name + "_extra"] = counts[name] - counts["fixed"]
    return counts


def host_pinned_manager_tensors(make_manager):
    """Manager ops executed per step whose outputs TF would keep on the host.

    Returns:
      ``"op (type): dtype"`` strings; empty when the manager's per-step path
      is device-resident.
    """
    names, graph, manager = traced_gan_step(make_manager)
    executed = set(name.split(":")[0] for name in names)
    found = []
    for op in manager.ops:
        if op.name not in executed:
            continue
        for output in op.outputs:
            if output.dtype in DEVICE_DTYPES:
                continue
            if (op.type == "Const" and output.dtype == tf.int32
                    and all(c.type in HOST_INDEX_CONSUMERS for c in output.consumers())):
                continue
            found.append("%s (%s): %s" % (op.name, op.type, output.dtype.name))
    return sorted(found)


def manager_op_types(make_manager):
    """Types of the manager's ops executed per step."""
    names, _, manager = traced_gan_step(make_manager)
    executed = set(names)
    return sorted(op.type for op in manager.ops if op.name in executed)
