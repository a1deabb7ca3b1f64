"""Shim-only: the device loop of ``iterations_per_loop``, emulated on CPU.

On Ascend the graph engine runs the subgraph that holds a node named exactly
``IterationOp`` (``tf.group(train_op, name="IterationOp")``) as a loop on the
device: ``GeOp::AddNodeAttrs`` in tf_adapter/kernels/geop_npu.cc sets
``need_iteration_`` for ``node->name() == "IterationOp"``, and the count is the
session config's ``NpuOptimizer`` parameter ``iterations_per_loop``
(``iteration_per_loop_`` there; tf_adapter's util.py keeps the loop bound,
``iterations_per_loop - 1``, in the variable ``npu_runconfig/iterations_per_loop``).
Each iteration runs the whole subgraph again: the input pipeline gives the
next batch, feeds stay as they are, variables keep what the last iteration
wrote, and the host gets the fetched values of the last iteration.

The shim does the same with one ``session.run`` per iteration: ``attach``
replaces the ``run`` of one session object (never ``tf.Session`` itself), and a
run whose fetches hold the op named ``IterationOp`` is run ``iterations``
times with the same fetches and feeds; the last results are returned. Runs
of other fetches run once, as on the device. A ``OneShotIterator`` in the
graph of a looped run is an error, as in tf_adapter's
om_partition_subgraphs_pass.cc ("iterator_per_loop only support 1 when using
OneShotIterator").

The user's script needs no call of this module: ``util.set_iteration_per_loop``,
``util.IterationPerLoop.load_iteration_per_loop_var`` and
``SetIterationsVarHook.after_create_session`` attach the session they are
given, as the real functions configure the device.
"""
from __future__ import absolute_import, division, print_function

import functools

import tensorflow.compat.v1 as tf

#: The node name the graph engine loops (geop_npu.cc).
ITERATION_OP_NAME = "IterationOp"
#: The session config's custom optimizer and its loop-count parameter.
_NPU_OPTIMIZER = "NpuOptimizer"
_CONFIG_PARAMETER = "iterations_per_loop"
#: The attribute of an attached session that holds its loop count.
_ATTRIBUTE = "_npu_shim_iterations_per_loop"


def attach(session, iterations):
    """Makes ``session`` run a fetch that holds ``IterationOp`` ``iterations``
    times per ``run``.

    Args:
      session: a ``tf.Session`` (the raw session a hook's
        ``after_create_session`` gets is one).
      iterations: the loop count, an int >= 1 (1: every run runs once).

    Raises:
      ValueError: when the session's config names an ``NpuOptimizer`` whose
        ``iterations_per_loop`` is another number: the graph engine would loop
        that many times, not ``iterations``.
    """
    configured = _configured_iterations(session)
    if configured is not None and configured != iterations:
        raise ValueError(
            "npu_bridge shim: the session's NpuOptimizer has iterations_per_loop=%d, but the "
            "loop variable was loaded with %d. Set custom_op.parameter_map"
            "['iterations_per_loop'].i = %d in the session config." % (
                configured, iterations, iterations))
    if getattr(session, _ATTRIBUTE, None) is None:
        session.run = functools.partial(_run, session, session.run)
    setattr(session, _ATTRIBUTE, iterations)


def iterations_of(session):
    """The loop count ``attach`` gave ``session``, or 1."""
    return getattr(session, _ATTRIBUTE, None) or 1


def _configured_iterations(session):
    """The ``iterations_per_loop`` of the session config's NpuOptimizer, or None."""
    config = getattr(session, "_config", None)  # BaseSession keeps the ConfigProto it was given
    if config is None:
        return None
    for custom in config.graph_options.rewrite_options.custom_optimizers:
        if custom.name == _NPU_OPTIMIZER and _CONFIG_PARAMETER in custom.parameter_map:
            return int(custom.parameter_map[_CONFIG_PARAMETER].i)
    return None


def _run(session, run, fetches, feed_dict=None, options=None, run_metadata=None):
    """``session.run``, looped when ``fetches`` hold the ``IterationOp``."""
    iterations = iterations_of(session)
    if iterations > 1 and _holds_iteration_op(session.graph, fetches):
        _refuse_one_shot_iterators(session.graph)
        for _ in range(iterations - 1):
            run(fetches, feed_dict=feed_dict, options=options, run_metadata=run_metadata)
    return run(fetches, feed_dict=feed_dict, options=options, run_metadata=run_metadata)


def _holds_iteration_op(graph, fetches):
    """Whether ``fetches`` (any structure ``session.run`` takes, a
    MonitoredSession's dict keyed by its hooks included) name the op called
    ``IterationOp``."""
    stack = [fetches]
    while stack:
        fetch = stack.pop()
        if isinstance(fetch, dict):
            stack.extend(fetch.values())
        elif isinstance(fetch, (list, tuple)):
            stack.extend(fetch)
        elif isinstance(fetch, str):
            if fetch.split(":")[0] == ITERATION_OP_NAME:
                return True
        elif isinstance(fetch, (tf.Operation, tf.Tensor)) and fetch.graph is graph:
            if (fetch if isinstance(fetch, tf.Operation) else fetch.op).name == ITERATION_OP_NAME:
                return True
    return False


def _refuse_one_shot_iterators(graph):
    if any(op.type == "OneShotIterator" for op in graph.get_operations()):
        raise RuntimeError(
            "npu_bridge shim: iterations_per_loop > 1 with a one-shot iterator; the graph "
            "engine supports only 1 then. Make the dataset's iterator with "
            "make_initializable_iterator() and run its initializer.")
