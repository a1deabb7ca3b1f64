"""The collapse policy: ``CollapseMonitor`` counts each step op's
consecutive skips and acts on a collapse (``Collapse``,
``LossScaleCollapse``)."""

from __future__ import absolute_import, division, print_function

import collections
import warnings

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale.core import checks as _checks
from npu_lossscale import device_loop as _device_loop
from npu_lossscale import diagnostics as _diagnostics
from npu_lossscale.monitoring import floor as _floor
from npu_lossscale.monitoring import step_ops as _step_ops

#: What the collapse policy does (``CollapseMonitor``, ``LossScaleHook``).
COLLAPSE_ACTIONS = ("warn", "stop", "raise")
#: The managers' own ``floor_warning_after``.
DEFAULT_COLLAPSE_AFTER = 20


class Collapse(collections.namedtuple(
        "Collapse", ["skips", "reasons", "last_skip", "floors", "message"])):
    """A collapse of the loss scale, as ``CollapseMonitor`` saw it.

    Attributes:
      skips: the number of consecutive skipped steps so far.
      reasons: dict from reason name to the number of those skips it caused.
      last_skip: the ``diagnostics.Skip`` of the last of them.
      floors: tuple of the class names of the watched managers at their floor.
      message: the counts, the last skip, and the fix for each reason seen.
    """


class LossScaleCollapse(RuntimeError):
    """Raised by a collapse policy of "raise"; ``collapse`` is the ``Collapse``."""

    def __init__(self, collapse):
        super(LossScaleCollapse, self).__init__(collapse.message)
        self.collapse = collapse


class _Streak(object):
    """One step op's consecutive skips (``skips``), their reasons (a
    ``Counter``), and the ``Collapse`` they made, or None."""

    def __init__(self):
        self.skips = 0
        self.reasons = collections.Counter()
        self.collapse = None


