"""The refusal rules: one function per row of docs/port.md's "What it
leaves to you" table, in its order, named after the row's rule.

Each takes the facts its row needs and returns ``_edits.Refused``s (none when
the row does not apply): what the script does, and the edit that lets the
tool go on."""

from __future__ import absolute_import, division, print_function

import libcst as cst

from npu_lossscale.tools.port import _names
from npu_lossscale.tools.port._edits import by_hand, refuse
from npu_lossscale.tools.port._sections import (SECTION_BUILDER, SECTION_DATA_PARALLEL,
                                                SECTION_GLOBAL_STEP, SECTION_LSO,
                                                SECTION_MANAGERS, SECTION_PORT, SECTION_PORTING,
                                                SECTION_UPDATE_OPS)


def _code(scanner, node):
    return scanner.code(node).strip()


def _title(wrapper):
    return _names.WRAPPER_TITLES[wrapper.kind]


def built_in_loop(wrapper=None, minimize=None, function=False):
    """A ``minimize`` (or a wrapper) in a loop or comprehension, or a wrapper
    in a function that may run more than once (``function``)."""
    if minimize is not None:
        return [refuse(minimize.call, "built-in-loop",
                       "This minimize runs in a loop or comprehension: the tool cannot tell "
                       "the optimizers apart. Unroll it (one optimizer and one minimize per "
                       "network, side by side), then run the tool again, or write one "
                       "scaler.add() per optimizer by hand.", SECTION_PORT)]
    if function:
        return [refuse(wrapper.call, "built-in-loop",
                       "This %s is built in a function that may run more than once (called "
                       "from several places or from a loop): the tool cannot tell the "
                       "optimizers apart. Make each network's wrapper where it is minimized, "
                       "side by side, then run the tool again, or write one scaler.add() per "
                       "optimizer by hand." % _title(wrapper), SECTION_PORT)]
    return [refuse(wrapper.call, "built-in-loop",
                   "This %s is built in a loop or comprehension: the tool cannot tell the "
                   "optimizers apart. Unroll it (one wrapper per network, side by side), "
                   "then run the tool again, or write one scaler.add() per optimizer by "
                   "hand." % _title(wrapper), SECTION_PORT)]


def optimizer_through_function(scanner, wrapper, call=None):
    """The drop-in's wrapper handed to ``call``, a function of the script, or
    (``call`` None) a wrapper made in a function and handed on."""
    if call is not None:
        return [refuse(call, "optimizer-through-function",
                       "This %s is handed to %s(), a function of this script, where the tool "
                       "cannot count its minimize calls: port it by hand (one "
                       "nl.LossScaleOptimizer minimized once per step)."
                       % (_title(wrapper), _code(scanner, call.func)), SECTION_PORT)]
    return [refuse(wrapper.call, "optimizer-through-function",
                   "This %s is made in function %s() and handed on: the tool cannot "
                   "follow it. Make it where it is minimized (inline the function), then "
                   "run the tool again, or write one scaler.add() per optimizer by hand."
                   % (_title(wrapper), scanner.function_of(wrapper.call).name.value),
                   SECTION_PORT)]


def optimizer_unfollowed(scanner, minimize, branch=None):
    """A ``minimize`` on an optimizer the tool cannot trace to one
    assignment; ``branch`` is the statement in an if's branch that binds it,
    when there is one."""
    if branch is not None:
        return [refuse(minimize.call, "optimizer-unfollowed",
                       "%s is bound in a branch of an if (line %d), so which optimizer this "
                       "minimize gets depends on the test: move the minimize calls into each "
                       "branch (a precision if/else is ported branch by branch: loss scaling "
                       "in one, plain minimize calls in the other), then run the tool again."
                       % (_code(scanner, minimize.receiver), scanner.line(branch)),
                       SECTION_PORT)]
    return [refuse(minimize.call, "optimizer-unfollowed",
                   "The tool cannot tell which optimizer %s is: built in another function, "
                   "a loop, a branch, or passed in. Bind it once (name = "
                   "tf.train.AdamOptimizer(...), then name = NPULossScaleOptimizer(name, m) if "
                   "it is scaled) in this block or one around it, before this line, then run "
                   "the tool again; or write one scaler.add() per optimizer by hand."
                   % _code(scanner, minimize.receiver), SECTION_PORT)]


