"""The apply gate: the Switch/Merge pivot by default, a ``tf.cond`` where
Ascend rejects v1 control flow.

Facts from Huawei's tf_adapter docs (docs/en/tfadapter_1, "dynamic shape"
and the ENABLE_FORCE_V2_CONTROL environment variable): v1 control operators
are rejected on dynamic-shape graphs; the fixes are tf.enable_control_flow_v2()
or ENABLE_FORCE_V2_CONTROL=1, whose functionalization converts v1 conds but
not raw Switch/Merge pairs; an If branch cannot assign ref variables, so the
docs pair control flow v2 with tf.enable_resource_variables().
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale.core import checks
from npu_lossscale.core import plan as P
from conftest import GRAPH_MODE, SKIPPED_STEPS, fresh_process, snapshot_globals
from models import add_gan_groups, two_group_gan
import warm_python

RAW_CONTROL = ("Switch", "Merge", "RefSwitch", "RefMerge")


def _build(gate="auto", backend="is_finite", count_skipped_steps=False,
           dtype=tf.float32):
    model = two_group_gan(compute_dtype=dtype)
    manager = nl.DynamicLossScaleManager(2.0 ** 8, growth_steps=2)
    scaler = nl.MultiOptimizerLossScale(manager, backend=backend, gate=gate)
    add_gan_groups(scaler, model)
    gs = tf.train.get_or_create_global_step()
    return model, scaler.build(global_step=gs, count_skipped_steps=count_skipped_steps), gs


def _raw_control_ops(graph):
    """Switch/Merge ops that are not part of a v1 ``tf.cond``.

    A v1 cond registers its context in the COND_CONTEXT collection; its own
    Switch/Merge ops sit under the cond's name scope (the pred switch and the
    result merge are outside the context itself). Those the adapter's
    functionalization converts; any other Switch/Merge it cannot.
    """
    conds = [context.name.rsplit("/", 1)[0] + "/"
             for context in graph.get_collection(tf.GraphKeys.COND_CONTEXT)]
    return [op.name for op in graph.get_operations()
            if op.type in RAW_CONTROL and not any(op.name.startswith(c) for c in conds)]


def _run_and_poison(model, train, gs):
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.is_finite], model.feed)[1]
        state = {v.op.name for v in tf.global_variables()
                 if v.op.name.startswith(("dynamic_loss_scale", SKIPPED_STEPS))}
        before = snapshot_globals(sess, exclude=state)
        feed = dict(model.feed)
        feed[model.poison_g] = np.inf
        assert not sess.run([train.update_op, train.is_finite], feed)[1]
        after = snapshot_globals(sess, exclude=state)
        assert set(before) == set(after)
        for name in before:
            assert np.array_equal(before[name], after[name]), name
        assert sess.run(train.skipped_steps) == 1
        assert sess.run([train.update_op, train.is_finite], model.feed)[1]
        return sess.run(gs)


def test_auto_gate_is_the_pivot_off_ascend(graph):
    _build()
    ops = [op.type for op in graph.get_operations()]
    # Functional Ifs only where the skip diagnosis keeps one whole: under
    # the pivot's false side, and the skip report's, run only when fetched,
    # on the same two branch functions (the diagnosis is built once). The
    # record is read through a Switch and a Merge: none is the gate.
    ifs = dict((op.name, op) for op in graph.get_operations()
               if op.type in ("If", "StatelessIf"))
    assert "Switch" in ops
    assert sorted(ifs) == ["loss_scale/diagnose/diagnose", "loss_scale/skip_report/diagnose"]
    branches = [tuple(op.get_attr(key).name for key in ("then_branch", "else_branch"))
                for op in ifs.values()]
    assert branches[0] == branches[1]


def test_cond_gate_has_no_raw_switch_merge_and_skips_atomically(graph):
    model, train, gs = _build(gate="cond")
    assert _raw_control_ops(graph) == []
    if GRAPH_MODE == "v2":  # control flow v2: one functional If, kept as is
        assert any(op.type in ("If", "StatelessIf") for op in graph.get_operations())
    assert _run_and_poison(model, train, gs) == 2


def test_cond_gate_matches_the_pivot_bit_for_bit():
    results = []
    for gate in ("pivot", "cond"):
        with tf.Graph().as_default():
            tf.set_random_seed(0)
            model, train, _ = _build(gate=gate)
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                feed = dict(model.feed)
                for step in range(6):
                    feed[model.poison_g] = np.inf if step == 3 else 1.0
                    sess.run(train.update_op, feed)
                results.append(snapshot_globals(sess))
    assert set(results[0]) == set(results[1])
    for name in results[0]:
        assert np.array_equal(results[0][name], results[1][name]), name


def test_force_v2_control_env_picks_the_cond(graph, monkeypatch):
    monkeypatch.setenv("ENABLE_FORCE_V2_CONTROL", "1")
    _build()
    assert _raw_control_ops(graph) == []


def test_npu_backend_with_control_flow_v2_picks_the_cond(graph, saturation_mode):
    model, train, gs = _build(backend="npu", dtype=tf.float16)
    if GRAPH_MODE == "v2":
        assert _raw_control_ops(graph) == []
    else:  # v1 control flow, as TF 1.15 runs by default: the cheaper pivot
        assert "Switch" in [op.type for op in graph.get_operations()]
    assert _run_and_poison(model, train, gs) == 2


def test_choose_gate_rule():
    assert P.choose_gate("auto", False, False, True) == "pivot"  # TF 2.x default alone
    assert P.choose_gate("auto", True, False, True) == "cond"
    assert P.choose_gate("auto", True, False, False) == "pivot"
    assert P.choose_gate("auto", False, True, False) == "cond"
    assert P.choose_gate("pivot", True, True, True) == "pivot"
    with pytest.raises(ValueError, match="gate"):
        checks.check_gate("if")


@fresh_process
def test_ref_variables_under_a_functional_if_get_a_clear_error():
    """Ref variables with control flow v2 on: say what to enable."""
    code = """
