"""npu_lossscale: one loss-scaled, overflow-checked update op for several
TF1 optimizers in one ``session.run``, on Ascend NPUs, GPUs and CPUs.

The public names are ``__all__`` (README.md, "API"); ``diagnostics`` reads
back why a step skipped, and ``python -m npu_lossscale.audit model.meta``
audits an existing graph.
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
from npu_lossscale.distributed.sync_replicas import SyncReplicasOptimizer
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
    "SyncReplicasOptimizer",
    "TrainOps",
    "all_finite",
    "audit",
    "summaries",
    "underflow_summaries",
]
