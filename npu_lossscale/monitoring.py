"""What a user watches while training: the summaries, ``LossScaleHook``, the
collapse policy (``CollapseMonitor``) and the floor warning (``check_floor``,
``FloorWarningHook``)."""

from __future__ import absolute_import, division, print_function

import collections
import warnings
import weakref

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale.core import checks as _checks
from npu_lossscale import device_loop as _device_loop
from npu_lossscale import diagnostics as _diagnostics
from npu_lossscale.core import graph_state as _graph_state
from npu_lossscale.core import graph_walk as _graph_walk


def summaries(train_ops, family="loss_scale", step_applied=False, iterations_per_loop=None):
    """Adds ``tf.summary.scalar`` summaries of the loss-scale state.

    They read state only, so fetching them never runs a step:
    ``<family>/scale`` and ``<family>/skipped_total`` (before this run's
    update), ``<family>/skips_<reason>`` for each reason but "applied",
    ``<family>/overflows_<group>``, and ``<family>/scale_<group>`` when
    groups have scales of their own. They go to ``tf.GraphKeys.SUMMARIES``.

    Args:
      train_ops: the ``TrainOps`` returned by ``MultiOptimizerLossScale.build``.
      family: the name prefix of the scalars.
      step_applied: also return ``<family>/step_applied`` (1 when this run's
        step applied) last. Fetching it runs ``update_op``, so it is kept out
        of ``tf.GraphKeys.SUMMARIES``: fetch it with ``update_op`` only.
      iterations_per_loop: under a device loop of this many steps per
        ``session.run``, also return ``<family>/skipped_in_loop`` last: how
        many of the last ``iterations_per_loop`` steps skipped, this one
        included, read after the step (from the record's history and the
        global step), so at a run's last iteration, the one the host sees,
        the run's skips. Like ``step_applied`` it runs ``update_op`` and is
        kept out of ``tf.GraphKeys.SUMMARIES``: fetch it with the loop's
        op. Needs a step built with ``global_step`` (the graph's) and
        ``count_skipped_steps=True``.

    Returns:
      The list of summary tensors.

    Raises:
      TypeError: if ``train_ops`` is not a ``TrainOps``, ``step_applied``
        not a bool, or ``iterations_per_loop`` not an int.
      ValueError: for ``iterations_per_loop`` < 1, or with a step that does
        not count its skipped steps in the graph's global step.
    """
    _checks.check_train_ops(train_ops)
    _checks.check_bool("step_applied", step_applied,
                           "Pass True to also get the joint step's applied flag.")
    loop_steps = None
    if iterations_per_loop is not None:
        loop_steps = _checks.check_count("iterations_per_loop", iterations_per_loop,
                                         "Pass the device loop's steps per run, e.g. 1000.")
        global_step = tf.train.get_global_step(train_ops.update_op.graph)
        if train_ops.counts_skipped_steps is not True or global_step is None:
            raise ValueError(
                "iterations_per_loop=%r needs a step whose global step counts every "
                "iteration, got counts_skipped_steps=%r. Build with "
                "global_step=tf.train.get_or_create_global_step() and "
                "count_skipped_steps=True." % (iterations_per_loop,
                                               train_ops.counts_skipped_steps))
    with tf.name_scope(None):
        result = [
            tf.summary.scalar("%s/scale" % family, train_ops.loss_scale),
            tf.summary.scalar("%s/skipped_total" % family, train_ops.skipped_steps),
        ]
        record = train_ops.diagnosis.last_skip
        known = _diagnostics.REASONS[:record.reason_counts.shape.as_list()[0]]
        result.extend(
            tf.summary.scalar("%s/skips_%s" % (family, reason), record.reason_counts[code])
            for code, reason in enumerate(known) if code != _diagnostics.APPLIED)
        group_names = [_diagnostics.decoded(name)
                       for name in tf.get_static_value(record.group_names)]
        result.extend(
            tf.summary.scalar("%s/overflows_%s" % (family, name), record.group_counts[index])
            for index, name in enumerate(group_names))
        scales = dict((name, group.loss_scale) for name, group in train_ops.groups.items())
        if len(set(tensor.name for tensor in scales.values())) > 1:
            result.extend(tf.summary.scalar("%s/scale_%s" % (family, name), scale)
                          for name, scale in sorted(scales.items()))
        if step_applied:
            result.append(tf.summary.scalar(
                "%s/step_applied" % family, tf.cast(train_ops.applied, tf.float32),
                collections=[]))
        if loop_steps is not None:
            result.append(tf.summary.scalar(
                "%s/skipped_in_loop" % family,
                _skipped_in_loop(train_ops, global_step, loop_steps), collections=[]))
    return result


