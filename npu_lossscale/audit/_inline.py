"""A GraphDef's nodes, with the function bodies of its calls inlined.

The function bodies of ``If``/``StatelessIf``/``Case``/``While`` and call
ops are inlined, once per call site, under the name
``<call node>/<function>/<node>``; a body node's function arguments are
wired to the call node's inputs, and the call node depends on its body. A
body node of a branch function carries that branch's ``Literal``.
"""

from __future__ import absolute_import, division, print_function

import collections

from npu_lossscale.core import graph_walk
from npu_lossscale.audit._conditions import Literal

__all__ = ["Inlined", "Node", "canonical"]

#: Attribute the CPU shim of npu_bridge puts on the stock op that emulates a
#: real adapter op type (``shims/npu_bridge``): the type audited is that one.
SHIM_OP_TYPE_ATTR = "_npu_shim_op_type"
_MAX_INLINE_DEPTH = 32

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


def _attr_type(node_def):
    attr = node_def.attr.get(SHIM_OP_TYPE_ATTR)
    if attr is not None and attr.s:
        return attr.s.decode("utf-8")
    return node_def.op


def canonical(nodes, tensor):
    """The tensor ("node:port") behind a chain of Identity-like ops."""
    name, port = tensor
    for _ in range(64):
        node = nodes.get(name)
        if node is None or node.type not in graph_walk.IDENTITY_TYPES or not node.inputs:
            break
        name, port = node.inputs[0]
    return "%s:%d" % (name, port)


class Inlined(object):
    """The nodes of a ``GraphDef``, its function bodies inlined.

    Args:
      graph_def: a ``GraphDef``.

    Attributes:
      nodes: OrderedDict node name -> ``Node``: the graph's nodes in the
        order of the definition, then the body nodes.
      raw_types: dict node -> the NodeDef's own op (the shim's stock op).
      body: dict call node -> every body node, recursively.
      rets: dict call node -> body nodes its outputs come from.
      functions: dict function name -> its ``FunctionDef``.
    """

    def __init__(self, graph_def):
        self.nodes = collections.OrderedDict()
        self.raw_types = {}
        self.body = {}
        self.rets = {}
        self.functions = dict((f.signature.name, f) for f in graph_def.library.function)
        for node_def in graph_def.node:
            self._add(node_def, node_def.name, self._outer_inputs(node_def), None, None)
        for node_def in graph_def.node:
            self._inline_calls(node_def.name, 0)

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
        self.raw_types[name] = node_def.op
        self.nodes[name] = Node(name, _attr_type(node_def), tuple(inputs), tuple(controls),
                                node_def.attr, call, branch)

    def _called_functions(self, node):
        """[(function name, argument offset, branch literal or None)] of a call node."""
        attr, calls = node.attr, []
        raw_type = node.type
        if raw_type in graph_walk.IF_TYPES and node.inputs:
            pred = canonical(self.nodes, node.inputs[0])
            for key, value in (("then_branch", True), ("else_branch", False)):
                if key in attr:
                    calls.append((attr[key].func.name, 1, Literal(pred, value, "cond")))
        elif raw_type in graph_walk.CASE_TYPES and node.inputs and "branches" in attr:
            pred = canonical(self.nodes, node.inputs[0])
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
        elif raw_type in self.functions:
            calls.append((raw_type, 0, None))
        return [c for c in calls if c[0] in self.functions]

    def _inline_calls(self, name, depth):
        node = self.nodes[name]
        calls = self._called_functions(node)
        if not calls or depth > _MAX_INLINE_DEPTH:
            return
        body, rets = [], []
        for function_name, offset, branch in calls:
            prefix = "%s/%s/" % (name, function_name)
            added, returned = self._inline_function(
                self.functions[function_name], prefix, node.inputs[offset:], name, branch)
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
