"""Shim of ``npu_bridge.estimator.npu.npu_plugin`` (overflow-mode queries only).

The real module also has npu_resource_init/shutdown, RDMA helpers, etc.,
which need the device runtime; they are not emulated.
"""
from npu_bridge import _emulation


def is_inf_nan_enabled():
    """True in INF/NaN overflow mode, False in saturation mode (emulated)."""
    return _emulation.get_overflow_mode() == _emulation.MODE_INF_NAN


def set_device_sat_mode(mode):
    """Process-level overflow mode: 0 saturation, 1 INF/NaN (Ascend API).

    In the shim this sets the same switch as
    ``npu_bridge._emulation.set_overflow_mode``; it affects ops built after
    the call.
    """
    if mode == 0:
        _emulation.set_overflow_mode(_emulation.MODE_SATURATION)
    elif mode == 1:
        _emulation.set_overflow_mode(_emulation.MODE_INF_NAN)
    else:
        raise ValueError("mode must be 0 (saturation) or 1 (INF/NaN), got %r" % (mode,))
