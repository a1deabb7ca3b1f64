"""The step, top-down: the one pipeline both public APIs build.

``MultiOptimizerLossScale.build`` runs it once for the joint step (and once
per group with ``per_group_ops``); ``LossScaleOptimizer.apply_gradients``
runs it on a one-group plan over the gradients it is given. Each phase is a
module, called in order; none calls back:

0. ``plan_step``: the checks that need TF or the environment (backend, gate,
   resource variables, losses that reach their variables), then
   ``plan.make_plan``; no op made;
1. ``gradients``: each scale read once, the scaled losses, one backprop per
   distinct loss and replica, unscaled;
2. ``overflow``: one flag per check (with per-group reads of the
   float-status register, each group's backprop follows the previous read),
   then one per skip condition;
3. ``window`` (with accumulation): the run adds its micro-batch; the run that
   closes the window closes the step with the window's sums and flags;
4. ``close``: reduce across replicas, transform, decide, update the
   managers, commit (the gate and the counters);
5. ``claims``: the state the step moves is claimed per run, when another
   step op moves it too.

What the step does beyond that plugs into the four seams (``seams``): the
groups' gradient transforms, the plan's skip conditions and reduction
engine, and the observers handed to ``build_step``. A user hook that can
fail (a manager's ``get_loss_scale``, ``update_loss_scale``) is called
before the step makes any state, so a failed build leaves nothing behind.
"""

from __future__ import absolute_import, division, print_function

import collections
import os

import tensorflow.compat.v1 as tf

from npu_lossscale import manager_protocol as _manager_protocol
from npu_lossscale import seams as _seams
from npu_lossscale.core import checks as _checks
from npu_lossscale.core import claims as _claims
from npu_lossscale.core import close as _close
from npu_lossscale.core.close import Decisions
from npu_lossscale.core import context as _context
from npu_lossscale.core import gradients as _gradients
from npu_lossscale.core import graph_state as _graph_state
from npu_lossscale.core import graph_walk as _graph_walk
from npu_lossscale.core import hooks as _hooks
from npu_lossscale.core import overflow as _overflow
from npu_lossscale.core import plan as _plan
from npu_lossscale.core import scales as _scales
from npu_lossscale.core import window as _window


class Options(collections.namedtuple(
        "Options", ["backend", "gate", "skip_policy", "engine", "allreduce_gradients",
                    "accumulation_steps", "count_skipped_steps", "conditions"])):
    """A step's options, as the public API took (and checked) them.

    Attributes:
      backend: the ``backend_protocol.Backend`` the step checks with (the
        caller resolves a name: ``backends.resolve_backend``).
      gate: "auto", "pivot" or "cond".
      skip_policy: "all" or "per_group".
      engine: the ``seams.ReductionEngine``, or None for one worker.
      allreduce_gradients: whether the engine averages the gradients.
      accumulation_steps: micro-batches per applied step.
      count_skipped_steps: whether ``global_step`` advances on skipped steps.
      conditions: the ``seams.SkipCondition``s after the overflow check.
    """

    def __new__(cls, backend, gate, skip_policy, engine, allreduce_gradients,
                accumulation_steps, count_skipped_steps, conditions=()):
        return super(Options, cls).__new__(cls, backend, gate, skip_policy, engine,
                                           allreduce_gradients, accumulation_steps,
                                           count_skipped_steps, tuple(conditions))


class Step(collections.namedtuple(
        "Step", ["update_op", "is_finite", "applied", "window_end", "group_is_finite",
                 "grads_and_vars", "loss_scale", "loss_scales", "accumulate_op",
                 "reports"])):
    """What ``build_step`` made (``TrainOps`` documents each field);
    ``reports`` holds each observer's ``report``, in their order."""


