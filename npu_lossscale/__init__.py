"""npu_lossscale: one loss-scaled, overflow-checked update op for several
TF1 optimizers in one ``session.run``, on Ascend NPUs, GPUs and CPUs.

Public API::

  managers   FixedLossScaleManager, ExponentialUpdateLossScaleManager,
             DynamicLossScaleManager, NoOpLossScaleManager (bfloat16: scale
             1, non-finite steps skipped), and their protocol,
             LossScaleManager
  underflow  ListeningLossScaleManager (a dynamic scale steered by the
             underflow measurement), underflow_summaries (of
             TrainOps.underflow, from build(measure_underflow=True))
  builder    MultiOptimizerLossScale, TrainOps
  seams      GradientTransform, SkipCondition, StepObserver, ReductionEngine
             (the step's extension points)
  optimizer  LossScaleOptimizer
  overflow   all_finite (the builder's own decision for a list of gradients)
  monitoring summaries, LossScaleHook (logging and the collapse policy),
             CollapseMonitor and LossScaleCollapse (the policy in a plain loop)
  diagnostics  why a step skipped: REASONS, reason_name, read_last_skip
             (TrainOps.diagnosis.skip_reason, groups_overflowed, last_skip)
  audit      audit, Finding (loss-scaling hazards in an existing TF1 graph;
             also ``python -m npu_lossscale.audit model.meta``)
"""

from npu_lossscale.audit import Finding, audit
from npu_lossscale.builder import MultiOptimizerLossScale, TrainOps
from npu_lossscale.managers import (DynamicLossScaleManager,
                                    ExponentialUpdateLossScaleManager,
                                    FixedLossScaleManager, LossScaleManager,
                                    NoOpLossScaleManager)
from npu_lossscale.managers.listening import ListeningLossScaleManager
from npu_lossscale.monitoring import (CollapseMonitor, LossScaleCollapse, LossScaleHook,
                                      summaries)
from npu_lossscale.optimizer import LossScaleOptimizer
from npu_lossscale.seams import GradientTransform, ReductionEngine, SkipCondition, StepObserver
from npu_lossscale.core.overflow import all_finite
from npu_lossscale.underflow import summaries as underflow_summaries

__version__ = "0.3.0"

__all__ = [
    "CollapseMonitor",
    "DynamicLossScaleManager",
    "ExponentialUpdateLossScaleManager",
    "Finding",
    "FixedLossScaleManager",
    "GradientTransform",
    "ListeningLossScaleManager",
    "LossScaleCollapse",
    "LossScaleHook",
    "LossScaleManager",
    "LossScaleOptimizer",
    "MultiOptimizerLossScale",
    "NoOpLossScaleManager",
    "ReductionEngine",
    "SkipCondition",
    "StepObserver",
    "TrainOps",
    "all_finite",
    "audit",
    "summaries",
    "underflow_summaries",
]
