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
"""

from __future__ import absolute_import, division, print_function

import collections
import os

import tensorflow.compat.v1 as tf

ENGINES = ("horovod", "hccl")
# Optimizer classes that already allreduce their gradients.
_REDUCING_WRAPPERS = ("_DistributedOptimizer", "DistributedOptimizer",
                      "NPUDistributedOptimizer")


class HorovodEngine(object):
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
        return widened(grad, lambda wide: self._hvd.allreduce(wide, op=self._hvd.Average))


class HcclEngine(object):
    """Ascend's HCCL allreduce from npu_bridge, across ``RANK_SIZE`` devices."""

    name = "hccl"

    def __init__(self, hccl_ops, rank_size):
        self._hccl_ops = hccl_ops
        self._rank_size = rank_size

    def sum(self, tensor):
        return self._hccl_ops.allreduce(tensor, "sum")

    def mean_gradient(self, grad):
        # HCCL reduces dense tensors only, as NPUDistributedOptimizer does.
        def mean(wide):
            summed = self._hccl_ops.allreduce(wide, "sum")
            return summed / tf.cast(self._rank_size, summed.dtype.base_dtype)
        return widened(tf.convert_to_tensor(grad), mean)


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
        Ascend devices deliberately decide alone), "horovod" or "hccl".

    Returns:
      None, a ``HorovodEngine`` or an ``HcclEngine``.

    Raises:
      ValueError: for an unknown name, a missing package, or Horovod before
        ``hvd.init()``.
    """
    if distributed is None or distributed is False:
        return None
    if distributed not in ENGINES:
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


def reduce_across_workers(reduction, flags, grads):
    """Sums the flags across workers (one collective) and averages the
    gradients, at the top level of the graph: never inside a cond or gate.

    Args:
      reduction: the ``plan.Reduction``.
      flags: ordered dict from check name to float32 flag.
      grads: ordered dict from group name to (gradient, variable) pairs.

    Returns:
      ``(flags, grads)``: new ordered dicts, reduced; the inputs unchanged
      without an engine.
    """
    if not reduction.active:
        return flags, grads
    engine = reduction.engine
    if flags:
        with tf.name_scope("reduce_overflow_flags"):
            summed = engine.sum(tf.stack(list(flags.values())))
            flags = collections.OrderedDict(
                (name, summed[index]) for index, name in enumerate(flags))
    if reduction.allreduce_gradients:
        with tf.name_scope("allreduce_gradients"):
            grads = collections.OrderedDict(
                (name, [(engine.mean_gradient(grad), var) for grad, var in pairs])
                for name, pairs in grads.items())
    return flags, grads


#: The environment variables Ascend's launchers set to the number of devices.
#: tf_adapter reads RANK_SIZE, else CM_WORKER_SIZE, and refuses both at once
#: (``get_ranksize()`` in tf_adapter npu_bridge/estimator/npu/util.py).
RANK_SIZE_VARIABLES = ("RANK_SIZE", "CM_WORKER_SIZE")


def rank_size_from_environment(environ=None):
    """The number of devices an Ascend launcher started, from the environment.

    Read as tf_adapter reads it: ``RANK_SIZE``, else ``CM_WORKER_SIZE``; both
    set at once is an error; neither means one device.

    Args:
      environ: a mapping to read instead of ``os.environ`` (for tests).

    Returns:
      An int >= 1.

    Raises:
      ValueError: if both are set, or the value is not a positive int.
    """
    environ = os.environ if environ is None else environ
    present = [name for name in RANK_SIZE_VARIABLES if environ.get(name)]
    if len(present) > 1:
        raise ValueError(
            "both RANK_SIZE=%r and CM_WORKER_SIZE=%r are set; tf_adapter refuses "
            "that, as the device count would be ambiguous. Unset one of them."
            % (environ["RANK_SIZE"], environ["CM_WORKER_SIZE"]))
    if not present:
        return 1
    name = present[0]
    value = environ[name]
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(
            "%s must be the number of devices, a positive int, got %r. Set it as "
            "Ascend's launch scripts do (e.g. %s=8), or unset it on one device."
            % (name, value, name))
    return count


def check_single_worker(what, reduce_with, opt_out):
    """Raises ValueError when Ascend's launcher started several devices but
    nothing would reduce the skip decision across them.

    Each device would then skip on its own overflows alone, and the replicas
    would drift apart silently.

    Args:
      what: the API being built, for the message.
      reduce_with: the argument that turns the reduction on.
      opt_out: the argument that declares the devices independent.

    Raises:
      ValueError: if the environment names more than one device.
    """
    ranks = rank_size_from_environment()
    if ranks > 1:
        raise ValueError(
            "%s: the environment names %d devices (RANK_SIZE/CM_WORKER_SIZE), but no "
            "cross-device reduction was asked for, so each device would skip on its "
            "own overflows and the replicas would drift apart. Pass %s to sum the "
            "overflow decision across devices, or %s if each device really trains "
            "alone." % (what, ranks, reduce_with, opt_out))


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
    if type(optimizer).__name__ == "NPUOptimizer" and getattr(optimizer, "_is_distributed", False):
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
