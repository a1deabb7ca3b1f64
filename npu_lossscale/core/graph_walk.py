"""Graph walks and the op vocabulary, shared by the library (which walks
``tf.Operation``s) and the audit (which walks ``GraphDef`` nodes by name).

No TensorFlow and no op: the caller says how to read its graph through
``parents`` (and, for ``updates_behind``, ``classify``).
"""

from __future__ import absolute_import, division, print_function

import collections
import re

__all__ = ["ACCUMULATOR_TAKE_TYPES", "BARRIER", "CASE_TYPES", "CONTROL",
           "CONTROL_FLOW_TYPES", "DATA_INPUT_TYPES",
           "ENTER_TYPES", "EXIT_TYPES", "FEEDABLE_TYPES", "FUNCTIONAL_CONTROL_FLOW_TYPES",
           "FUNCTION_CALL_TYPES", "IDENTITY_TYPES", "IF_TYPES", "MERGE_TYPES",
           "NEXT_ITERATION_TYPES", "STOP", "SWITCH_TYPES", "THROUGH", "UPDATE", "WHILE_TYPES",
           "Reached", "Walk", "called_functions", "children", "depth_first", "first_reached",
           "function_bodies", "is_optimizer_apply",
           "is_update", "kind_of_type", "reachable", "topological", "updates_behind",
           "walked_inputs"]

# Ops that store into the variable (ref or resource) that is their first
# input; not those that only read it, pass it on or own other state
# (iterators, queues). tests/test_graph_walk.py checks them against the op
# registry.
_VARIABLE_WRITE = re.compile(
    r"^(Assign(Add|Sub)?|Assign(Add|Sub)?VariableOp|AssignVariableXlaConcatND|"
    r"(Resource)?Scatter(Nd)?(Update|Add|Sub|Mul|Div|Min|Max)|"
    r"(Resource)?StridedSliceAssign|(Resource)?CountUpTo)$")
_OPTIMIZER_APPLY = re.compile(r"^(Resource)?(Sparse)?Apply[A-Z]\w*$")

IDENTITY_TYPES = frozenset(["Identity", "RefIdentity", "Snapshot"])

# v1 control flow, op by op.
SWITCH_TYPES = frozenset(["Switch", "RefSwitch"])
MERGE_TYPES = frozenset(["Merge", "RefMerge"])
ENTER_TYPES = frozenset(["Enter", "RefEnter"])
EXIT_TYPES = frozenset(["Exit", "RefExit"])
NEXT_ITERATION_TYPES = frozenset(["NextIteration", "RefNextIteration"])
# v2 control flow: functional ops whose bodies are functions.
IF_TYPES = frozenset(["If", "StatelessIf"])
CASE_TYPES = frozenset(["Case", "StatelessCase"])
WHILE_TYPES = frozenset(["While", "StatelessWhile"])
FUNCTIONAL_CONTROL_FLOW_TYPES = IF_TYPES | CASE_TYPES | WHILE_TYPES
#: Control flow: what lies behind these ops runs on some branch or iteration.
CONTROL_FLOW_TYPES = (FUNCTIONAL_CONTROL_FLOW_TYPES | SWITCH_TYPES | MERGE_TYPES
                      | ENTER_TYPES | EXIT_TYPES | NEXT_ITERATION_TYPES
                      | frozenset(["LoopCond"]))
# Their first input picks a branch rather than passing a value on.
_BRANCH_INDEX_FIRST = IF_TYPES | CASE_TYPES
#: Calls of a graph-mode ``tf.function``: one op that runs its whole body.
FUNCTION_CALL_TYPES = frozenset(["PartitionedCall", "StatefulPartitionedCall"])

#: Ops that hand a data pipeline's next element to the step, tf_adapter's
#: device-side ones for data offload included (docs/design.md, "The
#: float-status register").
DATA_INPUT_TYPES = frozenset([
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional", "GetNext",
    "AdpGetNext", "DynamicGetNextV2", "GetNextFromQueue"])
