"""What a TensorFlow value is, read alike in TF 1.15 and 2.x: a variable,
the op behind an op-like value, the graph a value belongs to. The ground
floor's readers, which the manager protocol and the core's checks share."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals


def is_variable(value):
    """True for ref and resource variables alike (TF 1.15 and 2.x)."""
    return (isinstance(value, tf.Variable)
            or _tf_internals.is_resource_variable(value))


def op_of(value):
    """The ``tf.Operation`` behind an op, a tensor or the variable-like
    result of ``tf.assign`` (the forms ``tf.group`` accepts), or None."""
    if isinstance(value, tf.Operation):
        return value
    op = getattr(value, "op", None)
    return op if isinstance(op, tf.Operation) else None


def _graph_of(value):
    """The graph of a variable or tensor; None for an eager one."""
    try:
        return value.graph
    except AttributeError:  # eager variables and tensors belong to no graph
        return None


def _graph_and_outer_graphs(graph):
    """``graph``, then each graph a function graph is nested in, outwards."""
    graphs = [graph]
    while getattr(graphs[-1], "outer_graph", None) is not None:
        graphs.append(graphs[-1].outer_graph)
    return graphs


def of_another_graph(value):
    """True when ``value`` (a variable or tensor) belongs to neither the
    default graph nor a graph it is nested in (False for eager values)."""
    graph = _graph_of(value)
    return graph is not None and not any(
        graph is other for other in _graph_and_outer_graphs(tf.get_default_graph()))
