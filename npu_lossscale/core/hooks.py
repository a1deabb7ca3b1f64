"""Calling the seams' hooks: what each one returns is checked where the step
takes it, so that a hook of the user's that returns the wrong thing fails at
graph-build time with its name, not deep in TensorFlow or, worse, silently.

``seams.StepObserver`` hooks may return nothing (None). The ops of the
hooks that run in a branch of the gate (``StepObserver.on_skip``,
``SkipCondition.on_apply``) must be made by the hook itself: an op made
before it, outside the branch, would run on every step; so would one that
the hook's ops wait for (``tf.group(made_before)``, a control dependency)
or whose written value they read.
"""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams
from npu_lossscale.core import graph_walk as _graph_walk


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
