"""Phase 3 of the step, the accumulation window: which runs close the step.

Each run of a window adds its unscaled gradients and its flags to float32
accumulators; the window's last run closes the step with the sums (the same
close as without accumulation), then zeroes them. The step calls, in order:

* ``open_window``: the accumulators and ``accumulate_op`` (no collective,
  no cond);
* with a ``distributed`` engine, ``update_op`` closes the window at the top
  level, so collectives run once per window and never in a cond:
  ``close_by_update_op``, the close, ``finish``;
* without one every run is ``update_op``: ``add_this_run``, then a cond
  whose true branch closes (``sums_at_window_end``, the close, ``finish``)
  and whose false branch ``advance``s.

The state is in global variables: a Saver checkpoints a window in progress.
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale.core import gradients as _gradients


class GradientAccumulator(object):
    """Accumulators for ``groups`` (group name -> (gradient, variable)
    pairs), a window of ``steps`` runs, and ``flags`` flags."""

    def __init__(self, groups, steps, flags):
        self.steps = steps
        self._slots = {}
        with tf.name_scope("accumulate"):
            self.micro_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                          name="micro_step")
            self.window_flags = tf.Variable(tf.zeros([flags], tf.float32),
                                            trainable=False, name="window_flags")
            for name, pairs in groups.items():
                with tf.name_scope(name):
                    self._slots[name] = [
                        tf.Variable(tf.zeros(var.shape, tf.float32), trainable=False,
                                    name=var.op.name.replace("/", "_"))
                        for _, var in pairs]

    def accumulate(self, groups, flags):
        """The list of ops adding this run's unscaled ``groups`` and float32
        ``flags`` vector to the window."""
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
        """Group name -> (float32 sum, variable) pairs, read from the slots."""
        return collections.OrderedDict(
            (name, [(slot.read_value(), var)
                    for slot, (_, var) in zip(self._slots[name], pairs)])
            for name, pairs in groups.items())

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


class Opened(collections.namedtuple(
        "Opened", ["accumulator", "flag_vector", "accumulate_op", "accumulate_entry"])):
    """An open window.

    Attributes:
      accumulator: the ``GradientAccumulator``.
      flag_vector: this run's float32 flags.
      accumulate_op: the op that adds this run without closing the window.
      accumulate_entry: the op every write of ``accumulate_op`` follows (its
        run-time claim attaches there).
    """


class ThisRun(collections.namedtuple("ThisRun", ["adds", "window_end", "window_flags",
                                                 "seen"])):
    """This run's micro-batch added, when every run is ``update_op``.

    Attributes:
      adds: the ops adding it (every write of ``update_op`` follows them).
      window_end: bool scalar, True when this run is the window's last.
      window_flags: the window's flags so far, read after the adds.
      seen: the ``Seen`` window, which writes nothing.
    """


class Seen(collections.namedtuple("Seen", ["sums", "window_end"])):
    """The window with this run in it (``Sums`` of flags, no gradients, and
    ``window_end``), read before this run's adds: fetching it writes nothing."""


def open_window(plan, grads, flags):
    """The ``Opened`` window, from this run's unscaled ``grads`` (by group)
    and ``flags`` (by check)."""
    accumulator = GradientAccumulator(grads, plan.window.steps,
                                      2 * len(plan.groups) + len(plan.conditions))
    vector = tf.concat([_flag_vector(plan, flags), _loss_bits(plan)], 0)
    with tf.name_scope("accumulate_only"):
        check = _window_position_check(accumulator, last=False)
        with tf.control_dependencies([check]):
            adds = accumulator.accumulate(grads, vector)
        with tf.control_dependencies(adds):
            accumulate_op = tf.group(accumulator.advance(), name="accumulate_op")
    return Opened(accumulator, vector, accumulate_op, check)


class Sums(collections.namedtuple("Sums", ["flags", "grads", "steps", "loss_flags"])):
    """What a window hands to the close: summed flags per check and
    condition, float32 gradient sums per group over ``steps`` runs, and per
    group the runs whose loss was not finite."""


