"""What the audit's checks need to know about a graph, computed once.

Every fact is derived from the graph definition alone (``_graph.GraphModel``);
the rules are documented on each attribute of ``Facts`` and in docs/audit.md.
"""

from __future__ import absolute_import, division, print_function

import re

import tensorflow.compat.v1 as tf

from npu_lossscale.core import graph_walk
from npu_lossscale.audit import _bookkeeping
from npu_lossscale.audit import _conditions
from npu_lossscale.audit import _graph
from npu_lossscale.audit import _losses
from npu_lossscale.audit import _savers
from npu_lossscale.audit import _scale_vars
from npu_lossscale.audit._savers import SaverUse

__all__ = ["CHECK_TYPES", "COLLECTIVE_TYPES", "Facts", "STATUS_TYPES", "SaverUse"]

STATUS_READ_TYPES = frozenset(["NpuGetFloatStatus", "NpuGetFloatStatusV2"])
STATUS_CLEAR_TYPES = frozenset(["NpuClearFloatStatus", "NpuClearFloatStatusV2"])
STATUS_TYPES = STATUS_READ_TYPES | STATUS_CLEAR_TYPES
#: Takes no input (tf_adapter ops/aicore/npu_mixed_precesion_ops.cc), so it
#: counts as a graph input, whatever a stand-in builds it from.
STATUS_ALLOC_TYPES = frozenset(["NpuAllocFloatStatus"])
#: Op types whose output tells whether values overflowed.
CHECK_TYPES = frozenset(["IsFinite", "IsInf", "IsNan"]) | STATUS_TYPES

COLLECTIVE_TYPES = graph_walk.COLLECTIVE_TYPES
_BROADCAST = re.compile(r"Broadcast|Bcast")
_RESTORE_TYPES = frozenset(["RestoreV2", "Restore", "RestoreSlice"])
#: Op types that bring a step's input data into the graph.
_SOURCE = re.compile(r"^(Placeholder\w*|Iterator\w*|QueueDequeue\w*|ReaderRead\w*|"
                     r"Random\w*|TruncatedNormal|StatelessRandom\w*|Multinomial|"
                     r"ParseExample\w*|ParseSingleExample\w*)$")
_GLOBAL_STEP_NAME = re.compile(r"(^|/)global_step$")

DT_HALF = tf.float16.as_datatype_enum