import tensorflow.compat.v1 as tf
tf.disable_eager_execution(); tf.disable_resource_variables(); tf.enable_control_flow_v2()
import npu_lossscale as nl
w = tf.Variable(1.0)
scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="is_finite", gate="cond")
scaler.add(w * 2.0, tf.train.GradientDescentOptimizer(0.1), var_list=[w])
try:
    scaler.build()
except ValueError as error:
    assert "enable_resource_variables" in str(error), error
    print("OK")
"""
    import sys
    from conftest import REPO
    out = warm_python.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip().endswith("OK"), out.stderr[-2000:]


def test_saturation_path_has_no_is_finite_op(graph, saturation_mode):
    """tf_adapter's docs: CANN does not support tf.is_finite; npu_bridge's
    managers test the ceiling with less() instead (tf_adapter
    npu_bridge/estimator/npu/npu_loss_scale_manager.py). So nothing the
    builder adds on the register path may be an IsFinite op."""
    before = set(graph.get_operations())
    for index, manager in enumerate((nl.DynamicLossScaleManager(),
                                     nl.ExponentialUpdateLossScaleManager(2.0 ** 32, 1000))):
        with tf.variable_scope("model_%d" % index):
            model = two_group_gan(compute_dtype=tf.float16)
        scaler = nl.MultiOptimizerLossScale(manager, backend="npu")
        add_gan_groups(scaler, model)
        scaler.build(global_step=tf.train.get_or_create_global_step(), per_group_ops=True)
    from npu_bridge import _emulation  # the shim's own register emulation uses IsFinite
    ours = [op for op in graph.get_operations()
            if op not in before and _emulation.INTERNAL_SCOPE not in op.name]
    assert [op.name for op in ours if op.type == "IsFinite"] == []
    graph_def = graph.as_graph_def()
    assert not any(node.op == "IsFinite" and _emulation.INTERNAL_SCOPE not in node.name
                   for f in graph_def.library.function for node in f.node_def)
