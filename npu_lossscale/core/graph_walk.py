"""Graph walks and the op vocabulary, shared by the library (which walks
``tf.Operation``s) and the audit (which walks ``GraphDef`` nodes by name).

* The op vocabulary: variable updates, identities, control flow, function
  calls, data inputs.
* ``depth_first`` (and ``reachable``, ``first_reached``), ``children`` and
  ``topological``: generic walks over any nodes, given their ``parents``.
* ``updates_behind``: which variable updates an op stands for, shared by
  the builder's ``update_ops`` check and the audit's NLS005.

For ``updates_behind``, an op given as an update (``tf.group``,
``tf.tuple``, ``check_numerics``, ``stop_gradient``, a ``tf.print`` under
``control_dependencies``, or the update itself) stands for the variable
updates the walk reaches from it, over data and control edges, through any
op that is not an update. The walk stops at the first update on each path:
an update's own inputs are the forward pass and the data pipeline, which
must run on every step, so it never goes past one. A data pipeline's
get-next op or a random op is stateful but writes no variable, so it is
walked through like any other op.

This module imports no TensorFlow and makes no op: the caller says how to
read its graph through functions, ``parents`` (and, for ``updates_behind``,
``classify``).
"""

from __future__ import absolute_import, division, print_function

import collections
import re

__all__ = ["ACCUMULATOR_TAKE_TYPES", "BARRIER", "CASE_TYPES", "CONTROL",
           "CONTROL_FLOW_TYPES", "DATA_INPUT_TYPES",
           "ENTER_TYPES", "EXIT_TYPES", "FEEDABLE_TYPES", "FUNCTIONAL_CONTROL_FLOW_TYPES",
           "FUNCTION_CALL_TYPES", "IDENTITY_TYPES", "IF_TYPES", "MERGE_TYPES",
           "NEXT_ITERATION_TYPES", "STOP", "SWITCH_TYPES", "THROUGH", "UPDATE", "WHILE_TYPES",
           "Reached", "Walk", "children", "depth_first", "first_reached", "is_optimizer_apply",
           "is_update", "kind_of_type", "reachable", "topological", "updates_behind",
           "walked_inputs"]

# Variable writes, from the ops' definitions: each takes the variable as its
# first input, a ref (Assign, ScatterAdd, ApplyAdam...) or a resource handle
# (AssignVariableOp, ResourceScatterAdd, ResourceApplyAdam...), and stores
# into it. Ops with such a first input that only read it (ReadVariableOp,
# ResourceGather, IsVariableInitialized), pass it on (RefIdentity, RefSwitch)
# or own other state (IteratorGetNext, StatefulUniform, queues, tables,
# TensorArrays) are not updates. tests/test_graph_walk.py checks the
# patterns against the op registry.
_VARIABLE_WRITE = re.compile(
    r"^(Assign(Add|Sub)?|Assign(Add|Sub)?VariableOp|AssignVariableXlaConcatND|"
    r"(Resource)?Scatter(Nd)?(Update|Add|Sub|Mul|Div|Min|Max)|"
    r"(Resource)?StridedSliceAssign|(Resource)?CountUpTo)$")
# The fused optimizer updates (ApplyAdam, ResourceSparseApplyMomentum...).
_OPTIMIZER_APPLY = re.compile(r"^(Resource)?(Sparse)?Apply[A-Z]\w*$")

#: Ops that pass their input on unchanged.
IDENTITY_TYPES = frozenset(["Identity", "RefIdentity", "Snapshot"])

# v1 control flow (tf.cond's and tf.while_loop's frames), op by op.
#: Passes its data input to one of two outputs, as its predicate (the
#: second input) says; the other output is dead.
SWITCH_TYPES = frozenset(["Switch", "RefSwitch"])
#: Passes on whichever input is live.
MERGE_TYPES = frozenset(["Merge", "RefMerge"])
#: Enters a loop's frame.
ENTER_TYPES = frozenset(["Enter", "RefEnter"])
#: Leaves a loop's frame.
EXIT_TYPES = frozenset(["Exit", "RefExit"])
#: Carries a value into a loop's next iteration (the back edge into a Merge).
NEXT_ITERATION_TYPES = frozenset(["NextIteration", "RefNextIteration"])
# v2 control flow: functional ops whose bodies are functions.
#: Runs one of two branch functions, as its first input says.
IF_TYPES = frozenset(["If", "StatelessIf"])
#: Runs one of its branch functions, as its first input (an index) says.
CASE_TYPES = frozenset(["Case", "StatelessCase"])
#: Runs its body function while its cond function says so.
WHILE_TYPES = frozenset(["While", "StatelessWhile"])
#: v2 control flow: functional ops whose bodies are functions.
FUNCTIONAL_CONTROL_FLOW_TYPES = IF_TYPES | CASE_TYPES | WHILE_TYPES
#: Control flow: v1's Switch/Merge frames and v2's functional ops. What lies
#: behind them runs only on some branch or iteration.
CONTROL_FLOW_TYPES = (FUNCTIONAL_CONTROL_FLOW_TYPES | SWITCH_TYPES | MERGE_TYPES
                      | ENTER_TYPES | EXIT_TYPES | NEXT_ITERATION_TYPES
                      | frozenset(["LoopCond"]))
# Inputs that pick a branch rather than pass a value on: a Switch's
# predicate (its second input), an If's or a Case's first input.
_BRANCH_INDEX_FIRST = IF_TYPES | CASE_TYPES
#: Calls of a function (a graph-mode ``tf.function``): one op that runs its
#: whole body.
FUNCTION_CALL_TYPES = frozenset(["PartitionedCall", "StatefulPartitionedCall"])

