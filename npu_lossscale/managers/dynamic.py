"""The rule of TF's ``DynamicLossScale`` (Keras defaults): ``DynamicLossScaleManager``."""

from __future__ import absolute_import, division, print_function

import math
import struct

from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.managers.base import (_DEFAULT_FLOOR_WARNING_AFTER, _DEFAULT_MAX_LOSS_SCALE,
                                         _DEFAULT_MIN_LOSS_SCALE, _FLOAT32_MAX,
                                         _check_initial_scale, _check_period, _check_ratio,
                                         _float32)
from npu_lossscale.managers.counting import _CountingLossScaleManager

# TF's DynamicLossScale and Keras' defaults; 2**15 is the largest power of
# two whose product with a unit loss fits float16. Hysteresis 1 backs off on
# every overflow (DeepSpeed and Megatron default to 2).
_DEFAULT_INITIAL_SCALE = 2.0 ** 15
_DEFAULT_GROWTH_STEPS = 2000
_DEFAULT_MULTIPLIER = 2.0
_DEFAULT_HYSTERESIS = 1


def _float32_step(value, steps):
    """The float32 ``steps`` representable values above ``value`` (> 0)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return struct.unpack("<f", struct.pack("<I", bits + steps))[0]


def _product_is_finite(scale, factor):
    """Whether float32 ``scale * factor`` is finite (exact in a double)."""
    try:
        return not math.isinf(_float32(scale * factor))
    except OverflowError:
        return False


def _finite_growth_ceiling(factor):
    """The smallest float32 ``s`` with ``s * factor`` overflowing: ``s <
    ceiling`` is TF's ``is_finite(s * factor)`` without ``IsFinite``."""
    candidate = _float32(_FLOAT32_MAX / factor)
    while not _product_is_finite(candidate, factor):
        candidate = _float32_step(candidate, -1)
    while _product_is_finite(_float32_step(candidate, 1), factor):
        candidate = _float32_step(candidate, 1)
    return _float32_step(candidate, 1)


class DynamicLossScaleManager(_CountingLossScaleManager):
    """The rule of TF's ``DynamicLossScale`` (Keras defaults); with
    ``hysteresis=H``, DeepSpeed's and Megatron's::

      if finite:
        good += 1
        if good == growth_steps: scale = grown(scale); good = 0; bad = 0
      else:
        good = 0
        if bad + 1 >= H: scale = max(scale / multiplier, min_loss_scale)
        bad = min(bad + 1, H - 1)

    where ``grown`` multiplies while the product is finite, up to
    ``min(max_loss_scale, 2**126)`` (TF's grows to float32's maximum), and
    ``bad`` is the state's ``bad_steps``. The state is
    ``dynamic_loss_scale/state``; the scale is also
    ``dynamic_loss_scale/loss_scale:0``.

    Args:
      initial_scale: the starting scale, 2**15 by default, in
        [min_loss_scale, 2**126].
      growth_steps: finite steps needed before the scale grows, in [1, 2**24].
      multiplier: growth and back-off factor, > 1.
      min_loss_scale: floor of the scale, 1 by default, as low as 2**-126.
      max_loss_scale: cap on growth, None (no cap but 2**126) by default.
      floor_warning_after: warn, once, when the scale sits at
        ``min_loss_scale`` after this many consecutive overflowing steps
        (see ``check_floor``); None never warns.
      hysteresis: overflows since the scale last grew before it backs off,
        in [1, 2**24]; 1 backs off on every overflow.

    Raises:
      TypeError: if an argument has the wrong type.
      ValueError: if an argument is out of range, NaN or infinite.
    """

    keeps_scale_in_range = True  # the counting rule's bounds

    def __init__(self, initial_scale=_DEFAULT_INITIAL_SCALE,
                 growth_steps=_DEFAULT_GROWTH_STEPS, multiplier=_DEFAULT_MULTIPLIER,
                 min_loss_scale=_DEFAULT_MIN_LOSS_SCALE,
                 max_loss_scale=_DEFAULT_MAX_LOSS_SCALE,
                 floor_warning_after=_DEFAULT_FLOOR_WARNING_AFTER,
                 hysteresis=_DEFAULT_HYSTERESIS):
        _helpers.require_graph_mode("DynamicLossScaleManager")
        _check_initial_scale("initial_scale", initial_scale, min_loss_scale,
                             max_loss_scale, floor_warning_after)
        _check_period("growth_steps", growth_steps, 2000)
        _check_ratio("multiplier", multiplier, 2)
        _check_period("hysteresis", hysteresis, 2)
        self._multiplier = _float32(float(multiplier))
        super(DynamicLossScaleManager, self).__init__(
            initial_scale, growth_steps, int(hysteresis), multiplier,
            min_loss_scale, max_loss_scale, floor_warning_after,
            growth_ceiling=_finite_growth_ceiling(self._multiplier),
            name="dynamic_loss_scale", scale_name_in_scope=True,
            keep_bad_at_shrink=True)

    def _shrink_factor(self):
        # TF writes `scale / multiplier`, which grappler runs as this
        # product: the same bits (docs/managers.md, "Growth ceiling").
        return 1.0 / self._multiplier

    @property
    def growth_steps(self):
        """Finite steps needed before the scale grows."""
        return self._grow_every

    @property
    def multiplier(self):
        """The growth and back-off factor."""
        return self._multiplier

    @property
    def hysteresis(self):
        """Overflows since the scale last grew before it backs off."""
        return self._shrink_every

