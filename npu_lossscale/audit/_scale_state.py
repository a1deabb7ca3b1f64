"""The checks on loss-scale state: NLS006 (state a Saver leaves out),
NLS008 (independent scales in one step), NLS011 (one manager's state updated
more than once in one step).
"""

from __future__ import absolute_import, division, print_function

import collections
import itertools

from npu_lossscale.audit import _conditions
from npu_lossscale.audit import _facts
from npu_lossscale.audit import _graph
from npu_lossscale.audit._findings import Finding, _some, _sorted

__all__ = ["check_double_scale_updates", "check_independent_scales",
           "check_unsaved_scale"]


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
    # Local variables, variables no collection holds, and the session's
    # bookkeeping (the claims' tables, the last-skip record: in no collection
    # by design, which a bare GraphDef does not say) are not what a
    # checkpoint should carry.
    uncollected = (facts.variables - model.collections.collected
                   if model.collections.collected else set())
    unsaved = model.collections.local | uncollected | facts.bookkeeping
    state = facts.scale_state.union(facts.flag_vars, facts.accumulators) - unsaved
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
            others = sorted(v for v in facts.variables - saver.saved - state - unsaved
                            if model.position(v) > made)
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
                if scale in facts.scaled_by(loss):
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


# -- NLS011 ----------------------------------------------------------------------

#: One manager's state updated by several update ops: the state variables,
#: the names of the updates, and the step ops a user fetches that run them.
SharedState = collections.namedtuple("SharedState", ["variables", "updates", "step_ops"])


def check_double_scale_updates(context):
    """A manager's state written by several update ops.

    One update of a manager writes a state variable once per run, or in
    branches that exclude each other (grow or count, back off or count), or
    in a sequence where each write follows the one before (the listening
    manager's dynamic rule, then its correction); all its writes decide on
    the same overflow checks. Writes of one state variable that decide on
    different checks, or that neither exclude nor follow each other, come
    from two updates of the same manager: one manager shared by two
    optimizers or builders, one LossScaleOptimizer used for two minimize
    calls, a builder's update_op and per_group ops (``_updates``); writes of
    two updates of which one follows the other are a sequence's sub-steps
    (``build(sequence=...)``), each a step of its own.

    An error when the fetched run holds two updates that can run together
    (the scale would move twice per run); otherwise, when the graph holds
    several, one info naming the step ops that must not be fetched together
    (fine in separate session.runs, as alternating GAN loops run them).
    """
    facts = context.facts
    clashes = collections.OrderedDict()  # update-op names -> state variables
    shared = collections.OrderedDict()   # SharedState key -> state variables
    for var in sorted(facts.scale_state):
        # A write behind a latch runs once (the measured first scale), not
        # as a second update per step.
        every = sorted(w for w in facts.mutations.get(var, ()) if w not in facts.once)
        updates = _updates(context, every)
        update_of = dict((write, index) for index, update in enumerate(updates)
                         for write in update.writes)
        writes = [w for w in every if w in context.run]
        clashing = set()
        for first, second in itertools.combinations(writes, 2):
            if (update_of[first] != update_of[second] and context.co_runnable(first, second)
                    and not context.ordered(first, second)):
                clashing |= set([first, second])
        if clashing and context.fetched:
            both = [u for u in updates if set(u.writes) & clashing]
            clashes.setdefault((_sorted(u.name for u in both), len(both)), []).append(var)
            continue
        if len(updates) > 1 and not all(
                context.ordered(first.writes[0], second.writes[0])
                for first, second in itertools.combinations(updates, 2)):
            names = _sorted(u.name for u in updates)
            shared.setdefault((names, context.step_ops(every)), []).append(var)
    found = []
    for (updates, count), variables in clashes.items():
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
            % (", ".join(variables), count, _some(list(updates), 4),
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


#: One update of a manager: its name and its writes of one state variable.
Update = collections.namedtuple("Update", ["name", "writes"])


def _updates(context, writes):
    """The manager updates that ``writes`` (of one state variable) belong to,
    as ``Update`` records sorted by name.

    Two writes belong to one update when they decide on the same overflow
    checks (the checks and flag variables their values and branch
    predicates derive from) and either exclude each other (their branch
    conditions contradict) or follow each other (one waits for the other,
    any edge). Each update is named by the longest name scope its writes
    share (a v1 cond's, or the outermost If/While/call node holding them),
    else (or when another update has that name) its first write.
    """
    facts, model = context.facts, context.model
    roots, before = {}, {}
    for write in writes:
        preds = [_conditions.pred_node(l) for l in model.conditions(write)
                 if l.kind == "cond"]
        seen = model.ancestors(facts.value_inputs(write) + preds, data_only=True)
        roots[write] = frozenset(n for n in seen if n in facts.flag_vars or (
            model.nodes[n].type in _facts.CHECK_TYPES
            and not _graph.is_shim_internal(n)))
        before[write] = model.ancestors([write])
    groups = []  # lists of writes, merged as they join
    for write in sorted(writes):
        joined = [group for group in groups if any(
            roots[other] == roots[write] and (
                other in before[write] or write in before[other]
                or model.exclusive(model.conditions(other), model.conditions(write)))
            for other in group)]
        merged = [write]
        for group in joined:
            merged.extend(group)
            groups.remove(group)
        groups.append(sorted(merged))
    names = []
    for members in groups:
        units = [model.outermost(m) for m in members]
        common = []
        for level in zip(*[unit.split("/") for unit in units]):
            if len(set(level)) != 1:
                break
            common.append(level[0])
        names.append(("/".join(common) if common else units[0], units[0]))
    scopes = [scope for scope, _ in names]
    return sorted(Update(scope if scopes.count(scope) == 1 else first, tuple(members))
                  for (scope, first), members in zip(names, groups))