def wrapper_unfollowed(wrapper, dropped=False):
    """A wrapper no ``minimize`` uses, or (``dropped``) whose result the
    script drops."""
    if dropped:
        return [refuse(wrapper.call, "wrapper-unfollowed",
                       "The result of this %s call is dropped: assign it (opt = ...) and "
                       "minimize that, then run the tool again, or port it by hand."
                       % _title(wrapper), SECTION_PORT)]
    return [refuse(wrapper.call, "wrapper-unfollowed",
                   "The tool cannot find the minimize of this %s: minimize it in this "
                   "file, in the block where it is made, then run the tool again, or write "
                   "one scaler.add() per optimizer by hand." % _title(wrapper), SECTION_PORT)]


def wrapper_on_object(wrapper, where, kept):
    """A wrapper built ``where`` (in a class) or ``kept`` (in an object's
    attribute or item): the tool cannot count the objects made nor follow
    the ``minimize`` calls made through them (``_trace.on_object``)."""
    return [refuse(wrapper.call, "wrapper-on-object",
                   "This %s is built %s: the tool cannot count the objects made nor follow "
                   "the minimize calls made through them. Port it by hand: "
                   "nl.LossScaleOptimizer(opt, manager) in its place is the drop-in when each "
                   "object is minimized once per step; for several optimizers, one "
                   "nl.MultiOptimizerLossScale." % (_title(wrapper), " and ".join(
                       w for w in (where, kept) if w)), SECTION_PORT)]


def optimizer_used_elsewhere(name, reference):
    """The optimizer's ``name`` read at ``reference`` besides its ``minimize``."""
    return [refuse(reference, "optimizer-used-elsewhere",
                   "%s is also used here, where the tool cannot follow it: read the "
                   "optimizer only in its minimize (bind the inner optimizer to a name of "
                   "its own for other uses), then run the tool again, or port it by hand."
                   % name, SECTION_PORT)]


def optimizer_reused(scanner, minimizes=(), name=None, reference=None, sharing=()):
    """One optimizer object minimized more than once: the drop-in's wrapper
    in ``minimizes``; ``name`` minimized again at ``reference``; or ``name``
    wrapped for each of the ``sharing`` groups."""
    if reference is not None:
        return [refuse(reference, "optimizer-reused",
                       "%s is minimized again here: one optimizer object for two minimize "
                       "calls (its Adam beta powers advance once per call; ModelZoo "
                       "BicycleGAN). Give each minimize its own optimizer, then run the tool "
                       "again." % name, SECTION_PORT)]
    if sharing:
        return [refuse(group.wrapper.call, "optimizer-reused",
                       "%s is wrapped for %d minimize calls (%s): one optimizer object "
                       "whose Adam beta powers advance once per call (ModelZoo "
                       "BicycleGAN). Give each minimize its own optimizer, then run "
                       "the tool again."
                       % (name, len(sharing), ", ".join(g.name for g in sharing)),
                       SECTION_PORT) for group in sharing]
    lines = ", ".join(str(scanner.line(m.call)) for m in minimizes)
    return [refuse(minimize.call, "optimizer-reused",
                   "One optimizer object is minimized %d times (lines %s): its Adam beta "
                   "powers advance once per call (ModelZoo BicycleGAN). Give each minimize "
                   "its own optimizer, then run the tool again."
                   % (len(minimizes), lines), SECTION_PORT) for minimize in minimizes]


def compute_apply_gradients(node, name):
    """``name`` computes and applies its gradients with more between."""
    return [refuse(node, "compute-apply-gradients",
                   "%s computes and applies gradients itself, with more than the next line "
                   "between: write scaler.add(loss, optimizer, var_list=..., transform_grads_fn="
                   "f), f doing the edits between the two calls (if none, apply on the line "
                   "after compute_gradients and run the tool again)." % name, SECTION_BUILDER)]