def _skipped_in_loop(train_ops, global_step, steps):
    """float32 scalar: the skips among the last ``steps`` global steps,
    this run's included, read after ``update_op``."""
    record = _graph_state.of(train_ops.update_op.graph).records[train_ops.update_op.name]
    with tf.control_dependencies([train_ops.update_op]):
        recent = record.recent_skips()
        now = tf.cast(global_step.read_value(), tf.int64)
    # A skip's global step is the one it ran at, before the step's increment.
    inside = tf.logical_and(tf.greater(recent.number, 0),
                            tf.greater_equal(recent.global_step, now - steps))
    return tf.reduce_sum(tf.cast(inside, tf.float32))


#: What the collapse policy does (``CollapseMonitor``, ``LossScaleHook``).
COLLAPSE_ACTIONS = ("warn", "stop", "raise")
#: The managers' own ``floor_warning_after``.
_DEFAULT_COLLAPSE_AFTER = 20
#: Fetch sets ``_StepRuns`` remembers before it starts again (a loop has a few).
_MAX_KNOWN_FETCHES = 256


class LossScaleHook(tf.train.SessionRunHook):
    """Logs the loss scale and the skipped steps every N runs, and acts on
    a collapse when asked.

    Example::

      train = scaler.build(global_step=tf.train.get_or_create_global_step())
      hook = npu_lossscale.LossScaleHook(train, every_n_steps=100,
                                         on_collapse="stop", collapse_after=20)
      with tf.train.MonitoredTrainingSession(hooks=[hook]) as sess:
          while not sess.should_stop():
              sess.run(train.update_op)

    With ``on_collapse``, the hook watches every run of a step op of
    ``train_ops`` (``update_op``, a tensor or op that depends on it, a
    ``per_group`` op), found by walking back from the fetches once per set
    of fetches. A joint step's run also fetches ``skip_reason`` and
    ``window_end``; a per-group op's run fetches ``skipped_steps``, and the
    hook reads the count and the reason in one small run after it. Each
    step op keeps its own streak, so in an alternating loop one network's
    applied steps do not hide the other's skips. At a collapse
    (``CollapseMonitor``) the hook warns ("warn"), asks the session to stop
    ("stop") or raises ``LossScaleCollapse`` ("raise"). Under a device loop
    (tf_adapter's ``IterationOp``, ``iterations_per_loop``) the monitor reads
    every iteration's skips after each run.

    When the session starts, a device loop over a step op of ``train_ops``
    is checked (``device_loop.check_loop``): a loop over one per-group op
    of several, or over a step whose ``global_step`` stands still on skips,
    is a ValueError in ``begin()``.

    Args:
      train_ops: the ``TrainOps`` of the step.
      every_n_steps: log once every this many runs of the session.
      on_collapse: None (no collapse policy), "warn", "stop" or "raise".
      collapse_after: the number of consecutive skipped steps (or
        overflows at a manager's floor) that make a collapse; 20 when not
        given. Only with ``on_collapse``.
      managers: a list of managers whose floor also counts
        (``check_floor``), read on skipped runs only. Only with
        ``on_collapse``.

    Raises:
      TypeError: for a wrong ``train_ops``, a non-int count, or a manager
        without the floor properties.
      ValueError: for a count < 1, an unknown ``on_collapse``, or
        ``collapse_after`` or ``managers`` without ``on_collapse``.
    """

    def __init__(self, train_ops, every_n_steps=100, on_collapse=None,
                 collapse_after=None, managers=()):
        _checks.check_train_ops(train_ops)
        every_n_steps = _checks.check_count("every_n_steps", every_n_steps,
                                            "Pass how often to log, e.g. 100.")
        managers = _manager_list(managers)
        if collapse_after is None:
            collapse_after = _DEFAULT_COLLAPSE_AFTER
        else:
            collapse_after = _check_collapse_after(collapse_after)
            if on_collapse is None:
                raise ValueError("collapse_after=%r acts only with on_collapse, got "
                                 "on_collapse=None. Pass on_collapse='warn', 'stop' or "
                                 "'raise'." % (collapse_after,))
        if managers and on_collapse is None:
            raise ValueError("managers=%r act only with on_collapse, got on_collapse=None. "
                             "Pass on_collapse='warn', 'stop' or 'raise', or use "
                             "FloorWarningHook(managers)." % (managers,))
        self._train = train_ops
        self._every = every_n_steps
        self._runs = 0
        #: The last logged values, a dict (for tests and tools): "scale",
        #: "skipped_steps" and "skipped_since_last_log" (None at the first
        #: log); under a device loop the last counts every iteration's skips.
        self.last = None
        #: The ``CollapseMonitor`` of ``on_collapse``, or None.
        self.monitor = None
        self._step_runs = _StepRuns(train_ops)
        self._step = None  # the step op of the current run, a _StepOp or None
        if on_collapse is not None:
            self.monitor = CollapseMonitor(train_ops, collapse_after=collapse_after,
                                           on_collapse=on_collapse, managers=managers)

    def begin(self):
        """Checks a device loop over a step op of ``train_ops``.

        Raises:
          ValueError: for a loop ``device_loop.check_loop`` finds wrong.
        """
        loop = _device_loop.iteration_op(self._train.update_op.graph)
        problems = [] if loop is None else _loop_problems(self._train, loop, self._step_runs)
        if problems:
            raise ValueError("npu_lossscale.LossScaleHook: " + " ".join(problems))

    def before_run(self, run_context):
        self._runs += 1
        fetches = {}
        if not self._runs % self._every:
            fetches.update(scale=self._train.loss_scale,
                           skipped_steps=self._train.skipped_steps)
        self._step = None
        if self.monitor is not None:
            self._step = self._step_runs.of(run_context.original_args.fetches)
            if self._step is not None and self._step.joint:
                fetches.update(skip_reason=self._train.diagnosis.skip_reason,
                               window_end=self._train.window_end)
            elif self._step is not None:
                fetches.update(skipped_before=self._train.skipped_steps)
        return tf.train.SessionRunArgs(fetches) if fetches else None

    def after_run(self, run_context, run_values):
        results = run_values.results or {}
        if "scale" in results:
            since = (None if self.last is None
                     else int(results["skipped_steps"]) - int(self.last["skipped_steps"]))
            self.last = {"scale": results["scale"], "skipped_steps": results["skipped_steps"],
                         "skipped_since_last_log": since}
            tf.logging.info("loss scale %g, %d skipped steps before run %d%s",
                            self.last["scale"], self.last["skipped_steps"], self._runs,
                            "" if since is None else " (%d since the last log)" % since)
        if self._step is None:
            return
        session = run_context.session
        if self._step.joint:
            reason, window_end = results["skip_reason"], results["window_end"]
        else:
            # The count moved in this run iff it skipped; the record holds why.
            after, reason = session.run([self._train.skipped_steps,
                                         self._train.diagnosis.last_skip.reason])
            window_end = True
            if after <= results["skipped_before"]:
                reason = _diagnostics.APPLIED
        collapse = self.monitor.observe(reason, session, window_end=window_end,
                                        step=self._step.key)
        if collapse is not None and self.monitor.on_collapse == "stop":
            run_context.request_stop()


