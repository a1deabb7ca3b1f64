"""The managers in the port: which manager object a wrapper's name holds
where it reads it (two managers under one name, one manager under two),
and what each of npu_bridge's, contrib's and TF's becomes among ours.

Each function takes the scanner (in a ``_trace.Script``) and the manager
calls mapped so far, and returns what it found with its edits: the managers
mapped where they stand (``Replace``, ``Mapped``), the report's entries and
the refusals.
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst

from npu_lossscale.tools.port import _emit, _flow, _names, _rules
from npu_lossscale.tools.port._edits import Mapped, Replace, changed, left_alone, refused
from npu_lossscale.tools.port._find import bind_args as _bind
from npu_lossscale.tools.port._sections import SECTION_MANAGERS

#: The loss-scale manager a group uses.
#:
#: Attributes:
#:   code: the expression to write (a name, or a new manager).
#:   key: what makes two groups' managers the same object (the assignment of
#:     the name they share), or None for a manager of its own.
#:   origin: the statement the expression comes from when it must move (a
#:     manager built inside the wrapper), else None.
ManagerUse = collections.namedtuple("ManagerUse", ["code", "key", "origin"])

#: A ``ManagerUse`` (None: refused) and the edits that found it.
Mapping = collections.namedtuple("Mapping", ["use", "edits"])

#: The manager a port without loss scaling adds (TF's DynamicLossScale defaults).
UNSCALED_MANAGER = "DynamicLossScaleManager()"


def manager_of(m, wrapper, statement, mapped):
    """The ``Mapping`` of a wrapper's loss scale.

    Args:
      m: the ``_trace.Script``.
      wrapper: the ``_find.Wrapper``.
      statement: the statement binding the wrapper to a name (where the
        manager expression moves from), or None.
      mapped: the manager calls mapped so far.
    """
    s = m.s
    expr = wrapper.scale
    if wrapper.kind in (_names.TF_MIXED_PRECISION, _names.GRAPH_REWRITE):
        return tf_loss_scale(m, wrapper, statement)
    if expr is None:
        return Mapping(None, _rules.wrapper_arguments(s, wrapper, no_manager=True))
    if isinstance(expr, cst.Call) and expr in s.managers:
        text, edits = mapped_manager(m, expr)
        return Mapping(None if text is None else ManagerUse(text, None, statement), edits)
    if isinstance(expr, cst.Name):
        value = manager_value(s, expr)
        if isinstance(value, cst.Call) and value in s.managers:
            edits = map_in_place(m, value, mapped)
            if refused(edits):
                return Mapping(None, edits)
        else:
            edits = manager_kept(s, expr)
        return Mapping(ManagerUse(expr.value, value, statement), edits)
    edits = manager_kept(s, expr)
    if statement is not None:
        return Mapping(None, edits + _rules.manager_unfollowed(s, expr))
    return Mapping(ManagerUse(_code(s, expr), None, None), edits)


def manager_value(scanner, name):
    """The expression a manager's name holds where the wrapper reads it:
    the value of the assignment that read gets, through aliases
    (``g_manager = d_manager``, ``d_manager = g_manager = Manager()``);
    None when the order of statements does not prove which one it is
    (then each group names its manager, and no two are taken for one).

    Two wrappers share a manager exactly when their values are the same
    node: a name bound twice (``loss_scale_manager = ...`` before each
    wrapper, as Pix2Pix has it) holds two managers."""
    seen = []
    while isinstance(name, cst.Name) and not any(name is n for n in seen):
        seen.append(name)
        assignment = _flow.reaching_assignment(scanner, name)
        if assignment is None:
            return None
        value = _flow.assigned_value(scanner, assignment)
        if value is None:
            return None
        if not isinstance(value, cst.Name):
            return value
        name = value
    return None


def manager_kept(scanner, expr):
    """A manager the tool does not map, passed on as it is."""
    return [left_alone(expr, "manager-kept",
                       "The manager %s is not one the tool maps; it is kept as it is (the "
                       "library takes npu_bridge's and contrib's managers too)."
                       % _code(scanner, expr), SECTION_MANAGERS)]


def tf_loss_scale(m, wrapper, statement):
    """TF's ``loss_scale`` argument as one of our managers (a ``Mapping``)."""
    expr = wrapper.scale
    alias = m.alias
    edits = []
    if expr is None or (isinstance(expr, cst.SimpleString)
                        and expr.evaluated_value == "dynamic"):
        text = "%s.%s" % (alias, UNSCALED_MANAGER)
        rule = "a dynamic scale: %s (TF's DynamicLossScale defaults: 2**15, x2 every " \
               "2000 finite steps)" % text
    elif _flow.is_number(expr):
        text = "%s.FixedLossScaleManager(%s)" % (alias, _code(m.s, expr))
        rule = "a fixed scale: %s" % text
    elif isinstance(expr, cst.Call) and expr in m.s.managers:
        text, edits = mapped_manager(m, expr)
        if text is None:
            return Mapping(None, edits)
        rule = text
    else:
        return Mapping(None, _rules.loss_scale_argument(m.s, expr))
    if "FixedLossScaleManager" in rule:
        rule += (". This changes one thing: TF's FixedLossScale applies every step, "
                 "non-finite gradients included, and the builder skips a step whose "
                 "gradients overflow (add enable_overflow_check=False to apply them as TF "
                 "did)")
    edits = edits + [changed(expr if expr is not None else wrapper.call, "loss-scale-mapped",
                             "%s's loss_scale is %s." % (_names.WRAPPER_TITLES[wrapper.kind],
                                                         rule), SECTION_MANAGERS)]
    return Mapping(ManagerUse(text, None, statement), edits)