def plan_step(groups, manager, options, global_step, api):
    """The plan of a step, after every check that needs TF; no op made.

    The gate is decided here, when the step is built (the backend just
    before, by the caller), as npu_bridge's ``NPULossScaleOptimizer``
    decides at ``apply_gradients``.

    Args:
      groups: the ``plan.Group`` records.
      manager: the default manager (read first; updated if a group uses it).
      options: the step's ``Options``.
      global_step: an integer variable, or None.
      api: the public name being built, for messages.

    Returns:
      A ``plan.Plan``.

    Raises:
      ValueError: for a register read outside the top level, ref variables
        under a functional ``If``, a loss that reaches none of its
        variables, a plan rule, or a plan the engine cannot run
        (``seams.ReductionEngine.check_plan``).
    """
    backend = options.backend
    if backend.reads_register and any(group.checked for group in groups):
        _context.require_top_level(api)
    cf_v2 = tf.control_flow_v2_enabled()
    gate_kind = _plan.choose_gate(options.gate, backend.on_npu,
                                  os.environ.get("ENABLE_FORCE_V2_CONTROL") == "1", cf_v2)
    plan = _plan.make_plan(
        groups, manager, backend, skip_policy=options.skip_policy, engine=options.engine,
        allreduce_gradients=options.allreduce_gradients,
        accumulation_steps=options.accumulation_steps,
        count_skipped_steps=options.count_skipped_steps, gate_kind=gate_kind,
        conditions=options.conditions)
    plan.reduction.engine.check_plan(_hooks.plan_view(plan), options, global_step, api)
    for group in plan.groups:
        if group.loss is not None:
            _hooks.replica_losses(plan.reduction.engine, group)  # refused before any op
    # Applies inside a functional If (the cond gate, or the accumulation
    # window's cond) cannot assign ref variables.
    if cf_v2 and (gate_kind == "cond" or plan.window.steps > 1):
        for group in plan.groups:
            _checks.check_resource_variables(group.var_list, group.name)
        if global_step is not None:
            _checks.check_resource_variables([global_step], "global_step")
    for group in plan.groups:
        if group.loss is not None and _graph_walk.first_reached(
                [group.loss.op], _differentiable_parents, _variable_ops(group.var_list)) is None:
            raise ValueError(
                "group %r: its loss %r depends on none of its %d variables. Check its "
                "var_list." % (group.name, group.loss, len(group.var_list)))
    return plan


def build_step(plan, description, global_step, skipped_steps=None, update_ops=(),
               counters=None, given=None, observers=(), substep=False):
    """Builds one step op of ``plan``, phase after phase.

    Args:
      plan: the ``plan.Plan`` (``plan_step``).
      description: what the step op is, for run-time messages (e.g.
        "update_op of MultiOptimizerLossScale (groups d, g)").
      global_step: an integer variable, or None.
      skipped_steps: the ``commit.SkippedSteps`` counter, or None.
      update_ops: ops that run only when every group applies (or
        ``commit.Copies`` of them).
      counters: a ``claims.StateKey`` for the caller's own per-step state
        (a builder's counters and window), claimed with the managers; None
        for none.
      given: for a one-group plan, the group's unscaled (gradient, variable)
        pairs, checked and applied as they are (no scale, no backprop).
      observers: the ``seams.StepObserver``s of the step.
      substep: whether the step is a sub-step of a sequence
        (``build(sequence=...)``): it reads ``global_step`` (its skip
        conditions and record do) but leaves its increment, and the claim of
        the state it moves (``moved_state``), to the sequence, which does
        each once for all its sub-steps.

    Returns:
      A ``Step``.
    """
    with _graph_state.building():
        return _build_step(plan, description, global_step, skipped_steps, update_ops,
                           counters, given, observers, substep)


