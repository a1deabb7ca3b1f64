"""The builder's checks: the refusal rules applied to the traced groups.

Before the builder is written, its groups must be takeable as they are
(``check_groups``), their train ops fetched one way (``fetch_mode``), and
what moves to ``build()`` or to the scaler must mean the same there
(``check_moves``). Each function returns what it decided as a record, with
the refusals of ``_rules``; none writes a shared table.
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst
import libcst.matchers as _matchers

from npu_lossscale.tools.port import _engines, _flow, _managers, _names, _rules, _trace
from npu_lossscale.tools.port._sections import SECTION_GLOBAL_STEP, SECTION_UPDATE_OPS

#: What ``check_groups`` decided.
#:
#: Attributes:
#:   moving: dict from a ``tf.control_dependencies`` block of ``minimize``
#:     calls to its constructor statements that move above it.
#:   edits: the refusals.
Checked = collections.namedtuple("Checked", ["moving", "edits"])

#: How the script fetches the train ops (see ``fetch_mode``).
#:
#: Attributes:
#:   mode: "joint" or "per_group", or None (refused).
#:   edits: the refusals.
Fetching = collections.namedtuple("Fetching", ["mode", "edits"])


#: Functions a statement moved above a ``tf.control_dependencies`` block
#: may call: they read the graph's collections and make no op (``tvars =
#: [v for v in tf.trainable_variables() if v.name.startswith("g")]``).
_COLLECTION_READERS = frozenset(["tensorflow.trainable_variables", "tensorflow.global_variables",
                                 "tensorflow.get_collection", "tensorflow.local_variables",
                                 "tensorflow.model_variables", "len"])
_STRING_METHODS = frozenset(["startswith", "endswith", "split", "lower", "upper", "strip"])


def chains(m, groups):
    """``(groups, edits)``: the groups with ``after`` set where a
    ``with tf.control_dependencies([d_train, ...]):`` around a group's lines
    holds nothing but earlier groups' train ops (Pix2Pix's generator
    trains after its discriminator). Those blocks are no update ops: they
    go, and ``fetch_mode`` counts the ops they named as fetched with the
    group's. A block that names a train op beside other dependencies, or a
    later group's, is refused (``train-op-dependency``)."""
    names = set(g.name for g in groups)
    found, edits = [], []
    for index, group in enumerate(groups):
        deps = group.update_ops
        if deps is None or not _flow.read_names(deps) & names:
            found.append(group)
            continue
        earlier = set(g.name for g in groups[:index])
        elements = [e.value for e in getattr(deps, "elements", ())]
        if not (isinstance(deps, (cst.List, cst.Tuple)) and elements and all(
                isinstance(e, cst.Name) and e.value in earlier for e in elements)):
            edits.extend(_rules.train_op_dependency(m.s, group, deps))
            found.append(group)
            continue
        found.append(group._replace(update_ops=None, after=tuple(elements)))
    return found, edits


def check_groups(m, groups):
    """The refusals of groups the builder cannot take as they are, and the
    constructors that move above their blocks (a ``Checked``)."""
    s = m.s
    edits = list(_rules.global_step_twice(groups))
    inner = collections.OrderedDict()  # a wrapped optimizer's assignment -> its groups
    for group in groups:
        if group.wrapper is not None and isinstance(group.wrapper.optimizer, cst.Name):
            optimizer = group.wrapper.optimizer
            key = _flow.reaching_assignment(s, optimizer) or optimizer.value
            inner.setdefault(key, []).append(group)
    for sharing in inner.values():
        if len(sharing) > 1:
            edits.extend(_rules.optimizer_reused(s, name=sharing[0].wrapper.optimizer.value,
                                                 sharing=sharing))
    for group in groups:
        edits.extend(_rules.minimize_arguments(s, group.minimize))
        edits.extend(_rules.var_list_missing(group.minimize))
        edits.extend(_rules.op_name_used(s, group.minimize))
        edits.extend(train_op_assignments(m, group)[1])
    moving = {}
    for top in unique_nodes([g.top for g in groups if g.top is not g.statement]):
        chained = [g for g in groups if g.top is top and g.after]
        movers, found = check_block(s, top, groups, chained[0] if chained else None)
        edits.extend(found)
        if movers:
            moving[top] = movers
    return Checked(moving, edits)


