"""Parameter servers with ``tf.train.SyncReplicasOptimizer``: the workers
push, the chief decides.

Each take of the chief's accumulators advances their step, and a push with
an older token is dropped, so ``global_step`` must advance on every
aggregated step, skipped or not (``count_skipped_steps=True``); otherwise
every worker waits forever (docs/design.md, "Data parallelism").

* ``SyncReplicasOptimizer(LossScaleOptimizer(opt, ...))``: the wrapper's
  ``apply_gradients`` runs on the chief with the aggregate (``aggregated``,
  ``check_chief_apply``).
* ``LossScaleOptimizer(SyncReplicasOptimizer(opt), ...)`` and a builder
  group with one, where ``SyncReplicasOptimizer`` is this module's
  (``SyncReplicasEngine``): the worker pushes its unscaled gradients, its
  overflow flag and each skip condition's flag, never gated (the chief
  would wait for a held-back push); the chief decides on the mean flags and
  the aggregate, applies, advances ``global_step`` and updates the manager
  in its sync op, holding the scale on a condition's skip as the worker's
  step would. The chief's apply
  is the ``ChiefApply`` this ``SyncReplicasOptimizer`` is constructed
  around, so nothing in TF's object is replaced while the step builds.

The manager lives with the model on the parameter servers: the workers read
its scale, the chief updates it.

This route is an entry point of its own, not a plug-in: the chief's sync op
is a second step, made with the core's ``make_plan`` and ``close`` (the
pieces ``plugin_helpers`` names for it), so ``SyncReplicasEngine.close`` is
handed the core's plan and closing records and returns its ``Closed``
(docs/design.md, "Data parallelism").
"""

from __future__ import absolute_import, division, print_function

import collections
import contextlib

import tensorflow.compat.v1 as tf

from npu_lossscale import backends as _backends
from npu_lossscale import seams as _seams
from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale import managers as _managers

#: The count a step with a SyncReplicasOptimizer needs, in the messages.
_ROUTE = "count_skipped_steps=True"


def is_sync_replicas(optimizer):
    """Whether ``optimizer`` is a ``tf.train.SyncReplicasOptimizer`` (TF's or
    this module's)."""
    return isinstance(optimizer, tf.train.SyncReplicasOptimizer)


def engine_for(optimizers, requested):
    """The engine of a step over ``optimizers``: a ``SyncReplicasEngine``
    when one of them is a ``SyncReplicasOptimizer`` (which refuses a
    ``requested`` engine beside it), else ``requested``."""
    if any(is_sync_replicas(optimizer) for optimizer in optimizers):
        return SyncReplicasEngine(requested)
    return requested


def aggregated(grads):
    """Whether any of ``grads`` is taken from a ``ConditionalAccumulator``
    (a ``SyncReplicasOptimizer``'s aggregate, applied on its chief)."""
    for grad in grads:
        op = _helpers.dense_values(grad).op
        while op.type == "Identity":
            op = op.inputs[0].op
        if op.type in _helpers.ACCUMULATOR_TAKE_TYPES:
            return True
    return False


def _check_plan(plan, options, global_step, api):
    """Refuses a step with a SyncReplicasOptimizer group that cannot work
    (``plan``, a ``seams.PlanView``; ``api`` names the public call in
    messages).

    Raises:
      ValueError: for such a group beside others, with accumulation, with a
        ``distributed`` engine, without ``global_step`` or
        ``count_skipped_steps=True``, or with manager state away from
        ``global_step``'s job.
      TypeError: for TF's own class (not this module's), or when it wraps
        a loss-scale wrapper.
    """
    group = [g for g in plan.groups if is_sync_replicas(g.optimizer)][0]
    if not isinstance(group.optimizer, SyncReplicasOptimizer):
        raise TypeError(
            "%s: group %r's optimizer is tf.train.SyncReplicasOptimizer %r, whose chief "
            "the step cannot reach. Construct npu_lossscale.SyncReplicasOptimizer in its "
            "place (same arguments), or use tf.train.SyncReplicasOptimizer("
            "LossScaleOptimizer(opt, ...))."
            % (api, group.name, group.optimizer.get_name()))
    if len(plan.groups) > 1:
        raise ValueError(
            "%s: group %r's SyncReplicasOptimizer must be the only group, got %d groups: "
            "its chief decides for its own variables alone, and TF supports one "
            "SyncReplicasOptimizer per graph (tensorflow#11071). Use distributed='horovod' "
            "or 'hccl' for several optimizers." % (api, group.name, len(plan.groups)))
    if options.accumulation_steps > 1:
        raise ValueError(
            "%s: accumulation_steps=%r with a SyncReplicasOptimizer; it aggregates "
            "replicas_to_aggregate pushes itself. Pass accumulation_steps=1."
            % (api, options.accumulation_steps))
    if options.engine.requested is not None:
        raise ValueError(
            "%s: distributed=%r with a SyncReplicasOptimizer, which aggregates on the "
            "parameter servers already. Leave distributed unset."
            % (api, options.engine.requested.name))
    if global_step is None:
        raise ValueError(
            "%s: a SyncReplicasOptimizer needs global_step, got None. Pass "
            "global_step=tf.train.get_or_create_global_step()." % (api,))
    if not options.count_skipped_steps:
        raise ValueError(
            "%s: count_skipped_steps=False with a SyncReplicasOptimizer, whose tokens "
            "follow global_step: a skipped step would leave every worker waiting "
            "forever. Pass %s." % (api, _ROUTE))
    _helpers.check_optimizer(group.optimizer.chief.optimizer,
                             argument="the optimizer the SyncReplicasOptimizer wraps")
    _check_beside(group.manager, global_step, api)


