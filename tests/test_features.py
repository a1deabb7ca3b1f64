"""Training-loop features: accumulation, clipping, skip policy, per-group
managers, shared losses and count_skipped_steps."""

import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from models import two_group_gan


@pytest.mark.parametrize("value, error, fragment", [
    (0, ValueError, "accumulation_steps must be >= 1, got 0"),
    (2.5, TypeError, "accumulation_steps must be a whole number, got 2.5"),
    (float("nan"), ValueError, "accumulation_steps must be a finite number, got nan"),
    (True, TypeError, "accumulation_steps must be a whole number, got True"),
    ("4", TypeError, "accumulation_steps must be a whole number, got '4'"),
])
def test_bad_accumulation_steps(graph, value, error, fragment):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars)
    with pytest.raises(error) as info:
        scaler.build(accumulation_steps=value)
    assert fragment in str(info.value)


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1.0, ValueError), ("1", TypeError)])
def test_bad_clip_norm(graph, value, error):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    with pytest.raises(error, match="clip_norm"):
        scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars, clip_norm=value)


def test_bad_skip_policy(graph):
    with pytest.raises(ValueError, match="skip_policy must be one of .* got 'some'"):
        nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), skip_policy="some")


def test_bad_per_group_manager(graph):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    with pytest.raises(TypeError, match="loss_scale_manager must have get_loss_scale"):
        scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars,
                   loss_scale_manager="dynamic")