def check_block(scanner, top, groups, chained=None):
    """``(moving, edits)`` for a ``tf.control_dependencies`` block of
    ``minimize`` calls: its constructor statements (optimizers, wrappers,
    managers, with inert arguments) move above it, and so do the
    statements before its first ``minimize`` that only read the graph's
    collections (a var_list); any other statement is refused (for the
    block of a group ordered after another's train op, ``chained``, with
    the message of that block)."""
    statements = list(top.body.body)
    stays = [st for st in statements if any(st is o for o in _trace.own_statements(groups))]
    moving, edits = [], []
    for index, statement in enumerate(statements):
        if any(statement is st for st in stays):
            continue
        kind = constructor(scanner, statement)
        if kind is None and not any(st in stays for st in statements[:index]) and (
                collection_read(scanner, statement)):
            kind = "inert"
        if kind is None and chained is not None:
            edits.extend(_rules.train_op_dependency(scanner, chained, chained.top,
                                                    statement=statement))
            continue
        if kind is None:
            edits.extend(_rules.control_dependencies_mixed(scanner, statement))
            continue
        if kind != "inert":
            edits.extend(_rules.constructor_unmovable(scanner, statement, argument=kind))
            continue
        jumped = [st for st in statements[:index] if any(st is k for k in stays)]
        bound, read = _flow.assigned(statement), _flow.read_names(statement)
        clash = [st for st in jumped
                 if bound & (_flow.assigned(st) | _flow.read_names(st))
                 or read & _flow.assigned(st)]
        if clash:
            edits.extend(_rules.constructor_unmovable(
                scanner, statement, clash=clash[0],
                names=(bound & (_flow.assigned(clash[0]) | _flow.read_names(clash[0])))
                | (read & _flow.assigned(clash[0]))))
            continue
        moving.append(statement)
    return moving, edits


def constructor(scanner, statement):
    """What a statement is to ``check_block``: "inert" for ``name =`` (or
    ``a = b =``) an optimizer's, a wrapper's or a manager's constructor
    whose arguments make no op (names, attributes, literals, such
    constructors); the text of the first argument that may make one for
    such a constructor otherwise; None for any other statement."""
    if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
        return None
    assign = statement.body[0]
    if not (isinstance(assign, cst.Assign)
            and all(isinstance(t.target, cst.Name) for t in assign.targets)
            and is_constructor(scanner, assign.value)):
        return None
    for arg in assign.value.args:
        bad = op_making(scanner, arg.value)
        if bad is not None:
            return _trace.code(scanner, bad)
    return "inert"


def collection_read(scanner, statement):
    """True for ``name = expr`` where ``expr`` makes no op: names,
    literals, attributes, lists and comprehensions of them, the graph's
    collections (``_COLLECTION_READERS``) and string methods."""
    if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1
            and isinstance(statement.body[0], cst.Assign)
            and all(isinstance(t.target, cst.Name) for t in statement.body[0].targets)):
        return False
    return _op_free(scanner, statement.body[0].value)


def _op_free(scanner, expr):
    """True when evaluating ``expr`` can make no op (see ``collection_read``)."""
    if isinstance(expr, (cst.Name, cst.SimpleString, cst.ConcatenatedString)) or (
            _flow.is_number(expr)):
        return True
    if isinstance(expr, cst.Attribute):
        return _op_free(scanner, expr.value)
    if isinstance(expr, (cst.List, cst.Tuple)):
        return all(_op_free(scanner, e.value) for e in expr.elements)
    if isinstance(expr, cst.BooleanOperation):
        return _op_free(scanner, expr.left) and _op_free(scanner, expr.right)
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not):
        return _op_free(scanner, expr.expression)
    if isinstance(expr, cst.ListComp):
        clauses, node = [], expr.for_in
        while node is not None:
            clauses.append(node)
            node = node.inner_for_in
        return _op_free(scanner, expr.elt) and all(
            isinstance(c.target, cst.Name) and _op_free(scanner, c.iter)
            and all(_op_free(scanner, i.test) for i in c.ifs) for c in clauses)
    if isinstance(expr, cst.Call):
        method = (isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _STRING_METHODS
                  and _op_free(scanner, expr.func.value))
        return ((method or scanner.call_name(expr) in _COLLECTION_READERS)
                and all(not a.star and _op_free(scanner, a.value) for a in expr.args))
    return False


def is_constructor(scanner, node):
    """True for a call of an optimizer's, a wrapper's or a manager's class."""
    name = scanner.call_name(node) if isinstance(node, cst.Call) else None
    return bool(name) and (_names.is_tf_optimizer(name) or name in _names.WRAPPERS
                           or name in _names.MANAGERS)


def op_making(scanner, expr):
    """The first part of a constructor's argument that may make an op (a
    call, a subscript, arithmetic on names), or None."""
    if isinstance(expr, (cst.Name, cst.SimpleString, cst.ConcatenatedString)) or (
            _flow.is_number(expr)):
        return None
    if isinstance(expr, cst.Attribute):
        return op_making(scanner, expr.value) if isinstance(expr.value, (
            cst.Name, cst.Attribute)) else expr
    if isinstance(expr, cst.Call) and is_constructor(scanner, expr):
        for arg in expr.args:
            bad = op_making(scanner, arg.value)
            if bad is not None:
                return bad
        return None
    return expr


