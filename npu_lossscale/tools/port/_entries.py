"""The report: what the port says of each change, of what it leaves
alone, and of each point a person must decide beside the rewrite.

The functions return ``_edits.Told`` records; the rows of docs/port.md's
"What it leaves alone" and "Five items come with a rewrite" tables each
have one here, named after the rule (the refusals are ``_rules``').
"""

from __future__ import absolute_import, division, print_function

import libcst.matchers as _matchers

from npu_lossscale.tools.port import _engines, _managers, _names, _trace
from npu_lossscale.tools.port._edits import by_hand, changed, left_alone
from npu_lossscale.tools.port._find import last_name as _last_name
from npu_lossscale.tools.port._sections import (SECTION_DATA_PARALLEL, SECTION_GLOBAL_STEP,
                                                SECTION_GRAPH_REWRITE, SECTION_LSO,
                                                SECTION_MANAGERS, SECTION_NPU_INIT,
                                                SECTION_PER_GROUP_SCALES, SECTION_PORT,
                                                SECTION_PORTING,
                                                SECTION_SEQUENCE, SECTION_SYNC_REPLICAS,
                                                SECTION_UPDATE_OPS)

#: Calls between two ``minimize`` calls that read nothing a ``minimize``
#: makes (its variables are not trainable).
_NOT_READING_THE_GRAPH = frozenset(["tensorflow.trainable_variables", "print", "len"])

#: Methods of names' strings (``var.name.startswith("g")`` in a list of
#: variables): they read no graph.
_STRING_METHODS = frozenset(["startswith", "endswith", "split", "lower", "upper", "replace",
                             "format", "join", "strip"])


def _quote(group):
    """The group's builder name, quoted (see ``_generate.group_name``)."""
    return '"%s"' % (group.name.lstrip("_") or "group")


# -- what it leaves alone ------------------------------------------------------------

def npu_init_import(statement):
    """`from npu_bridge.npu_init import *` kept: on Ascend it hands the graph to the NPU."""
    return left_alone(statement, "npu-init-import",
                      "Kept `from npu_bridge.npu_init import *`: on Ascend it hands the "
                      "graph to the NPU. On a GPU or CPU drop it and import what the "
                      "script used from it yourself.", SECTION_NPU_INIT)


def already_ported(statement):
    """A script that imports npu_lossscale: nothing to port."""
    return left_alone(statement, "already-ported",
                      "The script already imports npu_lossscale: nothing to port.")


def update_ops_ungated(scanner, owner):
    """A ``tf.control_dependencies`` block the drop-in keeps around its minimize."""
    return left_alone(owner, "update-ops-ungated",
                      "The drop-in keeps tf.control_dependencies(%s) around the "
                      "minimize: those updates still run on skipped steps, as before. "
                      "To skip them too, port to MultiOptimizerLossScale with "
                      "build(update_ops=...)." % _trace.code(scanner, _trace.control_dependencies(
                          scanner, owner)), SECTION_UPDATE_OPS)


def manager_unused(call, origin):
    """An npu_bridge or contrib manager no rewritten wrapper uses."""
    return left_alone(call, "manager-unused",
                      "This %s's manager feeds no wrapper the tool rewrote, so it "
                      "stays as it is." % origin, SECTION_MANAGERS)


def unscaled_single(minimize):
    """One ``minimize`` and no loss scaling."""
    return left_alone(minimize.call, "unscaled-single",
                      "One minimize without loss scaling: nothing to port. For float16 "
                      "compute wrap its optimizer: nl.LossScaleOptimizer(opt, "
                      "nl.DynamicLossScaleManager()).", SECTION_LSO)


def branch_unscaled(scanner, arm):
    """A branch of a precision ``if/else`` that trains without loss scaling."""
    return left_alone(arm.block.body[0], "branch-unscaled",
                      "This branch of the if (line %d) trains without loss scaling "
                      "(the script's float32 or plain mode): it stays as it is, and "
                      "the branch that scales is ported." % scanner.line(arm.branch),
                      SECTION_PORTING)


