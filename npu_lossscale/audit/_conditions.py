"""The branch conditions under which each node of an inlined graph runs.

A node's conditions are the branch literals ``(predicate, value, kind)``
that must hold for it to run: from the dead-tensor rule of Switch/Merge
control flow (a node runs only if all of its inputs, data and control, are
live; a Merge runs if any input is) and from the branch function that holds
it (``Node.branch``, set by ``_inline``).
"""

from __future__ import absolute_import, division, print_function

import collections

from npu_lossscale.core import graph_walk

__all__ = ["Literal", "compute", "exclusive", "pred_node"]

#: A literal: the predicate tensor ("node:port"), the branch value, and its
#: kind ("cond" for conds and gates, "loop" for loops).
Literal = collections.namedtuple("Literal", ["pred", "value", "kind"])


def pred_node(literal):
    """The name of the node whose output is a literal's predicate."""
    return literal.pred.rsplit(":", 1)[0]


def _condition_deps(model, name):
    node = model.nodes[name]
    deps = [s for s, _ in node.inputs
            if not (node.type in graph_walk.MERGE_TYPES and s in model.nodes
                    and model.nodes[s].type in graph_walk.NEXT_ITERATION_TYPES)]
    deps.extend(node.controls)
    if node.call is not None:
        deps.append(node.call)
    return deps


def compute(model):
    """The conditions of every node of a ``GraphModel``.

    Args:
      model: a ``GraphModel``.

    Returns:
      A dict from node name to the frozenset of ``Literal``s that hold
      whenever the node runs.
    """
    result = {}
    empty = frozenset()

    def of_output(source, port):
        base = result.get(source, empty)
        node = model.nodes.get(source)
        if (node is not None and node.type in graph_walk.SWITCH_TYPES
                and len(node.inputs) > 1):
            pred = model.canonical(node.inputs[1])
            kind = "loop" if _is_loop_cond(model, pred) else "cond"
            return base | frozenset([Literal(pred, port == 1, kind)])
        return base

    for name in model.topological(lambda name: _condition_deps(model, name)):
        node = model.nodes[name]
        base = set()
        if node.call is not None:
            base |= result.get(node.call, empty)
            if node.branch is not None:
                base.add(node.branch)
        for control in node.controls:
            base |= result.get(control, empty)
        data = [(s, p) for s, p in node.inputs if s in model.nodes]
        if node.type in graph_walk.MERGE_TYPES:
            live = [of_output(s, p) for s, p in data
                    if model.nodes[s].type not in graph_walk.NEXT_ITERATION_TYPES]
            if live:
                common = set(live[0])
                for other in live[1:]:
                    common &= other
                base |= common
        else:
            for source, port in data:
                base |= of_output(source, port)
            if node.type in graph_walk.EXIT_TYPES and data:
                switch = model.nodes[data[0][0]]
                if switch.type in graph_walk.SWITCH_TYPES and len(switch.inputs) > 1:
                    pred = model.canonical(switch.inputs[1])
                    base = set(l for l in base if l.pred != pred)
        result[name] = frozenset(base)
    return result


def _is_loop_cond(model, pred):
    node = model.nodes.get(pred.split(":")[0])
    return node is not None and node.type == "LoopCond"


def exclusive(first, second):
    """True when two condition sets can never hold in the same run."""
    values = {}
    for literal in first:
        values.setdefault(literal.pred, set()).add(literal.value)
    for literal in second:
        if literal.pred in values and literal.value not in values[literal.pred]:
            return True
    return False
