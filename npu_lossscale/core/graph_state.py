"""What the library keeps per ``tf.Graph``.

A graph holds one ``GraphState``, on the graph object itself: it lives and
dies with the graph (a table keyed by graph would keep every graph alive
through its ops), and a graph collection would put Python objects into
exported meta graphs. It records

* the float-status register: the graph's one clear, the objects that read
  the register, and the ops ordered after the clear (``backends``);
* the run-time claims: which step ops update which state, so that one
  ``session.run`` moves each loss scale once (``claims``);
* the steps' gates, so that an ``update_ops`` entry that runs another step
  is named as such (``commit``).

A build makes its state (variables, claims, control inputs of the user's
ops) only after every user hook that can fail (the managers'
``get_loss_scale`` and ``update_loss_scale``) has returned, so a build that
fails there leaves nothing behind to undo (``step``).
"""

from __future__ import absolute_import, division, print_function

import contextlib

import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals


class GraphState(object):
    """The library's record of one graph.

    Attributes:
      register_clear: the graph's one float-status clear op, or None before
        the first register read.
      register_readers: ``backends.Reader`` records of the objects that read
        the register, in order.
      register_ordered: the ops given ``register_clear`` as a control input.
      claimed: ``claims.ClaimedState`` records, one per piece of state that
        several step ops update.
      gates: names of the ops a step's gate returns.
      pending: (op, dep) control inputs a step being built adds to the
        user's ops once it is built (``defer_control_input``).
    """

    def __init__(self):
        self.register_clear = None
        self.register_readers = []
        self.register_ordered = []
        self.claimed = []
        self.gates = set()
        self.pending = []
        self.building = False


def of(graph=None):
    """The ``GraphState`` of ``graph`` (the default graph if None)."""
    graph = tf.get_default_graph() if graph is None else graph
    return _tf_internals.library_state(graph, GraphState)


def defer_control_input(op, dep):
    """``op`` runs after ``dep``: at once, or, while a step is being built
    (``building``), once it is built, so that a build that fails leaves
    the user's op as it was."""
    state = of(op.graph)
    state.pending.append((op, dep))
    if not state.building:
        _flush(state)


@contextlib.contextmanager
def building(graph=None):
    """The build of one step: the control inputs it defers are added when
    it returns, and dropped when it raises.

    Yields:
      Nothing.
    """
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
    """``op`` runs after ``dep`` from now on.

    Args:
      op: an existing ``tf.Operation``.
      dep: the ``tf.Operation`` it must follow.
    """
    _tf_internals.add_control_input(op, dep)


@contextlib.contextmanager
def outside(scope):
    """Makes ops outside any control flow, control dependency and function
    body, in the absolute name scope ``scope``: state that a step makes on
    first use, after the user hooks that can fail, wherever in the step that
    use is.

    Args:
      scope: an absolute name scope, ending in "/".

    Yields:
      Nothing.
    """
    with tf.init_scope(), tf.name_scope(scope):
        yield


def current_scope():
    """The current name scope as an absolute scope ("" at the root)."""
    scope = tf.get_default_graph().get_name_scope()
    return scope + "/" if scope else ""