def fetch_mode(m, groups):
    """The ``Fetching``: "joint" or "per_group", from how the script's
    ``session.run`` calls fetch the train ops (a run of a group ordered
    after others' train ops, ``Group.after``, runs those too); None
    (refused) otherwise."""
    s = m.s
    sites = collections.OrderedDict()
    last = s.line(groups[-1].statement)
    edits = []
    chained = [r for g in groups for r in g.after]
    for group in groups:
        for reference in s.references(train_op_assignments(m, group)[0]):
            if any(reference is r for r in chained):
                continue  # its block goes: the run of the group after it runs it
            site = s.fetch_site(reference) or group_site(s, reference)
            if site is not None and s.line(reference) < last:
                edits.extend(_rules.fetch_unmapped(reference, group.name, last=last))
            elif site is None:
                edits.extend(_rules.fetch_unmapped(reference, group.name, outside=True))
            else:
                sites.setdefault(site, set()).add(group.name)
    if edits:
        return Fetching(None, edits)
    if not sites:
        return Fetching(None, _rules.train_op_unfetched(groups))
    names = set(g.name for g in groups)
    for fetched in sites.values():  # a run of a group ordered after a train op runs that op
        for group in groups[::-1]:
            if group.name in fetched:
                fetched.update(r.value for r in group.after)
    joint = [site for site, fetched in sites.items() if fetched == names]
    single = [site for site, fetched in sites.items() if len(fetched) == 1]
    for site, fetched in sites.items():
        if fetched != names and len(fetched) != 1:
            edits.extend(_rules.fetch_unmapped(None, None, site=site, fetched=fetched,
                                               names=names))
    edits.extend(_rules.fetch_mixed(joint, single))
    if single and not edits:
        edits.extend(e for g in groups if g.after
                     for e in _rules.train_op_dependency(s, g, g.top, fetch=True))
    if edits:
        return Fetching(None, edits)
    return Fetching("per_group" if single else "joint", [])


def scoped_statements(m, groups, outer):
    """``(found, edits)``: the statements inside the ``with
    tf.name_scope(...)`` blocks that hold the groups, other than the port's
    own (the minimize calls, the wrappers, the constructors that move); and
    the refusals of a train op read there (it would run before
    ``build()``, which goes after the block)."""
    s = m.s
    ours = [g.top for g in groups] + [g.wrapper_statement for g in groups
                                      if g.wrapper_statement is not None] + [
        g.minimize.compute for g in groups if g.minimize.compute is not None]
    found, edits = [], []
    for anchor in outer:
        if any(anchor is g.top for g in groups):
            continue
        for statement in _matchers.findall(anchor.body, _matchers.SimpleStatementLine()):
            if not any(s.statement(statement) is o or _flow.inside(s, statement, o)
                       for o in ours):
                found.append(statement)
    chained = [r for g in groups for r in g.after]
    for group in groups:
        for reference in s.references(train_op_assignments(m, group)[0] or []):
            if any(reference is r for r in chained):
                continue
            if any(_flow.inside(s, reference, anchor) for anchor in outer
                   if anchor is not group.top):
                edits.extend(_rules.fetch_unmapped(reference, group.name, scoped=True))
    return found, edits


