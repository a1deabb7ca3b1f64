"""The plan's edit records, and the one place that merges them.

Each step of the plan (tracing, the refusal rules, the manager mapping,
emitting the code, the report) is a set of functions that return lists of
these records; no step writes a shared table. ``merge`` turns the list of a
module, in the order the steps made it, into the ``Plan`` that
``_rewrite`` applies: the tables of node edits and the report's entries. A
module with a refusal keeps none of its edits (a partial port of a
multi-optimizer script would put a builder's step and a wrapper's in one
run), and its report keeps what was left alone and what is to do by hand.
"""

from __future__ import absolute_import, division, print_function

import collections

from npu_lossscale.tools.port._report import BY_HAND, CHANGED, LEFT_ALONE, Entry
from npu_lossscale.tools.port._sections import SECTION_PORTING

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

#: ``node`` gives way to ``new``.
Replace = collections.namedtuple("Replace", ["node", "new"])
#: Statement ``node`` gives way to the list ``new`` (empty: removed).
Statements = collections.namedtuple("Statements", ["node", "new"])
#: A ``Statements`` edit of ``node`` taken back (its lines moved elsewhere).
Unset = collections.namedtuple("Unset", ["node"])
#: ``statements`` go before statement ``node``; ``once`` keeps the first of a kind.
Before = collections.namedtuple("Before", ["node", "statements", "once"])
#: ``statements`` go after statement ``node``; ``once`` keeps the first of a kind.
After = collections.namedtuple("After", ["node", "statements", "once"])
#: The ``with`` block ``node`` goes from branch ``index`` of the if it holds.
Lift = collections.namedtuple("Lift", ["node", "index"])
#: A manager call mapped to ours (a later wrapper of the same manager maps
#: it no more, and no ``manager-unused`` is said of it).
Mapped = collections.namedtuple("Mapped", ["call"])
#: A wrapper call a ``minimize`` was traced to (refused or not): no
#: ``wrapper-unfollowed`` is said of it.
Seen = collections.namedtuple("Seen", ["call"])
#: A report entry of ``kind`` at ``node`` (None: the whole file); ``once``,
#: when not None, keeps only the first entry with that key.
Told = collections.namedtuple("Told", ["kind", "node", "rule", "message", "section", "once"])
#: A reason the module cannot be rewritten, said as a by-hand entry.
Refused = collections.namedtuple("Refused", ["node", "rule", "message", "section", "once"])


def changed(node, rule, message, section="", once=None):
    """What the port changed at ``node``."""
    return Told(CHANGED, node, rule, message, section, once)


def left_alone(node, rule, message, section=""):
    """What the port recognised at ``node`` and left as it is."""
    return Told(LEFT_ALONE, node, rule, message, section, None)


def by_hand(node, rule, message, section=SECTION_PORTING, once=None):
    """A point a person must decide, beside the rewrite."""
    return Told(BY_HAND, node, rule, message, section, once)


def refuse(node, rule, message, section=SECTION_PORTING, once=None):
    """A reason the module cannot be rewritten."""
    return Refused(node, rule, message, section, once)


def refused(edits):
    """True when ``edits`` hold a refusal."""
    return any(isinstance(edit, Refused) for edit in edits)


def mapped_calls(edits):
    """The manager calls that ``edits`` map."""
    return [edit.call for edit in edits if isinstance(edit, Mapped)]


def seen_calls(edits):
    """The wrapper calls that ``edits`` trace a ``minimize`` to."""
    return [edit.call for edit in edits if isinstance(edit, Seen)]


def lifted(edits):
    """The ``with`` blocks that ``edits`` lift."""
    return [edit.node for edit in edits if isinstance(edit, Lift)]


def node_tables(edits):
    """``(replace, statements)``: the node edits so far, as the rewrite
    would apply them (for the lines that move with them)."""
    replace, statements = {}, {}
    for edit in edits:
        if isinstance(edit, Replace):
            replace[edit.node] = edit.new
        elif isinstance(edit, Statements):
            statements[edit.node] = edit.new
        elif isinstance(edit, Unset):
            statements.pop(edit.node, None)
    return replace, statements


def merge(scanner, path, edits):
    """The ``Plan`` of one module.

    Args:
      scanner: the module's ``_find.Scanner`` (the entries' lines).
      path: the module's path, as the report names it.
      edits: the records of every step, in the order they were made.

    Returns:
      A ``Plan``: the node edits in order, later ones over earlier ones;
      the entries in order, then the refusals. With a refusal, no node edit
      and no CHANGED entry is kept.
    """
    kept, seen = [], set()
    for edit in edits:
        once = getattr(edit, "once", None)
        if once is not None:
            if (type(edit), once) in seen:
                continue
            seen.add((type(edit), once))
        kept.append(edit)

    def entry(kind, edit):
        line = scanner.line(edit.node) if edit.node is not None else 0
        return Entry(kind, path, line, edit.rule, edit.message, edit.section)

    entries = [entry(e.kind, e) for e in kept if isinstance(e, Told)]
    reasons = [entry(BY_HAND, e) for e in kept if isinstance(e, Refused)]
    if reasons:
        return Plan({}, {}, {}, {}, [e for e in entries + reasons if e.kind != CHANGED], {})
    replace, statements = node_tables(kept)
    before, after, lift = {}, {}, {}
    for edit in kept:
        if isinstance(edit, Before):
            before.setdefault(edit.node, []).extend(edit.statements)
        elif isinstance(edit, After):
            after.setdefault(edit.node, []).extend(edit.statements)
        elif isinstance(edit, Lift):
            lift[edit.node] = edit.index
    return Plan(replace, statements, before, after, entries, lift)

