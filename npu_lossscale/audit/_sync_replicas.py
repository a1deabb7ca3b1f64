"""Parameter servers: NLS012 (a SyncReplicasOptimizer whose global step stops
on a skipped step).

``SyncReplicasOptimizer``'s chief applies the aggregated gradients (taken
from ``ConditionalAccumulator``s), then enqueues ``global_step`` as the
workers' tokens. Each take advances the accumulators' step; a push whose
token is older is dropped. A loss-scale wrapper between the two that
advances ``global_step`` only on applied steps (TF's
``MixedPrecisionLossScaleOptimizer``, ``LossScaleOptimizer`` with
``count_skipped_steps=False``) leaves the tokens a step behind after a skip,
and every worker waits forever.
"""

from __future__ import absolute_import, division, print_function

from npu_lossscale.core import graph_walk
from npu_lossscale.audit._findings import Finding

__all__ = ["check_sync_token_stall"]

#: Enqueues into a queue: the chief's token enqueue is one of them.
_ENQUEUE_TYPES = frozenset(["QueueEnqueueMany", "QueueEnqueueManyV2", "QueueEnqueue",
                            "QueueEnqueueV2"])


def _conditional(model, name):
    return any(literal.kind == "cond" for literal in model.conditions(name))


def check_sync_token_stall(context):
    """Token enqueues that hand out global_step after an aggregated apply
    that advances it only inside a cond (or not at all).

    Read on the whole graph, whatever the fetches: the chief's queue runner
    runs the enqueue in its own ``session.run``.
    """
    facts, model = context.facts, context.model
    found = []
    for name in sorted(model.nodes):
        if model.nodes[name].type not in _ENQUEUE_TYPES or _conditional(model, name):
            continue
        values = model.ancestors([name], data_only=True)
        steps = [v for v in values & facts.variables if facts.is_global_step(v)]
        if not steps:
            continue
        before = model.ancestors([name])
        if not any(model.nodes[n].type in graph_walk.ACCUMULATOR_TAKE_TYPES for n in before):
            continue
        advances = sorted(op for step in steps for op in facts.mutations.get(step, ())
                          if op in before)
        if advances and not all(_conditional(model, op) for op in advances):
            continue
        where = ("only inside a cond (%s)" % ", ".join(advances[:3]) if advances
                 else "nowhere before it")
        found.append(Finding(
            "NLS012-sync-token-stall", "error",
            "the SyncReplicasOptimizer token enqueue %s hands out %s, which advances %s, "
            "so a skipped aggregated step leaves every worker waiting for its token "
            "forever; advance global_step on skipped steps too "
            "(LossScaleOptimizer(..., count_skipped_steps=True))."
            % (name, steps[0], where),
            tuple([name] + sorted(steps) + advances)))
    return found
