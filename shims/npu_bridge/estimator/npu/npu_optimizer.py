"""Shim of ``npu_bridge.estimator.npu.npu_optimizer``.

Mirrors tf_adapter/python/npu_bridge/estimator/npu/npu_optimizer.py
(hicann/tensorflow).  Emulated:

``allreduce(tensor, average=True)``
    ``hccl_ops.allreduce(tensor, "sum")`` (fusion=1), divided by the rank
    count (``tf.div(summed, cast(size, tensor.dtype))``) when ``average``.
    The real function takes the count from ``NPUBasics("").size()``
    (npu_common.py): with no job config file it needs ``JOB_ID`` set
    (otherwise its job info is None and ``size()`` fails) and then reads
    ``util.get_ranksize()``.  The shim reads ``util.get_ranksize()`` and
    raises a RuntimeError naming JOB_ID when JOB_ID is unset; it does not
    cache the count in a singleton as NPUBasics does.  An IndexedSlices is
    gathered, never summed, as in the real code: ``hccl_ops.allgather`` of
    its values and of its indices, the values divided by the rank count
    when ``average``.

``NPUDistributedOptimizer(optimizer, is_weight_update_sharding=False, name=None)``
    A ``tf.train.Optimizer`` (name "Distributed<OptType>").
    ``compute_gradients``: the wrapped optimizer's, then, when
    ``int(util.get_ranksize()) > 1``, every non-None gradient replaced by
    ``allreduce(grad, True)`` inside ``name_scope(name + "_Allreduce")``.
    ``apply_gradients``: the wrapped optimizer's.  get_slot, get_slot_names
    and variables are forwarded.  Weight-update sharding is not emulated
    (NotImplementedError with more than one rank).

``npu_distributed_optimizer_wrapper(optimizer)``
    Patches the optimizer *instance in place* and returns it: its
    ``compute_gradients`` (scope "Npu_Distributed_optimizer_Allreduce"),
    ``get_gradients`` (scope "Npu_Distributed_optimizer_get_grads_Allreduce")
    and ``_compute_gradients`` (scope
    "Npu_Distributed_optimizer_compute_grads_Allreduce"), whichever exist,
    average the gradients with ``allreduce(grad, True)`` when the rank count,
    read ONCE when the wrapper is called, is above 1.  A string argument
    (Keras optimizer name, ``optimizers.get``) is not emulated.  Shim-only:
    each patched method carries ``_npu_shim_distributed_wrapper = True``.

``NPUOptimizer(opt, loss_scale_manager=None, is_distributed=False,
               is_loss_scale=False, is_tailing_optimization=False, name=None)``
    A ``tf.train.Optimizer`` (name "NPUOptimizer<OptType>").  ValueError if
    ``is_loss_scale`` and no manager.  ``compute_gradients``: scales the loss
    by the manager's scale when ``is_loss_scale``; the wrapped optimizer's
    gradients; averaged with ``allreduce(grad, True)`` in
    ``name_scope(name + "_Allreduce")`` when ``is_distributed`` (whatever the
    rank count); then divided by the scale when ``is_loss_scale``.
    ``apply_gradients``: without loss scaling the wrapped optimizer's; with
    it, unless tailing optimization is on, ``_reduce_all``: NpuGetFloatStatusV2
    after every non-None gradient, NpuClearFloatStatusV2 after the read, and
    ``reduce_all(equal(0, status))`` (distributed: ``allreduce([status],
    "sum", fusion=0)`` compared with 0), both after the clear; then
    ``cond(finite, apply, no_op)`` grouped with
    ``update_loss_scale(finite)``.  With tailing optimization the status is
    read in compute_gradients, before the last gradient's allreduce.  Unlike
    NPULossScaleOptimizer it never asks ``is_inf_nan_enabled()`` and has no
    v1-op path: it needs the v2 ops (op set "v2").

``npu_allreduce(values, reduction="mean", fusion=1, fusion_id=-1, group=...)``
    As the real one here: each dense value summed with ``hccl_ops.allreduce``
    (divided by ``int(util.get_ranksize())`` for "mean"), each IndexedSlices
    gathered with two ``hccl_ops.allgather`` calls, never made dense.

``KerasDistributeOptimizer`` is not emulated.
"""
from __future__ import absolute_import, division, print_function

import os

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import gen_control_flow_ops as _gen_cf_ops
from tensorflow.python.ops import gen_math_ops as _gen_math_ops

from npu_bridge.estimator.npu import util
from npu_bridge.hccl import hccl_ops
from npu_bridge.helper import helper

gen_npu_ops = helper.get_gen_ops()

#: attribute set on the methods npu_distributed_optimizer_wrapper installs (shim only)
WRAPPED_MARK = "_npu_shim_distributed_wrapper"


