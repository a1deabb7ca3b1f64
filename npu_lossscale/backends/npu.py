"""The float-status backend: reads Ascend's float-status register (saturation
mode), and what npu_bridge says of the device."""

from __future__ import absolute_import, division, print_function

import warnings

import tensorflow.compat.v1 as tf

from npu_lossscale.core import context as _context
from npu_lossscale.core import graph_state as _graph_state
from npu_lossscale.backends.base import Backend
from npu_lossscale.backends.register_order import order_after_clear
from npu_lossscale.core.gradients import dense_values


class NpuFloatStatusBackend(Backend):
    """Reads Ascend's float-status register; clears it once per run, first.

    The register is the device's overflow status: tf_adapter's read op
    reports it and its clear op zeroes it (``NpuGetFloatStatus``,
    ``NpuClearFloatStatus``, ops/aicore/npu_mixed_precesion_ops.cc); no
    read resets it, so a read sees every overflow since the last clear. npu_bridge's ``NPULossScaleOptimizer`` reads
    after its gradients and clears right after its read, so two of them in
    one ``session.run`` race: one's clear can land between the other's
    overflow and its read (seed 003). This backend never clears after a
    read. Each graph has one clear (``clear_status``), and every op that
    a read follows is made to follow that clear (``order_after_clear``): the
    ops among the read's ancestors that take a graph input (a placeholder,
    a variable, a constant) get the clear as a control input, and the rest
    descend from those. So in a run that feeds only placeholders, the clear
    runs once, before any computation of any reading step, and nothing
    clears after it: a read sees every overflow of its own step, whatever
    else the run fetches. What it can also see is an overflow of another
    step of the same run that landed before it, which makes it skip
    (conservative), never apply. Reads are built at the top level of the
    graph only (``context.require_top_level``).

    Uses the v2 ops (``npu_get_float_status_v2``/``npu_clear_float_status_v2``)
    when the installed npu_bridge has them, else the v1 ops
    (``npu_alloc_float_status``/``npu_get_float_status``/
    ``npu_clear_float_status``), as npu_bridge's optimizer chooses.

    Args:
      gen_ops: the module returned by ``npu_bridge.helper.helper.get_gen_ops()``.
    """

    name = "npu"
    #: One device-wide register: a read sees every overflow since the last
    #: clear, whichever group caused it.
    reads_register = True
    gives_evidence = True

    #: The register exists only on Ascend.
    on_npu = True

    def __init__(self, gen_ops):
        self._gen_ops = gen_ops
        self.uses_v2 = hasattr(gen_ops, "npu_get_float_status_v2")

    def overflow_flag(self, tensors, after=()):
        """Returns a float32 scalar: 0.0 if the register is clear, else 1.0.

        Orders the graph's clear before every op the read follows (see the
        class), then reads without clearing.

        Args:
          tensors: the step's gradients; the read follows all of them.
          after: more tensors the read must follow: the losses, so that a
            forward overflow whose value no gradient needs (TF may prune or
            fold that dependency) still lands before the read.

        Returns:
          A float32 scalar tensor.
        """
        _context.require_top_level("A float-status read (all_finite or a step)")
        gen = self._gen_ops
        deps = [dense_values(t) for t in list(tensors) + list(after)]
        order_after_clear(self.clear_status(), deps)
        with tf.name_scope("npu_float_status"):
            if self.uses_v2:
                with tf.control_dependencies(deps):
                    status = gen.npu_get_float_status_v2()
                overflow = tf.reduce_any(tf.not_equal(status, tf.zeros_like(status)))
            else:
                # The device writes the status into the allocated buffer, and
                # npu_bridge decides on the buffer (compared with
                # NpuClearFloatStatus's output, zeros: "The float element
                # tensor set to zero"), while the read's own output is
                # documented as "The one float status element tensor"
                # (tf_adapter ops/aicore/npu_mixed_precesion_ops.cc). Either
                # non-zero is an overflow; nothing is cleared.
                buffer = gen.npu_alloc_float_status()
                with tf.control_dependencies(deps):
                    status = gen.npu_get_float_status(buffer)
                with tf.control_dependencies([status]):
                    in_buffer = tf.reduce_any(tf.not_equal(buffer, tf.zeros_like(buffer)))
                overflow = tf.logical_or(
                    in_buffer, tf.reduce_any(tf.not_equal(status, tf.zeros_like(status))))
            return tf.cast(overflow, tf.float32)

    def clear_status(self):
        """The graph's one register clear (made on first use, then shared).

        Every register-reading step of the library runs it before its first
        op, so it need not be run by hand between steps or after an
        evaluation run. Run it alone to clear the register explicitly.

        Returns:
          An op named ``loss_scale/clear_status``.
        """
        graph = tf.get_default_graph()
        state = _graph_state.of(graph)
        if state.register_clear is None:
            gen = self._gen_ops
            # Outside any control context or dependency of the caller: the
            # clear must be free to run first.
            with graph.control_dependencies(None), graph.name_scope("loss_scale/"):
                with tf.name_scope("clear_status") as scope:
                    if self.uses_v2:
                        cleared = gen.npu_clear_float_status_v2()
                    else:
                        cleared = gen.npu_clear_float_status(gen.npu_alloc_float_status())
                    state.register_clear = tf.group(cleared, name=scope)
        return state.register_clear


def _import_npu_gen_ops():
    from npu_bridge.helper import helper  # pylint: disable=import-outside-toplevel
    return helper.get_gen_ops()


def inf_nan_mode_enabled():
    """Whether the Ascend device overflows to inf/nan (True) or saturates.

    Asked exactly as npu_bridge's own ``NPULossScaleOptimizer`` asks, through
    ``npu_plugin.is_inf_nan_enabled()`` (tf_adapter
    ``npu_bridge/estimator/npu/npu_plugin.py``), which queries the runtime's
    device overflow mode (``aclrtGetDeviceSatMode``). INF/NaN is the default on
    Atlas A2/A3 (910B/910C); Atlas training products (910A) only saturate. An
    adapter too old to have the function only knows saturation: False.
    """
    from npu_bridge.estimator.npu import npu_plugin  # pylint: disable=import-outside-toplevel
    query = getattr(npu_plugin, "is_inf_nan_enabled", None)
    return bool(query()) if query is not None else False


def _warn_if_saturating():
    """Warns when npu_bridge imports and the device saturates on overflow.

    In saturation mode an overflowing float16 result is +-65504, a finite
    number, so ``backend="is_finite"`` finds nothing and every overflowed
    step is applied. The mode is asked as ``inf_nan_mode_enabled`` asks it.
    """
    try:
        _import_npu_gen_ops()
    except ImportError:
        return
    if not inf_nan_mode_enabled():
        warnings.warn(
            "backend='is_finite' cannot see overflows in saturation mode (they give "
            "+-65504, not inf), so overflowed steps would be applied; pass "
            "backend='auto', or on Atlas A2/A3 call npu_plugin.set_device_sat_mode(1) "
            "before building.",
            UserWarning, stacklevel=4)
