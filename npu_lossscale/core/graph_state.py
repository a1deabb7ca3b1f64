"""What the library keeps per ``tf.Graph``, and the build transaction.

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

Every build (``MultiOptimizerLossScale.build``, ``LossScaleOptimizer``'s
``apply_gradients``) runs inside ``transaction``: if it fails, the graph's
collections (so its variables, for initializers and Savers), the control
inputs the library added to existing ops, the optimizers' slot tables and
this record are put back as they were. The ops it made stay in the graph
(TF cannot delete ops), unreachable from anything the user runs or saves.
"""

from __future__ import absolute_import, division, print_function

import contextlib

import tensorflow.compat.v1 as tf


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
      gates: names of the ops a step's gate returns (a failed build's stay:
        nothing the user runs reaches them).
    """

    def __init__(self):
        self.register_clear = None
        self.register_readers = []
        self.register_ordered = []
        self.claimed = []
        self.gates = set()
        self._journal = None

    def _snapshot(self):
        # Not the clear: an op with no state, kept for the retry (its name,
        # loss_scale/clear_status, is the documented one).
        return (list(self.register_readers), list(self.register_ordered),
                [(item, item.snapshot()) for item in self.claimed])

    def _restore(self, snapshot):
        readers, ordered, claimed = snapshot
        self.register_readers[:] = readers
        self.register_ordered[:] = ordered
        self.claimed[:] = [item for item, _ in claimed]
        for item, saved in claimed:
            item.restore(saved)


def of(graph=None):
    """The ``GraphState`` of ``graph`` (the default graph if None)."""
    graph = tf.get_default_graph() if graph is None else graph
    state = getattr(graph, "_npu_lossscale_state", None)
    if state is None:
        state = GraphState()
        graph._npu_lossscale_state = state  # pylint: disable=protected-access
    return state


class _Journal(object):
    """What a transaction must undo: collections, control inputs, records."""

    def __init__(self, graph, state, optimizers):
        self.graph = graph
        self.collections = dict((key, list(graph.get_collection(key)))
                                for key in graph.get_all_collection_keys())
        self.record = state._snapshot()  # pylint: disable=protected-access
        self.optimizers = [(opt, _slot_tables(opt)) for opt in _distinct(optimizers)]
        self.control_inputs = []  # (op, dep) added, in order

    def undo(self, state):
        for op, dep in reversed(self.control_inputs):
            _remove_control_input(op, dep)
        for key in self.graph.get_all_collection_keys():
            if key in self.collections:
                self.graph.get_collection_ref(key)[:] = self.collections[key]
            else:
                self.graph.clear_collection(key)
        for opt, tables in self.optimizers:
            _restore_slot_tables(opt, tables)
        state._restore(self.record)  # pylint: disable=protected-access


@contextlib.contextmanager
def transaction(optimizers=(), graph=None):
    """Undoes what a failed build did to the graph, then re-raises.

    Nested transactions belong to the outermost one.

    Args:
      optimizers: the ``tf.train.Optimizer``s the build applies with: slots
        and non-slot variables (Adam's beta powers) they create are
        forgotten on failure, so a retry makes them again, registered.
      graph: the graph (the default graph if None).

    Yields:
      Nothing.
    """
    graph = tf.get_default_graph() if graph is None else graph
    state = of(graph)
    if state._journal is not None:  # pylint: disable=protected-access
        yield
        return
    journal = _Journal(graph, state, optimizers)
    state._journal = journal  # pylint: disable=protected-access
    try:
        yield
    except BaseException:
        journal.undo(state)
        raise
    finally:
        state._journal = None  # pylint: disable=protected-access


def add_control_input(op, dep):
    """``op`` runs after ``dep`` from now on; undone if the build fails.

    Args:
      op: an existing ``tf.Operation``.
      dep: the ``tf.Operation`` it must follow.
    """
    op._add_control_input(dep)  # pylint: disable=protected-access
    journal = of(op.graph)._journal  # pylint: disable=protected-access
    if journal is not None:
        journal.control_inputs.append((op, dep))


def _remove_control_input(op, dep):
    kept = [other for other in op.control_inputs if other is not dep]
    op._remove_all_control_inputs()  # pylint: disable=protected-access
    op._add_control_inputs(kept)  # pylint: disable=protected-access


def _distinct(items):
    result = []
    for item in items:
        if not any(item is seen for seen in result):
            result.append(item)
    return result


def _slot_tables(opt):
    """Shallow copies of a ``tf.train.Optimizer``'s slot and non-slot tables."""
    slots = getattr(opt, "_slots", None)
    non_slots = getattr(opt, "_non_slot_dict", None)
    return (None if slots is None else dict((name, dict(table)) for name, table in slots.items()),
            None if non_slots is None else dict(non_slots))


def _restore_slot_tables(opt, tables):
    slots, non_slots = tables
    if slots is not None:
        opt._slots.clear()  # pylint: disable=protected-access
        opt._slots.update(slots)  # pylint: disable=protected-access
    if non_slots is not None:
        opt._non_slot_dict.clear()  # pylint: disable=protected-access
        opt._non_slot_dict.update(non_slots)  # pylint: disable=protected-access
