"""``LossScaleOptimizer``: the builder's machinery behind the Optimizer API.

A drop-in for npu_bridge's ``NPULossScaleOptimizer`` and contrib's
``LossScaleOptimizer`` in one-optimizer scripts and Estimator ``model_fn``s.
It is not a second implementation: scaling, unscaling, the overflow decision,
the guarded apply and the manager update are the builder's own functions.
"""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import backends as _backends
from npu_lossscale.core import checks as _checks
from npu_lossscale.core import context as _context
from npu_lossscale import distributed as _distributed
from npu_lossscale.core import gradients as _gradients
from npu_lossscale import managers as _managers
from npu_lossscale.core import plan as _plan
from npu_lossscale.core import step as _step
from npu_lossscale import tf_internals as _tf_internals
from npu_lossscale.distributed import sync_replicas as _sync_replicas


#: What makes a cluster's workers decide alike, per ``distributed.Cluster.kind``.
_CLUSTER_ROUTES = {
    "ascend": "Pass is_distributed=True to sum the overflow decision across devices",
    "horovod": "Wrap opt in hvd.DistributedOptimizer, whose averaged gradients every "
               "rank checks alike",
    "tf_config": "Wrap opt in npu_lossscale.SyncReplicasOptimizer (count_skipped_steps=True), "
                 "whose chief decides on the aggregated gradients",
}


#: Why apply_gradients may be called inside a tf.cond: another loss-scale
#: wrapper (contrib's, npu_bridge's) applies inside its own cond.
_WRAPPED_HINT = ("If another loss-scale wrapper (NPULossScaleOptimizer, contrib's "
                 "LossScaleOptimizer) wraps this one, it scales the loss a second time: use "
                 "one of the two wrappers.")