def unscaled_beside(minimize):
    """A plain ``minimize`` beside the one wrapper of a drop-in."""
    return left_alone(minimize.call, "unscaled-beside",
                      "This minimize has no loss scaling and stays as it is. To scale "
                      "it too, port the script to one MultiOptimizerLossScale by "
                      "hand.", SECTION_PORTING)


def alternating_device_loop(top, train):
    """Per-group ops in a script that asks for a device loop."""
    return left_alone(
        top, "alternating-device-loop",
        "The script runs a device loop (iterations_per_loop), and only the op "
        "named IterationOp loops: the per_group ops cannot both loop. To loop the "
        "alternating steps, give each add() a loss callable (add(lambda: "
        "build_loss(), ...)) and pass build(sequence=[...]) with the groups in "
        "the order the loop runs them; fetch %s.update_op." % train, SECTION_SEQUENCE)


# -- the points to decide -------------------------------------------------------------

def between_minimizes(m, groups, between, tops):
    """The statements between the first and the last ``minimize`` that call
    what may read the graph: they ran after the first groups' train ops and
    optimizer variables were made, and now run before ``build()`` makes
    them all."""
    s = m.s
    first, last = s.line(groups[0].minimize.call), s.line(groups[-1].minimize.call)
    ours = set(id(t) for t in list(tops) + _trace.own_statements(groups)) | set(
        id(g.wrapper_statement) for g in groups if g.wrapper_statement is not None)
    found = []
    for statement in between:
        if id(statement) in ours:
            continue
        calls = _matchers.findall(statement, _matchers.Call())
        called = [s.call_name(call) or "" for call in calls]
        if all(name in _NOT_READING_THE_GRAPH or _names.is_tf_optimizer(name)
               or name in _names.WRAPPERS or name in _names.MANAGERS
               or _last_name(call) in _STRING_METHODS
               for name, call in zip(called, calls)):
            continue
        found.append(by_hand(
            statement, "between-minimizes",
            "This statement runs between the minimize calls (lines %d and %d). "
            "The builder makes every group's gradients, optimizer slots and train "
            "ops in build(), after line %d, so a Saver, an initializer or a list "
            "of global variables made here no longer holds them: move it after "
            "line %d if it needs them." % (first, last, last, last), SECTION_PORT))
    return found


def global_step_per_group(minimize):
    """With per-group ops, global_step advances once per applied group run."""
    return by_hand(minimize.global_step, "global-step-per-group",
                   "With per-group ops global_step advances on every applied group "
                   "run (here twice per iteration, not once). Check what reads it "
                   "(schedules, checkpoint names): count your own iterations, or "
                   "build(count_skipped_steps=True).", SECTION_GLOBAL_STEP)


def update_ops_not_atomic(scanner, owner):
    """A ``tf.control_dependencies`` block that stays around ``build()``."""
    ops = _trace.code(scanner, _trace.control_dependencies(scanner, owner))
    return by_hand(owner, "update-ops-not-atomic",
                   "tf.control_dependencies(%s) here stays around build() (the tool "
                   "lifts only a block that holds nothing but minimize calls): every "
                   "run, skipped ones too, runs those updates, so a skipped step still "
                   "changes them (batch-norm statistics): the skip is not atomic. To gate "
                   "them, move the block's other statements out of it (or the minimize "
                   "calls into a tf.control_dependencies(%s) of their own, side by side), "
                   "then run the tool again on the original script." % (ops, ops),
                   SECTION_UPDATE_OPS)


