"""npu_lossscale.core.graph_walk: the op vocabulary checked against TF's op
registry, and the walk on small hand-made graphs (plain dicts, no TF), the
form the audit and the builder both feed it through ``parents``."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from npu_lossscale.core import graph_walk as W


def _registered_ops():
    """Every OpDef registered in this TF, by name."""
    pywrap = pytest.importorskip("tensorflow.python.client.pywrap_tf_session")
    from tensorflow.core.framework import op_def_pb2  # pylint: disable=import-outside-toplevel
    buffer = pywrap.TF_GetAllOpList()
    ops = op_def_pb2.OpList()
    ops.ParseFromString(pywrap.TF_GetBuffer(buffer))
    return dict((op.name, op) for op in ops.op)


def _first_input_is_state(op_def):
    """The first input is a ref or a resource handle (what an op writes)."""
    from tensorflow.core.framework import types_pb2  # pylint: disable=import-outside-toplevel
    if not op_def.input_arg:
        return False
    first = op_def.input_arg[0]
    return first.is_ref or first.type == types_pb2.DT_RESOURCE


# Ops with a ref/resource first input and a writer's name that own other
# state than a variable: TensorArrays, ConditionalAccumulators, tree ensembles.
_OTHER_STATE = re.compile(r"^(TensorArray|(Resource|Sparse)?Accumulator|BoostedTrees)")


def test_updates_are_the_registrys_variable_writers():
    """From the op definitions: every registered op that takes a variable
    (ref or resource) first and assigns, scatters, applies or counts into it
    is an update; every update type registered takes one first."""
    registry = _registered_ops()
    writers = sorted(name for name, op_def in registry.items()
                     if _first_input_is_state(op_def)
                     and re.search(r"Assign|Scatter|Apply|CountUpTo", name)
                     and not _OTHER_STATE.match(name))
    assert len(writers) > 80  # Assign*, Scatter*, (Resource)(Sparse)Apply*...
    assert [name for name in writers if not W.is_update(name)] == []
    updates = [name for name in registry if W.is_update(name)]
    assert sorted(updates) == writers


@pytest.mark.parametrize("op_type", [
    "ReadVariableOp", "ResourceGather", "IsVariableInitialized", "VarIsInitializedOp",
    "RefIdentity", "IteratorGetNext", "IteratorGetNextSync", "StatefulUniform",
    "RandomUniform", "RandomStandardNormal", "LookupTableInsertV2", "QueueEnqueueV2",
    "TensorScatterUpdate", "ScatterNdNonAliasingAdd", "VarHandleOp", "VariableV2",
    "PrintV2", "CheckNumerics", "StopGradient", "NoOp", "Identity"])
def test_readers_pipelines_random_ops_and_wrappers_are_not_updates(op_type):
    """Stateful, or reading a variable, or returning an updated copy, but no
    variable write: walked through, never gated."""
    assert not W.is_update(op_type)
    assert W.kind_of_type(op_type) == W.THROUGH


def test_feedable_types_are_registered_or_ascends():
    """The feedable/data-input vocabulary (read by the register's clear
    ordering and by the audit): TF's own names are registered ops; the rest
    are tf_adapter's get-next ops (ops/aicpu/npu_dataset_ops.cc)."""
    registry = _registered_ops()
    ascend = {"GetNext", "AdpGetNext", "DynamicGetNextV2", "GetNextFromQueue"}
    assert W.DATA_INPUT_TYPES <= W.FEEDABLE_TYPES
    assert sorted(W.FEEDABLE_TYPES - ascend) == sorted(
        name for name in W.FEEDABLE_TYPES if name in registry)
    assert W.FEEDABLE_TYPES - W.DATA_INPUT_TYPES == {"PlaceholderWithDefault"}


def test_control_flow_kinds_and_the_inputs_walked():
    for op_type in ("Switch", "RefSwitch", "Merge", "Enter", "Exit", "NextIteration", "If",
                    "While"):
        assert W.kind_of_type(op_type) == W.CONTROL
    assert W.walked_inputs("Switch", ["data", "pred"]) == ["data"]
    assert W.walked_inputs("If", ["pred", "a", "b"]) == ["a", "b"]
    assert W.walked_inputs("AddV2", ["a", "b"]) == ["a", "b"]


# A toy graph: node -> (type, parents). "assign" writes a counter whose
# value comes from the forward pass ("fwd"), which reads the data pipeline
# and holds another update ("inner") that the walk must not reach.
_GRAPH = {
    "print": ("PrintV2", ["fmt", "^check"]),
    "fmt": ("Const", []),
    "check": ("CheckNumerics", ["assign"]),
    "assign": ("AssignAdd", ["counter", "fwd"]),
    "counter": ("VariableV2", []),
    "fwd": ("Mul", ["next", "inner"]),
    "next": ("IteratorGetNext", ["iterator"]),
    "iterator": ("IteratorV2", []),
    "inner": ("AssignSub", ["counter", "next"]),
    "merge": ("Merge", ["branch", "other"]),
    "branch": ("NoOp", ["^assign", "^guarded"]),
    "other": ("Const", []),
    "guarded": ("Assign", ["counter", "fmt"]),
    "wrapper": ("Identity", ["fwd", "^assign"]),
}


def _parents(node):
    return [name.lstrip("^") for name in _GRAPH[node][1]]


def _classify(node):
    return W.kind_of_type(_GRAPH[node][0])


def test_the_walk_stops_at_the_first_update_on_each_path():
    walk = W.updates_behind(["print"], _parents, _classify)
    assert walk == W.Walk([W.Reached("assign", None)], [])
    # Through a forward-pass value: the pipeline is walked through, and the
    # update found under the control edge; the forward pass's own update is
    # reached, being the first on its path.
    walk = W.updates_behind(["wrapper"], _parents, _classify)
    assert [r.node for r in walk.updates] == ["inner", "assign"]


