"""Float-status backends: how a step learns that it overflowed.

A backend turns the step's gradients into one float32 scalar *overflow flag*:
0.0 when the step is finite, non-zero when it overflowed. A flag (rather than a
bool) is what data-parallel workers sum across ranks: zero after the sum means
every rank was finite.

* ``IsFiniteBackend`` (CPU/GPU, and Ascend in INF/NaN mode) reads every
  gradient once.
* ``NpuFloatStatusBackend`` (Ascend in saturation mode) reads the device's
  float-status register after all gradients; the graph's one clear runs
  before anything a read follows.
  There, an overflowing float16 result becomes +-65504 instead of inf, so the
  register is the only witness of the overflow.

``resolve_backend`` picks one. A backend declares what the rest of the step
needs to know about it: ``name``, ``reads_register`` (one device-wide read
that cannot tell groups apart) and ``on_npu``.
"""
