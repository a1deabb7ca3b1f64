"""The checks on train updates and their gates: NLS002 (untrained
variables), NLS003 (foreign loss), NLS005 (updates the gate does not hold),
NLS009 (accumulated gradients applied outside a window-wide gate), NLS010
(a variable updated twice in one step), NLS013 (one optimizer's own state
advanced by two steps).
"""

from __future__ import absolute_import, division, print_function

import collections
import itertools

from npu_lossscale.core import graph_walk
from npu_lossscale.audit import _conditions
from npu_lossscale.audit import _graph
from npu_lossscale.audit._findings import Finding, _if_run_together, _some, _sorted

__all__ = ["check_double_updates", "check_foreign_loss", "check_shared_optimizer_state",
           "check_ungated_accumulation", "check_ungated_updates",
           "check_untrained_variables"]


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


# -- NLS005 ----------------------------------------------------------------------

#: Why an ungated write runs on skipped steps (``check_ungated_updates``):
#: a forward-pass op waits for it (batch norm with updates_collections=None),
#: the step's own ops wait for it (control_dependencies around the step), or
#: it runs beside the gate.
_IN_PLACE, _AROUND_STEP, _BESIDE = "in_place", "around_step", "beside"


def check_ungated_updates(context):
    """Writes that run on skipped steps, in a run that has a loss-scale gate.

    An error when the written value comes from this step's float16 forward
    pass; a warning for a float32 one that belongs to (or feeds) UPDATE_OPS
    or that the step waits for. Each finding names the cause (``_cause``):
    writes inside the forward pass (batch norm built with
    ``updates_collections=None``), whose fix is to build the layer with
    UPDATE_OPS; writes the step's own ops wait for
    (``tf.control_dependencies(UPDATE_OPS)`` around ``minimize`` or
    ``build``), whose fix is ``build(update_ops=...)`` without the
    control_dependencies; writes beside the gate. Ungated writes that a
    gated op stands for (``graph_walk``: a ``tf.print``, ``check_numerics``
    or ``tf.tuple`` around them, which the gate holds instead of them) are
    an error of their own.
    """
    facts = context.facts
    gated = [op for op in context.train_updates() if facts.gates(op)]
    if not gated:
        return []
    update_ops = _update_ops_writes(context)
    wrapped = _wrapped_writes(context)
    cause = _cause(context, gated, update_ops)
    groups = collections.OrderedDict(
        ((severity, kind), []) for severity in ("error", "warning")
        for kind in (_IN_PLACE, _AROUND_STEP, _BESIDE))
    behind = []
    for op, var in sorted(facts.target.items()):
        if op not in context.run or facts.gates(op) or op in facts.once:
            continue
        if (var in facts.scale_state or var in facts.flag_vars or var in facts.accumulators
                or var in context.model.collections.local):
            continue
        kind = cause(op)
        if op in wrapped and kind == _BESIDE:
            behind.append(op)
        elif facts.forward_value(op):
            groups[("error", kind)].append(op)
        elif op in update_ops or kind != _BESIDE:
            groups[("warning", kind)].append(op)
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
    for (severity, kind), ops in groups.items():
        if not ops:
            continue
        why = ("from this step's float16 forward pass" if severity == "error"
               else "from UPDATE_OPS" if update_ops.issuperset(ops)
               else "of float32 values")
        if kind == _IN_PLACE:
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
        elif kind == _AROUND_STEP:
            message = (
                "%d variable update(s) %s (%s) are control inputs of the step's own "
                "ops (tf.control_dependencies(tf.get_collection(tf.GraphKeys."
                "UPDATE_OPS)) around minimize() or build() makes them so), so every "
                "step runs them, skipped (overflowing) ones too, writing values that "
                "can be inf or NaN (batch-norm statistics stay broken for good); drop "
                "that control_dependencies and pass the ops to MultiOptimizerLossScale"
                ".build(update_ops=...), which runs them on applied steps only."
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


def _cause(context, gated, update_ops):
    """A function telling why an ungated write runs on skipped steps.

    ``_IN_PLACE`` when a value of the forward pass waits for it (any edge):
    a data ancestor of a loss whose value does not derive from the loss
    scale (so not the scaled loss or the scale's read), and the write is not
    in UPDATE_OPS (batch norm built with updates_collections=None keeps its
    updates out of it). ``_AROUND_STEP`` when, otherwise, a gated train
    update or a loss waits for it: control edges from it to the step's own
    ops, which ``tf.control_dependencies`` around ``minimize`` or ``build``
    makes. ``_BESIDE`` else.
    """
    facts, model = context.facts, context.model
    losses = set(facts.seeds.values())
    scaled = facts.derived_from(facts.scale_state)
    forward = [n for n in model.ancestors(losses, data_only=True) if n not in scaled]
    in_forward = model.ancestors(forward)
    step_waits = model.ancestors(list(gated) + sorted(losses))

    def cause(op):
        if op in in_forward and op not in update_ops:
            return _IN_PLACE
        if op in step_waits:
            return _AROUND_STEP
        return _BESIDE
    return cause


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
                and node_type not in graph_walk.SWITCH_TYPES):
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
    preds = [_conditions.pred_node(l) for l in gates]
    seen = model.ancestors(preds, data_only=True)
    if seen & (facts.flag_vars | accumulators):
        return True
    writes = [m for a in accumulators for m in facts.mutations.get(a, ())]
    return bool(writes) and all(facts.gates(m) for m in writes)


