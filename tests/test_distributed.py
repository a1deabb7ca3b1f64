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
from conftest import REPO, assert_float16_reduction_matches, snapshot_globals
from graph_walk import collectives_inside_conds, collectives_outside_conds
from models import add_gan_groups, two_group_gan
import warm_python

try:
    import horovod.tensorflow as hvd
except ImportError:
    hvd = None

needs_horovod = pytest.mark.skipif(
    hvd is None, reason="Horovod is built against TF 2.15.1; make test runs this file there")
#: The shim's two HCCL ranks run the same on every TF: the TF 2.15 leg runs
#: this file for Horovod, which exists only there, and skips them (the shim's
#: two-rank mechanics on this TF are tests/test_shim_distributed.py's).
hccl_on_primary_tf = pytest.mark.skipif(
    hvd is not None, reason="the shim's HCCL ranks: proved on the TF 2.21 leg")
WORKER = os.path.join(REPO, "tests", "distributed", "dp_worker.py")
HOROVODRUN = os.path.join(REPO, "tests", "distributed", "horovodrun.py")
RUN_TIMEOUT = 240


def _fail_stalled(out_dir):
    stalled = []
    for rank in (0, 1):
        path = os.path.join(str(out_dir), "rank%d.progress" % rank)
        lines = open(path).read().split() if os.path.exists(path) else []
        stalled.append("rank %d: %s" % (rank, " ".join(lines[-2:]) or "no step finished"))
    pytest.fail("2-rank run hung for %ds; last progress: %s" % (RUN_TIMEOUT, "; ".join(stalled)))


def _results(out_dir):
    return [json.load(open(os.path.join(str(out_dir), "rank%d.json" % r))) for r in (0, 1)]


def _two_horovod_ranks(script, *args):
    """The horovodrun command line that runs ``python script args`` on 2
    local ranks over Gloo (through tests/distributed/horovodrun.py, which
    passes horovodrun this process's answer to its Gloo build check)."""
    return [sys.executable, HOROVODRUN, "--gloo-built=%d" % hvd.gloo_built(), "-np", "2",
            "-H", "localhost:2", "--gloo", "--network-interfaces", "lo",
            sys.executable, script] + [str(a) for a in args]


def _horovodrun(out_dir, *runs):
    """Runs dp_worker.py's ``runs`` on 2 ranks, in one launch; returns each
    run's [rank 0, rank 1] results by name. A hang fails and names the
    stalled rank."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    try:
        done = subprocess.run(_two_horovod_ranks(WORKER, out_dir, *runs),
                              capture_output=True, text=True,
                              timeout=RUN_TIMEOUT, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        _fail_stalled(out_dir)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return dict((run, _results(os.path.join(str(out_dir), run))) for run in runs)


@pytest.fixture(scope="module")
def horovod_runs(tmp_path_factory):
    """dp_worker.py's three runs on 2 Horovod ranks, in one launch."""
    if hvd is None:
        pytest.skip("Horovod is built against TF 2.15.1; make test runs this file there")
    return _horovodrun(tmp_path_factory.mktemp("horovod"), "plain", "no_allreduce",
                       "accumulate")


def _hccl_run(out_dir, run):
    """Runs dp_worker.py's ``run`` as two HCCL ranks on the npu shim
    (saturation mode), one process per rank as on Ascend; a hang fails and
    names the stalled rank."""
    rendezvous = os.path.join(str(out_dir), "hccl")
    os.makedirs(rendezvous)
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3",
                   RANK_SIZE="2", RANK_ID=str(rank), NPU_SHIM_HCCL_DIR=rendezvous,
                   NPU_SHIM_HCCL_TIMEOUT=str(RUN_TIMEOUT // 2),
                   NPU_SHIM_OVERFLOW_MODE="saturation")
        procs.append(warm_python.Popen(
            [sys.executable, WORKER, str(out_dir), "--engine", "hccl", run],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
            env=env, cwd=REPO))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=RUN_TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        _fail_stalled(out_dir)
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, "rank %d:\n%s" % (rank, output[-4000:])
    return _results(os.path.join(str(out_dir), run))


