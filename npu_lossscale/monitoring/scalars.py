"""``summaries``: the loss-scale state as ``tf.summary.scalar``s, read
without running a step (and, when asked, the run's applied flag and a
device loop's skips)."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale.core import checks as _checks
from npu_lossscale import diagnostics as _diagnostics
from npu_lossscale.core import graph_state as _graph_state


def summaries(train_ops, family="loss_scale", step_applied=False, iterations_per_loop=None):
    """Adds ``tf.summary.scalar`` summaries of the loss-scale state.

    They read state only, so fetching them never runs a step:
    ``<family>/scale`` and ``<family>/skipped_total`` (before this run's
    update), ``<family>/skips_<reason>`` for each reason but "applied",
    ``<family>/overflows_<group>``, and ``<family>/scale_<group>`` when
    groups have scales of their own. They go to ``tf.GraphKeys.SUMMARIES``.

    Args:
      train_ops: the ``TrainOps`` returned by ``MultiOptimizerLossScale.build``.
      family: the name prefix of the scalars.
      step_applied: also return ``<family>/step_applied`` (1 when this run's
        step applied) last. Fetching it runs ``update_op``, so it is kept out
        of ``tf.GraphKeys.SUMMARIES``: fetch it with ``update_op`` only.
      iterations_per_loop: under a device loop of this many steps per
        ``session.run``, also return ``<family>/skipped_in_loop`` last: how
        many of the last ``iterations_per_loop`` steps skipped, this one
        included, read after the step (from the record's history and the
        global step), so at a run's last iteration, the one the host sees,
        the run's skips. Like ``step_applied`` it runs ``update_op`` and is
        kept out of ``tf.GraphKeys.SUMMARIES``: fetch it with the loop's
        op. Needs a step built with ``global_step`` (the graph's) and
        ``count_skipped_steps=True``.

    Returns:
      The list of summary tensors.

    Raises:
      TypeError: if ``train_ops`` is not a ``TrainOps``, ``step_applied``
        not a bool, or ``iterations_per_loop`` not an int.
      ValueError: for ``iterations_per_loop`` < 1, or with a step that does
        not count its skipped steps in the graph's global step.
    """
    _checks.check_train_ops(train_ops)
    _checks.check_bool("step_applied", step_applied,
                           "Pass True to also get the joint step's applied flag.")
    loop_steps = None
    if iterations_per_loop is not None:
        loop_steps = _checks.check_count("iterations_per_loop", iterations_per_loop,
                                         "Pass the device loop's steps per run, e.g. 1000.")
        global_step = tf.train.get_global_step(train_ops.update_op.graph)
        if train_ops.counts_skipped_steps is not True or global_step is None:
            raise ValueError(
                "iterations_per_loop=%r needs a step whose global step counts every "
                "iteration, got counts_skipped_steps=%r. Build with "
                "global_step=tf.train.get_or_create_global_step() and "
                "count_skipped_steps=True." % (iterations_per_loop,
                                               train_ops.counts_skipped_steps))
    with tf.name_scope(None):
        result = [
            tf.summary.scalar("%s/scale" % family, train_ops.loss_scale),
            tf.summary.scalar("%s/skipped_total" % family, train_ops.skipped_steps),
        ]
        record = train_ops.diagnosis.last_skip
        known = _diagnostics.reasons_of(train_ops).names[
            :record.reason_counts.shape.as_list()[0]]
        result.extend(
            tf.summary.scalar("%s/skips_%s" % (family, reason), record.reason_counts[code])
            for code, reason in enumerate(known) if code != _diagnostics.APPLIED)
        group_names = [_diagnostics.decoded(name)
                       for name in tf.get_static_value(record.group_names)]
        result.extend(
            tf.summary.scalar("%s/overflows_%s" % (family, name), record.group_counts[index])
            for index, name in enumerate(group_names))
        scales = dict((name, group.loss_scale) for name, group in train_ops.groups.items())
        if len(set(tensor.name for tensor in scales.values())) > 1:
            result.extend(tf.summary.scalar("%s/scale_%s" % (family, name), scale)
                          for name, scale in sorted(scales.items()))
        if step_applied:
            result.append(tf.summary.scalar(
                "%s/step_applied" % family, tf.cast(train_ops.applied, tf.float32),
                collections=[]))
        if loop_steps is not None:
            result.append(tf.summary.scalar(
                "%s/skipped_in_loop" % family,
                _skipped_in_loop(train_ops, global_step, loop_steps), collections=[]))
    return result


def _skipped_in_loop(train_ops, global_step, steps):
    """float32 scalar: the skips among the last ``steps`` global steps,
    this run's included, read after ``update_op``."""
    record = _graph_state.of(train_ops.update_op.graph).records[train_ops.update_op.name]
    with tf.control_dependencies([train_ops.update_op]):
        recent = record.recent_skips()
        now = tf.cast(global_step.read_value(), tf.int64)
    # A skip's global step is the one it ran at, before the step's increment.
    inside = tf.logical_and(tf.greater(recent.number, 0),
                            tf.greater_equal(recent.global_step, now - steps))
    return tf.reduce_sum(tf.cast(inside, tf.float32))