def check_moves(m, groups, body, tops, scoped, moving):
    """The refusals of expressions that would not mean the same at
    ``build()`` (or at the scaler) as where the script evaluates them.

    Args:
      m: the ``_trace.Script``.
      groups: the ``Group``s.
      body: the builder's block's statements.
      tops: the statements of that block that hold the groups.
      scoped: the other statements inside the name scopes among ``tops``,
        which may run between any two places.
      moving: ``Checked.moving``.
    """
    s = m.s
    index = dict((id(statement), i) for i, statement in enumerate(body))
    end = index[id(tops[-1])] + 1
    # The port's own statements: the minimize calls' and the wrappers'.
    top_ids = set(id(t) for t in tops + _trace.own_statements(groups)) | set(
        id(g.wrapper_statement) for g in groups if g.wrapper_statement is not None)
    edits = []
    for group in groups:
        here = index[id(_trace.anchor(s, group.top))]
        line = s.line(group.top)
        spans = [(e, line, None) for e in (group.minimize.global_step, group.update_ops)]
        if group.manager.origin is not None:
            read = s.line(groups[0].top if group is groups[0] else group.top)
            spans += [(e, s.line(group.manager.origin), read)
                      for e in manager_reads(group.wrapper)]
        for expr, first, last in spans:  # lines of the scopes between
            between = [st for st in scoped
                       if s.line(st) > first and (last is None or s.line(st) < last)]
            if expr is not None and between and not stable(
                    expr, between, -1, len(between), set()):
                edits.extend(_rules.unmovable(s, expr, scoped=True))
        moves = [(group.minimize.global_step, "global_step", SECTION_GLOBAL_STEP),
                 (group.update_ops, "control_dependencies", SECTION_UPDATE_OPS)]
        for expr, what, section in moves:
            if expr is not None and not stable(expr, body, here, end, top_ids):
                edits.extend(_rules.unmovable(s, expr, what=what, section=section))
        spell = group.spelling
        if spell is not None and spell.node in [body[i] for i in index.values()]:
            edits.extend(_engines.check_test(s, spell.node.test, body, index[id(spell.node)],
                                             index[id(_trace.anchor(s, groups[0].top))]))
        origin = group.manager.origin
        if origin is not None:
            start = index.get(id(origin))
            if start is None and (any(origin is st for st in moving.get(group.top, ()))
                                  or _flow.inside(s, origin, body[here])):
                start = here  # in the group's name scope, or moving above its block
            target = index[id(tops[0])] if group is groups[0] else here
            if start is None or not all(stable(expr, body, start, target, top_ids)
                                        for expr in manager_reads(group.wrapper)):
                edits.extend(_managers.unmovable_manager(s, group, body, start, target))
    return edits


def stable(expr, body, start, end, tops):
    """True when ``expr`` means the same at ``body[end]`` as at
    ``body[start]``: no statement in between rebinds a name it reads or
    makes a call that reads one (``ops.extend(...)``, ``f(ops)`` may change
    it), and if it calls anything, only the port's own statements are in
    between."""
    between = [st for st in body[start + 1:end] if id(st) not in tops]
    if not between:
        return True
    if _flow.calls(expr):
        return False
    read = _flow.read_names(expr)
    return not any(read & (_flow.assigned(st) | (_flow.read_names(st) if _flow.calls(st)
                                                 else set()))
                   for st in between)


def manager_reads(wrapper):
    """The expressions a wrapper's manager is built from, which move with
    it: a manager call's arguments, or the manager's name."""
    scale = wrapper.scale
    if isinstance(scale, cst.Call):
        return [arg.value for arg in scale.args]
    return [scale] if isinstance(scale, (cst.Name, cst.Attribute)) else []


def unique_nodes(nodes):
    """``nodes`` without repeats (by identity), in order."""
    seen, found = set(), []
    for node in nodes:
        if id(node) not in seen:
            seen.add(id(node))
            found.append(node)
    return found


def train_op_assignments(m, group_):
    """``(assignments, edits)``: the assignments of a group's train op name
    that its fetches read: the ``minimize``'s own, also when the name held
    the group's optimizer just before (``d_optim = Adam(...)``, then
    ``d_optim = Wrapper(d_optim, m).minimize(...)``: ModelZoo's DCGAN), in
    the same block with no other read in between. None (refused) for any
    other second binding."""
    s = m.s
    target = _trace.assign_target(group_.statement, group_.minimize.call)
    assignments = s.assignments(target) or []
    own = [a for a in assignments if a.node is target]
    others = [a for a in assignments if a.node is not target
              and not _trace.in_other_branch(m, a.node)]
    if own and not others:
        return own, []
    optimizer = group_.wrapper.optimizer if group_.wrapper is not None else (
        group_.minimize.receiver)
    before = (_flow.reaching_assignment(s, optimizer)
              if isinstance(optimizer, cst.Name) and optimizer.value == target.value
              else None)
    if own and others == [before] and s.block(s.statement(before.node)) is s.block(
            group_.statement):
        later = s.references(own)
        stray = [r for r in s.references([before])
                 if r is not optimizer and not any(r is l for l in later)]
        if not stray:
            return own, []
        return None, _rules.train_op_rebound(s, group_, stray=stray[0], before=before)
    return None, _rules.train_op_rebound(s, group_)


def group_site(scanner, reference):
    """The ``tf.group(...)`` call that takes ``reference`` as a positional
    argument, or None. A group of every train op is the one step for all
    groups (``update_op``), as a run that fetches them together."""
    arg = scanner.parent(reference)
    call = scanner.parent(arg) if isinstance(arg, cst.Arg) else None
    if (isinstance(call, cst.Call) and arg.keyword is None and not arg.star
            and scanner.call_name(call) == _names.GROUP):
        return call
    return None

