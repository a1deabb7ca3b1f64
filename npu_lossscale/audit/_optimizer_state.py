"""The check on optimizer state shared by two steps: NLS013 (one optimizer
object, e.g. one ``AdamOptimizer``, used by two builders, a builder and a
plain ``minimize``, or two ``minimize`` calls).
"""

from __future__ import absolute_import, division, print_function

import collections
import itertools

from npu_lossscale.audit import _graph
from npu_lossscale.audit._findings import Finding, _some, _sorted

__all__ = ["check_shared_optimizer_state"]

#: One write of an optimizer's own state: the write and the variables of the
#: optimizer applies it follows (the variables its step trains).
_StateWrite = collections.namedtuple("_StateWrite", ["write", "trains"])


def check_shared_optimizer_state(context):
    """An optimizer's own state advanced by steps that train different variables.

    Optimizer state that is no variable's slot, such as Adam's
    ``beta1_power`` and ``beta2_power``, is one per optimizer object: each
    ``apply_gradients`` reads it in its apply ops and advances it once,
    after them. Two writes of one such variable that follow applies of
    different variables come from one optimizer object used by two steps
    (two builders, a builder and a ``minimize``, two ``minimize`` calls).
    The builder refuses one optimizer in two groups of one builder; across
    steps only the graph shows it.

    An error when both writes can run in the fetched run (the state advances
    twice per step); a warning otherwise: each run of either step advances
    the state for both, so each network's bias correction counts the other
    network's steps too. Writes that follow applies of the same variables
    (a builder's ``update_op`` and its ``per_group`` op of that group) are
    alternatives for one network, not reported.
    """
    facts, model = context.facts, context.model
    applies = set(op for op in facts.train_updates
                  if _graph.is_optimizer_apply(model.nodes[op].type))
    if not applies:
        return []
    skip = facts.trainable.union(facts.scale_state, facts.flag_vars, facts.accumulators,
                                 facts.bookkeeping, model.collections.local)
    found = collections.OrderedDict()  # (step ops, clashing) -> [variable]
    for var in sorted(facts.mutations):
        writes = facts.mutations[var]
        if var in skip or len(writes) < 2 or facts.is_global_step(var):
            continue
        readers = applies & facts.derived_from([var])
        if not readers:
            continue
        state = []
        for write in sorted(writes):
            trains = frozenset(facts.target[a] for a in model.ancestors([write]) & readers)
            if trains:
                state.append(_StateWrite(write, trains))
        shared, clashing = set(), False
        for first, second in itertools.combinations(state, 2):
            if first.trains & second.trains:
                continue
            shared |= set([first, second])
            clashing = clashing or (
                context.fetched and first.write in context.run and second.write in context.run
                and context.co_runnable(first.write, second.write))
        if shared:
            key = (tuple((context.step_ops([s.write]), tuple(sorted(s.trains)))
                         for s in sorted(shared)), clashing)
            found.setdefault(key, []).append(var)
    return [_finding(steps, clashing, variables)
            for (steps, clashing), variables in found.items()]


def _finding(steps, clashing, variables):
    """The NLS013 finding for ``variables`` advanced by ``steps``: (step
    ops, variables trained) pairs."""
    names = _sorted(op for ops, _ in steps for op in ops)
    trained = "; ".join("%s trains %s" % (_some(list(ops), 2), _some(list(trains), 3))
                        for ops, trains in steps)
    if clashing:
        what = ("advances %d times in one step (%s), once per step op, so Adam's bias "
                "correction runs ahead for both networks" % (len(steps), trained))
    else:
        what = ("advances on every run of each of %d step ops (%s), so each network's "
                "Adam bias correction also counts the other network's steps"
                % (len(steps), trained))
    return Finding(
        "NLS013-shared-optimizer", "error" if clashing else "warning",
        "the optimizer state %s %s: one optimizer object is used by two builders, a "
        "builder and a minimize, or two minimize calls; give each its own optimizer "
        "object (e.g. a tf.train.AdamOptimizer per network)."
        % (", ".join(variables), what),
        tuple(variables) + names)
