"""Copies of graph ops: ops remade in the current graph, each reading the
copies of its inputs.

Two places copy part of a graph: the float32 view (``float32_view``), a
float32 copy of a loss's forward graph, and the skip branch's loss heads
(``skip_inspection.LossHeads``), the ops of a loss that the backprop does not
need, copied into the branch so that they run only there. A copy is made in
the current name scope and control-dependency context, keeps the original's
name within that scope, and leaves out the original's control inputs and
private attributes (``_class``, its colocation, among them): it runs where
the context it is made in runs.
"""

from __future__ import absolute_import, division, print_function

import contextlib

import tensorflow.compat.v1 as tf


def data_inputs(op):
    """The producers of ``op``'s data inputs (a walk's ``parents``)."""
    return [tensor.op for tensor in op.inputs]


def _same(value):
    return value


class Copies(object):
    """Copies of ops, each made once, in the current graph.

    Args:
      outside: tensor -> what a copy reads for an input whose op is not
        copied (default: the input itself). Called when the copy is made.
      dtype: ``DType`` -> the dtype of a copied output (default: the same).
      attr: ``AttrValue`` -> the copy's attribute value (default: the same).
      on_device: whether each copy is placed on its original's device
        (default: the device of the current context).
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
        """Copies each op of ``ops`` not copied yet, in their order.

        Args:
          ops: ops, each after the ops of its inputs that are to be copied
            (``graph_walk.topological`` over ``data_inputs`` gives such an
            order).
        """
        graph = tf.get_default_graph()
        for op in ops:
            if op in self._copies:
                continue
            attrs = dict((key, self._attr(value)) for key, value in op.node_def.attr.items()
                         if not key.startswith("_"))
            # The inputs first: ``outside`` may make ops (a cast), which
            # take the context's device, not the original's.
            inputs = [self.tensor(tensor) for tensor in op.inputs]
            placed = (tf.device(op.device) if self._on_device and op.device
                      else contextlib.suppress())
            with placed:
                self._copies[op] = graph.create_op(
                    op.type, inputs, [self._dtype(tensor.dtype) for tensor in op.outputs],
                    name=op.name.rsplit("/", 1)[-1], attrs=attrs)