def check_chief_apply(plan, options, api):
    """Refuses a chief apply of aggregated gradients that cannot work
    (``SyncReplicasOptimizer(LossScaleOptimizer(...))``).

    Raises:
      ValueError: without ``count_skipped_steps=True``, or with a backend
        that reads the float-status register, which on the chief does not
        see the workers' overflows.
    """
    if not options.count_skipped_steps:
        raise ValueError(
            "%s got a SyncReplicasOptimizer's aggregated gradients with "
            "count_skipped_steps=False: a skipped step would not advance global_step, "
            "whose tokens every worker waits for. Pass %s." % (api, _ROUTE))
    if plan.backend.reads_register and plan.checks:
        raise ValueError(
            "%s got a SyncReplicasOptimizer's aggregated gradients with backend %r, "
            "whose float-status register on the chief cannot see the workers' overflows. "
            "Wrap the other way round, LossScaleOptimizer(SyncReplicasOptimizer(opt)), "
            "which pushes each worker's check." % (api, plan.backend.name))


def _check_beside(manager, global_step, api):
    """Refuses manager state on another job than ``global_step``'s."""
    job = tf.DeviceSpec.from_string(global_step.device or "").job
    if not job:
        return
    for variable in _managers.manager_variables(manager):
        if tf.DeviceSpec.from_string(variable.device or "").job != job:
            raise ValueError(
                "%s: the manager's variable %r is on %r, not on job %r beside "
                "global_step: the chief would update a scale the workers do not read. "
                "Create the manager inside the model's replica_device_setter scope."
                % (api, variable.op.name, variable.device, job))


class _FlagSlot(collections.namedtuple("_FlagSlot", ["name", "device", "shape"])):
    """What SyncReplicasOptimizer reads of a variable to make an accumulator
    (its name, device and shape), for the pushed overflow flag, which
    updates no variable."""

    def get_shape(self):
        return self.shape


class _AggregateCheck(_backends.Backend):
    """The chief's check: the aggregated gradients, plus the mean of the
    workers' pushed flags."""

    name = "is_finite"
    gives_evidence = True

    def __init__(self, pushed):
        self._pushed = pushed

    def overflow_flag(self, tensors, after=()):
        flag = _backends.IsFiniteBackend().overflow_flag(tensors, after)
        if self._pushed is None:
            return flag
        return flag + tf.reshape(tf.cast(self._pushed, tf.float32), [])


class _ChiefDecision(collections.namedtuple(
        "_ChiefDecision", ["plan", "group", "slot", "condition_slots", "skipped_steps", "scope",
                           "observers"])):
    """What the chief's apply needs of the worker's step: its ``plan``, the
    ``group`` (whose ``optimizer`` is the wrapped one), the pushed overflow
    flag's ``slot`` (or None), one slot per skip condition of the plan
    (``condition_slots``, in its order), ``skipped_steps``, the name
    ``scope`` and the step's ``observers``."""