def train_op_dependency(scanner, group, node, statement=None, fetch=False):
    """A ``tf.control_dependencies`` (``node``) ordering ``group`` after train ops
    and more, around a ``statement``, or (``fetch``) where a group runs alone."""
    where = "with tf.control_dependencies(...) at line %d" % scanner.line(group.top)
    message = ("This line is built inside %s, after the other step; the builder makes every "
               "group's gradients from one forward pass before any applies. Move it above the "
               "with block" % where if statement is not None else "%s orders %s after a train "
               "op: the tool makes one step of a block that names earlier groups' train ops "
               "alone, all groups fetched together. %s" % (where, group.name, "Fetch the groups "
                                                           "in the same runs" if fetch else
                                                           "Name only train ops in it"))
    return [refuse(statement or node, "train-op-dependency", message + ", then run the tool "
                   "again.", SECTION_PORT, once=("train-op-dependency", scanner.line(
                       statement or node)))]


def train_op_unfollowed(minimize):
    """A ``minimize`` whose result is not assigned to a plain name."""
    return [refuse(minimize.call, "train-op-unfollowed",
                   "This minimize's train op is not assigned to a plain name, so the "
                   "tool cannot follow its fetches: assign it (name = opt.minimize(...)) "
                   "and fetch that name, then run the tool again.")]


def train_op_rebound(scanner, group, stray=None, before=None):
    """A group's train op name bound twice, or (``stray``) read between its
    optimizer's assignment (``before``) and its train op's."""
    if stray is not None:
        return [refuse(stray, "train-op-rebound",
                       "%s is read here between the optimizer it holds (line %d) and the train "
                       "op it is bound to (line %d): the tool cannot tell which one this read "
                       "wants. Give the optimizer a name of its own (e.g. %s_opt), then run the "
                       "tool again." % (group.name, scanner.line(before.node),
                                        scanner.line(group.statement), group.name),
                       SECTION_PORT)]
    return [refuse(group.minimize.call, "train-op-rebound",
                   "%s is assigned more than once: the tool cannot tell which value each "
                   "session.run fetches. Give the train op a name no other line binds, then "
                   "run the tool again." % group.name)]


def constructor_unmovable(scanner, statement, argument=None, clash=None, names=()):
    """A constructor in a ``tf.control_dependencies`` block that takes
    ``argument``, which may make ops, or that would move past ``clash``,
    which reads or binds ``names`` it binds or reads."""
    if argument is not None:
        return [refuse(statement, "constructor-unmovable",
                       "This constructor inside the tf.control_dependencies block takes %s, "
                       "which may make ops that the block orders after its updates: the tool "
                       "will not move it above the block. Compute it above the block (e.g. lr "
                       "= ...), then run the tool again." % argument, SECTION_UPDATE_OPS)]
    return [refuse(statement, "constructor-unmovable",
                   "This constructor would move above the tf.control_dependencies block, past "
                   "line %d, which reads or binds a name it binds or reads (%s): give that "
                   "name one meaning in the block, then run the tool again." % (
                       scanner.line(clash), ", ".join(sorted(names))), SECTION_UPDATE_OPS)]


def fetch_unmapped(reference, name, last=None, outside=False, scoped=False, site=None,
                   fetched=(), names=()):
    """A train op (``name``) read before the last ``minimize`` (line
    ``last``), outside a fetch (``outside``), inside a name scope of the
    port (``scoped``); or a run (``site``) that fetches some train ops
    (``fetched``) of ``names`` but not all."""
    if site is not None:
        return [refuse(site, "fetch-unmapped",
                       "This session.run fetches %s but not %s: neither one step for all "
                       "groups nor one group's step. Fetch every train op in one run, or "
                       "one per run, then run the tool again." % (
                           ", ".join(sorted(fetched)), ", ".join(sorted(names - fetched))),
                       SECTION_PORT)]
    if scoped:
        return [refuse(reference, "fetch-unmapped",
                       "%s is read here, inside the tf.name_scope block, before build() "
                       "(which goes after the block): move this line after the block, then "
                       "run the tool again." % name, SECTION_PORT)]
    if outside:
        return [refuse(reference, "fetch-unmapped",
                       "%s is used here outside a session.run fetch (a list, a function, a "
                       "control dependency): the tool cannot map it to a builder op. Fetch it "
                       "in session.run (or group every train op in one tf.group), then run "
                       "the tool again." % name, SECTION_PORT)]
    return [refuse(reference, "fetch-unmapped",
                   "%s is read here, before the last minimize (line %d), where build() makes "
                   "the train ops: move this line after it, then run the tool again." % (
                       name, last), SECTION_PORT)]


