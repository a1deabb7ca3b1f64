"""``clip_norm``: a group's unscaled gradients clipped by their global norm."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams
from npu_lossscale import plugin_helpers as _helpers

# The clip_norm values for which clip_by_global_norm stays exact: clip_norm
# and 1 / clip_norm are both normal float32 numbers.
CLIP_NORM_RANGE = (2.0 ** -126, 2.0 ** 126)


class ClipByGlobalNorm(_seams.GradientTransform):
    """Clips a group's gradients by their global norm, as
    ``tf.clip_by_global_norm`` does, in float32.

    The norm is taken in float32: float16 squares overflow past a norm of
    about 256. Where even float32's sum of squares overflows (a norm past
    about 1.8e19 of finite gradients), TF's clip turns every gradient into
    NaN on a step the check found finite; the norm is then taken over the
    gradients rescaled by their largest magnitude (``_global_norm``).
    Otherwise float32 gradients are clipped exactly as
    ``tf.clip_by_global_norm`` clips them; others are cast back.

    Args:
      clip_norm: the global norm to clip to, in ``CLIP_NORM_RANGE``
        (checked by ``MultiOptimizerLossScale.add``).
    """

    name = "clip_by_global_norm"
    keeps_finite = True

    def __init__(self, clip_norm):
        self.clip_norm = clip_norm

    def transform(self, group, grads_and_vars):
        del group
        wide = [_cast(grad, tf.float32) for grad, _ in grads_and_vars]
        clipped, _ = tf.clip_by_global_norm(wide, self.clip_norm, use_norm=_global_norm(wide))
        return [(_cast(new, grad.dtype.base_dtype), var)
                for new, (grad, var) in zip(clipped, grads_and_vars)]

    def unscale_factor(self, group, scaled_pairs, inverse):
        """``inverse * clip_norm / max(inverse * norm, clip_norm)``, with the
        global norm of the scaled gradients in float32 (``_global_norm``)."""
        del group
        norm = _global_norm([_cast(grad, tf.float32) for grad, _ in scaled_pairs])
        return inverse * self.clip_norm / tf.maximum(norm * inverse, self.clip_norm)


def check_norm(argument, norm, fix):
    """``norm``, checked to lie in ``CLIP_NORM_RANGE``.

    ``tf.clip_by_global_norm`` multiplies by 1 / norm in float32; outside
    float32's normal range that quotient (or the norm itself) flushes to 0
    or overflows, and every gradient becomes 0 or NaN on a step the check
    found finite.

    Args:
      argument: the argument's name, for the message.
      norm: what it was given.
      fix: the message's last sentence.

    Returns:
      ``norm``.

    Raises:
      TypeError, ValueError: as ``checks.check_number``.
    """
    _helpers.check_number(
        argument, norm, minimum=CLIP_NORM_RANGE[0], maximum=CLIP_NORM_RANGE[1],
        hint="clip_by_global_norm computes 1 / clip_norm in float32, so both must be "
             "normal float32 numbers (2**-126 to 2**126, about 1.2e-38 to 8.5e37). " + fix)
    return norm


def _global_norm(grads):
    """``tf.global_norm(grads)``, or where its sum of squares overflows
    float32 while every gradient is finite, the same norm taken over the
    gradients divided by their largest magnitude (which cannot overflow),
    times that magnitude. Gradients that are not finite give a norm that is
    not finite, as TF's does (the step skips then anyway)."""
    values = [grad.values if isinstance(grad, tf.IndexedSlices) else grad for grad in grads]
    norm = tf.global_norm(values)
    largest = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(value)) for value in values]))
    divisor = tf.where(tf.greater(largest, 0.0), largest, tf.ones([]))
    rescaled = largest * tf.global_norm([value / divisor for value in values])
    return tf.where(tf.logical_and(tf.logical_not(_helpers.finite(norm)),
                                   _helpers.finite(largest)), rescaled, norm)


def _cast(grad, dtype):
    """``grad`` (a tensor or IndexedSlices) in ``dtype``; itself if already so."""
    if grad.dtype.base_dtype == dtype:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
    return tf.cast(grad, dtype)