class _PushedCondition(_seams.SkipCondition):
    """A worker's skip condition as the chief sees it: its flag is the
    aggregate of the workers' pushed flags (given to the chief's close, so
    ``flag`` is never called), and it keeps the worker condition's name,
    reason, fix and ``moves_scale``, so that the chief records a skip for
    its reason and holds the scale as the worker's step would. Its
    ``on_apply`` adds nothing on the chief."""

    def __init__(self, condition):
        self.name = condition.name
        self.reason = condition.reason
        self.fix = condition.fix
        self.moves_scale = condition.moves_scale

    def flag(self, state):
        raise AssertionError("the chief takes the pushed flags")


class ChiefApply(tf.train.Optimizer):
    """The optimizer a ``SyncReplicasOptimizer`` applies its aggregate
    through: ``optimizer``, behind the step's decision while a step builds
    (``deciding``), and plainly otherwise (so that
    ``SyncReplicasOptimizer(LossScaleOptimizer(opt, ...))`` applies through
    the wrapper, as TF's class does).

    Args:
      optimizer: the ``tf.train.Optimizer`` that applies the aggregate.
    """

    def __init__(self, optimizer):
        super(ChiefApply, self).__init__(use_locking=False, name="ChiefApply")
        self._opt = optimizer
        self._decision = None

    @property
    def optimizer(self):
        """The wrapped optimizer."""
        return self._opt

    @contextlib.contextmanager
    def deciding(self, decision):
        """Applies through the step's ``decision`` (a ``_ChiefDecision``)
        while inside."""
        self._decision = decision
        try:
            yield
        finally:
            self._decision = None

    def compute_gradients(self, *args, **kwargs):
        return self._opt.compute_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._opt.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._opt.get_slot_names(*args, **kwargs)

    def variables(self):
        return self._opt.variables()

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The chief's sync op: decide on the aggregate, apply, count and
        update the scale (inside ``deciding``); else ``optimizer``'s apply."""
        decision = self._decision
        if decision is None:
            return self._opt.apply_gradients(grads_and_vars, global_step=global_step,
                                             name=name)
        pairs = list(grads_and_vars)
        slots = [decision.slot] + list(decision.condition_slots)
        pushed = dict((id(var), grad) for grad, var in pairs
                      if any(var is slot for slot in slots))
        pairs = [(grad, var) for grad, var in pairs
                 if id(var) not in pushed and grad is not None]
        group = decision.group._replace(loss=None, own_backprop=False,
                                        var_list=tuple(var for _, var in pairs))
        chief = _helpers.make_plan(
            [group], group.manager, _AggregateCheck(pushed.get(id(decision.slot))),
            count_skipped_steps=True, gate_kind=decision.plan.gate_kind,
            conditions=[_PushedCondition(item.condition) for item in decision.plan.conditions])
        grads = collections.OrderedDict([(group.name, pairs)])
        with tf.name_scope(decision.scope):
            flags = _helpers.overflow_flags(chief, grads, _helpers.Packing([]), after=())
            for item, slot in zip(chief.conditions, decision.condition_slots):
                # The workers' mean: not 0 when any of them skipped.
                flags[item.name] = tf.cast(tf.not_equal(
                    tf.reshape(tf.cast(pushed[id(slot)], tf.float32), []), 0.0), tf.float32)
            closed = _helpers.close_step(chief, _helpers.Closing(flags, grads, [], 1),
                                         global_step, decision.skipped_steps,
                                         observers=decision.observers)
        return closed.applied.op


class SyncReplicasOptimizer(tf.train.SyncReplicasOptimizer):
    """``tf.train.SyncReplicasOptimizer`` whose chief decides the skip of
    the loss-scaled step it is given to.

    Construct it where a script constructs ``tf.train.SyncReplicasOptimizer``,
    with the same arguments, then pass it to
    ``MultiOptimizerLossScale.add`` or wrap it in ``LossScaleOptimizer``.
    Each worker pushes its unscaled gradients and its overflow flag; the
    chief checks the aggregate and the flags, applies through ``opt`` or
    skips, and advances ``global_step`` either way. It is TF's class in all
    else: ``make_session_run_hook``, ``get_init_tokens_op``, slots.

    Args:
      opt: the ``tf.train.Optimizer`` that applies the aggregated gradients.
      replicas_to_aggregate, total_num_replicas, variable_averages,
        variables_to_average, use_locking, name: as for
        ``tf.train.SyncReplicasOptimizer``.

    Raises:
      ValueError: when ``opt`` is a ``SyncReplicasOptimizer`` (it would
        aggregate twice and hand out two sets of tokens).
    """

    def __init__(self, opt, replicas_to_aggregate, total_num_replicas=None,
                 variable_averages=None, variables_to_average=None, use_locking=False,
                 name="sync_replicas"):
        if is_sync_replicas(opt):
            raise ValueError(
                "SyncReplicasOptimizer: opt is another SyncReplicasOptimizer (%r), which "
                "would aggregate twice and hand out two sets of tokens. Wrap the plain "
                "optimizer in one SyncReplicasOptimizer." % (opt.get_name(),))
        #: The ``ChiefApply`` the aggregate is applied through.
        self.chief = ChiefApply(opt)
        super(SyncReplicasOptimizer, self).__init__(
            self.chief, replicas_to_aggregate, total_num_replicas=total_num_replicas,
            variable_averages=variable_averages, variables_to_average=variables_to_average,
            use_locking=use_locking, name=name)