def _basics_size():
    # NPUBasics("").size(): no job config file "" -> job info from env; it
    # is None (and size() fails) when JOB_ID is unset.
    if os.getenv("JOB_ID", "") == "":
        raise RuntimeError(
            "npu_bridge shim: NPUBasics has no job info: JOB_ID is unset and there is no "
            "job config file (the real npu_bridge then fails in NPUBasics.size()); set JOB_ID")
    size = util.get_ranksize()
    return int(size) if size.isdigit() else 1


def allreduce(tensor, average=True):
    """Sum ``tensor`` over the ranks (HcomAllReduce), divided by the rank
    count when ``average``."""
    size = _basics_size()
    if isinstance(tensor, tf.IndexedSlices):
        return _gathered(tensor, size, average)
    summed = hccl_ops.allreduce(tensor, "sum")
    if not average:
        return summed
    return tf.div(summed, tf.cast(size, dtype=tensor.dtype))


def _gathered(slices, size, average, group="hccl_world_group"):
    """An IndexedSlices reduced as the real ``allreduce`` and
    ``_npu_allreduce`` reduce one: two allgathers instead of an allreduce
    (its values and its indices), the values divided by ``size`` when
    ``average``; never made dense."""
    values = hccl_ops.allgather(slices.values, size, group)
    indices = hccl_ops.allgather(slices.indices, size, group)
    new_values = tf.div(values, tf.cast(size, slices.values.dtype)) if average else values
    return tf.IndexedSlices(new_values, indices, dense_shape=slices.dense_shape)


def _npu_allreduce(values, reduction="mean", fusion=1, fusion_id=-1, group="hccl_world_group"):
    mean = reduction == "mean"
    if mean:
        reduction = "sum"
    size = int(util.get_ranksize())
    reduced = []
    for value in values:
        if isinstance(value, tf.IndexedSlices):
            reduced.append(_gathered(value, size, mean, group))
            continue
        summed = hccl_ops.allreduce(value, reduction, fusion, fusion_id, group)
        reduced.append(tf.div(summed, tf.cast(size, dtype=value.dtype)) if mean else summed)
    return reduced


def npu_allreduce(values, reduction="mean", fusion=1, fusion_id=-1, group="hccl_world_group"):
    """Each value reduced over the ranks (``hccl_ops.allreduce``, divided by
    ``int(util.get_ranksize())`` for "mean"), an IndexedSlices gathered
    (``_gathered``): a list for a list or tuple, else one tensor."""
    if isinstance(values, (list, tuple)):
        return _npu_allreduce(values, reduction, fusion, fusion_id, group)
    return _npu_allreduce([values], reduction, fusion, fusion_id, group)[0]


def _average_all(gradients, scope):
    averaged = []
    with tf.name_scope(scope):
        for grad, var in gradients:
            averaged.append((allreduce(grad, True) if grad is not None else None, var))
    return averaged


class NPUOptimizer(tf.train.Optimizer):
    """npu_bridge's combined loss-scale / distributed optimizer (CPU shim)."""

    def __init__(self, opt, loss_scale_manager=None, is_distributed=False, is_loss_scale=False,
                 is_tailing_optimization=False, name=None):
        self._opt = opt
        self._loss_scale_manager = loss_scale_manager
        self._float_status = tf.constant([0.0], dtype=tf.float32)
        self._is_distributed = is_distributed
        self._is_loss_scale = is_loss_scale
        self._is_tailing_optimization = is_tailing_optimization
        self._is_overall_finite = None
        if is_loss_scale and loss_scale_manager is None:
            raise ValueError("is_loss_scale is True, loss_scale_manager can not be None")
        if name is None:
            name = "NPUOptimizer{}".format(type(opt).__name__)
        self._name = name
        super(NPUOptimizer, self).__init__(name=self._name, use_locking=False)

    def compute_gradients(self, loss, var_list=None,
                          gate_gradients=tf.train.Optimizer.GATE_OP,
                          aggregation_method=None, colocate_gradients_with_ops=False,
                          grad_loss=None):
        loss_scale = None
        if self._is_loss_scale:
            loss_scale = self._loss_scale_manager.get_loss_scale()
            loss_value = loss() if callable(loss) else loss
            loss = loss_value * tf.cast(loss_scale, loss_value.dtype.base_dtype)
        gradients = self._opt.compute_gradients(
            loss, var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss)
        if self._is_distributed:
            gradients = self._averaged_gradients(gradients)
        if self._is_loss_scale:
            return self._down_scale(gradients, loss_scale)
        return gradients

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        if not self._is_loss_scale:
            return self._opt.apply_gradients(grads_and_vars, global_step, name)
        grads_and_vars = list(grads_and_vars)
        if not self._is_tailing_optimization:
            self._reduce_all([g for g, _ in grads_and_vars])

        def apply_fn():
            return self._opt.apply_gradients(grads_and_vars, global_step, name)

        update_variables = tf.cond(self._is_overall_finite, apply_fn, _gen_cf_ops.no_op)
        return tf.group(update_variables,
                        self._loss_scale_manager.update_loss_scale(self._is_overall_finite))

    def get_slot(self, *args, **kwargs):
        return self._opt.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._opt.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._opt.variables(*args, **kwargs)

    def _reduce_all(self, grads):
        graph = tf.get_default_graph()
        with graph.control_dependencies([g for g in grads if g is not None]):
            status = gen_npu_ops.npu_get_float_status_v2()
        with graph.control_dependencies([status]):
            cleared = gen_npu_ops.npu_clear_float_status_v2()
        if self._is_distributed:
            summed = hccl_ops.allreduce([status], "sum", fusion=0)
            with graph.control_dependencies([cleared]):
                self._is_overall_finite = tf.reduce_all(tf.equal(summed, 0))
        else:
            with graph.control_dependencies([cleared]):
                no_overflow = tf.equal(0, status)
            self._is_overall_finite = tf.reduce_all(no_overflow)

    def _averaged_gradients(self, gradients):
        averaged = []
        grads = []
        with tf.name_scope(self._name + "_Allreduce"):
            for grad, var in gradients:
                grads.append(grad)
                last = len(grads) == len(gradients)
                if self._is_loss_scale and self._is_tailing_optimization and last:
                    self._reduce_all(grads)
                    with tf.get_default_graph().control_dependencies([self._is_overall_finite]):
                        averaged.append((allreduce(grad, True) if grad is not None else None, var))
                else:
                    averaged.append((allreduce(grad, True) if grad is not None else None, var))
        return averaged

    def _down_scale(self, grads_vars, loss_scale):
        inverse = _gen_math_ops.reciprocal(loss_scale)
        return [(g * tf.cast(inverse, g.dtype.base_dtype), v) if g is not None else (g, v)
                for g, v in grads_vars]


