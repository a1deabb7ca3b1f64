"""Data-parallel reduction: every worker reaches the same skip decision.

Two things are reduced across workers, both *before* the apply gate and
never inside it or any cond (workers that took different branches of a cond
holding a collective would deadlock, tensorflow/tensorflow#46863):

* the overflow flags, summed: zero after the sum means every worker was
  finite, as Ascend's own adapter decides. (Summing "finite" flags and
  testing > 0.5 would be wrong: it calls a step finite if any one worker was.)
* the gradients, averaged with the engine's allreduce, unless the user's
  optimizers already do it (``allreduce_gradients=False``). float16
  gradients are averaged in float32 (``widened``): each worker's gradient
  is finite after the check, but their float16 sum can overflow where the
  mean does not, after the overflow check has run. On Ascend an HCCL
  AllReduce is an overflow-checked op (tf_adapter's NPULossScaleOptimizer
  reads the float-status register after the allreduced gradients its inner
  NPUDistributedOptimizer made, estimator/npu/npu_loss_scale_optimizer.py),
  so the builder's read, which precedes the reduction, would miss it and
  the saturated sum would be applied; under Horovod, or in INF/NaN mode,
  an inf mean would be applied. In float32 the sum of ranks' float16 values
  cannot overflow and the mean fits float16 again.

In-graph towers have no name here: they are a property of a group's loss
list (``add([loss_a, loss_b], ...)``), and the builder wraps whatever engine
it is given in ``towers.Towers`` (docs/extending.md, "Reduction engines").
"""

from __future__ import absolute_import, division, print_function

import collections
import copy

import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams
from npu_lossscale import tf_internals as _tf_internals
from npu_lossscale.cluster import (HOROVOD_SIZE_VARIABLES, RANK_SIZE_VARIABLES, Cluster,
                                   cluster_from_environment, rank_size_from_environment)
from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.plugin_helpers import check_reduced, data_parents, is_collective, values_op

__all__ = ["CollectiveEngine", "HcclEngine", "HorovodEngine", "ENGINES", "MODES",
           "resolve_engine", "Cluster", "cluster_from_environment"]

ENGINES = ("horovod", "hccl")
#: The modes of a ``seams.ReductionEngine``.
MODES = ("local", "workers", "chief")
# Optimizer classes that already allreduce their gradients.
_REDUCING_WRAPPERS = ("_DistributedOptimizer", "DistributedOptimizer",
                      "NPUDistributedOptimizer")


class CollectiveEngine(_seams.ReductionEngine):
    """Workers that reach one decision with collectives: the flags summed
    (one collective), the gradients averaged, both at the top level of the
    graph, never inside a cond or the gate. Subclasses give ``sum`` and
    ``mean_gradient``."""

    mode = "workers"
    #: Whether float16 gradients are reduced in float16 (``float16_mean``)
    #: rather than widened to float32 (``widened``).
    float16 = False

    def workers(self):
        """The number of workers (an int)."""
        raise NotImplementedError

    def reducing_float16(self):
        """A copy of this engine that reduces float16 gradients in float16
        (``allreduce_float16=True``), so that another builder given this
        engine still reduces as it was made to."""
        engine = copy.copy(self)
        engine.float16 = True
        return engine

    def float16_mean(self, grad):
        """The mean of a dense float16 gradient, reduced in float16: each
        worker divides by the worker count first, so the sum of their
        values, each at most 65504 / n, cannot overflow (half the bytes of
        the float32 reduction; values below n * 2**-24 flush to 0)."""
        return self.sum(grad * tf.constant(1.0 / self.workers(), tf.float16))

    def sum(self, tensor):
        """Allreduce-sum of a dense float32 tensor across workers."""
        raise NotImplementedError

    def mean_gradient(self, grad):
        """Allreduce-average of one gradient across workers."""
        raise NotImplementedError

    def reduce(self, flags, grads, allreduce_gradients):
        """Sums the flags across workers and averages the gradients.

        Args:
          flags: ordered dict from flag name to float32 flag.
          grads: ordered dict from group name to (gradient, variable) pairs.
          allreduce_gradients: whether to average the gradients too.

        Returns:
          ``(flags, grads)``: new ordered dicts.
        """
        if flags:
            with tf.name_scope("reduce_overflow_flags"):
                summed = self.sum(tf.stack(list(flags.values())))
                flags = collections.OrderedDict(
                    (name, summed[index]) for index, name in enumerate(flags))
        if allreduce_gradients:
            with tf.name_scope("allreduce_gradients"):
                grads = collections.OrderedDict(
                    (name, [(self.mean_gradient(grad), var) for grad, var in pairs])
                    for name, pairs in grads.items())
        return flags, grads