def mapped_manager(m, call):
    """``(text, edits)``: the text of our manager for a recognised manager
    call (None: refused, an argument we do not know), and the edits."""
    mapping = m.s.managers[call]
    known = [theirs for theirs, _ in mapping.keywords]
    ours = dict(mapping.keywords)
    bound, others = _bind(call, known)
    if others:
        return None, _rules.manager_arguments(m.s, call, mapping)
    args = []
    for theirs in known:
        arg = bound.get(theirs)
        if arg is None:
            continue
        value = _code(m.s, arg.value)
        args.append(value if arg.keyword is None else "%s=%s" % (ours[theirs], value))
    edits = [Mapped(call)]
    if mapping.origin != "tensorflow":
        edits.append(changed(call, "manager-mapped",
                             "%s's %s is %s.%s, same arguments."
                             % (mapping.origin, mapping.ours, m.alias, mapping.ours),
                             SECTION_MANAGERS))
    return "%s.%s(%s)" % (m.alias, mapping.ours, ", ".join(args)), edits


def map_in_place(m, call, mapped):
    """The edits that map a manager call where it stands (its function only:
    npu_bridge's and contrib's arguments are ours); none for a call in
    ``mapped``; a refusal for arguments we do not know."""
    if call in mapped:
        return []
    mapping = m.s.managers[call]
    _, others = _bind(call, [theirs for theirs, _ in mapping.keywords])
    if others or mapping.origin == "tensorflow":
        return _rules.manager_arguments(m.s, call, mapping)
    func = cst.parse_expression("%s.%s" % (m.alias, mapping.ours))
    shift = len(_code(m.s, func)) - len(_code(m.s, call.func))
    if isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
        shift = 0  # a hanging indent stays where it is
    return [Replace(call, call.with_changes(func=func, args=_emit.shift(call.args, shift))),
            Mapped(call),
            changed(call, "manager-mapped", "%s's %s is %s.%s, same arguments."
                    % (mapping.origin, mapping.ours, m.alias, mapping.ours), SECTION_MANAGERS)]


def unmovable_manager(scanner, group, body, start, target):
    """A wrapper's manager that would not mean the same where the builder
    reads it (``body[target]``; bound at ``body[start]``): the refusal that
    says the edit that lets the tool go on."""
    scale = group.wrapper.scale
    if isinstance(scale, cst.Name) and start is not None:
        again = [st for st in body[start + 1:target] if scale.value in _flow.assigned(st)]
        if again:
            return _rules.unmovable(scanner, group.wrapper.call, group=group, again=again[0])
    return _rules.unmovable(scanner, group.wrapper.call, group=group)


def _code(scanner, node):
    return scanner.code(node).strip()
