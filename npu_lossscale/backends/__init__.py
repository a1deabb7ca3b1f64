"""Float-status backends: how a step learns that it overflowed.

``base.Backend`` declares what a backend is; ``resolve_backend`` picks one.
"""

from __future__ import absolute_import, division, print_function

from npu_lossscale.backends.base import Backend, checked_flag
from npu_lossscale.backends.is_finite import IsFiniteBackend
from npu_lossscale.backends.npu import (NpuFloatStatusBackend, _import_npu_gen_ops,
                                        _warn_if_saturating, inf_nan_mode_enabled)
from npu_lossscale.backends.register_order import Reader, claim_register, order_after_clear
from npu_lossscale.core.gradients import SMALL_GRADIENT_ELEMENTS

#: The backend names ``resolve_backend`` knows.
BACKENDS = ("auto", "is_finite", "npu", "float_status")
_NAMES = ", ".join(repr(name) for name in BACKENDS)


def resolve_backend(backend, warn=True):
    """Turns a backend name, or a ``Backend`` instance, into a backend object.

    On Ascend the check follows the device's overflow mode, as npu_bridge's
    ``NPULossScaleOptimizer`` does: in INF/NaN mode overflows are real inf/nan
    values and the float-status register is not relied on, so the gradients
    are checked with is_finite; in saturation mode (overflows become +-65504)
    the register is the only witness, so it is read.

    Args:
      backend: a ``Backend`` instance (used as it is), or a name: "auto"
        (the npu rule when npu_bridge imports, else is_finite), "npu" (the
        npu rule; npu_bridge required), "is_finite" (always check the
        gradients) or "float_status" (always read the register; npu_bridge
        required).
      warn: whether to warn (UserWarning) when ``backend="is_finite"`` is
        asked for while npu_bridge reports saturation mode: overflows then
        saturate to +-65504, which is_finite cannot see, so no step would be
        skipped. Build-time callers warn; a constructor only checks the name.

    Returns:
      A ``Backend``.

    Raises:
      TypeError: for anything but a name or a ``Backend`` instance (a
        ``Backend`` subclass itself included).
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
    if backend == "is_finite":
        if warn:
            _warn_if_saturating()
        return IsFiniteBackend()
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
