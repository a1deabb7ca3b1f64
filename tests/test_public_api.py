"""The public surface is a contract: this test pins it."""

import sys

import warm_python

import npu_lossscale


def test_all_is_pinned():
    assert sorted(npu_lossscale.__all__) == [
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
    for name in npu_lossscale.__all__:
        assert getattr(npu_lossscale, name).__doc__, name


def test_train_ops_fields():
    # The step ops, what a loop fetches with update_op, then the grouped
    # rest (issue 31: the diagnosis one record, the groups' decisions and
    # scales one dict of records).
    assert npu_lossscale.TrainOps._fields == (
        "update_op", "per_group", "accumulate_op", "is_finite", "applied", "loss_scale",
        "skipped_steps", "window_end", "grads_and_vars", "groups", "diagnosis", "underflow",
        "observed", "clear_status", "counts_skipped_steps")
    from npu_lossscale.builder import GroupReport, SkipReport
    assert GroupReport._fields == ("is_finite", "loss_scale")
    assert SkipReport._fields == ("skip_reason", "groups_overflowed", "last_skip",
                                  "recent_skips")


def test_the_public_names_bind_on_first_use():
    """``import npu_lossscale`` imports none of the library's TensorFlow
    modules; the first public name used binds them all, and the subpackages
    they import (``nl.managers``, ``nl.seams``, as an eager import bound
    them). ``npu_lossscale.audit`` is the function even when the subpackage
    of that name is imported first; an unknown name is an AttributeError."""
    code = "\n".join([
        "import sys",
        "import npu_lossscale as nl",
        "assert 'npu_lossscale.builder' not in sys.modules",
        "assert sorted(set(nl.__all__) - set(dir(nl))) == []",
        "import npu_lossscale.audit",
        "assert callable(nl.audit) and nl.audit.__module__ == 'npu_lossscale.audit'",
        "assert nl.MultiOptimizerLossScale.__module__ == 'npu_lossscale.builder'",
        "assert nl.managers.LossScaleManager is nl.LossScaleManager",
        "assert nl.seams.StepObserver is nl.StepObserver",
        "from npu_lossscale import *",
        "assert underflow_summaries is sys.modules['npu_lossscale.underflow'].summaries",
        "try:",
        "    nl.LossScaleManagr",
        "except AttributeError as error:",
        "    print(error)",
    ])
    run = warm_python.run([sys.executable, "-c", code], stdout=warm_python.PIPE,
                          stderr=warm_python.PIPE, universal_newlines=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "module 'npu_lossscale' has no attribute 'LossScaleManagr'"


def test_a_subpackage_is_there_before_any_public_name():
    """``nl.managers.LossScaleManager`` as the first use (docs/managers.md's
    own manager subclasses it so)."""
    code = ("import npu_lossscale as nl\n"
            "from npu_lossscale import seams\n"
            "print(nl.managers.LossScaleManager.__name__, seams.SkipCondition.__name__)\n"
            "print(hasattr(nl, 'no_such_module'))\n")
    run = warm_python.run([sys.executable, "-c", code], stdout=warm_python.PIPE,
                          stderr=warm_python.PIPE, universal_newlines=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["LossScaleManager", "SkipCondition", "False"]
