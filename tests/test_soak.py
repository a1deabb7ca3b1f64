"""Soak: 3,000 steps of a float16 two-optimizer GAN under seeded random
overflow injection (tests/soak.py; ``make soak`` runs 100,000).

The runner records every step; the assertions below recompute the checks
from those records rather than trusting the runner's own verdict alone.
"""

import numpy as np
import pytest

import soak

STEPS = 3000
SEED = 7


@pytest.fixture(scope="module")
def report():
    config = soak.default_config(STEPS, seed=SEED)
    assert config.bursts == (1000,)
    return soak.run_soak(config)


def _replay(config, finite):
    """The scale each step should use, given which steps were finite."""
    scale, good, used = config.initial_scale, 0, []
    for ok in finite:
        used.append(scale)
        if not ok:
            scale, good = max(scale / config.multiplier, config.min_loss_scale), 0
        elif good + 1 >= config.growth_steps:
            scale, good = min(scale * config.multiplier, config.max_loss_scale), 0
        else:
            good += 1
    return np.array(used), scale


def test_soak_has_no_violation(report):
    assert report.violations == [], soak.summary(report)
    assert len(report.finite) == STEPS
    assert report.weight_checks >= STEPS // report.config.check_every


def test_injections_cover_every_target_and_value(report):
    codes, in_burst = soak.injection_plan(report.config)
    assert np.array_equal(codes > 0, report.injected)
    assert set(codes[codes > 0]) == set(range(1, len(soak.TARGETS) * len(soak.VALUES) + 1))
    random = report.injected & ~in_burst
    assert 30 <= random.sum() <= 100  # p = 0.02 of 3,000 steps, bursts aside
    assert in_burst.sum() == report.config.burst_len


def test_every_injected_overflow_is_caught(report):
    assert report.injected.sum() > 0
    assert not report.finite[report.injected].any()


def test_no_false_positive_every_non_injected_overflow_is_genuine(report):
    """Non-injected overflows are exactly the accounted-for genuine ones."""
    unexplained = ~report.finite & ~report.injected
    genuine = report.scale_overflow | report.grad_overflow
    assert np.array_equal(unexplained, genuine)
    # Scale overflows: exactly the non-injected steps run at a scale that
    # does not fit float16, and this float16 model does reach it.
    with np.errstate(over="ignore"):
        too_big = np.isinf(report.scale.astype(np.float16))
    assert np.array_equal(report.scale_overflow, too_big & ~report.injected)
    assert report.scale_overflow.sum() > 10
    # Every other step below 2**16 was finite unless injected or verified.
    assert report.finite[~too_big & ~report.injected & ~report.grad_overflow].all()
    assert report.probe == {2.0 ** 15: True, 2.0 ** 16: False}


def test_global_step_counts_applied_steps(report):
    assert np.array_equal(report.applied, report.finite)
    assert report.global_step == report.applied.sum()
    assert report.global_step < STEPS


def test_scale_follows_the_rule_and_stays_in_bounds(report):
    config = report.config
    expected, final = _replay(config, report.finite)
    assert np.array_equal(report.scale, expected)
    assert report.final_scale == final
    assert report.scale.min() >= config.min_loss_scale
    assert report.scale.max() <= config.max_loss_scale
    assert config.min_loss_scale <= report.final_scale <= config.max_loss_scale


def test_burst_floors_the_scale_then_training_recovers(report):
    config = report.config
    (burst,) = report.bursts
    start, end = burst["start"], burst["start"] + config.burst_len
    assert report.injected[start:end].all() and not report.finite[start:end].any()
    assert not report.applied[start:end].any()
    assert burst["scale_after_burst"] == config.min_loss_scale == report.scale[end]
    # 2**15 -> 4 takes 13 halvings, then the scale sat at the floor: the
    # streak counts all consecutive overflows (at least the burst's 50).
    assert burst["streak"] == burst["expected_streak"] >= config.floor_warning_after
    assert burst["warned"]
    # Recovery: every step applies, and after k finite steps the scale is
    # exactly min_loss_scale * 2 ** (k // growth_steps).
    recovery = slice(end, end + config.recovery)
    assert report.finite[recovery].all() and report.applied[recovery].all()
    expected = [config.min_loss_scale * config.multiplier ** (k // config.growth_steps)
                for k in range(config.recovery)]
    assert burst["recovery_scales"] == expected == list(report.scale[recovery])
    assert expected[-1] == 4.0 * 2 ** 7
    assert burst["recovery_applied"] == burst["global_step_gain"] == config.recovery
    assert len(burst["moved"]) == 8  # every weight of both networks kept training
    # And the scale grew back to its float16 ceiling later in the run.
    assert report.scale[end + config.recovery:].max() == 2.0 ** 16


def test_every_skip_has_its_reason_and_the_collapse_alarm_is_never_false(report):
    """Applied steps say "applied"; a poisoned loss says "loss_not_finite", a
    scale that does not fit float16 "gradients_overflowed" (the run checks
    each step); the collapse policy fires at the 20th skip of the burst and
    nowhere else."""
    names = np.array(soak.nl.diagnostics.REASONS)[report.reason]
    assert np.array_equal(names == "applied", report.applied)
    assert set(names[report.scale_overflow]) == {"gradients_overflowed"}
    codes, _ = soak.injection_plan(report.config)
    targets = np.array(["none"] + [t for t in soak.TARGETS for _ in soak.VALUES])[codes]
    poisoned_loss = np.isin(targets, ["d_loss", "g_loss"])
    assert set(names[poisoned_loss]) == {"loss_not_finite"}
    assert set(names[np.isin(targets, ["real", "z"])]) <= {"loss_not_finite",
                                                            "gradients_overflowed"}
    # The 20th consecutive skip: the burst's 20th step, or earlier when
    # skips ran into the burst.
    start, after = report.config.bursts[0], report.config.floor_warning_after
    [alarm] = report.alarms
    assert start <= alarm <= start + after - 1
    assert not report.finite[alarm - after + 1:alarm + 1].any()


def test_command_line_exits_non_zero_on_a_violation(monkeypatch, capsys):
    real = soak.run_soak

    def sabotaged(config, log=None):
        result = real(config, log)
        result.violations.append("injected for the test")
        return result

    monkeypatch.setattr(soak, "set_graph_mode", lambda: None)
    assert soak.main(["--steps", "50"]) == 0
    monkeypatch.setattr(soak, "run_soak", sabotaged)
    assert soak.main(["--steps", "50"]) == 1
    out = capsys.readouterr().out
    assert "violations:           1" in out and "injected for the test" in out
