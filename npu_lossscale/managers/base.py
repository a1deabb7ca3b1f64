"""The argument checks and defaults the managers share. The protocol itself,
``LossScaleManager`` and its readers, is ``manager_protocol``'s (the ground
floor, beside ``seams``); its names are re-exported here."""

from __future__ import absolute_import, division, print_function

import struct

from npu_lossscale import plugin_helpers as _helpers
# The protocol's names, re-exported for the managers and for callers of this module.
from npu_lossscale.manager_protocol import (FLOAT16_MAX, SCALE_RANGE, LossScaleManager,
                                            assign_scale, check_manager, check_manager_graph,
                                            declares_scale_in_range, describe,
                                            listens_to_underflow, manager_variables,
                                            overflow_check_enabled, scale_may_be_below_one,
                                            scale_moves, static_scale, takes_measured_scale)

# contrib's, npu_bridge's, Keras' and jmp's floor; a lower one, down to
# 2**-126, may be passed, as jmp allows.
_DEFAULT_MIN_LOSS_SCALE = 1.0
# No ceiling but SCALE_RANGE's, as in npu_bridge (whose examples start at 2**32).
_DEFAULT_MAX_LOSS_SCALE = None
# The largest finite float32, (2 - 2**-23) * 2**127 (IEEE 754 binary32).
_FLOAT32_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127
# float32 represents every integer up to 2**24 exactly (24-bit significand);
# the step counters must stay below it, so the periods are capped there.
_MAX_PERIOD = 2 ** 24
# Consecutive overflows at the floor before the "loss scale collapses" warning
# (apex #834, fairseq #1529): no scale helps then.
_DEFAULT_FLOOR_WARNING_AFTER = 20


def _float32(value):
    """Rounds a Python float to float32, as TF's constants do (OverflowError
    if it rounds to infinity)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


# Our managers' ceiling (npu_bridge, contrib and TF grow to float32's maximum).
_MAX_SCALE = SCALE_RANGE[1]


def _check_bounds(init_name, init_value, min_loss_scale, max_loss_scale):
    """The floor, the ceiling and the starting scale between them."""
    _helpers.check_number("min_loss_scale", min_loss_scale, minimum=SCALE_RANGE[0],
                         maximum=_MAX_SCALE,
                         hint="Pass e.g. 1 (the default; within 2**-126 to 2**126).")
    if max_loss_scale is not None:
        _helpers.check_number("max_loss_scale", max_loss_scale, minimum=min_loss_scale,
                             maximum=_FLOAT32_MAX,
                             hint="Pass a ceiling >= min_loss_scale, or None for none.")
    high = _MAX_SCALE if max_loss_scale is None else min(max_loss_scale, _MAX_SCALE)
    _helpers.check_number(init_name, init_value, minimum=min_loss_scale, maximum=high,
                         hint="Keep it within [min_loss_scale, max_loss_scale] and "
                              "at most 2**126.")


def _check_floor_warning(floor_warning_after):
    """``floor_warning_after`` as an int, or None (never warn)."""
    if floor_warning_after is None:
        return None
    return _helpers.check_count("floor_warning_after", floor_warning_after,
                               hint="Pass e.g. 20, or None never to warn.")


def _check_period(name, value, example):
    """A growth or back-off period as an int in [1, 2**24]."""
    return _helpers.check_count(name, value, maximum=_MAX_PERIOD,
                               hint="Pass e.g. %d (at most 2**24)." % example)


def _check_ratio(name, value, example):
    _helpers.check_number(name, value, minimum=1, min_open=True, maximum=_FLOAT32_MAX,
                         hint="Pass e.g. %r." % example)
    if _float32(float(value)) <= 1.0:
        raise ValueError(
            "%s must exceed 1 in float32, got %r (it rounds to 1.0). Pass e.g. %r."
            % (name, value, example))


def _check_initial_scale(name, value, min_loss_scale, max_loss_scale, floor_warning_after):
    """The checks both dynamic managers make of their starting scale and bounds."""
    if value is None:
        raise ValueError("%s must be a number, got None. Pass e.g. 2**15." % name)
    _check_floor_warning(floor_warning_after)
    _helpers.check_number(name, value, minimum=SCALE_RANGE[0], maximum=_MAX_SCALE,
                         hint="Pass e.g. 2**15 (within 2**-126 to 2**126).")
    _check_bounds(name, value, min_loss_scale, max_loss_scale)

