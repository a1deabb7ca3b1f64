"""Calling the seams' hooks: what they are given is the seams' own records
(``seams.StepState`` and its views, made here from the step's), and what
each one returns is checked where the step takes it, so that a hook of the
user's that returns the wrong thing fails at graph-build time with its
name, not deep in TensorFlow or, worse, silently.

``seams.StepObserver`` hooks may return nothing (None). The ops of the
hooks that run in a branch of the gate (``StepObserver.on_skip``,
``SkipCondition.on_apply``) must be made by the hook itself: an op made
before it, outside the branch, would run on every step; so would one that
the hook's ops wait for (``tf.group(made_before)``, a control dependency)
or whose written value they read.
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams
from npu_lossscale.core import graph_walk as _graph_walk


def group_view(group):
    """The ``seams.GroupView`` of a ``plan.Group`` (a view as it is)."""
    if isinstance(group, _seams.GroupView):
        return group
    return _seams.GroupView(group.name, group.loss, group.var_list, group.optimizer,
                            group.manager, group.checked, group.own_backprop,
                            tuple(group.transforms))


def plan_view(plan):
    """The ``seams.PlanView`` of a ``plan.Plan``."""
    backend = plan.backend
    return _seams.PlanView(
        tuple(group_view(group) for group in plan.groups),
        tuple(_seams.ManagerView(use.name, use.manager, use.groups) for use in plan.managers),
        plan.gate_kind, plan.reduction.engine,
        tuple(_seams.CheckView(check.name, check.groups) for check in plan.checks),
        tuple(_seams.ConditionView(item.name, item.condition) for item in plan.conditions),
        _seams.BackendView(bool(backend.reads_register),
                           # The protocol's defaults, for a backend that
                           # does not subclass it.
                           bool(getattr(backend, "gives_evidence", False)),
                           bool(getattr(backend, "on_npu", False))),
        plan.reduction.active, plan.window.steps)


def step_state(plan, global_step):
    """The ``seams.StepState`` of ``plan``'s step before anything is made."""
    return _seams.StepState(plan_view(plan), global_step)


def with_scales(state, plan, scales):
    """``state`` with the step's scale reads (``scales.read_scales``): as
    ``seams.ScaleView``s by manager use, and the value by group name."""
    return state._replace(
        scales=collections.OrderedDict(
            (name, _seams.ScaleView(scale.value, scale.inverse, scale.is_unit))
            for name, scale in scales.items()),
        loss_scales=collections.OrderedDict(
            (name, scales[plan.scale_of(name)].value) for name in plan.group_names
            if scales))


def close_view(closing, transformed=None):
    """The ``seams.CloseView`` of a ``close.Closing``."""
    return _seams.CloseView(closing.flags, closing.grads, closing.mean_over,
                            closing.loss_flags, transformed)


def hooked(owner, hook, state):
    """Calls ``owner.<hook>(state)``, a hook that returns a ``seams.Hooked``.

    Args:
      owner: the observer.
      hook: the hook's name ("before_scale_read", "before_update").
      state: the ``seams.StepState``.

    Returns:
      A ``seams.Hooked`` (empty for None).

    Raises:
      TypeError: for anything but a ``seams.Hooked`` or None.
    """
    value = getattr(owner, hook)(state)
    if value is None:
        return _seams.Hooked()
    if not isinstance(value, _seams.Hooked):
        raise TypeError("%s.%s returned %r; return a seams.Hooked(ops, entry_ops), or None "
                        "when it adds nothing." % (owner.name, hook, value))
    return value