class CollapseMonitor(object):
    """Watches a plain training loop for a collapsing loss scale.

    Feed it every run of ``update_op``: its ``skip_reason`` (and, with
    accumulation, ``window_end``). After ``collapse_after`` consecutive
    skipped steps, or a watched manager at its floor after as many
    overflows, it reads the last skip's record and acts once: "warn"
    (RuntimeWarning and log), "stop" (log; ``observe`` returns the
    ``Collapse``), or "raise" (``LossScaleCollapse``). An applied step
    re-arms it. It makes no op (finalized graphs are fine).

    Under a device loop (the graph holds tf_adapter's ``IterationOp``, so one
    ``session.run`` runs many steps) feed it as in a plain loop: after each
    run it reads the record's history (``diagnostics.read_recent_skips``),
    whose skips carry their streaks, so a collapse inside the loop is seen
    after that run. That needs a ``global_step``; without one it warns and
    sees each run's last iteration. A loop over one per-group op of several,
    or over a step that does not count its skips, is a ValueError at the
    first ``observe`` (``device_loop.check_loop``). Example::

      monitor = npu_lossscale.CollapseMonitor(train, collapse_after=20,
                                              on_collapse="stop")
      for batch in batches:
          _, reason = sess.run([train.update_op, train.diagnosis.skip_reason], feed(batch))
          if monitor.observe(reason, sess):
              break  # monitor.collapse.message says why

    Args:
      train_ops: the ``TrainOps`` of ``MultiOptimizerLossScale.build``.
      collapse_after: consecutive skipped steps (or overflows at a floor)
        that make a collapse, >= 1.
      on_collapse: "warn", "stop" or "raise".
      managers: a list of managers whose floor also counts (the public
        properties of ``check_floor``), read only after a skipped step.

    Raises:
      TypeError: for a wrong ``train_ops``, a non-int ``collapse_after`` or
        a manager without the floor properties.
      ValueError: for ``collapse_after`` < 1, an unknown ``on_collapse``, or
        a step through a ``SyncReplicasOptimizer`` (no ``skip_reason``).
    """

    def __init__(self, train_ops, collapse_after=DEFAULT_COLLAPSE_AFTER, on_collapse="warn",
                 managers=()):
        _checks.check_train_ops(train_ops)
        self._after = check_collapse_after(collapse_after)
        if on_collapse not in COLLAPSE_ACTIONS:
            raise ValueError("on_collapse must be one of %r, got %r. Pass 'warn', 'stop' "
                             "or 'raise'." % (COLLAPSE_ACTIONS, on_collapse))
        if train_ops.diagnosis.skip_reason is None:
            raise ValueError("train_ops has no skip_reason: its step goes through a "
                             "SyncReplicasOptimizer, whose chief decides the skips. Watch "
                             "the chief's managers with FloorWarningHook instead.")
        self.on_collapse = on_collapse
        self._train = train_ops
        self._graph = train_ops.update_op.graph
        # Runs that close no window: accumulation without an engine.
        self._windows = tf.get_static_value(train_ops.window_end) is None
        self._reasons = _diagnostics.reasons_of(train_ops)  # the builder's
        self._floors = [_floor.floor_of(manager) for manager in manager_list(managers)]
        self._streaks = {}
        self._last = None  # the streak key observed last
        #: The last ``Collapse`` whose step op has not applied since, or None.
        self.collapse = None
        self._seen = 0  # the number of the last recorded skip read (device loops)
        self._warned_no_step = False
        self._loop_checked = False

    @property
    def skips(self):
        """The consecutive skipped steps of the step op observed last."""
        streak = self._streaks.get(self._last)
        return 0 if streak is None else streak.skips

    def observe(self, skip_reason, session, window_end=None, step=None):
        """Counts one run of a step op and acts on a collapse.

        Args:
          skip_reason: the run's fetched ``TrainOps.diagnosis.skip_reason``,
            an int code of the builder's reasons (``diagnostics.reasons_of``).
          session: the session of the step; read at the collapse, and after
            a skipped step when managers are watched.
          window_end: the run's fetched ``TrainOps.window_end``; a run that
            closes no window is not counted. Needed with accumulation
            without an engine.
          step: a str naming the step op when a loop runs several (each has
            its own streak); None for the joint step.

        Returns:
          The ``Collapse`` while this step op's streak is collapsed, else
          None.

        Raises:
          TypeError: for a wrong type of any argument (a bool or a tensor
            as ``skip_reason`` included).
          ValueError: for a code out of range, a session of another graph,
            or no ``window_end`` where it is needed.
          LossScaleCollapse: at the collapse, with ``on_collapse="raise"``.
        """
        code = _reason_code(skip_reason, self._reasons)
        _checks.check_session(session, self._graph, "train_ops")
        closes = self._closes(window_end)
        if step is not None and not isinstance(step, str):
            raise TypeError("step must be None or a str naming the step op, got %r. Pass "
                            "e.g. step='g' for train.per_group['g']." % (step,))
        streak = self._streaks.setdefault(step, _Streak())
        self._last = step
        loop = _device_loop.iteration_op(self._graph)
        if loop is not None and not self._loop_checked:
            self._loop_checked = True
            problems = _step_ops.loop_problems(self._train, loop)
            if problems:
                raise ValueError("npu_lossscale.CollapseMonitor: " + " ".join(problems))
        if step is None and loop is not None:
            if self._train.counts_skipped_steps is not None:
                return self._observe_loop(code, session, streak)
            self._warn_no_global_step()
        if not closes or self._reasons.names[code] in self._reasons.holding:
            # A skip that holds the scale (asked for, a loss spike) says
            # nothing of it: neither a skip of the streak nor an applied step.
            return streak.collapse
        if code == _diagnostics.APPLIED:
            self._applied(step, streak)
            return None
        streak.skips += 1
        streak.reasons[self._reasons.names[code]] += 1
        if streak.collapse is not None:
            return streak.collapse
        return self._check(streak, step, session)

    def _applied(self, step, streak):
        """An applied step of ``step``'s op re-arms its streak."""
        if self.collapse is not None and self.collapse is streak.collapse:
            self.collapse = None
        self._streaks[step] = _Streak()

    def _check(self, streak, step, session):
        """The ``Collapse`` of ``streak`` if it is one now (acting on it), else None."""
        floors = tuple(type(floor.manager).__name__ for floor, (scale, streak_count)
                       in zip(self._floors,
                              session.run([[f.scale, f.streak] for f in self._floors]))
                       if floor.at_floor(scale, streak_count, self._after)
                       ) if self._floors else ()
        if streak.skips < self._after and not floors:
            return None
        streak.collapse = self.collapse = self._collapse(
            streak, step, _diagnostics.read_last_skip(session, self._train), floors)
        if self.on_collapse == "raise":
            raise LossScaleCollapse(self.collapse)
        tf.logging.warning(self.collapse.message)
        if self.on_collapse == "warn":
            warnings.warn(self.collapse.message, RuntimeWarning, stacklevel=3)
        return self.collapse

    def _observe_loop(self, code, session, streak):
        """``observe`` for a run of many device iterations: every skip of the
        run, read from the record's history with its streak, in order; then
        the run's last iteration (``code``)."""
        recent = _diagnostics.read_recent_skips(session, self._train)
        if recent and recent[-1].number < self._seen:  # a new session's record
            self._seen = 0
        new = [skip for skip in recent if skip.number > self._seen]
        if recent:
            self._seen = recent[-1].number
        found = None
        for skip in new:
            if skip.reason in self._reasons.holding:
                continue
            if skip.streak <= 1 and streak.skips:  # an applied step came before it
                self._applied(None, streak)
                streak = self._streaks[None]
            streak.skips = max(skip.streak, 1)
            streak.reasons[skip.reason] += 1
            if streak.collapse is None:
                found = self._check(streak, None, session)
        found = found or streak.collapse
        if code == _diagnostics.APPLIED:  # the run's last iteration applied
            self._applied(None, streak)
        return found

    def _warn_no_global_step(self):
        """Warns once that a device loop's streaks need a global step."""
        if self._warned_no_step:
            return
        self._warned_no_step = True
        message = ("npu_lossscale: a device loop runs a step without a global_step, so the "
                   "skip record cannot tell consecutive skips apart, and the collapse policy "
                   "sees each run's last iteration only. Pass build(global_step=...).")
        tf.logging.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _closes(self, window_end):
        """Whether the run closed a step, from its fetched ``window_end``."""
        if window_end is None:
            if self._windows:
                raise ValueError(
                    "window_end=None, but train_ops accumulates micro-batches and a run "
                    "that closes no window reads skip_reason 0. Pass the run's fetched "
                    "train.window_end.")
            return True
        if isinstance(window_end, np.ndarray) and window_end.shape == ():
            window_end = window_end[()]
        if not isinstance(window_end, (bool, np.bool_)):
            raise TypeError("window_end must be the bool fetched from train.window_end, got "
                            "%r (%s). Fetch it with update_op and pass its value."
                            % (window_end, type(window_end).__name__))
        return bool(window_end)

    def _collapse(self, streak, step, last_skip, floors):
        reasons = dict(streak.reasons)
        counts = ", ".join("%s %d" % (name, count) for name, count in
                           sorted(reasons.items(), key=lambda item: (-item[1], item[0])))
        of = "" if step is None else " of %s" % step
        message = ["npu_lossscale: the loss scale collapsed: %d consecutive skipped steps%s "
                   "(%s)" % (streak.skips, of, counts)]
        if floors:
            message[0] += ", %s at the floor" % ", ".join(floors)
        message[0] += "."
        if last_skip is not None:
            message.append("Last %s" % _diagnostics.describe(last_skip))
        seen = [] if last_skip is None else [last_skip.reason]
        for name in sorted(reasons, key=lambda item: (-reasons[item], item)):
            if name not in seen:
                message.append("Fix for %s: %s" % (name, self._reasons.fix(name)))
        return Collapse(streak.skips, reasons, last_skip, floors, " ".join(message))


