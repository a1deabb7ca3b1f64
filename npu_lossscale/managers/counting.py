"""The counting rule both dynamic managers share: ``_CountingLossScaleManager``
grows the scale after N finite steps and shrinks it after M bad ones, with
its state in one float32 vector (see the package docstring)."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import monitoring as _monitoring
from npu_lossscale.managers.base import _MAX_SCALE, LossScaleManager, _float32

# Positions in the state vector.
_SCALE, _GOOD, _BAD, _STREAK = 0, 1, 2, 3
_STATE_SIZE = 4
_INF = float("inf")


class _CountingLossScaleManager(LossScaleManager):
    """A scale that grows after N finite steps and shrinks after M bad ones.

    One rule covers both public dynamic managers. With ``good`` and ``bad`` the
    step counters::

      if finite:
        if good + 1 >= grow_every:  scale = grown(scale); good = bad = 0
        else:                       good += 1
      else:
        if bad + 1 >= shrink_every: scale = shrunk(scale); good = 0
                                    bad = shrink_every - 1 if keep_bad_at_shrink else 0
        else:                       bad += 1; good = 0

    With ``keep_bad_at_shrink`` False (contrib's and npu_bridge's rule),
    ``bad`` counts the overflows since the scale last changed; with it True
    (DeepSpeed's and Megatron's hysteresis), since the scale last grew: once
    ``shrink_every`` overflows have come, every further one shrinks the
    scale until it grows again.

    where ``grown(s) = min(s * incr, cap)`` if ``s`` is below the growth
    ceiling, else ``s``, with ``cap = min(max_loss_scale, 2**126)``
    (``base._MAX_SCALE``: above 2**126, 1/scale flushes to 0); and
    ``shrunk(s)`` is set by the subclass, floored at ``min_loss_scale``
    (at least 2**-126). The scale therefore stays in [min_loss_scale,
    2**126], inside the protocol's ``SCALE_RANGE``
    (``keeps_scale_in_range``).

    The state is one float32 vector ``[scale, good, bad, streak]``; ``streak``
    counts consecutive overflowing steps (for the floor warning). The update
    computes both branches as vectors and selects: each branch is described by
    a constant table, and the step's ``finite`` picks one table (one Select).
    """

    def __init__(self, init_loss_scale, grow_every, shrink_every, incr_ratio,
                 min_loss_scale, max_loss_scale, floor_warning_after,
                 growth_ceiling, name, scale_name_in_scope, keep_bad_at_shrink=False):
        self._init_loss_scale = float(init_loss_scale)
        # Checked by the subclass (_check_initial_scale) before any variable.
        self._floor_warning_after = (None if floor_warning_after is None
                                     else int(floor_warning_after))
        self._grow_every = int(grow_every)
        self._shrink_every = int(shrink_every)
        self._incr_ratio = float(incr_ratio)
        self._keep_bad_at_shrink = keep_bad_at_shrink
        # The floor as the float32 state holds it (0.1 is 0.100000001...), so
        # that the floor warning's comparison with the scale read is exact.
        self._min_loss_scale = _float32(float(min_loss_scale))
        self._max_loss_scale = None if max_loss_scale is None else float(max_loss_scale)
        self._growth_ceiling = growth_ceiling
        with tf.name_scope(None, default_name=name):
            self._state = tf.Variable(
                [self._init_loss_scale, 0.0, 0.0, 0.0], dtype=tf.float32,
                trainable=False, name="state")
            if scale_name_in_scope:
                self._values = self._named_values()
        if not scale_name_in_scope:
            self._values = self._named_values()

    def _named_values(self):
        # One Unpack named "loss_scale": "loss_scale:0" is the scale (as
        # npu_bridge's variable is), :1 good_steps, :2 bad_steps, :3 streak.
        # Built once; it reads the state whenever it is fetched.
        return tf.unstack(self._state.read_value(), num=_STATE_SIZE, name="loss_scale")

    def _shrink_factor(self):
        """The factor the shrinking branch multiplies the scale by."""
        raise NotImplementedError

    # -- public, read-only -------------------------------------------------

    @property
    def state(self):
        """The float32[4] state variable ``[scale, good, bad, streak]``."""
        return self._state

    @property
    def variables(self):
        """The state variables (one: ``state``), for savers and initialisers."""
        return [self._state]

    @property
    def loss_scale(self):
        """float32 scalar tensor: the current scale (the ``loss_scale:0``
        tensor, read whenever it is fetched)."""
        return self._values[_SCALE]

    @property
    def good_steps(self):
        """float32 scalar tensor: consecutive finite steps since the scale last
        changed or a step overflowed (resets at growth)."""
        return self._values[_GOOD]

    @property
    def bad_steps(self):
        """float32 scalar tensor: the back-off counter, not reset by finite
        steps (as in contrib). Exponential: overflowing steps since the scale
        last changed. Dynamic: overflowing steps since it last grew, at most
        ``hysteresis - 1`` (always 0 without hysteresis)."""
        return self._values[_BAD]

    @property
    def overflow_streak(self):
        """float32 scalar tensor: consecutive overflowing steps (saturates at
        2**24)."""
        return self._values[_STREAK]

    @property
    def initial_loss_scale(self):
        """The starting scale, a Python float."""
        return self._init_loss_scale

    @property
    def min_loss_scale(self):
        """The floor of the scale, a Python float."""
        return self._min_loss_scale

    @property
    def max_loss_scale(self):
        """The cap on growth as given, a Python float, or None for none (the
        scale never exceeds 2**126 either way)."""
        return self._max_loss_scale

    @property
    def floor_warning_after(self):
        """Consecutive overflows at the floor before the warning, or None."""
        return self._floor_warning_after

    # -- the protocol --------------------------------------------------------

    def get_loss_scale(self):
        # A fresh read for each caller; Unpack, not a strided slice (no index
        # constants, one op).
        return tf.unstack(self._state.read_value(), num=_STATE_SIZE)[_SCALE]

    def assign_loss_scale(self, scale):
        """The op that sets the scale to ``scale`` (a float32 scalar), within
        [min_loss_scale, max_loss_scale], and restarts the counters; a NaN
        ``scale`` leaves the state as it is (an optional protocol hook:
        ``base.assign_scale``)."""
        cap = _MAX_SCALE if self._max_loss_scale is None else min(self._max_loss_scale,
                                                                    _MAX_SCALE)
        new = tf.stack([tf.clip_by_value(scale, self._min_loss_scale, cap), 0.0, 0.0, 0.0])
        return tf.assign(self._state, tf.where(tf.is_nan(scale), self._state.read_value(),
                                               new)).op

    def _tables(self):
        """The finite and the non-finite branch as float32 [rows, 4] tables."""
        shrink_factor = self._shrink_factor()
        keep = [1.0, 0.0, 0.0, 1.0]  # scale kept, counters reset, streak kept
        floor = [self._min_loss_scale, 0.0, 0.0, 0.0]
        # The back-off counter after a shrink: reset (contrib), or held at
        # shrink_every - 1 by the cap below (hysteresis: factor 1, capped).
        bad_at_shrink = 1.0 if self._keep_bad_at_shrink else 0.0
        finite = [
            [1.0, 1.0, 1.0, 0.0],                      # mul: streak resets
            [0.0, 1.0, 0.0, 0.0],                      # add: good + 1
            [_INF, float(self._grow_every), _INF, _INF],     # event limit
            [self._growth_ceiling, _INF, _INF, _INF],  # grow only below this
            [self._incr_ratio, 0.0, 0.0, 1.0],         # event factor
            keep, floor,
        ]
        overflow = [
            [1.0, 0.0, 1.0, 1.0],                      # mul: good resets
            [0.0, 0.0, 1.0, 1.0],                      # add: bad + 1, streak + 1
            [_INF, _INF, float(self._shrink_every), _INF],   # event limit
            [_INF, _INF, _INF, _INF],                  # shrinking has no ceiling
            [shrink_factor, 0.0, bad_at_shrink, 1.0],  # event factor
            keep, floor,
        ]
        bad_cap = float(self._shrink_every - 1) if self._keep_bad_at_shrink else _INF
        cap = [self._scale_cap(), _INF, bad_cap, _INF]
        finite.append(cap)
        overflow.append(cap)
        if not self._ceiling_binds():
            del finite[3], overflow[3]
        return finite, overflow

    def _ceiling_binds(self):
        """Whether the growth ceiling can change an update: only when it is
        below the cap. From a scale at or above the ceiling the ceiling row
        keeps the scale, clipped to the cap; without it the grown scale
        (inf past the ceiling) is clipped to the cap too. The two differ
        only for a scale in [ceiling, cap). Both dynamic managers' defaults
        put the ceiling at about 2**127, above the 2**126 cap: the update
        then has no ceiling row, and two ops fewer."""
        return self._growth_ceiling < self._scale_cap()

    def _scale_cap(self):
        """The most the scale may grow to: ``min(max_loss_scale, 2**126)``."""
        if self._max_loss_scale is None:
            return _MAX_SCALE
        return min(self._max_loss_scale, _MAX_SCALE)

    def update_loss_scale(self, finite_grads):
        """Returns the op that moves the state by this step's finiteness.

        Both branches are computed as float32 vectors from
        ``candidate = state * mul + add`` (finite: ``[s, good+1, bad, 0]``;
        overflow: ``[s, 0, bad+1, streak+1]``); an event (growth or back-off
        due) is ``candidate >= limit`` anywhere, and then the state becomes
        ``candidate * factor`` clipped to [floor, cap] (one ``ClipByValue``;
        the cap is ``min(max_loss_scale, 2**126)``), with the factor falling
        back to ``keep`` where the scale is at its growth ceiling (where the
        ceiling is below the cap: ``_ceiling_binds``). One read, one assign.

        Args:
          finite_grads: bool scalar tensor (or Python bool).

        Returns:
          An op.
        """
        with tf.name_scope("update_loss_scale"):
            finite = tf.convert_to_tensor(finite_grads, dtype=tf.bool)
            finite_table, overflow_table = self._tables()
            rows = tf.unstack(tf.where(
                finite, tf.constant(finite_table, tf.float32),
                tf.constant(overflow_table, tf.float32)), num=len(finite_table))
            if self._ceiling_binds():
                mul, add, limit, ceiling, factor, keep, floor, cap = rows
            else:
                mul, add, limit, factor, _, floor, cap = rows
                ceiling = keep = None
            state = self._state.read_value()
            candidate = state * mul + add
            no_event = tf.reduce_all(tf.less(candidate, limit))
            if ceiling is not None:
                factor = tf.where(tf.less(candidate, ceiling), factor, keep)
            changed = tf.raw_ops.ClipByValue(t=candidate * factor, clip_value_min=floor,
                                             clip_value_max=cap)
            new_state = tf.where(no_event, candidate, changed)
            # The read above happens before the write below.
            with tf.control_dependencies([new_state]):
                return tf.assign(self._state, new_state, name="assign_state").op

    # -- the floor warning (monitoring.check_floor, on the properties above) --

    def check_floor(self, session):
        """Reads the scale once and warns, once per manager, of a collapse.

        The warning is due when the scale sits at ``min_loss_scale`` and the
        last ``floor_warning_after`` steps all overflowed. It is given with
        ``warnings.warn`` (RuntimeWarning) and ``tf.logging.warning``. Nothing
        in the training step checks this: call it every few hundred steps, or
        use ``floor_warning_hook`` with a MonitoredSession. The same as
        ``npu_lossscale.monitoring.check_floor(manager, session)``.

        Args:
          session: a ``tf.Session`` (or ``MonitoredSession``) of the
            manager's graph.

        Returns:
          Whether the warning is due (True on every call while it is).

        Raises:
          TypeError: if ``session`` is not a session.
          ValueError: if it runs another graph than the manager's.
        """
        return _monitoring.check_floor(self, session)

    def floor_warning_hook(self, every_n_steps=_monitoring.DEFAULT_WARNING_EVERY_N_STEPS):
        """A ``SessionRunHook`` that runs ``check_floor`` every N runs.

        Args:
          every_n_steps: how often to read the scale (one small copy), >= 1.

        Returns:
          A ``monitoring.FloorWarningHook``.
        """
        return _monitoring.FloorWarningHook([self], every_n_steps)
