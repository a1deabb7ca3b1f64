"""The counting rule both dynamic managers share.

The state is one non-trainable float32 variable ``[scale, good, bad,
streak]``, moved by one assign per step and saved by ``tf.train.Saver``:

* float32, not int32: TF keeps int32 tensors in host memory on a GPU, so
  int32 counters would cost host/device copies in every step;
* float32 counts exactly up to 2**24: the periods are capped there and the
  counters reset at them; ``streak`` saturates there, harmlessly (only the
  floor warning reads it);
* the update is elementwise ops and selects: no cond, and no ``IsFinite``,
  which Ascend's saturation mode lacks.
"""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import monitoring as _monitoring
from npu_lossscale.managers.base import _MAX_SCALE, LossScaleManager, _float32

# Positions in the state vector.
_SCALE, _GOOD, _BAD, _STREAK = 0, 1, 2, 3
_STATE_SIZE = 4
_INF = float("inf")


class _CountingLossScaleManager(LossScaleManager):
    """A scale that grows after N finite steps and shrinks after M bad ones::

      if finite:
        if good + 1 >= grow_every:  scale = grown(scale); good = bad = 0
        else:                       good += 1
      else:
        if bad + 1 >= shrink_every: scale = shrunk(scale); good = 0
                                    bad = shrink_every - 1 if keep_bad_at_shrink else 0
        else:                       bad += 1; good = 0

    where ``grown(s) = min(s * incr, cap)`` below the growth ceiling (else
    ``s``), ``cap = min(max_loss_scale, 2**126)``, and ``shrunk(s)`` is the
    subclass's, floored at ``min_loss_scale``: the scale stays in
    ``SCALE_RANGE``. ``keep_bad_at_shrink`` False (contrib, npu_bridge):
    ``bad`` counts overflows since the scale last changed; True (DeepSpeed's
    and Megatron's hysteresis): since it last grew. ``streak`` counts
    consecutive overflows, for the floor warning.
    """

    def __init__(self, init_loss_scale, grow_every, shrink_every, incr_ratio,
                 min_loss_scale, max_loss_scale, floor_warning_after,
                 growth_ceiling, name, scale_name_in_scope, keep_bad_at_shrink=False):
        self._init_loss_scale = float(init_loss_scale)
        self._floor_warning_after = (None if floor_warning_after is None
                                     else int(floor_warning_after))
        self._grow_every = int(grow_every)
        self._shrink_every = int(shrink_every)
        self._incr_ratio = float(incr_ratio)
        self._keep_bad_at_shrink = keep_bad_at_shrink
        # As float32 holds it, for the floor warning's exact comparison.
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
        # One Unpack named "loss_scale": "loss_scale:0" is the scale, as
        # npu_bridge's variable is.
        return tf.unstack(self._state.read_value(), num=_STATE_SIZE, name="loss_scale")

    def _shrink_factor(self):
        """The factor the shrinking branch multiplies the scale by."""
        raise NotImplementedError

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
        """float32 scalar tensor: the current scale."""
        return self._values[_SCALE]

    @property
    def good_steps(self):
        """float32 scalar tensor: finite steps since the last change or overflow."""
        return self._values[_GOOD]

    @property
    def bad_steps(self):
        """float32 scalar tensor: the back-off counter (finite steps keep it)."""
        return self._values[_BAD]

    @property
    def overflow_streak(self):
        """float32 scalar tensor: consecutive overflowing steps."""
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
        """The cap on growth as given, a Python float, or None."""
        return self._max_loss_scale

    @property
    def floor_warning_after(self):
        """Consecutive overflows at the floor before the warning, or None."""
        return self._floor_warning_after

    def get_loss_scale(self):
        # A fresh read per caller; Unpack is one op, a slice needs constants.
        return tf.unstack(self._state.read_value(), num=_STATE_SIZE)[_SCALE]

    def assign_loss_scale(self, scale):
        """The op that sets the scale to ``scale`` (float32), clipped to the
        bounds, and restarts the counters; a NaN ``scale`` changes nothing."""
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
        """Whether the growth ceiling is below the cap. Otherwise clipping to
        the cap gives the same scale, and the update drops the ceiling row
        (two ops): the defaults' ceilings are about 2**127."""
        return self._growth_ceiling < self._scale_cap()

    def _scale_cap(self):
        """The most the scale may grow to: ``min(max_loss_scale, 2**126)``."""
        if self._max_loss_scale is None:
            return _MAX_SCALE
        return min(self._max_loss_scale, _MAX_SCALE)

    def update_loss_scale(self, finite_grads):
        """Returns the op that moves the state by this step's finiteness.

        ``finite_grads`` picks one table of rows (one Select). Then
        ``candidate = state * mul + add``; an event (growth or back-off) is
        ``candidate >= limit`` anywhere, and makes the state ``candidate *
        factor`` clipped to [floor, cap] (``keep`` at the growth ceiling).
        One read, one assign.
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

    def check_floor(self, session):
        """``monitoring.check_floor(self, session)``: reads the scale once and
        warns, once per manager, when it sits at its floor after
        ``floor_warning_after`` overflows. Returns whether that is so."""
        return _monitoring.check_floor(self, session)

    def floor_warning_hook(self, every_n_steps=_monitoring.DEFAULT_WARNING_EVERY_N_STEPS):
        """A ``monitoring.FloorWarningHook`` over this manager."""
        return _monitoring.FloorWarningHook([self], every_n_steps)