class HorovodEngine(CollectiveEngine):
    """Horovod's allreduce (MPI, Gloo or NCCL), after ``hvd.init()``."""

    name = "horovod"

    def __init__(self, hvd):
        self._hvd = hvd

    def sum(self, tensor):
        """Allreduce-sum of a dense tensor."""
        return self._hvd.allreduce(tensor, op=self._hvd.Sum)

    def mean_gradient(self, grad):
        """Allreduce-average of a gradient (IndexedSlices allgathered)."""
        if isinstance(grad, tf.IndexedSlices):  # gathered, never summed
            return self._hvd.allreduce(grad, op=self._hvd.Average)
        if self.float16 and grad.dtype.base_dtype == tf.float16:
            return self.float16_mean(grad)
        return widened(grad, lambda wide: self._hvd.allreduce(wide, op=self._hvd.Average))

    def workers(self):
        return self._hvd.size()


class HcclEngine(CollectiveEngine):
    """Ascend's HCCL allreduce from npu_bridge, across ``RANK_SIZE`` devices."""

    name = "hccl"

    def __init__(self, hccl_ops, rank_size):
        self._hccl_ops = hccl_ops
        self._rank_size = rank_size

    def sum(self, tensor):
        return self._hccl_ops.allreduce(tensor, "sum")

    def mean_gradient(self, grad):
        """Allreduce-average of a dense gradient; an ``IndexedSlices`` is
        gathered, never made dense, as tf_adapter's
        ``npu_optimizer.allreduce`` gathers one
        (estimator/npu/npu_optimizer.py): two allgathers, of its values
        and of its indices, the values divided by the rank count (a
        gather sums nothing, so float16 values stay float16; the apply
        sums the duplicate rows, each at most 65504 / n)."""
        if isinstance(grad, tf.IndexedSlices):
            values = self._hccl_ops.allgather(grad.values, self._rank_size)
            indices = self._hccl_ops.allgather(grad.indices, self._rank_size)
            values = values / tf.cast(self._rank_size, values.dtype.base_dtype)
            return tf.IndexedSlices(values, indices, grad.dense_shape)

        def mean(wide):
            summed = self._hccl_ops.allreduce(wide, "sum")
            return summed / tf.cast(self._rank_size, summed.dtype.base_dtype)
        if self.float16 and grad.dtype.base_dtype == tf.float16:
            return self.float16_mean(grad)
        return widened(grad, mean)

    def workers(self):
        return self._rank_size


def widened(grad, reduce_fn):
    """``reduce_fn(grad)``, computed in float32 for a float16 ``grad``.

    Args:
      grad: a dense gradient tensor.
      reduce_fn: the allreduce-average, from tensor to tensor.

    Returns:
      The reduced gradient, in ``grad``'s dtype.
    """
    if grad.dtype.base_dtype != tf.float16:
        return reduce_fn(grad)
    return tf.cast(reduce_fn(tf.cast(grad, tf.float32)), tf.float16)


