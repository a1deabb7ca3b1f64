"""Tracing where the optimizers, wrappers and managers come from.

For each ``minimize`` call: which part of the module it is ported in (an
``Arm``), the assignment its optimizer comes from, through a wrapper and
npu_bridge's distributed layers or an ``if`` that spells the wrapper two
ways, and the manager the wrapper reads. The functions return what they
find as records (``Group``, ``Traced``) with the edits made on the way (the
managers mapped, the refusals of ``_rules``); none writes a shared table.
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst

from npu_lossscale.tools.port import _engines, _flow, _managers, _names, _rules
from npu_lossscale.tools.port._find import bind_args as _bind
from npu_lossscale.tools.port._find import last_name as _last_name

#: A part of a module the plan ports on its own.
#:
#: Attributes:
#:   branch: the ``cst.If`` whose branches are ported one by one, or None
#:     (the whole module).
#:   block: the branch's ``IndentedBlock``, or None.
Arm = collections.namedtuple("Arm", ["branch", "block"])

#: What the steps read of the module while they port one ``Arm``.
#:
#: Attributes:
#:   s: the ``_find.Scanner`` at the end of its walk.
#:   alias: the name the port imports the library as ("nl", or
#:     "npu_lossscale" when the script uses the name nl).
#:   arm: the ``Arm``.
#:   minimizes: the ``_find.Minimize`` calls of the arm.
#:   wrappers: the ``_find.Wrapper`` calls of the arm.
Script = collections.namedtuple("Script", ["s", "alias", "arm", "minimizes", "wrappers"])

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
#:   manager: the ``_managers.ManagerUse``.
#:   layers: npu_bridge's distributed layers around the wrapper ([] for none).
#:   spelling: the ``_engines.Spelling`` the wrapper is a branch of, or None.
#:   after: the names (``cst.Name``s) of the earlier groups' train ops that
#:     ``top``, a ``with tf.control_dependencies([d_train]):``, orders this
#:     group after (``_checks.chains``); () for none.
Group = collections.namedtuple("Group", ["name", "minimize", "statement", "top", "update_ops",
                                         "optimizer", "wrapper", "wrapper_statement", "manager",
                                         "layers", "spelling", "after"], defaults=((),))

def own_statements(groups):
    """The statements the groups' lines are: each ``minimize`` statement,
    and the ``compute_gradients`` statement of a pair (``_find.Minimize``),
    which goes with its ``apply_gradients``."""
    found = [g.statement for g in groups]
    return found + [g.minimize.compute for g in groups if g.minimize.compute is not None]


#: What tracing one ``minimize`` found.
#:
#: Attributes:
#:   group: the ``Group``, or None (refused).
#:   seen: the wrapper calls the ``minimize`` was traced to (refused or not).
#:   edits: the edits made on the way.
Traced = collections.namedtuple("Traced", ["group", "seen", "edits"])

#: Where a ``minimize``'s optimizer comes from (see ``optimizer_source``).
Source = collections.namedtuple("Source", ["wrapper", "statement", "optimizer", "layers",
                                           "spelling"])

_BUILDER_KEY = "builder"  # the one manager of a port without loss scaling


def code(scanner, node):
    """The source text of ``node``, stripped."""
    return scanner.code(node).strip()


def arms(scanner):
    """The parts of the module to port one at a time: the whole module
    (one ``Arm`` whose block is None), or, when every ``minimize`` and
    wrapper is inside one ``if`` statement with ``minimize`` calls in
    more than one of its branches (a precision ``if/else``: loss scaling
    in one branch, plain ``minimize`` in the other; or the spellings of
    a ``RANK_SIZE`` test), each branch; the condition stays."""
    s = scanner
    whole = [Arm(None, None)]
    nodes = [m.call for m in s.minimizes] + [w.call for w in s.wrappers]
    if not s.minimizes:
        return whole
    branch = s.parent(s.statement(s.minimizes[0].call))
    while branch is not None and not isinstance(branch, (cst.If, cst.FunctionDef)):
        branch = s.parent(branch)
    while isinstance(branch, cst.If):
        blocks = branch_blocks(branch)
        holding = [b for b in blocks if any(_flow.inside(s, m.call, b) for m in s.minimizes)]
        if (len(holding) > 1 and all(_flow.inside(s, n, branch) for n in nodes)
                and all(any(_flow.inside(s, n, b) for b in blocks) for n in nodes)):
            return [Arm(branch, b) for b in holding]
        branch = s.parent(branch)
        while branch is not None and not isinstance(branch, (cst.If, cst.FunctionDef)):
            branch = s.parent(branch)
    return whole


def branch_blocks(if_node):
    """The blocks of an ``if``'s branches: its body, each ``elif``'s, and
    the ``else``'s."""
    blocks = [if_node.body]
    orelse = if_node.orelse
    while orelse is not None:
        blocks.append(orelse.body)
        orelse = orelse.orelse if isinstance(orelse, cst.If) else None
    return [b for b in blocks if isinstance(b, cst.IndentedBlock)]


