"""The audit's checks: one function per finding code.

Each check takes a ``Context`` (the facts, the set of nodes in the run, and
whether fetches were given) and returns a list of ``Finding``s.
"""

from __future__ import absolute_import, division, print_function

import collections
import itertools

from npu_lossscale import graph_walk
from npu_lossscale.audit import _facts
from npu_lossscale.audit import _graph

__all__ = ["CHECKS", "CODES", "Context", "Finding", "needs_fetches_note"]

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
])


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

    def train_updates(self):
        return dict((op, var) for op, var in self.facts.train_updates.items()
                    if op in self.run)


def _sorted(names):
    return tuple(sorted(set(names)))


def _if_run_together(context):
    return "" if context.fetched else " if they run in one session.run"


# -- NLS001 ----------------------------------------------------------------------

def check_status_race(context):
    """No float-status clear may land between an overflow and the read that
    should see it.

    A read sees every overflow since the last clear and does not change the
    register (tf_adapter's read and clear are separate ops), so reads never
    race each other. A clear
    races a read in the same run unless it runs after the read, or before
    every op the read follows (then it only removes what came before the
    step, as the builder's one clear per run does).
    """
    model = context.model
    ops = [n for n in context.run if model.nodes[n].type in _facts.STATUS_TYPES]
    reads = sorted(n for n in ops if model.nodes[n].type in _facts.STATUS_READ_TYPES)
    clears = sorted(n for n in ops if model.nodes[n].type in _facts.STATUS_CLEAR_TYPES)
    racing = set()
    order = model.topological(model.all_deps) if reads and clears else []
    before = dict((clear, model.ancestors([clear])) for clear in clears)
    for read in reads:
        followed = model.ancestors([read])
        for clear in clears:
            if not context.co_runnable(read, clear):
                continue
            if read in before[clear]:
                continue  # the clear comes after the read
            if not _precedes_all(model, order, clear, followed):
                racing |= set([read, clear])
    if not racing:
        return []
    names = sorted(op for op in racing if model.nodes[op].type in _facts.STATUS_READ_TYPES)
    return [Finding(
        "NLS001-status-race", context.run_severity("error"),
        "%d float-status reads/clears (%s) can run in one step with a clear that "
        "can land between an overflow and the read that should see it%s, so a "
        "loss-scale check can miss its overflow and apply a saturated step (the "
        "multi-optimizer race of Huawei's FAQ); build all the optimizers with one "
        "npu_lossscale.MultiOptimizerLossScale (one clear per run, before every "
        "read's computation), or run each optimizer in its own session.run."
        % (len(racing), ", ".join(names), _if_run_together(context)),
        _sorted(racing))]


def _precedes_all(model, order, clear, followed):
    """Whether ``clear`` runs before every op in ``followed`` (a read's
    ancestors) that computes: all but graph inputs (nodes without inputs,
    placeholders with a default, status buffers). An op that runs before
    the clear (its ancestors) is not exempt: the clear wipes its overflow.
    A function body node starts when its call node does, so it also counts
    as after the clear when the call node's own inputs are. ``order``:
    every node, topologically."""

    def deps(name):
        call = model.nodes[name].call
        if call is None:
            return model.all_deps(name)
        outer = model.nodes[call]
        return model.all_deps(name) + [source for source, _ in outer.inputs] + list(
            outer.controls)

    after = set([clear])
    # A stand-in's own nodes (the CPU shim's) are named under the op's name.
    pending = [name for name in order if name in followed and name != clear
               and not name.startswith(clear + "/")]
    changed = True
    while changed:  # a second pass settles v1 loop back edges
        changed = False
        for name in pending:
            if name not in after and any(dep in after for dep in deps(name)):
                after.add(name)
                changed = True
    return all(name in after or not model.all_deps(name)
               or model.nodes[name].type in _facts.STATUS_ALLOC_TYPES
               or model.nodes[name].type in graph_walk.FEEDABLE_TYPES for name in pending)


# -- NLS002 / NLS003 ----------------------------------------------------------------

