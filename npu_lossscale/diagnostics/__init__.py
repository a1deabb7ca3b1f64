"""Why a step skipped: the reasons, what to do about each, and the record of
the last skip read back as Python values (``read_last_skip``, ``describe``).

A skipped step is diagnosed in the skip branch of its own gate, so an
applied step runs none of it (``evidence``, ``record``; docs/diagnosis.md
describes each reason). Each builder has its own reasons (``reasons``,
``reasons_of``): the shipped ones (``REASONS``), then its skip conditions'
(``seams.SkipCondition``) and its transforms'; where a check says overflow
too, the check's reason is given.
"""

from __future__ import absolute_import, division, print_function

import collections

from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.diagnostics import reasons as _reasons

#: The shipped reasons' names, by code (a read-only view of
#: ``reasons.SHIPPED``): ``TrainOps.diagnosis.skip_reason`` indexes it; a
#: builder's own reasons (``reasons_of``) start with these.
REASONS = _reasons.SHIPPED.names
APPLIED, LOSS_NOT_FINITE, GRADIENTS_OVERFLOWED, OTHER_WORKER_OVERFLOWED, \
    REGISTER_OUTSIDE_GRADIENTS, REQUESTED, LOSS_SPIKE, BACKEND_FLAGGED = range(len(REASONS))

#: The checks' own reasons: a skip condition cannot take one.
CHECK_REASONS = tuple(reason.name for reason in _reasons.CHECKS)

#: What to do about each shipped reason, as the collapse message says it.
FIXES = _reasons.SHIPPED.fixes

#: The shipped reasons that hold the loss scale (asked-for skips, loss
#: spikes): they say nothing of the scale, so the collapse policy
#: (``monitoring.CollapseMonitor``) passes over them.
HOLDING_REASONS = _reasons.SHIPPED.holding


def reasons_of(train_ops):
    """The reasons of the builder that made ``train_ops``: the shipped ones,
    then its skip conditions' and its transforms' (``reasons.collect``),
    carried by its skip record.

    Args:
      train_ops: the ``TrainOps`` of ``MultiOptimizerLossScale.build``.

    Returns:
      A ``reasons.Reasons``: ``names[code]`` is a code's name; the shipped
      ones for a step without a record of its own.

    Raises:
      TypeError: for a wrong ``train_ops``.
    """
    _helpers.check_train_ops(train_ops)
    record = _helpers.graph_state_of(train_ops.update_op.graph).records.get(
        train_ops.update_op.name)
    return _reasons.SHIPPED if record is None else record.reasons


def reason_name(code, reasons=None):
    """The name of a reason code, e.g. "loss_not_finite", for an int (or
    numpy integer) ``code``: TypeError for another type, ValueError for an
    unknown code.

    Args:
      code: the code, e.g. fetched from ``TrainOps.diagnosis.skip_reason``.
      reasons: the builder's ``reasons.Reasons`` (``reasons_of``); the
        shipped ones (``REASONS``) when None.

    Returns:
      A str.
    """
    return (_reasons.SHIPPED if reasons is None else reasons).name(code)


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
      reason: int32 scalar, the skip's reason code (``reasons_of``).
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


class _Fixed(object):
    """A decoded skip's ``fix``: from the reasons it was decoded with (its
    builder's, ``decode``), else the shipped ones."""

    @property
    def fix(self):
        """What to do about this skip's reason, one sentence."""
        return getattr(self, "_decoded_reasons", _reasons.SHIPPED).fix(self.reason)


class RecordedSkip(collections.namedtuple(
        "RecordedSkip", ["number", "global_step", "reason", "streak", "substep",
                         "groups"]), _Fixed):
    """One skip of the history, as Python values (``read_recent_skips``).

    Attributes:
      number: the skip's number (1 for the first of the session).
      global_step: the global step when it ran, or None if the step has none.
      reason: the reason's name (``reasons_of``).
      streak: its place in its run of consecutive skipped steps.
      substep: the skipped sub-step's index in the step's sequence (0
        outside a sequence).
      groups: tuple of the names of the groups that overflowed.
    """


def decode_recent(values, reasons=None):
    """The ``RecordedSkip``s in fetched ``RecentSkips`` values, oldest
    first; ``reasons`` as for ``decode``."""
    return tuple(
        _decoded_with(RecordedSkip(
            number=int(number), global_step=_global_step(step),
            reason=_reason_name(reason, reasons), streak=int(streak), substep=int(substep),
            groups=_masked(mask, values.group_names)),
            _reasons.SHIPPED if reasons is None else reasons)
        for number, step, reason, streak, substep, mask in zip(
            values.number, values.global_step, values.reason, values.streak,
            values.substep, values.groups)
        if int(number) > 0)


def _reason_name(code, reasons):
    """The name of a fetched ``code`` among ``reasons``, or the shipped
    ones when None: ValueError, saying to pass the builder's, for a code
    past them (a reason of a skip condition of the builder's own)."""
    if reasons is None:
        if int(code) >= len(_reasons.SHIPPED.reasons):
            raise ValueError(
                "reasons=None decodes the shipped reasons (codes 0..%d), got code %d, a reason "
                "of the builder's own skip conditions. Pass "
                "reasons=diagnostics.reasons_of(train_ops)."
                % (len(_reasons.SHIPPED.reasons) - 1, int(code)))
        reasons = _reasons.SHIPPED
    return reasons.name(int(code))


class Skip(collections.namedtuple(
        "Skip", ["number", "global_step", "reason", "groups", "variables"]), _Fixed):
    """One skipped step, as Python values (``decode``, ``read_last_skip``).

    Attributes:
      number: the skip's number (1 for the first).
      global_step: the global step when it ran, or None if the step has none.
      reason: the reason's name (``reasons_of``).
      groups: tuple of the names of the groups that overflowed.
      variables: tuple of the names of the variables that overflowed.
    """


def decode(values, reasons=None):
    """The ``Skip`` in fetched ``LastSkip`` values, or None before any skip.

    Args:
      values: the fetched ``LastSkip``.
      reasons: the builder's ``reasons.Reasons`` (``reasons_of``); the
        shipped ones when None.

    Returns:
      A ``Skip``, or None.
    """
    if int(values.number) == 0:
        return None
    reason = _reason_name(values.reason, reasons)
    reasons = _reasons.SHIPPED if reasons is None else reasons
    return _decoded_with(Skip(
        number=int(values.number), global_step=_global_step(values.global_step),
        reason=reason,
        groups=_masked(values.groups, values.group_names),
        variables=_masked(values.variables, values.variable_names)), reasons)


def _decoded_with(skip, reasons):
    """``skip``, whose ``fix`` reads ``reasons`` (its builder's)."""
    skip._decoded_reasons = reasons  # pylint: disable=protected-access
    return skip


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
    if _helpers.is_session(train_ops) and not _helpers.is_session(session):
        raise TypeError("read_last_skip takes (session, train_ops), got a %s first and the "
                        "session %r second. Call read_last_skip(sess, train)."
                        % (type(session).__name__, train_ops))
    _helpers.check_train_ops(train_ops)
    _helpers.check_session(session, train_ops.update_op.graph, "train_ops")
    return decode(session.run(train_ops.diagnosis.last_skip), reasons_of(train_ops))


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
    _helpers.check_train_ops(train_ops)
    _helpers.check_session(session, train_ops.update_op.graph, "train_ops")
    return decode_recent(session.run(train_ops.diagnosis.recent_skips), reasons_of(train_ops))


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