def _build_step(plan, description, global_step, skipped_steps, update_ops, counters, given,
                observers, substep):
    """``build_step``, inside ``graph_state.building``."""
    state = _hooks.step_state(plan, global_step)
    if substep:
        global_step = None  # the sequence advances it, once
    before_read = [_hooks.hooked(observer, "before_scale_read", state) for observer in observers]
    scales = collections.OrderedDict()
    if given is None:
        scales = _scales.read_scales(plan, after=[op for hooked in before_read
                                                  for op in hooked.ops])
    computed = _gradients_and_flags(plan, scales, given)
    state = _hooks.with_scales(state, plan, scales)._replace(scaled=computed.scaled,
                                                             grads=computed.seen)
    flags = collections.OrderedDict(computed.flags)
    flags.update(_overflow.condition_flags(plan, state))
    state = state._replace(flags=flags)
    heard = [_hooks.hooked(observer, "before_update", state) for observer in observers]
    after = [scale.value for scale in scales.values()] + [op for hooked in heard
                                                          for op in hooked.ops]
    grads = computed.grads
    window_end = None
    accumulate_op = None
    entry_ops = None  # None: the decisions are the ops every write follows
    close = plan.reduction.engine.wrap_close(_close.close)
    if plan.window.steps == 1:
        closed = close(plan, _close.Closing(flags, grads, after, 1), global_step,
                       skipped_steps, update_ops, observers, state)
        applied, decisions = closed.applied, closed.decisions
        seen = closed.state if closed.state is not None else state
    else:
        opened = _window.open_window(plan, grads, flags)
        accumulate_op = opened.accumulate_op
        if plan.window.closed_by_update_op:
            sums, entry = _window.close_by_update_op(plan, opened, grads)
            closed = close(plan, _close.Closing(sums.flags, sums.grads, after, sums.steps,
                                                sums.loss_flags),
                           global_step, skipped_steps, update_ops, observers, state)
            applied = _window.finish(opened, closed)
            decisions, entry_ops = closed.decisions, [entry]
            seen = closed.state
        else:
            this_run = _window.add_this_run(plan, opened, grads, after)

            def at_window_end():
                sums = _window.sums_at_window_end(plan, opened, this_run, grads)
                return _window.finish(opened, close(
                    plan, _close.Closing(sums.flags, sums.grads, [], sums.steps,
                                         sums.loss_flags),
                    global_step, skipped_steps, update_ops, observers, state))

            applied = tf.cond(this_run.window_end, at_window_end,
                              lambda: _window.advance(opened), name="window")
            window_end = this_run.window_end
            # This run's own decision, as without accumulation.
            decisions = _close.Decisions(flags, [g for pairs in grads.values()
                                                 for g, _ in pairs])
            entry_ops = this_run.adds
            window_end = this_run.seen.window_end
            window_flags = this_run.seen.sums.flags
            if any(not transform.keeps_finite for group in plan.groups
                   for transform in group.transforms):
                # What a transform returns at the window's close is known
                # only there: the fields follow the step here.
                missed = tf.cast(tf.logical_and(window_end, tf.logical_not(applied)), tf.float32)
                window_flags = collections.OrderedDict(
                    (name, flag + missed if name in [item.name for item in plan.checks] else flag)
                    for name, flag in window_flags.items())
            seen = state._replace(
                closing=_seams.CloseView(window_flags, collections.OrderedDict(),
                                         plan.window.steps, this_run.seen.sums.loss_flags,
                                         None),
                reduced_flags=window_flags, window_end=window_end)
    reports = [observer.report(seen) for observer in observers]
    step = _report(plan, scales, applied, decisions, state.grads, window_end, accumulate_op,
                   reports, seen)
    if substep:
        return step
    # A worker whose chief applies moves nothing: the chief's sync op does.
    states = moved_state(plan, counters) if plan.reduction.applies_here else []
    _claims.claim(states, description,
                  (decisions.ops if entry_ops is None else entry_ops)
                  + [op for hooked in heard for op in hooked.entry_ops])
    if accumulate_op is not None:
        _claims.claim(states, description.replace("update_op", "accumulate_op", 1),
                      [opened.accumulate_entry])
    return step


def _gradients_and_flags(plan, scales, given):
    """Phases 1 and 2: the unscaled gradients and one flag per check.

    With one read per check of the shared status register
    (``plan.serial_reads``), each group's backprop follows the previous
    group's read, which is never cleared: a group skips when it or a group
    added before it overflowed, and never misses its own overflow.

    Returns:
      A ``_Computed``.
    """
    if given is not None:
        grads = collections.OrderedDict([(plan.groups[0].name, list(given))])
        with plan.backend.fusion_scope():
            flags = _overflow.flags(plan, grads, _gradients.Packing([]), after=())
        return _Computed(grads, flags, collections.OrderedDict(), grads)
    if plan.serial_reads:
        scaled, flags, after = collections.OrderedDict(), collections.OrderedDict(), []
        for item in plan.checks:
            scaled.update(_gradients.scaled_gradients(plan, scales, item.groups, after))
            flags.update(_overflow.flags(plan, scaled, _gradients.Packing([]),
                                         after=[plan.group(item.groups[0]).loss],
                                         checks=[item]))
            after = [flags[item.name]]  # the next group follows this read
        rest = tuple(name for name in plan.group_names if name not in scaled)
        if rest:  # unchecked groups follow the last read
            scaled.update(_gradients.scaled_gradients(plan, scales, rest, after))
        scaled = collections.OrderedDict((name, scaled[name]) for name in plan.group_names)
        packing = _gradients.pack(plan, scaled)
    else:
        scaled = _gradients.scaled_gradients(plan, scales, plan.group_names)
        with plan.backend.fusion_scope():
            packing = _gradients.pack(plan, scaled)
            flags = _overflow.flags(plan, scaled, packing, after=list(plan.losses))
            return _unscaled(plan, scales, scaled, packing, flags)
    return _unscaled(plan, scales, scaled, packing, flags)