def check_untrained_variables(context):
    """Trainable variables no train update of the run writes.

    A warning for variables that no train op of the whole graph updates (the
    DCGAN port bug); an info for variables that only train ops outside the
    fetches update (fine when another session.run runs them, as in TF-GAN's
    sequential G and D steps).
    """
    facts = context.facts
    updates = context.train_updates()
    if not updates or not context.model.collections.trainable:
        return []
    missing = facts.trainable - set(updates.values())
    elsewhere = missing & set(facts.train_updates.values())
    found = []
    never = sorted(missing - elsewhere)
    if never:
        where = "train op, fetched or not" if context.fetched else "train op in the graph"
        found.append(Finding(
            "NLS002-untrained-variables", "warning",
            "%d trainable variable(s) (%s) are updated by no %s, so they never "
            "train; pass them in some optimizer's var_list (e.g. the generator's "
            "variables to the generator's group), or create them with "
            "trainable=False if they are frozen on purpose." % (len(never), _some(never), where),
            tuple(never)))
    if elsewhere:
        found.append(Finding(
            "NLS002-untrained-variables", "info",
            "%d trainable variable(s) (%s) are updated only by train ops that are "
            "not fetched; that is right if another session.run trains them, else "
            "fetch their train op too." % (len(elsewhere), _some(sorted(elsewhere))),
            tuple(sorted(elsewhere))))
    return found


def _some(names, limit=8):
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def check_foreign_loss(context):
    """Train updates whose gradient comes from a loss not reading their variable."""
    facts = context.facts
    found = []
    by_loss = collections.OrderedDict()
    for op, var in sorted(context.train_updates().items()):
        if var not in facts.trainable:
            continue
        losses = facts.losses_of_update(op)
        if not losses:
            continue
        if any(var in facts.loss_vars(loss) for loss in losses):
            continue
        by_loss.setdefault(tuple(sorted(losses)), []).append((op, var))
    for losses, pairs in by_loss.items():
        variables = sorted(set(v for _, v in pairs))
        found.append(Finding(
            "NLS003-foreign-loss", "error",
            "the gradients applied to %s come from loss %s, which does not read "
            "%s, so the update follows another network's loss; compute each "
            "optimizer's gradients from its own loss over its own variables "
            "(e.g. the generator's loss for the generator's variables)."
            % (", ".join(variables[:4]) + (", ..." if len(variables) > 4 else ""),
               " / ".join(losses), "them" if len(variables) > 1 else "it"),
            _sorted([op for op, _ in pairs] + list(losses))))
    return found


# -- NLS004 ----------------------------------------------------------------------

def _is_collective(node_type):
    return node_type in _facts.COLLECTIVE_TYPES


def check_collective_in_cond(context):
    """Collectives that only some steps (or ranks) run."""
    model = context.model
    ops = []
    for name in sorted(context.run):
        if not _is_collective(model.nodes[name].type):
            continue
        if any(l.kind == "cond" for l in model.conditions(name)):
            ops.append(name)
    if not ops:
        return []
    return [Finding(
        "NLS004-collective-in-cond", "error",
        "collective(s) %s run inside a cond branch or a Switch-guarded region, so "
        "a rank whose predicate differs skips them and the others hang; move every "
        "allreduce/allgather/broadcast before the cond (reduce the overflow flags "
        "and gradients first, then gate only local updates), as "
        "MultiOptimizerLossScale(distributed=...) does." % ", ".join(ops[:6]),
        tuple(ops))]


# -- NLS005 ----------------------------------------------------------------------