def fetch_mixed(joint, single):
    """Runs that fetch every train op (``joint``) beside runs that fetch one
    (``single``)."""
    if not (joint and single):
        return []
    return [refuse(site, "fetch-mixed",
                   "Some session.run calls fetch every train op and others one: fetch them the "
                   "same way in every run (all together, or one per run), then run the tool "
                   "again, or bind update_op and per_group ops by hand.", SECTION_PORT)
            for site in joint + single]


def train_op_unfetched(groups):
    """No ``session.run`` of the file fetches the groups' train ops."""
    return [refuse(group.minimize.call, "train-op-unfetched",
                   "No session.run of this file fetches %s: the tool cannot tell one step "
                   "for all groups (update_op) from one per group (per_group). Port it by "
                   "hand where the train ops are run." % group.name,
                   SECTION_PORT) for group in groups]


def blocks_differ(scanner, groups, anchors):
    """The groups' ``minimize`` calls (held by ``anchors``, the statements of
    their blocks) in different blocks or functions."""
    block = scanner.block(anchors[0])
    if all(scanner.block(a) is block for a in anchors):
        return []
    lines = ", ".join(str(scanner.line(g.minimize.call)) for g in groups)
    return [refuse(group.minimize.call, "blocks-differ",
                   "The minimize calls (lines %s) are in different blocks or functions: one "
                   "builder needs them side by side. Put them in one block (with tf.name_scope"
                   "(...) blocks side by side count as one), then run the tool again." % lines)
            for group in groups]


def control_dependencies_mixed(scanner, statement):
    """A statement (said once) sharing a ``tf.control_dependencies`` block
    with a ``minimize``."""
    return [refuse(statement, "control-dependencies-mixed",
                   "This statement shares a tf.control_dependencies block with a minimize: "
                   "the tool cannot lift the minimize out of it. Move it above or below the "
                   "with block (which may then hold only the minimize calls and the "
                   "optimizers', wrappers' and managers' constructors), then run the tool "
                   "again.", SECTION_UPDATE_OPS,
                   once=("control-dependencies-mixed", scanner.line(statement)))]


def mixed_scaling(minimize):
    """A ``minimize`` without a wrapper beside others with one."""
    return [refuse(minimize.call, "mixed-scaling",
                   "This minimize has no loss-scale wrapper while others have: the tool will "
                   "not guess its scale. Wrap its optimizer as the others are (NPULossScale"
                   "Optimizer(opt, manager)), then run the tool again, or port the script by "
                   "hand.")]


def already_ported_mixed(wrappers):
    """A script importing npu_lossscale that still builds ``wrappers``: each
    is a by-hand item, and the rest of the file is left as it is."""
    return [by_hand(wrapper.call, "already-ported-mixed",
                    "The script imports npu_lossscale and still builds %s: finish "
                    "the port by hand (one step per session.run)." % _title(wrapper))
            for wrapper in wrappers]


def var_list_missing(minimize):
    """Several optimizers, and this ``minimize`` has no ``var_list``."""
    if minimize.var_list is not None:
        return []
    return [refuse(minimize.call, "var-list-missing",
                   "This minimize has no var_list: with several optimizers each group needs "
                   "its own variables. Pass var_list=... (e.g. tf.trainable_variables("
                   "\"generator\")), then run the tool again.")]


def global_step_twice(groups):
    """``global_step`` passed to several of the groups' ``minimize`` calls."""
    steps = [g for g in groups if g.minimize.global_step is not None]
    if len(steps) < 2:
        return []
    return [refuse(group.minimize.global_step, "global-step-twice",
                   "global_step is passed to %d minimize calls: it advanced once per optimizer."
                   " The builder advances it once per step: pass it to one minimize (the one "
                   "whose runs count your steps), then run the tool again." % len(steps),
                   SECTION_GLOBAL_STEP) for group in steps]


