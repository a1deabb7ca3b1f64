"""Dtypes: NLS007 (float16 variables updated without a float32 master
copy)."""

from __future__ import absolute_import, division, print_function

from npu_lossscale.audit import _facts
from npu_lossscale.audit._findings import Finding, _sorted

__all__ = ["check_float16_master"]


# -- NLS007 ----------------------------------------------------------------------

def check_float16_master(context):
    """Optimizer updates of float16 variables."""
    facts, model = context.facts, context.model
    pairs = sorted((op, var) for op, var in context.train_updates().items()
                   if var in facts.trainable and model.dtype_enum(var) == _facts.DT_HALF)
    if not pairs:
        return []
    variables = sorted(set(v for _, v in pairs))
    return [Finding(
        "NLS007-float16-master", "warning",
        "%d float16 variable(s) (%s) are updated directly by an optimizer, so "
        "updates smaller than their float16 spacing are lost; keep the variables "
        "in float32 and cast them to float16 where they are used (float32 master "
        "weights)." % (len(variables), ", ".join(variables[:6])),
        _sorted([op for op, _ in pairs] + variables))]
