"""Emitting the code: the statements and expressions that take the
original's place, as edit records.

The drop-in's ``nl.LossScaleOptimizer(...)``; the builder's scaler, its
``add()`` calls, ``build()`` and the bindings of the train ops; the
wrappers that give way to the optimizers they wrapped; the constructors
that move above their ``tf.control_dependencies`` block; the import. The
lines are written by ``_emit``; what the report says of them comes from
``_entries``.
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst

from npu_lossscale.tools.port import _emit, _engines, _entries, _flow, _names, _trace
from npu_lossscale.tools.port._edits import (After, Before, Lift, Replace, Statements, Unset,
                                             node_tables)


def drop_in(m, wrapper, manager, sync):
    """The edits of the drop-in: ``nl.LossScaleOptimizer(optimizer, manager)``
    in the wrapper's place, ``nl.SyncReplicasOptimizer`` for TF's inside it
    (``sync``: the ``SyncReplicasOptimizer`` call inside or around it, or
    None)."""
    s, edits = m.s, []
    args = [_trace.code(s, wrapper.optimizer), manager.code]
    inside = sync is not None and sync is _engines.inner_value(s, wrapper.optimizer)
    if inside:
        ours = sync.with_changes(func=cst.parse_expression(
            "%s.SyncReplicasOptimizer" % m.alias))
        if sync is wrapper.optimizer:
            args[0] = _trace.code(s, ours)
        else:
            edits.append(Replace(sync, ours))
    if wrapper.distributed is not None:
        args.append("is_distributed=" + _trace.code(s, wrapper.distributed))
    if sync is not None:
        args.append("count_skipped_steps=True")
        edits.extend(_entries.sync_replicas_mapped(m.alias, sync, inside))
    text = _emit.call_text("%s.LossScaleOptimizer" % m.alias, args, s.column(wrapper.call))
    edits.append(Replace(wrapper.call, _emit.parse_expression_at(
        text, s.column(s.statement(wrapper.call)))))
    return edits


def liftable(m, outer):
    """``(owner, edits)``: the ``with tf.control_dependencies(X):`` around
    the if whose branch holds the builder, when it can go: it holds that if
    alone, X is a name nothing in it binds, the builder's lines are the
    branch's own, and no other branch scales; else ``(None, [])``. The
    builder's ``build(update_ops=X)`` then gates X, and the other branches
    keep the block around their lines, as before."""
    arm, s = m.arm, m.s
    if arm.branch is None or any(s.block(o) is not arm.block for o in outer):
        return None, []
    around = _trace.dependencies_around(s, outer[0])
    owner = s.owner(s.block(arm.branch))
    if not (around and owner is around[0] and len(owner.body.body) == 1):
        return None, []
    ops = _trace.control_dependencies(s, owner)
    others = [b for b in _trace.branch_blocks(arm.branch) if b is not arm.block]
    if not (isinstance(ops, cst.Name) and ops.value not in _flow.assigned(owner.body)
            and not any(_flow.inside(s, w.call, b) for w in s.wrappers for b in others)):
        return None, []
    return owner, [Lift(owner, _trace.branch_blocks(arm.branch).index(arm.block)),
                   _entries.update_ops_lifted(owner, ops)]


def builder(m, groups, mode, tops, last, moving, done, lifted=None, lifted_nodes=()):
    """The builder's statements, and the report of each change.

    Args:
      m: the ``_trace.Script``.
      groups: the ``Group``s.
      mode: "joint" or "per_group".
      tops: the statements the groups' lines replace.
      last: the statement of the builder's block that holds the last group:
        its top, or the name scope around it (``build()`` goes after that
        block).
      moving: ``_checks.Checked.moving``.
      done: the module's edits so far (the managers mapped where they stand
        go with the lines that move).
      lifted: the ops of a ``tf.control_dependencies`` block around the
        branch's if that the builder now gates (``liftable``), or None.
      lifted_nodes: the blocks lifted in the module so far.

    Returns:
      The edits.
    """
    s = m.s
    scaler, train = _fresh(s.names, "scaler"), _fresh(s.names, "train")
    first = groups[0]
    column = s.column(tops[0])
    per_group = mode == "per_group"
    edits = []
    adds = {}
    for group in groups:
        args = [_trace.code(s, group.minimize.loss), group.optimizer,
                "var_list=" + _trace.code(s, group.minimize.var_list),
                "name=" + quote(group_name(group))]
        if group is not first and not shares(first, group):
            args.append("loss_scale_manager=" + group.manager.code)
        adds[id(group.statement)] = _emit.call_text("%s.add" % scaler, args,
                                                    s.column(group.top))
    found = _engines.engine(s, first)
    engine = _engines.engine_args(found)
    scaler_text = _emit.call_text("%s = %s.MultiOptimizerLossScale" % (scaler, m.alias),
                                  [first.manager.code] + engine, column)
    edits.extend(_entries.distributed_mapped(first, found, engine))
    build_args = []
    stepped = [g for g in groups if g.minimize.global_step is not None]
    if stepped:
        build_args.append("global_step=" + _trace.code(s, stepped[0].minimize.global_step))
    if per_group:
        build_args.append("per_group_ops=True")
    update_ops, told = update_ops_text(m, groups, per_group, lifted)
    edits.extend(told)
    if update_ops:
        build_args.append("update_ops=" + update_ops)
    build_text = _emit.call_text("%s = %s.build" % (train, scaler), build_args, column)
    bindings = ["%s = %s.%s" % (g.name, train, "per_group[%s]" % quote(group_name(g))
                                 if per_group else "update_op") for g in groups]
    edits.extend(unwrap(m, groups))
    scoped = last is not tops[-1]
    computes = [g.minimize.compute for g in groups if g.minimize.compute is not None]
    for top in tops:
        inner = [top] if isinstance(top, cst.SimpleStatementLine) else list(top.body.body)
        movers = moving.get(top, [])
        lines, moved_edits = moved(m, movers, list(done) + edits)
        edits.extend(moved_edits)
        lines = _computes_removed(m, groups, top, lines, edits)
        edits.append(Statements(top, _emit.replacement_statements(
            [scaler_text] if top is tops[0] else [],
            [(adds[id(st)], st) for st in inner if not any(st is x for x in movers + computes)],
            [build_text] + bindings if top is tops[-1] and not scoped else [], top,
            s.column(top), lines)))
    if scoped:  # after the name scope's block, at its indentation
        edits.append(After(last, [_emit.parse_at(text, s.column(last)) for text in [
            _emit.call_text("%s = %s.build" % (train, scaler), build_args, s.column(last))]
            + bindings], None))
    for group in groups:
        edits.extend(_entries.group_changes(s, group, scaler, per_group))
    edits.extend(_entries.builder_changes(m, groups, scaler, train, per_group, lifted_nodes))
    return edits


def _computes_removed(m, groups, top, lines, edits):
    """``lines`` (see ``moved``) with the comments of the ``compute_gradients``
    statements of ``top``'s groups, which go with their ``apply_gradients``
    into one ``add()``; a compute statement outside ``top`` (beside it in
    its block) is removed (an edit added to ``edits``)."""
    comments = []
    for group in groups:
        compute = group.minimize.compute
        if compute is None or group.top is not top:
            continue
        comments.extend(_emit.lost_comments(compute, []))
        if isinstance(top, cst.SimpleStatementLine):
            edits.append(Statements(compute, []))
    if not comments:
        return lines
    if lines and isinstance(lines[-1], list):
        return list(lines[:-1]) + [lines[-1] + comments]
    return list(lines) + [comments]


def moved(m, statements, done):
    """``(lines, edits)``: the statements that move above their
    control_dependencies block, with the edits ``done`` made inside them (a
    manager mapped, a wrapper removed, taken back where it stood: ``Unset``),
    no comment dropped (see ``_emit.statements``' ``moved``); and the
    report's entries. Their continuation lines follow them: libcst writes
    a block's indentation before each."""
    replace, replaced = node_tables(done)
    found, pending, edits = [], [], []
    for statement in statements:
        if statement in replaced:  # a removed `opt = Wrapper(opt)`
            pending.extend(_emit.lost_comments(statement, []))
            found.extend(replaced[statement])
            edits.append(Unset(statement))
            continue
        new = statement.visit(_emit.Apply(replace))  # its continuation lines follow
        lost = pending + _emit.lost_comments(statement, [new])
        pending = []
        found.append(new.with_changes(leading_lines=list(new.leading_lines) + lost))
    if pending:  # the removed statements' comments go on the next one
        found.append(pending)
    for statement in statements:
        manager = m.s.call_name(statement.body[0].value) in _names.MANAGERS
        edits.append(_entries.constructor_moved(statement, manager))
    return found, edits


def update_ops_text(m, groups, per_group, lifted=None):
    """``(text, edits)``: ``build()``'s update_ops: one list for the joint
    step, or a dict by group with per-group ops: ops that several groups'
    minimize calls ran with go to each of them (``update-ops-each-group``)."""
    s = m.s
    if per_group:
        holders = collections.OrderedDict()  # the ops' text -> the groups that ran them
        for group in groups:
            if group.update_ops is not None:
                holders.setdefault(_trace.code(s, group.update_ops), []).append(group)
        if lifted is not None:
            holders.setdefault(lifted, []).extend(
                g for g in groups if g not in holders.get(lifted, []))
        edits = [_entries.update_ops_each_group(text, sharing)
                 for text, sharing in holders.items() if len(sharing) > 1]
        items = ["%s: %s" % (quote(group_name(group)), text)
                 for text, sharing in holders.items() for group in sharing]
        return ("{%s}" % ", ".join(items) if items else ""), edits
    texts = _unique_texts([_trace.code(s, g.update_ops) for g in groups
                           if g.update_ops is not None] + ([lifted] if lifted else []))
    if len(texts) <= 1:
        return (texts[0] if texts else ""), []
    return " + ".join("list(%s)" % text for text in texts), []


def unwrap(m, groups):
    """The edits by which each wrapper bound to a name gives way to the
    optimizer it wrapped."""
    s, edits = m.s, []
    for group in groups:
        wrapper, statement = group.wrapper, group.wrapper_statement
        if wrapper is None:
            continue
        title = _names.WRAPPER_TITLES[wrapper.kind]
        if statement is None:
            edits.append(_entries.wrapper_removed(wrapper.call, title, group))
            continue
        if isinstance(statement, cst.If):
            edits.extend(unwrap_spelling(m, group, title))
            continue
        outer = group.layers[0] if group.layers else wrapper.call
        target = _trace.assign_target(statement, outer)
        text = _engines.unwrapped_text(s, wrapper, group.layers)
        if group.layers and not (target is not None and text == target.value):
            edits.append(Replace(outer, cst.parse_expression(text)))
            edits.append(_entries.wrapper_removed(
                wrapper.call, title, group, layers=", ".join(
                    _trace.code(s, l.func) for l in group.layers), text=text))
        elif isinstance(wrapper.optimizer, cst.Name) and target is not None and (
                wrapper.optimizer.value == target.value):
            edits.append(Statements(statement, []))
            edits.append(_entries.wrapper_removed(wrapper.call, title, group,
                                                  kept=target.value))
        else:
            edits.append(Replace(wrapper.call, wrapper.optimizer))
            edits.append(_entries.wrapper_removed(wrapper.call, title, group,
                                                  text=group.optimizer))
        if wrapper.kind == _names.GRAPH_REWRITE:
            edits.append(_entries.graph_rewrite_session_config(wrapper))
    return edits


def unwrap_spelling(m, group, title):
    """The edits by which the ``if``/``else`` of a wrapper's two spellings
    gives way to the optimizer it wrapped (its test moves to the builder's
    engine)."""
    statement = group.wrapper_statement
    target = _trace.assign_target(statement.body.body[0], _engines.peel(
        m.s, statement.body.body[0].body[0].value).node)
    text = _engines.unwrapped_text(m.s, group.wrapper, group.layers)
    if target is None:
        target = statement.body.body[0].body[0].targets[0].target
    if text == target.value:
        edit = Statements(statement, [])
        said = "%s stays the optimizer it was" % text
    else:
        edit = Statements(statement, [_emit.parse_at("%s = %s" % (target.value, text),
                                                     m.s.column(statement))])
        said = "%s = %s" % (target.value, text)
    return [edit, _entries.spelling_removed(statement, title, said, group)]


def add_import(m):
    """``import npu_lossscale as nl`` after the module's leading imports
    (the first of these edits is kept, however many branches are ported)."""
    body = m.s.module.body
    text = "import npu_lossscale as nl" if m.alias == "nl" else "import npu_lossscale"
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
        return [After(anchor, [statement], "import"),
                _entries.import_added(anchor, "Added `%s` after the script's imports." % text)]
    rest = body[1:] if body and _is_docstring(body[0]) else body
    if rest:
        return [Before(rest[0], [statement], "import"),
                _entries.import_added(rest[0], "Added `%s`." % text)]
    return []


def group_name(group):
    """The builder's name for a group: its train op's name, less a leading
    "_" (a group's name is a TF name scope, which cannot start with one)."""
    return group.name.lstrip("_") or "group"


def shares(first, group):
    """True when ``group`` uses the same manager object as ``first``."""
    return group.manager.key is not None and group.manager.key == first.manager.key


def quote(name):
    return '"%s"' % name


def _unique_texts(texts):
    found = []
    for text in texts:
        if text not in found:
            found.append(text)
    return found


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

