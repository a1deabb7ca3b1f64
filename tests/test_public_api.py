"""The public surface is a contract: this test pins it."""

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
        "observed", "clear_status")
    from npu_lossscale.builder import GroupReport, SkipReport
    assert GroupReport._fields == ("is_finite", "loss_scale")
    assert SkipReport._fields == ("skip_reason", "groups_overflowed", "last_skip")
