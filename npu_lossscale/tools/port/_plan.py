"""Deciding the rewrite: what each pattern becomes, and what cannot be proved.

``plan(scanner, path)`` reads what ``_find.Scanner`` recorded and returns a
``_edits.Plan``: the node edits for ``_rewrite`` and the report's entries.
It takes one of three roads per part of the module (``_trace.arms``):

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

Each road runs the steps in order: tracing (``_trace``), the refusal rules
(``_rules``, applied to the builder's groups by ``_checks``), the manager
mapping (``_managers``), emitting the code (``_generate``) and the report
(``_entries``). Each step returns edit records; the road adds them to the
module's list, and ``_edits.merge`` makes the ``Plan`` of that list.
"""

from __future__ import absolute_import, division, print_function

import libcst as cst

from npu_lossscale.tools.port import (_checks, _edits, _engines, _entries, _flow, _managers,
                                      _names, _rules, _trace, _generate)
from npu_lossscale.tools.port._edits import refused


def plan(scanner, path):
    """Plans the rewrite of one module.

    Args:
      scanner: a ``_find.Scanner`` at the end of its walk.
      path: the module's path for the report.

    Returns:
      A ``_edits.Plan``.
    """
    s = scanner
    alias = "nl" if "nl" not in s.names else "npu_lossscale"
    edits = [_entries.npu_init_import(s.star_npu)] if s.star_npu is not None else []
    if s.library_import is not None:
        if s.wrappers:
            edits.extend(_rules.already_ported_mixed(s.wrappers))
        else:
            edits.append(_entries.already_ported(s.library_import))
        return _edits.merge(s, path, edits)
    for arm in _trace.arms(s):
        m = _trace.Script(s, alias, arm,
                          [x for x in s.minimizes if arm.block is None
                           or _flow.inside(s, x.call, arm.block)],
                          [w for w in s.wrappers if arm.block is None
                           or _flow.inside(s, w.call, arm.block)])
        edits.extend(_road(m, edits))
    if not refused(edits):
        mapped = _edits.mapped_calls(edits)
        edits.extend(_entries.manager_unused(call, s.managers[call].origin)
                     for call in s.managers
                     if call not in mapped and s.managers[call].origin != "tensorflow")
    return _edits.merge(s, path, edits)


def _road(m, done):
    """The edits of one ``Arm`` (``done``: the module's edits so far)."""
    if m.arm.block is not None and not m.wrappers:
        return [_entries.branch_unscaled(m.s, m.arm)]
    if not m.wrappers:
        if len(m.minimizes) == 1:
            return [_entries.unscaled_single(m.minimizes[0])]
        return builder(m, done, scaled=False) if m.minimizes else []
    if len(m.wrappers) == 1 and _trace.runs_once(m.s, m.wrappers[0].call):
        return drop_in(m, m.wrappers[0], done)
    return builder(m, done, scaled=True)


def drop_in(m, wrapper, done):
    """One wrapper: ``nl.LossScaleOptimizer`` in its place."""
    s = m.s
    if isinstance(s.parent(wrapper.call), cst.Expr):
        return _rules.wrapper_unfollowed(wrapper, dropped=True)
    minimizes = _trace.wrapper_minimizes(m, wrapper)
    edits = _trace.on_object(s, wrapper, minimizes)
    if edits:
        return edits
    if len(minimizes) > 1:
        return _rules.optimizer_reused(s, minimizes=minimizes)
    for call in _trace.handed_to_functions(s, wrapper):
        edits.extend(_rules.optimizer_through_function(s, wrapper, call))
    if refused(edits) or refused(done):
        return edits
    if wrapper.optimizer is None or wrapper.others:
        return _rules.wrapper_arguments(s, wrapper, drop_in=True)
    manager, edits = _managers.manager_of(m, wrapper, None, _edits.mapped_calls(done))
    if manager is None:
        return edits
    edits = edits + _generate.drop_in(m, wrapper, manager, _engines.sync_replicas(s, wrapper))
    edits.append(_entries.drop_in(m.alias, wrapper))
    if wrapper.kind == _names.GRAPH_REWRITE:
        edits.append(_entries.graph_rewrite_session_config(wrapper))
    for minimize in minimizes:
        for owner in _trace.dependencies_around(s, s.statement(minimize.call)):
            edits.append(_entries.update_ops_ungated(s, owner))
    for minimize in m.minimizes:
        if minimize not in minimizes:
            edits.append(_entries.unscaled_beside(minimize))
    return edits + _generate.add_import(m)


def builder(m, done, scaled):
    """Several optimizers: one ``MultiOptimizerLossScale``."""
    s = m.s
    wrappers = dict((w.call, w) for w in m.wrappers)
    groups, used, edits = [], set(), []
    for minimize in m.minimizes:
        traced = _trace.group(m, minimize, wrappers, scaled,
                              _edits.mapped_calls(list(done) + edits))
        edits.extend(_edits.Seen(call) for call in traced.seen)
        edits.extend(traced.edits)
        if traced.group is not None:
            groups.append(traced.group)
            if traced.group.wrapper is not None:
                used.add(traced.group.wrapper.call)
    seen = _edits.seen_calls(list(done) + edits)
    for wrapper in m.wrappers:
        if wrapper.call not in used and wrapper.call not in seen:
            edits.extend(_trace.unused_wrapper(m, wrapper))
    if refused(edits) or refused(done):
        return edits
    groups, found = _checks.chains(m, groups)
    edits.extend(found)
    anchors = [_trace.anchor(s, g.top) for g in groups]
    edits.extend(_rules.blocks_differ(s, groups, anchors))
    if refused(edits):
        return edits
    checked = _checks.check_groups(m, groups)
    edits.extend(checked.edits)
    edits.extend(_engines.check_engines(s, groups))
    if refused(edits):
        return edits
    fetching = _checks.fetch_mode(m, groups)
    edits.extend(fetching.edits)
    if fetching.mode is None:
        return edits
    tops = _checks.unique_nodes([g.top for g in groups])
    outer = _checks.unique_nodes(anchors)
    body = list(s.block(anchors[0]).body)
    index = dict((id(statement), i) for i, statement in enumerate(body))
    scoped, found = _checks.scoped_statements(m, groups, outer)
    edits.extend(found)
    edits.extend(_checks.check_moves(m, groups, body, outer, scoped, checked.moving))
    if refused(edits):
        return edits
    first = s.line(groups[0].minimize.call)
    edits.extend(_entries.between_minimizes(
        m, groups, body[index[id(outer[0])] + 1:index[id(outer[-1])]]
        + [st for st in scoped if s.line(st) > first], tops))
    lifted, found = _generate.liftable(m, outer)
    edits.extend(found)
    lifted_nodes = _edits.lifted(list(done) + edits)
    edits.extend(_generate.builder(
        m, groups, fetching.mode, tops, outer[-1], checked.moving, list(done) + edits,
        _trace.code(s, _trace.control_dependencies(s, lifted)) if lifted else None,
        lifted_nodes))
    for owner in _trace.dependencies_around(s, tops[0]):
        if owner is not lifted:
            edits.append(_entries.update_ops_not_atomic(s, owner))
    return edits + _generate.add_import(m)