@needs_horovod
def test_two_ranks_agree_on_every_skip_and_stay_identical(horovod_runs):
    rank0, rank1 = horovod_runs["plain"]
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
def test_without_gradient_allreduce_rank0_still_skips_the_step_rank1_broke(horovod_runs):
    rank0, rank1 = horovod_runs["no_allreduce"]
    step2 = rank0["records"][2]
    assert not step2["finite"] and not step2["applied"]  # its own gradients were finite
    assert [r["global_step"] for r in rank0["records"]] == [r["global_step"] for r in rank1["records"]]
    # Local gradients on different data: the weights legitimately differ.
    assert any(not np.array_equal(v, rank1["weights"][k]) for k, v in rank0["weights"].items())


@pytest.fixture(scope="module")
def float16_sum_runs(tmp_path_factory):
    """fp16_sum_worker.py on 2 Horovod ranks: its float32 and float16 runs,
    in one launch."""
    out = tmp_path_factory.mktemp("fp16_sum")
    worker = os.path.join(REPO, "tests", "distributed", "fp16_sum_worker.py")
    done = subprocess.run(_two_horovod_ranks(worker, out), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
                          cwd=REPO)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out


@needs_horovod
@pytest.mark.parametrize("float16", [False, True])
def test_float16_gradients_whose_sum_overflows_are_averaged_exactly(float16_sum_runs, float16):
    """Each rank's float16 gradient is 40000; their float16 sum is inf, so a
    float16 average would apply -inf after the overflow check passed. The
    builder averages in float32 (distributed.widened), or with
    allreduce_float16=True in float16 with each rank's value halved first
    (20000 + 20000 fits): both ranks apply the exact mean,
    w = -1e-4 * 40000. On 64 random float16 gradients per rank the float16
    reduction equals the float32 one within float16 rounding (issue 34)."""
    run = os.path.join(str(float16_sum_runs), "float16" if float16 else "float32")
    assert_float16_reduction_matches(_results(run))


@needs_horovod
def test_two_ranks_with_accumulation(horovod_runs):
    rank0, rank1 = horovod_runs["accumulate"]
    applied = [r["applied"] for r in rank0["records"]]
    assert applied == [False, True, False, False, False, True]  # window 2 holds step 2
    assert applied == [r["applied"] for r in rank1["records"]]
    finite = [r["finite"] for r in rank0["records"][1::2]]  # the closing runs
    assert finite == [r["finite"] for r in rank1["records"][1::2]] == [True, False, True]
    # The reduction runs once per window, in the closing run: one flag sum
    # and one allreduce per gradient (4 variables); micro-batches run none.
    for records in (rank0["records"], rank1["records"]):
        assert [r["collectives"] for r in records] == [0, 5, 0, 5, 0, 5]
    for name, value in rank0["weights"].items():
        assert np.array_equal(value, rank1["weights"][name]), name


@hccl_on_primary_tf
def test_hccl_ranks_agree_on_an_overflow_only_one_register_saw(tmp_path):
    """Ascend's float-status register is per device. Rank 1's overflow
    saturates (finite values), so only its register sees it; the summed flag
    makes rank 0 skip too, and the ranks stay identical."""
    rank0, rank1 = _hccl_run(tmp_path, "plain")
    for a, b in zip(rank0["records"], rank1["records"]):
        assert a["finite"] == b["finite"] == (a["step"] != 2), (a, b)
        assert a["scale_after"] == b["scale_after"] and a["global_step"] == b["global_step"]
    assert [r["scale_after"] for r in rank0["records"]] == [1024.0, 1024.0, 512.0, 512.0]
    for name, value in rank0["weights"].items():
        assert np.array_equal(value, rank1["weights"][name]), name


@hccl_on_primary_tf
def test_hccl_without_gradient_allreduce_rank0_still_skips(tmp_path):
    rank0, rank1 = _hccl_run(tmp_path, "no_allreduce")
    assert [r["applied"] for r in rank0["records"]] == [True, True, False, True]
    assert [r["applied"] for r in rank1["records"]] == [True, True, False, True]
    assert any(not np.array_equal(v, rank1["weights"][k]) for k, v in rank0["weights"].items())


