"""Sub-steps in one op: ``build(sequence=["d", "d", "g"])``.

A GAN trained the usual TF1 way runs the discriminator's step in one
``session.run`` and the generator's in the next. On Ascend only the op named
``IterationOp`` loops on the device (``device_loop``), so such a loop cannot
run there; TF-GAN's ``TPUGANEstimator`` and ModelZoo's compare_gan put the
sub-steps into one op instead. Here each sub-step is a whole step of its
group, built by the same pipeline as a per-group op (``core.step``), under
the previous sub-step's end: its loss callable is called again there, so its
forward pass reads the weights the previous sub-step wrote (resource or ref
variables alike), and an input pipeline read inside it gives each sub-step a
batch of its own, as separate runs would.

Per sub-step: its own scale read, check, gate, skip decision, manager update
and skip record (the record's history names the sub-step); the batch-norm
statistics its callable adds to ``tf.GraphKeys.UPDATE_OPS`` run behind its
gate; on the float-status register its reads follow a clear of their own,
made after the previous sub-step. ``global_step`` advances once per run of
the sequence, after the last sub-step: by one when any sub-step applied
(every run with ``count_skipped_steps``); ``skipped_steps`` counts the
skipped sub-steps. The state the sequence moves is claimed once for the
whole op (``core.claims``).
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale.core import claims as _claims
from npu_lossscale.core import plan as _plan
from npu_lossscale.core import step as _step
from npu_lossscale.diagnostics import record as _record


class SubStep(collections.namedtuple("SubStep", ["index", "name", "step", "diagnosis"])):
    """One sub-step of a sequence.

    Attributes:
      index: its place in the sequence.
      name: its group's name.
      step: the ``core.step.Step`` built for it.
      diagnosis: its skip diagnosis's report: the reason code, and the dict
        from group name to whether it overflowed.
    """


class Sequence(collections.namedtuple(
        "Sequence", ["update_op", "substeps", "is_finite", "applied"])):
    """What ``build_sequence`` made.

    Attributes:
      update_op: the op that runs every sub-step in order, then advances the
        global step.
      substeps: the ``SubStep``s, in order.
      is_finite: bool scalar, True when every sub-step's check passed.
      applied: bool scalar, True when any sub-step applied.
    """


def check_sequence(sequence, groups, loss_fns, options):
    """``sequence`` as a tuple of group names, checked; no op made.

    Args:
      sequence: what ``build(sequence=...)`` was given.
      groups: the builder's ``plan.Group`` records.
      loss_fns: dict from group name to the loss callable ``add()`` took.
      options: a dict of the other ``build()`` options a sequence cannot
        take, from name to whether it was given.

    Returns:
      A tuple of group names.

    Raises:
      TypeError: unless ``sequence`` is a list or tuple of str.
      ValueError: for an empty sequence, an unknown name, a group left out,
        a group whose loss is a tensor, or an option a sequence cannot take.
    """
    if not isinstance(sequence, (list, tuple)) or not all(
            isinstance(name, str) for name in sequence):
        raise TypeError("sequence must be a list of group names, got %r. Pass e.g. "
                        "sequence=['d', 'g']." % (sequence,))
    names = [group.name for group in groups]
    if not sequence:
        raise ValueError("sequence=[] has no sub-step. Pass the group names in the order "
                         "they run, e.g. %r." % (names,))
    unknown = [name for name in sequence if name not in names]
    if unknown:
        raise ValueError("sequence=%r names %r, which is no group (groups: %s). Pass the "
                         "names add() returned." % (list(sequence), unknown[0],
                                                     ", ".join(names)))
    left_out = [name for name in names if name not in sequence]
    if left_out:
        raise ValueError("sequence=%r leaves out group %r, which would never train. Name "
                         "every group at least once." % (list(sequence), left_out[0]))
    tensors = [name for name in names if name not in loss_fns]
    if tensors:
        raise ValueError(
            "sequence=%r: group %r's loss is a tensor, built once, so it cannot read the "
            "weights an earlier sub-step wrote. Pass add(lambda: build_loss(), ...) instead."
            % (list(sequence), tensors[0]))
    given = [name for name, on in sorted(options.items()) if on]
    if given:
        raise ValueError(
            "sequence=%r cannot take %s: each sub-step is a whole step of its own. Leave "
            "it out (a sub-step gates the UPDATE_OPS its loss callable adds)."
            % (list(sequence), given[0]))
    return tuple(sequence)


def build_sequence(sequence, groups, loss_fns, plan, global_step, skipped_steps, record,
                   counters, description):
    """Builds the sequence's op: one step per sub-step, each after the last.

    Args:
      sequence: the checked tuple of group names (``check_sequence``).
      groups: dict from group name to its ``plan.Group``.
      loss_fns: dict from group name to its loss callable.
      plan: the builder's ``plan.Plan``, for the backend, gate and options.
      global_step: an integer variable, or None.
      skipped_steps: the builder's ``commit.SkippedSteps``.
      record: the builder's skip ``Record``.
      counters: the builder's ``claims.StateKey`` of its counters.
      description: what the op is, for run-time messages.

    Returns:
      A ``Sequence``.
    """
    with tf.name_scope("sequence") as scope:
        start = tf.no_op(name="start")
    previous, substeps, moved = start, [], [counters]
    for index, name in enumerate(sequence):
        backend = plan.backend
        if backend.reads_register and index:
            backend = backend.cleared_after(previous, name="clear_status_%d" % index)
        with tf.control_dependencies([previous]):
            with tf.name_scope("loss_scale_%d_%s" % (index, name)):
                before = set(tf.get_collection(tf.GraphKeys.UPDATE_OPS))
                loss = loss_fns[name]()
                update_ops = [op for op in tf.get_collection(tf.GraphKeys.UPDATE_OPS)
                              if op not in before]
                group = groups[name]._replace(loss=loss)
                alone = _plan.make_plan(
                    [group], group.manager, backend, engine=plan.reduction.engine,
                    allreduce_gradients=plan.reduction.allreduce_gradients,
                    count_skipped_steps=plan.count_skipped_steps, gate_kind=plan.gate_kind,
                    conditions=[item.condition for item in plan.conditions])
                diagnosis = _record.SkipDiagnosis(record, substep=index)
                step = _step.build_step(
                    alone, "sub-step %d (%s) of %s" % (index, name, description), global_step,
                    skipped_steps, update_ops, observers=[diagnosis], substep=True)
        moved.extend(state for state in _step.moved_state(alone, None)
                     if all(state.key is not seen.key for seen in moved))
        substeps.append(SubStep(index, name, step, step.reports[0]))  # its one observer
        previous = step.update_op
    with tf.name_scope(scope):
        applied = tf.reduce_any(tf.stack([sub.step.applied for sub in substeps]),
                                name="applied")
        is_finite = tf.reduce_all(tf.stack([sub.step.is_finite for sub in substeps]),
                                  name="is_finite")
        done = [previous]
        if global_step is not None:
            with tf.control_dependencies([previous]):
                by = (tf.ones([], global_step.dtype.base_dtype) if plan.count_skipped_steps
                      else tf.cast(applied, global_step.dtype.base_dtype))
                done = [tf.assign_add(global_step, by).op]
        update_op = tf.group(*done, name="update")
    _claims.claim(moved, description, [start])
    return Sequence(update_op, tuple(substeps), is_finite, applied)