def _loop_problems(train_ops, loop, step_runs=None):
    """``device_loop.check_loop`` of the step op of ``train_ops`` that the
    device loop ``loop`` (the ``IterationOp``) runs; no problem when it runs
    none of them.

    Args:
      train_ops: the ``TrainOps``.
      loop: the ``IterationOp``.
      step_runs: the ``_StepRuns`` of ``train_ops``, or None to make one.

    Returns:
      A list of sentences, each a problem and its fix.
    """
    step = (step_runs or _StepRuns(train_ops)).of([loop])
    if step is None:
        return []
    return _device_loop.check_loop(train_ops, _device_loop.Looped(loop, step.name, step.joint))


class _StepOp(collections.namedtuple("_StepOp", ["key", "joint", "name"])):
    """A step op of a ``TrainOps``, as the hook watches it.

    Attributes:
      key: its streak's key for ``CollapseMonitor.observe``: None for the
        joint step, "per_group['<name>']" for a per-group op.
      joint: whether it is the joint step (``update_op``).
      name: None for the joint step, else the per-group op's group name.
    """


class _StepRuns(object):
    """Which step op of a ``TrainOps`` a run runs: the one its fetches depend
    on, over data and control edges. Reads the graph only (finalized is
    fine), once per set of fetches."""

    def __init__(self, train_ops):
        self._graph = train_ops.update_op.graph
        self._targets = {train_ops.update_op: _StepOp(None, True, None)}
        for name, op in train_ops.per_group.items():
            self._targets[op] = _StepOp("per_group[%r]" % (name,), False, name)
        self._known = {}

    def of(self, fetches):
        """The ``_StepOp`` a run of ``fetches`` (any form ``session.run``
        takes) runs, or None."""
        ops = frozenset(self._fetched_ops(fetches))
        if ops not in self._known:
            if len(self._known) >= _MAX_KNOWN_FETCHES:
                self._known.clear()
            found = _graph_walk.first_reached(
                ops, lambda op: [tensor.op for tensor in op.inputs] + list(op.control_inputs),
                self._targets)
            self._known[ops] = None if found is None else self._targets[found]
        return self._known[ops]

    def _fetched_ops(self, fetches):
        """The ops of ``fetches``; what is not of this graph is left to
        ``session.run`` to refuse."""
        stack = [fetches]
        while stack:
            fetch = stack.pop()
            if isinstance(fetch, dict):
                stack.extend(fetch.values())
            elif isinstance(fetch, (list, tuple)):
                stack.extend(fetch)
            elif isinstance(fetch, (tf.SparseTensor, tf.IndexedSlices)):
                stack.extend(part for part in (fetch.indices, fetch.values, fetch.dense_shape)
                             if part is not None)
            else:
                try:
                    element = self._graph.as_graph_element(fetch, allow_tensor=True,
                                                           allow_operation=True)
                except (TypeError, ValueError, KeyError):
                    continue
                yield element if isinstance(element, tf.Operation) else element.op


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

    def __init__(self, train_ops, collapse_after=_DEFAULT_COLLAPSE_AFTER, on_collapse="warn",
                 managers=()):
        _checks.check_train_ops(train_ops)
        self._after = _check_collapse_after(collapse_after)
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
        self._floors = [_floor(manager) for manager in _manager_list(managers)]
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
            an int code of ``diagnostics.REASONS``.
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
        code = _reason_code(skip_reason)
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
            problems = _loop_problems(self._train, loop)
            if problems:
                raise ValueError("npu_lossscale.CollapseMonitor: " + " ".join(problems))
        if step is None and loop is not None:
            if self._train.counts_skipped_steps is not None:
                return self._observe_loop(code, session, streak)
            self._warn_no_global_step()
        if not closes or _diagnostics.REASONS[code] in _diagnostics.HOLDING_REASONS:
            # A skip that holds the scale (asked for, a loss spike) says
            # nothing of it: neither a skip of the streak nor an applied step.
            return streak.collapse
        if code == _diagnostics.APPLIED:
            self._applied(step, streak)
            return None
        streak.skips += 1
        streak.reasons[_diagnostics.REASONS[code]] += 1
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
            if skip.reason in _diagnostics.HOLDING_REASONS:
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
                message.append("Fix for %s: %s" % (
                    name, _diagnostics.FIXES[_diagnostics.REASONS.index(name)]))
        return Collapse(streak.skips, reasons, last_skip, floors, " ".join(message))