@hccl_on_primary_tf
def test_hccl_ranks_reduce_once_per_window(tmp_path):
    rank0, rank1 = _hccl_run(tmp_path, "accumulate")
    for records in (rank0["records"], rank1["records"]):
        assert [r["applied"] for r in records] == [False, True, False, False, False, True]
        assert [r["collectives"] for r in records] == [0, 5, 0, 5, 0, 5]
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
                    for _ in range(accumulation - 1):  # the window's first micro-batches
                        sess.run(train.accumulate_op, model.feed)
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
    out = warm_python.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
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


# -- accumulation with an engine: one reduction per window --------------------

WINDOW = 3


def _window_model(distributed, policy="all", allreduce=True, backend="is_finite"):
    """The two-group model under accumulation; returns (model, train, manager, gs)."""
    model = two_group_gan(compute_dtype=tf.float16)
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 10, growth_steps=2)
    scaler = nl.MultiOptimizerLossScale(manager, backend=backend, skip_policy=policy,
                                        distributed=distributed,
                                        allreduce_gradients=allreduce)
    add_gan_groups(scaler, model)
    gs = tf.train.get_or_create_global_step()
    return model, scaler.build(global_step=gs, accumulation_steps=WINDOW), manager, gs


def _micro_batches(model, windows, poison=()):
    """Feeds for ``windows`` windows; micro-batch indices in ``poison`` overflow."""
    rng = np.random.RandomState(5)
    feeds = []
    for i in range(windows * WINDOW):
        feed = {model.x: rng.normal(0, 1, model.x.shape.as_list()).astype(np.float32)}
        if i in poison:
            feed[model.poison_g] = np.inf
        feeds.append(feed)
    return feeds


def _collective_names(graph):
    """Collective ops by type, or by their own name for the shim's stand-ins
    (not by name scope: "allreduce_gradients/truediv" is arithmetic)."""
    from graph_walk import is_collective
    return set(op.name for op in graph.get_operations()
               if is_collective(op.type, op.name.rsplit("/", 1)[-1]))


def _no_grappler():
    # Grappler may fold the shim's identity-backed allreduce away; keep it.
    config = tf.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config


@pytest.mark.parametrize("allreduce", [True, False])
def test_window_reduces_once_per_window_and_never_inside_a_cond(npu_shim, allreduce):
    with tf.Graph().as_default() as graph:
        model, train, _, _ = _window_model("hccl", allreduce=allreduce)
        assert collectives_inside_conds(graph) == []
        collectives = _collective_names(graph)
        executed = []
        with tf.Session(config=_no_grappler()) as sess:
            sess.run(tf.global_variables_initializer())
            for i, feed in enumerate(_micro_batches(model, 2)):
                op = train.update_op if i % WINDOW == WINDOW - 1 else train.accumulate_op
                meta = tf.RunMetadata()
                sess.run(op, feed, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
                         run_metadata=meta)
                names = set(node.node_name for dev in meta.step_stats.dev_stats
                            for node in dev.node_stats)
                executed.append(len(names & collectives))
    # One flag reduction, plus one allreduce per gradient (4 variables), only
    # in the run that closes each window.
    per_window = 1 + (4 if allreduce else 0)
    assert executed == [0, 0, per_window, 0, 0, per_window]


