"""Distributed training: NLS004 (a collective that only some steps or ranks
run)."""

from __future__ import absolute_import, division, print_function

from npu_lossscale.audit import _facts
from npu_lossscale.audit._findings import Finding

__all__ = ["check_collective_in_cond"]


# -- NLS004 ----------------------------------------------------------------------

def _is_collective(node_type):
    return node_type in _facts.COLLECTIVE_TYPES


def check_collective_in_cond(context):
    """Collectives that only some steps (or ranks) run."""
    model = context.model
    ops = []
    for name in sorted(context.run):
        if not _is_collective(model.nodes[name].type):
            continue
        if any(l.kind == "cond" for l in model.conditions(name)):
            ops.append(name)
    if not ops:
        return []
    return [Finding(
        "NLS004-collective-in-cond", "error",
        "collective(s) %s run inside a cond branch or a Switch-guarded region, so "
        "a rank whose predicate differs skips them and the others hang; move every "
        "allreduce/allgather/broadcast before the cond (reduce the overflow flags "
        "and gradients first, then gate only local updates), as "
        "MultiOptimizerLossScale(distributed=...) does." % ", ".join(ops[:6]),
        tuple(ops))]
