"""``LossScaleHook``: logs the scale and the skipped steps every N runs,
and feeds the collapse policy from each run of a step op."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale.core import checks as _checks
from npu_lossscale import device_loop as _device_loop
from npu_lossscale import diagnostics as _diagnostics
from npu_lossscale.monitoring import collapse as _collapse
from npu_lossscale.monitoring import step_ops as _step_ops


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
        managers = _collapse.manager_list(managers)
        if collapse_after is None:
            collapse_after = _collapse.DEFAULT_COLLAPSE_AFTER
        else:
            collapse_after = _collapse.check_collapse_after(collapse_after)
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
        self._step_runs = _step_ops.StepRuns(train_ops)
        self._step = None  # the step op of the current run, a StepOp or None
        if on_collapse is not None:
            self.monitor = _collapse.CollapseMonitor(train_ops, collapse_after=collapse_after,
                                           on_collapse=on_collapse, managers=managers)

    def begin(self):
        """Checks a device loop over a step op of ``train_ops``.

        Raises:
          ValueError: for a loop ``device_loop.check_loop`` finds wrong.
        """
        loop = _device_loop.iteration_op(self._train.update_op.graph)
        problems = ([] if loop is None
                    else _step_ops.loop_problems(self._train, loop, self._step_runs))
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

