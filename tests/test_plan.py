"""The plan (npu_lossscale/core/plan.py) in plain Python: no graph, no TF objects.

Losses, optimizers and managers are stand-in objects; the plan only compares
them by identity. One test proves the module needs no TensorFlow at all.
"""

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from npu_lossscale.core import plan as P


class _Manager(object):
    def __init__(self, checked=True):
        self.checked = checked


def _group(name, loss=None, manager=None, checked=True, own_backprop=False, transforms=()):
    return P.Group(name=name, loss=loss if loss is not None else object(),
                   optimizer=object(), var_list=(object(),), transforms=transforms,
                   manager=manager if manager is not None else _SHARED,
                   checked=checked, own_backprop=own_backprop)


_SHARED = _Manager()


class _Engine(object):
    """A stand-in engine across workers: the plan reads ``mode`` only."""

    mode = "workers"


class _Backend(object):
    """A stand-in backend: the plan reads ``reads_register`` only."""

    def __init__(self, reads_register):
        self.reads_register = reads_register


_IS_FINITE = _Backend(False)
_REGISTER = _Backend(True)


def test_plan_module_imports_no_tensorflow():
    # The package binds its public names on first use, so a tool that wants
    # only the plan imports it without TensorFlow.
    code = textwrap.dedent("""
        import sys
        import npu_lossscale.core.plan as plan
        assert not [m for m in sys.modules if m.split(".")[0] == "tensorflow"], "TF imported"
        print(plan.make_plan.__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "make_plan"


def test_two_groups_one_manager_share_one_check_one_gate_one_update():
    d, g = _group("d"), _group("g")
    plan = P.make_plan([d, g], _SHARED, _IS_FINITE)
    assert plan.checks == (P.Check("shared", ("d", "g")),)
    assert plan.gates == (P.Gate("apply_if_finite", ("d", "g"), ("shared",)),)
    assert [(u.name, u.groups, u.checks) for u in plan.managers] == [
        ("shared", ("d", "g"), ("shared",))]
    assert [b.groups for b in plan.backprops] == [("d",), ("g",)]
    assert plan.window == P.Window(1, False)
    assert not plan.serial_reads and not plan.reduction.active


def test_shared_loss_and_manager_is_one_backprop():
    loss = object()
    a, b = _group("a", loss=loss), _group("b", loss=loss)
    plan = P.make_plan([a, b], _SHARED, _IS_FINITE)
    assert [backprop.groups for backprop in plan.backprops] == [("a", "b")]
    assert plan.losses == (loss,)


def test_own_compute_gradients_is_never_shared():
    loss = object()
    a, b = _group("a", loss=loss), _group("b", loss=loss, own_backprop=True)
    plan = P.make_plan([a, b], _SHARED, _IS_FINITE)
    assert [backprop.groups for backprop in plan.backprops] == [("a",), ("b",)]


def test_per_group_policy_on_is_finite_checks_each_group_and_gates_each():
    d, g = _group("d"), _group("g")
    plan = P.make_plan([d, g], _SHARED, _IS_FINITE, skip_policy="per_group")
    assert [c.groups for c in plan.checks] == [("d",), ("g",)]
    assert [(gate.name, gate.checks) for gate in plan.gates] == [
        ("apply_d_if_finite", ("d",)), ("apply_g_if_finite", ("g",))]
    assert not plan.serial_reads


def test_per_group_policy_on_a_register_reads_serially():
    d, g = _group("d"), _group("g")
    plan = P.make_plan([d, g], _SHARED, _REGISTER, skip_policy="per_group")
    assert plan.serial_reads
    assert [c.groups for c in plan.checks] == [("d",), ("g",)]


def test_register_cannot_tell_apart_groups_sharing_a_loss():
    loss = object()
    with pytest.raises(ValueError, match="share one loss"):
        P.make_plan([_group("a", loss=loss), _group("b", loss=loss)], _SHARED,
                    _REGISTER, skip_policy="per_group")


def test_per_group_managers_on_is_finite_get_their_own_checks():
    m1, m2 = _Manager(), _Manager()
    a, b = _group("a", manager=m1), _group("b", manager=m2)
    plan = P.make_plan([a, b], _SHARED, _IS_FINITE)
    assert [c.groups for c in plan.checks] == [("a",), ("b",)]
    # One gate (skip "all") waits for both; each manager follows its own group.
    assert plan.gates[0].checks == ("a", "b")
    assert [(u.name, u.groups, u.checks) for u in plan.managers] == [
        ("shared", (), ()), ("a", ("a",), ("a",)), ("b", ("b",), ("b",))]


def test_per_group_managers_on_a_register_share_its_one_read():
    m1, m2 = _Manager(), _Manager()
    plan = P.make_plan([_group("a", manager=m1), _group("b", manager=m2)], _SHARED,
                       _REGISTER)
    assert plan.checks == (P.Check("shared", ("a", "b")),)


def test_unchecked_group_is_in_no_check_and_its_gate_always_opens():
    a, b = _group("a"), _group("b", checked=False)
    plan = P.make_plan([a, b], _SHARED, _IS_FINITE, skip_policy="per_group")
    assert plan.check_of("a") == "a" and plan.check_of("b") is None
    assert plan.gates[1] == P.Gate("apply_b_if_finite", ("b",), ())


def test_window_is_closed_by_update_op_only_with_an_engine():
    groups = [_group("a")]
    assert P.make_plan(groups, _SHARED, _IS_FINITE, accumulation_steps=4).window == P.Window(4, False)
    engine = _Engine()
    plan = P.make_plan(groups, _SHARED, _IS_FINITE, engine=engine, accumulation_steps=4)
    assert plan.window == P.Window(4, True)
    assert plan.reduction.active and plan.reduction.engine is engine


def test_no_groups_is_rejected():
    with pytest.raises(ValueError, match="no groups"):
        P.make_plan([], _SHARED, _IS_FINITE)


def test_plan_records_are_immutable():
    plan = P.make_plan([_group("a")], _SHARED, _IS_FINITE)
    with pytest.raises(AttributeError):
        plan.skip_policy = "per_group"