def graph_rewrite_session_config(wrapper):
    """Said once per module: one session config to change."""
    return by_hand(wrapper.call, "graph-rewrite-session-config",
                   "enable_mixed_precision_graph_rewrite also turned on grappler's "
                   "auto_mixed_precision for later sessions; the port keeps only its loss "
                   "scaling. Set config.graph_options.rewrite_options.auto_mixed_precision = "
                   "RewriterConfig.ON in the session config.", SECTION_GRAPH_REWRITE,
                   once="graph-rewrite-session-config")


# -- what changed ---------------------------------------------------------------------

def drop_in(alias, wrapper):
    """The one wrapper is the drop-in, ``LossScaleOptimizer``."""
    return changed(wrapper.call, "drop-in",
                   "%s is now %s.LossScaleOptimizer(...), the drop-in for one optimizer "
                   "(same optimizer, same manager arguments)."
                   % (_names.WRAPPER_TITLES[wrapper.kind], alias), SECTION_LSO)


def sync_replicas_mapped(alias, sync, inside):
    """TF's ``SyncReplicasOptimizer`` inside (ours) or around (kept) the drop-in."""
    return [changed(sync, "sync-replicas-mapped",
                    "%s; the drop-in passes count_skipped_steps=True: the workers' tokens "
                    "are global_step, and a skip that held it back would drop every later "
                    "push, the workers waiting forever." % (
                        "tf.train.SyncReplicasOptimizer inside the loss scaling is %s."
                        "SyncReplicasOptimizer, the same arguments (its chief applies "
                        "through the step's decision)" % alias if inside else
                        "tf.train.SyncReplicasOptimizer around the loss scaling stays"),
                    SECTION_SYNC_REPLICAS)]


def import_added(node, message):
    """The library's import, said once however many branches are ported."""
    return changed(node, "import-added", message, once="import-added")


def update_ops_lifted(owner, ops):
    """The ``tf.control_dependencies`` block around the if, gone from the branch that scales."""
    return changed(owner, "update-ops-lifted",
                   "with tf.control_dependencies(%s) around the if is gone from the branch "
                   "that scales: its build(update_ops=...) runs those updates on applied "
                   "steps only (with the wrappers they ran on skipped steps too); the other "
                   "branches keep the block around their lines." % ops.value,
                   SECTION_UPDATE_OPS)


def distributed_mapped(first, found, engine):
    """The builder's engine (``engine``: its arguments) from the wrappers'
    reductions (``found``, see ``_engines.engine``)."""
    if len(found) == 3:
        return [changed(first.top, "distributed-mapped",
                        "The wrappers were spelled under `if %s:` (%s), else (%s): the builder "
                        "takes %s, the test evaluated where the scaler is made, and sums the "
                        "overflow decision across devices when it reduces, so every device "
                        "applies or skips a step alike." % (
                            found[0], _engines.engine_words(found[1]),
                            _engines.engine_words(found[2]), ", ".join(engine)),
                        SECTION_DATA_PARALLEL)]
    if engine:
        return [changed(first.top, "distributed-mapped",
                        "The wrappers %s: the builder does it with %s, and sums the overflow "
                        "decision across devices, so every device applies or skips a step "
                        "alike." % (_engines.engine_words(found), ", ".join(engine)),
                        SECTION_DATA_PARALLEL)]
    return []


def update_ops_each_group(text, sharing):
    """Ops that several groups' ``minimize`` calls ran with go to each of them."""
    return changed(sharing[0].top, "update-ops-each-group",
                   "%s ran with each of %s's runs, skipped ones too; each of "
                   "their per-group steps now runs it when it applies. If each "
                   "network's statistics should move with its own runs only, "
                   "split them: build(..., update_ops={%s}) with each network's "
                   "ops (e.g. tf.get_collection(tf.GraphKeys.UPDATE_OPS, scope))."
                   % (text, ", ".join(g.name for g in sharing),
                      ", ".join("%s: ..." % _quote(g) for g in sharing)), SECTION_UPDATE_OPS)


