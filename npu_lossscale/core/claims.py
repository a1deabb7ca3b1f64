"""Run-time claims: each piece of step state moves once per ``session.run``.

Several step ops may update one state (a shared manager, a builder's
``update_op`` and its ``per_group`` ops). In separate runs, as alternating
loops run them, that is correct; a run that fetches two would move the
state twice, a fact about one run, so it is refused at run time.

A state with two or more step ops gets a counter and a table of names, in
no collection (they matter within one run only), zeroed by one reset per
run that every claim follows. Each claim writes its step op's name and
adds one before any write of its step; of two claims in one run one reads
two and fails the run, naming the step ops. A state with one step op gets
no claim. Runs of one step op from several threads may be refused.
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale.core import graph_state as _graph_state

#: Names kept per claimed state; beyond, names share slots in the message.
NAME_SLOTS = 16


class Claimant(collections.namedtuple("Claimant", ["description", "entry_ops", "claim"])):
    """One step op that updates a claimed state.

    Attributes:
      description: what the step op is, for messages.
      entry_ops: ops of the step that every write of it follows; the claim
        becomes a control input of each.
      claim: the claim's ``Assert`` op, or None while the state has one
        step op.
    """


class ClaimedState(object):
    """A piece of state (``key``, compared by identity, and its
    ``description``), its ``Claimant``s, and ``(count, names, reset)`` once
    two claim it."""

    def __init__(self, key, description):
        self.key = key
        self.description = description
        self.claimants = []
        self.variables = None

    def snapshot(self):
        """What ``restore`` needs to undo later changes (a failed build)."""
        return list(self.claimants), self.variables

    def restore(self, saved):
        """Puts back a ``snapshot``."""
        claimants, variables = saved
        self.claimants[:] = claimants
        self.variables = variables


class StateKey(collections.namedtuple("StateKey", ["key", "description"])):
    """State a step op updates once per run: an object and its description."""


def claim(states, description, entry_ops):
    """Registers a step op that updates ``states`` (``StateKey``s). Once a
    state has two, every step op updating it claims it first.

    Args:
      states: ``StateKey``s of what the step op updates once per run.
      description: what the step op is, for messages.
      entry_ops: ops of the step that all its writes follow.
    """
    graph = tf.get_default_graph()
    if graph.building_function:
        # An eager program's tf.function: each call is a run of its own.
        return
    state = _graph_state.of(graph)
    for key in states:
        record = _find(state, key.key)
        if record is None:
            record = ClaimedState(key.key, key.description)
            state.claimed.append(record)
        record.claimants.append(Claimant(description, tuple(entry_ops), None))
        if len(record.claimants) > 1:
            _claim_all(graph, record, state.claimed.index(record))


def _find(state, key):
    for record in state.claimed:
        if record.key is key:
            return record
    return None


def _claim_all(graph, record, index):
    """Makes the claims of every claimant of ``record`` that has none."""
    with graph.control_dependencies(None), graph.name_scope("loss_scale/claims/"):
        with tf.name_scope("state_%d" % index):
            if record.variables is None:
                record.variables = _variables()
            for position, claimant in enumerate(record.claimants):
                if claimant.claim is not None:
                    continue
                op = _claim_op(record, position, claimant.description)
                for entry in claimant.entry_ops:
                    _graph_state.add_control_input(entry, op)
                record.claimants[position] = claimant._replace(claim=op)


def _variables():
    """The counter, the names table and the per-run reset of one state."""
    blank = tf.fill([NAME_SLOTS], "")
    count = tf.Variable(0, dtype=tf.int64, trainable=False, collections=[], name="count")
    names = tf.Variable(blank, trainable=False, collections=[], name="names")
    # Assigning needs no initialized variable: no initializer to run.
    reset = tf.group(tf.assign(count, tf.zeros([], tf.int64)), tf.assign(names, blank),
                     name="reset")
    return count, names, reset


MESSAGE = ("npu_lossscale: one session.run ran two step ops that both update %s, "
           "which must move once per run. Fetch one of them per session.run; the "
           "first may already have applied. Step ops that ran:")


def _claim_op(record, position, description):
    """The ``Assert`` that fails when another step op claimed this run."""
    count, names, reset = record.variables
    with tf.control_dependencies([reset]):
        wrote = tf.scatter_update(names, [position % NAME_SLOTS], ["%s; " % description])
    with tf.control_dependencies([wrote]):
        added = tf.assign_add(count, tf.ones([], tf.int64))
    # A copy (a ref variable's read aliases its buffer); the names after it,
    # when every step op counted has written its own.
    with tf.control_dependencies([added]):
        now = tf.raw_ops.Snapshot(input=count.read_value())
    with tf.control_dependencies([now]):
        ran = tf.strings.reduce_join(names.read_value())
    return tf.raw_ops.Assert(condition=tf.equal(now, 1),
                             data=[MESSAGE % record.description, ran],
                             summarize=1, name="claim")
