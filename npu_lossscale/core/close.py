"""Phase 4 of the step, closing it: reduce across replicas, transform the
gradients, decide, update the managers, commit (``commit``).

``close`` runs on the run that closes a step (every run without
accumulation; the window's last one with it). It takes a ``Closing`` record,
the flags and gradients of the step as the earlier phases left them, and
returns a ``Closed`` one.
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale.core import checks as _checks
from npu_lossscale.core import collectives as _collectives
from npu_lossscale.core import commit as _commit
from npu_lossscale.core import gradients as _gradients
from npu_lossscale.core import hooks as _hooks
from npu_lossscale.core import overflow as _overflow


class Closing(collections.namedtuple("Closing", ["flags", "grads", "after", "mean_over",
                                                 "loss_flags"], defaults=(None,))):
    """What closing a step needs.

    Attributes:
      flags: ordered dict from flag name (each check's, each condition's)
        to float32 flag (0.0 to apply).
      grads: ordered dict from group name to the (gradient, variable) pairs:
        this run's unscaled gradients, or an accumulation window's float32
        sums.
      after: tensors the manager updates must follow (the step's scale
        reads), so the step reads each scale before it moves.
      mean_over: the number of micro-batches ``grads`` sum, 1 without
        accumulation: the applied gradients are their mean, taken after the
        reduction across workers, in each variable's dtype.
      loss_flags: for an accumulation window, ordered dict from group name
        to the count of its micro-batches whose loss was not finite; None
        when the losses themselves are at hand.
    """


class Closed(collections.namedtuple("Closed", ["applied", "decisions", "grads", "state"],
                                       defaults=(None,))):
    """A closed step.

    Attributes:
      applied: bool scalar, True when this run applied (any group); it
        follows the applies, the counters and the manager updates.
      decisions: the step's ``Decisions``.
      grads: ordered dict from group name to the applied pairs.
      state: the ``seams.StepState`` at the close (None for a worker whose
        chief closes).
    """


def close(plan, closing, global_step, skipped_steps=None, update_ops=(), observers=(),
          state=None):
    """Reduces, transforms, decides, updates the managers and commits.

    Args:
      plan: the ``plan.Plan``.
      closing: a ``Closing``.
      global_step: an integer variable, or None.
      skipped_steps: the ``commit.SkippedSteps`` counter, or None.
      update_ops: ops that run only when every group applies (or
        ``commit.Copies`` of them).
      observers: the step's ``seams.StepObserver``s; their ``on_skip`` ops
        make the gate's skip branch.
      state: the ``seams.StepState`` so far (the plan's alone if None).

    Returns:
      A ``Closed``.
    """
    engine = plan.reduction.engine
    flags, grads = _hooks.reduced(engine, closing.flags, closing.grads,
                                  plan.reduction.allreduce_gradients)
    if plan.reduction.active:
        _collectives.check_reduced(engine, (closing.flags, closing.grads), (flags, grads),
                                   plan.reduction.allreduce_gradients)
    if closing.mean_over > 1:
        grads = _gradients.means(grads, closing.mean_over)
    grads = transformed(plan, grads)
    flags, faults = _overflow.transformed_flags(plan, flags, grads)
    decisions = Decisions(flags, [g for pairs in grads.values() for g, _ in pairs])
    # The groups whose transforms may turn finite values into non-finite
    # ones: the skip diagnosis tells their fault from an overflow.
    state = (state if state is not None else _hooks.step_state(plan, global_step))._replace(
        closing=_hooks.close_view(closing, collections.OrderedDict(
            (name, pairs) for name, pairs in grads.items()
            if any(not transform.keeps_finite for transform in plan.group(name).transforms))),
        reduced_flags=flags)
    def skip_branch(scope):
        del scope
        return [op for observer in observers
                for op in _hooks.branch_ops(observer, "on_skip", state)]

    def on_apply():
        return [op for item in plan.conditions
                for op in _hooks.branch_ops(item.condition, "on_apply", state)]

    on_skip = skip_branch if flags and observers else None  # no flag: nothing skips

    # The managers' updates (user hooks that may fail) come before the
    # commit makes any state; they follow the step's scale reads, which is
    # all the step reads of the scale.
    updates = update_managers(plan, decisions, list(closing.after), faults)
    committed = _commit.commit(plan, grads, decisions, global_step, skipped_steps, update_ops,
                               on_skip=on_skip, on_apply=on_apply if plan.conditions else None)
    with tf.control_dependencies(committed.ops + updates):
        applied = tf.identity(committed.applied, name="applied")
    return Closed(applied, decisions, grads, state)


def transformed(plan, grads):
    """Each group's pairs through its ``seams.GradientTransform``s, in order.

    Args:
      plan: the ``plan.Plan``.
      grads: ordered dict from group name to unscaled pairs.

    Returns:
      A new ordered dict.

    Raises:
      TypeError: when a transform returns anything but (gradient, variable)
        pairs over the group's variables.
    """
    result = collections.OrderedDict()
    for name, pairs in grads.items():
        group = plan.group(name)
        fused = _gradients.fused_transform(plan, name)
        for transform in group.transforms:
            if transform is fused:  # applied with the unscale
                continue
            with tf.name_scope("%s/%s" % (name, transform.name)):
                pairs = _hooks.checked_pairs(
                    transform.name, name, pairs,
                    transform.transform(_hooks.group_view(group), list(pairs)),
                    "Return e.g. [(tf.clip_by_norm(g, 1.0), v) for g, v in grads_and_vars].")
        result[name] = pairs
    return result


class Decisions(object):
    """The step's bool decisions: one per check, ordered after the gradients.

    Anything gated on a decision therefore runs only once all of the step's
    gradients exist: no group's update can race another group's backprop.

    Args:
      flags: ordered dict from check name to float32 flag.
      after: tensors every decision must follow (the step's gradients).
    """

    def __init__(self, flags, after):
        self.flags = flags
        self._after = [_gradients.dense_values(t) for t in after]
        self.by_check = collections.OrderedDict()
        for name, flag in flags.items():
            with tf.control_dependencies(self._after):
                self.by_check[name] = tf.identity(tf.equal(flag, 0.0),
                                                  name="group_is_finite")
        self._always = None

    @property
    def ops(self):
        """The decision ops made so far: every write gated on a decision
        follows one of them."""
        tensors = list(self.by_check.values())
        if self._always is not None:
            tensors.append(self._always)
        return [tensor.op for tensor in tensors]

    def all_of(self, checks, name=None):
        """True when every check in ``checks`` passed (True if there is none).

        Args:
          checks: check names.
          name: the op name of a conjunction of several decisions.

        Returns:
          A bool scalar tensor; one decision is returned as it is.
        """
        decisions = [self.by_check[check] for check in checks]
        if not decisions:
            if self._always is None:
                with tf.control_dependencies(self._after):
                    self._always = tf.identity(tf.constant(True), name="always_finite")
            return self._always
        if len(decisions) == 1:
            return decisions[0]
        return tf.reduce_all(tf.stack(decisions), name=name)


def update_manager(manager, is_finite, after):
    """The manager's update, ordered after ``after`` (the step's scale reads).

    Args:
      manager: a loss-scale manager.
      is_finite: bool scalar, the decision its groups were gated on.
      after: ops or tensors the update must follow.

    Returns:
      The update op.

    Raises:
      TypeError: if ``update_loss_scale`` returns no op (None, a number...).
    """
    with tf.control_dependencies(after):
        update = manager.update_loss_scale(is_finite)
    return update_op(manager, update)


def update_op(manager, update):
    """The op of what ``manager.update_loss_scale`` returned, checked.

    Accepts an ``Operation``, a ``Tensor`` (an assign's output) or anything
    whose ``op`` is an ``Operation`` (what ``tf.assign`` returns for a
    resource variable), the forms contrib's and npu_bridge's optimizers
    accept in ``tf.group``.

    Args:
      manager: the manager (its class names the error).
      update: the value its ``update_loss_scale`` returned.

    Returns:
      A ``tf.Operation``.

    Raises:
      TypeError: for anything else, before the step uses it.
    """
    op = _checks.op_of(update)
    if op is not None:
        return op
    raise TypeError(
        "%s.update_loss_scale(finite_grads) returned %r, not an op. Return the assign "
        "op, or tf.no_op() for a scale that never moves."
        % (type(manager).__name__, update))


def update_managers(plan, decisions, after, faults=None):
    """Every used manager's update, fed with its groups' decision.

    A manager no group uses (the builder's, when every group brings its own)
    is read for ``TrainOps.loss_scale`` but never updated. A skip condition
    that does not move the scale holds the updates: on a step it skips while
    the overflow checks pass, no manager updates. So does a transform's own
    fault: on a step whose gradients passed a manager's checks and whose
    transforms returned inf or NaN, that manager does not update (unless a
    condition that moves the scale failed too).

    Args:
      plan: the ``plan.Plan``.
      decisions: the step's ``close.Decisions``.
      after: ops or tensors every update must follow (the applies and the
        scale reads, so that the step reads the scale before it moves).
      faults: ordered dict from check name to the bool that the check's
        transforms failed (``overflow.Transformed.faults``), or None.

    Returns:
      A list of ops.
    """
    faults = faults or {}
    moving = [item.name for item in plan.conditions if item.condition.moves_scale]
    holding = [item.name for item in plan.conditions if not item.condition.moves_scale]
    updates = []
    for use in plan.managers:
        if not use.groups:
            continue
        finite = decisions.all_of(list(use.checks) + moving)
        held = [faults[check] for check in use.checks if check in faults]
        if not holding and not held:
            updates.append(update_manager(use.manager, finite, after))
            continue
        free = tf.logical_or(decisions.all_of(holding), tf.logical_not(finite))
        if held:
            fault = tf.reduce_any(tf.stack(held))
            if moving:
                fault = tf.logical_and(fault, decisions.all_of(moving))
            free = tf.logical_and(free, tf.logical_not(fault))
        updates.append(_commit.run_if(
            free, lambda scope, manager=use.manager, finite=finite: [
                update_manager(manager, finite, after)], "update_%s" % use.name).op)
    return updates