def check_ungated_updates(context):
    """Writes that run on skipped steps, in a run that has a loss-scale gate.

    An error when the written value comes from this step's float16 forward
    pass; a warning for a float32 one that belongs to (or feeds) UPDATE_OPS
    or that a loss depends on. The latter, writes inside the forward pass
    (batch norm built with ``updates_collections=None``), get their own
    finding: no gate can hold them back, the layer has to be built with
    UPDATE_OPS. Ungated writes that a gated op stands for (``graph_walk``:
    a ``tf.print``, ``check_numerics`` or ``tf.tuple`` around them, which
    the gate holds instead of them) are an error of their own.
    """
    facts = context.facts
    gated = [op for op in context.train_updates() if facts.gates(op)]
    if not gated:
        return []
    update_ops = _update_ops_writes(context)
    wrapped = _wrapped_writes(context)
    forward_pass = context.model.ancestors(set(facts.seeds.values()))
    groups = collections.OrderedDict(
        ((severity, in_place), []) for severity in ("error", "warning")
        for in_place in (True, False))
    behind = []
    for op, var in sorted(facts.target.items()):
        if op not in context.run or facts.gates(op):
            continue
        if (var in facts.scale_state or var in facts.flag_vars or var in facts.accumulators
                or var in context.model.collections.local):
            continue
        in_place = op in forward_pass
        if op in wrapped and not in_place:
            behind.append(op)
        elif facts.forward_value(op):
            groups[("error", in_place)].append(op)
        elif op in update_ops or in_place:
            groups[("warning", in_place)].append(op)
    found = []
    if behind:
        wrappers = _sorted(wrapped[op] for op in behind)
        found.append(Finding(
            "NLS005-ungated-update", context.run_severity("error"),
            "%d variable update(s) (%s) run on every step, skipped (overflowing) ones "
            "too: the loss-scale gate holds op(s) that only wrap them (%s, such as "
            "a tf.print, check_numerics, tf.tuple or tf.group around them), not the "
            "updates; pass the wrappers or the updates to MultiOptimizerLossScale"
            ".build(update_ops=...), which gates the updates behind any wrapper, or "
            "make the updates inside the gate's branch."
            % (len(behind), _some(behind, 6), _some(list(wrappers), 4)),
            _sorted(behind + list(wrappers) + gated[:1])))
    for (severity, in_place), ops in groups.items():
        if not ops:
            continue
        why = ("from this step's float16 forward pass" if severity == "error"
               else "from UPDATE_OPS" if not in_place else "of float32 values")
        if in_place:
            message = (
                "%d variable update(s) %s (%s) run inside the forward pass (the loss "
                "depends on them, as batch norm built with updates_collections=None "
                "makes its moving-statistics updates), so every step runs them, "
                "skipped (overflowing) ones too, writing values that can be inf or "
                "NaN (batch-norm statistics stay broken for good), and no gate can "
                "hold them back; build the layer with the default "
                "updates_collections (tf.GraphKeys.UPDATE_OPS) and pass "
                "tf.get_collection(tf.GraphKeys.UPDATE_OPS) to "
                "MultiOptimizerLossScale.build(update_ops=...)."
                % (len(ops), why, ", ".join(ops[:6])))
        else:
            message = (
                "%d variable update(s) %s (%s) run beside the loss-scale gate but "
                "outside it%s, so on an overflowing step that is skipped they still "
                "write values that can be inf or NaN (batch-norm statistics stay "
                "broken for good); put them behind the gate (MultiOptimizerLossScale"
                ".build(update_ops=...) or inside the apply cond; batch norm built "
                "with updates_collections=None updates inside the forward pass: "
                "keep the default UPDATE_OPS and pass those ops to build(update_ops=...))."
                % (len(ops), why, ", ".join(ops[:6]), _if_run_together(context)))
        found.append(Finding("NLS005-ungated-update", context.run_severity(severity),
                             message, _sorted(ops + [g for g in gated[:1]])))
    return found


def _walk_kind(context):
    """``graph_walk`` classify for the audit: writes are updates; a node
    whose value derives from an overflow decision (the gate's predicate,
    its pivot, packed flags) is the gate's own machinery, not walked; a
    Switch is walked (only its predicate is a decision, and the walk skips
    it), so a cond branch's captures lead to what they capture."""
    facts, nodes = context.facts, context.model.nodes

    def classify(name):
        node_type = nodes[name].type
        kind = graph_walk.kind_of_type(node_type)
        if (kind != graph_walk.UPDATE and name in facts.decision
                and node_type not in ("Switch", "RefSwitch")):
            return graph_walk.STOP
        return kind
    return classify


