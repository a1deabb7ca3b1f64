"""What the audit's checks need to know about a graph, computed once.

Every fact is derived from the graph definition alone (``_graph.GraphModel``);
the rules are documented on each attribute of ``Facts`` and in docs/audit.md.
"""

from __future__ import absolute_import, division, print_function

import collections
import re

import tensorflow.compat.v1 as tf

from npu_lossscale.core import graph_walk
from npu_lossscale.audit import _collections
from npu_lossscale.audit import _graph

__all__ = ["CHECK_TYPES", "COLLECTIVE_TYPES", "Facts", "STATUS_TYPES", "SaverUse"]

#: One Saver of the graph: its name (top name scope), its save op names,
#: the set of variables it saves, and the name of its filename tensor (the
#: checkpoint prefix ``Saver.save`` feeds; None where the graph does not
#: show one).
SaverUse = collections.namedtuple("SaverUse", ["name", "saves", "saved", "filename"])

STATUS_READ_TYPES = frozenset(["NpuGetFloatStatus", "NpuGetFloatStatusV2"])
STATUS_CLEAR_TYPES = frozenset(["NpuClearFloatStatus", "NpuClearFloatStatusV2"])
STATUS_TYPES = STATUS_READ_TYPES | STATUS_CLEAR_TYPES
#: Ops that tell whether a variable holds a value (resource and ref variables).
_INITIALIZED_CHECK_TYPES = frozenset(["VarIsInitializedOp", "IsVariableInitialized"])
#: Ops a variable's ref, or its resource handle, passes through unread.
_REF_PASS_TYPES = graph_walk.SWITCH_TYPES.union(graph_walk.ENTER_TYPES)
_HANDLE_PASS_TYPES = _REF_PASS_TYPES.union(graph_walk.IDENTITY_TYPES)
#: Takes no input (tf_adapter ops/aicore/npu_mixed_precesion_ops.cc), so it
#: counts as a graph input, whatever a stand-in builds it from.
STATUS_ALLOC_TYPES = frozenset(["NpuAllocFloatStatus"])
#: Op types whose output tells whether values overflowed.
CHECK_TYPES = frozenset(["IsFinite", "IsInf", "IsNan"]) | STATUS_TYPES

COLLECTIVE_TYPES = graph_walk.COLLECTIVE_TYPES
_BROADCAST = re.compile(r"Broadcast|Bcast")
_RESTORE_TYPES = frozenset(["RestoreV2", "Restore", "RestoreSlice"])
SAVE_TYPES = {"SaveV2": 3, "Save": 2, "SaveSlices": 3}
#: Op types that bring a step's input data into the graph.
_SOURCE = re.compile(r"^(Placeholder\w*|Iterator\w*|QueueDequeue\w*|ReaderRead\w*|"
                     r"Random\w*|TruncatedNormal|StatelessRandom\w*|Multinomial|"
                     r"ParseExample\w*|ParseSingleExample\w*)$")
_GRADIENT_SCOPE = re.compile(r"(^|/)gradients(_\d+)?/")
_SEED = re.compile(r"(^|/)grad_ys_\d+$")
_SCALE_STATE_NAMES = re.compile(
    r"(^|/)(loss_scale|current_loss_scale|good_steps|bad_steps|num_good_steps)(_\d+)?$"
    r"|(^|/)(dynamic|exponential)_loss_scale(_\d+)?/state$")
_GLOBAL_STEP_NAME = re.compile(r"(^|/)global_step$")

DT_HALF = tf.float16.as_datatype_enum
_INTEGER = frozenset([tf.int32.as_datatype_enum, tf.int64.as_datatype_enum])
_ADD_TYPES = frozenset(["AssignAdd", "AssignAddVariableOp"])
#: Ops a gradient seed passes through on its way to the loss's gradient.
_IDENTITY_TYPES = graph_walk.IDENTITY_TYPES | frozenset(["IdentityN"])
_FLOATING = frozenset([tf.float16.as_datatype_enum, tf.float32.as_datatype_enum,
                       tf.float64.as_datatype_enum, tf.bfloat16.as_datatype_enum])