def check_collapse_after(collapse_after):
    """``collapse_after`` as an int >= 1."""
    return _checks.check_count("collapse_after", collapse_after,
                               "Pass the consecutive skips that make a collapse, e.g. 20.")


def manager_list(managers):
    """``managers`` as a list; a single manager is refused, not iterated."""
    if hasattr(managers, "get_loss_scale") or not isinstance(
            managers, (list, tuple, set, frozenset)):
        raise TypeError("managers must be a list of managers, got %r. Pass e.g. "
                        "managers=[manager]." % (managers,))
    return list(managers)


def _reason_code(skip_reason, reasons):
    """A fetched ``skip_reason`` as an int code of ``reasons`` (the
    builder's): TypeError for a bool, a float or a tensor; ValueError for
    an unknown code."""
    if isinstance(skip_reason, (tf.Tensor, tf.Operation)) or _checks.is_variable(skip_reason):
        raise TypeError("skip_reason must be the value session.run fetched, got the tensor "
                        "%r. Fetch train.diagnosis.skip_reason with update_op and pass its value."
                        % (skip_reason.name,))
    if isinstance(skip_reason, np.ndarray) and skip_reason.shape == ():
        skip_reason = skip_reason[()]
    if isinstance(skip_reason, (bool, np.bool_)):
        raise TypeError("skip_reason must be a reason code, got the bool %r (is_finite or "
                        "applied?). Fetch train.diagnosis.skip_reason and pass its value."
                        % (skip_reason,))
    if not isinstance(skip_reason, (int, np.integer)):
        raise TypeError("skip_reason must be an int code of diagnostics.REASONS, got %r (%s). "
                        "Pass the value fetched from train.diagnosis.skip_reason."
                        % (skip_reason, type(skip_reason).__name__))
    if not 0 <= int(skip_reason) < len(reasons.reasons):
        raise ValueError("skip_reason must be a code in 0..%d, got %r. Pass the value "
                         "fetched from train.diagnosis.skip_reason."
                         % (len(reasons.reasons) - 1, skip_reason))
    return int(skip_reason)