def _update_ops_writes(context):
    """Writes that members of UPDATE_OPS stand for (``graph_walk``)."""
    facts, model = context.facts, context.model
    members = [n for n in sorted(model.collections.update_ops) if n in model.nodes]
    walk = graph_walk.updates_behind(members, model.walk_parents, _walk_kind(context))
    return set(reached.node for reached in walk.updates if reached.node in facts.target)


def _wrapped_writes(context):
    """Ungated writes that a gated op of the run stands for (``graph_walk``),
    as a dict from the write to that op."""
    facts, model = context.facts, context.model
    classify = _walk_kind(context)
    starts = [n for n in context.run
              if facts.gates(n) and not graph_walk.is_update(model.nodes[n].type)]
    seen, found = set(), {}
    for start in sorted(starts, key=model.position):
        walk = graph_walk.updates_behind([start], model.walk_parents, classify, seen)
        for reached in walk.updates:
            if reached.node in facts.target and not facts.gates(reached.node):
                found.setdefault(reached.node, start)
    return found


# -- NLS006 ----------------------------------------------------------------------

def check_unsaved_scale(context):
    """Loss-scale state that a training Saver leaves out.

    The state is the scale and its counters, the overflow flag variables
    (window flags, the skipped-step counter) and the gradient accumulators.
    A Saver made before some of them (its save op comes first in the graph,
    which lists nodes in creation order) was made before ``build()`` or
    before the manager: its default var_list, the global variables that
    existed then, cannot hold them, so the fix is to create it later, not
    to touch its var_list. State made before the Saver and left out means
    an explicit var_list without it. Each finding names the Saver (its
    scope and filename tensor) and says which other Saver, if any, does
    save the state: a script may keep its authors' early Saver unused
    beside the one it checkpoints with.
    """
    facts, model = context.facts, context.model
    state = facts.scale_state.union(facts.flag_vars, facts.accumulators) - model.collections.local
    if not facts.scale_state:
        return []
    savers = [saver for saver in facts.savers() if saver.saved & facts.trainable]
    found = []
    for saver in savers:
        missing = sorted(state - saver.saved)
        if not missing:
            continue
        made = min(model.position(save) for save in saver.saves)
        late = [v for v in missing if model.position(v) > made]
        early = [v for v in missing if model.position(v) < made]
        if late:
            others = sorted(v for v in facts.variables - saver.saved - state
                            - model.collections.local if model.position(v) > made)
            fix = ("create the Saver after build() (tf.train.Saver() last, once the "
                   "whole training graph is built)")
            found.append(Finding(
                "NLS006-unsaved-scale", "warning",
                "Saver %s was created before the loss-scale state %s (before "
                "build(), or before the manager), and a Saver made without var_list "
                "saves only the variables that exist when it is made, so this Saver "
                "does not save them%s and a run restored from its checkpoints "
                "restarts from the initial scale and counters; %s."
                % (_saver_label(saver), ", ".join(late),
                   " (nor %d other variable(s) made after it, e.g. %s)"
                   % (len(others), _some(others, 4)) if others else "",
                   _other_saver_fix(savers, saver, late, fix)),
                tuple(late + saver.saves)))
        if early:
            fix = ("leave var_list out (save every global variable) or add these "
                   "variables to it")
            found.append(Finding(
                "NLS006-unsaved-scale", "warning",
                "Saver %s does not save the loss-scale state %s, so a run restored "
                "from its checkpoints restarts from the initial scale and counters; %s."
                % (_saver_label(saver), ", ".join(early),
                   _other_saver_fix(savers, saver, early, fix)),
                tuple(early + saver.saves)))
    return found


def _saver_label(saver):
    """'save' (filename tensor 'save/Const:0'): how a Saver is named."""
    if saver.filename:
        return "%r (filename tensor %r)" % (saver.name, saver.filename)
    return repr(saver.name)


def _other_saver_fix(savers, saver, variables, fix):
    """``fix``, preceded by the Savers that do save ``variables`` if any."""
    keeping = [other for other in savers
               if other is not saver and set(variables) <= other.saved]
    if not keeping:
        return fix
    return ("Saver %s does save %s: if that is the Saver you checkpoint with, delete "
            "this unused one (nothing is lost), else %s"
            % (" and ".join(_saver_label(other) for other in keeping),
               "it" if len(variables) == 1 else "them", fix))