#: Ops that hand a data pipeline's next element to the step. With Ascend's
#: data offload (``enable_data_pre_proc``) tf_adapter places the iterator and
#: its get-next on the device, fused into ``AdpGetNext`` (tf_adapter
#: optimizers/om_partition_subgraphs_pass.cc; ``GetNext``, ``AdpGetNext``,
#: ``DynamicGetNextV2`` and ``GetNextFromQueue`` are registered in
#: ops/aicpu/npu_dataset_ops.cc), where it feeds the training loop from its
#: own queue: an edge from the register's clear into it would tie prefetching
#: to the step. They are graph inputs: their consumers take the edge instead.
DATA_INPUT_TYPES = frozenset([
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional", "GetNext",
    "AdpGetNext", "DynamicGetNextV2", "GetNextFromQueue"])
#: Ops with inputs that a run typically feeds instead of running (it then
#: passes its constant default on, or is cut out with its control inputs),
#: or that deliver input data: they compute nothing an overflow check sees.
#: The register's clear orders their consumers instead
#: (``backends.register_order``); the audit reads them the same way.
FEEDABLE_TYPES = frozenset(["PlaceholderWithDefault"]) | DATA_INPUT_TYPES
#: A ``ConditionalAccumulator``'s take (ref, resource and sparse): the mean of
#: the gradients workers pushed, as ``SyncReplicasOptimizer`` applies it on
#: its chief.
ACCUMULATOR_TAKE_TYPES = frozenset([
    "AccumulatorTakeGradient", "ResourceAccumulatorTakeGradient",
    "SparseAccumulatorTakeGradient"])

# What ``classify`` says of a node.
#: A variable update: recorded; the walk does not go past it.
UPDATE = "update"
#: Something the caller refuses to look past (another step's gate, a
#: functional op whose body writes a variable): recorded; not walked past.
BARRIER = "barrier"
#: Control flow: walked through; updates behind it are reached ``via`` it.
CONTROL = "control"
#: Any other op: walked through.
THROUGH = "through"
#: Not walked through, not recorded.
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
    """The kind the vocabulary alone gives an op type: ``UPDATE``, ``CONTROL``
    or ``THROUGH``. Callers refine it (barriers, stops) in ``classify``."""
    if is_update(op_type):
        return UPDATE
    if op_type in CONTROL_FLOW_TYPES:
        return CONTROL
    return THROUGH


def walked_inputs(op_type, inputs):
    """The data inputs the walk follows: all of them, except the predicate
    (or branch index) of a Switch, If or Case, which picks what runs rather
    than being what the op passes on.

    Args:
      op_type: the op's type.
      inputs: its data inputs, in order (any objects).

    Returns:
      A list.
    """
    inputs = list(inputs)
    if op_type in SWITCH_TYPES:
        return inputs[:1]
    if op_type in _BRANCH_INDEX_FIRST:
        return inputs[1:]
    return inputs


def updates_behind(roots, parents, classify, seen=None):
    """The updates (and barriers) ``roots`` stand for.

    Depth first from each root, in order; each node's parents in the order
    ``parents`` gives them. A root is classified like any node, so an update
    given as a root stands for itself.

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
    """Each node reachable from ``roots``, once, depth first.

    The library's one reachability walk: over ``parents`` it yields a
    node's ancestors, over consumers its descendants. A node is yielded
    when the walk first takes it off its stack; its ``parents`` are then
    pushed in the order given (so the last is walked first), unless
    ``stop`` holds for it. ``parents`` is called once the caller asks for
    the next node, so the caller may change the graph around the node just
    yielded.

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


def reachable(roots, parents, stop=None):
    """The set of nodes ``depth_first`` reaches: the roots' ancestors (their
    descendants when ``parents`` gives consumers), the roots included.

    Args:
      roots: iterable of nodes.
      parents: node -> iterable of the nodes to walk to from it.
      stop: optional node -> bool; a node for which it is True is included
        but not walked past.

    Returns:
      A set of nodes.
    """
    return set(depth_first(roots, parents, stop))


def first_reached(roots, parents, targets):
    """The first of ``targets`` a depth-first walk from ``roots`` meets.

    Whether a loss reaches its variables (only through edges gradients flow
    through, as ``parents`` gives them), whether an update op already runs
    with a loss.

    Args:
      roots: iterable of nodes (any hashable: ops, node names).
      parents: node -> iterable of the nodes it depends on.
      targets: the nodes looked for (a roots' own node counts).

    Returns:
      A node of ``targets``, or None when the walk meets none.
    """
    targets = set(targets)
    for node in depth_first(roots, parents):
        if node in targets:
            return node
    return None


def children(nodes, parents):
    """The edges of a graph turned around: who waits for each node.

    Args:
      nodes: iterable of every node of the graph, in order.
      parents: node -> iterable of the nodes it waits for.

    Returns:
      A dict from a node to the list of nodes it is a parent of, in the
      order of ``nodes``; a node without children has no entry. A parent
      that is not among ``nodes`` gets its entry too.
    """
    found = {}
    for node in nodes:
        for parent in parents(node):
            found.setdefault(parent, []).append(node)
    return found


def topological(nodes, parents):
    """``nodes`` ordered so that each comes after its parents.

    Depth first from each node in turn, in post order. A cycle (a v1 loop's
    back edge) is broken where the walk meets a node it is still inside.

    Args:
      nodes: iterable of every node of the graph, in order.
      parents: node -> iterable of the nodes it waits for; a parent not
        among ``nodes`` is ordered like the others.

    Returns:
      A list of nodes.
    """
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