class LossScaleOptimizer(_tf_internals.CheckpointsWrappedState, tf.train.Optimizer):
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
      backend: "auto", "is_finite", "xla", "npu", "float_status" or a
        ``backends.Backend`` instance, as for the builder; "npu" and "auto"
        follow the device's overflow mode at ``apply_gradients``, as
        npu_bridge's ``NPULossScaleOptimizer`` does.
      is_distributed: True sums the overflow decision across Ascend devices
        with HCCL (npu_bridge's ``is_distributed``; gradients are averaged by
        ``NPUDistributedOptimizer`` as usual). False: each worker decides
        alone (asynchronous parameter-server workers). None (default):
        ``apply_gradients`` refuses it when the environment names several
        workers (RANK_SIZE, a Horovod/MPI launcher, a TF_CONFIG cluster),
        since the replicas would drift apart, unless a
        SyncReplicasOptimizer's chief decides or ``opt`` averages its
        gradients across workers (``hvd.DistributedOptimizer``,
        ``NPUDistributedOptimizer``; not on the float-status register).
      gate: "auto", "cond" or "pivot", as for ``MultiOptimizerLossScale``.
      count_skipped_steps: if True, ``apply_gradients`` advances
        ``global_step`` on every step, applied or skipped, as the builder's
        ``build(count_skipped_steps=True)``; if False (default), only on
        applied steps. A ``SyncReplicasOptimizer`` needs True, on
        either side of this wrapper (it hands out its tokens by
        ``global_step``; without it a skipped step would leave every worker
        waiting): ``apply_gradients`` refuses False there.

    Raises:
      TypeError: for a non-TF1 or already-wrapped optimizer, a manager
        without the protocol, or a backend neither a name nor a ``Backend``.
      ValueError: for an unknown backend name, or "npu" without npu_bridge.
    """

    #: The child name under which the release before commit c050077 saved the
    #: wrapped optimizer; such checkpoints still restore.
    previous_child = "base_optimizer"

    def __init__(self, opt, loss_scale_manager, backend="auto", is_distributed=None,
                 gate="auto", count_skipped_steps=False):
        _checks.check_optimizer(opt, argument="opt")
        _checks.check_bool("count_skipped_steps", count_skipped_steps,
                           "Pass True to advance global_step on skipped steps too.")
        self._count_skipped_steps = count_skipped_steps
        _managers.check_manager(loss_scale_manager)
        if is_distributed is not None:
            _checks.check_bool(
                "is_distributed", is_distributed,
                "Pass True to sum the overflow decision across Ascend devices (as "
                "NPULossScaleOptimizer does), False if each device trains alone.")
        _checks.check_gate(gate)
        self._gate = gate
        self._opt = opt
        self._manager = loss_scale_manager
        self._requested_backend = backend
        _backends.resolve_backend(backend, warn=False)  # rejects a bad name now
        self._is_distributed = is_distributed
        self._engine = _distributed.resolve_engine("hccl") if is_distributed else None
        super(LossScaleOptimizer, self).__init__(
            use_locking=False, name="LossScale%s" % opt.get_name())
        # In tf.train.Checkpoint(optimizer=this, ...) this object stands for
        # the optimizer that holds the state: it shares that optimizer's slot,
        # non-slot (e.g. Adam's beta powers) and deferred-restore dicts, which
        # tf.train.Optimizer's checkpoint methods read, and makes no state of
        # its own. Tracking the wrapped optimizer as a child instead would
        # save each slot twice (once per optimizer whose get_slot finds it),
        # which the checkpoint refuses with NotImplementedError. The layout
        # is a plain optimizer's, plus the manager's state. A restore made
        # before the state exists waits in the holder's deferred
        # dependencies (``_deferred_dependencies`` below), which the holder
        # serves when it makes the variable.
        self._holder = _state_holder(opt)
        _tf_internals.share_optimizer_state(self, self._holder)
        for index, variable in enumerate(_managers.manager_variables(loss_scale_manager)):
            self._track_trackable(variable, name="loss_scale_state_%d" % index)

    @property
    def inner_optimizer(self):
        """The wrapped optimizer."""
        return self._opt

    @property
    def loss_scale_manager(self):
        """The loss-scale manager."""
        return self._manager

    def minimize(self, loss, global_step=None, var_list=None,
                 gate_gradients=tf.train.Optimizer.GATE_OP, aggregation_method=None,
                 colocate_gradients_with_ops=False, name=None, grad_loss=None):
        """``tf.compat.v1.train.Optimizer.minimize``, with ``global_step``
        checked before ``compute_gradients`` makes its first op.

        Raises:
          TypeError: if ``global_step`` is not None or an integer variable.
          ValueError: if ``global_step`` is of another graph; as
            ``apply_gradients`` otherwise.
        """
        _checks.check_global_step(global_step)
        return super(LossScaleOptimizer, self).minimize(
            loss, global_step=global_step, var_list=var_list,
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, name=name,
            grad_loss=grad_loss)

    def compute_gradients(self, loss, var_list=None,
                          gate_gradients=tf.train.Optimizer.GATE_OP,
                          aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None):
        """Returns unscaled (gradient, variable) pairs of the scaled loss.

        Same arguments as ``tf.compat.v1.train.Optimizer.compute_gradients``;
        ``loss`` may be a callable taking no argument, as there. Pairs whose
        gradient is None are kept, as the base class does.
        """
        _context.require_graph_mode("LossScaleOptimizer.compute_gradients",
                                   eager_functions=True)
        _distributed.check_no_strategy("LossScaleOptimizer.compute_gradients")
        _managers.check_manager_graph(self._manager)
        if callable(loss) and not isinstance(loss, tf.Tensor):
            loss = loss()
        with tf.name_scope("loss_scale"):
            scale = _gradients.read_scale(self._manager)
            scaled_loss = _gradients.scaled(loss, scale)
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
          global_step: advanced by one when the gradients are applied (on
            every step with ``count_skipped_steps=True``).
          name: name for the wrapped optimizer's apply op.

        Returns:
          An op that applies (or skips) and updates the loss scale. When the
          wrapped optimizer is an ``npu_lossscale.SyncReplicasOptimizer``:
          the worker's op, which pushes its gradients and overflow flag and
          waits for its token; the chief's queue runner decides on the
          aggregate, applies, advances ``global_step`` and updates the scale.

        Raises:
          ValueError: before any op is made: if no gradient is given, inside
            a ``tf.cond``/``tf.while_loop`` body or a graph-mode
            ``tf.function``, for a manager of another graph, or with
            a ``SyncReplicasOptimizer`` on either side without
            ``count_skipped_steps=True`` (or without ``global_step``).
          TypeError: when another loss-scale wrapper calls it (TF's, from
            ``enable_mixed_precision_graph_rewrite``; ``compute_gradients``
            refuses it too), or when the wrapped optimizer is TF's own
            ``tf.train.SyncReplicasOptimizer`` (pass ours).

        Several calls (several ``minimize`` ops, or optimizers sharing one
        manager) are fine when each ``session.run`` fetches one of them, as
        alternating GAN loops do: each run updates the scale once. A run
        that fetches two step ops updating one manager fails with an
        InvalidArgumentError before the second one writes anything.
        """
        _context.require_graph_mode("LossScaleOptimizer.apply_gradients",
                                   eager_functions=True, hint=_WRAPPED_HINT)
        _distributed.check_no_strategy("LossScaleOptimizer.apply_gradients")
        _checks.check_global_step(global_step)
        grads_and_vars = list(grads_and_vars)
        present = [(g, v) for g, v in grads_and_vars if g is not None]
        if not present:
            raise ValueError("apply_gradients() got only None gradients, for %r. Check "
                             "that the loss depends on these variables."
                             % ([v.name for _, v in grads_and_vars],))
        _managers.check_manager_graph(self._manager)
        return self._apply(present, global_step, name)

    def _apply(self, present, global_step, name):
        """``apply_gradients``' step: a one-group plan over the given
        gradients, built by the builder's own pipeline (``step``)."""
        with tf.name_scope(name, "loss_scale_apply") as scope:
            group = _plan.Group(
                name=name or self._opt.get_name(), loss=None, optimizer=self._opt,
                var_list=tuple(var for _, var in present), transforms=(),
                manager=self._manager,
                checked=_managers.overflow_check_enabled(self._manager), own_backprop=False)
            # The backend and the gate are decided here, at apply_gradients,
            # as npu_bridge's NPULossScaleOptimizer decides.
            options = _step.Options(
                backend=_backends.resolve_backend(self._requested_backend), gate=self._gate,
                skip_policy="all",
                engine=_sync_replicas.engine_for([self._opt], self._engine),
                allreduce_gradients=False, accumulation_steps=1,
                count_skipped_steps=self._count_skipped_steps)
            plan = _step.plan_step([group], self._manager, options, global_step,
                                   "LossScaleOptimizer.apply_gradients")
            aggregated = _sync_replicas.aggregated([grad for grad, _ in present])
            if aggregated:
                # SyncReplicasOptimizer(LossScaleOptimizer(...)): this is its chief.
                _sync_replicas.check_chief_apply(plan, options,
                                                 "LossScaleOptimizer.apply_gradients")
            if self._is_distributed is None:
                _distributed.check_cluster(
                    "LossScaleOptimizer.apply_gradients", plan, _CLUSTER_ROUTES,
                    "is_distributed=False",
                    aggregated=aggregated or not plan.reduction.applies_here,
                    given=present)
            step = _step.build_step(
                plan, "LossScaleOptimizer %s, step %s" % (self.get_name(), scope.rstrip("/")),
                global_step, given=present)
            if plan.backend.reads_register and plan.checks:
                _backends.claim_register(self, "LossScaleOptimizer %r" % self.get_name())
            return step.update_op

    def get_slot(self, var, name):
        return self._opt.get_slot(var, name)

    def get_slot_names(self):
        return self._opt.get_slot_names()

    def variables(self):
        return self._opt.variables()


def _state_holder(opt):
    """The optimizer whose slot and non-slot dicts hold ``opt``'s state.

    ``opt`` itself, unless it overrides ``get_slot`` to forward to an
    optimizer it wraps (as npu_bridge's ``NPUDistributedOptimizer`` does,
    in ``_optimizer``): then that one's holder.
    """
    while type(opt).get_slot is not tf.train.Optimizer.get_slot:
        inner = _tf_internals.wrapped_optimizer(opt)
        if not isinstance(inner, tf.train.Optimizer):
            break
        opt = inner
    return opt


# TF's enable_mixed_precision_graph_rewrite(LossScaleOptimizer(...)) would
# scale the loss a second time, and apply in its own cond: it refuses at the
# wrap itself.
_tf_internals.refuse_graph_rewrite_wrapping(LossScaleOptimizer, TypeError(
    "enable_mixed_precision_graph_rewrite got a LossScaleOptimizer, which TF's "
    "MixedPrecisionLossScaleOptimizer would wrap and scale again. Pass it the plain "
    "optimizer and turn the rewrite on in the session config, or use LossScaleOptimizer "
    "alone (docs/features.md, 'Graph-rewrite mixed precision')."))