def wrapper_removed(call, title, group, layers=None, text=None, kept=None):
    """A wrapper gone: inline in the ``minimize`` (nothing else given), with
    npu_bridge's ``layers`` around it (``text``: what it is now), its line
    gone (``kept``: the name that stays the optimizer), or its call
    replaced by the optimizer ``text``."""
    if layers is not None:
        message = ("%s and npu_bridge's %s around it are gone: %s is %s, and the builder "
                   "scales group %s." % (title, layers, group.optimizer, text, _quote(group)))
    elif kept is not None:
        message = ("This line (%s) is gone: %s stays the optimizer it was, and the builder "
                   "scales group %s." % (title, kept, _quote(group)))
    elif text is not None:
        message = ("%s is gone: %s is the optimizer it wrapped, and the builder scales "
                   "group %s." % (title, text, _quote(group)))
    else:
        message = "%s is gone: group %s gets the optimizer it wrapped." % (title, _quote(group))
    return changed(call, "wrapper-removed", message, SECTION_PORTING)


def spelling_removed(statement, title, said, group):
    """The if/else of a wrapper's two spellings gone."""
    return changed(statement, "wrapper-removed",
                   "This if/else (%s, spelled two ways) is gone: %s, and the builder scales "
                   "group %s, its engine following the test." % (title, said, _quote(group)),
                   SECTION_PORTING)


def constructor_moved(statement, manager):
    """A constructor that moves above its ``tf.control_dependencies`` block."""
    return changed(statement, "constructor-moved",
                   "This line moves above its tf.control_dependencies block, with the "
                   "builder: %s" % (
                       "a manager's variables' initializers no longer wait for the "
                       "block's updates (inside it, running the initializer ran those "
                       "updates and needed their feeds)." if manager else
                       "making an optimizer or a wrapper, or reading the graph's "
                       "collections, makes no op that the block orders."), SECTION_UPDATE_OPS)


def group_changes(scanner, group, scaler, per_group):
    """What changed of one group's ``minimize``."""
    minimize = group.minimize
    receiver = _trace.code(scanner, minimize.receiver)
    if minimize.compute is None:
        found = [changed(minimize.call, "minimize-to-add",
                         "%s = %s.minimize(...) is %s.add(..., name=%s): the same loss, "
                         "optimizer and var_list." % (group.name, receiver, scaler,
                                                      _quote(group)), SECTION_PORTING)]
    else:
        grads = _trace.code(scanner, minimize.compute.body[0].targets[0].target)
        found = [changed(minimize.compute, "compute-apply-to-add",
                         "%s = %s.compute_gradients(...), then %s = %s.apply_gradients(%s) "
                         "with nothing done to %s between them, is minimize in two calls: "
                         "%s.add(..., name=%s), the same loss, optimizer and var_list."
                         % (grads, receiver, group.name, receiver, grads, grads, scaler,
                            _quote(group)), SECTION_PORTING)]
    if minimize.name is not None:
        found.append(changed(minimize.name, "op-name-dropped",
                             "The op name %s is gone: the builder names its ops under "
                             "loss_scale/." % _trace.code(scanner, minimize.name),
                             SECTION_PORTING))
    if minimize.global_step is not None:
        found.append(changed(minimize.global_step, "global-step-to-build",
                             "global_step moves to build(global_step=...): it advances once "
                             "per applied step, never on a skipped one.", SECTION_GLOBAL_STEP))
        if per_group:
            found.append(global_step_per_group(minimize))
    if group.after:
        found.append(changed(group.top, "train-ops-chained", train_ops_chained(
            scanner, group), SECTION_PORT))
    if group.update_ops is not None:
        found.append(changed(group.top, "update-ops-gated",
                             "with tf.control_dependencies(%s) around %s's minimize is build("
                             "update_ops=...): those updates now run only on applied steps, "
                             "never on skipped ones (with the wrappers they ran on skipped "
                             "steps too: batch-norm statistics no longer take a skipped "
                             "step's batch)." % (_trace.code(scanner, group.update_ops),
                                                 group.name), SECTION_UPDATE_OPS))
    return found


