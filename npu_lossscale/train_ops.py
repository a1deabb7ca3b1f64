"""What ``MultiOptimizerLossScale.build`` returns, and the step ops it is
made of: the joint step and the per-group ones (``joint_ops``), or the
sub-steps of a sequence (``sequence_ops``), with each observer's report read
by its name.
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale import assembly as _assembly
from npu_lossscale import backends as _backends
from npu_lossscale.core import claims as _claims
from npu_lossscale.core import commit as _commit
from npu_lossscale.core import graph_state as _graph_state
from npu_lossscale.core import plan as _plan
from npu_lossscale.core import step as _step
from npu_lossscale.core import update_ops as _update_ops


class GroupReport(collections.namedtuple("GroupReport", ["is_finite", "loss_scale"])):
    """One group's part of a run of ``update_op`` (``TrainOps.groups``).

    Attributes:
      is_finite: bool scalar, the group's overflow decision (equal to
        ``TrainOps.is_finite`` on a single check).
      loss_scale: float32 scalar, the scale the group used.
    """


class SkipReport(collections.namedtuple("SkipReport", ["skip_reason", "groups_overflowed",
                                                       "last_skip", "recent_skips"])):
    """Why steps skipped (``TrainOps.diagnosis``; docs/diagnosis.md).

    Attributes:
      skip_reason: int32 scalar, why this run of ``update_op`` skipped: 0
        when it applied (or closed no accumulation window), else a code of
        the builder's reasons, ``diagnostics.reasons_of(train_ops)`` (the
        shipped ones keep their ``diagnostics.REASONS`` codes).
      groups_overflowed: dict from group name to a bool scalar, True when
        this run skipped and that group's loss or gradients were not finite
        on this worker (or saturated, on Ascend's register).
      last_skip: a ``diagnostics.LastSkip``: reads of the record of the last
        skipped step of any step op of the builder (``read_last_skip``),
        with counts by reason and by group; in no collection, so not saved.
      recent_skips: a ``diagnostics.RecentSkips``: reads of the history of
        the last ``skip_history`` skips, oldest first, each with its global
        step and streak (``read_recent_skips``): after a run of many device
        iterations, every skip of the run.
    """


class TrainOps(collections.namedtuple(
        "TrainOps", ["update_op", "per_group", "accumulate_op", "is_finite", "applied",
                     "loss_scale", "skipped_steps", "window_end", "grads_and_vars",
                     "groups", "diagnosis", "underflow", "observed", "clear_status",
                     "counts_skipped_steps"])):
    """What ``MultiOptimizerLossScale.build`` returns.

    Fetch one step op per ``session.run``: ``update_op``, or one op of
    ``per_group``. Every other field is a value of a run of ``update_op``:
    fetched with it, it is that run's; fetched without it, it is worked out
    for that run's batch and state, and nothing is applied or written
    (``skipped_steps``, ``loss_scale`` and ``diagnosis.last_skip`` are
    reads of the state, so they suit a run of a ``per_group`` op too). With
    a ``distributed`` engine, fetch the fields that reduce across workers
    (``is_finite``, ``applied``, ``diagnosis``) with ``update_op`` only:
    alone, they would wait for the other workers' collectives.

    Attributes:
      update_op: the single op to run each step, in place of the
        per-optimizer ``minimize`` ops: it applies every group (or none)
        and updates the loss scales. With accumulation and no engine, run
        it for every micro-batch; with an engine, run ``accumulate_op`` for
        the first ``accumulation_steps - 1`` micro-batches and ``update_op``
        for the last. A manager may be shared with other builders and
        ``LossScaleOptimizer``s: each ``session.run`` that fetches one of
        their step ops updates it once. A run that fetches two step ops
        updating one manager fails with an InvalidArgumentError before the
        second one writes anything.
      per_group: with ``build(per_group_ops=True)``, a dict from group name
        to an op that computes, checks and applies that group alone (same
        managers and counters), for alternating loops; empty otherwise.
      accumulate_op: with accumulation, the op that adds a micro-batch
        without closing the window (no collective, no cond); None otherwise.
      is_finite: bool scalar, the run's overflow decision (all groups; the
        window's, with accumulation and an engine).
      applied: bool scalar, True when the run applies (any group, with
        ``skip_policy="per_group"``); None with a SyncReplicasOptimizer
        group, whose chief decides.
      loss_scale: float32 scalar, the builder manager's scale for this run,
        before the manager's update.
      skipped_steps: int64 scalar, the checkpointed count of steps (windows)
        on which some group did not apply, before this run.
      window_end: bool scalar, True when the run closes an accumulation
        window (always True without accumulation).
      grads_and_vars: dict from group name to its unscaled (gradient,
        variable) pairs of this run, before the reduction across workers,
        an accumulation window's mean and every transform (``clip_norm``,
        ``transform_grads_fn``): what skip conditions and observers see
        as ``seams.StepState.grads``. Where the step fuses a clip into the
        unscale, these are a multiply of their own that runs only when
        fetched.
      groups: dict from group name to its ``GroupReport``.
      diagnosis: the ``SkipReport`` (its ``skip_reason`` None through a
        SyncReplicasOptimizer, whose chief decides).
      underflow: with ``build(measure_underflow=True)`` (or
        ``underflow.measure_underflow()`` among the observers), a dict from
        group name to its ``underflow.Underflow``: the report of the
        observer named "underflow"; empty otherwise.
      observed: dict from the name of each observer passed to
        ``build(observers=...)`` to what its ``report`` returned (the
        keywords' observers are not in it).
      clear_status: the op that clears Ascend's float-status register (a
        no-op off the register); every register-reading step runs it first.
      counts_skipped_steps: whether ``update_op`` advances ``global_step`` on
        skipped steps too (``build(count_skipped_steps=True)``); None without
        a ``global_step``. A device loop (docs/ascend.md) needs True.
    """


def joint_ops(owner, plan, global_step, update_ops, per_group_ops, shipped, observers,
              given, history):
    """The joint step, then the per-group steps if asked, as a ``TrainOps``.

    Args:
      owner: the builder, which owns the step's counters and register claim.
      plan: the builder's ``plan.Plan``.
      global_step: an integer variable, or None.
      update_ops: the checked ``update_ops`` (``update_ops.check_argument``).
      per_group_ops: whether to build ``TrainOps.per_group``.
      shipped: the observers every build wires (the cluster check, the
        hearing), before the diagnosis joins them.
      observers: the observers asked for, by keyword or ``observers``.
      given: those of ``observers`` passed as ``observers``.
      history: how many skips the record keeps.

    Returns:
      A ``TrainOps``.
    """
    what = "MultiOptimizerLossScale (groups %s)" % ", ".join(plan.group_names)
    counters = _claims.StateKey(owner, "the step counters of " + what)
    # Absolute ("loss_scale/"): a root op named "loss_scale" (npu_bridge's
    # name for the scale) must not move this scope to "loss_scale_1".
    with tf.name_scope("loss_scale/"):
        skipped_steps = _commit.SkippedSteps()
        record = _assembly.record(plan, history)
        shipped = [_assembly.diagnosis(record)] + list(shipped)
        joint = _step.build_step(plan, "update_op of " + what, global_step, skipped_steps,
                                 _update_ops.joint(update_ops), counters,
                                 observers=shipped + observers)
        clear_status = plan.backend.clear_status()
        applied = joint.applied if plan.reduction.applies_here else None
        # By name: the shipped observers' and the asked-for ones' apart,
        # since an observer of yours may take a shipped one's name.
        reports = _reports(observers, joint.reports[len(shipped):])
        reported = _reports(shipped, joint.reports)[_assembly.DIAGNOSIS]
        report = SkipReport(None, {}, record.last_skip(), record.recent_skips())
        if applied is not None:
            report = report._replace(skip_reason=reported[0],
                                     groups_overflowed=reported[1])
    per_group = {}
    if per_group_ops:
        for group in plan.groups:
            alone = _plan.make_plan(
                [group], group.manager, plan.backend, engine=plan.reduction.engine,
                allreduce_gradients=plan.reduction.allreduce_gradients,
                count_skipped_steps=plan.count_skipped_steps, gate_kind=plan.gate_kind,
                conditions=[item.condition for item in plan.conditions])
            with tf.name_scope("loss_scale_%s" % group.name):
                # Copies: the originals already belong to update_op's gate.
                per_group[group.name] = _step.build_step(
                    alone, "per_group[%s] of %s" % (group.name, what), global_step,
                    skipped_steps, _commit.Copies(update_ops.get(group.name, ())),
                    counters, observers=shipped + observers).update_op
    if plan.backend.reads_register and plan.checks:
        _backends.claim_register(owner, "a " + what)
    _graph_state.of(joint.update_op.graph).records[joint.update_op.name] = record
    return TrainOps(
        update_op=joint.update_op, per_group=per_group, accumulate_op=joint.accumulate_op,
        is_finite=joint.is_finite, applied=applied, loss_scale=joint.loss_scale,
        skipped_steps=skipped_steps.before, window_end=joint.window_end,
        grads_and_vars=joint.grads_and_vars,
        groups=dict((name, GroupReport(joint.group_is_finite[name],
                                       joint.loss_scales.get(name)))
                    for name in plan.group_names),
        diagnosis=report, underflow=reports.get(_assembly.UNDERFLOW, {}),
        observed=dict((observer.name, reports[observer.name]) for observer in given),
        clear_status=clear_status,
        counts_skipped_steps=None if global_step is None else plan.count_skipped_steps)


def sequence_ops(owner, plan, global_step, sequence, loss_fns, manager, history):
    """The op of ``build(sequence=...)`` (``sequence.build_sequence``), as a
    ``TrainOps``.

    Args:
      owner: the builder, which owns the step's counters and register claim.
      plan: the builder's ``plan.Plan``.
      global_step: an integer variable, or None.
      sequence: the checked tuple of group names.
      loss_fns: dict from group name to the loss callable ``add()`` took.
      manager: the builder's manager (``TrainOps.loss_scale`` is its scale).
      history: how many skips the record keeps.

    Returns:
      A ``TrainOps``.

    Raises:
      ValueError: with a SyncReplicasOptimizer group, before any op.
    """
    if not plan.reduction.applies_here:
        raise ValueError("sequence=%r with a SyncReplicasOptimizer group: its chief "
                         "decides one step at a time. Leave sequence out."
                         % (list(sequence),))
    what = "MultiOptimizerLossScale (sequence %s)" % ", ".join(sequence)
    counters = _claims.StateKey(owner, "the step counters of " + what)
    with tf.name_scope("loss_scale/"):
        skipped_steps = _commit.SkippedSteps()
        record = _assembly.record(plan, history)
        built = _assembly.build_sequence(
            sequence, dict((group.name, group) for group in plan.groups), loss_fns,
            plan, global_step, skipped_steps, record, counters, "update_op of " + what)
        last = dict((sub.name, sub) for sub in built.substeps)
        reasons = [sub.diagnosis[0] for sub in built.substeps]
        reason = reasons[-1]
        for earlier in reversed(reasons[:-1]):  # the first sub-step that skipped
            reason = tf.where(tf.not_equal(earlier, 0), earlier, reason)
        overflowed = dict((name, tf.reduce_any(tf.stack(
            [sub.diagnosis[1][name] for sub in built.substeps if sub.name == name])))
            for name in plan.group_names)
        report = SkipReport(tf.identity(reason, name="skip_reason"), overflowed,
                            record.last_skip(), record.recent_skips())
        clear_status = plan.backend.clear_status()
    if plan.backend.reads_register and plan.checks:
        _backends.claim_register(owner, "a " + what)
    _graph_state.of(built.update_op.graph).records[built.update_op.name] = record
    first = built.substeps[0].step
    return TrainOps(
        update_op=built.update_op, per_group={}, accumulate_op=None,
        is_finite=built.is_finite, applied=built.applied,
        loss_scale=next((sub.step.loss_scale for sub in built.substeps
                         if plan.group(sub.name).manager is manager),
                        first.loss_scale),
        skipped_steps=skipped_steps.before, window_end=tf.constant(True),
        grads_and_vars=dict((name, sub.step.grads_and_vars[name])
                            for name, sub in last.items()),
        groups=dict((name, GroupReport(sub.step.group_is_finite[name],
                                       sub.step.loss_scales.get(name)))
                    for name, sub in last.items()),
        diagnosis=report, underflow={}, observed={}, clear_status=clear_status,
        counts_skipped_steps=None if global_step is None else plan.count_skipped_steps)


def _reports(observers, reports):
    """Dict from each observer's name to its report (``build_step`` gives
    the reports in its observers' order)."""
    return dict((observer.name, report) for observer, report in zip(observers, reports))
