"""What a backend is: the one declaration the step is written against.

A backend turns the step's gradients into one float32 scalar *overflow flag*:
0.0 when the step is finite, non-zero when it overflowed. A flag (rather than a
bool) is what data-parallel workers sum across ranks, and what an accumulation
window sums across micro-batches: zero after the sum means every rank and
every micro-batch was finite.

* ``IsFiniteBackend`` (CPU/GPU, and Ascend in INF/NaN mode) reads every
  gradient once.
* ``NpuFloatStatusBackend`` (Ascend in saturation mode) reads the device's
  float-status register after all gradients; the graph's one clear runs
  before anything a read follows.
  There, an overflowing float16 result becomes +-65504 instead of inf, so the
  register is the only witness of the overflow.

``resolve_backend`` picks one by name, or takes any ``Backend`` instance. The
rest of the step reads only what ``Backend`` declares: ``name``,
``reads_register``, ``on_npu``, ``overflow_flag`` and ``clear_status``.
"""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf


class _ClassName(object):
    """The class's name, until a subclass or an instance sets its own."""

    def __get__(self, instance, owner):
        return owner.__name__


class Backend(object):
    """An overflow check: subclass it and implement ``overflow_flag``.

    Pass an instance as ``backend=`` to ``MultiOptimizerLossScale``,
    ``LossScaleOptimizer`` or ``all_finite``; nothing else needs to know of
    it. The defaults describe a check that reads the gradients themselves.

    Example::

      class AbsMax(Backend):
          name = "abs_max"

          def overflow_flag(self, tensors, after=()):
              big = [tf.reduce_any(tf.abs(tf.cast(t, tf.float32)) > 1e4)
                     for t in tensors]
              return tf.cast(tf.reduce_any(tf.stack(big)), tf.float32)

    Attributes:
      name: a short str naming the check (``MultiOptimizerLossScale.backend``
        reports it). Defaults to the class name.
      reads_register: True when ``overflow_flag`` reads one device-wide
        status that cannot tell groups apart (Ascend's float-status register)
        rather than the tensors it is given. The step then reads it once for
        all groups (or once per group, each group's backprop after the
        previous read, with ``skip_policy="per_group"``), builds it at the top
        level of the graph only, and warns when a second object of the graph
        reads it. Default False.
      on_npu: True when the step runs on Ascend, where ``gate="auto"`` builds
        a ``tf.cond`` under control flow v2 (the adapter rejects raw v1
        Switch/Merge there). Default False.
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
        """Makes the flag of one check.

        Called at build time, once per check of a step (once per group with
        ``skip_policy="per_group"``), in the caller's name scope and graph; it
        may be called several times per graph.

        Args:
          tensors: the gradients to check (tensors or ``tf.IndexedSlices``,
            none of them None), possibly float16: those of
            ``MultiOptimizerLossScale`` still multiplied by the loss scale
            (small ones of one shape may come stacked into one tensor, same
            values), those ``LossScaleOptimizer.apply_gradients`` receives
            (unscaled), or those given to ``all_finite``.
          after: tensors the flag must also follow: the losses, or the
            previous group's flag. A check that reads the tensors themselves
            may ignore it; one that reads device state must run after them
            (``tf.control_dependencies``) so that every overflow it must see
            has landed.

        Returns:
          A float32 scalar tensor that follows every tensor of ``tensors``
          (computed from them, or after them): finite, >= 0, and 0.0 exactly
          when the step may be applied. Flags are summed across workers and
          micro-batches, so a negative flag could cancel another's overflow.
        """
        raise NotImplementedError(
            "%s must implement overflow_flag(tensors, after=())." % type(self).__name__)

    def clear_status(self):
        """An op that resets the state ``overflow_flag`` reads, if any.

        The builder returns it as ``TrainOps.clear_status``. Default: a
        no-op (there is nothing to reset).

        Returns:
          A ``tf.Operation``.
        """
        return tf.no_op(name="clear_status")



def checked_flag(backend, tensors, after=()):
    """``backend.overflow_flag(tensors, after)``, refused unless a float32
    scalar tensor.

    Raises:
      TypeError: when the flag is not a float32 scalar tensor.
    """
    flag = backend.overflow_flag(tensors, after=after)
    if not (isinstance(flag, tf.Tensor) and flag.dtype == tf.float32
            and flag.shape.ndims == 0):
        raise TypeError(
            "backend %r returned %r from overflow_flag; return a float32 scalar tensor "
            "(0.0 when finite)." % (backend.name, flag))
    return flag
