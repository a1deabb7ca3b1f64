"""Why a step skipped: the reasons, what to do about each, and the record of
the last skip read back as Python values (``read_last_skip``, ``describe``).

A skipped step is diagnosed in the skip branch of its own gate, so an
applied step runs none of it (``evidence``, ``record``; docs/diagnosis.md
describes each reason). A skip condition (``seams.SkipCondition``) may add a
reason of its own (``register_reason``); where a check says overflow too,
the check's reason is given.
"""

from __future__ import absolute_import, division, print_function

import collections

import numpy as np

from npu_lossscale.core import checks as _checks

#: The reason codes, by name: ``TrainOps.diagnosis.skip_reason`` indexes it,
#: and ``register_reason`` appends a skip condition's own.
REASONS = ("applied", "loss_not_finite", "gradients_overflowed",
           "other_worker_overflowed", "register_outside_gradients", "requested",
           "loss_spike", "backend_flagged")
APPLIED, LOSS_NOT_FINITE, GRADIENTS_OVERFLOWED, OTHER_WORKER_OVERFLOWED, \
    REGISTER_OUTSIDE_GRADIENTS, REQUESTED, LOSS_SPIKE, BACKEND_FLAGGED = range(len(REASONS))

#: The checks' own reasons: a skip condition cannot take one.
CHECK_REASONS = ("applied", "loss_not_finite", "gradients_overflowed",
                 "other_worker_overflowed", "register_outside_gradients", "backend_flagged")

#: What to do about each reason, as the collapse message says it.
FIXES = (
    "nothing to fix.",
    "the loss is inf or nan before any scaling, so no loss scale can help: it is a "
    "model or data bug. Check the input batch for inf/nan, and keep exp, log, "
    "softmax and the losses in float32.",
    "the named variables' gradients overflow float16 even at this scale: keep the "
    "ops that produce them in float32, or bound their inputs (clip, normalise); "
    "lowering min_loss_scale only hides it.",
    "another worker overflowed, not this one: read that worker's last_skip record "
    "(its reason and variables name the fault) and check its data shard.",
    "the float-status register was set while every gradient was finite: an op "
    "outside the gradients overflowed, usually a forward op or the input data. "
    "Find it with npu_lossscale.audit or by checking the forward outputs, and "
    "keep it in float32.",
    "the step was asked to be skipped (build(skip_global_steps=...)): nothing to fix.",
    "a loss exceeded skip_loss_spikes times its moving average: check the batch "
    "behind it; the weights and the loss scale stayed as they were.",
    "the step's backend (a Backend of your own) flagged values that are all finite, "
    "and it gives no per-variable evidence: ask the backend which values it "
    "flagged.",
)


#: The reasons of skip conditions that hold the loss scale (asked-for
#: skips, loss spikes): they say nothing of the scale, so the collapse
#: policy (``monitoring.CollapseMonitor``) passes over them.
HOLDING_REASONS = frozenset(["requested", "loss_spike"])


def register_reason(name, fix, holds_scale=False):
    """The code of a skip condition's reason, added to ``REASONS`` if new.

    Args:
      name: the reason's name, a non-empty str.
      fix: what to do about a skip for this reason, one sentence.
      holds_scale: whether a skip for this reason leaves the loss scale as
        it was (``HOLDING_REASONS``).

    Returns:
      The int code (``REASONS.index(name)``).

    Raises:
      TypeError: unless ``name`` and ``fix`` are str.
      ValueError: for an empty name, one of the checks' own reasons
        (``CHECK_REASONS``), or a name registered before with another fix
        or another ``holds_scale``.
    """
    global REASONS, FIXES, HOLDING_REASONS  # pylint: disable=global-statement
    if not isinstance(name, str) or not isinstance(fix, str):
        raise TypeError("a skip condition's reason and fix must be str, got reason=%r, "
                        "fix=%r. Set e.g. reason = 'negative_loss' and fix = 'check the "
                        "data.' on the class." % (name, fix))
    if not name:
        raise ValueError("a skip condition's reason must be a non-empty name, got %r. Set "
                         "e.g. reason = 'negative_loss' on the class." % (name,))
    if name in CHECK_REASONS:
        raise ValueError("a skip condition's reason %r is one of the step's own (%s): a skip "
                         "for it would be read as one of theirs. Name your condition's "
                         "reason, e.g. reason = 'negative_loss'."
                         % (name, ", ".join(CHECK_REASONS)))
    if name in REASONS and (FIXES[REASONS.index(name)] != fix
                            or (name in HOLDING_REASONS) != holds_scale):
        raise ValueError(
            "a skip condition's reason %r is registered already with fix %r and "
            "moves_scale=%r; this one has fix %r and moves_scale=%r. Give it a reason of its "
            "own, or the same fix and moves_scale." % (
                name, FIXES[REASONS.index(name)], name not in HOLDING_REASONS, fix,
                not holds_scale))
    if name not in REASONS:
        REASONS = REASONS + (name,)
        FIXES = FIXES + (fix,)
        if holds_scale:
            HOLDING_REASONS = HOLDING_REASONS.union([name])
    return REASONS.index(name)