def branch_ops(owner, hook, state):
    """Calls ``owner.<hook>(state)``, a hook whose ops run in a branch of the
    gate (``on_skip``, ``on_apply``), and returns them as a list.

    Args:
      owner: the observer or skip condition.
      hook: the hook's name.
      state: the ``seams.StepState``.

    Returns:
      A list of ``tf.Operation``s and ``tf.Tensor``s (empty for None).

    Raises:
      TypeError: for anything but an op, a tensor, a list or tuple of them,
        or None; or a ref variable the hook writes inside a functional If
        (TensorFlow's error, with the fix).
      ValueError: for an op the hook did not make (made before it, outside
        the branch: it would run on every step), or one it made that waits
        for such an op (a control input: ``tf.group``,
        ``tf.control_dependencies``) or reads what one wrote (a variable
        update's output).
    """
    graph = tf.get_default_graph()
    # What the branch itself makes every op of the hook wait for (its
    # pivot, the step's control dependencies): the inputs of an op made
    # here, and never run (nothing reads it).
    given = set(tf.no_op(name="hook_context").control_inputs)
    made_before = len(graph.get_operations())
    try:
        value = getattr(owner, hook)(state)
    except TypeError as error:
        if "_ref" not in str(error):
            raise
        raise TypeError(
            "%s.%s: %s. The hook's ops are built in the gate's branch, a functional If under "
            "control flow v2, where a variable it writes must be a resource variable: make "
            "it with tf.Variable(..., use_resource=True) or tf.get_variable(..., "
            "use_resource=True), or build with gate=\"pivot\"." % (owner.name, hook, error))
    if value is None:
        return []
    if isinstance(value, (tf.Operation, tf.Tensor)):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(item, (tf.Operation, tf.Tensor)) for item in value):
        raise TypeError("%s.%s returned %r; return a list of ops (or None)."
                        % (owner.name, hook, value))
    made = set(graph.get_operations()[made_before:])
    for item in value:
        op = item if isinstance(item, tf.Operation) else item.op
        if op not in made:
            raise ValueError(
                "%s.%s returned %r, an op made before the hook was called: it would run on "
                "every step, not only in the gate's branch. Make the op inside %s (e.g. "
                "return [tf.assign_add(self.count, 1).op])." % (owner.name, hook, op.name, hook))
        outside = _made_before_behind(op, made, given)
        if outside is not None:
            raise ValueError(
                "%s.%s returned %r, which runs %r, an op made before the hook was called "
                "(a control dependency, tf.group, or the output of an update): it would run "
                "on every step, not only in the gate's branch. Make that op inside %s (e.g. "
                "return [tf.assign_add(self.count, 1).op])."
                % (owner.name, hook, op.name, outside.name, hook))
    return list(value)


def replica_losses(engine, group):
    """``engine.replica_losses(group)``: one scalar float loss tensor of this
    graph per in-graph replica, checked.

    Args:
      engine: the ``seams.ReductionEngine``.
      group: the ``plan.Group``, or its ``seams.GroupView``; the engine is
        given the view.

    Returns:
      A tuple of loss tensors.

    Raises:
      TypeError: for anything but a non-empty list or tuple of float tensors.
      ValueError: for a loss of a known shape other than a scalar (its
        gradient would be the sum's: twice the gradient for two entries), or
        of another graph than the group's loss.
    """
    value = engine.replica_losses(group_view(group))
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(loss, tf.Tensor) and loss.dtype.base_dtype.is_floating
            for loss in value):
        raise TypeError(
            "%s.replica_losses(group %r) returned %r; return a non-empty tuple of float "
            "scalar loss tensors, one per in-graph replica (default: (group.loss,))."
            % (engine.name, group.name, value))
    for loss in value:
        if loss.shape.ndims is not None and loss.shape.ndims != 0:
            raise ValueError(
                "%s.replica_losses(group %r) returned %r, not a scalar: its gradient would "
                "be its sum's. Return one scalar loss per replica (e.g. "
                "tf.reduce_mean(loss))." % (engine.name, group.name, loss))
        if loss.graph is not group.loss.graph:
            raise ValueError(
                "%s.replica_losses(group %r) returned %r, a tensor of another graph than the "
                "group's loss. Return losses of the step's graph." % (engine.name, group.name,
                                                                     loss))
    return tuple(value)


