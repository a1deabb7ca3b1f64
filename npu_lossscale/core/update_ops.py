"""The ``update_ops`` argument of ``build()``: what an entry stands for (the
variable updates behind its wrappers), what the gate cannot hold, and the
checked ops per group."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals

from npu_lossscale.core import checks as _checks
from npu_lossscale.core import graph_state as _graph_state
from npu_lossscale.core import graph_walk as _graph_walk


def check_argument(update_ops, plan, per_group_ops):
    """``update_ops`` as a dict from group name (or "" for all) to ops."""
    _checks.check_bool("per_group_ops", per_group_ops,
                           "Pass True to also get one update op per group.")
    check_not_a_name(update_ops)
    if plan.window.steps > 1 and (update_ops or per_group_ops):
        raise ValueError(
            "update_ops and per_group_ops need accumulation_steps=1, got %d. Run the "
            "batch-norm updates with accumulate_op yourself." % plan.window.steps)
    if update_ops is None:
        return {}
    if isinstance(update_ops, dict):
        unknown = sorted(set(update_ops) - set(plan.group_names))
        if unknown:
            raise ValueError("update_ops names no group %r; the groups are %r."
                             % (unknown, list(plan.group_names)))
        checked = dict((name, check_update_ops(ops))
                       for name, ops in update_ops.items())
    else:
        if per_group_ops:
            raise ValueError(
                "update_ops must be a dict from group name to ops with "
                "per_group_ops=True, got a list. Pass e.g. update_ops={'d': d_updates, "
                "'g': g_updates}.")
        checked = {"": check_update_ops(update_ops)}
    everything = [op for ops in checked.values() for op in ops]
    for index, op in enumerate(everything):
        # With per-group ops an op may be several groups' (each group's step
        # runs a copy of it when it applies; update_op runs it once).
        if op in everything[:index] and not per_group_ops:
            raise ValueError("update op %r is listed for two groups. List it for one, or "
                             "pass per_group_ops=True." % (op.name,))
    everything = _distinct(everything)
    check_update_ops_off_the_losses(everything, plan.losses)
    if plan.gate_kind == "cond" and tf.control_flow_v2_enabled():
        _checks.check_no_ref_inputs(everything)
    return checked


def _distinct(ops):
    """``ops`` without repeats, in order."""
    seen = set()
    return [op for op in ops if not (op in seen or seen.add(op))]


def joint(checked):
    """The ops ``update_op`` gates: every group's, each once."""
    return _distinct([op for ops in checked.values() for op in ops])


def check_update_ops_off_the_losses(update_ops, losses):
    """Raises ValueError for an update op one of ``losses`` depends on (TF1's
    ``with tf.control_dependencies(update_ops): loss = ...``): it runs on
    every step, and gating it would make the gate depend on itself."""
    found = _graph_walk.first_reached(
        [loss.op for loss in losses],
        lambda op: [tensor.op for tensor in op.inputs] + list(op.control_inputs), update_ops)
    if found is not None:
        raise ValueError(
            "update op %r already runs with a loss (through `with "
            "tf.control_dependencies(update_ops):`), so it would run on skipped steps. "
            "Build the loss without that dependency and pass the op only to update_ops."
            % (found.name,))


# -- what an update_ops entry stands for ----------------------------------------

def _is_gate(op):
    return op.name in _graph_state.of(op.graph).gates


def _function_writes(op):
    """True when a function the functional op or call ``op`` runs (or one
    those call) writes a variable, or is not in the graph to look into."""
    def definition(name):
        return getattr(_tf_internals.graph_function(op.graph, name), "definition", None)

    return any(body is None or any(_graph_walk.is_update(node.op) for node in body.node_def)
               for _, body in _graph_walk.function_bodies(op.node_def, definition))


def _classify(op):
    """The ``graph_walk`` kind of ``op``: another step's gate, or a v2 cond
    or loop whose body writes, is a barrier; a called ``tf.function`` that
    writes is an update (its whole body waits for the gate)."""
    if _is_gate(op):
        return _graph_walk.BARRIER
    if op.type in _graph_walk.FUNCTIONAL_CONTROL_FLOW_TYPES:
        return _graph_walk.BARRIER if _function_writes(op) else _graph_walk.CONTROL
    if op.type in _graph_walk.FUNCTION_CALL_TYPES and _function_writes(op):
        return _graph_walk.UPDATE
    return _graph_walk.kind_of_type(op.type)


def _parents(op):
    """What ``op`` waits for: its inputs' ops (``graph_walk.walked_inputs``),
    then its control inputs."""
    inputs = _graph_walk.walked_inputs(op.type, op.inputs)
    return [tensor.op for tensor in inputs] + list(op.control_inputs)


def check_not_a_name(value):
    """Raises TypeError for an op name given instead of the op."""
    if isinstance(value, (str, bytes)):
        raise TypeError(
            "update_ops must hold ops, not names, got the string %r. Pass "
            "tf.get_default_graph().get_operation_by_name(%r)." % (value, value))


def updates_of(op):
    """The list of updates (variable writes, calls of functions that write)
    the entry ``op`` stands for.

    Raises:
      ValueError: when it leads to another step's gate, to updates inside or
        behind a cond or loop, or to no update.
    """
    walk = _graph_walk.updates_behind([op], _parents, _classify)
    for barrier in walk.barriers:
        if _is_gate(barrier.node):
            raise ValueError(
                "update_ops entry %r runs another training step (gate %r), not an "
                "update. Run that step in its own session.run and pass the model's "
                "update ops." % (op.name, barrier.node.name))
    inside = [barrier.node for barrier in walk.barriers]
    inside += [reached.via for reached in walk.updates if reached.via is not None]
    if inside:
        raise ValueError(
            "update_ops entry %r reaches its updates through a tf.cond or tf.while_loop "
            "(op %r), which the gate cannot hold. Pass the updates made at the top "
            "level, without the cond." % (op.name, inside[0].name))
    updates = [reached.node for reached in walk.updates]
    if not updates:
        raise ValueError(
            "update_ops entry %r (type %s) updates no variable. Pass the ops that update "
            "state, e.g. tf.get_collection(tf.GraphKeys.UPDATE_OPS)." % (op.name, op.type))
    for update in updates:
        if _tf_internals.control_flow_context(update) is not None:
            raise ValueError(
                "update op %r is inside a tf.cond or tf.while_loop, which the gate cannot "
                "hold. Make the update at the top level of the graph." % (update.name,))
    return updates


def check_update_ops(update_ops):
    """Checks the ops passed as ``update_ops`` and returns the updates to gate.

    Each entry (an op, a tensor, ``var.assign_sub``'s result, or a wrapper of
    them) stands for the updates behind it (``graph_walk.updates_behind``);
    those are gated, not the wrappers.

    Returns:
      A tuple of ops.

    Raises:
      TypeError: for a name or an entry that is no op or tensor.
      ValueError: for one from another graph, or one ``updates_of`` refuses.
    """
    check_not_a_name(update_ops)
    if _checks.op_of(update_ops) is not None:
        update_ops = [update_ops]
    ops = []
    for entry in update_ops:
        check_not_a_name(entry)
        op = _checks.op_of(entry)
        if op is None:
            raise TypeError("update_ops must hold ops or tensors, got %r. Pass "
                            "tf.get_collection(tf.GraphKeys.UPDATE_OPS)." % (entry,))
        if op.graph is not tf.get_default_graph():
            raise ValueError("update op %r belongs to another graph. Pass the update ops "
                             "of the model's graph." % (op.name,))
        for update in updates_of(op):
            if update not in ops:
                ops.append(update)
    return tuple(ops)
