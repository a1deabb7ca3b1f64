"""The is_finite backend: checks the gradients themselves (CPU/GPU, and
Ascend in INF/NaN mode)."""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale.backend_protocol import Backend
from npu_lossscale.plugin_helpers import SMALL_GRADIENT_ELEMENTS, dense_values


class IsFiniteBackend(Backend):
    """Checks the gradients themselves.

    Every gradient is summed in float32 and the sums are added: the total is
    finite exactly when no gradient holds inf or nan (a finite gradient
    whose sum overflows would overflow the update too). Small gradients of
    one shape and dtype are first added elementwise (float16 ones stacked,
    then cast once): two ops per shape, not one per gradient. Large ones
    keep a ``Sum`` each, which runs as soon as each exists.
    """

    name = "is_finite"
    reads_register = False
    gives_evidence = True

    def __init__(self, on_npu=False):
        self.on_npu = on_npu  # Ascend in INF/NaN mode

    def overflow_flag(self, tensors, after=()):
        """A float32 scalar: 0.0 if every tensor is finite, else 1.0."""
        del after
        with tf.name_scope("is_finite_check"):
            sums = []
            small = collections.OrderedDict()
            for tensor in tensors:
                values = dense_values(tensor)
                shape = values.shape
                if shape.is_fully_defined() and shape.num_elements() < SMALL_GRADIENT_ELEMENTS:
                    key = (values.dtype.base_dtype, tuple(shape.as_list()))
                    small.setdefault(key, []).append(values)
                    continue
                if values.dtype.base_dtype != tf.float32:
                    values = tf.cast(values, tf.float32)
                sums.append(tf.reduce_sum(values))
            for (dtype, _), same in small.items():
                if dtype == tf.float32:
                    values = same[0] if len(same) == 1 else tf.add_n(same)
                else:
                    # Adding in float16 could overflow on finite values, so
                    # stack (no arithmetic) and cast once.
                    values = tf.cast(same[0] if len(same) == 1 else tf.stack(same),
                                     tf.float32)
                sums.append(tf.reduce_sum(values))
            total = sums[0] if len(sums) == 1 else tf.add_n(sums)
            return 1.0 - tf.cast(tf.is_finite(total), tf.float32)


class XlaBackend(IsFiniteBackend):
    """The is_finite check, compiled by XLA with the unscale (and the clip
    factor of a ``clip_norm`` group) into one cluster
    (``tf.xla.experimental.jit_scope``).

    On a GPU each small op of the check and the unscale is a kernel launch;
    in one cluster XLA fuses them into a few. The math is the is_finite
    backend's, so the applied values are the same (within float32 rounding
    in a clipped group, whose norm XLA sums in its own order).
    ``LossScaleOptimizer.apply_gradients`` compiles its check alone. It needs a TF built with
    XLA (TF 1.15's GPU and CPU wheels are) and a device XLA compiles for:
    not Ascend, whose graph compiler fuses on its own.
    """

    name = "xla"

    def fusion_scope(self):
        """``jit_scope``: every op made inside is compiled into one cluster."""
        return tf.xla.experimental.jit_scope(compile_ops=True,
                                             separate_compiled_gradients=False)