def resolve_engine(distributed):
    """Turns ``distributed`` into an engine object, or None.

    Args:
      distributed: None or False (one worker; False also when several
        Ascend devices deliberately decide alone), "horovod", "hccl", or a
        ``seams.ReductionEngine`` instance (used as it is).

    Returns:
      None, or the engine.

    Raises:
      ValueError: for an unknown name, a missing package, or Horovod before
        ``hvd.init()``.
    """
    if distributed is None or distributed is False:
        return None
    if isinstance(distributed, _seams.ReductionEngine):
        if distributed.mode not in MODES:
            raise ValueError(
                "distributed=%r has mode %r, which is none of %r. Set the engine's mode to "
                "\"workers\" for an engine that reduces in reduce(), as seams.ReductionEngine "
                "documents." % (distributed, distributed.mode, MODES))
        return distributed
    if isinstance(distributed, type) and issubclass(distributed, _seams.ReductionEngine):
        raise TypeError("distributed=%r is a class; pass an instance, distributed=%s()."
                        % (distributed, distributed.__name__))
    if not isinstance(distributed, str) or distributed not in ENGINES:
        raise ValueError(
            "distributed must be None or one of %r, got %r. Use 'horovod' on "
            "GPUs/CPUs, 'hccl' on Ascend." % (ENGINES, distributed))
    if distributed == "horovod":
        try:
            import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
        except ImportError as error:
            raise ValueError(
                "distributed='horovod' needs Horovod, which failed to import: %s. "
                "Install it with TensorFlow support (HOROVOD_WITH_TENSORFLOW=1 pip "
                "install horovod), or pass distributed=None." % (error,))
        try:
            hvd.size()
        except ValueError as error:
            raise ValueError(
                "distributed='horovod' was given before hvd.init() (%s). Call "
                "hvd.init() at program start, before building the graph." % (error,))
        return HorovodEngine(hvd)
    try:
        from npu_bridge.hccl import hccl_ops  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise ValueError(
            "distributed='hccl' needs Huawei's npu_bridge (CANN tf_adapter), which "
            "failed to import: %s. Install it, or pass distributed=None." % (error,))
    rank_size = rank_size_from_environment()
    return HcclEngine(hccl_ops, rank_size)


#: The environment variables Ascend's launchers set to the number of devices.
def check_cluster(what, plan, reduce_with, opt_out, aggregated=False, given=None):
    """Refuses a step of one of several workers whose skip decisions nothing
    makes equal, or returns the observer that checks its gradients.

    Each worker would otherwise skip on its own overflows alone, and the
    replicas would drift apart silently. Accepted without an engine: a
    step whose decision a SyncReplicasOptimizer's chief takes on the
    aggregate (``aggregated``), and one whose checked gradients are
    averaged across workers before the check (``hvd.DistributedOptimizer``,
    npu_bridge's distributed wrappers), with a backend that reads those
    gradients (not the float-status register, which sees only this
    device's overflows). What decides is what the step reduces, not how the
    optimizer was called: every checked gradient must come out of a
    collective op (``graph_walk.COLLECTIVE_TYPES``), looked up once the
    gradients exist.

    Args:
      what: the API being built, for the message.
      plan: the step's ``seams.PlanView`` (or the plan it views).
      reduce_with: dict from ``Cluster.kind`` to the route that makes the
        workers decide alike, for the message.
      opt_out: the argument that declares the workers independent.
      aggregated: whether a SyncReplicasOptimizer's chief decides.
      given: the (gradient, variable) pairs a ``LossScaleOptimizer`` was
        handed, checked here; None for a builder's step, whose gradients
        the returned observer checks.

    Returns:
      None, or a ``ReducedGradients`` observer for the step.

    Raises:
      ValueError: if the environment names several workers and none of the
        above holds.
    """
    cluster = cluster_from_environment()
    if cluster is None or aggregated:
        return None
    checked = [group for group in plan.groups if group.checked]
    refusal = ReducedGradients(what, cluster, reduce_with[cluster.kind], opt_out)
    if not plan.backend.reads_register:
        if given is not None:
            refusal.check(plan.groups[0].name, given)
            return None
        if all(reduces_gradients(group.optimizer) for group in checked):
            return refusal
    raise ValueError(
        "%s: this process is one of %d workers (%s), but their skip decisions are not "
        "reduced, so the replicas would drift apart. %s, or pass %s if each worker "
        "trains alone." % (what, cluster.workers, cluster.source, reduce_with[cluster.kind],
                           opt_out))