def _consumers_through_identities(name, consumers, nodes):
    """Consumers of a node, looking through identities and the shim's
    instrumentation (which sits between a float16 tensor and its users):
    each identity's consumers in order, identities walked depth first."""

    def passes_on(consumer):
        return (_is_shim_internal(consumer)
                or nodes[consumer].type in _IDENTITY_TYPES)

    result = []
    for node in graph_walk.depth_first(
            [name], lambda node: [c for c in consumers.get(node, ()) if passes_on(c)]):
        result.extend(c for c in consumers.get(node, ())
                      if c != name and c not in result and not passes_on(c))
    return result


def _forward_op_of(gradient_op, prefix, nodes):
    """X for a gradient op named ``<prefix>X_grad/...``, if X is a node."""
    if not gradient_op.startswith(prefix):
        return None
    rest = gradient_op[len(prefix):]
    start = 0
    while True:
        index = rest.find("_grad/", start)
        if index < 0:
            return None
        if rest[:index] in nodes:
            return rest[:index]
        start = index + 1


def _is_shim_internal(name):
    return _graph.SHIM_INTERNAL_SCOPE in name.split("/")


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
        (``Facts._find_once``): the measured first scale's assign.
      claims: dict claim (an ``Assert`` node) -> its counter variable, for
        run-time one-step-per-run claims (``Facts._find_claims``).
      bookkeeping: variables that live for one session and that no
        checkpoint carries: the claims' counters and name tables, and
        variables read only behind their own is-initialized check (the
        library's last-skip record), which need no initializer and no
        restore (``Facts._find_self_initializing``). A bare ``GraphDef``
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
            if not _graph.is_mutation(node.type) or not node.inputs or _is_shim_internal(name):
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
        self.claims, bookkeeping = self._find_claims()
        self._claim_sets = None
        self.bookkeeping = set()
        for op in bookkeeping:  # the claims' own counting, not an update
            self.bookkeeping.add(self.target[op])
            self.mutations[self.target.pop(op)].remove(op)
        self.bookkeeping |= self._find_self_initializing()
        self.checked = self._derived(
            lambda n: nodes[n].type in CHECK_TYPES and not _is_shim_internal(n))
        self.seeds = self._find_seeds()
        self._loss_vars = {}
        self.once = self._find_once()
        self.scale_vars = self._find_scale_vars()
        self.scale_state = self._find_scale_state()
        self.flag_vars = set(
            v for v in self.variables - self.trainable - self.scale_vars
            if any(self._value_checked(m) for m in self.mutations.get(v, ())))
        gradient = self._derived(self._is_gradient_op)
        self.accumulators = set(
            v for v in self.variables - self.trainable - self.scale_state - self.flag_vars
            if any(any(d in gradient for d in self.value_inputs(m))
                   for m in self.mutations.get(v, ())))
        self.gradient = self._derived(self._is_gradient_op, through=self.accumulators)
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

    def _value_checked(self, op):
        return any(d in self.checked for d in self.value_inputs(op))

    def _branch_checked(self, op):
        return any(self._pred_node(l) in self.checked
                   for l in self.model.conditions(op) if l.kind == "cond")

    @staticmethod
    def _pred_node(literal):
        return literal.pred.rsplit(":", 1)[0]

    def _is_gradient_op(self, name):
        return bool(_GRADIENT_SCOPE.search(name) or _SEED.search(name))

    # -- losses and loss-scale state ------------------------------------------

    def _find_seeds(self):
        """Gradient seeds and their losses.

        ``tf.gradients(ys, ...)`` seeds the backprop of each ``y`` with a
        ``Fill`` named ``<scope>/gradients/grad_ys_<i>``, or with an
        ``Identity`` of that name when the caller passes ``grad_ys`` (the
        library seeds with the loss scale). Its loss is the input of the
        ``Shape`` it fills (when the shape is not folded to a constant) or
        the forward op ``X`` that the gradient ops consuming the seed are
        named after (``<scope>/gradients/X_grad/...``): the seed's own
        consumers first (an ``AddV2`` loss's gradient is identities named
        after it), then those behind identities.
        """
        seeds = {}
        nodes = self.model.nodes
        consumers = graph_walk.children(
            nodes, lambda name: [source for source, _ in nodes[name].inputs])
        for name, node in nodes.items():
            if not _SEED.search(name) or not node.inputs:
                continue
            shape = nodes.get(node.inputs[0][0])
            if shape is not None and shape.type == "Shape" and shape.inputs:
                seeds[name] = shape.inputs[0][0]
                continue
            prefix = name[:name.rindex("grad_ys_")]
            for consumer in (list(consumers.get(name, ()))
                             + _consumers_through_identities(name, consumers, nodes)):
                loss = _forward_op_of(consumer, prefix, nodes)
                if loss is not None:
                    seeds[name] = loss
                    break
        return seeds

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

    def _find_scale_vars(self):
        read_by_losses = set()
        for loss in set(self.seeds.values()):
            read_by_losses |= self.scaled_by(loss)
        result = set()
        for var in read_by_losses - self.trainable:
            if self.model.dtype_enum(var) not in _FLOATING:
                continue
            if not self.model.is_small_variable(var):
                continue
            if any(self._value_checked(m) or self._branch_checked(m)
                   for m in self.mutations.get(var, ()) if m not in self.once):
                result.add(var)
        return result

    def _find_scale_state(self):
        state = set(self.scale_vars)
        updates = [m for v in self.scale_vars for m in self.mutations.get(v, ())
                   if m not in self.once]
        values = [d for m in updates for d in self.value_inputs(m)]
        read = self.model.ancestors(values, data_only=True) & self.variables
        for var in read - self.trainable - state:
            if any(self._value_checked(m) or self._branch_checked(m)
                   for m in self.mutations.get(var, ())):
                state.add(var)
        for var in self.variables - self.trainable:
            if _SCALE_STATE_NAMES.search(var):
                state.add(var)
        return state

    def _find_once(self):
        """The writes behind a latch (``once``): ``if not done: write;
        done = True``, where ``done`` is a non-trainable bool variable, so
        the branch runs until it has run (its writes are left out of the
        scale variables' and the updates' counts)."""
        model = self.model
        latches = set(v for v in self.variables - self.trainable
                      if model.dtype_enum(v) == tf.bool.as_datatype_enum)
        if not latches:
            return set()
        latched = {}  # (pred, value) -> whether the branch writes a latch it reads
        once = set()
        for name in self.target:
            for literal in model.conditions(name):
                if literal.kind != "cond":
                    continue
                key = (literal.pred, literal.value)
                if key not in latched:
                    read = model.ancestors([literal.pred.rsplit(":", 1)[0]], data_only=True)
                    latched[key] = any(
                        literal in model.conditions(write)
                        for var in read & latches for write in self.mutations.get(var, ()))
                if latched[key]:
                    once.add(name)
                    break
        return once

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

    def _find_claims(self):
        """The run-time claims of the graph: ``Assert(Equal(a, b))`` where one
        side derives from an add to a non-trainable integer counter that
        counts within the run: the other side reads the counter without the
        add (the count at the run's start), or the add follows a write of
        the counter that is not an add (its reset at the run's start).

        This is the shape of the library's claims (``npu_lossscale.claims``):
        each step op adds one to the counter before its first write and
        asserts that it is the run's only claim, so of two claims on one
        counter in a run one fails the run, and the writes that follow it
        never run.

        Returns:
          (dict from Assert node name to the counter variable's name, the
          set of the claims' own writes: the counters' adds and resets and
          whatever else non-trainable the claims write, bookkeeping that no
          check reports).
        """
        model = self.model
        adds = dict((op, var) for op, var in self.target.items()
                    if model.nodes[op].type in _ADD_TYPES and var not in self.trainable
                    and model.dtype_enum(var) in _INTEGER and not self.is_global_step(var))
        claims, bookkeeping = {}, set()
        if not adds:
            return claims, bookkeeping
        stop = lambda n: n in self.variables
        for name, node in model.nodes.items():
            if node.type != "Assert" or not node.inputs:
                continue
            equal = model.nodes.get(node.inputs[0][0])
            if equal is None or equal.type != "Equal" or len(equal.inputs) != 2:
                continue
            sides = [model.ancestors([source], stop=stop) for source, _ in equal.inputs]
            for add, var in adds.items():
                for this, other in (sides, sides[::-1]):
                    if add not in this or add in other:
                        continue
                    reset = any(w != add and w in this and model.nodes[w].type not in _ADD_TYPES
                                for w in self.mutations.get(var, ()))
                    if var in other or reset:
                        claims[name] = var
            if name in claims:
                bookkeeping |= set(
                    w for w in model.ancestors([name], stop=stop)
                    if w in self.target and self.target[w] not in self.trainable)
        return claims, bookkeeping

    def _find_self_initializing(self):
        """Variables that the graph reads only behind their own is-initialized
        check: every read that feeds another node sits in a cond branch taken
        when ``VarIsInitializedOp`` (or ``IsVariableInitialized``) of that
        variable is True, so the graph copes with the variable holding no
        value (the library's last-skip record, ``diagnosis.Record``).

        A read is the first op on the variable's handle or ref past
        ``Switch``/``Enter`` (and, for a resource handle, ``Identity``) that
        neither writes the variable nor checks its initialization; a read
        that nothing consumes (``ResourceVariable``'s own ``Read`` op) only
        runs when fetched and is left out.

        Returns:
          A set of variable names.
        """
        model, nodes = self.model, self.model.nodes
        checks = {}  # variable -> its is-initialized check nodes
        for name, node in nodes.items():
            if node.type in _INITIALIZED_CHECK_TYPES and node.inputs:
                var = model.resolve_variable(node.inputs[0])
                if var is not None:
                    checks.setdefault(var, set()).add(name)
        if not checks:
            return set()
        consumers = graph_walk.children(nodes, model.all_deps)
        handle_of = {}  # node -> the variable whose handle or ref it passes on
        reads = {}      # variable -> its reads
        for name in model.topological(model.data_deps):
            node = nodes[name]
            if not node.inputs or name in model.body:  # a call: its body reads
                continue
            source = node.inputs[0][0]
            var = source if source in checks else handle_of.get(source)
            if var is None:
                continue
            # An Identity of a ref is its read; of a resource handle, the handle.
            passes = _HANDLE_PASS_TYPES if nodes[var].type == "VarHandleOp" else _REF_PASS_TYPES
            if node.type in passes:
                handle_of[name] = var
            elif (node.type not in _INITIALIZED_CHECK_TYPES and not _graph.is_mutation(node.type)
                  and consumers.get(name)):
                reads.setdefault(var, []).append(name)
        found = set()
        for var, names in reads.items():
            if all(any(l.kind == "cond" and l.value is True
                       and self._pred_node(l) in checks[var]
                       for l in model.conditions(read)) for read in names):
                found.add(var)
        return found

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
                         and self._pred_node(l) in self.decision)

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
        """The ``SaverUse``s of the graph's savers."""
        model = self.model
        save_nodes = [n for n, node in model.nodes.items() if node.type in SAVE_TYPES]
        result, covered = [], set()
        for saver_def in model.collections.saver_defs:
            root = _collections.node_name(saver_def.save_tensor_name)
            if root not in model.nodes:
                continue
            saves = [n for n in model.ancestors([root]) if n in save_nodes]
            if saves:
                covered |= set(saves)
                result.append((root.split("/")[0], saves, saver_def.filename_tensor_name))
        leftovers = {}
        for name in save_nodes:
            if name not in covered:
                leftovers.setdefault(name.split("/")[0], []).append(name)
        result.extend((scope, saves, None) for scope, saves in sorted(leftovers.items()))
        named = []
        for saver, saves, filename in result:
            saved = set()
            for save in saves:
                node = model.nodes[save]
                sources = [s for s, _ in node.inputs[SAVE_TYPES[node.type]:]]
                saved |= model.ancestors(sources, data_only=True) & self.variables
            named.append(SaverUse(saver, sorted(saves), saved,
                                  filename or self._prefix_input(saves[0])))
        return named

    def _prefix_input(self, save):
        """The placeholder a save op's prefix comes from (``<scope>/Const:0``
        for a ``tf.train.Saver``), as a tensor name, or None."""
        node = self.model.nodes[save]
        if not node.inputs:
            return None
        for name in sorted(self.model.ancestors([node.inputs[0][0]], data_only=True)):
            if self.model.nodes[name].type in ("PlaceholderWithDefault", "Placeholder"):
                return name + ":0"
        return None
