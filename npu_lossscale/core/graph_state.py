"""What the library keeps per ``tf.Graph``: one ``GraphState``, held on the
graph object itself, so that it dies with the graph (a table keyed by graph
would keep graphs alive; a collection would export Python objects).

The control inputs a build adds to the user's ops wait until it returns
(``building``), so a build that fails leaves them as they were.
"""

from __future__ import absolute_import, division, print_function

import contextlib

import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals


class GraphState(object):
    """The library's record of one graph.

    Attributes:
      register_clear: the graph's one float-status clear op, or None.
      register_readers: ``backends.Reader`` records of the register's readers.
      register_ordered: the ops given ``register_clear`` as a control input.
      claimed: ``claims.ClaimedState`` records (``claims``).
      gates: names of the ops a step's gate returns, so that an
        ``update_ops`` entry that runs another step is named as such.
      pending: (op, dep) control inputs deferred while a step is built.
      building: whether a step is being built.
      records: dict from the name of a builder's ``update_op`` to its skip
        record (``diagnostics.record.Record``), for reads made later
        (``monitoring.summaries``).
    """

    def __init__(self):
        self.register_clear = None
        self.register_readers = []
        self.register_ordered = []
        self.claimed = []
        self.gates = set()
        self.pending = []
        self.building = False
        self.records = {}


def of(graph=None):
    """The ``GraphState`` of ``graph`` (the default graph if None)."""
    graph = tf.get_default_graph() if graph is None else graph
    return _tf_internals.library_state(graph, GraphState)


def defer_control_input(op, dep):
    """``op`` runs after ``dep``: at once, or once the step being built is."""
    state = of(op.graph)
    state.pending.append((op, dep))
    if not state.building:
        _flush(state)


@contextlib.contextmanager
def building(graph=None):
    """The build of one step: the control inputs it defers are added when
    it returns, and dropped when it raises."""
    state = of(graph)
    state.building = True
    try:
        yield
    except BaseException:
        del state.pending[:]
        raise
    finally:
        state.building = False
    _flush(state)


def _flush(state):
    """Adds the deferred control inputs (once each)."""
    done = set()
    for op, dep in state.pending:
        if (op, dep) in done or dep in op.control_inputs:
            continue
        done.add((op, dep))
        add_control_input(op, dep)
        if dep is state.register_clear:
            state.register_ordered.append(op)
    del state.pending[:]


def add_control_input(op, dep):
    """The existing ``op`` runs after ``dep`` from now on."""
    _tf_internals.add_control_input(op, dep)


@contextlib.contextmanager
def outside(scope):
    """Makes ops outside any control flow, control dependency and function
    body, in the absolute name scope ``scope`` (ending in "/"): state a step
    makes on first use, wherever that is."""
    with tf.init_scope(), tf.name_scope(scope):
        yield


def current_scope():
    """The current name scope as an absolute scope ("" at the root)."""
    scope = tf.get_default_graph().get_name_scope()
    return scope + "/" if scope else ""