def test_updates_behind_control_flow_are_reached_via_it():
    walk = W.updates_behind(["merge"], _parents, _classify)
    assert walk.updates == [W.Reached("assign", "merge"), W.Reached("guarded", "merge")]
    # Reached directly and through control flow: the control flow is kept.
    walk = W.updates_behind(["print", "merge"], _parents, _classify)
    assert walk.updates[0] == W.Reached("assign", "merge")


def test_barriers_and_stops_end_the_walk():
    def classify(node):
        if node == "check":
            return W.BARRIER
        if node == "next":
            return W.STOP
        return _classify(node)
    assert W.updates_behind(["print"], _parents, classify) == W.Walk(
        [], [W.Reached("check", None)])
    seen = set()
    assert W.updates_behind(["wrapper"], _parents, classify, seen).updates == [
        W.Reached("inner", None), W.Reached("assign", None)]
    # A shared ``seen``: what one walk reached is not reported again.
    assert W.updates_behind(["check"], _parents, _classify, seen).updates == []


def test_graph_walk_imports_no_tensorflow():
    code = textwrap.dedent("""
        import sys, types
        package = types.ModuleType("npu_lossscale")
        package.__path__ = [%r]
        sys.modules["npu_lossscale"] = package
        import npu_lossscale.core.graph_walk as walk
        assert not [m for m in sys.modules if m.split(".")[0] == "tensorflow"], "TF imported"
        print(walk.is_update("AssignVariableOp"))
    """ % os.path.join(REPO, "npu_lossscale"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


# The generic walks on a diamond: a waits for b and c, both wait for d.
_DIAMOND = {"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []}


def test_depth_first_yields_each_node_once_last_parent_first():
    # a; then c (pushed last); d under c; then b, whose d is already seen.
    assert list(W.depth_first(["a"], _DIAMOND.get)) == ["a", "c", "d", "b"]
    # A stop node is yielded, not walked past: d is reached through b only.
    assert list(W.depth_first(["a"], _DIAMOND.get, stop=lambda n: n == "c")) == [
        "a", "c", "b", "d"]
    # A cycle ends: each node once.
    assert list(W.depth_first(["x"], {"x": ["y"], "y": ["x"]}.get)) == ["x", "y"]


def test_depth_first_reads_parents_after_the_node_is_handled():
    """The register's clear ordering adds a control input to a node the walk
    just yielded: the walk reads the node's parents after that."""
    graph = {"a": ["b"], "b": [], "late": []}
    walked = []
    for node in W.depth_first(["a"], lambda n: list(graph[n])):
        walked.append(node)
        if node == "b":
            graph["b"].append("late")
    assert walked == ["a", "b", "late"]


def test_reachable_gives_ancestors_or_descendants():
    assert W.reachable(["b"], _DIAMOND.get) == {"b", "d"}
    assert W.reachable(["a"], _DIAMOND.get, stop=lambda n: n in ("b", "c")) == {"a", "b", "c"}
    consumers = W.children(_DIAMOND, _DIAMOND.get)
    assert W.reachable(["d"], lambda n: consumers.get(n, ())) == {"a", "b", "c", "d"}
    assert W.reachable(["c"], lambda n: consumers.get(n, ())) == {"a", "c"}


def test_first_reached_is_the_first_target_the_walk_meets():
    assert W.first_reached(["a"], _DIAMOND.get, ["b", "d"]) == "d"  # a, c, d
    assert W.first_reached(["a"], _DIAMOND.get, ["a"]) == "a"
    assert W.first_reached(["b"], _DIAMOND.get, ["c"]) is None


def test_children_turns_the_edges_around_in_node_order():
    consumers = W.children(["a", "b", "c", "d"], lambda n: _DIAMOND[n] + ["outside"])
    assert consumers == {"b": ["a"], "c": ["a"], "d": ["b", "c"],
                         "outside": ["a", "b", "c", "d"]}


def test_topological_puts_parents_first_and_breaks_cycles():
    assert W.topological(["a", "b", "c", "d"], _DIAMOND.get) == ["d", "b", "c", "a"]
    # A v1 loop: merge waits for enter and for next_iteration, which waits
    # for merge (the back edge). Each node once; merge after enter.
    loop = {"merge": ["enter", "next_iteration"], "enter": [],
            "next_iteration": ["merge"]}
    assert W.topological(["merge", "enter", "next_iteration"], loop.get) == [
        "enter", "next_iteration", "merge"]


def test_control_flow_vocabulary_is_registered_and_composed():
    """Each op type of the control-flow and identity vocabulary (shared by
    the core and the audit) is a registered op; CONTROL_FLOW_TYPES is their
    union (with LoopCond)."""
    registry = _registered_ops()
    parts = [W.SWITCH_TYPES, W.MERGE_TYPES, W.ENTER_TYPES, W.EXIT_TYPES,
             W.NEXT_ITERATION_TYPES, W.IF_TYPES, W.CASE_TYPES, W.WHILE_TYPES]
    for part in parts + [W.IDENTITY_TYPES, W.FUNCTION_CALL_TYPES]:
        assert part and all(name in registry for name in part), part
    assert W.CONTROL_FLOW_TYPES == frozenset().union(*parts) | {"LoopCond"}
    assert W.FUNCTIONAL_CONTROL_FLOW_TYPES == W.IF_TYPES | W.CASE_TYPES | W.WHILE_TYPES
    assert len(W.CONTROL_FLOW_TYPES) == 17