def minimize_arguments(scanner, minimize):
    """A ``minimize`` without a loss the tool can read, or with arguments
    ``add()`` does not take."""
    found = []
    if minimize.loss is None:
        found.append(refuse(minimize.call, "minimize-arguments",
                            "This minimize has no loss argument the tool can read: pass the "
                            "loss as its first argument, then run the tool again."))
    if minimize.others:
        found.append(refuse(minimize.call, "minimize-arguments",
                            "This minimize passes %s, which scaler.add() does not take: drop "
                            "them if they are defaults, then run the tool again, or port it "
                            "by hand." % ", ".join(_code(scanner, a) for a in minimize.others)))
    return found


def op_name_used(scanner, minimize):
    """A ``minimize(name=...)`` whose name the script uses elsewhere (or that
    is not a plain string)."""
    if minimize.name is None:
        return []
    value = getattr(minimize.name, "evaluated_value", None)
    if isinstance(minimize.name, cst.SimpleString) and scanner.strings[value] <= 1:
        return []
    return [refuse(minimize.name, "op-name-used",
                   "This train op's name %s is used elsewhere in the script: the builder's op "
                   "has another name. Reach the op through its variable there, drop name=..., "
                   "then run the tool again." % _code(scanner, minimize.name))]


def wrapper_arguments(scanner, wrapper, drop_in=False, unread=False, no_manager=False):
    """A wrapper call with arguments the tool does not know (the drop-in's
    own words with ``drop_in``), no optimizer it can read (``unread``), or no
    manager (``no_manager``)."""
    if no_manager:
        return [refuse(wrapper.call, "wrapper-arguments",
                       "This %s call has no loss-scale manager: pass one as its second "
                       "argument (e.g. ExponentialUpdateLossScaleManager(2 ** 15, 1000)), "
                       "then run the tool again, or port it by hand." % _title(wrapper),
                       SECTION_MANAGERS)]
    if unread:
        return [refuse(wrapper.call, "wrapper-arguments",
                       "This %s call has no optimizer argument the tool can read: pass the "
                       "optimizer as its first argument, then run the tool again." % _title(
                           wrapper))]
    shown = (_code(scanner, wrapper.call) if drop_in
             else ", ".join(_code(scanner, a) for a in wrapper.others))
    return [refuse(wrapper.call, "wrapper-arguments",
                   "This %s call has arguments the tool does not know (%s): drop those that "
                   "are defaults, then run the tool again, or port it by hand."
                   % (_title(wrapper), shown), SECTION_LSO if drop_in else SECTION_PORTING)]


def manager_arguments(scanner, call, mapping):
    """A recognised manager call with arguments the tool does not map."""
    return [refuse(call, "manager-arguments",
                   "This %s manager has arguments the tool does not know (%s): the tool maps "
                   "%s. Drop the others if they are defaults, then run the tool again, or "
                   "pass our manager by hand." % (mapping.origin, _code(scanner, call), ", ".join(
                       theirs for theirs, _ in mapping.keywords)), SECTION_MANAGERS)]


def loss_scale_argument(scanner, expr):
    """A TF ``loss_scale`` that is not a literal or a TF loss-scale call."""
    return [refuse(expr, "loss-scale-argument",
                   "The loss_scale %s is not a literal or a DynamicLossScale/FixedLossScale "
                   "call the tool can map: pass our manager by hand." % _code(scanner, expr),
                   SECTION_MANAGERS)]


def manager_unfollowed(scanner, expr):
    """A manager built inside the wrapper by a call the tool cannot move."""
    return [refuse(expr, "manager-unfollowed",
                   "The manager %s is built inside the wrapper by a call the tool cannot "
                   "move: bind it to a name on the line above the wrapper (m = ...; "
                   "Wrapper(opt, m)), then run the tool again." % _code(scanner, expr),
                   SECTION_MANAGERS)]