class NPUDistributedOptimizer(tf.train.Optimizer):
    """npu_bridge's gradient-averaging optimizer wrapper (CPU shim)."""

    def __init__(self, optimizer, is_weight_update_sharding=False, name=None):
        if name is None:
            name = "Distributed{}".format(type(optimizer).__name__)
        self._optimizer = optimizer
        self._is_weight_update_sharding = is_weight_update_sharding
        super(NPUDistributedOptimizer, self).__init__(name=name, use_locking=False)

    def compute_gradients(self, *args, **kwargs):
        gradients = self._optimizer.compute_gradients(*args, **kwargs)
        rank_size = util.get_ranksize()
        if rank_size is None or int(rank_size) <= 1:
            return gradients
        if self._is_weight_update_sharding:
            raise NotImplementedError("npu_bridge shim: weight update sharding is not emulated")
        return _average_all(gradients, self._name + "_Allreduce")

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        rank_size = util.get_ranksize()
        if rank_size is not None and int(rank_size) > 1 and self._is_weight_update_sharding:
            raise NotImplementedError("npu_bridge shim: weight update sharding is not emulated")
        return self._optimizer.apply_gradients(grads_and_vars, global_step, name)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def npu_distributed_optimizer_wrapper(optimizer):
    """Patch ``optimizer`` in place so that its gradients are averaged over
    the ranks; returns the same object."""
    if isinstance(optimizer, str):
        raise NotImplementedError("npu_bridge shim: optimizer names (Keras "
                                  "optimizers.get) are not emulated; pass an optimizer")
    rank_size = util.get_ranksize()
    several = rank_size is not None and int(rank_size) > 1

    if hasattr(optimizer, "compute_gradients"):
        original_compute = optimizer.compute_gradients

        def compute_gradients(*args, **kwargs):
            gradients = original_compute(*args, **kwargs)
            if not several:
                return gradients
            return _average_all(gradients, "Npu_Distributed_optimizer_Allreduce")

        setattr(compute_gradients, WRAPPED_MARK, True)
        optimizer.compute_gradients = compute_gradients

    if hasattr(optimizer, "get_gradients"):
        original_get = optimizer.get_gradients

        def get_gradients(*args, **kwargs):
            grads = original_get(*args, **kwargs)
            if not several:
                return grads
            with tf.name_scope("Npu_Distributed_optimizer_get_grads_Allreduce"):
                return [allreduce(g, True) if g is not None else None for g in grads]

        setattr(get_gradients, WRAPPED_MARK, True)
        optimizer.get_gradients = get_gradients

    if hasattr(optimizer, "_compute_gradients"):
        original_private = optimizer._compute_gradients  # pylint: disable=protected-access

        def _compute_gradients(*args, **kwargs):
            gradients = original_private(*args, **kwargs)
            if not several:
                return gradients
            return _average_all(gradients, "Npu_Distributed_optimizer_compute_grads_Allreduce")

        setattr(_compute_gradients, WRAPPED_MARK, True)
        optimizer._compute_gradients = _compute_gradients  # pylint: disable=protected-access
    return optimizer