class ReducedGradients(_seams.StepObserver):
    """Checks, once a step's gradients exist, that every checked gradient
    comes out of a collective op: the workers then check equal gradients
    and decide alike (``check_cluster``).

    Args:
      what: the API being built, for the message.
      cluster: the ``Cluster``.
      route: the route that makes the workers decide alike.
      opt_out: the argument that declares the workers independent.
    """

    name = "reduced_gradients"

    def __init__(self, what, cluster, route, opt_out):
        self._what, self._cluster, self._route, self._opt_out = what, cluster, route, opt_out

    def before_update(self, state):
        for group in state.plan.groups:
            if group.checked:
                self.check(group.name, state.grads[group.name])
        return _seams.Hooked()

    def check(self, name, grads_and_vars):
        """Raises ValueError unless every gradient of ``grads_and_vars``
        depends on a collective op."""
        for grad, var in grads_and_vars:
            if grad is None:
                continue
            op = values_op(grad)
            if not any(is_collective(node)
                       for node in _helpers.depth_first([op], data_parents)):
                raise ValueError(
                    "%s: this process is one of %d workers (%s), and group %r's gradient of "
                    "%r is not averaged across them (no collective op computes it), so the "
                    "replicas' skip decisions would drift apart. %s, or pass %s if each "
                    "worker trains alone." % (
                        self._what, self._cluster.workers, self._cluster.source, name,
                        var.op.name, self._route, self._opt_out))


def check_no_strategy(what):
    """Raises ValueError under a ``tf.distribute`` strategy with several
    replicas in one graph (``MirroredStrategy`` over local devices...),
    which the step, one graph per worker, does not support.

    A strategy with one replica in each process's graph is accepted,
    however many replicas it keeps in sync across processes:
    ``NPUStrategy``, what Huawei's converter puts for ``MirroredStrategy``
    (tf_adapter npu_bridge/estimator/npu/npu_strategy.py: a
    ``OneDeviceExtended`` whose ``num_replicas_in_sync`` is RANK_SIZE), a
    ``OneDeviceStrategy``, a multi-worker strategy over one device per
    worker. Its workers reduce as any others do (``distributed="hccl"`` or
    "horovod"; ``check_cluster`` refuses a launch that reduces nothing).

    Args:
      what: the API being built, for the message.
    """
    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    local = len(strategy.extended.worker_devices)
    if local > 1:
        raise ValueError(
            "%s: built under %s with %d replicas in one graph, which this library does "
            "not support. Run one process per device with distributed='horovod' (or "
            "'hccl'), or tf.train.SyncReplicasOptimizer on parameter servers."
            % (what, type(strategy).__name__, local))


def reduces_gradients(optimizer):
    """Whether ``optimizer`` already averages its gradients across workers.

    True for Horovod's ``DistributedOptimizer``, npu_bridge's
    ``NPUDistributedOptimizer`` and ``NPUOptimizer(is_distributed=True)``,
    and for an instance whose ``compute_gradients`` was replaced in place, as
    npu_bridge's ``npu_distributed_optimizer_wrapper`` does (tf_adapter
    ``npu_bridge/estimator/npu/npu_optimizer.py``).

    Args:
      optimizer: a ``tf.train.Optimizer``.

    Returns:
      A bool.
    """
    if any(cls.__name__ in _REDUCING_WRAPPERS for cls in type(optimizer).__mro__):
        return True
    if type(optimizer).__name__ == "NPUOptimizer" and _tf_internals.npu_optimizer_flag(
            optimizer, "is_distributed"):
        return True
    return "compute_gradients" in vars(optimizer)


def check_not_already_reducing(optimizer, group, allreduce_gradients):
    """Raises ValueError when gradients would be allreduced twice."""
    if allreduce_gradients and reduces_gradients(optimizer):
        raise ValueError(
            "the optimizer of group %r (%s) already allreduces its gradients "
            "(a distributed optimizer, or npu_distributed_optimizer_wrapper), and "
            "allreduce_gradients=True would average them a second time. Pass "
            "allreduce_gradients=False to MultiOptimizerLossScale, or give the group "
            "the unwrapped optimizer." % (group, type(optimizer).__name__))
