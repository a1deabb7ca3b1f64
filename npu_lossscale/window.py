"""Phase 5, the accumulation window: which runs close the step.

A window is ``accumulation_steps`` micro-batches. Each run adds its unscaled
gradients to float32 accumulators and its overflow flags to the window's
flags; the run that closes the window hands the window's sums and flags to
the rest of the step (reduction, decision, commit, manager update), which is
the same code as without accumulation, then zeroes the window.

* Without a ``distributed`` engine every run is ``update_op``; the rest of
  the step runs inside the ``window`` cond, at the window's last run.
* With one, ``accumulate_op`` adds the first micro-batches and ``update_op``
  closes the window at the top level of the graph, so the collectives run
  once per window and never inside a cond.

All state is in non-trainable global variables, so ``tf.train.Saver``
checkpoints a window in progress and a restore continues it exactly.
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale import overflow as _overflow


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


class WindowStep(collections.namedtuple(
        "WindowStep", ["applied", "window_end", "accumulate_op", "decisions", "grads",
                       "entry_ops", "accumulate_entry_ops"])):
    """What the window hands back to ``build``.

    Attributes:
      applied: bool scalar, True when this run applied.
      window_end: bool scalar, True when this run closed a window.
      accumulate_op: the op adding a micro-batch without closing the window,
        or None without accumulation.
      decisions: the ``overflow.Decisions`` reported by ``TrainOps``.
      grads: ordered dict of the (gradient, variable) pairs reported.
      entry_ops: top-level ops that every write of ``update_op``'s run
        follows (and no write of ``accumulate_op``), for its run-time claim;
        None without accumulation, where the decisions are those ops.
      accumulate_entry_ops: the same for ``accumulate_op``, or None.
    """


def run(plan, grads, flags, finish, after):
    """Runs the rest of the step (``finish``) on the runs that close a window.

    Args:
      plan: the ``plan.Plan``.
      grads: ordered dict from group name to this run's unscaled pairs.
      flags: ordered dict from check name to this run's float32 flag.
      finish: ``finish(flags, grads, after, to_apply)``, the rest of the step;
        returns a record with ``applied``, ``decisions`` and ``grads``.
        ``to_apply`` maps the reduced gradients to the ones applied.
      after: tensors the manager updates must follow (the scale reads).

    Returns:
      A ``WindowStep``.
    """
    if plan.window.steps == 1:
        step = finish(flags, grads, after, None)
        return WindowStep(step.applied, tf.constant(True, name="window_end"), None,
                          step.decisions, step.grads, None, None)
    if plan.window.closed_by_update_op:
        return _closed_by_update_op(plan, grads, flags, finish, after)
    return _closed_at_window_end(plan, grads, flags, finish, after)


def _flag_vector(plan, flags):
    """One float32 flag per group, in group order (0 for an unchecked group)."""
    return tf.stack([flags[plan.check_of(name)] if plan.check_of(name) else tf.zeros([])
                     for name in plan.group_names], name="flags")


def _check_flags(plan, window_flags):
    """The window's flag of each check (that of the check's first group)."""
    return collections.OrderedDict(
        (item.name, window_flags[plan.group_names.index(item.groups[0])])
        for item in plan.checks)


def _open(plan, grads, flags):
    """The window's accumulators, this run's flag vector, the op that adds a
    micro-batch without closing the window, and the op its writes follow."""
    accumulator = GradientAccumulator(grads, plan.window.steps)
    vector = _flag_vector(plan, flags)
    accumulate_op, entry = _accumulate_only(accumulator, grads, vector)
    return accumulator, vector, accumulate_op, entry


def _closed_at_window_end(plan, grads, flags, finish, after):
    accumulator, vector, accumulate_op, accumulate_entry = _open(plan, grads, flags)
    adds = accumulator.accumulate(grads, vector)
    with tf.control_dependencies(adds + list(after)):
        window_end = tf.equal(accumulator.micro_step.read_value(), plan.window.steps - 1,
                              name="window_end")
        window_flags = accumulator.window_flags.read_value()

    def at_window_end():
        step = finish(_check_flags(plan, window_flags), accumulator.means(grads), [], None)
        with tf.control_dependencies([step.applied]):
            resets = accumulator.reset()
        with tf.control_dependencies(resets):
            return tf.identity(step.applied)

    def mid_window():
        with tf.control_dependencies([accumulator.advance()]):
            return tf.constant(False)

    applied = tf.cond(window_end, at_window_end, mid_window, name="window")
    # This run's own decision, as without accumulation.
    decisions = _overflow.Decisions(flags, [g for pairs in grads.values() for g, _ in pairs])
    return WindowStep(applied, window_end, accumulate_op, decisions, grads, adds,
                      [accumulate_entry])


def _closed_by_update_op(plan, grads, flags, finish, after):
    accumulator, vector, accumulate_op, accumulate_entry = _open(plan, grads, flags)
    with tf.name_scope("close_window"):
        last = _window_position_check(accumulator, last=True)
        with tf.control_dependencies([last]):
            adds = accumulator.accumulate(grads, vector)
        with tf.control_dependencies(adds):
            sums = accumulator.sums(grads)
            window_flags = accumulator.window_flags.read_value()
    step = finish(_check_flags(plan, window_flags), sums, after, accumulator.means_of)
    applied_means = [g for pairs in step.grads.values() for g, _ in pairs]
    # The window's values are read (and reduced) before they are zeroed.
    with tf.control_dependencies([step.applied] + applied_means):
        resets = accumulator.reset()
    with tf.control_dependencies(resets):
        applied = tf.identity(step.applied, name="window_applied")
    return WindowStep(applied, tf.constant(True, name="window_end"), accumulate_op,
                      step.decisions, step.grads, [last], [accumulate_entry])


def _window_position_check(accumulator, last):
    """An assert that this run is (``last``) or is not the window's last."""
    position = accumulator.micro_step.read_value()
    steps = accumulator.steps
    if last:
        ok = tf.equal(position, steps - 1)
        message = ("update_op closes an accumulation window of %d micro-batches, "
                   "so it must follow exactly %d runs of accumulate_op; it followed"
                   % (steps, steps - 1))
        fix = ("runs. Run accumulate_op for the first %d micro-batches of each "
               "window and update_op for the last." % (steps - 1))
    else:
        ok = tf.less(position, steps - 1)
        message = "accumulate_op ran after"
        fix = ("runs of accumulate_op in a window of %d micro-batches; the last "
               "micro-batch belongs to update_op, which closes the window. Run "
               "update_op for the last micro-batch of each window." % steps)
    # The raw op: tf.Assert would wrap non-string data in a cond guard, whose
    # inner assert a control input of the guard does not order (claims).
    return tf.raw_ops.Assert(condition=ok, data=[message, position, fix], name="window_position")


def _accumulate_only(accumulator, grads, flag_vector):
    """The op adding one micro-batch that is not its window's last, and the
    check every write of it follows."""
    with tf.name_scope("accumulate_only"):
        check = _window_position_check(accumulator, last=False)
        with tf.control_dependencies([check]):
            adds = accumulator.accumulate(grads, flag_vector)
        with tf.control_dependencies(adds):
            return tf.group(accumulator.advance(), name="accumulate_op"), check
