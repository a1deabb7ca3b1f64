"""Gradient accumulation windows: state and arithmetic, no control flow.

A window is ``accumulation_steps`` runs of the update op. Each run adds its
unscaled gradients to float32 accumulators and its overflow flags to the
window's flags. The builder decides, at the window's last run, whether to
apply the mean; this module only owns the variables and the arithmetic.

All state is in non-trainable global variables, so ``tf.train.Saver``
checkpoints a window in progress and a restore continues it exactly.
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf


class GradientAccumulator(object):
    """Accumulators for a set of (gradient, variable) groups.

    Args:
      groups: ordered mapping from group name to its (gradient, variable) pairs.
      steps: the window length, an int >= 2.
    """

    def __init__(self, groups, steps):
        self.steps = steps
        self._slots = {}
        with tf.name_scope("accumulate"):
            self.micro_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                          name="micro_step")
            self.window_flags = tf.Variable(tf.zeros([len(groups)], tf.float32),
                                            trainable=False, name="window_flags")
            for name, pairs in groups.items():
                with tf.name_scope(name):
                    self._slots[name] = [
                        tf.Variable(tf.zeros(var.shape, tf.float32), trainable=False,
                                    name=var.op.name.replace("/", "_"))
                        for _, var in pairs]

    def accumulate(self, groups, flags):
        """Ops adding this run's gradients and flags to the window.

        Args:
          groups: the same mapping as at construction, with this run's
            unscaled gradients.
          flags: float32 vector, one overflow flag per group (0 = finite).

        Returns:
          A list of ops.
        """
        ops = [tf.assign_add(self.window_flags, flags).op]
        for name, pairs in groups.items():
            for slot, (grad, _) in zip(self._slots[name], pairs):
                if isinstance(grad, tf.IndexedSlices):
                    values = tf.cast(grad.values, tf.float32)
                    ops.append(tf.scatter_add(slot, grad.indices, values).op)
                else:
                    ops.append(tf.assign_add(slot, tf.cast(grad, tf.float32)).op)
        return ops

    def sums(self, groups):
        """The window's summed gradients, float32 tensors read from the slots.

        Args:
          groups: the mapping of (gradient, variable) pairs (for the variables).

        Returns:
          Ordered mapping from group name to (float32 sum, variable) pairs.
        """
        return collections.OrderedDict(
            (name, [(slot.read_value(), var)
                    for slot, (_, var) in zip(self._slots[name], pairs)])
            for name, pairs in groups.items())

    def means_of(self, sums):
        """Window means of ``sums`` (as from ``sums``), in each variable's dtype."""
        inv = 1.0 / self.steps
        return collections.OrderedDict(
            (name, [(tf.cast(total * inv, var.dtype.base_dtype), var)
                    for total, var in pairs])
            for name, pairs in sums.items())

    def means(self, groups):
        """The window's mean gradients, in each variable's dtype.

        Args:
          groups: the mapping of (gradient, variable) pairs (for the variables).

        Returns:
          Ordered mapping from group name to (mean gradient, variable) pairs.
        """
        return self.means_of(self.sums(groups))

    def reset(self):
        """Ops that zero the accumulators, the window flags and the counter."""
        ops = [tf.assign(self.micro_step, tf.zeros([], tf.int64)).op,
               tf.assign(self.window_flags, tf.zeros_like(self.window_flags)).op]
        for slots in self._slots.values():
            ops.extend(tf.assign(slot, tf.zeros_like(slot)).op for slot in slots)
        return ops

    def advance(self):
        """The op that moves to the next run of the window."""
        return tf.assign_add(self.micro_step, tf.ones([], tf.int64)).op
