"""Copies of graph ops, each reading the copies of its inputs: the float32
view of a loss's forward graph, and the loss heads of the skip branch.

A copy is made in the current name scope and control context, keeps its
original's name, and leaves out its control inputs and private attributes
(colocation among them): it runs where its context runs.
"""

from __future__ import absolute_import, division, print_function

import contextlib

import tensorflow.compat.v1 as tf


def copy_op(op, inputs=None, name=None):
    """One copy of ``op`` made here: same type and attributes, on
    ``inputs`` (its own if None), named ``name`` (its own last name part if
    None), without its control inputs.

    Returns:
      The new ``tf.Operation``.
    """
    inputs = list(op.inputs) if inputs is None else list(inputs)
    node = op.node_def
    return tf.get_default_graph().create_op(
        op.type, inputs, [output.dtype for output in op.outputs],
        input_types=[tensor.dtype for tensor in inputs],
        name=name or op.name.rsplit("/", 1)[-1],
        attrs=dict((key, node.attr[key]) for key in node.attr))


def data_inputs(op):
    """The producers of ``op``'s data inputs (a walk's ``parents``)."""
    return [tensor.op for tensor in op.inputs]


def _same(value):
    return value


class Copies(object):
    """Copies of ops, each made once, in the current graph.

    Args:
      outside: tensor -> what a copy reads for an input not copied.
      dtype: ``DType`` -> the dtype of a copied output.
      attr: ``AttrValue`` -> the copy's attribute value.
      on_device: whether a copy goes on its original's device, not the
        context's.
    """

    def __init__(self, outside=_same, dtype=_same, attr=_same, on_device=False):
        self._outside = outside
        self._dtype = dtype
        self._attr = attr
        self._on_device = on_device
        self._copies = {}  # original op -> its copy

    def __contains__(self, op):
        return op in self._copies

    def tensor(self, tensor):
        """What a copy reads for ``tensor``: its copy, or ``outside(tensor)``."""
        copy = self._copies.get(tensor.op)
        return self._outside(tensor) if copy is None else copy.outputs[tensor.value_index]

    def copy(self, ops):
        """Copies each op of ``ops`` not copied yet, in order: each after
        its inputs' ops (``graph_walk.topological`` over ``data_inputs``)."""
        graph = tf.get_default_graph()
        for op in ops:
            if op in self._copies:
                continue
            attrs = dict((key, self._attr(value)) for key, value in op.node_def.attr.items()
                         if not key.startswith("_"))
            # Before the device scope: ``outside``'s ops take the context's.
            inputs = [self.tensor(tensor) for tensor in op.inputs]
            placed = (tf.device(op.device) if self._on_device and op.device
                      else contextlib.suppress())
            with placed:
                self._copies[op] = graph.create_op(
                    op.type, inputs, [self._dtype(tensor.dtype) for tensor in op.outputs],
                    name=op.name.rsplit("/", 1)[-1], attrs=attrs)