def runs_once(scanner, node, outer=()):
    """True when ``node`` is built once per graph: in no loop, and in no
    function called from more than one place or from a call that may run
    more than once (``outer``: the functions whose calls are being
    followed; a recursion is not once)."""
    s = scanner
    if s.loop_around(node) is not None:
        return False
    function = s.function_of(node)
    while function is not None:
        sites = s.call_sites.get(function.name.value, ())
        if len(sites) > 1 or function in outer:
            return False
        if s.loop_around(function) is not None:
            return False
        if any(not runs_once(s, site, tuple(outer) + (function,)) for site in sites):
            return False
        function = s.function_of(function)
    return True


def wrapper_name(scanner, wrapper):
    """``(name, references)``: the ``cst.Name`` a wrapper call is
    assigned to (``name = Wrapper(...)``) and the names that read that
    assignment; ``(None, [])`` for a wrapper used otherwise."""
    s = scanner
    parent = s.parent(wrapper.call)
    if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1
            and isinstance(parent.targets[0].target, cst.Name)):
        return None, []
    target = parent.targets[0].target
    assignment = [a for a in (s.assignments(target) or ()) if a.node is target]
    return target, s.references(assignment)


def wrapper_minimizes(m, wrapper):
    """The ``minimize`` calls of the arm made on ``wrapper``'s object
    (inline, or through the name it is assigned to)."""
    receivers = [wrapper.call] + wrapper_name(m.s, wrapper)[1]
    return [x for x in m.minimizes if any(x.receiver is r for r in receivers)]


def handed_to_functions(scanner, wrapper):
    """The calls of the script's own functions that take the name
    ``wrapper`` is assigned to as an argument."""
    s = scanner
    calls = []
    for reference in wrapper_name(s, wrapper)[1]:
        arg = s.parent(reference)
        call = s.parent(arg) if isinstance(arg, cst.Arg) else None
        if isinstance(call, cst.Call) and _last_name(call) in s.functions:
            calls.append(call)
    return calls


def control_dependencies(scanner, with_node):
    """X of ``with tf.control_dependencies(X):`` (the only item), else None."""
    if len(with_node.items) != 1 or with_node.items[0].asname is not None:
        return None
    call = with_node.items[0].item
    if scanner.call_name(call) != _names.CONTROL_DEPENDENCIES:
        return None
    bound, others = _bind(call, ["control_inputs"])
    if others or "control_inputs" not in bound:
        return None
    return bound["control_inputs"].value


def dependencies_around(scanner, statement):
    """The ``with tf.control_dependencies(...)`` statements around the
    block that holds ``statement``, innermost first, up to its function:
    those whose ops every run of what is built inside runs."""
    found = []
    node = scanner.parent(statement)
    while node is not None and not isinstance(node, (cst.FunctionDef, cst.ClassDef)):
        if isinstance(node, cst.With) and control_dependencies(scanner, node) is not None:
            found.append(node)
        node = scanner.parent(node)
    return found


