"""What a user watches while training: TensorBoard summaries of the loss
scale, the skip decision and the skipped-steps count, and a SessionRunHook
that logs them (for ``MonitoredTrainingSession`` and Estimator users)."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import checks as _checks


def summaries(train_ops, family="loss_scale", step_applied=False):
    """Adds ``tf.summary.scalar`` summaries of the loss-scale state.

    The scalars read state only, so fetching them (or
    ``tf.summary.merge_all()``) never runs a training step: with
    ``update_op``, ``per_group[name]``, or alone. They are
    ``<family>/scale`` (the builder manager's scale, before this run's
    update), ``<family>/skipped_total`` (the skipped-steps count before this
    run: it rises by one after each skipped step) and, when groups use scales
    of their own, ``<family>/scale_<group>``. They are added to
    ``tf.GraphKeys.SUMMARIES``.

    Args:
      train_ops: the ``TrainOps`` returned by ``MultiOptimizerLossScale.build``.
      family: the name prefix of the scalars.
      step_applied: also return ``<family>/step_applied`` (1 when this run's
        joint step applied, else 0) as the last element. It is computed by
        the joint step, so fetching it runs ``update_op``: it is kept out of
        ``tf.GraphKeys.SUMMARIES`` (``merge_all`` never picks it up); merge
        it yourself and fetch it with ``update_op`` only.

    Returns:
      The list of summary tensors.

    Raises:
      TypeError: if ``train_ops`` is not a ``TrainOps`` or ``step_applied``
        not a bool.
    """
    _check_train_ops(train_ops)
    _checks.check_bool("step_applied", step_applied,
                           "Pass True to also get the joint step's applied flag.")
    with tf.name_scope(None):
        result = [
            tf.summary.scalar("%s/scale" % family, train_ops.loss_scale),
            tf.summary.scalar("%s/skipped_total" % family, train_ops.skipped_steps),
        ]
        scales = train_ops.loss_scales
        if len(set(tensor.name for tensor in scales.values())) > 1:
            result.extend(tf.summary.scalar("%s/scale_%s" % (family, name), scale)
                          for name, scale in sorted(scales.items()))
        if step_applied:
            result.append(tf.summary.scalar(
                "%s/step_applied" % family, tf.cast(train_ops.applied, tf.float32),
                collections=[]))
    return result


class LossScaleHook(tf.train.SessionRunHook):
    """Logs the loss scale and the skipped steps every N runs.

    Example::

      train = scaler.build(global_step=tf.train.get_or_create_global_step())
      hook = npu_lossscale.LossScaleHook(train, every_n_steps=100)
      with tf.train.MonitoredTrainingSession(hooks=[hook]) as sess:
          while not sess.should_stop():
              sess.run(train.update_op)

    Args:
      train_ops: the ``TrainOps`` of the step.
      every_n_steps: log once every this many runs of the session.

    Raises:
      TypeError: for a wrong ``train_ops`` or a non-int ``every_n_steps``.
      ValueError: for ``every_n_steps`` < 1.
    """

    def __init__(self, train_ops, every_n_steps=100):
        _check_train_ops(train_ops)
        _checks.check_number("every_n_steps", every_n_steps, minimum=1, integer=True,
                                 hint="Pass how often to log, e.g. 100.")
        self._train = train_ops
        self._every = every_n_steps
        self._runs = 0
        self.last = None  #: the last logged values, a dict (for tests and tools)

    def before_run(self, run_context):
        del run_context
        self._runs += 1
        if self._runs % self._every:
            return None
        return tf.train.SessionRunArgs({"scale": self._train.loss_scale,
                                        "skipped_steps": self._train.skipped_steps})

    def after_run(self, run_context, run_values):
        del run_context
        if run_values.results:
            self.last = dict(run_values.results)
            tf.logging.info("loss scale %g, %d skipped steps before run %d",
                            self.last["scale"], self.last["skipped_steps"], self._runs)


# How often FloorWarningHook reads the state: one 16-byte device-to-host copy
# every this many runs, instead of a check on every step.
_DEFAULT_WARNING_EVERY_N_STEPS = 100


class FloorWarningHook(tf.train.SessionRunHook):
    """Warns once per manager when its scale collapses (see ``check_floor``).

    Every ``every_n_steps`` runs it fetches the managers' state vectors along
    with the run's own fetches, so the check costs nothing on the other runs.

    Args:
      managers: dynamic managers of this package.
      every_n_steps: how often to read the state, >= 1.

    Raises:
      TypeError: if a manager is not one of this package's dynamic managers.
      ValueError: if ``every_n_steps`` < 1.
    """

    def __init__(self, managers, every_n_steps=_DEFAULT_WARNING_EVERY_N_STEPS):
        # pylint: disable=import-outside-toplevel,cyclic-import
        from npu_lossscale.managers.counting import _CountingLossScaleManager
        every_n_steps = _checks.check_count("every_n_steps", every_n_steps,
                                            hint="Pass e.g. 100.")
        managers = list(managers)
        for manager in managers:
            if not isinstance(manager, _CountingLossScaleManager):
                raise TypeError(
                    "managers must be DynamicLossScaleManager or "
                    "ExponentialUpdateLossScaleManager instances, got %r. Pass "
                    "this package's dynamic managers." % (manager,))
        self._managers = managers
        self._every = every_n_steps
        self._runs = 0
        self._reads = None

    def begin(self):
        self._reads = [list(manager._values) for manager in self._managers]  # pylint: disable=protected-access

    def before_run(self, run_context):
        self._runs += 1
        if self._runs % self._every:
            return None
        return tf.train.SessionRunArgs(self._reads)

    def after_run(self, run_context, run_values):
        if run_values.results is None:
            return
        for manager, values in zip(self._managers, run_values.results):
            manager._check_floor_values(values)  # pylint: disable=protected-access


def _check_train_ops(train_ops):
    if not all(hasattr(train_ops, field) for field in ("loss_scale", "applied",
                                                        "skipped_steps", "clear_status")):
        raise TypeError(
            "train_ops must be the TrainOps returned by MultiOptimizerLossScale.build(), "
            "got %r." % (train_ops,))