# -- NLS007 ----------------------------------------------------------------------

def check_float16_master(context):
    """Optimizer updates of float16 variables."""
    facts, model = context.facts, context.model
    pairs = sorted((op, var) for op, var in context.train_updates().items()
                   if var in facts.trainable and model.dtype_enum(var) == _facts.DT_HALF)
    if not pairs:
        return []
    variables = sorted(set(v for _, v in pairs))
    return [Finding(
        "NLS007-float16-master", "warning",
        "%d float16 variable(s) (%s) are updated directly by an optimizer, so "
        "updates smaller than their float16 spacing are lost; keep the variables "
        "in float32 and cast them to float16 where they are used (float32 master "
        "weights)." % (len(variables), ", ".join(variables[:6])),
        _sorted([op for op, _ in pairs] + variables))]


# -- NLS008 ----------------------------------------------------------------------

def check_independent_scales(context):
    """Several loss-scale variables read in one run, each with its own gates."""
    facts = context.facts
    scales = sorted(v for v in facts.scale_vars if v in context.run)
    if len(scales) < 2:
        return []
    gates = dict((s, set()) for s in scales)
    for op in context.train_updates():
        for loss in facts.losses_of_update(op):
            for scale in scales:
                if scale in facts.loss_vars(loss):
                    gates[scale] |= facts.gates(op)
    independent = set()
    for first, second in itertools.combinations(scales, 2):
        if gates[first] and gates[second] and not gates[first] & gates[second]:
            independent |= set([first, second])
    if not independent:
        return []
    return [Finding(
        "NLS008-independent-scales", "warning",
        "%d loss scales (%s) are used in one step, each deciding on its own which "
        "updates to skip, so one network can be updated while the other skips; "
        "use one manager for all optimizers (one MultiOptimizerLossScale) unless "
        "independent scales are intended." % (len(independent), ", ".join(sorted(independent))),
        tuple(sorted(independent)))]


# -- NLS009 ----------------------------------------------------------------------

def check_ungated_accumulation(context):
    """Applies of accumulated gradients must be gated on the window's overflow."""
    facts, model = context.facts, context.model
    if not facts.accumulators:
        return []
    found = []
    from_accumulators = facts.derived_from(facts.accumulators)
    for op in sorted(context.train_updates()):
        if not any(d in from_accumulators for d in facts.value_inputs(op)):
            continue
        read = model.ancestors(facts.value_inputs(op), data_only=True) & facts.accumulators
        gates = facts.gates(op)
        if not gates:
            problem = "is not behind any overflow gate"
        elif _gate_sees_window(context, gates, read):
            continue
        else:
            problem = ("is gated only on this run's overflow check, while the "
                       "accumulators add every micro-step's gradients unchecked")
        found.append(Finding(
            "NLS009-ungated-accumulation", "error",
            "the apply of accumulated gradients %s (%s) %s, so one overflowing "
            "micro-batch poisons the applied mean; decide on the whole window's "
            "overflow flags behind the same gate as the apply "
            "(MultiOptimizerLossScale.build(accumulation_steps=N))."
            % (op, ", ".join(sorted(read)[:3]), problem),
            _sorted([op] + sorted(read))))
    return found


def _gate_sees_window(context, gates, accumulators):
    facts, model = context.facts, context.model
    preds = [l.pred.rsplit(":", 1)[0] for l in gates]
    seen = model.ancestors(preds, data_only=True)
    if seen & (facts.flag_vars | accumulators):
        return True
    writes = [m for a in accumulators for m in facts.mutations.get(a, ())]
    return bool(writes) and all(facts.gates(m) for m in writes)


# -- NLS010 ----------------------------------------------------------------------

