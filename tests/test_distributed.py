"""Data parallelism: every worker reaches the same skip decision, and no
collective ever sits inside a cond.

The two-rank runs need Horovod, which `make test` builds against TF 2.15.1 and
runs this file with; elsewhere those tests are skipped with that reason. The
graph walks and bad-input checks that need no second process run everywhere
Horovod or the npu shim imports.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import REPO
from graph_walk import collectives_inside_conds, collectives_outside_conds
from models import two_group_gan

try:
    import horovod.tensorflow as hvd
except ImportError:
    hvd = None

needs_horovod = pytest.mark.skipif(
    hvd is None, reason="Horovod is built against TF 2.15.1; make test runs this file there")
WORKER = os.path.join(REPO, "tests", "distributed", "dp_worker.py")
RUN_TIMEOUT = 240


def _horovodrun(out_dir, *worker_args):
    """Runs dp_worker.py on 2 ranks; a hang fails and names the stalled rank."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    command = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo",
               "--network-interfaces", "lo", sys.executable, WORKER, str(out_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    try:
        done = subprocess.run(command + list(worker_args), capture_output=True, text=True,
                              timeout=RUN_TIMEOUT, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        stalled = []
        for rank in (0, 1):
            path = os.path.join(str(out_dir), "rank%d.progress" % rank)
            lines = open(path).read().split() if os.path.exists(path) else []
            stalled.append("rank %d: %s" % (rank, " ".join(lines[-2:]) or "no step finished"))
        pytest.fail("2-rank run hung for %ds; last progress: %s" % (RUN_TIMEOUT, "; ".join(stalled)))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.load(open(os.path.join(str(out_dir), "rank%d.json" % r))) for r in (0, 1)]


@needs_horovod
def test_two_ranks_agree_on_every_skip_and_stay_identical(tmp_path):
    rank0, rank1 = _horovodrun(tmp_path)
    assert rank0["size"] == rank1["size"] == 2
    for a, b in zip(rank0["records"], rank1["records"]):
        assert a["finite"] == b["finite"] == (a["step"] != 2), (a, b)
        assert a["scale_after"] == b["scale_after"]
        assert a["global_step"] == b["global_step"]
    assert [r["scale_after"] for r in rank0["records"]] == [1024.0, 1024.0, 512.0, 512.0]
    assert rank0["records"][-1]["global_step"] == 3
    for name, value in rank0["weights"].items():
        assert np.array_equal(value, rank1["weights"][name]), name


@needs_horovod
def test_without_gradient_allreduce_rank0_still_skips_the_step_rank1_broke(tmp_path):
    rank0, rank1 = _horovodrun(tmp_path, "--no-allreduce")
    step2 = rank0["records"][2]
    assert not step2["finite"] and not step2["applied"]  # its own gradients were finite
    assert [r["global_step"] for r in rank0["records"]] == [r["global_step"] for r in rank1["records"]]
    # Local gradients on different data: the weights legitimately differ.
    assert any(not np.array_equal(v, rank1["weights"][k]) for k, v in rank0["weights"].items())


@needs_horovod
def test_two_ranks_with_accumulation(tmp_path):
    rank0, rank1 = _horovodrun(tmp_path, "--accumulate", "2", "--steps", "6")
    applied = [r["applied"] for r in rank0["records"]]
    assert applied == [False, True, False, False, False, True]  # window 2 holds step 2
    assert applied == [r["applied"] for r in rank1["records"]]
    for name, value in rank0["weights"].items():
        assert np.array_equal(value, rank1["weights"][name]), name


def _configurations():
    for engine in ("horovod", "hccl"):
        for policy in ("all", "per_group"):
            for accumulation in (1, 3):
                for allreduce in (True, False):
                    yield engine, policy, accumulation, allreduce


def _engine_ready(engine, npu_shim_path):
    if engine == "horovod":
        if hvd is None:
            pytest.skip("Horovod is built against TF 2.15.1; make test runs this file there")
        hvd.init()
    else:
        sys.path.insert(0, npu_shim_path)


@pytest.mark.parametrize("engine, policy, accumulation, allreduce", list(_configurations()))
def test_no_collective_inside_any_cond(engine, policy, accumulation, allreduce, request):
    from conftest import SHIMS
    _engine_ready(engine, SHIMS)
    try:
        with tf.Graph().as_default() as graph:
            model = two_group_gan(compute_dtype=tf.float16)
            backend = "npu" if engine == "hccl" else "is_finite"
            scaler = nl.MultiOptimizerLossScale(
                nl.DynamicLossScaleManager(), backend=backend, skip_policy=policy,
                distributed=engine, allreduce_gradients=allreduce)
            scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars, name="d")
            scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars, name="g")
            train = scaler.build(global_step=tf.train.get_or_create_global_step(),
                                 accumulation_steps=accumulation)
            assert collectives_inside_conds(graph) == []
            outside = collectives_outside_conds(graph)
            assert outside, "expected the flag reduction at the top level"
            if engine == "hccl":  # one worker: the shim's allreduce is the identity
                with tf.Session() as sess:
                    sess.run(tf.global_variables_initializer())
                    assert sess.run([train.update_op, train.is_finite], model.feed)[1]
    finally:
        if engine == "hccl":
            sys.path.remove(SHIMS)
            emulation = sys.modules.get("npu_bridge._emulation")
            if emulation is not None:
                emulation.uninstall()
            for name in [m for m in sys.modules if m.startswith("npu_bridge")]:
                del sys.modules[name]


