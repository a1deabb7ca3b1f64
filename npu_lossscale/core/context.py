"""Where a step may be built: graph mode, at the top level of a graph.

The apply gate, ``global_step`` and the loss-scale update are made for one
run of a graph, so a step is refused in eager execution and inside a
``tf.cond``/``tf.while_loop`` body or a graph-mode ``tf.function``; a
float-status read must be at the top level for the register's clear
ordering. Checked at the boundary, before any op is made.
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
    """Where ops made now land, for messages; None at the top level.

    Args:
      graph: the default graph.

    Returns:
      None at the top level of a ``tf.Graph``, else e.g. "a tf.cond branch
      (function graph 'cond_true_3')".
    """
    if _tf_internals.control_flow_context(graph) is not None:
        return "a tf.cond branch or tf.while_loop body (v1 control flow)"
    if not graph.building_function:
        return None
    kind = _CONTROL_FLOW_GRAPHS.get(type(graph).__name__, "a tf.function")
    return "%s (function graph %r)" % (kind, graph.name)


def _traced_from_eager(graph):
    """True for the graph of a ``tf.function`` called by an eager program.

    Its variables are eager ones that the function captures, and it runs
    once per call: as a top-level graph is once per ``session.run``.
    """
    if (not graph.building_function or type(graph).__name__ in _CONTROL_FLOW_GRAPHS
            or getattr(graph.outer_graph, "building_function", False)):
        return False
    with tf.init_scope():
        return tf.executing_eagerly()


def require_graph_mode(what, eager_functions=False, hint=""):
    """Raises ValueError unless ops are being made at the top level of a graph.

    Refused, for every backend: eager execution, and a ``tf.cond`` branch or
    ``tf.while_loop`` body (v1 or v2) or a ``tf.function`` of a graph-mode
    program, since the apply gate, the ``global_step`` and the manager update
    are made for one run of the graph.

    Args:
      what: the name of the API being used, for the message.
      eager_functions: True where ``what`` also works at the top level of a
        ``tf.function`` that an eager program calls (it makes no variable of
        its own, so the function's retracing cannot make a second one).
      hint: a sentence added to the message for a call inside control flow.

    Raises:
      ValueError: before any op is made, for eager execution, inside a
        control-flow body or a graph-mode function, and (unless
        ``eager_functions``) inside an eager program's function.
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
    """Raises ValueError inside a function or control-flow body.

    A float-status step orders the graph's one register clear before the
    ops its read follows; that needs the read at the top level of a
    ``tf.Graph``, not in a ``tf.cond``/``tf.while_loop`` body or a
    ``tf.function`` (eager programs' included).

    Args:
      what: the name of the API being used, for the message.

    Raises:
      ValueError: inside a function graph or a v1 control-flow context.
    """
    inside = _inside(tf.get_default_graph())
    if inside is None:
        return
    raise ValueError(
        "%s must be built at the top level of the graph to read Ascend's "
        "float-status register, got %s. Build it outside tf.cond, tf.while_loop and "
        "tf.function, or pass backend='is_finite'." % (what, inside))
