"""Which variables hold the loss scale and its state, and which writes run
once (behind a latch) rather than per step.
"""

from __future__ import absolute_import, division, print_function

import re

import tensorflow.compat.v1 as tf

from npu_lossscale.audit import _conditions

__all__ = ["find_once", "find_scale_state", "find_scale_vars"]

_SCALE_STATE_NAMES = re.compile(
    r"(^|/)(loss_scale|current_loss_scale|good_steps|bad_steps|num_good_steps)(_\d+)?$"
    r"|(^|/)(dynamic|exponential)_loss_scale(_\d+)?/state$")
_FLOATING = frozenset([tf.float16.as_datatype_enum, tf.float32.as_datatype_enum,
                       tf.float64.as_datatype_enum, tf.bfloat16.as_datatype_enum])


def find_scale_vars(facts):
    """The loss-scale variables (``Facts.scale_vars``)."""
    read_by_losses = set()
    for loss in set(facts.seeds.values()):
        read_by_losses |= facts.scaled_by(loss)
    result = set()
    for var in read_by_losses - facts.trainable:
        if facts.model.dtype_enum(var) not in _FLOATING:
            continue
        if not facts.model.is_small_variable(var):
            continue
        if any(facts.value_checked(m) or facts.branch_checked(m)
               for m in facts.mutations.get(var, ()) if m not in facts.once):
            result.add(var)
    return result


def find_scale_state(facts):
    """The loss-scale state (``Facts.scale_state``)."""
    state = set(facts.scale_vars)
    updates = [m for v in facts.scale_vars for m in facts.mutations.get(v, ())
               if m not in facts.once]
    values = [d for m in updates for d in facts.value_inputs(m)]
    read = facts.model.ancestors(values, data_only=True) & facts.variables
    for var in read - facts.trainable - state:
        if any(facts.value_checked(m) or facts.branch_checked(m)
               for m in facts.mutations.get(var, ())):
            state.add(var)
    for var in facts.variables - facts.trainable:
        if _SCALE_STATE_NAMES.search(var):
            state.add(var)
    return state


def find_once(facts):
    """The writes behind a latch (``once``): ``if not done: write;
    done = True``, where ``done`` is a non-trainable bool variable, so
    the branch runs until it has run (its writes are left out of the
    scale variables' and the updates' counts).

    Args:
      facts: the ``Facts`` being built (its variables, trainable,
        target and mutations).

    Returns:
      A set of write op names.
    """
    model = facts.model
    latches = set(v for v in facts.variables - facts.trainable
                  if model.dtype_enum(v) == tf.bool.as_datatype_enum)
    if not latches:
        return set()
    latched = {}  # (pred, value) -> whether the branch writes a latch it reads
    once = set()
    for name in facts.target:
        for literal in model.conditions(name):
            if literal.kind != "cond":
                continue
            key = (literal.pred, literal.value)
            if key not in latched:
                read = model.ancestors([_conditions.pred_node(literal)], data_only=True)
                latched[key] = any(
                    literal in model.conditions(write)
                    for var in read & latches for write in facts.mutations.get(var, ()))
            if latched[key]:
                once.add(name)
                break
    return once