def check_double_updates(context):
    """Variables (and global_step) written by more than one train op in a run."""
    facts = context.facts
    writers = {}
    for op, var in context.train_updates().items():
        writers.setdefault(var, set()).add(op)
    for var, ops in facts.mutations.items():
        if facts.is_global_step(var):
            writers.setdefault(var, set()).update(o for o in ops if o in context.run)
    found = []
    for var in sorted(writers):
        if var not in facts.trainable and not facts.is_global_step(var):
            continue
        ops = sorted(writers[var])
        clashing = set()
        for first, second in itertools.combinations(ops, 2):
            if context.co_runnable(first, second):
                clashing |= set([first, second])
        if not clashing:
            continue
        what = "global_step advances" if facts.is_global_step(var) else "%s is updated" % var
        found.append(Finding(
            "NLS010-double-update", context.run_severity("error"),
            "%s %d times in one step%s (%s), e.g. by two builders or a builder "
            "plus a plain minimize; give each variable to exactly one optimizer "
            "and pass global_step to one of them only."
            % (what, len(clashing), _if_run_together(context), ", ".join(sorted(clashing))),
            (var,) + tuple(sorted(clashing))))
    return found


# -- NLS011 ----------------------------------------------------------------------

#: One manager's state updated by several update ops: the state variables,
#: the names of the updates, and the step ops a user fetches that run them.
SharedState = collections.namedtuple("SharedState", ["variables", "updates", "step_ops"])


def check_double_scale_updates(context):
    """A manager's state written by several update ops.

    One update of a manager writes each state variable at most once per run:
    its writes of one variable sit in branches that exclude each other
    (grow or count, back off or count). Two writes of one state variable
    therefore come from two updates of the same manager: one manager shared
    by two optimizers or builders, one LossScaleOptimizer used for two
    minimize calls, a builder's update_op and per_group ops. The updates are
    told apart by the overflow checks their writes decide on.

    An error when the fetched run holds two updates that can run together
    (the scale would move twice per run); otherwise, when the graph holds
    several, one info naming the step ops that must not be fetched together
    (fine in separate session.runs, as alternating GAN loops run them).
    """
    facts = context.facts
    clashes = collections.OrderedDict()  # update-op names -> state variables
    shared = collections.OrderedDict()   # SharedState key -> state variables
    for var in sorted(facts.scale_state):
        every = sorted(facts.mutations.get(var, ()))
        writes = [w for w in every if w in context.run]
        clashing = set()
        for first, second in itertools.combinations(writes, 2):
            if context.co_runnable(first, second):
                clashing |= set([first, second])
        if clashing and context.fetched:
            clashes.setdefault(_update_ops(context, clashing), []).append(var)
            continue
        updates = _update_ops(context, every)
        if len(updates) > 1:
            shared.setdefault((updates, _step_ops(context, every)), []).append(var)
    found = []
    for updates, variables in clashes.items():
        found.append(Finding(
            "NLS011-double-scale-update", "error",
            "the loss-scale state %s is updated by %d update ops in one step (%s), "
            "so one manager counts each step more than once and its scale grows or "
            "backs off too fast (one manager shared by two optimizers or builders, "
            "one LossScaleOptimizer used for two minimize calls, or a builder's "
            "per_group op fetched with its update_op)%s; update each manager once per "
            "session.run: fetch one of these step ops per run (alternating runs are "
            "fine), or add every optimizer to one MultiOptimizerLossScale and fetch "
            "its update_op, or give each optimizer its own manager if independent "
            "scales are meant."
            % (", ".join(variables), max(len(updates), 2), _some(list(updates), 4),
               _refused_note(context, variables)),
            tuple(variables) + updates))
    if shared:
        found.append(_shared_manager_note(context, shared))
    return found


def _refused_note(context, variables):
    """Says that the run fails at run time when the clashing writes follow
    one-step-per-run claims on one counter."""
    facts = context.facts
    writes = [w for v in variables for w in facts.mutations.get(v, ()) if w in context.run]
    if any(facts.claim_exclusive(a, b) for a, b in itertools.combinations(writes, 2)):
        return (" (these step ops claim the run, so such a session.run fails with an "
                "InvalidArgumentError, after one of them may have applied)")
    return ""


