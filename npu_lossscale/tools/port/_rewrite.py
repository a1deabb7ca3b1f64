"""The rewrite: one module's source in, the ported source and its report
entries out.

``port_source`` parses the module with libcst (which keeps every space and
comment), lets ``_find.Scanner`` and ``_plan.plan`` decide, and applies the
plan's node edits with a ``CSTTransformer``. Code the plan does not touch is
written back byte for byte; a statement the plan removes hands its comments
to the statement after it.
"""

from __future__ import absolute_import, division, print_function

import ast

import libcst as cst
from libcst.metadata import MetadataWrapper

from npu_lossscale.tools.port import _emit, _find, _plan
from npu_lossscale.tools.port._report import BY_HAND, Entry


#: A UTF-8 byte-order mark, as the decoded text starts with it.
_BOM = u"\ufeff"


class _Rewriter(cst.CSTTransformer):
    """Applies a ``_plan.Plan`` to the module it was made for."""

    def __init__(self, plan):
        super(_Rewriter, self).__init__()
        self._plan = plan
        self._pending = []  # comments of a removed statement, for the next one
        self._carried = {}  # statement -> the comments it receives

    def on_visit(self, node):
        if self._pending and isinstance(node, (cst.SimpleStatementLine,
                                               cst.BaseCompoundStatement)):
            self._carried[node] = self._pending
            self._pending = []
        return True

    def on_leave(self, original_node, updated_node):
        plan = self._plan
        if original_node in plan.replace:
            return plan.replace[original_node]
        if original_node in plan.lift:
            return _lifted(updated_node, plan.lift[original_node])
        carried = self._carried.pop(original_node, [])
        if carried:
            updated_node = updated_node.with_changes(
                leading_lines=carried + list(updated_node.leading_lines))
        if original_node in plan.statements:
            new = list(plan.statements[original_node])
            if not new:
                self._pending.extend(_emit.lost_comments(original_node, []))
                return cst.RemovalSentinel.REMOVE
            lost = _emit.lost_comments(original_node, new)
            if carried or lost:
                new[0] = new[0].with_changes(
                    leading_lines=carried + lost + list(new[0].leading_lines))
            return cst.FlattenSentinel(new)
        if isinstance(original_node, cst.SimpleStatementLine) and not original_node.deep_equals(
                updated_node):
            lost = _emit.lost_comments(original_node, [updated_node])
            if lost:  # a rewritten call's comments: above its statement
                updated_node = updated_node.with_changes(
                    leading_lines=list(updated_node.leading_lines) + lost)
        before = plan.before.get(original_node, [])
        after = plan.after.get(original_node, [])
        if before or after:
            return cst.FlattenSentinel(list(before) + [updated_node] + list(after))
        return updated_node


def _lifted(with_node, scaled):
    """The if a ``tf.control_dependencies`` block held, without the block:
    the branch at index ``scaled`` (its builder gates the ops) as it is, each
    other branch's lines inside a copy of the block. The block's comments go
    above the if."""
    if_node = with_node.body.body[0]

    def keep(block):
        inner = with_node.with_changes(leading_lines=[], body=cst.IndentedBlock(
            body=list(block.body), header=block.header))
        return cst.IndentedBlock(body=[inner])

    def branches(node, index):
        body = node.body if index == scaled else keep(node.body)
        orelse = node.orelse
        if isinstance(orelse, cst.If):
            orelse = branches(orelse, index + 1)
        elif isinstance(orelse, cst.Else):
            orelse = orelse.with_changes(
                body=orelse.body if index + 1 == scaled else keep(orelse.body))
        return node.with_changes(body=body, orelse=orelse)

    header = ([cst.EmptyLine(comment=with_node.body.header.comment)]
              if with_node.body.header.comment is not None else [])
    return branches(if_node, 0).with_changes(
        leading_lines=list(with_node.leading_lines) + header + list(if_node.leading_lines))


def port_source(source, path):
    """Ports one module.

    Args:
      source: the module's text.
      path: its path, as the report names it.

    Returns:
      ``(new_source, entries)``: the rewritten text (``source`` itself when
      nothing changes) and the report's ``Entry``s.
    """
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as error:
        line, reason = getattr(error, "raw_line", 0), str(error).splitlines()[0]
        try:  # Python's own parser places most errors better than libcst's
            ast.parse(source)
        except SyntaxError as python_error:
            line, reason = python_error.lineno or line, "%s at line %s" % (
                python_error.msg, python_error.lineno)
        return source, [Entry(BY_HAND, path, line, "unparsable",
                              "The tool cannot parse this file (%s); it is copied as it is."
                              % reason, "")]
    wrapper = MetadataWrapper(module)
    found = []
    wrapper.visit(_find.Scanner(lambda scanner: found.append(_plan.plan(scanner, path))))
    plan = found[0]
    if not (plan.replace or plan.statements or plan.before or plan.after or plan.lift):
        return source, plan.entries
    new = wrapper.module.visit(_Rewriter(plan)).code
    if source.startswith(_BOM) and not new.startswith(_BOM):  # libcst drops it
        new = _BOM + new
    return new, plan.entries