class _CollectiveInApply(tf.train.GradientDescentOptimizer):
    """Puts a stand-in collective (an op named like an allreduce) in its apply."""

    def _apply_dense(self, grad, var):
        return super(_CollectiveInApply, self)._apply_dense(
            tf.identity(grad, name="fake_allreduce"), var)

    def _resource_apply_dense(self, grad, handle):
        return super(_CollectiveInApply, self)._resource_apply_dense(
            tf.identity(grad, name="fake_allreduce"), handle)


@pytest.mark.parametrize("policy", ["all", "per_group"])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_walk_finds_a_collective_under_the_apply_gate(graph, policy, accumulation):
    """Negative control: the apply gate is no cond, so the walk must follow
    its pivot; a collective placed under it is found, in our gate."""
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), skip_policy=policy)
    scaler.add(model.d_loss, _CollectiveInApply(0.1), var_list=model.d_vars, name="d")
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars, name="g")
    scaler.build(accumulation_steps=accumulation)
    for only_ours in (False, True):
        found = collectives_inside_conds(graph, only_ours=only_ours)
        assert len(found) == len(model.d_vars), found
        assert all("fake_allreduce" in name for name in found), found
    if accumulation == 1:
        assert collectives_outside_conds(graph) == []


def test_unknown_engine(graph):
    with pytest.raises(ValueError, match=r"distributed must be None or one of .* got 'nccl'"):
        nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), distributed="nccl")


def test_horovod_missing(graph, monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod", None)
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)
    with pytest.raises(ValueError, match="distributed='horovod' needs Horovod"):
        nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), distributed="horovod")


@needs_horovod
def test_horovod_before_init():
    code = textwrap.dedent("""
        import tensorflow.compat.v1 as tf
        tf.disable_eager_execution()
        import npu_lossscale as nl
        try:
            nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), distributed="horovod")
        except ValueError as error:
            assert "before hvd.init()" in str(error), error
            print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.stdout.strip().endswith("OK"), out.stderr[-2000:]


@needs_horovod
def test_distributed_optimizer_with_allreduce_is_a_double_reduction(graph):
    hvd.init()
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), distributed="horovod")
    wrapped = hvd.DistributedOptimizer(tf.train.AdamOptimizer())
    with pytest.raises(ValueError, match="already allreduces.*allreduce_gradients=False"):
        scaler.add(model.d_loss, wrapped, var_list=model.d_vars)
    ok = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), distributed="horovod",
                                    allreduce_gradients=False)
    ok.add(model.d_loss, hvd.DistributedOptimizer(tf.train.AdamOptimizer()), var_list=model.d_vars)
    ok.build()
    # Horovod's DistributedOptimizer wraps its own allreduce in a cond whose
    # predicate is the constant `size() > 1`, equal on every rank; none of
    # the conds this library builds holds a collective.
    assert collectives_inside_conds(tf.get_default_graph(), only_ours=True) == []
    assert collectives_inside_conds(tf.get_default_graph())  # Horovod's own
