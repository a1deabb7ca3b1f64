"""The floor warning: a manager's scale at ``min_loss_scale`` after
``floor_warning_after`` consecutive overflows (``check_floor``,
``FloorWarningHook``)."""

from __future__ import absolute_import, division, print_function

import collections
import warnings
import weakref

import tensorflow.compat.v1 as tf

from npu_lossscale.core import checks as _checks

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


def floor_of(manager, argument="managers"):
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
    floor = floor_of(manager, "manager")
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
        self._floors = [floor_of(manager) for manager in managers]
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
