"""The graph's own bookkeeping, which no check reports: the run-time
one-step-per-run claims and their counters, and the variables that cope
with holding no value (read only behind their own is-initialized check).
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale.core import graph_walk
from npu_lossscale.audit import _conditions
from npu_lossscale.audit import _graph

__all__ = ["Claims", "find_claims", "find_self_initializing"]

#: The run-time claims of a graph: ``counters``, a dict from claim (an
#: ``Assert`` node name) to its counter variable's name, and ``writes``, the
#: set of the claims' own writes (the counters' adds and resets and whatever
#: else non-trainable the claims write): bookkeeping that no check reports.
Claims = collections.namedtuple("Claims", ["counters", "writes"])

#: Ops that tell whether a variable holds a value (resource and ref variables).
_INITIALIZED_CHECK_TYPES = frozenset(["VarIsInitializedOp", "IsVariableInitialized"])
#: Ops a variable's ref, or its resource handle, passes through unread.
_REF_PASS_TYPES = graph_walk.SWITCH_TYPES.union(graph_walk.ENTER_TYPES)
_HANDLE_PASS_TYPES = _REF_PASS_TYPES.union(graph_walk.IDENTITY_TYPES)
_INTEGER = frozenset([tf.int32.as_datatype_enum, tf.int64.as_datatype_enum])
_ADD_TYPES = frozenset(["AssignAdd", "AssignAddVariableOp"])


def find_claims(facts):
    """The run-time claims of the graph: ``Assert(Equal(a, b))`` where one
    side derives from an add to a non-trainable integer counter that
    counts within the run: the other side reads the counter without the
    add (the count at the run's start), or the add follows a write of
    the counter that is not an add (its reset at the run's start).

    This is the shape of the library's claims (``npu_lossscale.claims``):
    each step op adds one to the counter before its first write and
    asserts that it is the run's only claim, so of two claims on one
    counter in a run one fails the run, and the writes that follow it
    never run.

    Args:
      facts: the ``Facts`` being built (its variables, trainable, target
        and mutations).

    Returns:
      A ``Claims``.
    """
    model = facts.model
    adds = dict((op, var) for op, var in facts.target.items()
                if model.nodes[op].type in _ADD_TYPES and var not in facts.trainable
                and model.dtype_enum(var) in _INTEGER and not facts.is_global_step(var))
    claims, bookkeeping = {}, set()
    if not adds:
        return Claims(claims, bookkeeping)
    stop = lambda n: n in facts.variables
    for name, node in model.nodes.items():
        if node.type != "Assert" or not node.inputs:
            continue
        equal = model.nodes.get(node.inputs[0][0])
        if equal is None or equal.type != "Equal" or len(equal.inputs) != 2:
            continue
        sides = [model.ancestors([source], stop=stop) for source, _ in equal.inputs]
        for add, var in adds.items():
            for this, other in (sides, sides[::-1]):
                if add not in this or add in other:
                    continue
                reset = any(w != add and w in this and model.nodes[w].type not in _ADD_TYPES
                            for w in facts.mutations.get(var, ()))
                if var in other or reset:
                    claims[name] = var
        if name in claims:
            bookkeeping |= set(
                w for w in model.ancestors([name], stop=stop)
                if w in facts.target and facts.target[w] not in facts.trainable)
    return Claims(claims, bookkeeping)


def find_self_initializing(model):
    """Variables that the graph reads only behind their own is-initialized
    check: every read that feeds another node sits in a cond branch taken
    when ``VarIsInitializedOp`` (or ``IsVariableInitialized``) of that
    variable is True, so the graph copes with the variable holding no
    value (the library's last-skip record, ``diagnosis.Record``).

    A read is the first op on the variable's handle or ref past
    ``Switch``/``Enter`` (and, for a resource handle, ``Identity``) that
    neither writes the variable nor checks its initialization; a read
    that nothing consumes (``ResourceVariable``'s own ``Read`` op) only
    runs when fetched and is left out.

    Args:
      model: a ``GraphModel``.

    Returns:
      A set of variable names.
    """
    nodes = model.nodes
    checks = {}  # variable -> its is-initialized check nodes
    for name, node in nodes.items():
        if node.type in _INITIALIZED_CHECK_TYPES and node.inputs:
            var = model.resolve_variable(node.inputs[0])
            if var is not None:
                checks.setdefault(var, set()).add(name)
    if not checks:
        return set()
    consumers = graph_walk.children(nodes, model.all_deps)
    handle_of = {}  # node -> the variable whose handle or ref it passes on
    reads = {}      # variable -> its reads
    for name in model.topological(model.data_deps):
        node = nodes[name]
        if not node.inputs or name in model.body:  # a call: its body reads
            continue
        source = node.inputs[0][0]
        var = source if source in checks else handle_of.get(source)
        if var is None:
            continue
        # An Identity of a ref is its read; of a resource handle, the handle.
        passes = _HANDLE_PASS_TYPES if nodes[var].type == "VarHandleOp" else _REF_PASS_TYPES
        if node.type in passes:
            handle_of[name] = var
        elif (node.type not in _INITIALIZED_CHECK_TYPES and not _graph.is_mutation(node.type)
              and consumers.get(name)):
            reads.setdefault(var, []).append(name)
    found = set()
    for var, names in reads.items():
        if all(any(l.kind == "cond" and l.value is True
                   and _conditions.pred_node(l) in checks[var]
                   for l in model.conditions(read)) for read in names):
            found.add(var)
    return found
