"""The checks on loss-scale state: NLS006 (state a Saver leaves out),
NLS008 (independent scales in one step), NLS011 (one manager's state updated
more than once in one step).
"""

from __future__ import absolute_import, division, print_function

import collections
import itertools

from npu_lossscale.core import graph_walk
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
    # Local variables, and variables no collection holds (the library's
    # last-skip record: bookkeeping of one session that no default Saver
    # saves), are not what a checkpoint should carry.
    uncollected = (facts.variables - model.collections.collected
                   if model.collections.collected else set())
    state = (facts.scale_state.union(facts.flag_vars, facts.accumulators)
             - model.collections.local - uncollected)
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
                            - model.collections.local - uncollected
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
    sinks = set()
    for name in graph_walk.depth_first(writes, lambda name: consumers.get(name, ())):
        if not consumers.get(name) and not _reads_a_variable(model, name):
            sinks.add(_outermost(model, name))
    return tuple(sorted(sinks))


def _reads_a_variable(model, name):
    node = model.nodes[name]
    return node.type in _READ_TYPES and bool(node.inputs) and (
        model.nodes.get(node.inputs[0][0]) is not None
        and model.nodes[node.inputs[0][0]].type in _graph.VARIABLE_TYPES)


_READ_TYPES = graph_walk.IDENTITY_TYPES | frozenset(["ReadVariableOp"])


def _consumers(context):
    """dict node -> the nodes that wait for it (all edges), built once."""
    cached = getattr(context, "_consumer_map", None)
    if cached is None:
        cached = graph_walk.children(context.model.nodes, context.model.all_deps)
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