@pytest.mark.parametrize("policy", ["all", "per_group"])
def test_window_with_an_engine_equals_the_single_worker_window(npu_shim, policy):
    """One worker: reducing once per window (hccl shim, identity allreduce) must
    give bit for bit what the engine-free accumulation gives."""
    def run(distributed):
        with tf.Graph().as_default():
            tf.set_random_seed(0)
            model, train, manager, gs = _window_model(distributed, policy)
            feeds = _micro_batches(model, 3, poison={4})  # window 2 overflows in g
            records = []
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                for i, feed in enumerate(feeds):
                    last = i % WINDOW == WINDOW - 1
                    # The accumulate_op/update_op loop, which works with or
                    # without an engine.
                    if last:
                        records.append(sess.run(
                            [train.update_op, train.applied, _finite(train)], feed)[1:])
                    else:
                        sess.run(train.accumulate_op, feed)
                return records, snapshot_globals(sess)

    plain_records, plain = run(None)
    window_records, windowed = run("hccl")
    g_finite = [True, False, True]  # per window
    assert [r[0] for r in window_records] == [r[0] for r in plain_records] == (
        g_finite if policy == "all" else [True] * 3)
    # With an engine group_is_finite is the window's decision; without one it
    # is this run's (the closing micro-batch was finite in every window).
    assert [r[1]["g"] for r in window_records] == g_finite
    assert [r[1]["d"] for r in window_records] == (g_finite if policy == "all" else [True] * 3)
    assert [r[1]["g"] for r in plain_records] == [True] * 3
    assert sorted(plain) == sorted(windowed)
    for name in plain:
        assert np.array_equal(plain[name], windowed[name]), name


def test_window_misuse_fails_the_run_and_changes_nothing(npu_shim):
    with tf.Graph().as_default():
        model, train, _, _ = _window_model("hccl")
        feed = _micro_batches(model, 1)[0]
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            start = snapshot_globals(sess)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="Run accumulate_op for the first 2 micro-batches"):
                sess.run(train.update_op, feed)  # closes a window after 0 of 2
            sess.run(train.accumulate_op, feed)
            sess.run(train.accumulate_op, feed)
            middle = snapshot_globals(sess)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="Run update_op for the last micro-batch"):
                sess.run(train.accumulate_op, feed)  # a third add: the window's last
            after = snapshot_globals(sess)
    for name in start:
        if "accumulate/" not in name:
            assert np.array_equal(start[name], middle[name]), name
        assert np.array_equal(middle[name], after[name]), name
    assert after["loss_scale/accumulate/micro_step"] == 2


# -- the DCGAN example under horovodrun ----------------------------------------

@needs_horovod
def test_dcgan_example_under_horovodrun(tmp_path):
    """Two ranks train the example; rank 0 alone writes; the ranks end equal.

    The ranks seed their initializers differently, so equal digests also show
    that the example's broadcast_global_variables(0) took effect."""
    out = tmp_path / "dcgan"
    command = _two_horovod_ranks(
        os.path.join(REPO, "examples", "gan", "dcgan.py"), "--distributed", "horovod",
        "--steps", "2", "--batch-size", "8", "--eval-samples", "40",
        "--log-every", "1", "--ckpt-every", "1", "--out", out)
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                              env=env, cwd=REPO)
    except subprocess.TimeoutExpired as error:
        pytest.fail("dcgan.py on 2 ranks hung for %ds; output so far:\n%s"
                    % (RUN_TIMEOUT, (error.stdout or b"")[-3000:]))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    finals = {}
    for line in done.stdout.splitlines():
        if "variables digest" in line:
            rank = int(line.split("rank ")[1].split("/")[0])
            finals[rank] = line.split(":", 2)[-1].split(",", 1)[1]
    assert sorted(finals) == [0, 1], done.stdout
    assert finals[0] == finals[1], finals  # step, loss scale and digest
    assert done.stdout.count("outputs in ") == 1 and "[0]<stdout>:outputs in" in done.stdout
    names = sorted(os.listdir(str(out)))
    assert len([n for n in names if n.startswith("events.out")]) == 1, names
    assert set(n for n in names if not n.startswith(("events.out", "model.ckpt-"))) == {
        "checkpoint", "curves.png", "history.json", "metrics.json", "samples.png"}, names
    assert sorted(set(n.split(".")[1] for n in names if n.startswith("model.ckpt-"))) == [
        "ckpt-1", "ckpt-2"], names
    report = json.load(open(str(out / "metrics.json")))
    assert report["ranks"] == 2 and report["global_step"] + report["skipped_steps"] == 2


def _finite(train):
    """Each group's decision of the run, by group name."""
    return dict((name, group.is_finite) for name, group in train.groups.items())