#: Ops with inputs that still count as graph inputs (a run feeds them, or
#: they deliver data): the register's clear orders their consumers instead.
FEEDABLE_TYPES = frozenset(["PlaceholderWithDefault"]) | DATA_INPUT_TYPES
#: A ``ConditionalAccumulator``'s take: the workers' mean gradient, as a
#: ``SyncReplicasOptimizer`` chief applies it.
ACCUMULATOR_TAKE_TYPES = frozenset([
    "AccumulatorTakeGradient", "ResourceAccumulatorTakeGradient",
    "SparseAccumulatorTakeGradient"])

# What ``classify`` says of a node: an update, or a barrier the caller will
# not look past (recorded, not walked past); control flow (walked through,
# updates behind it are reached ``via`` it); any other op (walked through);
# or a stop (neither walked through nor recorded).
UPDATE = "update"
BARRIER = "barrier"
CONTROL = "control"
THROUGH = "through"
STOP = "stop"


class Reached(collections.namedtuple("Reached", ["node", "via"])):
    """A node the walk stopped at.

    Attributes:
      node: the update or barrier.
      via: the first control-flow node on a path to it that crosses control
        flow, or None when no path does.
    """


class Walk(collections.namedtuple("Walk", ["updates", "barriers"])):
    """What a walk found, each list in walk order, each node once.

    Attributes:
      updates: ``Reached`` updates.
      barriers: ``Reached`` barriers.
    """


def is_update(op_type):
    """True for op types that write a variable (through their first input)."""
    return bool(_VARIABLE_WRITE.match(op_type) or _OPTIMIZER_APPLY.match(op_type))


def is_optimizer_apply(op_type):
    """True for the fused optimizer updates (ApplyAdam, ResourceApplyAdam...)."""
    return bool(_OPTIMIZER_APPLY.match(op_type))


def kind_of_type(op_type):
    """``UPDATE``, ``CONTROL`` or ``THROUGH``, from the op type alone."""
    if is_update(op_type):
        return UPDATE
    if op_type in CONTROL_FLOW_TYPES:
        return CONTROL
    return THROUGH


def walked_inputs(op_type, inputs):
    """The data inputs (a list) the walk follows: all but the predicate or
    branch index of a Switch, If or Case."""
    inputs = list(inputs)
    if op_type in SWITCH_TYPES:
        return inputs[:1]
    if op_type in _BRANCH_INDEX_FIRST:
        return inputs[1:]
    return inputs


def updates_behind(roots, parents, classify, seen=None):
    """The updates (and barriers) ``roots`` stand for.

    An op given as an update (``tf.group``, ``check_numerics``, a
    ``tf.print`` under ``control_dependencies``, or the update itself)
    stands for the updates the walk reaches from it, over data and control
    edges, up to the first update on each path: an update's own inputs are
    the forward pass, which runs on every step. Depth first, in order.

    Args:
      roots: iterable of nodes (any hashable: ops, node names).
      parents: node -> iterable of the nodes it waits for (data inputs,
        then control inputs), the data inputs filtered by ``walked_inputs``.
      classify: node -> ``UPDATE``, ``BARRIER``, ``CONTROL``, ``THROUGH`` or
        ``STOP``.
      seen: optional set of ``(node, behind control flow)`` pairs already
        walked, shared by several calls; updated in place.

    Returns:
      A ``Walk``.
    """
    seen = set() if seen is None else seen
    found = {UPDATE: collections.OrderedDict(), BARRIER: collections.OrderedDict()}
    stack = [(root, None) for root in reversed(list(roots))]
    while stack:
        node, via = stack.pop()
        key = (node, via is not None)
        if key in seen:
            continue
        seen.add(key)
        kind = classify(node)
        if kind in found:
            if found[kind].get(node) is None:
                found[kind][node] = via
            continue
        if kind == STOP:
            continue
        if kind == CONTROL and via is None:
            via = node
        stack.extend((parent, via) for parent in reversed(list(parents(node))))
    return Walk(*[[Reached(node, via) for node, via in found[kind].items()]
                  for kind in (UPDATE, BARRIER)])


