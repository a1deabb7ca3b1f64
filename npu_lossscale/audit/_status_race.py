"""NLS001: a float-status clear that can land between an overflow and the
read meant to see it, in one step (Ascend's float-status register).
"""

from __future__ import absolute_import, division, print_function

from npu_lossscale.core import graph_walk
from npu_lossscale.audit import _facts
from npu_lossscale.audit._findings import _READ_TYPES, Finding, _if_run_together, _sorted

__all__ = ["check_status_race"]


# -- NLS001 ----------------------------------------------------------------------

def check_status_race(context):
    """No float-status clear may land between an overflow and the read that
    should see it.

    A read sees every overflow since the last clear and does not change the
    register (tf_adapter's read and clear are separate ops), so reads never
    race each other. A clear
    races a read in the same run unless it runs after the read, or before
    every op the read follows (then it only removes what came before the
    step, as the builder's one clear per run does), leaving out the ops
    that run before the clear and that the read's computation does not read
    as data: a sequence's earlier sub-steps, whose own reads saw them.
    """
    model = context.model
    ops = [n for n in context.run if model.nodes[n].type in _facts.STATUS_TYPES]
    reads = sorted(n for n in ops if model.nodes[n].type in _facts.STATUS_READ_TYPES)
    clears = sorted(n for n in ops if model.nodes[n].type in _facts.STATUS_CLEAR_TYPES)
    racing = set()
    before = dict((clear, model.ancestors([clear])) for clear in clears)
    for read in reads:
        followed = model.ancestors([read])
        # Ops before a clear that the read follows, which the read's own
        # computation does not read as data: an earlier sub-step's (a
        # sequence, build(sequence=...)), whose own read saw them and whose
        # overflows that clear wipes before this read's step.
        used = model.ancestors(model.all_deps(read), data_only=True)
        earlier = set()
        for clear in clears:
            if clear in followed:
                earlier |= before[clear]
        earlier -= used
        exempt = earlier | _constants(model, followed)
        for clear in clears:
            if not context.co_runnable(read, clear):
                continue
            if read in before[clear]:
                continue  # the clear comes after the read
            if not _precedes_all(model, clear, followed, exempt):
                racing |= set([read, clear])
    if not racing:
        return []
    names = sorted(op for op in racing if model.nodes[op].type in _facts.STATUS_READ_TYPES)
    return [Finding(
        "NLS001-status-race", context.run_severity("error"),
        "%d float-status reads/clears (%s) can run in one step with a clear that "
        "can land between an overflow and the read that should see it%s, so a "
        "loss-scale check can miss its overflow and apply a saturated step (the "
        "multi-optimizer race of Huawei's FAQ); build all the optimizers with one "
        "npu_lossscale.MultiOptimizerLossScale (one clear per run, before every "
        "read's computation), or run each optimizer in its own session.run."
        % (len(racing), ", ".join(names), _if_run_together(context)),
        _sorted(racing))]


def _precedes_all(model, clear, followed, exempt=()):
    """Whether ``clear`` runs before every op in ``followed`` (a read's
    ancestors) that computes: all but graph inputs (nodes without inputs,
    placeholders with a default, status buffers) and the ``exempt`` ones
    (ops before another clear, nodes that compute nothing: ``_constants``).
    Another op that runs before the clear (its ancestors) is not exempt:
    the clear wipes its overflow.
    A function body node starts when its call node does, so it also counts
    as after the clear when the call node's own inputs are."""

    def deps(name):
        call = model.nodes[name].call
        if call is None:
            return model.all_deps(name)
        outer = model.nodes[call]
        return model.all_deps(name) + [source for source, _ in outer.inputs] + list(
            outer.controls)

    # A stand-in's own nodes (the CPU shim's) are named under the op's name.
    pending = [name for name in followed if name != clear
               and not name.startswith(clear + "/")]
    # After the clear: what waits for it through ops of ``pending``.
    waiting = graph_walk.children(pending, deps)
    after = graph_walk.reachable([clear], lambda name: waiting.get(name, ()))
    return all(name in after or name in exempt or not model.all_deps(name)
               or model.nodes[name].type in _facts.STATUS_ALLOC_TYPES
               or model.nodes[name].type in graph_walk.FEEDABLE_TYPES for name in pending)


def _constants(model, names):
    """The nodes of ``names`` that compute nothing an overflow could come
    from, under any control dependencies: a constant or a no-op, an op whose
    data inputs all are such, or a read (an identity, a variable's read) of
    a graph input or of such a node (a ref variable's ``read``, made once
    and shared by a sequence's sub-steps)."""
    kinds, visiting = {}, set()  # node -> "constant", "read" or None
    for name in names:
        stack = [name]
        while stack:
            current = stack[-1]
            if current in kinds:
                stack.pop()
                continue
            deps = [dep for dep in model.data_deps(current) if dep in model.nodes]
            waiting = [dep for dep in deps if dep not in kinds and dep not in visiting]
            if waiting and current not in visiting:
                visiting.add(current)
                stack.extend(waiting)
                continue
            visiting.discard(current)
            kinds[current] = _kind(model, current, [kinds.get(dep) for dep in deps])
            stack.pop()
    return set(name for name, kind in kinds.items() if kind is not None)


def _kind(model, name, dep_kinds):
    """"constant", "read" or None for ``name``, given its data inputs' kinds
    (``_constants``)."""
    node = model.nodes[name]
    if not dep_kinds:
        if node.type in _CONSTANT_TYPES:
            return "constant"
        return "input" if not model.all_deps(name) else None
    if all(kind == "constant" for kind in dep_kinds):
        return "constant"
    if node.type in _READ_TYPES and all(kind is not None for kind in dep_kinds):
        return "read"
    return None

#: Nodes without data inputs that compute no value of the model.
_CONSTANT_TYPES = frozenset(["Const", "NoOp"])