def transform_reason(group):
    """The reason of a skip that ``group``'s own transforms caused, and its
    fix: the transforms that may turn finite gradients into inf or NaN
    (``seams.GradientTransform.keeps_finite`` False), named, e.g.
    ``("transform_grads_fn_not_finite", ...)``; None when every transform
    keeps finite values. ``register_reason`` takes it.

    Args:
      group: a ``core.plan.Group``.

    Returns:
      A ``(name, fix)`` pair, or None.
    """
    names = [transform.name for transform in group.transforms if not transform.keeps_finite]
    if not names:
        return None
    which = "+".join(names)
    return ("%s_not_finite" % which,
            "the gradient transform %s returned inf or NaN from finite gradients and "
            "losses: its own fault, not the loss scale's; make it keep finite values "
            "(guard its divisions and logs). The step counted it as an overflow." % which)


def reason_name(code):
    """``REASONS[code]``, e.g. "loss_not_finite", for an int (or numpy
    integer) ``code``: TypeError for another type, ValueError for an unknown
    code."""
    if isinstance(code, bool) or not isinstance(code, (int, np.integer)):
        raise TypeError("code must be an int reason code, got %r. Pass the value "
                        "fetched from TrainOps.diagnosis.skip_reason." % (code,))
    if not 0 <= int(code) < len(REASONS):
        raise ValueError("code must be in 0..%d, got %r. Pass the value fetched from "
                         "TrainOps.diagnosis.skip_reason." % (len(REASONS) - 1, code))
    return REASONS[int(code)]


class LastSkip(collections.namedtuple(
        "LastSkip", ["number", "global_step", "reason", "groups", "variables",
                     "group_names", "variable_names", "reason_counts", "group_counts"])):
    """The record of the last skipped step, as tensors that read it.

    Written only in the skip branch, so reading it never runs a step; fetched
    with ``update_op`` it may show the record before or after that run's
    skip (``TrainOps.diagnosis.skip_reason`` is the run's own). It reads the
    variable ``loss_scale/last_skip``, which no collection holds: not
    checkpointed, no initializer, blank in each new session.

    Attributes:
      number: int64 scalar, the skip's number: how many skips the record
        has seen in this session; 0 before any skip.
      global_step: int64 scalar, the global step's value when the skipped
        step ran (-1 when the step has none, or before any skip).
      reason: int32 scalar, the skip's reason code (``REASONS``).
      groups: bool vector over ``group_names``: the groups whose loss or
        gradients were not finite (or saturated) on this worker.
      variables: bool vector over ``variable_names``: the same, by variable.
      group_names: string vector, the builder's group names.
      variable_names: string vector, the names of every group's variables.
      reason_counts: int64 vector, the number of skips for each reason code
        in this session (the first, "applied", stays 0).
      group_counts: int64 vector, for each group the number of skips in
        which it overflowed.
    """


class RecentSkips(collections.namedtuple(
        "RecentSkips", ["number", "global_step", "reason", "streak", "substep",
                        "groups", "group_names"])):
    """The record's history of the last skips, as tensors that read it,
    oldest first (``TrainOps.diagnosis.recent_skips``).

    Each field but ``group_names`` has one entry per place of the history
    (``MultiOptimizerLossScale(skip_history=...)``); a place no skip has
    filled yet has number 0 and comes first. Written only in the skip
    branch, and in no collection, like ``LastSkip``.

    Attributes:
      number: int64 vector, each skip's number (``LastSkip.number``).
      global_step: int64 vector, the global step each skip ran at (-1
        without one).
      reason: int32 vector, each skip's reason code.
      streak: int64 vector, each skip's place in its run of consecutive
        skipped steps (1 for a skip after an applied step); skips for a
        reason that holds the scale neither extend nor break it.
      substep: int32 vector, the index of each skipped sub-step in the
        step's sequence (``build(sequence=...)``); 0 outside a sequence.
      groups: bool matrix [places, groups]: the groups that overflowed.
      group_names: string vector, the builder's group names.
    """


class RecordedSkip(collections.namedtuple(
        "RecordedSkip", ["number", "global_step", "reason", "streak", "substep",
                         "groups"])):
    """One skip of the history, as Python values (``read_recent_skips``).

    Attributes:
      number: the skip's number (1 for the first of the session).
      global_step: the global step when it ran, or None if the step has none.
      reason: the reason's name (``REASONS``).
      streak: its place in its run of consecutive skipped steps.
      substep: the skipped sub-step's index in the step's sequence (0
        outside a sequence).
      groups: tuple of the names of the groups that overflowed.
    """

    @property
    def fix(self):
        """What to do about this skip's reason, one sentence."""
        return FIXES[REASONS.index(self.reason)]