def top_of(scanner, statement):
    """``(top, update_ops)``: the statement of the builder's block that
    holds ``statement``, and the ``control_dependencies`` argument."""
    owner = scanner.owner(scanner.block(statement))
    if isinstance(owner, cst.With) and control_dependencies(scanner, owner) is not None:
        return owner, control_dependencies(scanner, owner)
    return statement, None


def anchor(scanner, top):
    """The statement of the builder's block that holds ``top``: ``top``,
    or the outermost ``with tf.name_scope(...)`` around it (wrappers and
    minimize calls in name scopes, as Pix2Pix has them: the scopes stay,
    so the variables made in them keep their names)."""
    s, node = scanner, top
    while True:
        owner = s.owner(s.block(node))
        if not (isinstance(owner, cst.With) and len(owner.items) == 1
                and s.call_name(owner.items[0].item) == _names.NAME_SCOPE):
            return node
        node = owner


def assign_target(statement, value):
    """The Name of ``name = value`` when ``statement`` is exactly that."""
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    assign = statement.body[0]
    if not (isinstance(assign, cst.Assign) and assign.value is value
            and len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name)):
        return None
    return assign.targets[0].target


def in_other_branch(m, node):
    """True when ``node`` is in a branch of the ``if`` being ported one
    branch at a time, other than the current one (it never runs with the
    current branch's lines)."""
    arm = m.arm
    return (arm.branch is not None and _flow.inside(m.s, node, arm.branch)
            and not _flow.inside(m.s, node, arm.block))


def group(m, minimize, wrappers, scaled, mapped):
    """Traces one ``minimize`` call to its ``Group``.

    Args:
      m: the ``Script``.
      minimize: the ``_find.Minimize``.
      wrappers: dict from a wrapper call to its ``_find.Wrapper``.
      scaled: whether the module has loss scaling (a ``minimize`` without a
        wrapper is then refused).
      mapped: the manager calls mapped so far.

    Returns:
      A ``Traced``.
    """
    s = m.s
    statement = s.statement(minimize.call)
    target = assign_target(statement, minimize.call)
    if target is None:
        return Traced(None, [], _rules.train_op_unfollowed(minimize))
    if s.loop_around(minimize.call) is not None:
        return Traced(None, [], _rules.built_in_loop(minimize=minimize))
    top, update_ops = top_of(s, statement)
    seen, edits, source = optimizer_source(m, minimize, top, wrappers)
    if source is None:
        return Traced(None, seen, edits)
    if scaled and source.wrapper is None:
        return Traced(None, seen, _rules.mixed_scaling(minimize))
    if source.wrapper is not None:
        manager, edits = wrapper_checks(m, source.wrapper, source.statement, mapped)
        if manager is None:
            return Traced(None, seen, edits)
    else:
        edits, manager = [], _managers.ManagerUse(
            "%s.%s" % (m.alias, _managers.UNSCALED_MANAGER), _BUILDER_KEY, None)
    return Traced(Group(target.value, minimize, statement, top, update_ops, source.optimizer,
                        source.wrapper, source.statement, manager, source.layers,
                        source.spelling), seen, edits)


