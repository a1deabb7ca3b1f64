"""What counts as a collective op, and the check of what a "workers"
engine's ``reduce`` returns: on one of several workers (``cluster``), each
reduced flag (and gradient) must come out of a collective computed from what
``reduce`` was given, or each worker would decide alone."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals
from npu_lossscale.cluster import cluster_from_environment
from npu_lossscale.core import graph_walk as _graph_walk


def check_reduced(engine, given, reduced, allreduce_gradients):
    """Refuses, when the environment names several workers, a "workers"
    engine whose ``reduce`` put no collective op between what it was given
    and what it returned: each worker would then decide on its own flags
    (and apply its own gradients) while the step looked reduced.

    Args:
      engine: the ``seams.ReductionEngine``, for the message.
      given: ``(flags, grads)`` as ``reduce`` was given them.
      reduced: ``(flags, grads)`` as it returned them (checked:
        ``hooks.reduced``).
      allreduce_gradients: whether the gradients had to be averaged too.

    Raises:
      ValueError: for a flag, or with ``allreduce_gradients`` a gradient,
        that no collective op computes from what was given.
    """
    cluster = cluster_from_environment()
    if cluster is None:
        return
    stops = set(values_op(tensor) for tensor in given[0].values())
    stops.update(values_op(grad) for pairs in given[1].values() for grad, _ in pairs)
    outputs = [("flag %r" % name, flag) for name, flag in reduced[0].items()]
    if allreduce_gradients:
        outputs += [("group %r's gradient of %r" % (name, var.op.name), grad)
                    for name, pairs in reduced[1].items() for grad, var in pairs]
    for what, tensor in outputs:
        walked = _graph_walk.depth_first([values_op(tensor)],
                                         lambda op: [] if op in stops else data_parents(op))
        if not any(op not in stops and is_collective(op) for op in walked):
            raise ValueError(
                "distributed=%s: this process is one of %d workers (%s), but the engine's "
                "reduce returned %s with no collective op between it and what it was given: "
                "each worker would decide alone. Reduce it with a collective (e.g. "
                "hvd.allreduce), or pass distributed=False if each worker trains alone."
                % (engine.name, cluster.workers, cluster.source, what))


def values_op(tensor):
    """The op of a tensor or of an ``IndexedSlices``' values."""
    return (tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor).op


def is_collective(op):
    """Whether ``op`` is a collective (npu_bridge's emulation included, by
    the op type it stands for), or a functional op or call whose functions
    run one (Horovod 0.28's allreduce sits in a ``tf.cond`` on its size)."""
    node_def = op.node_def  # a serialized copy: made once
    if _collective_node(node_def):
        return True

    def definition(name):
        return getattr(_tf_internals.graph_function(op.graph, name), "definition", None)

    return any(body is not None and any(_collective_node(node) for node in body.node_def)
               for _, body in _graph_walk.function_bodies(node_def, definition))


def _collective_node(node_def):
    """Whether a NodeDef is a collective, by its type or the type the
    npu_bridge emulation records in ``_npu_shim_op_type``."""
    kind = node_def.op
    shim = node_def.attr.get("_npu_shim_op_type")
    if shim is not None and shim.s:
        kind = shim.s.decode("utf-8")
    return kind in _graph_walk.COLLECTIVE_TYPES


def data_parents(op):
    """The producers of ``op``'s data inputs."""
    return [tensor.op for tensor in op.inputs]
