"""npu_lossscale: one loss-scaled, overflow-checked update op for several
TF1 optimizers in one ``session.run``, on Ascend NPUs, GPUs and CPUs.

The public names are ``__all__`` (README.md, "API"); ``diagnostics`` reads
back why a step skipped, and ``python -m npu_lossscale.audit model.meta``
audits an existing graph.

The package imports its public names, and TensorFlow with them, the first
time one is used (PEP 562, Python 3.7): ``python -m npu_lossscale.port``
rewrites source without waiting for TensorFlow to load.
"""

import importlib
import importlib.util
import sys
import types

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


def _public_names():
    """Imports the modules that define ``__all__`` and returns its names.

    Returns:
      A dict from each name of ``__all__`` to its object.
    """
    # pylint: disable=import-outside-toplevel
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
    from npu_lossscale.backends import all_finite
    from npu_lossscale.distributed.sync_replicas import SyncReplicasOptimizer
    from npu_lossscale.underflow import summaries as underflow_summaries
    return dict(locals())


def __getattr__(name):
    """Binds every public name on the first use of one, and imports a
    subpackage or module on the first use of its name (PEP 562).

    Raises:
      AttributeError: if ``name`` is neither.
    """
    if name in __all__:
        for public, value in _public_names().items():
            setattr(sys.modules[__name__], public, value)
        return globals()[name]
    if not name.startswith("_") and importlib.util.find_spec(__name__ + "." + name):
        return importlib.import_module(__name__ + "." + name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def __dir__():
    """Lists the public names with the ones already bound."""
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package's module: ``npu_lossscale.audit`` stays the function.

    Importing the subpackage ``npu_lossscale.audit`` binds it as this
    package's ``audit`` attribute; the public name is the function of the
    same name, so that binding is not kept.
    """

    def __setattr__(self, name, value):
        if name == "audit" and isinstance(value, types.ModuleType):
            return
        super(_Package, self).__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