def optimizer_source(m, minimize, top, wrappers):
    """``(seen, edits, source)``: the wrapper calls a minimize's receiver
    was traced to, the refusals, and its ``Source`` (None: refused)."""
    s = m.s
    receiver = minimize.receiver
    if isinstance(receiver, cst.Call):
        peeled = _engines.peel(s, receiver)
        if peeled.node in wrappers:
            wrapper = wrappers[peeled.node]
            if wrapper.optimizer is None:
                return [peeled.node], _rules.wrapper_arguments(s, wrapper, unread=True), None
            return [peeled.node], [], Source(wrapper, None, _engines.unwrapped_text(
                s, wrapper, peeled.layers), peeled.layers, None)
        if _names.is_tf_optimizer(s.call_name(peeled.node)):
            return [], [], Source(None, None, code(s, peeled.node), [], None)
        return [], _unfollowed(s, minimize), None
    if not isinstance(receiver, cst.Name):
        return [], _unfollowed(s, minimize), None
    own = s.statement(minimize.call)
    target = assign_target(own, minimize.call)
    assignments = [a for a in s.assignments(receiver) or () if a.node is not target]
    places = [(order(s, s.statement(a.node), top), a, s.statement(a.node))
              for a in assignments]
    position = order(s, own, own)
    spell = _engines.spelling_if(s, assignments, wrappers)
    if spell is not None:  # the if stands for its two assignments
        branch = [a for a in assignments if _flow.inside(s, a.node, spell.node)]
        places = [p for p in places if not any(p[1] is a for a in branch)] + [
            (order(s, spell.node, top), branch[0], spell.node)]
    if not places or any(p is None or p >= position
                         or not (isinstance(statement, cst.SimpleStatementLine)
                                 or spell is not None and statement is spell.node)
                         for p, _, statement in places):
        return [], _unfollowed(s, minimize), None
    _, source, statement = max(places, key=lambda p: p[0])
    peeled = _engines.peel(s, s.assigned_value(source))
    value = peeled.node
    allowed = [receiver] + (s.references([a for a in s.assignments(receiver)
                                            if a.node is target]) if target is not None
                            and target.value == receiver.value else [])
    if minimize.compute is not None:  # the pair's compute_gradients
        allowed.append(minimize.compute.body[0].value.func.value)
    wrapper, seen = wrappers.get(value), []
    if wrapper is not None:
        seen.append(value)
        if wrapper.optimizer is None:
            return seen, _rules.wrapper_arguments(s, wrapper, unread=True), None
        for spelled in (spell.wrappers if spell is not None else [wrapper]):
            seen.append(spelled.call)
            if isinstance(spelled.optimizer, cst.Name):
                allowed.append(spelled.optimizer)
    elif not _names.is_tf_optimizer(s.call_name(value)):
        return seen, _unfollowed(s, minimize), None
    for reference in s.references(assignments):
        if in_other_branch(m, reference):
            continue  # never runs with this branch's lines
        if not any(reference is a for a in allowed):
            return seen, _other_use(s, receiver.value, reference), None
    if wrapper is None:
        return seen, [], Source(None, None, receiver.value, [], None)
    spelling = spell if spell is not None and any(wrapper is w for w in spell.wrappers) else None
    return seen, [], Source(wrapper, statement, receiver.value, peeled.layers, spelling)


def order(scanner, statement, top):
    """Where ``statement`` runs before the statements of ``top``'s block,
    as a sortable tuple of indices from the builder's block down (a
    statement of an enclosing block, or of ``top``'s own
    control_dependencies block); None for a statement elsewhere (a
    branch, another function)."""
    mine = statement_path(scanner, statement)
    theirs = statement_path(scanner, top)
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


def statement_path(scanner, statement):
    """``[(block, index), ...]`` from the outermost block of
    ``statement``'s function (or module) down to ``statement``, or None
    when a part of it is no plain block (an ``else``, a one-line suite)."""
    found, node = [], statement
    while True:
        block = scanner.parent(node)
        if not isinstance(block, (cst.IndentedBlock, cst.Module)):
            return None
        found.append((block, position(list(block.body), node)))
        owner = None if isinstance(block, cst.Module) else scanner.parent(block)
        if owner is None or isinstance(owner, (cst.FunctionDef, cst.ClassDef)):
            return list(reversed(found))
        node = owner


def position(body, statement):
    """The index of ``statement`` in ``body`` (by identity), or None."""
    for index, candidate in enumerate(body):
        if candidate is statement:
            return index
    return None


