"""A read-only model of a TF1 graph definition, for the audit.

The audit never imports a graph into a ``tf.Graph``: op types such as
``NpuGetFloatStatusV2`` or ``HcomAllReduce`` are unknown where npu_bridge is
not installed, and importing would fail. It reads the ``GraphDef`` (and the
``MetaGraphDef``'s collections) instead, through this module:

* ``load`` turns a ``tf.Graph``, ``GraphDef`` or ``MetaGraphDef`` into a
  ``GraphModel``;
* the function bodies of ``If``/``StatelessIf``/``Case``/``While`` and call
  ops are inlined, once per call site, under the name
  ``<call node>/<function>/<node>``; a body node's function arguments are
  wired to the call node's inputs, and the call node depends on its body;
* every node gets its *conditions*: the branch literals
  ``(predicate, value, kind)`` that must hold for it to run, from the dead-
  tensor rule of Switch/Merge control flow (a node runs only if all of its
  inputs, data and control, are live; a Merge runs if any input is) and from
  the branch function that holds it.
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals
from npu_lossscale.core import graph_walk
from npu_lossscale.audit import _collections

__all__ = ["GraphModel", "Literal", "Node", "is_mutation", "is_optimizer_apply", "load"]

#: Attribute the CPU shim of npu_bridge puts on the stock op that emulates a
#: real adapter op type (``shims/npu_bridge``): the type audited is that one.
SHIM_OP_TYPE_ATTR = "_npu_shim_op_type"
#: Name-scope component of the shim's per-op overflow instrumentation, which
#: emulates the device's register writes; not a check of the user's graph.
SHIM_INTERNAL_SCOPE = "npu_shim_overflow_check"

VARIABLE_TYPES = frozenset(["VariableV2", "Variable", "VarHandleOp"])
#: Ops a variable's ref or handle passes through on its way to a write.
_PASS_THROUGH_TYPES = graph_walk.IDENTITY_TYPES.union(
    graph_walk.SWITCH_TYPES, graph_walk.ENTER_TYPES, ["ReadVariableOp"])
_MAX_INLINE_DEPTH = 32

#: A literal: the predicate tensor ("node:port"), the branch value, and its
#: kind ("cond" for conds and gates, "loop" for loops).
Literal = collections.namedtuple("Literal", ["pred", "value", "kind"])

Node = collections.namedtuple(
    "Node", ["name", "type", "inputs", "controls", "attr", "call", "branch"])
Node.__doc__ = """One node of the (inlined) graph.

Attributes:
  name: the node name; body nodes are ``<call node>/<function>/<node>``.
  type: the op type audited (the real adapter type for shim-emulated ops).
  inputs: tuple of (source node name, output port) data inputs.
  controls: tuple of source node names of the control inputs.
  attr: the NodeDef's attr map.
  call: for a body node, the name of the call node that runs its function.
  branch: for a body node, the ``Literal`` its function's branch adds.
