"""The rule of TF's ``DynamicLossScale`` (Keras defaults): ``DynamicLossScaleManager``."""

from __future__ import absolute_import, division, print_function

import math
import struct

from npu_lossscale.core import context as _context
from npu_lossscale.managers.base import (_DEFAULT_FLOOR_WARNING_AFTER, _DEFAULT_MAX_LOSS_SCALE,
                                         _DEFAULT_MIN_LOSS_SCALE, _FLOAT32_MAX,
                                         _check_initial_scale, _check_period, _check_ratio,
                                         _float32)
from npu_lossscale.managers.counting import _CountingLossScaleManager

# TF's DynamicLossScale and Keras' LossScaleOptimizer start at 2**15: the
# largest power of two whose product with a unit loss still fits float16.
_DEFAULT_INITIAL_SCALE = 2.0 ** 15
# Keras' default: grow after 2000 consecutive finite steps.
_DEFAULT_GROWTH_STEPS = 2000
# Keras' default growth and back-off factor.
_DEFAULT_MULTIPLIER = 2.0
# Back off on every overflow, as TF's DynamicLossScale and Keras do. DeepSpeed
# ("hysteresis": 2 in its fp16 config) and Megatron (--hysteresis 2) wait for
# a second overflow.
_DEFAULT_HYSTERESIS = 1


def _float32_step(value, steps):
    """The float32 ``steps`` representable values above a positive finite
    float32 (below, for negative ``steps``); may be inf."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return struct.unpack("<f", struct.pack("<I", bits + steps))[0]


def _product_is_finite(scale, factor):
    """Whether float32 ``scale * factor`` is finite (both are float32 values,
    so their exact product fits a double and is rounded once)."""
    try:
        return not math.isinf(_float32(scale * factor))
    except OverflowError:
        return False


def _finite_growth_ceiling(factor):
    """The smallest float32 ``s`` with ``s * factor`` overflowing float32.

    ``s < ceiling`` is then exactly ``is_finite(s * factor)`` for every
    float32 ``s > 0``, the test of TF's DynamicLossScale and contrib, without
    an ``IsFinite`` op.
    """
    candidate = _float32(_FLOAT32_MAX / factor)
    while not _product_is_finite(candidate, factor):
        candidate = _float32_step(candidate, -1)
    while _product_is_finite(_float32_step(candidate, 1), factor):
        candidate = _float32_step(candidate, 1)
    return _float32_step(candidate, 1)



class DynamicLossScaleManager(_CountingLossScaleManager):
    """The rule of TF's ``DynamicLossScale`` (Keras defaults).

    After ``growth_steps`` consecutive finite steps the scale is multiplied by
    ``multiplier`` if the result is finite; on any non-finite step it becomes
    ``max(scale / multiplier, min_loss_scale)`` and the count restarts. With
    ``hysteresis=H``, DeepSpeed's and Megatron's rule: an overflow always
    restarts the growth count, but the scale backs off only on the H-th
    overflow since it last grew and on every overflow after that, until it
    grows again (finite steps between the overflows do not restore the
    count; growth does)::

      if finite:
        good += 1
        if good == growth_steps: scale = grown(scale); good = 0; bad = 0
      else:
        good = 0
        if bad + 1 >= H: scale = max(scale / multiplier, min_loss_scale)
        bad = min(bad + 1, H - 1)

    where ``bad`` is the state's ``bad_steps`` (DeepSpeed's ``hysteresis -
    cur_hysteresis``). The
    finiteness test is done without ``IsFinite``: ``scale < ceiling``, with
    the ceiling computed at build time as the smallest float32 whose product
    with the multiplier overflows, which is the same test bit for bit.
    Deviation from TF: the scale never grows past 2**126 (nor past
    ``max_loss_scale``), where TF's grows up to float32's maximum: above
    2**126 the inverse the step unscales with is subnormal and flushed to 0
    (``managers.SCALE_RANGE``).

    The state is the variable ``dynamic_loss_scale/state``; the scale is also
    the tensor ``dynamic_loss_scale/loss_scale:0``.

    Args:
      initial_scale: the starting scale, 2**15 by default, in
        [min_loss_scale, 2**126].
      growth_steps: finite steps needed before the scale grows, in [1, 2**24].
      multiplier: growth and back-off factor, > 1.
      min_loss_scale: floor of the scale, 1 by default (Keras' and jmp's);
        as low as 2**-126 (``SCALE_RANGE``), as jmp's ``min_loss_scale``
        allows. PyTorch's GradScaler has no floor.
      max_loss_scale: cap on growth, None (no cap but 2**126) by default.
      floor_warning_after: warn, once, when the scale sits at
        ``min_loss_scale`` after this many consecutive overflowing steps
        (see ``check_floor``); None never warns.
      hysteresis: overflows since the scale last grew before it backs off,
        in [1, 2**24]; 1 (the default) backs off on every overflow, as TF
        and Keras; DeepSpeed and Megatron default to 2. The count lives in
        the state's ``bad_steps``, so checkpoints keep their layout.

    Raises:
      TypeError: if an argument has the wrong type.
      ValueError: if an argument is out of range, NaN or infinite.
    """

    # The counting rule keeps the scale in [min_loss_scale, growth cap], with
    # min_loss_scale >= 2**-126 (see _CountingLossScaleManager).
    keeps_scale_in_range = True

    def __init__(self, initial_scale=_DEFAULT_INITIAL_SCALE,
                 growth_steps=_DEFAULT_GROWTH_STEPS, multiplier=_DEFAULT_MULTIPLIER,
                 min_loss_scale=_DEFAULT_MIN_LOSS_SCALE,
                 max_loss_scale=_DEFAULT_MAX_LOSS_SCALE,
                 floor_warning_after=_DEFAULT_FLOOR_WARNING_AFTER,
                 hysteresis=_DEFAULT_HYSTERESIS):
        _context.require_graph_mode("DynamicLossScaleManager")
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
        # TF's DynamicLossScale writes `scale / multiplier`, and a Session's
        # grappler (constant folding, ReduceDivToReciprocalMul) runs it as
        # `scale * float32(1 / multiplier)`: this is what TF computes, bit for
        # bit (tests/test_managers.py cross-checks it with multiplier 3). For
        # a power of two both spellings are the same number.
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