def _shared_manager_note(context, shared):
    """The one info finding for managers that several step ops update."""
    facts = context.facts
    parts, ops, refused = [], [], True
    for (updates, step_ops), variables in shared.items():
        parts.append("%s by %s" % (", ".join(variables), _some(list(step_ops), 6)))
        ops.extend(variables)
        ops.extend(step_ops)
        writes = [w for v in variables for w in facts.mutations.get(v, ())]
        refused = refused and all(
            facts.claim_exclusive(a, b) for a, b in itertools.combinations(writes, 2)
            if not context.model.exclusive(context.model.conditions(a),
                                           context.model.conditions(b)))
    what = ("the library refuses such a run at run time (InvalidArgumentError; one "
            "of them may have applied first)" if refused
            else "such a run updates the scale twice (NLS011 error with those fetches)")
    return Finding(
        "NLS011-double-scale-update", "info",
        "several step ops update one loss-scale manager (%s): that is right when each "
        "session.run fetches one of them, as an alternating GAN loop does, but never "
        "fetch two of them in one session.run: %s." % ("; ".join(parts), what),
        _sorted(ops))


def _step_ops(context, writes):
    """The ops a user fetches that run ``writes``: the nodes without
    consumers among the writes' dependents (all edges), leaving out reads
    of a variable (a manager reading its state back), sorted."""
    model = context.model
    consumers = _consumers(context)
    seen, stack, sinks = set(), list(writes), set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        after = consumers.get(name, ())
        if not after and not _reads_a_variable(model, name):
            sinks.add(_outermost(model, name))
        stack.extend(after)
    return tuple(sorted(sinks))


def _reads_a_variable(model, name):
    node = model.nodes[name]
    return node.type in _READ_TYPES and bool(node.inputs) and (
        model.nodes.get(node.inputs[0][0]) is not None
        and model.nodes[node.inputs[0][0]].type in _graph.VARIABLE_TYPES)


_READ_TYPES = frozenset(["ReadVariableOp", "Identity", "RefIdentity", "Snapshot"])


def _consumers(context):
    """dict node -> the nodes that wait for it (all edges), built once."""
    cached = getattr(context, "_consumer_map", None)
    if cached is None:
        cached = {}
        for name in context.model.nodes:
            for dep in context.model.all_deps(name):
                cached.setdefault(dep, []).append(name)
        context._consumer_map = cached  # pylint: disable=protected-access
    return cached


def _update_ops(context, writes):
    """Names for the manager updates that ``writes`` belong to, sorted.

    Writes of one update decide on the same overflow checks (the checks and
    flag variables their values and branch predicates derive from); each
    update is named by the longest name scope its writes share (a v1 cond's,
    or the outermost If/While/call node holding them), else its first write.
    """
    facts, model = context.facts, context.model
    groups = collections.OrderedDict()
    for write in sorted(writes):
        preds = [l.pred.rsplit(":", 1)[0] for l in model.conditions(write)
                 if l.kind == "cond"]
        seen = model.ancestors(facts.value_inputs(write) + preds, data_only=True)
        roots = frozenset(n for n in seen if n in facts.flag_vars or (
            model.nodes[n].type in _facts.CHECK_TYPES
            and _graph.SHIM_INTERNAL_SCOPE not in n.split("/")))
        groups.setdefault(roots, []).append(_outermost(model, write))
    names = []
    for members in groups.values():
        parts = [m.split("/") for m in members]
        common = []
        for level in zip(*parts):
            if len(set(level)) != 1:
                break
            common.append(level[0])
        names.append("/".join(common) if common else members[0])
    return tuple(sorted(set(names)))


def _outermost(model, write):
    """The graph op that runs a write: the outermost If/While/call node whose
    body holds it, else the write itself."""
    unit = write
    while model.nodes[unit].call is not None:
        unit = model.nodes[unit].call
    return unit


CHECKS = (check_status_race, check_untrained_variables, check_foreign_loss,
          check_collective_in_cond, check_ungated_updates, check_unsaved_scale,
          check_float16_master, check_independent_scales, check_ungated_accumulation,
          check_double_updates, check_double_scale_updates)


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
