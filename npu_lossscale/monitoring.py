"""What a user watches while training: TensorBoard summaries of the loss
scale, the skip decision and the skipped-steps count, a SessionRunHook that
logs them (for ``MonitoredTrainingSession`` and Estimator users), and the
floor warning of a collapsing scale (``check_floor``, ``FloorWarningHook``),
written on the managers' public properties."""

from __future__ import absolute_import, division, print_function

import collections
import warnings
import weakref

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
        every_n_steps = _checks.check_count("every_n_steps", every_n_steps,
                                            "Pass how often to log, e.g. 100.")
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


# How often FloorWarningHook reads the managers: one small device-to-host
# copy every this many runs, instead of a check on every step.
_DEFAULT_WARNING_EVERY_N_STEPS = 100

#: What the floor warning reads of a manager: its public properties.
_FLOOR_PROPERTIES = ("loss_scale", "overflow_streak", "min_loss_scale",
                     "floor_warning_after")

#: The managers whose floor warning was given: once per manager, whether
#: ``check_floor`` or a hook saw it first (held weakly).
_WARNED = weakref.WeakSet()


class _Floor(collections.namedtuple(
        "_Floor", ["manager", "scale", "streak", "min_loss_scale", "after"])):
    """What the floor warning reads of one manager.

    Attributes:
      manager: the manager.
      scale: its ``loss_scale``, a float32 scalar tensor read when fetched.
      streak: its ``overflow_streak`` (consecutive overflowing steps), the same.
      min_loss_scale: its floor, a Python float.
      after: its ``floor_warning_after``, an int, or None never to warn.
    """

    def warn_if_due(self, scale, streak):
        """Warns, once per manager, when the fetched values show a collapse.

        Returns:
          Whether the warning is due.
        """
        due = (self.after is not None and float(scale) <= self.min_loss_scale
               and float(streak) >= self.after)
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
    """The ``_Floor`` of ``manager``, from its public properties.

    Raises:
      TypeError: if it lacks one of ``_FLOOR_PROPERTIES``, or cannot be
        remembered as warned (unhashable, or no weak references).
    """
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

    The warning is due when the scale sits at ``min_loss_scale`` and the
    last ``floor_warning_after`` steps all overflowed. No loss scale helps
    then: a float16 op overflows in the forward pass, or the data holds
    inf/nan. It is given with ``warnings.warn`` (RuntimeWarning) and
    ``tf.logging.warning``. Any manager with the public properties
    ``loss_scale``, ``overflow_streak`` (float32 scalar tensors read when
    fetched), ``min_loss_scale`` and ``floor_warning_after`` works; fetching
    them adds no op (finalized graphs).

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
    graph = getattr(session, "graph", None)
    if not isinstance(graph, tf.Graph) or not callable(getattr(session, "run", None)):
        raise TypeError("session must be a tf.Session or MonitoredSession, got %r (%s). "
                        "Pass the session that runs the training step."
                        % (session, type(session).__name__))
    if graph is not floor.scale.graph:
        raise ValueError("session must run the graph of %s, got %r, which runs another "
                         "graph. Pass the training step's session, e.g. "
                         "tf.Session(graph=<the manager's graph>)."
                         % (type(manager).__name__, session))
    return floor.warn_if_due(*session.run([floor.scale, floor.streak]))


class FloorWarningHook(tf.train.SessionRunHook):
    """Warns once per manager when its scale collapses (see ``check_floor``).

    Every ``every_n_steps`` runs it fetches each manager's ``loss_scale`` and
    ``overflow_streak`` along with the run's own fetches, so the check costs
    nothing on the other runs. Example::

      hook = npu_lossscale.monitoring.FloorWarningHook([d_manager, g_manager])
      with tf.train.MonitoredTrainingSession(hooks=[hook]) as sess:
          ...

    Args:
      managers: managers with the public properties ``check_floor`` reads
        (this package's dynamic managers have them).
      every_n_steps: how often to read them, >= 1 (an int or integral float).

    Raises:
      TypeError: if a manager lacks one of the properties.
      ValueError: if ``every_n_steps`` < 1.
    """

    def __init__(self, managers, every_n_steps=_DEFAULT_WARNING_EVERY_N_STEPS):
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


def _check_train_ops(train_ops):
    if not all(hasattr(train_ops, field) for field in ("loss_scale", "applied",
                                                        "skipped_steps", "clear_status")):
        raise TypeError(
            "train_ops must be the TrainOps returned by MultiOptimizerLossScale.build(), "
            "got %r." % (train_ops,))
