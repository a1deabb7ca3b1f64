"""The public surface is a contract: this test pins it."""

import npu_lossscale


def test_all_is_pinned():
    assert sorted(npu_lossscale.__all__) == [
        "CollapseMonitor",
        "DynamicLossScaleManager",
        "ExponentialUpdateLossScaleManager",
        "Finding",
        "FixedLossScaleManager",
        "ListeningLossScaleManager",
        "LossScaleCollapse",
        "LossScaleHook",
        "LossScaleManager",
        "LossScaleOptimizer",
        "MultiOptimizerLossScale",
        "NoOpLossScaleManager",
        "TrainOps",
        "all_finite",
        "audit",
        "summaries",
        "underflow_summaries",
    ]
    for name in npu_lossscale.__all__:
        assert getattr(npu_lossscale, name).__doc__, name


def test_train_ops_fields():
    assert npu_lossscale.TrainOps._fields == (
        "update_op", "is_finite", "loss_scale", "grads_and_vars",
        "applied", "window_end", "group_is_finite", "loss_scales", "accumulate_op",
        "per_group", "skipped_steps", "clear_status", "underflow", "skip_reason",
        "groups_overflowed", "last_skip")  # new fields only at the end
