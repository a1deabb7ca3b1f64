"""Where a step may be built: graph mode, at the top level of a graph.

The gate, ``global_step`` and the scale update are made for one run of a
graph, and a float-status read needs the top level for the clear's
ordering. Checked before any op is made.
"""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals


#: Function graphs that tf.cond and tf.while_loop make under control flow v2,
#: by class name (tensorflow/python/ops/control_flow_v2_func_graphs.py).
_CONTROL_FLOW_GRAPHS = {"CondBranchFuncGraph": "a tf.cond branch",
                        "WhileCondFuncGraph": "a tf.while_loop condition",
                        "WhileBodyFuncGraph": "a tf.while_loop body"}


def _inside(graph):
    """Where ops made now in ``graph`` land, for messages, e.g. "a tf.cond
    branch (function graph 'cond_true_3')"; None at the top level."""
    if _tf_internals.control_flow_context(graph) is not None:
        return "a tf.cond branch or tf.while_loop body (v1 control flow)"
    if not graph.building_function:
        return None
    kind = _CONTROL_FLOW_GRAPHS.get(type(graph).__name__, "a tf.function")
    return "%s (function graph %r)" % (kind, graph.name)


def _traced_from_eager(graph):
    """True for the graph of a ``tf.function`` an eager program calls: it
    runs once per call, as a top-level graph once per ``session.run``."""
    if (not graph.building_function or type(graph).__name__ in _CONTROL_FLOW_GRAPHS
            or getattr(graph.outer_graph, "building_function", False)):
        return False
    with tf.init_scope():
        return tf.executing_eagerly()


def require_graph_mode(what, eager_functions=False, hint=""):
    """Raises ValueError unless ops are being made at the top level of a graph.

    Args:
      what: the name of the API being used, for the message.
      eager_functions: True where ``what`` also works in an eager program's
        ``tf.function`` (it makes no variable, so retracing is harmless).
      hint: a sentence added to the message for a call inside control flow.
    """
    if tf.executing_eagerly():
        raise ValueError(
            "%s builds a TF1 graph and cannot run eagerly. Call "
            "tf.compat.v1.disable_eager_execution() at program start." % what)
    graph = tf.get_default_graph()
    inside = _inside(graph)
    if inside is None:
        return
    if _traced_from_eager(graph) and _tf_internals.control_flow_context(graph) is None:
        if eager_functions:
            return
        raise ValueError(
            "%s makes variables, so it cannot be built in an eager program's "
            "tf.function (%s), which retraces. Disable eager execution and build at "
            "the top level, or use LossScaleOptimizer, which works there." % (what, inside))
    raise ValueError(
        "%s must be built at the top level of the graph, got a call inside %s. Build "
        "it outside tf.cond, tf.while_loop and tf.function; branch in Python around "
        "session.run instead.%s" % (what, inside, " " + hint if hint else ""))


def require_top_level(what):
    """Raises ValueError inside a function or control-flow body, where the
    register's clear cannot be ordered before a read's ops."""
    inside = _inside(tf.get_default_graph())
    if inside is None:
        return
    raise ValueError(
        "%s must be built at the top level of the graph to read Ascend's "
        "float-status register, got %s. Build it outside tf.cond, tf.while_loop and "
        "tf.function, or pass backend='is_finite'." % (what, inside))
