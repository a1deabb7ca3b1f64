"""Writing the port's code: generated lines wrapped at the project's line
length and parsed for the indentation they go to, the statements that take
a rewritten statement's place with its comments, and the node edits inside
a statement the plan moves.

The plan decides what to write (``_plan``); these functions only turn its
texts into libcst nodes that keep the script's formatting.
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst
import libcst.matchers as _matchers

#: Where a line of generated code wraps (the project's line length).
LINE_LENGTH = 99


def lost_comments(original, replacements):
    """The comments of ``original`` that none of ``replacements`` holds, as
    comment lines to put above them: a removed statement's, and those inside
    a call the port rewrote (after an argument, inside its parentheses), so
    that no comment of the script is dropped."""
    kept = collections.Counter(comment.value for node in replacements
                               for comment in _matchers.findall(node, _matchers.Comment()))
    lost = []
    for comment in _matchers.findall(original, _matchers.Comment()):
        if kept[comment.value] > 0:
            kept[comment.value] -= 1
        else:
            lost.append(cst.EmptyLine(comment=cst.Comment(comment.value)))
    return lost


def call_text(head, args, column):
    """``head(arg, arg, ...)``, wrapped under the open parenthesis when the
    line would pass ``LINE_LENGTH`` at indentation ``column``, or after it
    (a hanging indent of four) when that is still too long."""
    one_line = "%s(%s)" % (head, ", ".join(args))
    if column + len(one_line) <= LINE_LENGTH or not args:
        return one_line
    under = _wrapped(head + "(", " " * (column + len(head) + 1), args, column)
    if all(len(line) <= LINE_LENGTH for line in [" " * column + under.split("\n")[0]]
           + under.split("\n")[1:]):
        return under
    return head + "(\n" + _wrapped(" " * (column + 4), " " * (column + 4), args, 0)


def _wrapped(start, indent, args, column):
    """``args`` after ``start``, a line broken before an argument that would
    pass ``LINE_LENGTH``, continuation lines at ``indent``, closed by ")"."""
    lines, current = [], start + args[0]
    for arg in args[1:]:
        if column + len(current) + len(arg) + 3 > LINE_LENGTH:
            lines.append(current + ",")
            current = indent + arg
        else:
            current += ", " + arg
    lines.append(current + ")")
    return "\n".join(lines)


def replacement_statements(prefix, mains, suffix, top, column, moved=()):
    """The statements that replace ``top``, carrying its comments.

    Args:
      prefix: texts of statements before the replacements (the scaler).
      mains: ``(text, original)`` pairs: each original statement's
        replacement, which keeps its trailing comment (and, inside a ``with``
        block, its leading comments).
      suffix: texts of statements after them (the build, the bindings).
      top: the statement replaced; its leading comments and, for a ``with``,
        its header's comment go above the first new statement.
      column: the indentation of ``top``'s block.
      moved: statements (nodes) before all of them: those moving out of
        ``top``'s block, and last, a list of comment lines for the statement
        after them when the last of them were removed.
    """
    comments = moved[-1] if moved and isinstance(moved[-1], list) else []
    moved = list(moved[:-1] if comments else moved)
    statements = moved + [parse_at(text, column) for text in prefix]
    for text, original in mains:
        statement = parse_at(text, column)
        changes = {}
        if original is not top:
            changes["leading_lines"] = original.leading_lines
        if original.trailing_whitespace.comment is not None:
            changes["trailing_whitespace"] = original.trailing_whitespace
        statements.append(statement.with_changes(**changes))
    statements.extend(parse_at(text, column) for text in suffix)
    if comments:
        after = statements[len(moved)]
        statements[len(moved)] = after.with_changes(
            leading_lines=comments + list(after.leading_lines))
    leading = list(top.leading_lines)
    if isinstance(top, cst.With) and top.body.header.comment is not None:
        leading.append(cst.EmptyLine(comment=top.body.header.comment))
    statements[0] = statements[0].with_changes(
        leading_lines=leading + list(statements[0].leading_lines))
    return statements


def parse_at(text, column):
    """Parses a statement written for indentation ``column``: its first line
    unindented, its continuation lines indented as they must show."""
    if not column:
        return cst.parse_statement(text + "\n")
    module = cst.parse_module("if True:\n%s%s\n" % (" " * column, text))
    return module.body[0].body.body[0]


def parse_expression_at(text, column):
    """An expression written with its continuation lines' full indentation,
    for a statement of a block indented ``column``."""
    statement = parse_at("_ = " + text, column)
    return statement.body[0].value


class Apply(cst.CSTTransformer):
    """The plan's node replacements, inside a statement the plan moves."""

    def __init__(self, replace):
        super(Apply, self).__init__()
        self._replace = replace

    def on_leave(self, original_node, updated_node):
        return self._replace.get(original_node, updated_node)


class _Shift(cst.CSTTransformer):
    def __init__(self, columns):
        super(_Shift, self).__init__()
        self._columns = columns

    def leave_ParenthesizedWhitespace(self, original_node, updated_node):
        width = max(0, len(updated_node.last_line.value) + self._columns)
        return updated_node.with_changes(last_line=cst.SimpleWhitespace(" " * width))


def shift(args, columns):
    """``args`` with their continuation lines moved ``columns`` to the right
    (the call's name grew by that much)."""
    if not columns:
        return args
    return [arg.visit(_Shift(columns)) for arg in args]
