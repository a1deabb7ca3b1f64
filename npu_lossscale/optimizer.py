"""``LossScaleOptimizer``: the builder's machinery behind the Optimizer API.

A drop-in for npu_bridge's ``NPULossScaleOptimizer`` and contrib's
``LossScaleOptimizer`` in one-optimizer scripts and Estimator ``model_fn``s.
It is not a second implementation: scaling, unscaling, the overflow decision,
the guarded apply and the manager update are the builder's own functions.
"""

from __future__ import absolute_import, division, print_function

import os

import tensorflow.compat.v1 as tf

from npu_lossscale import _validation
from npu_lossscale import backends as _backends
from npu_lossscale import commit as _commit
from npu_lossscale import distributed as _distributed
from npu_lossscale import gradients as _gradients
from npu_lossscale import inputs as _inputs
from npu_lossscale import manager_update as _manager_update
from npu_lossscale import overflow as _overflow
from npu_lossscale import plan as _plan


class LossScaleOptimizer(tf.train.Optimizer):
    """Wraps one TF1 optimizer with loss scaling and overflow skipping.

    ``compute_gradients`` scales the loss and returns unscaled gradients.
    ``apply_gradients`` checks the gradients it is given (one float-status
    read on the npu backend), applies them behind a gate only when finite,
    advances ``global_step`` only then, and updates the loss scale. Each method
    stands on its own: nothing computed in one is read by the other.

    Example::

      opt = LossScaleOptimizer(tf.train.AdamOptimizer(1e-3),
                               DynamicLossScaleManager())
      train_op = opt.minimize(loss, global_step=tf.train.get_global_step())

    For several optimizers in one ``session.run`` use
    ``MultiOptimizerLossScale`` instead: one wrapper per optimizer means one
    skip decision per optimizer.

    Args:
      opt: the ``tf.compat.v1.train.Optimizer`` to wrap.
      loss_scale_manager: any object with ``get_loss_scale()`` and
        ``update_loss_scale(finite)``.
      backend: "auto", "is_finite", "npu" or "float_status", as for the
        builder; "npu" and "auto" follow the device's overflow mode at
        ``apply_gradients``, as npu_bridge's ``NPULossScaleOptimizer`` does.
      is_distributed: True sums the overflow decision across Ascend devices
        with HCCL (npu_bridge's ``is_distributed``; gradients are averaged by
        ``NPUDistributedOptimizer`` as usual). False: each device decides
        alone. None (default): an error when RANK_SIZE/CM_WORKER_SIZE names
        more than one device, since the replicas would drift apart.
      gate: "auto", "cond" or "pivot", as for ``MultiOptimizerLossScale``.

    Raises:
      TypeError: for a non-TF1 or already-wrapped optimizer, or a manager
        without the protocol.
      ValueError: for an unknown backend, or "npu" without npu_bridge.
    """

    def __init__(self, opt, loss_scale_manager, backend="auto", is_distributed=None,
                 gate="auto"):
        _inputs.check_optimizer(opt, argument="opt")
        _inputs.check_manager(loss_scale_manager)
        if is_distributed is not None:
            _validation.check_bool(
                "is_distributed", is_distributed,
                "Pass True to sum the overflow decision across Ascend devices (as "
                "NPULossScaleOptimizer does), False if each device trains alone.")
        _plan.check_gate(gate)
        self._gate = gate
        self._opt = opt
        self._manager = loss_scale_manager
        self._requested_backend = backend
        _backends.resolve_backend(backend)  # rejects a bad name now
        self._is_distributed = is_distributed
        if is_distributed:
            self._engine = _distributed.resolve_engine("hccl")
        else:
            self._engine = None
            if is_distributed is None:
                _distributed.check_single_worker("LossScaleOptimizer", "is_distributed=True",
                                                 "is_distributed=False")
        super(LossScaleOptimizer, self).__init__(
            use_locking=False, name="LossScale%s" % opt.get_name())
        # tf.train.Checkpoint(optimizer=this) saves the wrapped optimizer and
        # the manager's state, as the name-based Saver does.
        self._track_trackable(opt, name="base_optimizer")
        for index, variable in enumerate(_manager_variables(loss_scale_manager)):
            self._track_trackable(variable, name="loss_scale_state_%d" % index)

    @property
    def inner_optimizer(self):
        """The wrapped optimizer."""
        return self._opt

    @property
    def loss_scale_manager(self):
        """The loss-scale manager."""
        return self._manager

    def compute_gradients(self, loss, var_list=None,
                          gate_gradients=tf.train.Optimizer.GATE_OP,
                          aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None):
        """Returns unscaled (gradient, variable) pairs of the scaled loss.

        Same arguments as ``tf.compat.v1.train.Optimizer.compute_gradients``;
        ``loss`` may be a callable taking no argument, as there. Pairs whose
        gradient is None are kept, as the base class does.
        """
        _inputs.require_graph_mode("LossScaleOptimizer.compute_gradients")
        if callable(loss) and not isinstance(loss, tf.Tensor):
            loss = loss()
        with tf.name_scope("loss_scale"):
            scale = _gradients.read_scale(self._manager)
            scaled_loss = _gradients.scale_loss(loss, scale.value)
        grads_and_vars = self._opt.compute_gradients(
            scaled_loss, var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            grad_loss=grad_loss)
        present = [(g, v) for g, v in grads_and_vars if g is not None]
        unscaled = iter(_gradients.unscale(present, scale))
        return [next(unscaled) if g is not None else (g, v) for g, v in grads_and_vars]

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Applies the gradients if all are finite, then updates the scale.

        Args:
          grads_and_vars: (gradient, variable) pairs, as from
            ``compute_gradients``; None gradients are left out.
          global_step: advanced by one only when the gradients are applied.
          name: name for the wrapped optimizer's apply op.

        Returns:
          An op that applies (or skips) and updates the loss scale.

        Raises:
          ValueError: if no gradient is given, or for a float-status read
            built inside a ``tf.cond``/``tf.while_loop`` body or a
            ``tf.function``.
        """
        _inputs.require_graph_mode("LossScaleOptimizer.apply_gradients")
        _inputs.check_global_step(global_step)
        present = [(g, v) for g, v in grads_and_vars if g is not None]
        if not present:
            raise ValueError(
                "apply_gradients() got no gradients (all None) for variables %r. "
                "Check that the loss depends on the variables."
                % ([v.name for _, v in grads_and_vars],))
        with tf.name_scope(name, "loss_scale_apply"):
            grads = [g for g, _ in present]
            flags = {}
            # Decided here, as npu_bridge's NPULossScaleOptimizer does.
            backend = _backends.resolve_backend(self._requested_backend)
            if backend.reads_register and _overflow.overflow_check_enabled(self._manager):
                _inputs.require_top_level("LossScaleOptimizer.apply_gradients")
            kind = _plan.choose_gate(self._gate, backend.on_npu,
                                     os.environ.get("ENABLE_FORCE_V2_CONTROL") == "1",
                                     tf.control_flow_v2_enabled())
            if kind == "cond" and tf.control_flow_v2_enabled():
                _inputs.check_resource_variables([v for _, v in present], self.get_name())
            if _overflow.overflow_check_enabled(self._manager):
                if backend.reads_register:
                    _backends.claim_register(self,
                                             "LossScaleOptimizer %r" % self.get_name())
                flags["gradients"] = backend.overflow_flag(grads)
                if self._engine is not None:
                    with tf.name_scope("reduce_overflow_flags"):
                        flags["gradients"] = self._engine.sum(flags["gradients"])
            is_finite = _overflow.Decisions(flags, grads).all_of(list(flags))
            applied = _commit.guarded_apply(
                is_finite, [_commit.Apply(name or self._opt.get_name(), self._opt, present,
                                          None)],
                global_step, kind=kind)
            deps = [applied] + [_gradients.dense_values(g) for g in grads]
            update = _manager_update.update_manager(self._manager, is_finite, deps)
            return tf.group(applied.op, update)

    def get_slot(self, var, name):
        return self._opt.get_slot(var, name)

    def get_slot_names(self):
        return self._opt.get_slot_names()

    def variables(self):
        return self._opt.variables()


def _manager_variables(manager):
    """The variables holding a manager's state (ours, npu_bridge's, contrib's)."""
    declared = getattr(manager, "variables", None)
    if declared is not None and not callable(declared):
        return list(declared)
    return [value for _, value in sorted(vars(manager).items())
            if _inputs.is_variable(value)]
