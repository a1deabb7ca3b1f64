"""A read-only model of a TF1 graph definition, for the audit.

The audit never imports a graph into a ``tf.Graph``: op types such as
``NpuGetFloatStatusV2`` or ``HcomAllReduce`` are unknown where npu_bridge is
not installed, and importing would fail. It reads the ``GraphDef`` (and the
``MetaGraphDef``'s collections) instead, through this module:

* ``load`` turns a ``tf.Graph``, ``GraphDef`` or ``MetaGraphDef`` into a
  ``GraphModel``;
* the function bodies of ``If``/``StatelessIf``/``Case``/``While`` and call
  ops are inlined, once per call site (``_inline``);
* every node gets its *conditions*: the branch literals
  ``(predicate, value, kind)`` that must hold for it to run
  (``_conditions``).
"""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals
from npu_lossscale.core import graph_walk
from npu_lossscale.audit import _collections
from npu_lossscale.audit import _conditions
from npu_lossscale.audit import _inline
from npu_lossscale.audit._conditions import Literal
from npu_lossscale.audit._inline import Node

__all__ = ["GraphModel", "Literal", "Node", "is_mutation", "is_optimizer_apply",
           "is_shim_internal", "load"]

#: Name-scope component of the shim's per-op overflow instrumentation, which
#: emulates the device's register writes; not a check of the user's graph.
SHIM_INTERNAL_SCOPE = "npu_shim_overflow_check"

VARIABLE_TYPES = frozenset(["VariableV2", "Variable", "VarHandleOp"])
#: Ops a variable's ref or handle passes through on its way to a write.
_PASS_THROUGH_TYPES = graph_walk.IDENTITY_TYPES.union(
    graph_walk.SWITCH_TYPES, graph_walk.ENTER_TYPES, ["ReadVariableOp"])

#: True for op types that write a variable through their first input (the
#: vocabulary the builder's update_ops check uses too).
is_mutation = graph_walk.is_update
#: True for the fused optimizer update ops (ApplyAdam, ResourceApplyAdam...).
is_optimizer_apply = graph_walk.is_optimizer_apply


def is_shim_internal(name):
    """True for a node of the shim's overflow instrumentation."""
    return SHIM_INTERNAL_SCOPE in name.split("/")


class GraphModel(object):
    """The inlined graph: nodes, consumers, conditions and collections.

    Args:
      graph_def: a ``GraphDef``.
      collections: a ``Collections``.
    """

    def __init__(self, graph_def, collections_):
        self.collections = collections_
        inlined = _inline.Inlined(graph_def)
        self.nodes = inlined.nodes
        self._raw_types = inlined.raw_types  # node -> the NodeDef's own op
        self.body = inlined.body  # call node -> every body node, recursively
        self.rets = inlined.rets  # call node -> body nodes its outputs come from
        self._functions = inlined.functions
        self._conditions = None
        self._positions = None
        self._orders = {}  # data_deps / all_deps -> their topological order

    # -- basic queries --------------------------------------------------------

    def canonical(self, tensor):
        """The tensor ("node:port") behind a chain of Identity-like ops."""
        return _inline.canonical(self.nodes, tensor)

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
            self._conditions = _conditions.compute(self)
        return self._conditions.get(name, frozenset())

    #: True when two condition sets can never hold in the same run.
    exclusive = staticmethod(_conditions.exclusive)

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