def _check_collapse_after(collapse_after):
    """``collapse_after`` as an int >= 1."""
    return _checks.check_count("collapse_after", collapse_after,
                               "Pass the consecutive skips that make a collapse, e.g. 20.")


def _manager_list(managers):
    """``managers`` as a list; a single manager is refused, not iterated."""
    if hasattr(managers, "get_loss_scale") or not isinstance(
            managers, (list, tuple, set, frozenset)):
        raise TypeError("managers must be a list of managers, got %r. Pass e.g. "
                        "managers=[manager]." % (managers,))
    return list(managers)


def _reason_code(skip_reason):
    """A fetched ``skip_reason`` as an int code (TypeError for a bool, a
    float or a tensor; ValueError for an unknown code)."""
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
    if not 0 <= int(skip_reason) < len(_diagnostics.REASONS):
        raise ValueError("skip_reason must be a code in 0..%d, got %r. Pass the value "
                         "fetched from train.diagnosis.skip_reason."
                         % (len(_diagnostics.REASONS) - 1, skip_reason))
    return int(skip_reason)


# One small device-to-host copy every this many runs, not a check per step.
DEFAULT_WARNING_EVERY_N_STEPS = 100

#: What the floor warning reads of a manager: its public properties.
_FLOOR_PROPERTIES = ("loss_scale", "overflow_streak", "min_loss_scale",
                     "floor_warning_after")

#: The managers already warned of (once each, whoever saw it first).
_WARNED = weakref.WeakSet()


