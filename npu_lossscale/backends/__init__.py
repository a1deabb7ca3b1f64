"""Float-status backends: how a step learns that it overflowed.

``base.Backend`` declares what a backend is; ``resolve_backend`` picks one.
"""

from __future__ import absolute_import, division, print_function

from npu_lossscale.backends.base import Backend
from npu_lossscale.backends.is_finite import IsFiniteBackend
from npu_lossscale.backends.npu import (NpuFloatStatusBackend, _import_npu_gen_ops,
                                        _warn_if_saturating, inf_nan_mode_enabled,
                                        npu_available)
from npu_lossscale.backends.register_order import (DATA_INPUT_TYPES, Reader,
                                                   claim_register, order_after_clear)
from npu_lossscale.gradients import SMALL_GRADIENT_ELEMENTS

BACKENDS = ("auto", "is_finite", "npu", "float_status")


def resolve_backend(backend, warn=True):
    """Turns a backend name into a backend object.

    On Ascend the check follows the device's overflow mode, as npu_bridge's
    ``NPULossScaleOptimizer`` does: in INF/NaN mode overflows are real inf/nan
    values and the float-status register is not relied on, so the gradients
    are checked with is_finite; in saturation mode (overflows become +-65504)
    the register is the only witness, so it is read.

    Args:
      backend: "auto" (the npu rule when npu_bridge imports, else
        is_finite), "npu" (the npu rule; npu_bridge required), "is_finite"
        (always check the gradients) or "float_status" (always read the
        register; npu_bridge required).
      warn: whether to warn (UserWarning) when ``backend="is_finite"`` is
        asked for while npu_bridge reports saturation mode: overflows then
        saturate to +-65504, which is_finite cannot see, so no step would be
        skipped. Build-time callers warn; a constructor only checks the name.

    Returns:
      An ``IsFiniteBackend`` or ``NpuFloatStatusBackend``.

    Raises:
      ValueError: for an unknown name, or an npu name without npu_bridge.
    """
    if backend not in BACKENDS:
        raise ValueError(
            "backend must be one of %r, got %r. Use 'is_finite' on CPU/GPU, 'npu' "
            "on Ascend (it follows the device's overflow mode), 'float_status' to "
            "always read Ascend's float-status register, or 'auto' to pick npu "
            "when npu_bridge imports." % (BACKENDS, backend))
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
            "backend=%r needs Huawei's npu_bridge (the TF adapter shipped with "
            "the Ascend CANN toolkit), which failed to import: %s. Install the CANN "
            "toolkit and its tf_adapter (npu_bridge) package, put the shims/ folder "
            "of this repository on sys.path to emulate it on CPU, or pass "
            "backend='is_finite'." % (backend, error))
    if backend != "float_status" and inf_nan_mode_enabled():
        return IsFiniteBackend(on_npu=True)
    return NpuFloatStatusBackend(gen_ops)
