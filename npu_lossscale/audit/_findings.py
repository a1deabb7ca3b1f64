"""What the audit reports: the ``Finding`` record, the ``CODES`` it uses,
and the ``Context`` every check reads.
"""

from __future__ import absolute_import, division, print_function

import collections

from npu_lossscale.core import graph_walk
from npu_lossscale.audit import _graph

__all__ = ["CODES", "Context", "Finding", "needs_fetches_note"]

Finding = collections.namedtuple("Finding", ["code", "severity", "message", "ops"])
Finding.__doc__ = """One hazard found by ``audit``.

Attributes:
  code: a stable code such as "NLS001-status-race" (see ``CODES``).
  severity: "error", "warning" or "info".
  message: one sentence: what is wrong and the fix.
  ops: tuple of the names of the ops (or variables) involved.
"""

#: code -> (severity, what it reports). Severities in parentheses apply when
#: no fetches are given (the hazard then depends on what is run together).
CODES = collections.OrderedDict([
    ("NLS000-needs-fetches", ("info", "checks that were run on the whole graph "
                              "because no fetches were given")),
    ("NLS001-status-race", ("error (warning)", "a float-status clear that can "
                            "run between an overflow and the read meant to see "
                            "it, in one step")),
    ("NLS002-untrained-variables", ("warning (info)", "trainable variables that "
                                    "no train op updates (info: only unfetched "
                                    "ones do)")),
    ("NLS003-foreign-loss", ("error", "a train op whose gradients come from a loss "
                             "that does not read the variable it updates")),
    ("NLS004-collective-in-cond", ("error", "a collective inside a cond branch, "
                                   "If branch function or Switch-guarded region")),
    ("NLS005-ungated-update", ("error or warning (warning)", "a variable update "
                               "that runs on steps the loss-scale gate skips")),
    ("NLS006-unsaved-scale", ("warning", "loss-scale state that a Saver does "
                              "not save")),
    ("NLS007-float16-master", ("warning", "a float16 variable updated directly by "
                               "an optimizer (no float32 master copy)")),
    ("NLS008-independent-scales", ("warning", "two or more loss scales, each "
                                   "with its own gate, in one step")),
    ("NLS009-ungated-accumulation", ("error", "accumulated gradients applied "
                                     "outside a gate that sees the whole "
                                     "window's overflow")),
    ("NLS010-double-update", ("error (warning)", "a variable (or global_step) "
                              "updated by more than one train op in one step")),
    ("NLS011-double-scale-update", ("error (info)", "one loss-scale manager's "
                                    "state updated by more than one update op in "
                                    "one step (info: by several step ops of the "
                                    "graph, which must not be fetched together)")),
    ("NLS012-sync-token-stall", ("error", "a SyncReplicasOptimizer whose global "
                                 "step, its workers' token, advances only on "
                                 "applied steps: a skip hangs every worker")),
    ("NLS013-shared-optimizer", ("error or warning (warning)", "one optimizer's own "
                                 "state (Adam's beta powers) advanced by two step ops "
                                 "that train different variables (error: both in one "
                                 "step)")),
])


_READ_TYPES = graph_walk.IDENTITY_TYPES | frozenset(["ReadVariableOp"])


class Context(object):
    """What the checks share.

    Args:
      facts: the ``Facts`` of the graph.
      run: set of node names that can execute in the audited run (the
        ancestors of the fetches; every node without fetches).
      fetched: whether fetches were given.
    """

    def __init__(self, facts, run, fetched):
        self.facts = facts
        self.model = facts.model
        self.run = run
        self.fetched = fetched
        self._consumers = None  # node -> the nodes that wait for it (all edges)
        self._ancestor_sets = {}  # node -> its ancestors (ordered)

    def run_severity(self, severity):
        """``severity`` with fetches; "warning" without (the hazard then
        depends on what the user runs together)."""
        return severity if self.fetched else "warning"

    def co_runnable(self, first, second):
        """Whether two ops can run in one step: their branch conditions do
        not exclude each other and, without fetches, they do not follow two
        one-step-per-run claims on one counter (alternative step ops, such
        as a builder's ``update_op`` and ``per_group`` ops: a run of both
        fails at run time; with fetches that run is what is audited)."""
        if self.model.exclusive(self.model.conditions(first), self.model.conditions(second)):
            return False
        return self.fetched or not self.facts.claim_exclusive(first, second)

    def ordered(self, first, second):
        """Whether one of two ops always runs after the other (it depends on
        it): the sub-steps of a sequence (``build(sequence=...)``), where each
        sub-step updates after the one before."""
        return first in self._ancestors(second) or second in self._ancestors(first)

    def _ancestors(self, name):
        if name not in self._ancestor_sets:
            self._ancestor_sets[name] = self.model.ancestors([name])
        return self._ancestor_sets[name]

    def train_updates(self):
        return dict((op, var) for op, var in self.facts.train_updates.items()
                    if op in self.run)

    def step_ops(self, writes):
        """The step ops a user fetches that run ``writes``, sorted.

        For each write: the nodes without consumers among its dependents
        (all edges), each as the outermost call node holding it. Of those,
        the ops run for their effect (no outputs, such as a ``tf.group``; a
        variable write; an op whose outputs the graph does not tell) are the
        step ops; the values (a read of the state after the step, such as
        ``skip_reason`` or the last-skip record's fields) only where the
        write has no such op. Reads of a variable (a manager reading its
        state back) and v1 conds' pivots (``switch_t``, ``switch_f``) are
        never step ops.

        Args:
          writes: names of variable writes.

        Returns:
          A tuple of node names.
        """
        if self._consumers is None:
            self._consumers = graph_walk.children(self.model.nodes, self.model.all_deps)
        consumers, model = self._consumers, self.model
        found = set()
        for write in writes:
            effects, values = set(), set()
            for name in graph_walk.depth_first([write], lambda n: consumers.get(n, ())):
                if consumers.get(name) or self._is_read(name):
                    continue
                count = model.output_count(name)
                effect = (count is None or count == 0
                          or graph_walk.is_update(model.nodes[name].type))
                (effects if effect else values).add(model.outermost(name))
            found |= effects or values
        return tuple(sorted(found))

    def _is_read(self, name):
        """A read of a variable, or a v1 cond's pivot (an identity of a
        ``Switch`` output): never a step op."""
        node, nodes = self.model.nodes[name], self.model.nodes
        if not node.inputs or node.inputs[0][0] not in nodes:
            return False
        source = nodes[node.inputs[0][0]].type
        if node.type in graph_walk.IDENTITY_TYPES and source in graph_walk.SWITCH_TYPES:
            return True
        return node.type in _READ_TYPES and source in _graph.VARIABLE_TYPES


def _sorted(names):
    return tuple(sorted(set(names)))


def _if_run_together(context):
    return "" if context.fetched else " if they run in one session.run"


def _some(names, limit=8):
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def needs_fetches_note():
    """The info finding given when no fetches were passed."""
    return Finding(
        "NLS000-needs-fetches", "info",
        "no fetches were given, so the whole graph was audited as one run: "
        "NLS001, NLS005 and NLS010 are warnings about ops that would clash if run "
        "together (except step ops whose run-time claims refuse a run of both, such "
        "as a builder's update_op and per_group ops: alternatives, not one run), "
        "NLS011 is an info naming the step ops that update one manager, and NLS002 "
        "counts every train op in the graph; pass the ops you run in one "
        "session.run as fetches (--fetch NAME) to confirm them.",
        ())