class Facts(object):
    """Facts about one ``GraphModel``.

    Attributes:
      model: the ``GraphModel``.
      variables: names of the variable nodes.
      trainable: trainable variables (the collection; without collections,
        the variables an optimizer apply op updates).
      mutations: dict variable -> names of the ops that write it, leaving
        out initializers and restores (``Facts._is_mutation_counted``) and
        the writes of one-step-per-run claims (their counters).
      target: dict mutation op -> the variable it writes.
      checked: names of nodes whose value derives (data edges) from an
        overflow check: ``IsFinite``/``IsInf``/``IsNan`` or a float-status
        read or clear.
      seeds: dict gradient seed node (``.../grad_ys_N``) -> its loss node.
      scale_vars: loss-scale variables: non-trainable floating scalars (or small
        state vectors) that a gradient's loss (the scaled loss) or its seed
        (a scale passed as ``grad_ys``) reads, written by an op whose value
        or branch depends on an overflow check.
      scale_state: ``scale_vars`` plus the counters their update reads
        (non-trainable variables written depending on an overflow check and
        read by a scale variable's update), plus non-trainable variables
        named like a manager's state (loss_scale, good_steps, bad_steps...).
      flag_vars: other non-trainable variables written with a checked
        value (accumulated overflow flags).
      accumulators: non-trainable variables, not the above, written with a
        gradient-derived value (gradient accumulation).
      train_updates: dict op -> variable, for optimizer apply ops and
        gradient-derived writes of trainable variables.
      once: writes that run once, not per step: each is in a branch whose
        predicate reads a non-trainable bool variable (a latch, such as
        ``first_scale_measured``) that the same branch writes
        (``_scale_vars.find_once``): the measured first scale's assign.
      claims: dict claim (an ``Assert`` node) -> its counter variable, for
        run-time one-step-per-run claims (``_bookkeeping.find_claims``).
      bookkeeping: variables that live for one session and that no
        checkpoint carries: the claims' counters and name tables, and
        variables read only behind their own is-initialized check (the
        library's last-skip record), which need no initializer and no
        restore (``_bookkeeping.find_self_initializing``). A bare ``GraphDef``
        has no collections to say that they are in none; these rules do.
    """

    def __init__(self, model):
        self.model = model
        nodes = model.nodes
        self.variables = set(n for n, node in nodes.items() if node.type in _graph.VARIABLE_TYPES)
        self._restored = self._derived(lambda n: nodes[n].type in _RESTORE_TYPES)
        self.target = {}
        self.mutations = {}
        for name, node in nodes.items():
            if (not _graph.is_mutation(node.type) or not node.inputs
                    or _graph.is_shim_internal(name)):
                continue
            var = model.resolve_variable(node.inputs[0])
            if var is None or not self._is_mutation_counted(name, var):
                continue
            self.target[name] = var
            self.mutations.setdefault(var, []).append(name)
        self.trainable = set(model.collections.trainable) & self.variables
        if not model.collections.trainable:
            self.trainable = set(v for op, v in self.target.items()
                                 if _graph.is_optimizer_apply(nodes[op].type))
        claims = _bookkeeping.find_claims(self)
        self.claims = claims.counters
        self._claim_sets = None
        self.bookkeeping = set()
        for op in claims.writes:  # the claims' own counting, not an update
            self.bookkeeping.add(self.target[op])
            self.mutations[self.target.pop(op)].remove(op)
        self.bookkeeping |= _bookkeeping.find_self_initializing(model)
        self.checked = self._derived(
            lambda n: nodes[n].type in CHECK_TYPES and not _graph.is_shim_internal(n))
        self.seeds = _losses.find_seeds(model)
        self._loss_vars = {}
        self.once = _scale_vars.find_once(self)
        self.scale_vars = _scale_vars.find_scale_vars(self)
        self.scale_state = _scale_vars.find_scale_state(self)
        self.flag_vars = set(
            v for v in self.variables - self.trainable - self.scale_vars
            if any(self.value_checked(m) for m in self.mutations.get(v, ())))
        gradient = self._derived(_losses.is_gradient_op)
        self.accumulators = set(
            v for v in self.variables - self.trainable - self.scale_state - self.flag_vars
            if any(any(d in gradient for d in self.value_inputs(m))
                   for m in self.mutations.get(v, ())))
        self.gradient = self._derived(_losses.is_gradient_op, through=self.accumulators)
        self.train_updates = {}
        for op, var in self.target.items():
            if _graph.is_optimizer_apply(nodes[op].type) or (
                    var in self.trainable
                    and any(d in self.gradient for d in self.value_inputs(op))):
                self.train_updates[op] = var
        self.decision = self._derived(
            lambda n: n in self.checked or n in self.flag_vars)
        self._seed_sets = None

    # -- generic passes -------------------------------------------------------

    def _data_deps_through(self, through):
        model = self.model

        def deps(name):
            result = model.data_deps(name)
            if name in through:
                for op in self.mutations.get(name, ()):
                    result = result + self.value_inputs(op)
            return result
        return deps

    def _derived(self, source, through=()):
        """Nodes whose value derives (data edges) from a node where
        ``source`` holds; variables in ``through`` carry what their writes'
        values derive from."""
        deps = self._data_deps_through(set(through)) if through else self.model.data_deps
        found = set()
        for name in self.model.topological(deps):
            if source(name) or any(d in found for d in deps(name)):
                found.add(name)
        return found

    def derived_from(self, names):
        """Nodes whose value derives (data edges) from one of ``names``."""
        names = set(names)
        return self._derived(lambda n: n in names)

    def value_inputs(self, op):
        """The data inputs of a write other than the variable written."""
        return [s for s, _ in self.model.nodes[op].inputs[1:]]

    def _is_mutation_counted(self, op, var):
        if op in self.model.collections.initializers:
            return False
        if op == var + "/Assign" or op.startswith(var + "/Initializer/"):
            return False
        return not any(d in self._restored for d in
                       [s for s, _ in self.model.nodes[op].inputs[1:]])

    def value_checked(self, op):
        """Whether a write's value derives from an overflow check."""
        return any(d in self.checked for d in self.value_inputs(op))

    def branch_checked(self, op):
        """Whether an op runs in a branch whose predicate derives from an
        overflow check."""
        return any(_conditions.pred_node(l) in self.checked
                   for l in self.model.conditions(op) if l.kind == "cond")

    # -- losses ---------------------------------------------------------------

    def loss_vars(self, loss):
        """Variables a loss node reads (data edges)."""
        if loss not in self._loss_vars:
            self._loss_vars[loss] = (self.model.ancestors([loss], data_only=True)
                                     & self.variables)
        return self._loss_vars[loss]

    def scaled_by(self, loss):
        """Variables a loss's backprop starts from: those the loss reads (a
        scaled loss) and those its seeds read (a scale passed as
        ``grad_ys``)."""
        seeds = [seed for seed, of in self.seeds.items() if of == loss]
        return self.loss_vars(loss) | (
            self.model.ancestors(seeds, data_only=True) & self.variables)

    def seeds_of(self, name):
        """Loss nodes whose gradients a node's value derives from (through
        gradient accumulators too)."""
        if self._seed_sets is None:
            deps = self._data_deps_through(self.accumulators)
            sets = {}
            empty = frozenset()
            for node in self.model.topological(deps):
                found = set()
                if node in self.seeds:
                    found.add(self.seeds[node])
                for dep in deps(node):
                    found |= sets.get(dep, empty)
                sets[node] = frozenset(found) if found else empty
            self._seed_sets = sets
        return self._seed_sets.get(name, frozenset())

    def losses_of_update(self, op):
        """The losses a train update's gradient comes from."""
        losses = set()
        for dep in self.value_inputs(op):
            losses |= self.seeds_of(dep)
        return losses

    # -- one-step-per-run claims ---------------------------------------------

    def claims_followed(self, name):
        """The claims (``Assert`` node names) that a node waits for (all
        edges), as a frozenset."""
        if not self.claims:
            return frozenset()
        if self._claim_sets is None:
            model = self.model
            sets, empty = {}, frozenset()
            for node in model.topological(model.all_deps):
                found = set([node]) if node in self.claims else set()
                for dep in model.all_deps(node):
                    found |= sets.get(dep, empty)
                sets[node] = frozenset(found) if found else empty
            self._claim_sets = sets
        return self._claim_sets.get(name, frozenset())

    def claim_exclusive(self, first, second):
        """True when two nodes follow different claims on one counter: a
        run that would run both fails at the later claim, before the writes
        that follow it (one of the two steps may have run first)."""
        claimed = {}
        for claim in self.claims_followed(first) | self.claims_followed(second):
            claimed.setdefault(self.claims[claim], set()).add(claim)
        first_vars = set(self.claims[c] for c in self.claims_followed(first))
        second_vars = set(self.claims[c] for c in self.claims_followed(second))
        return any(len(claimed[var]) > 1 for var in first_vars & second_vars)

    # -- gates, sources, savers -----------------------------------------------

    def gates(self, op):
        """The loss-scale gate literals guarding an op: cond literals taken
        when True, whose predicate is an overflow decision."""
        return frozenset(l for l in self.model.conditions(op)
                         if l.kind == "cond" and l.value is True
                         and _conditions.pred_node(l) in self.decision)

    def is_global_step(self, var):
        return var in self.model.collections.global_step or bool(_GLOBAL_STEP_NAME.search(var))

    def forward_value(self, op):
        """Whether a write's value comes from the step's float16 computation:
        its data ancestors, short of overflow decisions, restores and
        broadcasts, hold an input source and a float16 op."""
        nodes = self.model.nodes

        def stop(name):
            return (name in self.checked or nodes[name].type in _RESTORE_TYPES
                    or bool(_BROADCAST.search(nodes[name].type)))
        seen = self.model.ancestors(self.value_inputs(op), data_only=True, stop=stop)
        seen = set(n for n in seen if not stop(n))
        has_source = any(_SOURCE.match(nodes[n].type) for n in seen)
        has_half = any(self.model.touches(n, DT_HALF) for n in seen)
        return has_source and has_half

    def savers(self):
        """The ``SaverUse``s of the graph's savers (``_savers.find``)."""
        return _savers.find(self.model, self.variables)