# -- NLS010 ----------------------------------------------------------------------

def check_double_updates(context):
    """Variables (and global_step) written by more than one train op in a run,
    where neither write follows the other (a sequence's sub-steps update one
    after another, as separate runs would)."""
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
            if context.co_runnable(first, second) and not context.ordered(first, second):
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


# -- NLS013 ----------------------------------------------------------------------

#: One write of an optimizer's own state: the write and the variables of the
#: optimizer applies it follows (the variables its step trains).
_StateWrite = collections.namedtuple("_StateWrite", ["write", "trains"])


def check_shared_optimizer_state(context):
    """An optimizer's own state advanced by steps that train different variables.

    Optimizer state that is no variable's slot, such as Adam's
    ``beta1_power`` and ``beta2_power``, is one per optimizer object: each
    ``apply_gradients`` reads it in its apply ops and advances it once,
    after them. Two writes of one such variable that follow applies of
    different variables come from one optimizer object used by two steps
    (two builders, a builder and a ``minimize``, two ``minimize`` calls).
    The builder refuses one optimizer in two groups of one builder; across
    steps only the graph shows it.

    An error when both writes can run in the fetched run (the state advances
    twice per step); a warning otherwise: each run of either step advances
    the state for both, so each network's bias correction counts the other
    network's steps too. Writes that follow applies of the same variables
    (a builder's ``update_op`` and its ``per_group`` op of that group) are
    alternatives for one network, not reported.
    """
    facts, model = context.facts, context.model
    applies = set(op for op in facts.train_updates
                  if _graph.is_optimizer_apply(model.nodes[op].type))
    if not applies:
        return []
    skip = facts.trainable.union(facts.scale_state, facts.flag_vars, facts.accumulators,
                                 facts.bookkeeping, model.collections.local)
    found = collections.OrderedDict()  # (step ops, clashing) -> [variable]
    for var in sorted(facts.mutations):
        writes = facts.mutations[var]
        if var in skip or len(writes) < 2 or facts.is_global_step(var):
            continue
        readers = applies & facts.derived_from([var])
        if not readers:
            continue
        state = []
        for write in sorted(writes):
            trains = frozenset(facts.target[a] for a in model.ancestors([write]) & readers)
            if trains:
                state.append(_StateWrite(write, trains))
        shared, clashing = set(), False
        for first, second in itertools.combinations(state, 2):
            if first.trains & second.trains:
                continue
            shared |= set([first, second])
            clashing = clashing or (
                context.fetched and first.write in context.run and second.write in context.run
                and context.co_runnable(first.write, second.write))
        if shared:
            key = (tuple((context.step_ops([s.write]), tuple(sorted(s.trains)))
                         for s in sorted(shared)), clashing)
            found.setdefault(key, []).append(var)
    return [_finding(steps, clashing, variables)
            for (steps, clashing), variables in found.items()]


def _finding(steps, clashing, variables):
    """The NLS013 finding for ``variables`` advanced by ``steps``: (step
    ops, variables trained) pairs."""
    names = _sorted(op for ops, _ in steps for op in ops)
    trained = "; ".join("%s trains %s" % (_some(list(ops), 2), _some(list(trains), 3))
                        for ops, trains in steps)
    if clashing:
        what = ("advances %d times in one step (%s), once per step op, so Adam's bias "
                "correction runs ahead for both networks" % (len(steps), trained))
    else:
        what = ("advances on every run of each of %d step ops (%s), so each network's "
                "Adam bias correction also counts the other network's steps"
                % (len(steps), trained))
    return Finding(
        "NLS013-shared-optimizer", "error" if clashing else "warning",
        "the optimizer state %s %s: one optimizer object is used by two builders, a "
        "builder and a minimize, or two minimize calls; give each its own optimizer "
        "object (e.g. a tf.train.AdamOptimizer per network)."
        % (", ".join(variables), what),
        tuple(variables) + names)