def unmovable(scanner, node, what=None, section=SECTION_PORT, scoped=False, test=None,
              test_why=None, group=None, again=None):
    """An argument that moves to the builder past lines that may change it:
    inside the name scopes (``scoped``); ``build()``'s ``what`` argument; a
    spelling if's ``test`` (``test_why``: why it may not mean the same);
    ``group``'s manager, bound again at ``again`` or past lines that may
    change its arguments."""
    if scoped:
        return [refuse(node, "unmovable",
                       "This argument moves to the builder, past lines inside the tf.name_scope"
                       " blocks that may change it: bind it to a name before the first block, "
                       "and leave it as it is until the last, then run the tool again.",
                       SECTION_PORT)]
    if what is not None:
        return [refuse(node, "unmovable",
                       "This %s argument moves to build(), after lines the script runs in "
                       "between that may change it (a new value, or a call that reads it): "
                       "bind it to a name before the first minimize, and leave it as it is "
                       "until the last, then run the tool again." % what, section)]
    if test is not None:
        return [refuse(test, "unmovable",
                       "This if's test (%s) moves to the builder's distributed=..., where the "
                       "scaler is made: it may not mean the same there (%s). Bind it to a name "
                       "before the first minimize (e.g. rank_size = int(os.getenv(\"RANK_SIZE\", "
                       "\"1\"))) and test that, then run the tool again." % (
                           _code(scanner, test), test_why), SECTION_DATA_PARALLEL)]
    scale = group.wrapper.scale
    if again is not None:
        return [refuse(group.wrapper.call, "unmovable",
                       "This wrapper reads the manager %s, which line %d binds again "
                       "before %s's minimize, where the builder reads it: give each "
                       "manager a name of its own (e.g. %s_manager = ... and this wrapper "
                       "reading it), then run the tool again."
                       % (scale.value, scanner.line(again), group.name,
                          group.name.lstrip("_").split("_")[0]), SECTION_MANAGERS)]
    return [refuse(group.wrapper.call, "unmovable",
                   "This wrapper's manager moves to the builder, past lines that may change "
                   "its arguments: bind the manager to a name above the first minimize (m = "
                   "Manager(...)), then run the tool again.", SECTION_MANAGERS)]


def distributed(scanner, node, literal=False, func=None, sync=False, spelled=None,
                reductions=None, groups=()):
    """A cross-device reduction the builder cannot take as it is, at
    ``node``: an ``is_distributed=`` that is no literal (``literal``); a
    wrapped optimizer ``func`` (``sync``: TF's SyncReplicasOptimizer, else
    one that averages); an if/else spelling the wrapper two ways the builder
    cannot follow (``spelled``: its test and the two engines in words); the
    ``groups``' wrappers reducing in different ways (``reductions``: each
    way's groups and its words)."""
    if literal:
        return [refuse(node, "distributed",
                       "is_distributed=%s: the builder's cross-device check is "
                       "MultiOptimizerLossScale(..., distributed=\"hccl\"), on or off for the "
                       "whole script: write True or False here (or port it by hand), then "
                       "run the tool again." % _code(scanner, node), SECTION_DATA_PARALLEL)]
    if sync:
        return [refuse(node, "distributed",
                       "The wrapped optimizer is %s: the builder's group takes "
                       "npu_lossscale.SyncReplicasOptimizer (the same arguments) with "
                       "build(count_skipped_steps=True), docs/distributed.md, 'Parameter "
                       "servers'; port it by hand." % _code(scanner, func), SECTION_DATA_PARALLEL)]
    if func is not None:
        return [refuse(node, "distributed",
                       "The wrapped optimizer averages gradients across workers (%s): the "
                       "builder does that itself, with distributed=\"hccl\". Put "
                       "npu_tf_optimizer(...) around the wrapper instead of %s inside it (the "
                       "tool maps it), then run the tool again, or port it by hand."
                       % (_code(scanner, func), _code(scanner, func)), SECTION_DATA_PARALLEL)]
    if spelled is not None:
        return [refuse(node, "distributed",
                       "The if/else (`if %s:`) spells this wrapper with %s and %s: the "
                       "builder's distributed=... can follow a test between averaging "
                       "across devices (npu_tf_optimizer) and one device, not this. "
                       "Spell both branches alike, then run the tool again, or port it "
                       "by hand." % spelled, SECTION_DATA_PARALLEL)]
    return [refuse(group.wrapper.call, "distributed",
                   "The wrappers reduce across devices in different ways (%s): the "
                   "builder's distributed=... is one for all groups. Give every "
                   "wrapper the same is_distributed and npu_tf_optimizer layer, then "
                   "run the tool again." % "; ".join(
                       "%s: %s" % (", ".join(g.name for g in sharing), words)
                       for sharing, words in reductions), SECTION_DATA_PARALLEL)
            for group in groups]
