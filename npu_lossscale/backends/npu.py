"""The float-status backend: reads Ascend's float-status register (saturation
mode), and what npu_bridge says of the device."""

from __future__ import absolute_import, division, print_function

import warnings

import tensorflow.compat.v1 as tf

from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.backend_protocol import Backend
from npu_lossscale.backends.register_order import order_after_clear


class NpuFloatStatusBackend(Backend):
    """Reads Ascend's float-status register; clears it once per run, first.

    No read resets the register, so a read sees every overflow since the
    last clear. A read never clears either (two clearing readers in one run
    race: docs/design.md, "The float-status register"). Each graph has one
    clear (``clear_status``), ordered before every op a read follows
    (``order_after_clear``): a read sees every overflow of its own step, and
    at worst another step's of the same run, which makes it skip, never
    apply. The v2 ops where npu_bridge has them, else v1, as its optimizer
    chooses.

    Args:
      gen_ops: the module returned by ``npu_bridge.helper.helper.get_gen_ops()``.
      clear: the clear ``clear_status`` returns: None for the graph's one
        clear, or a sub-step's own (``cleared_after``).
    """

    name = "npu"
    reads_register = True
    gives_evidence = True
    on_npu = True

    def __init__(self, gen_ops, clear=None):
        self._gen_ops = gen_ops
        self.uses_v2 = hasattr(gen_ops, "npu_get_float_status_v2")
        self._own_clear = clear

    def overflow_flag(self, tensors, after=()):
        """A float32 scalar: 0.0 if the register is clear, else 1.0.

        The read follows ``tensors`` and ``after`` (the losses: a forward
        overflow no gradient needs must land before it too).
        """
        _helpers.require_top_level("A float-status read (all_finite or a step)")
        gen = self._gen_ops
        deps = [_helpers.dense_values(t) for t in list(tensors) + list(after)]
        order_after_clear(self.clear_status(), deps)
        with tf.name_scope("npu_float_status"):
            if self.uses_v2:
                with tf.control_dependencies(deps):
                    status = gen.npu_get_float_status_v2()
                overflow = tf.reduce_any(tf.not_equal(status, tf.zeros_like(status)))
            else:
                # npu_bridge decides on the allocated buffer, tf_adapter
                # documents the read's output as the status: either non-zero
                # is an overflow.
                buffer = gen.npu_alloc_float_status()
                with tf.control_dependencies(deps):
                    status = gen.npu_get_float_status(buffer)
                with tf.control_dependencies([status]):
                    in_buffer = tf.reduce_any(tf.not_equal(buffer, tf.zeros_like(buffer)))
                overflow = tf.logical_or(
                    in_buffer, tf.reduce_any(tf.not_equal(status, tf.zeros_like(status))))
            return tf.cast(overflow, tf.float32)

    def clear_status(self):
        """The graph's one register clear, ``loss_scale/clear_status``, made
        on first use. Every reading step runs it first; it need not be run
        by hand."""
        if self._own_clear is not None:
            return self._own_clear
        graph = tf.get_default_graph()
        state = _helpers.graph_state_of(graph)
        if state.register_clear is None:
            # Free of the caller's control context, to run first.
            with graph.control_dependencies(None), graph.name_scope("loss_scale/"):
                state.register_clear = self._clear("clear_status")
        return state.register_clear

    def _clear(self, name):
        """A register clear op, made here."""
        gen = self._gen_ops
        with tf.name_scope(name) as scope:
            if self.uses_v2:
                cleared = gen.npu_clear_float_status_v2()
            else:
                cleared = gen.npu_clear_float_status(gen.npu_alloc_float_status())
            return tf.group(cleared, name=scope)

    def cleared_after(self, op, name="clear_status"):
        """This backend for a sub-step that runs after ``op`` in the same run
        (``build(sequence=...)``): its reads follow a clear of their own,
        made here after ``op``, so that they see the sub-step's overflows
        only, as a run of its own would.

        Args:
          op: the previous sub-step's end.
          name: the clear's name scope.

        Returns:
          An ``NpuFloatStatusBackend`` whose ``clear_status`` is that clear.
        """
        with tf.control_dependencies([op]):
            return NpuFloatStatusBackend(self._gen_ops, clear=self._clear(name))


def _import_npu_gen_ops():
    from npu_bridge.helper import helper  # pylint: disable=import-outside-toplevel
    return helper.get_gen_ops()


def inf_nan_mode_enabled():
    """Whether the Ascend device overflows to inf/nan (True) or saturates.

    Asked as npu_bridge's ``NPULossScaleOptimizer`` asks, through
    ``npu_plugin.is_inf_nan_enabled()``; an adapter without it only knows
    saturation. INF/NaN is the default on Atlas A2/A3.
    """
    from npu_bridge.estimator.npu import npu_plugin  # pylint: disable=import-outside-toplevel
    query = getattr(npu_plugin, "is_inf_nan_enabled", None)
    return bool(query()) if query is not None else False


def _warn_if_saturating():
    """Warns when the device saturates on overflow (+-65504, which
    ``backend="is_finite"`` cannot see)."""
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
