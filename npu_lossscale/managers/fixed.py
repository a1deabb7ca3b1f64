"""A constant loss scale: ``FixedLossScaleManager``."""

from __future__ import absolute_import, division, print_function

import warnings

import tensorflow.compat.v1 as tf

from npu_lossscale.core import checks as _checks
from npu_lossscale.managers.base import _MAX_SCALE, FLOAT16_MAX, LossScaleManager

class FixedLossScaleManager(LossScaleManager):
    """A constant loss scale.

    With ``enable_overflow_check=False`` the builder skips the overflow check
    entirely (every step applies), through the same code path as the dynamic
    managers. ``FixedLossScaleManager(1, enable_overflow_check=False)`` is
    therefore plain, unscaled training.

    A scale above 65504, float16's largest finite value, draws a
    ``UserWarning``: the gradient of a loss computed in float16 is then
    infinite on every step, so (with the check on) every step is skipped.
    Such a scale only works when the loss and the ops next to it run in
    float32.

    Args:
      loss_scale: the scale, a number in [1, 2**126] (above 2**126 its
        inverse flushes to 0: see ``managers.SCALE_RANGE``).
      enable_overflow_check: whether steps with non-finite gradients are skipped.

    Raises:
      TypeError: if ``loss_scale`` is not a number or the flag is not a bool.
      ValueError: if ``loss_scale`` is None, NaN, infinite, < 1 or above
        2**126.
    """

    # A constant checked at construction to lie in [1, 2**126].
    keeps_scale_in_range = True

    def __init__(self, loss_scale, enable_overflow_check=True):
        if loss_scale is None:
            # contrib, npu_bridge and TF's FixedLossScale raise ValueError here.
            raise ValueError("loss_scale must be a number, got None. Pass e.g. 1024, "
                             "or 1 for no scaling.")
        _checks.check_number("loss_scale", loss_scale, minimum=1, maximum=_MAX_SCALE,
                             hint="Pass a power of two such as 1024 (at most 2**126), "
                                  "or 1 for no scaling.")
        _checks.check_bool("enable_overflow_check", enable_overflow_check,
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
        """Returns whether steps with non-finite gradients are skipped.

        The name matches npu_bridge's FixedLossScaleManager
        (tf_adapter/python/npu_bridge/estimator/npu/npu_loss_scale_manager.py),
        so the builder reads this flag the same way from either class.
        """
        return self._enable_overflow_check

    @property
    def static_loss_scale(self):
        """The scale as a Python float (the builder skips unscaling at 1)."""
        return self._loss_scale_value


class NoOpLossScaleManager(FixedLossScaleManager):
    """No loss scaling, and steps with inf/nan gradients still skipped.

    For bfloat16 models (Ascend Atlas A2/A3, current GPUs) and float32 ones:
    bfloat16 has float32's exponent range, so its gradients need no scale to
    stay above underflow, but a non-finite step (a bad batch, a diverging
    loss) should still change nothing. The scale is the constant 1
    (``static_loss_scale``), so the step makes no scale ops: the loss is
    differentiated as it is, in its own dtype, and nothing is unscaled. The
    overflow check, the one decision and the gate are the other managers'.
    jmp's ``NoOpLossScale``, plus the skip; the same as
    ``FixedLossScaleManager(1)``.

    Example::

      scaler = MultiOptimizerLossScale(NoOpLossScaleManager())

    Args:
      enable_overflow_check: whether steps with non-finite gradients are
        skipped (True); False applies every step (plain training).

    Raises:
      TypeError: if the flag is not a bool.
    """

    # The constant 1.
    keeps_scale_in_range = True

    def __init__(self, enable_overflow_check=True):
        super(NoOpLossScaleManager, self).__init__(1, enable_overflow_check)