def reduced(engine, flags, grads, allreduce_gradients):
    """``engine.reduce(flags, grads, allreduce_gradients)``, checked: the
    same flag names, each a float32 scalar, and each group's pairs over the
    variables it was given, each gradient of its variable's dtype and shape
    (a float16 gradient for a float32 variable would abort the process at
    its apply).

    Args:
      engine: the ``seams.ReductionEngine``.
      flags: ordered dict from flag name to float32 flag, as given.
      grads: ordered dict from group name to (gradient, variable) pairs.
      allreduce_gradients: whether the engine averages the gradients.

    Returns:
      ``(flags, grads)``, the engine's, as ordered dicts.

    Raises:
      TypeError: for anything but a pair of dicts with those keys, a flag
        that is no float32 scalar tensor, or pairs of another dtype.
      ValueError: for pairs over other variables, or of another shape.
    """
    owner = "%s.reduce" % engine.name
    value = engine.reduce(flags, grads, allreduce_gradients)
    try:
        new_flags, new_grads = value
    except (TypeError, ValueError):
        new_flags = new_grads = None
    if not (isinstance(new_flags, dict) and isinstance(new_grads, dict)
            and sorted(new_flags) == sorted(flags) and sorted(new_grads) == sorted(grads)):
        raise TypeError(
            "%s returned %r; return (flags, grads): an ordered dict with the flags' names %s "
            "and one with the groups' names %s, as it was given."
            % (owner, value, list(flags), list(grads)))
    for name in flags:
        flag = new_flags[name]
        if not (isinstance(flag, tf.Tensor) and flag.dtype == tf.float32
                and flag.shape.ndims == 0):
            raise TypeError(
                "%s returned %r for flag %r; return a float32 scalar tensor for each flag "
                "(the workers' sum, 0.0 to apply)." % (owner, flag, name))
    result = collections.OrderedDict()
    for name in grads:
        result[name] = checked_pairs(
            owner, name, grads[name], new_grads[name],
            "Return the reduced pairs, e.g. [(hvd.allreduce(g), v) for g, v in pairs].")
    return collections.OrderedDict((name, new_flags[name]) for name in flags), result


def checked_pairs(owner, group_name, given, returned, example):
    """``returned``, refused unless one (gradient, variable) pair for each
    of ``given``'s variables, each gradient of its variable's dtype and
    shape.

    Args:
      owner: the hook, for the messages (e.g. "Clip.transform").
      group_name: the group's name.
      given: the pairs the hook was given.
      returned: what it returned.
      example: the fix for a wrong type, a sentence (e.g. "Return e.g.
        [(g, v) ...].").

    Returns:
      The list of pairs.

    Raises:
      TypeError: for anything but pairs of gradients and the variables
        given, or a gradient of another dtype.
      ValueError: for a variable left out or listed twice, or a gradient of
        another shape.
    """
    try:
        pairs = [(grad, var) for grad, var in returned]
    except (TypeError, ValueError):
        pairs = None
    variables = set(id(var) for _, var in given)
    if (pairs is None or any(id(var) not in variables for _, var in pairs)
            or any(not isinstance(grad, (tf.Tensor, tf.IndexedSlices)) for grad, _ in pairs)):
        raise TypeError(
            "group %r: %s returned %r, not a list of (gradient, variable) pairs over the "
            "variables it was given. %s" % (group_name, owner, returned, example))
    if sorted(id(var) for _, var in pairs) != sorted(id(var) for _, var in given):
        raise ValueError(
            "group %r: %s returned pairs for %s, given %s: return one pair for each variable "
            "it was given (a variable left out would never train, one listed twice would "
            "apply twice)." % (group_name, owner, [var.op.name for _, var in pairs],
                               [var.op.name for _, var in given]))
    for grad, var in pairs:
        if grad.dtype.base_dtype != var.dtype.base_dtype:
            raise TypeError(
                "group %r: %s returned a %s gradient for %s, a %s variable. Cast it back: "
                "tf.cast(g, v.dtype.base_dtype)." % (group_name, owner,
                                                      grad.dtype.base_dtype.name, var.op.name,
                                                      var.dtype.base_dtype.name))
        if isinstance(grad, tf.Tensor) and not grad.shape.is_compatible_with(var.shape):
            raise ValueError(
                "group %r: %s returned a gradient of shape %s for %s, of shape %s. Return "
                "gradients of their variables' shapes." % (group_name, owner, grad.shape,
                                                           var.op.name, var.shape))
    return pairs


def _made_before_behind(op, made, given):
    """The first op outside ``made`` that ``op`` makes run, through the ops
    of ``made``: a control input (but those of ``given``, the branch's
    own), or the producer of a data input that writes a variable; None if
    there is none. Reading a variable, a constant or any other value made
    before is fine: it writes nothing."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for control in current.control_inputs:
            if control in given:
                continue
            if control not in made:
                return control
            stack.append(control)
        for tensor in current.inputs:
            if tensor.op in made:
                stack.append(tensor.op)
            elif _graph_walk.is_update(tensor.op.type):
                return tensor.op
    return None