def close_by_update_op(plan, opened, grads):
    """``update_op``'s run with an engine: checks that it is the window's
    last and adds it. Returns the window's ``Sums`` and the check every
    write of ``update_op`` follows."""
    accumulator = opened.accumulator
    with tf.name_scope("close_window"):
        last = _window_position_check(accumulator, last=True)
        with tf.control_dependencies([last]):
            adds = accumulator.accumulate(grads, opened.flag_vector)
        with tf.control_dependencies(adds):
            sums = accumulator.sums(grads)
            window_flags = accumulator.window_flags.read_value()
    return Sums(_check_flags(plan, window_flags), sums, plan.window.steps,
                _loss_flags(plan, window_flags)), last


def add_this_run(plan, opened, grads, after):
    """``update_op``'s run without an engine: the ``ThisRun`` that adds this
    micro-batch; the window's decision follows ``after`` (the scale reads)."""
    accumulator = opened.accumulator
    with tf.name_scope("seen"):
        # Snapshots: a ref variable's read would alias what the adds write.
        position = tf.raw_ops.Snapshot(input=accumulator.micro_step.read_value())
        before = tf.raw_ops.Snapshot(input=accumulator.window_flags.read_value())
        flags = before + opened.flag_vector
        seen = Seen(Sums(_check_flags(plan, flags), collections.OrderedDict(),
                         plan.window.steps, _loss_flags(plan, flags)),
                    tf.equal(position, plan.window.steps - 1, name="window_end"))
    with tf.control_dependencies([position, before]):
        adds = accumulator.accumulate(grads, opened.flag_vector)
    with tf.control_dependencies(adds + list(after)):
        window_end = tf.equal(accumulator.micro_step.read_value(), plan.window.steps - 1,
                              name="window_end")
        window_flags = accumulator.window_flags.read_value()
    return ThisRun(adds, window_end, window_flags, seen)


def sums_at_window_end(plan, opened, this_run, grads):
    """The window's ``Sums``, read in the ``window`` cond's true branch."""
    return Sums(_check_flags(plan, this_run.window_flags), opened.accumulator.sums(grads),
                plan.window.steps, _loss_flags(plan, this_run.window_flags))


def finish(opened, closed):
    """Zeroes the window after the ``closed`` step's decision and means;
    returns ``closed.applied``, after the zeroing."""
    applied_means = [g for pairs in closed.grads.values() for g, _ in pairs]
    with tf.control_dependencies([closed.applied] + applied_means):
        resets = opened.accumulator.reset()
    with tf.control_dependencies(resets):
        return tf.identity(closed.applied, name="window_applied")


def advance(opened):
    """A run inside the window: moves on, and returns False after the move."""
    with tf.control_dependencies([opened.accumulator.advance()]):
        return tf.constant(False)


def _flag_vector(plan, flags):
    """One float32 flag per group, in group order (0 for an unchecked group),
    then one per skip condition."""
    return tf.stack([flags[plan.check_of(name)] if plan.check_of(name) else tf.zeros([])
                     for name in plan.group_names]
                    + [flags[item.name] for item in plan.conditions], name="flags")


def _loss_bits(plan):
    """One float32 per group: 1 when its loss is not finite this run (0 for
    a group without a loss at hand)."""
    def not_finite(loss):
        return 1.0 - tf.cast(_gradients.finite(tf.cast(loss, tf.float32)), tf.float32)

    return tf.stack([tf.zeros([]) if group.loss is None else not_finite(group.loss)
                     for group in plan.groups], name="loss_bits")


def _loss_flags(plan, window_flags):
    """The window's count of non-finite losses of each group."""
    offset = len(plan.groups) + len(plan.conditions)
    return collections.OrderedDict(
        (name, window_flags[offset + index]) for index, name in enumerate(plan.group_names))


def _check_flags(plan, window_flags):
    """The window's flag of each check (that of the check's first group),
    then of each skip condition."""
    result = collections.OrderedDict(
        (item.name, window_flags[plan.group_names.index(item.groups[0])])
        for item in plan.checks)
    for index, item in enumerate(plan.conditions):
        result[item.name] = window_flags[len(plan.groups) + index]
    return result


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
    # The raw op: tf.Assert would wrap it in a cond guard, which a claim's
    # control input would not order.
    return tf.raw_ops.Assert(condition=ok, data=[message, position, fix], name="window_position")
