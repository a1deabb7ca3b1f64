"""Distributed training in the port: npu_bridge's layers around a wrapper
(``npu_tf_optimizer``, ``npu_distributed_optimizer_wrapper``,
``is_distributed``), an ``if`` that spells a wrapper two ways (a
``RANK_SIZE`` test), and ``tf.train.SyncReplicasOptimizer`` around or
inside the one wrapper: what each becomes in the builder's engine
(``distributed=``) or the drop-in, and what is refused.

Functions of the scanner and of what tracing found (a group's wrapper,
the layers peeled off it, the if that spells it), returning what they find
or the refusals (``_rules.distributed``, ``_rules.unmovable``).
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst
import libcst.matchers as _matchers

from npu_lossscale.tools.port import _flow, _names, _rules

#: An ``if``/``else`` whose branches spell one wrapper two ways.
#:
#: Attributes:
#:   node: the ``cst.If``.
#:   wrappers: the ``_find.Wrapper`` of its body, then of its ``else``.
#:   layers: npu_bridge's distributed layers around each (see ``Peeled``).
Spelling = collections.namedtuple("Spelling", ["node", "wrappers", "layers"])

#: A value with npu_bridge's distributed layers peeled off.
#:
#: Attributes:
#:   node: the loss-scale wrapper call inside the layers, or the value as it
#:     is (no wrapper inside layers).
#:   layers: the layer calls around the wrapper, outermost first ([] for none).
Peeled = collections.namedtuple("Peeled", ["node", "layers"])

#: Calls a spelling if's test may make and still mean the same a few lines
#: later: environment reads and conversions.
_PURE_CALLS = frozenset(["os.getenv", "os.environ.get", "builtins.int", "builtins.str",
                         "builtins.float", "builtins.bool", "builtins.len"])


def sync_replicas(scanner, wrapper):
    """The ``tf.train.SyncReplicasOptimizer(...)`` call inside a wrapper
    (its optimizer, or the one assignment of its optimizer's name) or
    around it (the wrapper as its first argument), or None."""
    s = scanner
    inner = inner_value(s, wrapper.optimizer)
    if s.call_name(inner) == _names.SYNC_REPLICAS:
        return inner
    arg = s.parent(wrapper.call)
    call = s.parent(arg) if isinstance(arg, cst.Arg) else None
    if (isinstance(call, cst.Call) and s.call_name(call) == _names.SYNC_REPLICAS
            and call.args and call.args[0] is arg):
        return call
    return None


def spelling_if(scanner, assignments, wrappers):
    """The ``if``/``else`` that chooses between two spellings of one
    wrapper (a ``RANK_SIZE`` test: ``npu_tf_optimizer(NPULossScaleOptimizer(
    opt, m, is_distributed=True))`` on several devices, ``NPULossScaleOptimizer(
    opt, m)`` on one), each branch that one assignment alone, as a
    ``Spelling``; None for any other binding. Both spellings wrap the same
    optimizer with the same manager; their distributed layers may differ
    (``engine`` reads them)."""
    s = scanner
    node = None
    for assignment in assignments:
        owner = s.owner(s.block(s.statement(assignment.node)))
        owner = s.parent(owner) if isinstance(owner, cst.Else) else owner
        if isinstance(owner, cst.If):
            node = owner
    if not (isinstance(node, cst.If) and isinstance(node.orelse, cst.Else)):
        return None
    assignments = [a for a in assignments if _flow.inside(s, a.node, node)]
    if len(assignments) != 2:
        return None
    statements = [s.statement(a.node) for a in assignments]
    blocks = [node.body, node.orelse.body]
    if not all(isinstance(b, cst.IndentedBlock) and len(b.body) == 1 for b in blocks):
        return None
    order = [[a for a, st in zip(assignments, statements) if st is b.body[0]]
             for b in blocks]
    if not all(len(found) == 1 for found in order):
        return None
    peeled = [peel(s, s.assigned_value(a[0])) for a in order]
    found = [wrappers.get(p.node) for p in peeled]
    if any(w is None or w.optimizer is None for w in found):
        return None
    first, second = found
    if not (first.kind == second.kind and first.scale is not None
            and second.scale is not None
            and _code(s, first.optimizer) == _code(s, second.optimizer)
            and _code(s, first.scale) == _code(s, second.scale)
            and unwrapped_text(s, first, peeled[0].layers)
            == unwrapped_text(s, second, peeled[1].layers)
            and not first.others and not second.others):
        return None
    return Spelling(node, found, [p.layers for p in peeled])


def peel(scanner, value):
    """A loss-scale wrapper inside npu_bridge's distributed layers
    (``npu_tf_optimizer(NPULossScaleOptimizer(...))``) as a ``Peeled``: the
    wrapper call and its layers; any other value as it is, with none."""
    found, node = [], value
    while (isinstance(node, cst.Call) and scanner.call_name(node) in _names.LAYERS
           and len(node.args) == 1 and node.args[0].keyword is None
           and not node.args[0].star):
        found.append(node)
        node = node.args[0].value
    if found and isinstance(node, cst.Call) and any(w.call is node for w in scanner.wrappers):
        return Peeled(node, found)
    return Peeled(value, [])


def unwrapped_text(scanner, wrapper, layers):
    """What the wrapper, and its distributed ``layers``, give way to: the
    optimizer it wrapped, inside the layers that are inert on one device
    (npu_tf_optimizer's averaging is the builder's distributed="hccl")."""
    text = _code(scanner, wrapper.optimizer)
    for layer in reversed(layers):
        if _names.LAYERS[scanner.call_name(layer)] == "inert":
            text = "%s(%s)" % (_code(scanner, layer.func), text)
    return text


def engine(scanner, group):
    """``(averaged, summed)``: whether a group's wrapper's gradients were
    averaged across devices (an averaging layer around it) and its overflow
    decision summed (``is_distributed=True``); for a wrapper spelled two
    ways under an ``if``, ``(test, engine of the if's, engine of the
    else's)``; ``(False, False)`` for a group without a wrapper."""
    if group.wrapper is None:
        return (False, False)
    spell = group.spelling
    if spell is not None:
        first, second = (plain_engine(scanner, w, layers)
                         for w, layers in zip(spell.wrappers, spell.layers))
        if first != second:
            return (_code(scanner, spell.node.test), first, second)
        return first
    return plain_engine(scanner, group.wrapper, group.layers)


def plain_engine(scanner, wrapper, layers):
    """``(averaged, summed)`` of one spelling (see ``engine``)."""
    averaged = any(_names.LAYERS[scanner.call_name(l)] == "averaging" for l in layers)
    summed = isinstance(wrapper.distributed, cst.Name) and wrapper.distributed.value == "True"
    return averaged, summed


def check_engines(scanner, groups):
    """Refuses groups whose wrappers reduced across devices in different
    ways: the builder's ``distributed=`` is one for all its groups."""
    engines = collections.OrderedDict()
    for group in groups:
        if group.wrapper is not None:
            engines.setdefault(engine(scanner, group), []).append(group)
    found = []
    for way, sharing in engines.items():
        if len(way) == 3 and (sum(map(any, way[1:])) != 1
                              or any(e == (False, True) for e in way[1:])):
            for group in sharing:
                found.extend(_rules.distributed(scanner, group.wrapper.call, spelled=(
                    way[0], engine_words(way[1]), engine_words(way[2]))))
    if len(engines) > 1:
        found.extend(_rules.distributed(scanner, None, groups=groups, reductions=[
            (sharing, engine_words(way)) for way, sharing in engines.items()]))
    return found


def check_test(scanner, test, body, start, end):
    """Refuses a spelling if's test that may not mean at the scaler
    (``body[end]``) what it meant at the if (``body[start]``): a name it
    reads bound in between, or a call other than an environment read or
    a conversion."""
    calls = [scanner.call_name(c) for c in _matchers.findall(test, _matchers.Call())]
    first, last = min(start, end), max(start, end)
    read = _flow.read_names(test)
    bound = set()
    for statement in body[first + 1:last]:
        bound |= _flow.assigned(statement)
    if all(name in _PURE_CALLS for name in calls) and not (read & bound):
        return []
    return _rules.unmovable(scanner, test, test=test, test_why=(
        "a name it reads is bound in between" if read & bound else "it calls something"))


def _code(scanner, node):
    return scanner.code(node).strip()


def engine_args(engine):
    """The builder's arguments for an ``engine`` (see ``engine``):
    a conditional one as ``distributed="hccl" if (test) else None``."""
    if len(engine) == 3:
        test, first, second = engine
        return ['distributed="hccl" if %s else None' % test if any(first) else
                'distributed=None if %s else "hccl"' % test]
    averaged, summed = engine
    return (['distributed="hccl"'] if averaged else
            ['distributed="hccl"', "allreduce_gradients=False"] if summed else [])


def engine_words(engine):
    if len(engine) == 3:
        return "under `if %s:` %s, else %s" % (engine[0], engine_words(engine[1]),
                                              engine_words(engine[2]))
    averaged, summed = engine
    return ("averaged the gradients across devices (npu_tf_optimizer)%s"
            % (" and summed the overflow decision (is_distributed=True)" if summed else "")
            if averaged else "summed the overflow decision across devices (is_distributed="
            "True)" if summed else "reduced nothing across devices")


def inner_value(scanner, expr):
    """``expr``, or the value of the one assignment its name reads."""
    if isinstance(expr, cst.Name):
        assignment = _flow.reaching_assignment(scanner, expr)
        value = _flow.assigned_value(scanner, assignment) if assignment is not None else None
        return value if value is not None else expr
    return expr
