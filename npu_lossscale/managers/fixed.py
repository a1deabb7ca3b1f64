"""A constant loss scale: ``FixedLossScaleManager``."""

from __future__ import absolute_import, division, print_function

import warnings

import tensorflow.compat.v1 as tf

from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.managers.base import _MAX_SCALE, FLOAT16_MAX, LossScaleManager

class FixedLossScaleManager(LossScaleManager):
    """A constant loss scale.

    With ``enable_overflow_check=False`` every step applies, through the same
    code path: ``FixedLossScaleManager(1, enable_overflow_check=False)`` is
    plain training. A scale above 65504 warns: a float16 loss's gradient is
    then inf on every step.

    Args:
      loss_scale: the scale, a number in [1, 2**126].
      enable_overflow_check: whether steps with non-finite gradients are skipped.

    Raises:
      TypeError: if ``loss_scale`` is not a number or the flag is not a bool.
      ValueError: if ``loss_scale`` is None, NaN, infinite, < 1 or above
        2**126.
    """

    keeps_scale_in_range = True  # checked at construction

    def __init__(self, loss_scale, enable_overflow_check=True):
        if loss_scale is None:
            raise ValueError("loss_scale must be a number, got None. Pass e.g. 1024, "
                             "or 1 for no scaling.")
        _helpers.check_number("loss_scale", loss_scale, minimum=1, maximum=_MAX_SCALE,
                             hint="Pass a power of two such as 1024 (at most 2**126), "
                                  "or 1 for no scaling.")
        _helpers.check_bool("enable_overflow_check", enable_overflow_check,
                           "Pass True to skip steps with inf/nan gradients.")
        if loss_scale > FLOAT16_MAX:
            warnings.warn(
                "FixedLossScaleManager: loss_scale=%r exceeds 65504, so a float16 "
                "loss's gradient overflows on every step. Keep the loss in float32, "
                "or pass a scale <= 32768." % (loss_scale,), UserWarning, stacklevel=2)
        self._loss_scale_value = float(loss_scale)
        self._enable_overflow_check = enable_overflow_check

    def get_loss_scale(self):
        return tf.constant(self._loss_scale_value, dtype=tf.float32, name="loss_scale")

    def update_loss_scale(self, finite_grads):
        del finite_grads  # A fixed scale never moves.
        return tf.no_op(name="fixed_loss_scale_update")

    def get_enable_overflow_check(self):
        """Whether steps with non-finite gradients are skipped (npu_bridge's
        name)."""
        return self._enable_overflow_check

    @property
    def static_loss_scale(self):
        """The scale as a Python float."""
        return self._loss_scale_value


class NoOpLossScaleManager(FixedLossScaleManager):
    """No loss scaling, and steps with inf/nan gradients still skipped.

    For bfloat16 and float32 models, whose gradients need no scale but whose
    non-finite steps should still change nothing: jmp's ``NoOpLossScale``
    plus the skip, ``FixedLossScaleManager(1)``. The step makes no scale ops.

    Example::

      scaler = MultiOptimizerLossScale(NoOpLossScaleManager())

    Args:
      enable_overflow_check: whether steps with non-finite gradients are
        skipped (True); False applies every step (plain training).

    Raises:
      TypeError: if the flag is not a bool.
    """

    keeps_scale_in_range = True  # the constant 1

    def __init__(self, enable_overflow_check=True):
        super(NoOpLossScaleManager, self).__init__(1, enable_overflow_check)