class _Floor(collections.namedtuple(
        "_Floor", ["manager", "scale", "streak", "min_loss_scale", "after"])):
    """What the floor warning reads of one manager: its ``loss_scale`` and
    ``overflow_streak`` tensors, its floor, and ``floor_warning_after``."""

    def at_floor(self, scale, streak, after):
        """Whether fetched values show the scale at its floor after at least
        ``after`` consecutive overflows (never for ``after`` None)."""
        return (after is not None and float(scale) <= self.min_loss_scale
                and float(streak) >= after)

    def warn_if_due(self, scale, streak):
        """Warns, once per manager, when the fetched values show a collapse;
        returns whether they do."""
        due = self.at_floor(scale, streak, self.after)
        if due and self.manager not in _WARNED:
            _WARNED.add(self.manager)
            message = (
                "npu_lossscale: the loss scale of %s sits at its floor (%g) after %d "
                "consecutive overflowing steps, so no scale can help. Keep softmax "
                "and losses in float32, or check the input for inf/nan."
                % (type(self.manager).__name__, self.min_loss_scale, float(streak)))
            tf.logging.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
        return due


def _floor(manager, argument="managers"):
    """The ``_Floor`` of ``manager``; TypeError if it lacks a property of
    ``_FLOOR_PROPERTIES`` or cannot be weakly referenced."""
    missing = [name for name in _FLOOR_PROPERTIES if not hasattr(manager, name)]
    if missing:
        raise TypeError(
            "%s must expose %s, got %r without %s. Pass a DynamicLossScaleManager "
            "or ExponentialUpdateLossScaleManager, or add those properties."
            % (argument, ", ".join(_FLOOR_PROPERTIES), manager, ", ".join(missing)))
    try:
        hash(weakref.ref(manager))
    except TypeError:
        raise TypeError("%s must be hashable and weakly referenceable, got %r. Pass "
                        "an object with the default __hash__." % (argument, manager))
    return _Floor(manager, manager.loss_scale, manager.overflow_streak,
                  float(manager.min_loss_scale), manager.floor_warning_after)


def check_floor(manager, session):
    """Reads ``manager``'s scale once and warns, once per manager, of a collapse.

    The warning (RuntimeWarning and log) is due when the scale sits at
    ``min_loss_scale`` and the last ``floor_warning_after`` steps all
    overflowed: no scale helps then, the forward pass or the data is at
    fault. Any manager with the properties ``loss_scale``,
    ``overflow_streak``, ``min_loss_scale`` and ``floor_warning_after``
    works; it adds no op.

    Args:
      manager: the manager.
      session: a ``tf.Session`` (or ``MonitoredSession``) of its graph.

    Returns:
      Whether the warning is due (True on every call while it is).

    Raises:
      TypeError: if ``session`` is not a session, or the manager lacks a
        property.
      ValueError: if ``session`` runs another graph than the manager's.
    """
    floor = _floor(manager, "manager")
    _checks.check_session(session, floor.scale.graph, type(manager).__name__)
    return floor.warn_if_due(*session.run([floor.scale, floor.streak]))


class FloorWarningHook(tf.train.SessionRunHook):
    """Warns once per manager when its scale collapses (see ``check_floor``).

    It fetches the managers' ``loss_scale`` and ``overflow_streak`` with
    every ``every_n_steps``-th run. Example::

      hook = npu_lossscale.monitoring.FloorWarningHook([d_manager, g_manager])
      with tf.train.MonitoredTrainingSession(hooks=[hook]) as sess:
          ...

    Args:
      managers: managers with the properties ``check_floor`` reads.
      every_n_steps: how often to read them, >= 1.

    Raises:
      TypeError: if a manager lacks one of the properties.
      ValueError: if ``every_n_steps`` < 1.
    """

    def __init__(self, managers, every_n_steps=DEFAULT_WARNING_EVERY_N_STEPS):
        every_n_steps = _checks.check_count("every_n_steps", every_n_steps,
                                            hint="Pass e.g. 100.")
        self._floors = [_floor(manager) for manager in managers]
        self._every = every_n_steps
        self._runs = 0

    def before_run(self, run_context):
        del run_context
        self._runs += 1
        if self._runs % self._every:
            return None
        return tf.train.SessionRunArgs([[floor.scale, floor.streak]
                                        for floor in self._floors])

    def after_run(self, run_context, run_values):
        del run_context
        if run_values.results is None:
            return
        for floor, (scale, streak) in zip(self._floors, run_values.results):
            floor.warn_if_due(scale, streak)
