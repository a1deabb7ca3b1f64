"""What a backend is: the one declaration the step reads of an overflow check.

A backend turns the step's gradients into one float32 *overflow flag*, 0.0
when finite. A flag rather than a bool, because workers and an accumulation
window sum flags: zero after the sum means every one was finite.
"""

from __future__ import absolute_import, division, print_function

import contextlib

import tensorflow.compat.v1 as tf


class _ClassName(object):
    """The class's name, until a subclass or an instance sets its own."""

    def __get__(self, instance, owner):
        return owner.__name__


class Backend(object):
    """An overflow check: subclass it and implement ``overflow_flag``.

    Pass an instance as ``backend=`` to ``MultiOptimizerLossScale``,
    ``LossScaleOptimizer`` or ``all_finite``. The defaults describe a check
    that reads the gradients themselves.

    Example::

      class AbsMax(Backend):
          name = "abs_max"

          def overflow_flag(self, tensors, after=()):
              big = [tf.reduce_any(tf.abs(tf.cast(t, tf.float32)) > 1e4)
                     for t in tensors]
              return tf.cast(tf.reduce_any(tf.stack(big)), tf.float32)

    Attributes:
      name: a short str naming the check; the class name by default.
      reads_register: True when ``overflow_flag`` reads one device-wide
        status that cannot tell groups apart (Ascend's register), not the
        tensors: the step then reads it once for all groups (per group in
        turn with ``skip_policy="per_group"``), at the top level only.
      on_npu: True on Ascend, where ``gate="auto"`` builds a ``tf.cond``
        under control flow v2.
    """

    name = _ClassName()
    reads_register = False
    on_npu = False
    #: Whether a skip it flags shows in the values the skip diagnosis reads
    #: (a non-finite gradient or loss; +-65504 on a saturating register).
    #: A check of its own (say a threshold) may flag finite values: its
    #: skips then read "backend_flagged". Default False.
    gives_evidence = False

    def overflow_flag(self, tensors, after=()):
        """Makes the flag of one check, at build time (once per check).

        Args:
          tensors: the gradients to check (tensors or ``tf.IndexedSlices``),
            possibly float16 and still scaled; small ones of one shape may
            come stacked.
          after: tensors the flag must also follow (the losses, the previous
            group's flag): a check that reads device state runs after them.

        Returns:
          A float32 scalar tensor that follows ``tensors``: finite, >= 0
          (flags are summed, so a negative one could cancel an overflow),
          and 0.0 exactly when the step may be applied.
        """
        raise NotImplementedError(
            "%s must implement overflow_flag(tensors, after=())." % type(self).__name__)

    def fusion_scope(self):
        """The context the step makes the pack, the check and the unscale
        in (not the backprop, the gate or the apply); none by default.

        Returns:
          A context manager, entered once per step.
        """
        return contextlib.suppress()

    def clear_status(self):
        """The op that resets the state ``overflow_flag`` reads
        (``TrainOps.clear_status``); a no-op by default."""
        return tf.no_op(name="clear_status")


def checked_flag(backend, tensors, after=()):
    """``backend.overflow_flag(tensors, after)``; TypeError unless it is a
    float32 scalar tensor."""
    flag = backend.overflow_flag(tensors, after=after)
    if not (isinstance(flag, tf.Tensor) and flag.dtype == tf.float32
            and flag.shape.ndims == 0):
        raise TypeError(
            "backend %r returned %r from overflow_flag; return a float32 scalar tensor "
            "(0.0 when finite)." % (backend.name, flag))
    return flag
