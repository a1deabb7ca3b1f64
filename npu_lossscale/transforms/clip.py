"""``clip_norm``: a group's unscaled gradients clipped by their global norm."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams

# The clip_norm values for which clip_by_global_norm stays exact: clip_norm
# and 1 / clip_norm are both normal float32 numbers.
CLIP_NORM_RANGE = (2.0 ** -126, 2.0 ** 126)


class ClipByGlobalNorm(_seams.GradientTransform):
    """Clips a group's gradients by their global norm, as
    ``tf.clip_by_global_norm`` does, in float32.

    The norm is taken in float32: float16 squares overflow past a norm of
    about 256, and TF's clip turns every gradient into NaN then, on a step
    the check found finite. float32 gradients are clipped exactly as
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
        clipped, _ = tf.clip_by_global_norm(wide, self.clip_norm)
        return [(_cast(new, grad.dtype.base_dtype), var)
                for new, (grad, var) in zip(clipped, grads_and_vars)]


def _cast(grad, dtype):
    """``grad`` (a tensor or IndexedSlices) in ``dtype``; itself if already so."""
    if grad.dtype.base_dtype == dtype:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
    return tf.cast(grad, dtype)
