"""Gradient transforms (``seams.GradientTransform``): what a group's
unscaled gradients go through before the apply.

Each is a value, and they compose::

  scaler.add(loss, opt, transform_grads_fn=transforms.chain(
      my_fn, transforms.clip_by_global_norm(1.0)))

is ``add(loss, opt, transform_grads_fn=my_fn, clip_norm=1.0)``.
"""

from __future__ import absolute_import, division, print_function

from npu_lossscale.transforms.clip import CLIP_NORM_RANGE, ClipByGlobalNorm, check_norm
from npu_lossscale.transforms.compose import Chain, as_transforms, chain
from npu_lossscale.transforms.transform_fn import TransformGradsFn

__all__ = ["CLIP_NORM_RANGE", "Chain", "ClipByGlobalNorm", "TransformGradsFn", "as_transforms",
           "chain", "clip_by_global_norm"]


def clip_by_global_norm(norm):
    """A clip of a group's gradients by their global norm (``clip_norm``).

    Args:
      norm: the global norm, in ``CLIP_NORM_RANGE``.

    Returns:
      A ``ClipByGlobalNorm``.

    Raises:
      TypeError, ValueError: for a norm that is not a number in the range.
    """
    return ClipByGlobalNorm(check_norm("norm", norm, "Pass a global norm such as 1.0."))
