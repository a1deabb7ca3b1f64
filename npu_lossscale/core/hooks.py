"""Calling the seams' hooks: what each one returns is checked where the step
takes it, so that a hook of the user's that returns the wrong thing fails at
graph-build time with its name, not deep in TensorFlow or, worse, silently.

``seams.StepObserver`` hooks may return nothing (None). The ops of the
hooks that run in a branch of the gate (``StepObserver.on_skip``,
``SkipCondition.on_apply``) must be made by the hook itself: an op made
before it, outside the branch, would run on every step.
"""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams


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
        the branch: it would run on every step).
    """
    graph = tf.get_default_graph()
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
    return list(value)