def on_object(scanner, wrapper, minimized):
    """``wrapper-on-object`` for a wrapper kept in an object's attribute or
    item (``self.opt = Wrapper(...)``), or built in a class and minimized
    nowhere the tool sees (``minimized`` empty); [] for any other."""
    parent = scanner.parent(wrapper.call)
    stored = [code(scanner, t.target) for t in getattr(parent, "targets", ())
              if isinstance(parent, cst.Assign) and not isinstance(t.target, cst.Name)]
    node, method, klass = wrapper.call, None, None
    while node is not None and klass is None:
        node = scanner.parent(node)
        if isinstance(node, cst.FunctionDef) and method is None:
            method = node.name.value
        elif isinstance(node, cst.ClassDef):
            klass = node.name.value
    if not stored and (klass is None or minimized):
        return []  # a local name in a method, minimized there, is followed
    where = ("in %s of class %s" % ("method %s()" % method if method else "the body", klass)
             if klass else "")
    return _rules.wrapper_on_object(wrapper, where, "kept in %s" % ", ".join(stored)
                                    if stored else "")


def _unfollowed(scanner, minimize):
    """``optimizer-unfollowed``, naming the if's branch that binds the
    receiver when there is one (a one-line ``if fp16: opt = Wrapper(opt, m)``
    with no else is such a branch: the statement is the if itself)."""
    s, receiver = scanner, minimize.receiver
    branches = [s.statement(a.node) for a in (
        s.assignments(receiver) or () if isinstance(receiver, cst.Name) else ())
                if isinstance(s.owner(s.block(s.statement(a.node))), (cst.If, cst.Else))
                or isinstance(s.statement(a.node), cst.If)]
    return _rules.optimizer_unfollowed(s, minimize, branches[0] if branches else None)


def _other_use(scanner, name, reference):
    """The rule for a read of the optimizer's name besides its minimize."""
    parent = scanner.parent(reference)
    method = parent.attr.value if isinstance(parent, cst.Attribute) else None
    if method == "minimize":
        return _rules.optimizer_reused(scanner, name=name, reference=reference)
    if method in ("compute_gradients", "apply_gradients"):
        return _rules.compute_apply_gradients(reference, name)
    return _rules.optimizer_used_elsewhere(name, reference)


def unused_wrapper(m, wrapper):
    """Why no group came through ``wrapper``, as well as we can tell."""
    s = m.s
    target, references = wrapper_name(s, wrapper)
    for reference in references:
        holder = s.parent(reference)
        if isinstance(holder, cst.Attribute) and holder.attr.value in (
                "compute_gradients", "apply_gradients"):
            return _rules.compute_apply_gradients(reference, target.value)
    kept = on_object(s, wrapper, wrapper_minimizes(m, wrapper))
    if kept:
        return kept
    if s.loop_around(wrapper.call) is not None:
        return _rules.built_in_loop(wrapper=wrapper)
    if s.function_of(wrapper.call) is not None and not (
            isinstance(s.parent(wrapper.call), cst.Assign)
            and len(s.parent(wrapper.call).targets) == 1):
        return _rules.optimizer_through_function(s, wrapper)
    if not runs_once(s, wrapper.call):
        return _rules.built_in_loop(wrapper=wrapper, function=True)
    return _rules.wrapper_unfollowed(wrapper)


def wrapper_checks(m, wrapper, wrapper_statement, mapped):
    """``(manager, edits)``: the wrapper's ``ManagerUse`` (None: refused,
    what the builder cannot take from it) and the edits."""
    s = m.s
    if wrapper.others:
        return None, _rules.wrapper_arguments(s, wrapper)
    distributed = wrapper.distributed
    if distributed is not None and not (isinstance(distributed, cst.Name)
                                        and distributed.value in ("False", "True")):
        return None, _rules.distributed(s, distributed, literal=True)
    inner = wrapper.optimizer
    if isinstance(inner, cst.Name):
        assignments = s.assignments(inner) or ()
        values = [s.assigned_value(a) for a in assignments]
        inner = values[0] if len(values) == 1 else inner
    if s.call_name(inner) == "tensorflow.train.SyncReplicasOptimizer":
        return None, _rules.distributed(s, wrapper.optimizer, func=inner.func, sync=True)
    if s.call_name(inner) in _names.DISTRIBUTED:
        return None, _rules.distributed(s, wrapper.optimizer, func=inner.func)
    use, edits = _managers.manager_of(m, wrapper, wrapper_statement, mapped)
    return use, edits