def _unscaled(plan, scales, scaled, packing, flags):
    """The ``_Computed`` of the checked ``scaled`` gradients."""
    unscaled = _gradients.unscale_all(plan, scales, scaled, packing)
    return _Computed(unscaled, _overflow.unscaled_flags(plan, flags, unscaled), scaled,
                     _gradients.before_transforms(plan, scales, scaled, packing, unscaled))


class _Computed(collections.namedtuple("_Computed", ["grads", "flags", "scaled", "seen"])):
    """Phases 1 and 2: ordered dicts from group name to unscaled pairs (a
    fused transform applied: ``gradients.fused_transform``), from check name
    to float32 flag, from group name to scaled pairs (empty for given
    gradients), and from group name to the unscaled pairs before any
    transform, which the hooks see as ``StepState.grads`` (the pairs of
    ``grads`` where no transform is fused; otherwise a multiply of their
    own, which runs only where a hook or a fetch reads it)."""


def _report(plan, scales, done, decisions, grads, window_end, accumulate_op, reports, seen):
    """The step's tensors, as ``TrainOps`` reports them.

    ``update_op`` follows ``done``, the end of the step. The decisions are
    worked out again from the run's flags (and ``applied`` from the flags
    as the close reduced them, ``seen``), apart from the ones the gates and
    the run-time claims hang on: fetched without ``update_op`` they apply,
    write and claim nothing.
    """
    decisions = Decisions(decisions.flags, [])
    is_finite = tf.identity(decisions.all_of([item.name for item in plan.checks]),
                            name="is_finite")
    group_is_finite = dict(
        (name, decisions.all_of([plan.check_of(name)] if plan.check_of(name) else []))
        for name in plan.group_names)
    loss_scales = dict((name, scales[plan.scale_of(name)].value)
                       for name in plan.group_names if scales)
    applied = done
    if seen.reduced_flags is not None:
        reduced = Decisions(seen.reduced_flags, [])
        conditions = [item.name for item in plan.conditions]
        applied = tf.reduce_any(tf.stack([reduced.all_of(list(gate.checks) + conditions)
                                          for gate in plan.gates]))
        if seen.window_end is not None:
            applied = tf.logical_and(seen.window_end, applied)
        applied = tf.identity(applied, name="applied_step")
    return Step(
        update_op=tf.group(done.op, name="update"), is_finite=is_finite, applied=applied,
        window_end=tf.constant(True, name="window_end") if window_end is None else window_end,
        group_is_finite=group_is_finite, grads_and_vars=dict(grads),
        loss_scale=scales[plan.managers[0].name].value if scales else None,
        loss_scales=loss_scales, accumulate_op=accumulate_op, reports=reports)


def moved_state(plan, counters):
    """What the step moves once per run: each manager whose scale can move,
    and the caller's counters."""
    states = [] if counters is None else [counters]
    for use in plan.managers:
        if use.groups and _manager_protocol.scale_moves(use.manager):
            states.append(_claims.StateKey(use.manager, _manager_protocol.describe(use.manager)))
    return states


#: Ops whose gradient is None whatever flows into them.
_GRADIENT_STOPS = ("StopGradient", "PreventGradient")


def _differentiable_parents(op):
    """The producers of ``op``'s inputs that gradients flow through (float,
    complex and resource edges), none past ``tf.stop_gradient``."""
    if op.type in _GRADIENT_STOPS:
        return []
    return [tensor.op for tensor in op.inputs
            if (tensor.dtype.base_dtype.is_floating or tensor.dtype.base_dtype.is_complex
                or tensor.dtype.base_dtype == tf.resource)]


def _variable_ops(var_list):
    """The ops that stand for ``var_list`` in a graph walk (the variable op,
    and a resource variable's handle op)."""
    ops = []
    for var in var_list:
        handle = getattr(var, "handle", None)
        ops.append((handle if handle is not None else var).op)
        ops.append(var.op)
    return ops