def decode_recent(values):
    """The ``RecordedSkip``s in fetched ``RecentSkips`` values, oldest first."""
    return tuple(
        RecordedSkip(number=int(number), global_step=_global_step(step),
                     reason=reason_name(int(reason)), streak=int(streak),
                     substep=int(substep), groups=_masked(mask, values.group_names))
        for number, step, reason, streak, substep, mask in zip(
            values.number, values.global_step, values.reason, values.streak,
            values.substep, values.groups)
        if int(number) > 0)


class Skip(collections.namedtuple(
        "Skip", ["number", "global_step", "reason", "groups", "variables"])):
    """One skipped step, as Python values (``decode``, ``read_last_skip``).

    Attributes:
      number: the skip's number (1 for the first).
      global_step: the global step when it ran, or None if the step has none.
      reason: the reason's name (``REASONS``).
      groups: tuple of the names of the groups that overflowed.
      variables: tuple of the names of the variables that overflowed.
    """

    @property
    def fix(self):
        """What to do about this skip's reason, one sentence."""
        return FIXES[REASONS.index(self.reason)]


def decode(values):
    """The ``Skip`` in fetched ``LastSkip`` values, or None before any skip."""
    if int(values.number) == 0:
        return None
    return Skip(number=int(values.number), global_step=_global_step(values.global_step),
                reason=reason_name(int(values.reason)),
                groups=_masked(values.groups, values.group_names),
                variables=_masked(values.variables, values.variable_names))


def _masked(mask, names):
    """The fetched ``names`` where ``mask`` is set, as a tuple of str."""
    return tuple(decoded(name) for name, bad in zip(names, mask) if bad)


def _global_step(value):
    """A fetched global step, or None for the record's -1 (no global step)."""
    return None if int(value) < 0 else int(value)


def decoded(name):
    """A name fetched from a string tensor (bytes), as a str."""
    return name.decode("utf-8") if isinstance(name, bytes) else str(name)


def read_last_skip(session, train_ops):
    """Reads the last skip's record in a run of its own; no step runs.

    Args:
      session: a session of the graph of ``train_ops``.
      train_ops: the ``TrainOps`` of ``MultiOptimizerLossScale.build``.

    Returns:
      A ``Skip``, or None when no step has skipped yet.

    Raises:
      TypeError: for arguments in the wrong order, or of the wrong type.
      ValueError: for a session of another graph than ``train_ops``'s.
    """
    if _checks.is_session(train_ops) and not _checks.is_session(session):
        raise TypeError("read_last_skip takes (session, train_ops), got a %s first and the "
                        "session %r second. Call read_last_skip(sess, train)."
                        % (type(session).__name__, train_ops))
    _checks.check_train_ops(train_ops)
    _checks.check_session(session, train_ops.update_op.graph, "train_ops")
    return decode(session.run(train_ops.diagnosis.last_skip))


def read_recent_skips(session, train_ops):
    """Reads the record's history of the last skips in a run of its own; no
    step runs.

    After a ``session.run`` that ran many steps (a device loop of
    ``iterations_per_loop``), this shows every skip of the run, where
    ``read_last_skip`` shows the last.

    Args:
      session: a session of the graph of ``train_ops``.
      train_ops: the ``TrainOps`` of ``MultiOptimizerLossScale.build``.

    Returns:
      A tuple of ``RecordedSkip``, oldest first: the last
      ``MultiOptimizerLossScale(skip_history=...)`` skips of this session.

    Raises:
      TypeError: for a wrong ``train_ops``.
      ValueError: for a session of another graph than ``train_ops``'s.
    """
    _checks.check_train_ops(train_ops)
    _checks.check_session(session, train_ops.update_op.graph, "train_ops")
    return decode_recent(session.run(train_ops.diagnosis.recent_skips))


def describe(skip):
    """One or two sentences about a ``Skip``: its reason, groups, variables
    and fix."""
    where = "" if skip.global_step is None else " at global step %d" % skip.global_step
    parts = ["skip #%d%s: %s" % (skip.number, where, skip.reason)]
    if skip.groups:
        parts.append("groups %s" % ", ".join(skip.groups))
    if skip.variables:
        shown = list(skip.variables[:8])
        if len(skip.variables) > len(shown):
            shown.append("and %d more" % (len(skip.variables) - len(shown)))
        parts.append("variables %s" % ", ".join(shown))
    return "%s. Fix: %s" % ("; ".join(parts), skip.fix)