def depth_first(roots, parents, stop=None):
    """Each node reachable from ``roots``, once, depth first (the last parent
    first). ``parents`` is called when the next node is asked for, so the
    caller may change the graph around the node just yielded.

    Args:
      roots: iterable of nodes (any hashable: ops, node or function names).
      parents: node -> iterable of the nodes to walk to from it.
      stop: optional node -> bool; a node for which it is True is yielded
        but not walked past.

    Yields:
      Nodes: the roots and what they reach.
    """
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        if stop is None or not stop(node):
            stack.extend(parents(node))


def called_functions(node_def):
    """The names of the functions a NodeDef's attrs name (branches, bodies,
    ``f``)."""
    names = []
    for value in node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        elif value.HasField("list"):
            names.extend(func.name for func in value.list.func)
    return names


def function_bodies(node_def, definition):
    """The functions a functional op or call runs, and those they call.

    Args:
      node_def: the op's NodeDef.
      definition: function name -> its FunctionDef, or None when the graph
        does not hold it.

    Yields:
      (name, FunctionDef or None) pairs, once per function.
    """
    def called(name):
        body = definition(name)
        if body is None:
            return []
        names = []
        for node in body.node_def:
            names.extend(called_functions(node))
            if definition(node.op) is not None:  # a function called by its name
                names.append(node.op)
        return names

    for name in depth_first(called_functions(node_def), called):
        yield name, definition(name)


def reachable(roots, parents, stop=None):
    """The set of nodes ``depth_first`` reaches, the roots included."""
    return set(depth_first(roots, parents, stop))


def first_reached(roots, parents, targets):
    """The first of ``targets`` a depth-first walk from ``roots`` meets (a
    root included), or None."""
    targets = set(targets)
    for node in depth_first(roots, parents):
        if node in targets:
            return node
    return None


def children(nodes, parents):
    """The edges turned around: a dict from a node to the nodes that wait for
    it, in the order of ``nodes`` (no entry for a node without children)."""
    found = {}
    for node in nodes:
        for parent in parents(node):
            found.setdefault(parent, []).append(node)
    return found


def topological(nodes, parents):
    """``nodes`` (and their parents) listed so that each comes after its
    parents; a cycle (a v1 loop's back edge) is broken where met."""
    order, state = [], {}  # state: 1 while walking a node's parents, 2 when done
    for root in nodes:
        if root in state:
            continue
        stack = [(root, iter(parents(root)))]
        state[root] = 1
        while stack:
            node, pending = stack[-1]
            advanced = False
            for parent in pending:
                if parent not in state:
                    state[parent] = 1
                    stack.append((parent, iter(parents(parent))))
                    advanced = True
                    break
            if not advanced:
                stack.pop()
                state[node] = 2
                order.append(node)
    return order


#: Op types that exchange tensors across workers (Horovod, HCCL, NCCL, TF's
#: collectives).
COLLECTIVE_TYPES = frozenset([
    "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather",
    "HorovodGroupedAllgather", "HorovodBroadcast", "HorovodAlltoall",
    "HorovodReducescatter", "HorovodGroupedReducescatter", "HorovodJoin",
    "HorovodBarrier",
    "HcomAllReduce", "HcomAllGather", "HcomBroadcast", "HcomReduceScatter",
    "HcomReduce", "HcomSend", "HcomReceive", "HcomAllToAllV", "HcomAllToAllVC",
    "HcomGatherAllToAllV",
    "NcclAllReduce", "NcclReduce", "NcclBroadcast",
    "CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3",
    "CollectiveGather", "CollectiveGatherV2", "CollectiveBcastSend",
    "CollectiveBcastRecv", "CollectiveBcastSendV2", "CollectiveBcastRecvV2",
    "CollectiveAllToAllV2", "CollectiveAllToAllV3", "CollectiveReduceScatterV2",
])
