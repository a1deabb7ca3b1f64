"""Distributed training in the port: npu_bridge's layers around a wrapper
(``npu_tf_optimizer``, ``npu_distributed_optimizer_wrapper``,
``is_distributed``), an ``if`` that spells a wrapper two ways (a
``RANK_SIZE`` test), and ``tf.train.SyncReplicasOptimizer`` around or
inside the one wrapper: what each becomes in the builder's engine
(``distributed=``) or the drop-in, and what is refused.

``EngineRules`` is a part of ``_plan._Planner``: its methods use the
planner's scanner, ``refuse`` and ``code``, and its ``layers`` and
``spelled`` records.
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst
import libcst.matchers as _matchers

from npu_lossscale.tools.port import _flow, _names
from npu_lossscale.tools.port._sections import SECTION_DATA_PARALLEL

#: An ``if``/``else`` whose branches spell one wrapper two ways.
#:
#: Attributes:
#:   node: the ``cst.If``.
#:   wrappers: the ``_find.Wrapper`` of its body, then of its ``else``.
Spelling = collections.namedtuple("Spelling", ["node", "wrappers"])

#: Calls a spelling if's test may make and still mean the same a few lines
#: later: environment reads and conversions.
_PURE_CALLS = frozenset(["os.getenv", "os.environ.get", "builtins.int", "builtins.str",
                         "builtins.float", "builtins.bool", "builtins.len"])


class EngineRules(object):
    """The planner's rules for distributed training (see the module
    docstring)."""

    def sync_replicas(self, wrapper):
        """The ``tf.train.SyncReplicasOptimizer(...)`` call inside a wrapper
        (its optimizer, or the one assignment of its optimizer's name) or
        around it (the wrapper as its first argument), or None."""
        s = self.s
        inner = inner_value(s, wrapper.optimizer)
        if s.call_name(inner) == _names.SYNC_REPLICAS:
            return inner
        arg = s.parent(wrapper.call)
        call = s.parent(arg) if isinstance(arg, cst.Arg) else None
        if (isinstance(call, cst.Call) and s.call_name(call) == _names.SYNC_REPLICAS
                and call.args and call.args[0] is arg):
            return call
        return None

    def spelling_if(self, assignments, wrappers):
        """The ``if``/``else`` that chooses between two spellings of one
        wrapper (a ``RANK_SIZE`` test: ``npu_tf_optimizer(NPULossScaleOptimizer(
        opt, m, is_distributed=True))`` on several devices, ``NPULossScaleOptimizer(
        opt, m)`` on one), each branch that one assignment alone, as a
        ``Spelling``; None for any other binding. Both spellings wrap the same
        optimizer with the same manager; their distributed layers may differ
        (``engine`` reads them)."""
        s = self.s
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
        found = [wrappers.get(self.peel(s.assigned_value(a[0]))) for a in order]
        if any(w is None or w.optimizer is None for w in found):
            return None
        first, second = found
        if not (first.kind == second.kind and first.scale is not None
                and second.scale is not None
                and self.code(first.optimizer) == self.code(second.optimizer)
                and self.code(first.scale) == self.code(second.scale)
                and self.unwrapped_text(first) == self.unwrapped_text(second)
                and not first.others and not second.others):
            return None
        spell = Spelling(node, found)
        self.spelled[first.call] = self.spelled[second.call] = spell
        return spell

    def peel(self, value):
        """A loss-scale wrapper inside npu_bridge's distributed layers
        (``npu_tf_optimizer(NPULossScaleOptimizer(...))``): the wrapper call,
        its layers recorded (``self.layers``); any other value as it is."""
        found, node = [], value
        while (isinstance(node, cst.Call) and self.s.call_name(node) in _names.LAYERS
               and len(node.args) == 1 and node.args[0].keyword is None
               and not node.args[0].star):
            found.append(node)
            node = node.args[0].value
        if found and isinstance(node, cst.Call) and any(w.call is node for w in self.s.wrappers):
            self.layers[node] = found
            return node
        return value

    def unwrapped_text(self, wrapper):
        """What the wrapper, and its distributed layers, give way to: the
        optimizer it wrapped, inside the layers that are inert on one device
        (npu_tf_optimizer's averaging is the builder's distributed="hccl")."""
        text = self.code(wrapper.optimizer)
        for layer in reversed(self.layers.get(wrapper.call, [])):
            if _names.LAYERS[self.s.call_name(layer)] == "inert":
                text = "%s(%s)" % (self.code(layer.func), text)
        return text

    def engine(self, wrapper):
        """``(averaged, summed)``: whether a wrapper's gradients were averaged
        across devices (an averaging layer around it) and its overflow
        decision summed (``is_distributed=True``); for a wrapper spelled two
        ways under an ``if``, ``(test, engine of the if's, engine of the
        else's)``."""
        spell = self.spelled.get(wrapper.call)
        if spell is not None:
            first, second = (self.plain_engine(w) for w in spell.wrappers)
            if first != second:
                return (self.code(spell.node.test), first, second)
            return first
        return self.plain_engine(wrapper)

    def plain_engine(self, wrapper):
        """``(averaged, summed)`` of one spelling (see ``engine``)."""
        layers = self.layers.get(wrapper.call, [])
        averaged = any(_names.LAYERS[self.s.call_name(l)] == "averaging" for l in layers)
        summed = isinstance(wrapper.distributed, cst.Name) and wrapper.distributed.value == "True"
        return averaged, summed

    def check_engines(self, groups):
        """Refuses groups whose wrappers reduced across devices in different
        ways: the builder's ``distributed=`` is one for all its groups."""
        engines = collections.OrderedDict()
        for group in groups:
            if group.wrapper is not None:
                engines.setdefault(self.engine(group.wrapper), []).append(group)
        for engine, sharing in engines.items():
            if len(engine) == 3 and (sum(map(any, engine[1:])) != 1
                                     or any(e == (False, True) for e in engine[1:])):
                for group in sharing:
                    self.refuse(group.wrapper.call, "distributed",
                                "The if/else (`if %s:`) spells this wrapper with %s and %s: the "
                                "builder's distributed=... can follow a test between averaging "
                                "across devices (npu_tf_optimizer) and one device, not this. "
                                "Spell both branches alike, then run the tool again, or port it "
                                "by hand." % (engine[0], engine_words(engine[1]),
                                              engine_words(engine[2])), SECTION_DATA_PARALLEL)
        if len(engines) > 1:
            for group in groups:
                self.refuse(group.wrapper.call, "distributed",
                            "The wrappers reduce across devices in different ways (%s): the "
                            "builder's distributed=... is one for all groups. Give every "
                            "wrapper the same is_distributed and npu_tf_optimizer layer, then "
                            "run the tool again." % "; ".join(
                                "%s: %s" % (", ".join(g.name for g in sharing),
                                            engine_words(engine))
                                for engine, sharing in engines.items()), SECTION_DATA_PARALLEL)

    def check_test(self, test, body, start, end):
        """Refuses a spelling if's test that may not mean at the scaler
        (``body[end]``) what it meant at the if (``body[start]``): a name it
        reads bound in between, or a call other than an environment read or
        a conversion."""
        s = self.s
        calls = [s.call_name(c) for c in _matchers.findall(test, _matchers.Call())]
        first, last = min(start, end), max(start, end)
        read = _flow.read_names(test)
        bound = set()
        for statement in body[first + 1:last]:
            bound |= _flow.assigned(statement)
        if all(name in _PURE_CALLS for name in calls) and not (read & bound):
            return
        self.refuse(test, "unmovable",
                    "This if's test (%s) moves to the builder's distributed=..., where the "
                    "scaler is made: it may not mean the same there (%s). Bind it to a name "
                    "before the first minimize (e.g. rank_size = int(os.getenv(\"RANK_SIZE\", "
                    "\"1\"))) and test that, then run the tool again." % (
                        self.code(test), "a name it reads is bound in between" if read & bound
                        else "it calls something"), SECTION_DATA_PARALLEL)


def engine_args(engine):
    """The builder's arguments for an ``engine`` (see ``_Planner.engine``):
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
