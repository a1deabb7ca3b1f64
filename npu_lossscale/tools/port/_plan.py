"""Deciding the rewrite: what each pattern becomes, and what cannot be proved.

``plan(scanner, path)`` reads what ``_find.Scanner`` recorded and returns a
``Plan``: the node edits for ``_rewrite`` and the report's entries. It takes
one of three roads per module:

* **drop-in**: one loss-scale wrapper, built once: it becomes
  ``nl.LossScaleOptimizer(opt, manager)``.
* **builder**: several wrappers (or several ``minimize`` ops and no loss
  scaling at all): one ``nl.MultiOptimizerLossScale``, one ``add()`` per
  ``minimize``, one ``build()`` after the last of them, and each train op's
  name bound to what the script's ``session.run`` calls need (the joint
  ``update_op``, or its group's ``per_group`` op).
* **by hand**: anything the tool cannot prove keeps its meaning. The module
  is then left exactly as it is (a partial port of a multi-optimizer script
  would put a builder's step and a wrapper's in one run) and each reason is
  listed.
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst
import libcst.matchers as _matchers

from npu_lossscale.tools.port import _emit, _engines, _flow, _managers, _names
from npu_lossscale.tools.port._find import bind_args as _bind
from npu_lossscale.tools.port._find import last_name as _last_name
from npu_lossscale.tools.port._report import BY_HAND, CHANGED, LEFT_ALONE, Entry

from npu_lossscale.tools.port._sections import (  # noqa: F401 (the report's sections)
    SECTION_PORTING,
    SECTION_SEQUENCE,
    SECTION_UPDATE_OPS,
    SECTION_GLOBAL_STEP,
    SECTION_NPU_INIT,
    SECTION_MANAGERS,
    SECTION_PER_GROUP_SCALES,
    SECTION_LSO,
    SECTION_GRAPH_REWRITE,
    SECTION_DATA_PARALLEL,
    SECTION_SYNC_REPLICAS,
    SECTION_BUILDER,
    SECTION_PORT)

#: The edits of one module and its report entries.
#:
#: Attributes:
#:   replace: dict from an original node to the node that takes its place.
#:   statements: dict from an original statement to the list of statements
#:     that take its place (an empty list removes it).
#:   before: dict from an original statement to statements inserted before it.
#:   after: dict from an original statement to statements inserted after it.
#:   entries: the report's ``Entry``s for this module.
#:   lift: dict from a ``with tf.control_dependencies(X):`` around an ``if``
#:     to the index of the if's branch whose builder now gates X: the with
#:     goes, and each other branch's lines keep it around them.
Plan = collections.namedtuple("Plan", ["replace", "statements", "before", "after", "entries",
                                       "lift"])

#: A part of a module the plan ports on its own.
#:
#: Attributes:
#:   branch: the ``cst.If`` whose branches are ported one by one, or None
#:     (the whole module).
#:   block: the branch's ``IndentedBlock``, or None.
Arm = collections.namedtuple("Arm", ["branch", "block"])

#: One ``minimize`` call that becomes a builder group.
#:
#: Attributes:
#:   name: the group's name (the train op's variable).
#:   minimize: the ``_find.Minimize``.
#:   statement: its ``SimpleStatementLine``.
#:   top: the statement of the builder's block that holds it (itself, or
#:     the ``with tf.control_dependencies(...)`` around it).
#:   update_ops: the ``control_dependencies`` argument, or None.
#:   optimizer: the optimizer expression ``add()`` gets.
#:   wrapper: the ``_find.Wrapper`` it came through, or None.
#:   wrapper_statement: the statement that binds the wrapper to a name, or
#:     None (a wrapper inline in the ``minimize``, or none).
#:   manager: the ``ManagerUse``.
Group = collections.namedtuple("Group", ["name", "minimize", "statement", "top", "update_ops",
                                         "optimizer", "wrapper", "wrapper_statement", "manager"])

_BUILDER_KEY = "builder"  # the one manager of a port without loss scaling


def plan(scanner, path):
    """Plans the rewrite of one module.

    Args:
      scanner: a ``_find.Scanner`` at the end of its walk.
      path: the module's path for the report.

    Returns:
      A ``Plan``.
    """
    planner = _Planner(scanner, path)
    planner.run()
    return Plan(planner.replace, planner.statements, planner.before, planner.after,
                planner.entries, planner.lift)


class _Planner(_engines.EngineRules, _managers.ManagerRules):
    """The decisions for one module (see the module docstring)."""

    def __init__(self, scanner, path):
        self.s = scanner
        self.path = path
        self.entries, self.reasons = [], []
        self.replace, self.statements, self.before, self.after = {}, {}, {}, {}
        taken = scanner.names
        self.alias = "nl" if "nl" not in taken else "npu_lossscale"
        self.mapped = set()  # manager calls already mapped
        self.moving = {}  # a control_dependencies top -> its statements moving above it
        self.lift = {}  # see Plan
        self.layers = {}  # a wrapper call -> npu_bridge's distributed layers around it
        self.spelled = {}  # a wrapper call -> the ``Spelling`` it is the if-branch of
        self.seen = set()  # wrappers a minimize was traced to
        self.arm = Arm(None, None)  # the part being ported (see arms())
        self.minimizes, self.wrappers = scanner.minimizes, scanner.wrappers

    # -- report -------------------------------------------------------------------

    def _entry(self, kind, node, rule, message, section=""):
        line = self.s.line(node) if node is not None else 0
        return Entry(kind, self.path, line, rule, message, section)

    def changed(self, node, rule, message, section=""):
        self.entries.append(self._entry(CHANGED, node, rule, message, section))

    def left_alone(self, node, rule, message, section=""):
        self.entries.append(self._entry(LEFT_ALONE, node, rule, message, section))

    def by_hand(self, node, rule, message, section=SECTION_PORTING):
        self.entries.append(self._entry(BY_HAND, node, rule, message, section))

    def refuse(self, node, rule, message, section=SECTION_PORTING):
        """Records a reason the module cannot be rewritten."""
        self.reasons.append(self._entry(BY_HAND, node, rule, message, section))

    def code(self, node):
        return self.s.code(node).strip()

    # -- the three roads ----------------------------------------------------------

    def run(self):
        s = self.s
        if s.star_npu is not None:
            self.left_alone(s.star_npu, "npu-init-import",
                            "Kept `from npu_bridge.npu_init import *`: on Ascend it hands the "
                            "graph to the NPU. On a GPU or CPU drop it and import what the "
                            "script used from it yourself.", SECTION_NPU_INIT)
        if s.library_import is not None:
            if s.wrappers:
                for wrapper in s.wrappers:
                    self.by_hand(wrapper.call, "already-ported-mixed",
                                 "The script imports npu_lossscale and still builds %s: finish "
                                 "the port by hand (one step per session.run)."
                                 % _names.WRAPPER_TITLES[wrapper.kind])
            else:
                self.left_alone(s.library_import, "already-ported",
                                "The script already imports npu_lossscale: nothing to port.")
            return
        for arm in self.arms():
            self.arm = arm
            self.minimizes = [m for m in s.minimizes if arm.block is None
                              or _flow.inside(s, m.call, arm.block)]
            self.wrappers = [w for w in s.wrappers if arm.block is None
                             or _flow.inside(s, w.call, arm.block)]
            if arm.block is not None and not self.wrappers:
                self.left_alone(arm.block.body[0], "branch-unscaled",
                                "This branch of the if (line %d) trains without loss scaling "
                                "(the script's float32 or plain mode): it stays as it is, and "
                                "the branch that scales is ported." % s.line(arm.branch),
                                SECTION_PORTING)
            elif not self.wrappers:
                self.unscaled()
            elif len(self.wrappers) == 1 and self.runs_once(self.wrappers[0].call):
                self.drop_in(self.wrappers[0])
            else:
                self.builder(scaled=True)
        self.entries.extend(self.reasons)
        if self.reasons:
            self.replace, self.statements, self.before, self.after = {}, {}, {}, {}
            self.lift = {}
            self.entries = [e for e in self.entries if e.kind != CHANGED]
            return
        for call in s.managers:
            if call not in self.mapped and s.managers[call].origin != "tensorflow":
                self.left_alone(call, "manager-unused",
                                "This %s's manager feeds no wrapper the tool rewrote, so it "
                                "stays as it is." % s.managers[call].origin, SECTION_MANAGERS)

    def arms(self):
        """The parts of the module to port one at a time: the whole module
        (one ``Arm`` whose block is None), or, when every ``minimize`` and
        wrapper is inside one ``if`` statement with ``minimize`` calls in
        more than one of its branches (a precision ``if/else``: loss scaling
        in one branch, plain ``minimize`` in the other; or the spellings of
        a ``RANK_SIZE`` test), each branch; the condition stays."""
        s = self.s
        whole = [Arm(None, None)]
        nodes = [m.call for m in s.minimizes] + [w.call for w in s.wrappers]
        if not s.minimizes:
            return whole
        branch = s.parent(s.statement(s.minimizes[0].call))
        while branch is not None and not isinstance(branch, (cst.If, cst.FunctionDef)):
            branch = s.parent(branch)
        while isinstance(branch, cst.If):
            blocks = _branch_blocks(branch)
            holding = [b for b in blocks if any(_flow.inside(s, m.call, b) for m in s.minimizes)]
            if (len(holding) > 1 and all(_flow.inside(s, n, branch) for n in nodes)
                    and all(any(_flow.inside(s, n, b) for b in blocks) for n in nodes)):
                return [Arm(branch, b) for b in holding]
            branch = s.parent(branch)
            while branch is not None and not isinstance(branch, (cst.If, cst.FunctionDef)):
                branch = s.parent(branch)
        return whole

    def runs_once(self, node, outer=()):
        """True when ``node`` is built once per graph: in no loop, and in no
        function called from more than one place or from a call that may
        run more than once.

        Args:
          node: a ``cst`` node.
          outer: the functions whose calls are being followed (a recursion
            is not once).
        """
        if self.s.loop_around(node) is not None:
            return False
        function = self.s.function_of(node)
        while function is not None:
            sites = self.s.call_sites.get(function.name.value, ())
            if len(sites) > 1 or function in outer:
                return False
            if self.s.loop_around(function) is not None:
                return False
            if any(not self.runs_once(site, tuple(outer) + (function,)) for site in sites):
                return False
            function = self.s.function_of(function)
        return True

    def unscaled(self):
        """No loss-scale wrapper: several ``minimize`` ops become one builder
        with a dynamic scale; a single one is left alone."""
        minimizes = self.minimizes
        if len(minimizes) == 1:
            self.left_alone(minimizes[0].call, "unscaled-single",
                            "One minimize without loss scaling: nothing to port. For float16 "
                            "compute wrap its optimizer: nl.LossScaleOptimizer(opt, "
                            "nl.DynamicLossScaleManager()).", SECTION_LSO)
        elif len(minimizes) > 1:
            self.builder(scaled=False)

    # -- drop-in ------------------------------------------------------------------

    def drop_in(self, wrapper):
        """One wrapper: ``nl.LossScaleOptimizer`` in its place."""
        s = self.s
        if isinstance(s.parent(wrapper.call), cst.Expr):
            self.refuse(wrapper.call, "wrapper-unfollowed",
                        "The result of this %s call is dropped: assign it (opt = ...) and "
                        "minimize that, then run the tool again, or port it by hand."
                        % _names.WRAPPER_TITLES[wrapper.kind], SECTION_PORT)
            return
        if self.refuse_on_object(wrapper):
            return
        minimizes = self.wrapper_minimizes(wrapper)
        if len(minimizes) > 1:
            self.refuse_reused(minimizes)
            return
        for call in self.handed_to_functions(wrapper):
            self.refuse(call, "optimizer-through-function",
                        "This %s is handed to %s(), a function of this script, where the tool "
                        "cannot count its minimize calls: port it by hand (one "
                        "nl.LossScaleOptimizer minimized once per step)."
                        % (_names.WRAPPER_TITLES[wrapper.kind], self.code(call.func)),
                        SECTION_PORT)
        if self.reasons:
            return
        if wrapper.optimizer is None or wrapper.others:
            self.refuse(wrapper.call, "wrapper-arguments",
                        "This %s call has arguments the tool does not know (%s): drop those "
                        "that are defaults, then run the tool again, or port it by hand."
                        % (_names.WRAPPER_TITLES[wrapper.kind], self.code(wrapper.call)),
                        SECTION_LSO)
            return
        manager = self.manager_of(wrapper, None)
        if manager is None:
            return
        sync = self.sync_replicas(wrapper)
        args = [self.code(wrapper.optimizer), manager.code]
        if sync is not None and sync is _engines.inner_value(s, wrapper.optimizer):
            ours = sync.with_changes(func=cst.parse_expression(
                "%s.SyncReplicasOptimizer" % self.alias))
            if sync is wrapper.optimizer:
                args[0] = self.code(ours)
            else:
                self.replace[sync] = ours
        if wrapper.distributed is not None:
            args.append("is_distributed=" + self.code(wrapper.distributed))
        if sync is not None:
            args.append("count_skipped_steps=True")
            inside = sync is _engines.inner_value(s, wrapper.optimizer)
            self.changed(sync, "sync-replicas-mapped",
                         "%s; the drop-in passes count_skipped_steps=True: the workers' tokens "
                         "are global_step, and a skip that held it back would drop every later "
                         "push, the workers waiting forever." % (
                             "tf.train.SyncReplicasOptimizer inside the loss scaling is %s."
                             "SyncReplicasOptimizer, the same arguments (its chief applies "
                             "through the step's decision)" % self.alias if inside else
                             "tf.train.SyncReplicasOptimizer around the loss scaling stays"),
                         SECTION_SYNC_REPLICAS)
        column = s.column(wrapper.call)
        text = _emit.call_text("%s.LossScaleOptimizer" % self.alias, args, column)
        self.replace[wrapper.call] = _emit.parse_expression_at(text,
                                                          s.column(s.statement(wrapper.call)))
        self.changed(wrapper.call, "drop-in",
                     "%s is now %s.LossScaleOptimizer(...), the drop-in for one optimizer "
                     "(same optimizer, same manager arguments)."
                     % (_names.WRAPPER_TITLES[wrapper.kind], self.alias), SECTION_LSO)
        if wrapper.kind == _names.GRAPH_REWRITE:
            self.graph_rewrite_note(wrapper)
        for minimize in minimizes:
            for owner in self.dependencies_around(s.statement(minimize.call)):
                self.left_alone(owner, "update-ops-ungated",
                                "The drop-in keeps tf.control_dependencies(%s) around the "
                                "minimize: those updates still run on skipped steps, as before. "
                                "To skip them too, port to MultiOptimizerLossScale with "
                                "build(update_ops=...)." % self.code(self.control_dependencies(
                                    owner)), SECTION_UPDATE_OPS)
        for minimize in self.minimizes:
            if minimize not in minimizes:
                self.left_alone(minimize.call, "unscaled-beside",
                                "This minimize has no loss scaling and stays as it is. To scale "
                                "it too, port the script to one MultiOptimizerLossScale by "
                                "hand.", SECTION_PORTING)
        self.add_import()

    def refuse_on_object(self, wrapper):
        """Refuses a wrapper kept in an object's attribute or item
        (``self.opt = Wrapper(...)``), or built in a class and minimized
        nowhere the tool sees: the tool cannot count the objects made nor
        follow the ``minimize`` calls made through them. Returns True when
        refused."""
        s = self.s
        parent = s.parent(wrapper.call)
        stored = [self.code(t.target) for t in getattr(parent, "targets", ())
                  if isinstance(parent, cst.Assign) and not isinstance(t.target, cst.Name)]
        node, method, klass = wrapper.call, None, None
        while node is not None and klass is None:
            node = s.parent(node)
            if isinstance(node, cst.FunctionDef) and method is None:
                method = node.name.value
            elif isinstance(node, cst.ClassDef):
                klass = node.name.value
        if not stored and (klass is None or self.wrapper_minimizes(wrapper)):
            return False  # a local name in a method, minimized there, is followed
        where = ("in %s of class %s" % ("method %s()" % method if method else "the body",
                                        klass) if klass else "")
        kept = "kept in %s" % ", ".join(stored) if stored else ""
        self.refuse(wrapper.call, "wrapper-on-object",
                    "This %s is built %s: the tool cannot count the objects made nor follow "
                    "the minimize calls made through them. Port it by hand: "
                    "nl.LossScaleOptimizer(opt, manager) in its place is the drop-in when each "
                    "object is minimized once per step; for several optimizers, one "
                    "nl.MultiOptimizerLossScale." % (_names.WRAPPER_TITLES[wrapper.kind],
                                                     " and ".join(w for w in (where, kept) if w)),
                    SECTION_PORT)
        return True

    def wrapper_name(self, wrapper):
        """``(name, references)``: the ``cst.Name`` a wrapper call is
        assigned to (``name = Wrapper(...)``) and the names that read that
        assignment; ``(None, [])`` for a wrapper used otherwise."""
        s = self.s
        parent = s.parent(wrapper.call)
        if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1
                and isinstance(parent.targets[0].target, cst.Name)):
            return None, []
        target = parent.targets[0].target
        assignment = [a for a in (s.assignments(target) or ()) if a.node is target]
        return target, s.references(assignment)

    def wrapper_minimizes(self, wrapper):
        """The ``minimize`` calls made on ``wrapper``'s object (inline, or
        through the name it is assigned to)."""
        receivers = [wrapper.call] + self.wrapper_name(wrapper)[1]
        return [m for m in self.minimizes if any(m.receiver is r for r in receivers)]

    def handed_to_functions(self, wrapper):
        """The calls of the script's own functions that take the name
        ``wrapper`` is assigned to as an argument."""
        s = self.s
        calls = []
        for reference in self.wrapper_name(wrapper)[1]:
            arg = s.parent(reference)
            call = s.parent(arg) if isinstance(arg, cst.Arg) else None
            if isinstance(call, cst.Call) and _last_name(call) in s.functions:
                calls.append(call)
        return calls

    def refuse_reused(self, minimizes):
        lines = ", ".join(str(self.s.line(m.call)) for m in minimizes)
        for minimize in minimizes:
            self.refuse(minimize.call, "optimizer-reused",
                        "One optimizer object is minimized %d times (lines %s): its Adam beta "
                        "powers advance once per call (ModelZoo BicycleGAN). Give each minimize "
                        "its own optimizer, then run the tool again."
                        % (len(minimizes), lines), SECTION_PORT)

    def graph_rewrite_note(self, wrapper):
        if any(e.rule == "graph-rewrite-session-config" for e in self.entries):
            return  # once per module: one session config to change
        self.by_hand(wrapper.call, "graph-rewrite-session-config",
                     "enable_mixed_precision_graph_rewrite also turned on grappler's "
                     "auto_mixed_precision for later sessions; the port keeps only its loss "
                     "scaling. Set config.graph_options.rewrite_options.auto_mixed_precision = "
                     "RewriterConfig.ON in the session config.", SECTION_GRAPH_REWRITE)

    # -- builder ------------------------------------------------------------------

    def builder(self, scaled):
        """Several optimizers: one ``MultiOptimizerLossScale``."""
        s = self.s
        wrappers = dict((w.call, w) for w in self.wrappers)
        groups, used = [], set()
        for minimize in self.minimizes:
            group = self.group(minimize, wrappers, scaled)
            if group is not None:
                groups.append(group)
                if group.wrapper is not None:
                    used.add(group.wrapper.call)
        for wrapper in self.wrappers:
            if wrapper.call not in used and wrapper.call not in self.seen:
                self.refuse_unused(wrapper)
        if self.reasons:
            return
        anchors = [self.anchor(g.top) for g in groups]
        block = s.block(anchors[0])
        if any(s.block(a) is not block for a in anchors):
            lines = ", ".join(str(s.line(g.minimize.call)) for g in groups)
            for group in groups:
                self.refuse(group.minimize.call, "blocks-differ",
                            "The minimize calls (lines %s) are in different blocks or "
                            "functions: one builder needs them side by side. Put them in one "
                            "block (with tf.name_scope(...) blocks side by side count as one), "
                            "then run the tool again." % lines)
            return
        self.check_groups(groups)
        self.check_engines(groups)
        if self.reasons:
            return
        mode = self.fetch_mode(groups)
        if mode is None:
            return
        tops = _unique_nodes([g.top for g in groups])
        outer = _unique_nodes(anchors)
        body = list(block.body)
        index = dict((id(statement), i) for i, statement in enumerate(body))
        scoped = self.scoped_statements(groups, outer)
        self.check_moves(groups, body, index, outer, scoped)
        if self.reasons:
            return
        first = s.line(groups[0].minimize.call)
        self.note_between(groups, body[index[id(outer[0])] + 1:index[id(outer[-1])]]
                          + [st for st in scoped if s.line(st) > first], tops)
        lifted = self.liftable(outer)
        self.write_builder(groups, mode, tops, outer[-1],
                           self.code(self.control_dependencies(lifted)) if lifted else None)
        for owner in self.dependencies_around(tops[0]):
            if owner is lifted:
                continue
            self.by_hand(owner, "update-ops-not-atomic",
                         "tf.control_dependencies(%s) here stays around build() (the tool "
                         "lifts only a block that holds nothing but minimize calls): every "
                         "run, skipped ones too, runs those updates, so a skipped step still "
                         "changes them (batch-norm statistics): the skip is not atomic. To gate "
                         "them, move the block's other statements out of it (or the minimize "
                         "calls into a tf.control_dependencies(%s) of their own, side by side), "
                         "then run the tool again on the original script."
                         % ((self.code(self.control_dependencies(owner)),) * 2),
                         SECTION_UPDATE_OPS)
        self.add_import()

    def group(self, minimize, wrappers, scaled):
        """The ``Group`` of one ``minimize`` call, or None (refused)."""
        s = self.s
        statement = s.statement(minimize.call)
        target = _assign_target(statement, minimize.call)
        if target is None:
            self.refuse(minimize.call, "train-op-unfollowed",
                        "This minimize's train op is not assigned to a plain name, so the "
                        "tool cannot follow its fetches: assign it (name = opt.minimize(...)) "
                        "and fetch that name, then run the tool again.")
            return None
        if s.loop_around(minimize.call) is not None:
            self.refuse(minimize.call, "built-in-loop",
                        "This minimize runs in a loop or comprehension: the tool cannot tell "
                        "the optimizers apart. Unroll it (one optimizer and one minimize per "
                        "network, side by side), then run the tool again, or write one "
                        "scaler.add() per optimizer by hand.", SECTION_PORT)
            return None
        top, update_ops = self.top_of(statement)
        source = self.optimizer_source(minimize, top, wrappers)
        if source is None:
            return None
        wrapper, wrapper_statement, optimizer = source
        if scaled and wrapper is None:
            self.refuse(minimize.call, "mixed-scaling",
                        "This minimize has no loss-scale wrapper while others have: the tool "
                        "will not guess its scale. Wrap its optimizer as the others are "
                        "(NPULossScaleOptimizer(opt, manager)), then run the tool again, or port "
                        "the script by hand.")
            return None
        if wrapper is not None:
            manager = self.wrapper_checks(wrapper, wrapper_statement)
            if manager is None:
                return None
        else:
            manager = _managers.ManagerUse(
                "%s.%s" % (self.alias, _managers.UNSCALED_MANAGER), _BUILDER_KEY, None)
        return Group(target.value, minimize, statement, top, update_ops, optimizer, wrapper,
                     wrapper_statement, manager)

    def top_of(self, statement):
        """``(top, update_ops)``: the statement of the builder's block that
        holds ``statement``, and the ``control_dependencies`` argument."""
        owner = self.s.owner(self.s.block(statement))
        if isinstance(owner, cst.With) and self.control_dependencies(owner) is not None:
            return owner, self.control_dependencies(owner)
        return statement, None

    def liftable(self, outer):
        """The ``with tf.control_dependencies(X):`` around the if whose
        branch holds the builder, when it can go (``Plan.lift``): it holds
        that if alone, X is a name nothing in it binds, the builder's lines
        are the branch's own, and no other branch scales; else None. The
        builder's ``build(update_ops=X)`` then gates X, and the other
        branches keep the block around their lines, as before."""
        arm, s = self.arm, self.s
        if arm.branch is None or any(s.block(o) is not arm.block for o in outer):
            return None
        around = self.dependencies_around(outer[0])
        owner = s.owner(s.block(arm.branch))
        if not (around and owner is around[0] and len(owner.body.body) == 1):
            return None
        ops = self.control_dependencies(owner)
        others = [b for b in _branch_blocks(arm.branch) if b is not arm.block]
        if not (isinstance(ops, cst.Name) and ops.value not in _flow.assigned(owner.body)
                and not any(_flow.inside(s, w.call, b) for w in s.wrappers for b in others)):
            return None
        self.lift[owner] = _branch_blocks(arm.branch).index(arm.block)
        self.changed(owner, "update-ops-lifted",
                     "with tf.control_dependencies(%s) around the if is gone from the branch "
                     "that scales: its build(update_ops=...) runs those updates on applied "
                     "steps only (with the wrappers they ran on skipped steps too); the other "
                     "branches keep the block around their lines." % ops.value,
                     SECTION_UPDATE_OPS)
        return owner

    def dependencies_around(self, statement):
        """The ``with tf.control_dependencies(...)`` statements around the
        block that holds ``statement``, innermost first, up to its function:
        those whose ops every run of what is built inside runs."""
        s, found = self.s, []
        node = s.parent(statement)
        while node is not None and not isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            if isinstance(node, cst.With) and self.control_dependencies(node) is not None:
                found.append(node)
            node = s.parent(node)
        return found

    def control_dependencies(self, with_node):
        """X of ``with tf.control_dependencies(X):`` (the only item), else None."""
        if len(with_node.items) != 1 or with_node.items[0].asname is not None:
            return None
        call = with_node.items[0].item
        if self.s.call_name(call) != _names.CONTROL_DEPENDENCIES:
            return None
        bound, others = _bind(call, ["control_inputs"])
        if others or "control_inputs" not in bound:
            return None
        return bound["control_inputs"].value

    def optimizer_source(self, minimize, top, wrappers):
        """``(wrapper, wrapper_statement, optimizer_code)`` for a minimize's
        receiver, or None (refused)."""
        s = self.s
        receiver = minimize.receiver
        if isinstance(receiver, cst.Call):
            receiver = self.peel(receiver)
            if receiver in wrappers:
                wrapper = wrappers[receiver]
                self.seen.add(receiver)
                if wrapper.optimizer is None:
                    return self.refuse_arguments(wrapper)
                return wrapper, None, self.unwrapped_text(wrapper)
            if _names.is_tf_optimizer(s.call_name(receiver)):
                return None, None, self.code(receiver)
            return self.refuse_unfollowed(minimize)
        if not isinstance(receiver, cst.Name):
            return self.refuse_unfollowed(minimize)
        own = s.statement(minimize.call)
        target = _assign_target(own, minimize.call)
        assignments = [a for a in s.assignments(receiver) or () if a.node is not target]
        places = [(self.order(s.statement(a.node), top), a, s.statement(a.node))
                  for a in assignments]
        position = self.order(own, own)
        spell = self.spelling_if(assignments, wrappers)
        if spell is not None:  # the if stands for its two assignments
            branch = [a for a in assignments if _flow.inside(s, a.node, spell.node)]
            places = [p for p in places if not any(p[1] is a for a in branch)] + [
                (self.order(spell.node, top), branch[0], spell.node)]
        if not places or any(p is None or p >= position
                             or not (isinstance(statement, cst.SimpleStatementLine)
                                     or spell is not None and statement is spell.node)
                             for p, _, statement in places):
            return self.refuse_unfollowed(minimize)
        _, source, statement = max(places, key=lambda p: p[0])
        value = self.peel(s.assigned_value(source))
        allowed = [receiver] + (s.references([a for a in s.assignments(receiver)
                                                if a.node is target]) if target is not None
                                and target.value == receiver.value else [])
        wrapper = wrappers.get(value)
        if wrapper is not None:
            self.seen.add(value)
            if wrapper.optimizer is None:
                return self.refuse_arguments(wrapper)
            for spelled in (spell.wrappers if spell is not None else [wrapper]):
                self.seen.add(spelled.call)
                if isinstance(spelled.optimizer, cst.Name):
                    allowed.append(spelled.optimizer)
        elif not _names.is_tf_optimizer(s.call_name(value)):
            return self.refuse_unfollowed(minimize)
        for reference in s.references(assignments):
            if not any(reference is a for a in allowed):
                self.refuse_other_use(receiver.value, reference)
                return None
        return wrapper, (statement if wrapper is not None else None), receiver.value

    def order(self, statement, top):
        """Where ``statement`` runs before the statements of ``top``'s block,
        as a sortable tuple of indices from the builder's block down (a
        statement of an enclosing block, or of ``top``'s own
        control_dependencies block); None for a statement elsewhere (a
        branch, another function)."""
        s = self.s
        mine = self.statement_path(statement)
        theirs = self.statement_path(top)
        if isinstance(top, cst.With) and top is not statement:
            theirs = theirs + [(top.body, None)]  # the block it holds
        if mine is None or theirs is None or len(mine) > len(theirs):
            return None
        for depth, (block, _) in enumerate(mine):
            if block is not theirs[depth][0]:
                return None
            if depth < len(mine) - 1 and mine[depth][1] != theirs[depth][1]:
                return None
        return tuple(index for _, index in mine)

    def statement_path(self, statement):
        """``[(block, index), ...]`` from the outermost block of
        ``statement``'s function (or module) down to ``statement``, or None
        when a part of it is no plain block (an ``else``, a one-line
        suite)."""
        s, found, node = self.s, [], statement
        while True:
            block = s.parent(node)
            if not isinstance(block, (cst.IndentedBlock, cst.Module)):
                return None
            found.append((block, _position(list(block.body), node)))
            owner = None if isinstance(block, cst.Module) else s.parent(block)
            if owner is None or isinstance(owner, (cst.FunctionDef, cst.ClassDef)):
                return list(reversed(found))
            node = owner

    def anchor(self, top):
        """The statement of the builder's block that holds ``top``: ``top``,
        or the outermost ``with tf.name_scope(...)`` around it (wrappers and
        minimize calls in name scopes, as Pix2Pix has them: the scopes stay,
        so the variables made in them keep their names)."""
        s, node = self.s, top
        while True:
            owner = s.owner(s.block(node))
            if not (isinstance(owner, cst.With) and len(owner.items) == 1
                    and s.call_name(owner.items[0].item) == _names.NAME_SCOPE):
                return node
            node = owner

    def refuse_mixed_block(self, statement):
        """Once per statement: it shares a ``tf.control_dependencies`` block
        with a ``minimize``."""
        if any(e.rule == "control-dependencies-mixed" and e.line == self.s.line(statement)
               for e in self.reasons):
            return
        self.refuse(statement, "control-dependencies-mixed",
                    "This statement shares a tf.control_dependencies block with a minimize: "
                    "the tool cannot lift the minimize out of it. Move it above or below the "
                    "with block (which may then hold only the minimize calls and the "
                    "optimizers', wrappers' and managers' constructors), then run the tool "
                    "again.", SECTION_UPDATE_OPS)

    def refuse_unfollowed(self, minimize):
        s, receiver = self.s, minimize.receiver
        branches = [s.statement(a.node) for a in (
            s.assignments(receiver) or () if isinstance(receiver, cst.Name) else ())
                    if isinstance(s.owner(s.block(s.statement(a.node))), (cst.If, cst.Else))]
        if branches:
            self.refuse(minimize.call, "optimizer-unfollowed",
                        "%s is bound in a branch of an if (line %d), so which optimizer this "
                        "minimize gets depends on the test: move the minimize calls into each "
                        "branch (a precision if/else is ported branch by branch: loss scaling "
                        "in one, plain minimize calls in the other), then run the tool again."
                        % (self.code(receiver), s.line(branches[0])), SECTION_PORT)
            return None
        self.refuse(minimize.call, "optimizer-unfollowed",
                    "The tool cannot tell which optimizer %s is: built in another function, "
                    "a loop, a branch, or passed in. Bind it once (name = "
                    "tf.train.AdamOptimizer(...), then name = NPULossScaleOptimizer(name, m) if "
                    "it is scaled) in this block or one around it, before this line, then run "
                    "the tool again; or write one scaler.add() per optimizer by hand."
                    % self.code(minimize.receiver), SECTION_PORT)
        return None

    def refuse_arguments(self, wrapper):
        self.refuse(wrapper.call, "wrapper-arguments",
                    "This %s call has no optimizer argument the tool can read: pass the "
                    "optimizer as its first argument, then run the tool again."
                    % _names.WRAPPER_TITLES[wrapper.kind])
        return None

    def refuse_other_use(self, name, reference):
        parent = self.s.parent(reference)
        method = parent.attr.value if isinstance(parent, cst.Attribute) else None
        if method == "minimize":
            self.refuse(reference, "optimizer-reused",
                        "%s is minimized again here: one optimizer object for two minimize "
                        "calls (its Adam beta powers advance once per call; ModelZoo "
                        "BicycleGAN). Give each minimize its own optimizer, then run the tool "
                        "again." % name, SECTION_PORT)
        elif method in ("compute_gradients", "apply_gradients"):
            self.refuse_gradients(reference, name)
        else:
            self.refuse(reference, "optimizer-used-elsewhere",
                        "%s is also used here, where the tool cannot follow it: read the "
                        "optimizer only in its minimize (bind the inner optimizer to a name of "
                        "its own for other uses), then run the tool again, or port it by hand."
                        % name,
                        SECTION_PORT)

    def refuse_gradients(self, node, name):
        self.refuse(node, "compute-apply-gradients",
                    "%s computes and applies gradients itself (compute_gradients/"
                    "apply_gradients): write scaler.add(loss, optimizer, var_list=..., "
                    "transform_grads_fn=f), f doing the edits between the two calls." % name,
                    SECTION_BUILDER)

    def refuse_unused(self, wrapper):
        """A wrapper no group came through: say why, as well as we can tell."""
        s = self.s
        title = _names.WRAPPER_TITLES[wrapper.kind]
        target, references = self.wrapper_name(wrapper)
        for reference in references:
            holder = s.parent(reference)
            if isinstance(holder, cst.Attribute) and holder.attr.value in (
                    "compute_gradients", "apply_gradients"):
                self.refuse_gradients(reference, target.value)
                return
        if self.refuse_on_object(wrapper):
            return
        if s.loop_around(wrapper.call) is not None:
            self.refuse(wrapper.call, "built-in-loop",
                        "This %s is built in a loop or comprehension: the tool cannot tell the "
                        "optimizers apart. Unroll it (one wrapper per network, side by side), "
                        "then run the tool again, or write one scaler.add() per optimizer by "
                        "hand." % title,
                        SECTION_PORT)
        elif s.function_of(wrapper.call) is not None and not (
                isinstance(s.parent(wrapper.call), cst.Assign)
                and len(s.parent(wrapper.call).targets) == 1):
            self.refuse(wrapper.call, "optimizer-through-function",
                        "This %s is made in function %s() and handed on: the tool cannot "
                        "follow it. Make it where it is minimized (inline the function), then "
                        "run the tool again, or write one scaler.add() per optimizer by hand."
                        % (title, s.function_of(wrapper.call).name.value), SECTION_PORT)
        elif not self.runs_once(wrapper.call):
            self.refuse(wrapper.call, "built-in-loop",
                        "This %s is built in a function that may run more than once (called "
                        "from several places or from a loop): the tool cannot tell the "
                        "optimizers apart. Make each network's wrapper where it is minimized, "
                        "side by side, then run the tool again, or write one scaler.add() per "
                        "optimizer by hand." % title,
                        SECTION_PORT)
        else:
            self.refuse(wrapper.call, "wrapper-unfollowed",
                        "The tool cannot find the minimize of this %s: minimize it in this "
                        "file, in the block where it is made, then run the tool again, or write "
                        "one scaler.add() per optimizer by hand." % title, SECTION_PORT)

    def wrapper_checks(self, wrapper, wrapper_statement):
        """Refuses what the builder cannot take from a wrapper; returns its
        ``ManagerUse`` or None."""
        s = self.s
        if wrapper.others:
            self.refuse(wrapper.call, "wrapper-arguments",
                        "This %s call has arguments the tool does not know (%s): drop those that "
                        "are defaults, then run the tool again, or port it by hand."
                        % (_names.WRAPPER_TITLES[wrapper.kind],
                           ", ".join(self.code(a) for a in wrapper.others)))
            return None
        distributed = wrapper.distributed
        if distributed is not None and not (isinstance(distributed, cst.Name)
                                            and distributed.value in ("False", "True")):
            self.refuse(distributed, "distributed",
                        "is_distributed=%s: the builder's cross-device check is "
                        "MultiOptimizerLossScale(..., distributed=\"hccl\"), on or off for the "
                        "whole script: write True or False here (or port it by hand), then "
                        "run the tool again." % self.code(distributed), SECTION_DATA_PARALLEL)
            return None
        inner = wrapper.optimizer
        if isinstance(inner, cst.Name):
            assignments = s.assignments(inner) or ()
            values = [s.assigned_value(a) for a in assignments]
            inner = values[0] if len(values) == 1 else inner
        if s.call_name(inner) == "tensorflow.train.SyncReplicasOptimizer":
            self.refuse(wrapper.optimizer, "distributed",
                        "The wrapped optimizer is %s: the builder's group takes "
                        "npu_lossscale.SyncReplicasOptimizer (the same arguments) with "
                        "build(count_skipped_steps=True), docs/distributed.md, 'Parameter "
                        "servers'; port it by hand." % self.code(inner.func),
                        SECTION_DATA_PARALLEL)
            return None
        if s.call_name(inner) in _names.DISTRIBUTED:
            self.refuse(wrapper.optimizer, "distributed",
                        "The wrapped optimizer averages gradients across workers (%s): the "
                        "builder does that itself, with distributed=\"hccl\". Put "
                        "npu_tf_optimizer(...) around the wrapper instead of %s inside it (the "
                        "tool maps it), then run the tool again, or port it by hand."
                        % (self.code(inner.func), self.code(inner.func)), SECTION_DATA_PARALLEL)
            return None
        return self.manager_of(wrapper, wrapper_statement)

    def check_groups(self, groups):
        """Refuses groups the builder cannot take as they are."""
        s = self.s
        steps = [g for g in groups if g.minimize.global_step is not None]
        if len(steps) > 1:
            for group in steps:
                self.refuse(group.minimize.global_step, "global-step-twice",
                            "global_step is passed to %d minimize calls: it advanced once per "
                            "optimizer. The builder advances it once per step: pass it to one "
                            "minimize (the one whose runs count your steps), then run the tool "
                            "again." % len(steps), SECTION_GLOBAL_STEP)
        inner = collections.OrderedDict()  # a wrapped optimizer's assignment -> its groups
        for group in groups:
            if group.wrapper is not None and isinstance(group.wrapper.optimizer, cst.Name):
                optimizer = group.wrapper.optimizer
                key = _flow.reaching_assignment(s, optimizer) or optimizer.value
                inner.setdefault(key, []).append(group)
        for sharing in inner.values():
            name = sharing[0].wrapper.optimizer.value
            if len(sharing) > 1:
                for group in sharing:
                    self.refuse(group.wrapper.call, "optimizer-reused",
                                "%s is wrapped for %d minimize calls (%s): one optimizer object "
                                "whose Adam beta powers advance once per call (ModelZoo "
                                "BicycleGAN). Give each minimize its own optimizer, then run "
                                "the tool again."
                                % (name, len(sharing), ", ".join(g.name for g in sharing)),
                                SECTION_PORT)
        for group in groups:
            minimize = group.minimize
            if minimize.loss is None:
                self.refuse(minimize.call, "minimize-arguments",
                            "This minimize has no loss argument the tool can read: pass the "
                            "loss as its first argument, then run the tool again.")
            if minimize.others:
                self.refuse(minimize.call, "minimize-arguments",
                            "This minimize passes %s, which scaler.add() does not take: drop "
                            "them if they are defaults, then run the tool again, or port it by "
                            "hand." % ", ".join(self.code(a) for a in minimize.others))
            if minimize.var_list is None:
                self.refuse(minimize.call, "var-list-missing",
                            "This minimize has no var_list: with several optimizers each "
                            "group needs its own variables. Pass var_list=... (e.g. "
                            "tf.trainable_variables(\"generator\")), then run the tool again.")
            if minimize.name is not None:
                value = getattr(minimize.name, "evaluated_value", None)
                if not isinstance(minimize.name, cst.SimpleString) or s.strings[value] > 1:
                    self.refuse(minimize.name, "op-name-used",
                                "This train op's name %s is used elsewhere in the script: the "
                                "builder's op has another name. Reach the op through its variable "
                                "there, drop name=..., then run the tool again."
                                % self.code(minimize.name))
            self.train_op_assignments(group)
        for top in _unique_nodes([g.top for g in groups if g.top is not g.statement]):
            self.check_block(top, groups)

    def train_op_assignments(self, group):
        """The assignments of a group's train op name that its fetches read:
        the ``minimize``'s own, also when the name held the group's optimizer
        just before (``d_optim = Adam(...)``, then ``d_optim =
        Wrapper(d_optim, m).minimize(...)``: ModelZoo's DCGAN), in the same
        block with no other read in between. None (refused) for any other
        second binding."""
        s = self.s
        target = _target(group)
        assignments = s.assignments(target) or []
        own = [a for a in assignments if a.node is target]
        others = [a for a in assignments if a.node is not target
                  and not self.in_other_branch(a.node)]
        if own and not others:
            return own
        optimizer = group.wrapper.optimizer if group.wrapper is not None else (
            group.minimize.receiver)
        before = (_flow.reaching_assignment(s, optimizer)
                  if isinstance(optimizer, cst.Name) and optimizer.value == target.value
                  else None)
        if own and others == [before] and s.block(s.statement(before.node)) is s.block(
                group.statement):
            later = s.references(own)
            stray = [r for r in s.references([before])
                     if r is not optimizer and not any(r is l for l in later)]
            if not stray:
                return own
            self.refuse(stray[0], "train-op-rebound",
                        "%s is read here between the optimizer it holds (line %d) and the train "
                        "op it is bound to (line %d): the tool cannot tell which one this read "
                        "wants. Give the optimizer a name of its own (e.g. %s_opt), then run the "
                        "tool again." % (group.name, s.line(before.node), s.line(group.statement),
                                         group.name), SECTION_PORT)
            return None
        self.refuse(group.minimize.call, "train-op-rebound",
                    "%s is assigned more than once: the tool cannot tell which value each "
                    "session.run fetches. Give the train op a name no other line binds, then "
                    "run the tool again." % group.name)
        return None

    def in_other_branch(self, node):
        """True when ``node`` is in a branch of the ``if`` being ported one
        branch at a time, other than the current one (it never runs with
        the current branch's lines)."""
        arm = self.arm
        return (arm.branch is not None and _flow.inside(self.s, node, arm.branch)
                and not _flow.inside(self.s, node, arm.block))

    def check_block(self, top, groups):
        """A ``tf.control_dependencies`` block of ``minimize`` calls: its
        constructor statements (optimizers, wrappers, managers, with inert
        arguments) move above it (``self.moving``); any other statement is
        refused."""
        statements = list(top.body.body)
        stays = [st for st in statements if any(st is g.statement for g in groups)]
        moving = []
        for index, statement in enumerate(statements):
            if any(statement is st for st in stays):
                continue
            kind = self.constructor(statement)
            if kind is None:
                self.refuse_mixed_block(statement)
                continue
            if kind != "inert":
                self.refuse(statement, "constructor-unmovable",
                            "This constructor inside the tf.control_dependencies block takes "
                            "%s, which may make ops that the block orders after its updates: "
                            "the tool will not move it above the block. Compute it above the "
                            "block (e.g. lr = ...), then run the tool again." % kind,
                            SECTION_UPDATE_OPS)
                continue
            jumped = [st for st in statements[:index] if any(st is k for k in stays)]
            bound, read = _flow.assigned(statement), _flow.read_names(statement)
            clash = [st for st in jumped
                     if bound & (_flow.assigned(st) | _flow.read_names(st))
                     or read & _flow.assigned(st)]
            if clash:
                self.refuse(statement, "constructor-unmovable",
                            "This constructor would move above the tf.control_dependencies "
                            "block, past line %d, which reads or binds a name it binds or reads "
                            "(%s): give that name one meaning in the block, then run the tool "
                            "again." % (self.s.line(clash[0]), ", ".join(sorted(
                                (bound & (_flow.assigned(clash[0])
                                          | _flow.read_names(clash[0])))
                                | (read & _flow.assigned(clash[0]))))), SECTION_UPDATE_OPS)
                continue
            moving.append(statement)
        if moving:
            self.moving[top] = moving

    def constructor(self, statement):
        """What a statement is to ``check_block``: "inert" for ``name =``
        (or ``a = b =``) an optimizer's, a wrapper's or a manager's
        constructor whose arguments make no op (names, attributes, literals,
        such constructors); the text of the first argument that may make one
        for such a constructor otherwise; None for any other statement."""
        if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
            return None
        assign = statement.body[0]
        if not (isinstance(assign, cst.Assign)
                and all(isinstance(t.target, cst.Name) for t in assign.targets)
                and self.is_constructor(assign.value)):
            return None
        for arg in assign.value.args:
            bad = self.op_making(arg.value)
            if bad is not None:
                return self.code(bad)
        return "inert"

    def is_constructor(self, node):
        name = self.s.call_name(node) if isinstance(node, cst.Call) else None
        return bool(name) and (_names.is_tf_optimizer(name) or name in _names.WRAPPERS
                               or name in _names.MANAGERS)

    def op_making(self, expr):
        """The first part of a constructor's argument that may make an op
        (a call, a subscript, arithmetic on names), or None."""
        if isinstance(expr, (cst.Name, cst.SimpleString, cst.ConcatenatedString)) or (
                _flow.is_number(expr)):
            return None
        if isinstance(expr, cst.Attribute):
            return self.op_making(expr.value) if isinstance(expr.value, (
                cst.Name, cst.Attribute)) else expr
        if isinstance(expr, cst.Call) and self.is_constructor(expr):
            for arg in expr.args:
                bad = self.op_making(arg.value)
                if bad is not None:
                    return bad
            return None
        return expr

    def fetch_mode(self, groups):
        """"joint" or "per_group", from how the script's ``session.run``
        calls fetch the train ops; None (refused) otherwise."""
        s = self.s
        sites = collections.OrderedDict()
        last = s.line(groups[-1].statement)
        for group in groups:
            assignments = self.train_op_assignments(group)
            for reference in s.references(assignments):
                site = s.fetch_site(reference) or self.group_site(reference)
                if site is not None and s.line(reference) < last:
                    self.refuse(reference, "fetch-unmapped",
                                "%s is read here, before the last minimize (line %d), where "
                                "build() makes the train ops: move this line after it, then "
                                "run the tool again." % (group.name, last), SECTION_PORT)
                elif site is None:
                    self.refuse(reference, "fetch-unmapped",
                                "%s is used here outside a session.run fetch (a list, a "
                                "function, a control dependency): the tool cannot map it to a "
                                "builder op. Fetch it in session.run (or group every train op "
                                "in one tf.group), then run the tool again." % group.name,
                                SECTION_PORT)
                else:
                    sites.setdefault(site, set()).add(group.name)
        if self.reasons:
            return None
        if not sites:
            for group in groups:
                self.refuse(group.minimize.call, "train-op-unfetched",
                            "No session.run of this file fetches %s: the tool cannot tell one "
                            "step for all groups (update_op) from one per group (per_group). "
                            "Port it by hand where the train ops are run." % group.name,
                            SECTION_PORT)
            return None
        names = set(g.name for g in groups)
        joint = [site for site, fetched in sites.items() if fetched == names]
        single = [site for site, fetched in sites.items() if len(fetched) == 1]
        for site, fetched in sites.items():
            if fetched != names and len(fetched) != 1:
                self.refuse(site, "fetch-unmapped",
                            "This session.run fetches %s but not %s: neither one step for all "
                            "groups nor one group's step. Fetch every train op in one run, or "
                            "one per run, then run the tool again." % (", ".join(sorted(fetched)),
                                                              ", ".join(sorted(names - fetched))),
                            SECTION_PORT)
        if joint and single:
            for site in joint + single:
                self.refuse(site, "fetch-mixed",
                            "Some session.run calls fetch every train op and others one: fetch "
                            "them the same way in every run (all together, or one per run), then "
                            "run the tool again, or bind update_op and per_group ops by hand.",
                            SECTION_PORT)
        if self.reasons:
            return None
        return "per_group" if single else "joint"

    def group_site(self, reference):
        """The ``tf.group(...)`` call that takes ``reference`` as a positional
        argument, or None. A group of every train op is the one step for
        all groups (``update_op``), as a run that fetches them together."""
        arg = self.s.parent(reference)
        call = self.s.parent(arg) if isinstance(arg, cst.Arg) else None
        if (isinstance(call, cst.Call) and arg.keyword is None and not arg.star
                and self.s.call_name(call) == _names.GROUP):
            return call
        return None

    def scoped_statements(self, groups, outer):
        """The statements inside the ``with tf.name_scope(...)`` blocks that
        hold the groups, other than the port's own (the minimize calls, the
        wrappers, the constructors that move); refuses a train op read
        there (it would run before ``build()``, which goes after the
        block)."""
        s = self.s
        ours = [g.top for g in groups] + [g.wrapper_statement for g in groups
                                          if g.wrapper_statement is not None]
        found = []
        for anchor in outer:
            if any(anchor is g.top for g in groups):
                continue
            for statement in _matchers.findall(anchor.body, _matchers.SimpleStatementLine()):
                if not any(s.statement(statement) is o or _flow.inside(s, statement, o)
                           for o in ours):
                    found.append(statement)
        for group in groups:
            for reference in s.references(self.train_op_assignments(group) or []):
                if any(_flow.inside(s, reference, anchor) for anchor in outer
                       if anchor is not group.top):
                    self.refuse(reference, "fetch-unmapped",
                                "%s is read here, inside the tf.name_scope block, before "
                                "build() (which goes after the block): move this line after the "
                                "block, then run the tool again." % group.name, SECTION_PORT)
        return found

    def check_moves(self, groups, body, index, tops, scoped=()):
        """Refuses expressions that would not mean the same at ``build()``
        (or at the scaler) as where the script evaluates them.

        Args:
          groups: the ``Group``s.
          body, index: the builder's block's statements, and their indices.
          tops: the statements of that block that hold the groups.
          scoped: the other statements inside the name scopes among
            ``tops``, which may run between any two places.
        """
        end = index[id(tops[-1])] + 1
        # The port's own statements: the minimize calls' and the wrappers'.
        top_ids = set(id(t) for t in tops) | set(
            id(g.wrapper_statement) for g in groups if g.wrapper_statement is not None)
        s = self.s
        for group in groups:
            here = index[id(self.anchor(group.top))]
            line = s.line(group.top)
            spans = [(e, line, None) for e in (group.minimize.global_step, group.update_ops)]
            if group.manager.origin is not None:
                read = s.line(groups[0].top if group is groups[0] else group.top)
                spans += [(e, s.line(group.manager.origin), read)
                          for e in _manager_reads(group.wrapper)]
            for expr, first, last in spans:  # lines of the scopes between
                between = [st for st in scoped
                           if s.line(st) > first and (last is None or s.line(st) < last)]
                if expr is not None and between and not self.stable(
                        expr, between, -1, len(between), set()):
                    self.refuse(expr, "unmovable",
                                "This argument moves to the builder, past lines inside the "
                                "tf.name_scope blocks that may change it: bind it to a name "
                                "before the first block, and leave it as it is until the "
                                "last, then run the tool again.", SECTION_PORT)
            moving = [(group.minimize.global_step, "global_step", SECTION_GLOBAL_STEP),
                      (group.update_ops, "control_dependencies", SECTION_UPDATE_OPS)]
            for expr, what, section in moving:
                if expr is not None and not self.stable(expr, body, here, end, top_ids):
                    self.refuse(expr, "unmovable",
                                "This %s argument moves to build(), after lines the script "
                                "runs in between that may change it (a new value, or a call "
                                "that reads it): bind it to a name before the first minimize, "
                                "and leave it as it is until the last, then run the tool "
                                "again." % what, section)
            spell = self.spelled.get(group.wrapper.call) if group.wrapper is not None else None
            if spell is not None and spell.node in [body[i] for i in index.values()]:
                self.check_test(spell.node.test, body, index[id(spell.node)],
                                index[id(self.anchor(groups[0].top))])
            origin = group.manager.origin
            if origin is not None:
                start = index.get(id(origin))
                if start is None and (
                        any(origin is st for st in self.moving.get(group.top, ()))
                        or _flow.inside(self.s, origin, body[here])):
                    start = here  # in the group's name scope, or moving above its block
                target = index[id(tops[0])] if group is groups[0] else here
                if start is None or not all(self.stable(expr, body, start, target, top_ids)
                                            for expr in _manager_reads(group.wrapper)):
                    self.refuse_unmovable_manager(group, body, start, target)

    def note_between(self, groups, between, tops):
        """Lists the statements between the first and the last ``minimize``
        that call what may read the graph: they ran after the first groups'
        train ops and optimizer variables were made, and now run before
        ``build()`` makes them all."""
        s = self.s
        first, last = s.line(groups[0].minimize.call), s.line(groups[-1].minimize.call)
        ours = set(id(t) for t in tops) | set(
            id(g.wrapper_statement) for g in groups if g.wrapper_statement is not None)
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
            self.by_hand(statement, "between-minimizes",
                         "This statement runs between the minimize calls (lines %d and %d). "
                         "The builder makes every group's gradients, optimizer slots and train "
                         "ops in build(), after line %d, so a Saver, an initializer or a list "
                         "of global variables made here no longer holds them: move it after "
                         "line %d if it needs them." % (first, last, last, last), SECTION_PORT)

    def stable(self, expr, body, start, end, tops):
        """True when ``expr`` means the same at ``body[end]`` as at
        ``body[start]``: no statement in between rebinds a name it reads or
        makes a call that reads one (``ops.extend(...)``, ``f(ops)`` may
        change it), and if it calls anything, only the port's own statements
        are in between."""
        between = [st for st in body[start + 1:end] if id(st) not in tops]
        if not between:
            return True
        if _flow.calls(expr):
            return False
        read = _flow.read_names(expr)
        return not any(read & (_flow.assigned(st) | (_flow.read_names(st) if _flow.calls(st)
                                                     else set()))
                       for st in between)

    def write_builder(self, groups, mode, tops, last, lifted=None):
        """The builder's statements, and the report of each change.

        Args:
          groups: the ``Group``s.
          mode: "joint" or "per_group".
          tops: the statements the groups' lines replace.
          last: the statement of the builder's block that holds the last
            group: its top, or the name scope around it (``build()`` goes
            after that block).
          lifted: the ops of a ``tf.control_dependencies`` block around the
            branch's if that the builder now gates (``liftable``), or None.
        """
        s = self.s
        scaler, train = _fresh(s.names, "scaler"), _fresh(s.names, "train")
        first = groups[0]
        column = s.column(tops[0])
        per_group = mode == "per_group"
        adds = {}
        for group in groups:
            args = [self.code(group.minimize.loss), group.optimizer,
                    "var_list=" + self.code(group.minimize.var_list),
                    "name=" + _quote(_group_name(group))]
            if group is not first and not _shares(first, group):
                args.append("loss_scale_manager=" + group.manager.code)
            adds[id(group.statement)] = _emit.call_text("%s.add" % scaler, args,
                                                        s.column(group.top))
        found = self.engine(first.wrapper) if first.wrapper is not None else (False, False)
        engine = _engines.engine_args(found)
        scaler_text = _emit.call_text("%s = %s.MultiOptimizerLossScale" % (scaler, self.alias),
                                 [first.manager.code] + engine, column)
        if len(found) == 3:
            self.changed(first.top, "distributed-mapped",
                         "The wrappers were spelled under `if %s:` (%s), else (%s): the builder "
                         "takes %s, the test evaluated where the scaler is made, and sums the "
                         "overflow decision across devices when it reduces, so every device "
                         "applies or skips a step alike." % (
                             found[0], _engines.engine_words(found[1]),
                             _engines.engine_words(found[2]), ", ".join(engine)),
                         SECTION_DATA_PARALLEL)
        elif engine:
            self.changed(first.top, "distributed-mapped",
                         "The wrappers %s: the builder does it with %s, and sums the overflow "
                         "decision across devices, so every device applies or skips a step "
                         "alike." % (_engines.engine_words(found), ", ".join(engine)),
                         SECTION_DATA_PARALLEL)
        build_args = []
        stepped = [g for g in groups if g.minimize.global_step is not None]
        if stepped:
            build_args.append("global_step=" + self.code(stepped[0].minimize.global_step))
        if per_group:
            build_args.append("per_group_ops=True")
        update_ops = self.update_ops_text(groups, per_group, lifted)
        if update_ops:
            build_args.append("update_ops=" + update_ops)
        build_text = _emit.call_text("%s = %s.build" % (train, scaler), build_args, column)
        bindings = ["%s = %s.%s" % (g.name, train, "per_group[%s]" % _quote(_group_name(g))
                                     if per_group else "update_op") for g in groups]
        self.unwrap(groups)
        scoped = last is not tops[-1]
        for top in tops:
            inner = [top] if isinstance(top, cst.SimpleStatementLine) else list(top.body.body)
            moving = self.moving.get(top, [])
            self.statements[top] = _emit.replacement_statements(
                [scaler_text] if top is tops[0] else [],
                [(adds[id(st)], st) for st in inner if not any(st is m for m in moving)],
                [build_text] + bindings if top is tops[-1] and not scoped else [], top,
                s.column(top), self.moved(moving))
        if scoped:  # after the name scope's block, at its indentation
            self.after.setdefault(last, []).extend(
                _emit.parse_at(text, s.column(last)) for text in [_emit.call_text(
                    "%s = %s.build" % (train, scaler), build_args, s.column(last))] + bindings)
        for group in groups:
            self.report_group(group, scaler, per_group)
        self.report_builder(groups, scaler, train, per_group)

    def moved(self, statements):
        """The statements that move above their control_dependencies block,
        with the plan's edits inside them (a manager mapped, a wrapper
        removed), no comment dropped (see ``_emit.statements``' ``moved``). Their
        continuation lines follow them: libcst writes a block's indentation
        before each."""
        found, pending = [], []
        for statement in statements:
            if statement in self.statements:  # a removed `opt = Wrapper(opt)`
                pending.extend(_emit.lost_comments(statement, []))
                found.extend(self.statements.pop(statement))
                continue
            new = statement.visit(_emit.Apply(self.replace))  # its continuation lines follow
            lost = pending + _emit.lost_comments(statement, [new])
            pending = []
            found.append(new.with_changes(leading_lines=list(new.leading_lines) + lost))
        if pending:  # the removed statements' comments go on the next one
            found.append(pending)
        for statement in statements:
            manager = self.s.call_name(statement.body[0].value) in _names.MANAGERS
            self.changed(statement, "constructor-moved",
                         "This line moves above its tf.control_dependencies block, with the "
                         "builder: %s" % (
                             "a manager's variables' initializers no longer wait for the "
                             "block's updates (inside it, running the initializer ran those "
                             "updates and needed their feeds)." if manager else
                             "making an optimizer or a wrapper makes no op that the block "
                             "orders."), SECTION_UPDATE_OPS)
        return found

    def update_ops_text(self, groups, per_group, lifted=None):
        """``build()``'s update_ops: one list for the joint step, or a dict
        by group with per-group ops: ops that several groups' minimize calls
        ran with go to each of them (``update-ops-each-group``)."""
        if per_group:
            holders = collections.OrderedDict()  # the ops' text -> the groups that ran them
            for group in groups:
                if group.update_ops is not None:
                    holders.setdefault(self.code(group.update_ops), []).append(group)
            if lifted is not None:
                holders.setdefault(lifted, []).extend(
                    g for g in groups if g not in holders.get(lifted, []))
            for text, sharing in holders.items():
                if len(sharing) > 1:
                    self.changed(sharing[0].top, "update-ops-each-group",
                                 "%s ran with each of %s's runs, skipped ones too; each of "
                                 "their per-group steps now runs it when it applies. If each "
                                 "network's statistics should move with its own runs only, "
                                 "split them: build(..., update_ops={%s}) with each network's "
                                 "ops (e.g. tf.get_collection(tf.GraphKeys.UPDATE_OPS, scope))."
                                 % (text, ", ".join(g.name for g in sharing),
                                    ", ".join("%s: ..." % _quote(_group_name(g))
                                              for g in sharing)), SECTION_UPDATE_OPS)
            items = ["%s: %s" % (_quote(_group_name(group)), text)
                     for text, sharing in holders.items() for group in sharing]
            return "{%s}" % ", ".join(items) if items else ""
        texts = _unique_texts([self.code(g.update_ops) for g in groups
                               if g.update_ops is not None] + ([lifted] if lifted else []))
        if len(texts) <= 1:
            return texts[0] if texts else ""
        return " + ".join("list(%s)" % text for text in texts)

    def unwrap(self, groups):
        """Each wrapper bound to a name gives way to the optimizer it wrapped."""
        for group in groups:
            wrapper, statement = group.wrapper, group.wrapper_statement
            if wrapper is None:
                continue
            title = _names.WRAPPER_TITLES[wrapper.kind]
            if statement is None:
                self.changed(wrapper.call, "wrapper-removed",
                             "%s is gone: group %s gets the optimizer it wrapped."
                             % (title, _quote(_group_name(group))), SECTION_PORTING)
                continue
            if isinstance(statement, cst.If):
                self.unwrap_spelling(group, title)
                continue
            layers = self.layers.get(wrapper.call, [])
            outer = layers[0] if layers else wrapper.call
            target = _assign_target(statement, outer)
            text = self.unwrapped_text(wrapper)
            if layers and not (target is not None and text == target.value):
                self.replace[outer] = cst.parse_expression(text)
                self.changed(wrapper.call, "wrapper-removed",
                             "%s and npu_bridge's %s around it are gone: %s is %s, and the "
                             "builder scales group %s." % (
                                 title, ", ".join(self.code(l.func) for l in layers),
                                 group.optimizer, text, _quote(_group_name(group))),
                             SECTION_PORTING)
            elif isinstance(wrapper.optimizer, cst.Name) and target is not None and (
                    wrapper.optimizer.value == target.value):
                self.statements[statement] = []
                self.changed(wrapper.call, "wrapper-removed",
                             "This line (%s) is gone: %s stays the optimizer it was, and the "
                             "builder scales group %s." % (title, target.value,
                                                            _quote(_group_name(group))),
                             SECTION_PORTING)
            else:
                self.replace[wrapper.call] = wrapper.optimizer
                self.changed(wrapper.call, "wrapper-removed",
                             "%s is gone: %s is the optimizer it wrapped, and the builder "
                             "scales group %s." % (title, group.optimizer,
                                                    _quote(_group_name(group))), SECTION_PORTING)
            if wrapper.kind == _names.GRAPH_REWRITE:
                self.graph_rewrite_note(wrapper)

    def unwrap_spelling(self, group, title):
        """The ``if``/``else`` of a wrapper's two spellings gives way to the
        optimizer it wrapped (its test moves to the builder's engine)."""
        statement = group.wrapper_statement
        target = _assign_target(statement.body.body[0], self.peel(
            statement.body.body[0].body[0].value))
        text = self.unwrapped_text(group.wrapper)
        if target is None:
            target = statement.body.body[0].body[0].targets[0].target
        if text == target.value:
            self.statements[statement] = []
            said = "%s stays the optimizer it was" % text
        else:
            self.statements[statement] = [_emit.parse_at("%s = %s" % (target.value, text),
                                                    self.s.column(statement))]
            said = "%s = %s" % (target.value, text)
        self.changed(statement, "wrapper-removed",
                     "This if/else (%s, spelled two ways) is gone: %s, and the builder scales "
                     "group %s, its engine following the test." % (title, said,
                                                                 _quote(_group_name(group))),
                     SECTION_PORTING)

    def report_group(self, group, scaler, per_group):
        minimize = group.minimize
        self.changed(minimize.call, "minimize-to-add",
                     "%s = %s.minimize(...) is %s.add(..., name=%s): the same loss, optimizer "
                     "and var_list." % (group.name, self.code(minimize.receiver), scaler,
                                        _quote(_group_name(group))), SECTION_PORTING)
        if minimize.name is not None:
            self.changed(minimize.name, "op-name-dropped",
                         "The op name %s is gone: the builder names its ops under "
                         "loss_scale/." % self.code(minimize.name), SECTION_PORTING)
        if minimize.global_step is not None:
            self.changed(minimize.global_step, "global-step-to-build",
                         "global_step moves to build(global_step=...): it advances once per "
                         "applied step, never on a skipped one.", SECTION_GLOBAL_STEP)
            if per_group:
                self.by_hand(minimize.global_step, "global-step-per-group",
                             "With per-group ops global_step advances on every applied group "
                             "run (here twice per iteration, not once). Check what reads it "
                             "(schedules, checkpoint names): count your own iterations, or "
                             "build(count_skipped_steps=True).", SECTION_GLOBAL_STEP)
        if group.update_ops is not None:
            self.changed(group.top, "update-ops-gated",
                         "with tf.control_dependencies(%s) around %s's minimize is build("
                         "update_ops=...): those updates now run only on applied steps, never "
                         "on skipped ones (with the wrappers they ran on skipped steps too: "
                         "batch-norm statistics no longer take a skipped step's batch)."
                         % (self.code(group.update_ops), group.name),
                         SECTION_UPDATE_OPS)

    def report_builder(self, groups, scaler, train, per_group):
        names = ", ".join(g.name for g in groups)
        first = groups[0]
        around = [o for o in self.dependencies_around(first.top) if o not in self.lift]
        self.changed(first.top, "builder",
                     "One %s.MultiOptimizerLossScale (%s) for the %d optimizers (%s): one "
                     "overflow check per step, and every group applies or none does%s."
                     % (self.alias, scaler, len(groups), names,
                        "; the updates of the tf.control_dependencies block around it (line "
                        "%d) run on skipped steps too, as before (by hand: "
                        "update-ops-not-atomic)" % self.s.line(around[0]) if around else ""),
                     SECTION_PORTING)
        own = [g for g in groups[1:] if not _shares(first, g)]
        if own:
            self.changed(first.top, "manager-per-group",
                         "Each of %s keeps its own manager and scale, as with its own wrapper "
                         "(add(..., loss_scale_manager=...)); the skip decision is shared. "
                         "Pass one manager to share one scale." % ", ".join(
                             g.name for g in [first] + own), SECTION_PER_GROUP_SCALES)
        sharing = [g for g in groups if g is first or _shares(first, g)]
        if not per_group and len(sharing) > 1 and first.wrapper is not None:
            self.changed(first.top, "manager-once-per-step",
                         "%s shared one manager, and each wrapper updated it in the runs that "
                         "fetched them together (%d updates a run); the builder updates it once "
                         "a step, so its growth and decrease periods count steps now, not "
                         "minimize calls." % (", ".join(g.name for g in sharing), len(sharing)),
                         SECTION_PER_GROUP_SCALES)
        if per_group:
            message = ("%s: each is now %s.per_group[name], its group's step: the script's "
                       "session.run calls fetch one train op each, so they run unchanged."
                       % (names, train))
            if self.runs_device_loops():
                self.left_alone(
                    first.top, "alternating-device-loop",
                    "The script runs a device loop (iterations_per_loop), and only the op "
                    "named IterationOp loops: the per_group ops cannot both loop. To loop the "
                    "alternating steps, give each add() a loss callable (add(lambda: "
                    "build_loss(), ...)) and pass build(sequence=[...]) with the groups in "
                    "the order the loop runs them; fetch %s.update_op." % train,
                    SECTION_SEQUENCE)
        else:
            message = ("%s: each is now %s.update_op, the one step for all groups: the "
                       "session.run calls that fetched them together run it once, their lists "
                       "and dicts unchanged." % (names, train))
        self.changed(groups[-1].top, "train-ops-bound", message, SECTION_PORTING)
        if not groups[0].wrapper:
            self.changed(first.top, "scaling-added",
                         "The script had no loss scaling: the builder adds a dynamic scale "
                         "(%s.%s: 2**15, x2 every 2000 finite steps) and skips overflowing "
                         "steps. With float32 compute, pass %s.FixedLossScaleManager(1) "
                         "instead." % (self.alias, _managers.UNSCALED_MANAGER, self.alias),
                         SECTION_MANAGERS)

    def runs_device_loops(self):
        """Whether the script asks tf_adapter for a device loop
        (``iterations_per_loop``, ``set_iteration_per_loop``)."""
        text = self.s.code(self.s.module)
        return "iterations_per_loop" in text or "set_iteration_per_loop" in text

    # -- the import ----------------------------------------------------------------

    def add_import(self):
        """``import npu_lossscale as nl`` after the module's leading imports
        (once, however many branches are ported)."""
        if any(e.rule == "import-added" for e in self.entries):
            return
        body = self.s.module.body
        text = ("import npu_lossscale as nl" if self.alias == "nl"
                else "import npu_lossscale")
        statement = cst.parse_statement(text + "\n")
        anchor = None
        for index, top in enumerate(body):
            if _is_import(top):
                anchor = top
            elif anchor is not None and _is_call_statement(top):
                # matplotlib.use("Agg") before pyplot's import, sys.path.insert(...):
                # part of the imports, which the added one must not split
                anchor = top
            elif not (index == 0 and _is_docstring(top)):
                break
        if anchor is not None:
            self.after.setdefault(anchor, []).append(statement)
            self.changed(anchor, "import-added", "Added `%s` after the script's imports."
                         % text)
            return
        rest = body[1:] if body and _is_docstring(body[0]) else body
        if rest:
            self.before.setdefault(rest[0], []).append(statement)
            self.changed(rest[0], "import-added", "Added `%s`." % text)


# -- helpers ----------------------------------------------------------------------

def _branch_blocks(if_node):
    """The blocks of an ``if``'s branches: its body, each ``elif``'s, and
    the ``else``'s."""
    blocks = [if_node.body]
    orelse = if_node.orelse
    while orelse is not None:
        blocks.append(orelse.body)
        orelse = orelse.orelse if isinstance(orelse, cst.If) else None
    return [b for b in blocks if isinstance(b, cst.IndentedBlock)]


def _group_name(group):
    """The builder's name for a group: its train op's name, less a leading
    "_" (a group's name is a TF name scope, which cannot start with one)."""
    return group.name.lstrip("_") or "group"


def _target(group):
    """The ``cst.Name`` a group's train op is assigned to."""
    return _assign_target(group.statement, group.minimize.call)


def _shares(first, group):
    """True when ``group`` uses the same manager object as ``first``."""
    return group.manager.key is not None and group.manager.key == first.manager.key


def _assign_target(statement, value):
    """The Name of ``name = value`` when ``statement`` is exactly that."""
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    assign = statement.body[0]
    if not (isinstance(assign, cst.Assign) and assign.value is value
            and len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name)):
        return None
    return assign.targets[0].target


def _manager_reads(wrapper):
    """The expressions a wrapper's manager is built from, which move with
    it: a manager call's arguments, or the manager's name."""
    scale = wrapper.scale
    if isinstance(scale, cst.Call):
        return [arg.value for arg in scale.args]
    return [scale] if isinstance(scale, (cst.Name, cst.Attribute)) else []


def _position(body, statement):
    for index, candidate in enumerate(body):
        if candidate is statement:
            return index
    return None


def _unique_nodes(nodes):
    seen, found = set(), []
    for node in nodes:
        if id(node) not in seen:
            seen.add(id(node))
            found.append(node)
    return found


def _unique_texts(texts):
    found = []
    for text in texts:
        if text not in found:
            found.append(text)
    return found


def _quote(name):
    return '"%s"' % name


def _fresh(taken, base):
    """``base``, or ``base_1``, ``base_2``... : the first name the module does
    not use."""
    if base not in taken:
        return base
    number = 1
    while "%s_%d" % (base, number) in taken:
        number += 1
    return "%s_%d" % (base, number)


def _is_import(statement):
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(small, (cst.Import, cst.ImportFrom)) for small in statement.body)


def _is_call_statement(statement):
    """True for a line of calls alone (``matplotlib.use("Agg")``)."""
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)
        for small in statement.body)


def _is_docstring(statement):
    return (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1
            and isinstance(statement.body[0], cst.Expr)
            and isinstance(statement.body[0].value, (cst.SimpleString,
                                                     cst.ConcatenatedString)))


#: Calls between two ``minimize`` calls that read nothing a ``minimize``
#: makes (its variables are not trainable).
_NOT_READING_THE_GRAPH = frozenset(["tensorflow.trainable_variables", "print", "len"])


#: Methods of names' strings (``var.name.startswith("g")`` in a list of
#: variables): they read no graph.
_STRING_METHODS = frozenset(["startswith", "endswith", "split", "lower", "upper", "replace",
                             "format", "join", "strip"])
