"""Overflow backends: how a step learns that it overflowed.
``backend_protocol.Backend`` declares what a backend is; ``resolve_backend``
picks one, and ``all_finite`` asks it of some gradients."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale.backend_protocol import Backend, checked_flag
from npu_lossscale.backends.is_finite import IsFiniteBackend, XlaBackend
from npu_lossscale.backends.npu import (NpuFloatStatusBackend, _import_npu_gen_ops,
                                        _warn_if_saturating, inf_nan_mode_enabled)
from npu_lossscale.backends.register_order import Reader, claim_register, order_after_clear
from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.plugin_helpers import SMALL_GRADIENT_ELEMENTS

#: The backend names ``resolve_backend`` knows.
BACKENDS = ("auto", "is_finite", "xla", "npu", "float_status")
_NAMES = ", ".join(repr(name) for name in BACKENDS)


def resolve_backend(backend, warn=True):
    """Turns a backend name, or a ``Backend`` instance, into a backend.

    The npu rule follows the device's overflow mode, as npu_bridge's
    ``NPULossScaleOptimizer`` does: is_finite in INF/NaN mode, the
    float-status register in saturation mode, where overflows give +-65504.

    Args:
      backend: a ``Backend`` instance, or a name: "auto" (the npu rule when
        npu_bridge imports, else is_finite), "npu" (the npu rule),
        "is_finite", "xla" (is_finite compiled with the unscale into one
        XLA cluster: CPUs and GPUs) or "float_status" (always the
        register).
      warn: whether "is_finite" warns in saturation mode, where it sees no
        overflow (build-time callers warn, constructors do not).

    Returns:
      A ``Backend``.

    Raises:
      TypeError: for anything but a name or a ``Backend`` instance.
      ValueError: for an unknown name, or an npu name without npu_bridge.
    """
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, type) and issubclass(backend, Backend):
        raise TypeError(
            "backend=%r is a class; pass an instance, backend=%s()."
            % (backend, backend.__name__))
    if not isinstance(backend, str):
        raise TypeError(
            "backend=%r is not a backend; pass one of %s or a backends.Backend "
            "instance." % (backend, _NAMES))
    if backend not in BACKENDS:
        raise ValueError(
            "backend=%r is unknown; pass one of %s or a backends.Backend instance."
            % (backend, _NAMES))
    if backend in ("is_finite", "xla"):
        if warn:
            _warn_if_saturating()
        return XlaBackend() if backend == "xla" else IsFiniteBackend()
    try:
        gen_ops = _import_npu_gen_ops()
    except ImportError as error:
        if backend == "auto":
            return IsFiniteBackend()
        raise ValueError(
            "backend=%r needs npu_bridge (CANN's tf_adapter), which failed to import "
            "(%s); install it, put shims/ on sys.path to emulate it, or pass "
            "backend='is_finite'." % (backend, error))
    if backend != "float_status" and inf_nan_mode_enabled():
        return IsFiniteBackend(on_npu=True)
    return NpuFloatStatusBackend(gen_ops)


def all_finite(grads, backend="auto"):
    """The bool decision the builder itself would take for ``grads``.

    Args:
      grads: gradients (tensors or IndexedSlices; None entries are left out).
      backend: "auto", "is_finite", "xla", "npu" or "float_status", as for the
        builder, or a ``backends.Backend`` instance. With the register
        (Ascend, saturation mode) the read follows every gradient, and the
        graph's one register clear is ordered before everything the
        gradients follow.

    Returns:
      A bool scalar tensor, True when no gradient overflowed; it follows
      every gradient.

    Raises:
      TypeError: unless ``grads`` is a list or tuple of float gradients (one
        tensor, (gradient, variable) pairs, None, a number or a str are
        refused).
      ValueError: for an unknown backend, no gradient at all, gradients of
        another graph, or the register inside a ``tf.cond``/``tf.while_loop``
        body or a ``tf.function``.
    """
    grads = _helpers.check_gradients(grads)
    flag = checked_flag(resolve_backend(backend), grads)
    with tf.control_dependencies([_helpers.dense_values(grad) for grad in grads]):
        return tf.identity(tf.equal(flag, 0.0), name="all_finite")