def train_ops_chained(scanner, group):
    """What changes where a group's lines were built inside ``with
    tf.control_dependencies([d_train]):`` (``_checks.chains``)."""
    before = ", ".join(r.value for r in group.after)
    return ("with tf.control_dependencies(%s) around %s's lines goes: the joint step runs %s "
            "and %s together, one overflow check for both. What changes: %s's gradients no "
            "longer wait for %s's update, and both come from the same forward pass (the "
            "script's gradients read that pass's tensors too, its ops built outside the "
            "block); the two updates are one step that applies or skips as one, where each "
            "wrapper skipped on its own overflow alone." % (
                _trace.code(scanner, _trace.control_dependencies(scanner, group.top)),
                group.name, before, group.name, group.name, before))


def builder_changes(m, groups, scaler, train, per_group, lifted_nodes):
    """What the builder changed of the groups together (``lifted_nodes``:
    the ``tf.control_dependencies`` blocks the module's builders lift)."""
    s, names, first = m.s, ", ".join(g.name for g in groups), groups[0]
    around = [o for o in _trace.dependencies_around(s, first.top) if o not in lifted_nodes]
    found = [changed(first.top, "builder",
                     "One %s.MultiOptimizerLossScale (%s) for the %d optimizers (%s): one "
                     "overflow check per step, and every group applies or none does%s."
                     % (m.alias, scaler, len(groups), names,
                        "; the updates of the tf.control_dependencies block around it (line "
                        "%d) run on skipped steps too, as before (by hand: "
                        "update-ops-not-atomic)" % s.line(around[0]) if around else ""),
                     SECTION_PORTING)]
    shares = [g is first or (g.manager.key is not None and g.manager.key == first.manager.key)
              for g in groups]
    own = [g for g, shared in zip(groups, shares) if not shared]
    if own:
        found.append(changed(first.top, "manager-per-group",
                             "Each of %s keeps its own manager and scale, as with its own "
                             "wrapper (add(..., loss_scale_manager=...)); the skip decision "
                             "is shared. Pass one manager to share one scale." % ", ".join(
                                 g.name for g in [first] + own), SECTION_PER_GROUP_SCALES))
    sharing = [g for g, shared in zip(groups, shares) if shared]
    if not per_group and len(sharing) > 1 and first.wrapper is not None:
        found.append(changed(first.top, "manager-once-per-step",
                             "%s shared one manager, and each wrapper updated it in the runs "
                             "that fetched them together (%d updates a run); the builder "
                             "updates it once a step, so its growth and decrease periods "
                             "count steps now, not minimize calls."
                             % (", ".join(g.name for g in sharing), len(sharing)),
                             SECTION_PER_GROUP_SCALES))
    if per_group:
        message = ("%s: each is now %s.per_group[name], its group's step: the script's "
                   "session.run calls fetch one train op each, so they run unchanged."
                   % (names, train))
        text = s.code(s.module)
        if "iterations_per_loop" in text or "set_iteration_per_loop" in text:
            found.append(alternating_device_loop(first.top, train))
    else:
        message = ("%s: each is now %s.update_op, the one step for all groups: the "
                   "session.run calls that fetched them together run it once, their lists "
                   "and dicts unchanged." % (names, train))
    found.append(changed(groups[-1].top, "train-ops-bound", message, SECTION_PORTING))
    if not groups[0].wrapper:
        found.append(changed(first.top, "scaling-added",
                             "The script had no loss scaling: the builder adds a dynamic scale "
                             "(%s.%s: 2**15, x2 every 2000 finite steps) and skips overflowing "
                             "steps. With float32 compute, pass %s.FixedLossScaleManager(1) "
                             "instead." % (m.alias, _managers.UNSCALED_MANAGER, m.alias),
                             SECTION_MANAGERS))
    return found