"""


#: True for op types that write a variable through their first input (the
#: vocabulary the builder's update_ops check uses too).
is_mutation = graph_walk.is_update
#: True for the fused optimizer update ops (ApplyAdam, ResourceApplyAdam...).
is_optimizer_apply = graph_walk.is_optimizer_apply


def _attr_type(node_def):
    attr = node_def.attr.get(SHIM_OP_TYPE_ATTR)
    if attr is not None and attr.s:
        return attr.s.decode("utf-8")
    return node_def.op


class GraphModel(object):
    """The inlined graph: nodes, consumers, conditions and collections.

    Args:
      graph_def: a ``GraphDef``.
      collections: a ``Collections``.
    """

    def __init__(self, graph_def, collections_):
        self.collections = collections_
        self.nodes = collections.OrderedDict()
        self._raw_types = {}  # node -> the NodeDef's own op (the shim's stock op)
        self.body = {}      # call node -> every body node, recursively
        self.rets = {}      # call node -> body nodes its outputs come from
        self._functions = dict((f.signature.name, f) for f in graph_def.library.function)
        for node_def in graph_def.node:
            self._add(node_def, node_def.name, self._outer_inputs(node_def), None, None)
        for node_def in graph_def.node:
            self._inline_calls(node_def.name, 0)
        self._conditions = None
        self._positions = None
        self._orders = {}  # data_deps / all_deps -> their topological order

    # -- construction ---------------------------------------------------------

    @staticmethod
    def _outer_inputs(node_def):
        inputs, controls = [], []
        for text in node_def.input:
            if text.startswith("^"):
                controls.append(text[1:])
            else:
                parts = text.split(":")
                inputs.append((parts[0], int(parts[1]) if len(parts) > 1 else 0))
        return inputs, controls

    def _add(self, node_def, name, inputs_controls, call, branch):
        inputs, controls = inputs_controls
        self._raw_types[name] = node_def.op
        self.nodes[name] = Node(name, _attr_type(node_def), tuple(inputs), tuple(controls),
                                node_def.attr, call, branch)

    def _called_functions(self, node):
        """[(function name, argument offset, branch literal or None)] of a call node."""
        attr, calls = node.attr, []
        raw_type = node.type
        if raw_type in graph_walk.IF_TYPES and node.inputs:
            pred = self.canonical(node.inputs[0])
            for key, value in (("then_branch", True), ("else_branch", False)):
                if key in attr:
                    calls.append((attr[key].func.name, 1, Literal(pred, value, "cond")))
        elif raw_type in graph_walk.CASE_TYPES and node.inputs and "branches" in attr:
            pred = self.canonical(node.inputs[0])
            for index, func in enumerate(attr["branches"].list.func):
                calls.append((func.name, 1, Literal(pred, index, "cond")))
        elif raw_type in graph_walk.WHILE_TYPES:
            if "cond" in attr:
                calls.append((attr["cond"].func.name, 0, None))
            if "body" in attr:
                calls.append((attr["body"].func.name, 0,
                              Literal(node.name + ":loop", True, "loop")))
        elif raw_type in graph_walk.FUNCTION_CALL_TYPES and "f" in attr:
            calls.append((attr["f"].func.name, 0, None))
        elif raw_type in self._functions:
            calls.append((raw_type, 0, None))
        return [c for c in calls if c[0] in self._functions]

    def _inline_calls(self, name, depth):
        node = self.nodes[name]
        calls = self._called_functions(node)
        if not calls or depth > _MAX_INLINE_DEPTH:
            return
        body, rets = [], []
        for function_name, offset, branch in calls:
            prefix = "%s/%s/" % (name, function_name)
            added, returned = self._inline_function(
                self._functions[function_name], prefix, node.inputs[offset:], name, branch)
            body.extend(added)
            rets.extend(returned)
            for inner in added:
                self._inline_calls(inner, depth + 1)
                body.extend(self.body.get(inner, ()))
        self.body[name] = body
        self.rets[name] = rets

    def _inline_function(self, function, prefix, call_inputs, call, branch):
        args = {}
        for index, arg in enumerate(function.signature.input_arg):
            if index < len(call_inputs):
                args[arg.name] = call_inputs[index]
        local = set(n.name for n in function.node_def)

        def resolve(text):
            parts = text.split(":")
            if parts[0] in local:
                port = int(parts[-1]) if len(parts) > 1 else 0
                if len(parts) == 3 and parts[1] in ("output_true", "output_false"):
                    port = 1 if parts[1] == "output_true" else 0
                return (prefix + parts[0], port)
            return args.get(parts[0])

        added = []
        for node_def in function.node_def:
            inputs, controls = [], []
            for text in node_def.input:
                if text.startswith("^"):
                    if text[1:] in local:
                        controls.append(prefix + text[1:])
                    continue
                source = resolve(text)
                if source is not None:
                    inputs.append(source)
            self._add(node_def, prefix + node_def.name, (inputs, controls), call, branch)
            added.append(prefix + node_def.name)
        returned = []
        for value in list(function.ret.values()):
            source = resolve(value)
            if source is not None:
                returned.append(source[0])
        for value in function.control_ret.values():
            if value in local:
                returned.append(prefix + value)
        return added, returned

    # -- basic queries --------------------------------------------------------

    def canonical(self, tensor):
        """The tensor ("node:port") behind a chain of Identity-like ops."""
        name, port = tensor
        for _ in range(64):
            node = self.nodes.get(name)
            if node is None or node.type not in graph_walk.IDENTITY_TYPES or not node.inputs:
                break
            name, port = node.inputs[0]
        return "%s:%d" % (name, port)

    def resolve_variable(self, tensor):
        """The variable node a ref/handle tensor comes from, or None."""
        name = tensor[0]
        for _ in range(64):
            node = self.nodes.get(name)
            if node is None:
                return None
            if node.type in VARIABLE_TYPES:
                return name
            if node.type not in _PASS_THROUGH_TYPES or not node.inputs:
                return None
            name = node.inputs[0][0]
        return None

    def outermost(self, name):
        """The graph node that runs a node: the outermost If/While/call node
        whose body holds it, else the node itself."""
        while self.nodes[name].call is not None:
            name = self.nodes[name].call
        return name

    def data_deps(self, name):
        """Names a node's values come from: data inputs and, for a call
        node, the body nodes that produce its outputs."""
        node = self.nodes[name]
        deps = [source for source, _ in node.inputs]
        deps.extend(self.rets.get(name, ()))
        return deps

    def all_deps(self, name):
        """Names a node waits for: data and control inputs and, for a call
        node, its whole body."""
        node = self.nodes[name]
        deps = [source for source, _ in node.inputs]
        deps.extend(node.controls)
        deps.extend(self.body.get(name, ()))
        return deps

    def walk_parents(self, name):
        """What a node waits for, as ``graph_walk.updates_behind`` reads it:
        the data inputs ``graph_walk.walked_inputs`` keeps, the control
        inputs and, for a call node, its whole body."""
        node = self.nodes[name]
        deps = [source for source, _ in graph_walk.walked_inputs(node.type, node.inputs)]
        deps.extend(node.controls)
        deps.extend(self.body.get(name, ()))
        return [dep for dep in deps if dep in self.nodes]

    def ancestors(self, names, data_only=False, stop=None):
        """Every node some of ``names`` depends on, ``names`` included
        (``graph_walk.reachable``).

        Args:
          names: iterable of node names.
          data_only: follow data edges only (values), not control edges.
          stop: optional predicate; a node for which it is True is included
            but not walked through.

        Returns:
          A set of node names.
        """
        deps = self.data_deps if data_only else self.all_deps
        return graph_walk.reachable(
            [n for n in names if n in self.nodes],
            lambda name: [d for d in deps(name) if d in self.nodes], stop)

    def topological(self, deps):
        """Node names ordered so that each follows its ``deps`` (cycles,
        i.e. v1 loop back edges, are broken arbitrarily;
        ``graph_walk.topological``). The orders of ``data_deps`` and
        ``all_deps``, which the checks ask for many times, are kept."""
        own = deps == self.data_deps or deps == self.all_deps
        if own and deps in self._orders:
            return self._orders[deps]
        order = tuple(graph_walk.topological(
            self.nodes, lambda name: [d for d in deps(name) if d in self.nodes]))
        if own:
            self._orders[deps] = order
        return order

    # -- conditions -----------------------------------------------------------

    def conditions(self, name):
        """The frozenset of ``Literal``s that hold whenever ``name`` runs."""
        if self._conditions is None:
            self._conditions = self._compute_conditions()
        return self._conditions.get(name, frozenset())

    def _condition_deps(self, name):
        node = self.nodes[name]
        deps = [s for s, _ in node.inputs
                if not (node.type in graph_walk.MERGE_TYPES and s in self.nodes
                        and self.nodes[s].type in graph_walk.NEXT_ITERATION_TYPES)]
        deps.extend(node.controls)
        if node.call is not None:
            deps.append(node.call)
        return deps

    def _compute_conditions(self):
        result = {}
        empty = frozenset()

        def of_output(source, port):
            base = result.get(source, empty)
            node = self.nodes.get(source)
            if (node is not None and node.type in graph_walk.SWITCH_TYPES
                    and len(node.inputs) > 1):
                pred = self.canonical(node.inputs[1])
                kind = "loop" if self._is_loop_cond(pred) else "cond"
                return base | frozenset([Literal(pred, port == 1, kind)])
            return base

        for name in self.topological(self._condition_deps):
            node = self.nodes[name]
            base = set()
            if node.call is not None:
                base |= result.get(node.call, empty)
                if node.branch is not None:
                    base.add(node.branch)
            for control in node.controls:
                base |= result.get(control, empty)
            data = [(s, p) for s, p in node.inputs if s in self.nodes]
            if node.type in graph_walk.MERGE_TYPES:
                live = [of_output(s, p) for s, p in data
                        if self.nodes[s].type not in graph_walk.NEXT_ITERATION_TYPES]
                if live:
                    common = set(live[0])
                    for other in live[1:]:
                        common &= other
                    base |= common
            else:
                for source, port in data:
                    base |= of_output(source, port)
                if node.type in graph_walk.EXIT_TYPES and data:
                    switch = self.nodes[data[0][0]]
                    if switch.type in graph_walk.SWITCH_TYPES and len(switch.inputs) > 1:
                        pred = self.canonical(switch.inputs[1])
                        base = set(l for l in base if l.pred != pred)
            result[name] = frozenset(base)
        return result

    def _is_loop_cond(self, pred):
        node = self.nodes.get(pred.split(":")[0])
        return node is not None and node.type == "LoopCond"

    @staticmethod
    def exclusive(first, second):
        """True when two condition sets can never hold in the same run."""
        values = {}
        for literal in first:
            values.setdefault(literal.pred, set()).add(literal.value)
        for literal in second:
            if literal.pred in values and literal.value not in values[literal.pred]:
                return True
        return False

    # -- attributes -----------------------------------------------------------

    def position(self, name):
        """The node's index in the graph definition. Graph nodes come in the
        order they were created (``Graph.as_graph_def`` and
        ``export_meta_graph`` keep it), so a smaller index was made first;
        function body nodes come after every graph node."""
        if self._positions is None:
            self._positions = dict((n, i) for i, n in enumerate(self.nodes))
        return self._positions[name]

    def output_count(self, name):
        """How many outputs a node has, or None when the graph does not say.

        Read from the ``_output_shapes`` attr that ``export_meta_graph`` and
        ``Graph.as_graph_def(add_shapes=True)`` write (it is there for op
        types unknown here, such as ``NpuGetFloatStatusV2``), else from the
        signature of the function the node calls or of its registered op
        (``num_split``-like number attrs and type-list attrs counted).

        Args:
          name: a node name.

        Returns:
          An int, or None when neither source knows the node's outputs.
        """
        node = self.nodes[name]
        shapes = node.attr.get("_output_shapes")
        if shapes is not None and shapes.WhichOneof("value") == "list":
            return len(shapes.list.shape)
        raw_type = self._raw_types.get(name, node.type)
        function = self._functions.get(raw_type)
        if function is not None:
            return len(function.signature.output_arg)
        op_def = _registered_op(raw_type)
        if op_def is None:
            return None
        count = 0
        for arg in op_def.output_arg:
            if arg.number_attr or arg.type_list_attr:
                value = _attr_or_default(node.attr, op_def,
                                         arg.number_attr or arg.type_list_attr)
                if value is None:
                    return None
                count += value.i if arg.number_attr else len(value.list.type)
            else:
                count += 1
        return count

    def dtype_enum(self, name):
        """The ``dtype`` attr of a node (a variable's type), or None."""
        attr = self.nodes[name].attr.get("dtype")
        return None if attr is None else attr.type

    def touches(self, name, dtype_enum):
        """True when any type attr of the node is ``dtype_enum``."""
        for value in self.nodes[name].attr.values():
            which = value.WhichOneof("value")
            if which == "type" and value.type == dtype_enum:
                return True
            if which == "list" and dtype_enum in list(value.list.type):
                return True
        return False

    def is_small_variable(self, name, max_elements=8):
        """True unless the variable's ``shape`` attr says it holds more than
        ``max_elements`` values (a scalar scale, or a manager's small state
        vector such as npu_lossscale's [scale, good, bad, streak])."""
        attr = self.nodes[name].attr.get("shape")
        if attr is None or attr.shape.unknown_rank:
            return True
        count = 1
        for dim in attr.shape.dim:
            if dim.size < 0:
                return False
            count *= dim.size
        return count <= max_elements


def _registered_op(op_type):
    """The ``OpDef`` registered for an op type here, or None."""
    return _tf_internals.registered_op_def(op_type)


def _attr_or_default(attr, op_def, key):
    """A node's attr ``key``, or the op's default for it, or None."""
    if key in attr:
        return attr[key]
    for attr_def in op_def.attr:
        if attr_def.name == key and attr_def.HasField("default_value"):
            return attr_def.default_value
    return None


# -- loading --------------------------------------------------------------------

def load(graph):
    """Builds a ``GraphModel`` from a graph in any of the accepted forms.

    Args:
      graph: a ``tf.Graph``, ``GraphDef`` or ``MetaGraphDef``; None means the
        default graph.

    Returns:
      A ``GraphModel``.

    Raises:
      TypeError: for any other type.
    """
    if graph is None:
        graph = tf.get_default_graph()
    if isinstance(graph, tf.Graph):
        return GraphModel(graph.as_graph_def(), _collections.of_graph(graph))
    if isinstance(graph, tf.MetaGraphDef):
        return GraphModel(graph.graph_def, _collections.of_meta_graph(graph))
    if isinstance(graph, tf.GraphDef):
        return GraphModel(graph, _collections.Collections())
    raise TypeError(
        "graph must be a tf.Graph, GraphDef or MetaGraphDef, got %r (%s). Pass "
        "sess.graph, graph.as_graph_def(), or tf.train.export_meta_graph()."
        % (graph, type(graph).__name__))