def _close_worker(plan, closing, global_step, skipped_steps=None, observers=()):
    """The close of a worker's step: it pushes its gradients and summed flag,
    ungated, and waits for its token; the chief's apply, built here too,
    decides on the aggregate (``ChiefApply``), counts ``skipped_steps`` and
    runs the step's ``observers`` in its skip branch.

    Returns:
      A ``close.Closed`` whose ``applied`` is this worker's own decision,
      after its push.
    """
    group = plan.groups[0]
    pairs = list(closing.grads[group.name])
    graph = tf.get_default_graph()
    scope = graph.get_name_scope()
    pushes = list(pairs)

    def pushed(flag, name):
        """Pushes ``flag`` through a slot of its own; returns the slot."""
        slot = _FlagSlot(graph.unique_name((scope + "/" if scope else "") + name,
                                           mark_as_used=True) + ":0",
                         global_step.device, tf.TensorShape([]))
        pushes.append((flag, slot))
        return slot

    # The checks' flags in one push, each skip condition's in its own: the
    # chief tells an overflow (which moves the scale) from a condition's
    # skip (which may hold it).
    checks = [closing.flags[item.name] for item in plan.checks]
    slot = (pushed(tf.add_n(checks, name="pushed_overflow_flag"), "overflow_flag")
            if checks else None)
    condition_slots = tuple(pushed(closing.flags[item.name], item.name + "_flag")
                            for item in plan.conditions)
    chief = group.optimizer.chief
    decision = _ChiefDecision(plan, group._replace(optimizer=chief.optimizer), slot,
                              condition_slots, skipped_steps,
                              (scope + "/" if scope else "") + "sync_chief", tuple(observers))
    with chief.deciding(decision):
        pushed = group.optimizer.apply_gradients(pushes, global_step=global_step)
    decisions = _helpers.Decisions(closing.flags, [g for g, _ in pairs])
    with tf.control_dependencies([pushed]):
        applied = tf.identity(decisions.all_of([item.name for item in plan.checks]),
                              name="pushed")
    grads = collections.OrderedDict([(group.name, pairs)])
    return _helpers.Closed(applied, decisions, grads)


def check_builder_options(plan, update_ops, per_group_ops):
    """Raises ValueError for ``update_ops`` (the chief decides the skip, after
    this worker's run) or ``per_group_ops`` with a SyncReplicasOptimizer."""
    if _seams.applies_here(plan.engine):
        return
    if any(update_ops.values()):
        raise ValueError(
            "build: update_ops with a SyncReplicasOptimizer group cannot be gated, since "
            "the chief decides the skip after the workers' runs. Run them yourself, or "
            "use distributed='horovod'.")
    if per_group_ops:
        raise ValueError(
            "build: per_group_ops=True with a SyncReplicasOptimizer group, which is the "
            "only group. Pass per_group_ops=False.")


class SyncReplicasEngine(_seams.ReductionEngine):
    """The workers push to a ``SyncReplicasOptimizer``'s chief, which
    decides on the aggregate."""

    name = "sync_replicas"
    mode = "chief"

    def __init__(self, requested=None):
        #: The engine the caller asked for beside it (refused), or None.
        self.requested = requested

    def check_plan(self, plan, options, global_step, api):
        _check_plan(plan, options, global_step, api)

    def close(self, plan, closing, global_step, skipped_steps, observers=()):
        return _close_worker(plan, closing, global_step, skipped_steps, observers)
