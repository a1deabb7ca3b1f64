"""Parameter servers: SyncReplicasOptimizer with our optimizers (issue 27).

Issue 27's table, row by row, with the real token queue and accumulators
(tests/distributed/sync_table.py, run in a subprocess: a hang must fail a
test, not the suite), then a real localhost cluster: one parameter server
and two workers (tests/distributed/ps_worker.py), synchronous through each
of the three routes and asynchronous.

The model is ``loss = sum(w * x)`` with ``w0 = [1, 2]`` and ``x = [0.25,
0.5]``, plain SGD at rate 1: each applied step moves ``w`` by exactly
``-x``, so every expected number below is worked by hand. The poisoned step
feeds ``x = [inf, 0.5]`` (``[1e5, 0.5]`` in float16 under saturation,
which saturates to a finite 65504 that only the float-status register sees).
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import REPO, op_ancestors
from models import fed_linear_model
import warm_python

TABLE = os.path.join(REPO, "tests", "distributed", "sync_table.py")
PS_WORKER = os.path.join(REPO, "tests", "distributed", "ps_worker.py")
#: A whole table run (every scenario; the hanging one waits HANG_MS).
TABLE_TIMEOUT = 240
#: A run that has not returned after HANG_MS hangs: the table's runs take
#: milliseconds, and the hanging one waits on a token that never comes.
HANG_MS = 3000
#: A localhost cluster's run, start to end (the issue asks for under 90 s).
CLUSTER_TIMEOUT = 90

#: After each of 6 steps with the inf at step 2: the global step counts every
#: aggregated step, the scale halves once, w skips one step's -x.
EXPECTED = [
    {"global_step": 1, "scale": 1024.0, "w": [0.75, 1.5]},
    {"global_step": 2, "scale": 1024.0, "w": [0.5, 1.0]},
    {"global_step": 3, "scale": 512.0, "w": [0.5, 1.0]},
    {"global_step": 4, "scale": 512.0, "w": [0.25, 0.5]},
    {"global_step": 5, "scale": 512.0, "w": [0.0, 0.0]},
    {"global_step": 6, "scale": 512.0, "w": [-0.25, -0.5]},
]
OUR_ROUTES = ("builder", "ours_outside", "ours_inside")


def _run_table(tmp_path_factory, name, scenarios, saturation=False):
    out = str(tmp_path_factory.mktemp(name) / "table.jsonl")
    command = [sys.executable, TABLE, out] + list(scenarios) + ["--hang-ms", str(HANG_MS)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if saturation:
        command.append("--saturation")
        env["NPU_SHIM_OVERFLOW_MODE"] = "saturation"
    return warm_python.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True, env=env, cwd=REPO), out


def _collect(started):
    proc, out = started
    try:
        output = proc.communicate(timeout=TABLE_TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        done = open(out).read() if os.path.exists(out) else ""
        pytest.fail("sync_table.py ran past %ds; finished: %s" % (TABLE_TIMEOUT, done))
    assert proc.returncode == 0, output[-4000:]
    results = [json.loads(line) for line in open(out)]
    return dict((result["scenario"], result) for result in results)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Every scenario of the table, plus the saturation-mode ones, in two
    subprocesses run side by side."""
    plain = _run_table(tmp_path_factory, "plain", OUR_ROUTES + (
        "tf_mixed_precision", "tf_mixed_precision_counting", "builder_requested"))
    saturated = _run_table(tmp_path_factory, "saturated", (
        "builder", "ours_outside", "ours_inside", "ours_inside_is_finite"), saturation=True)
    results = _collect(plain)
    results.update(("saturated/" + key, value) for key, value in _collect(saturated).items())
    return results


def _without(records, key):
    """The records without ``key`` (and the builder's last-skip reads, which
    the other routes do not have)."""
    dropped = (key, "last_skip", "last_reason")
    return [dict((k, v) for k, v in record.items() if k not in dropped) for record in records]


# -- the table -------------------------------------------------------------------

@pytest.mark.parametrize("route", OUR_ROUTES)
def test_our_routes_train_through_the_skip(table, route):
    """Builder group, LossScaleOptimizer(SyncReplicasOptimizer) and
    SyncReplicasOptimizer(LossScaleOptimizer), count_skipped_steps=True:
    no hang, the step skipped once, the scale halved once."""
    result = table[route]
    assert result["outcome"] == "ran", result
    assert _without(result["records"], "skipped_steps") == EXPECTED


def test_tfs_own_wrapper_with_a_counting_step_is_the_reference(table):
    """The issue's working row, TF's MixedPrecisionLossScaleOptimizer with
    global_step advanced on skipped steps too, gives the same numbers."""
    result = table["tf_mixed_precision_counting"]
    assert result["outcome"] == "ran", result
    assert result["records"] == EXPECTED
    assert result["records"] == _without(table["builder"]["records"], "skipped_steps")


def test_tfs_own_wrapper_hangs_after_the_skip(table):
    """TF's bug, reproduced: global_step stays at 2 on the skip, the tokens
    fall behind the accumulators, and the next run never returns."""
    result = table["tf_mixed_precision"]
    assert result["outcome"] == "hung" and result["hung_at"] == 3, result
    assert result["records"] == [EXPECTED[0], EXPECTED[1],
                                 {"global_step": 2, "scale": 512.0, "w": [0.5, 1.0]}]


def test_the_builder_counts_the_skip_once(table):
    assert [r["skipped_steps"] for r in table["builder"]["records"]] == [0, 0, 1, 1, 1, 1]


def test_a_requested_skip_is_recorded_as_requested_and_holds_the_scale(table):
    """skip_global_steps=[4] beside the inf at step 2: the chief skips the
    fifth run for the reason "requested" and keeps the scale at 512 (the
    worker pushed one flag for both, so the chief took the request for an
    overflow, recorded gradients_overflowed and halved the scale to 256)."""
    result = table["builder_requested"]
    assert result["outcome"] == "ran", result
    records = result["records"]
    assert [r["scale"] for r in records] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0]
    assert [r["w"] for r in records] == [[0.75, 1.5], [0.5, 1.0], [0.5, 1.0], [0.25, 0.5],
                                         [0.25, 0.5], [0.0, 0.0]]
    assert [r["global_step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 2, 2]
    assert [nl.diagnostics.reason_name(r["last_reason"]) for r in records[2:]] == [
        "gradients_overflowed", "gradients_overflowed", "requested", "requested"]


@pytest.mark.parametrize("scenario", ["builder", "saturated/builder"])
def test_the_chiefs_skip_reaches_the_last_skip_record(table, scenario):
    """Issue 32: the chief diagnoses the skip it takes, in its gate's skip
    branch, into the builder's record (once, at the poisoned step; before,
    last_skip stayed blank while skipped_steps was 1)."""
    records = table[scenario]["records"]
    assert [r["last_skip"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert nl.diagnostics.reason_name(records[-1]["last_reason"]) == "gradients_overflowed"


@pytest.mark.parametrize("route", ["builder", "ours_outside"])
def test_a_saturated_overflow_only_the_workers_register_saw_is_skipped(table, route):
    """The worker pushes its float-status flag beside its gradients: the
    aggregate holds 65504 / 1024, a finite value, yet the chief skips."""
    result = table["saturated/" + route]
    assert result["outcome"] == "ran", result
    assert _without(result["records"], "skipped_steps") == EXPECTED


def test_saturation_negative_control_the_aggregate_alone_looks_finite(table):
    """backend='is_finite' on the chief's aggregate: the saturated step is
    applied, w moves by -65504 / 1024 (float16) in its first element."""
    result = table["saturated/ours_inside_is_finite"]
    assert result["outcome"] == "ran", result
    step2 = result["records"][2]
    assert step2["scale"] == 1024.0 and step2["global_step"] == 3
    assert step2["w"] == [0.5 - 65504.0 / 1024.0, 0.5]


def test_the_chief_register_is_refused_under_saturation(table):
    result = table["saturated/ours_inside"]
    assert result["outcome"] == "error", result
    for fragment in ("aggregated gradients", "'npu'", "cannot see the workers' overflows",
                     "LossScaleOptimizer(SyncReplicasOptimizer(opt))"):
        assert fragment in result["error"], result["error"]


# -- build-time refusals, each naming the route ---------------------------------

def _sync(inner=None, cls=nl.SyncReplicasOptimizer, **kwargs):
    """Ours by default (the builder's and the outer wrapper's route); pass
    ``cls=tf.train.SyncReplicasOptimizer`` for TF's (the inner route)."""
    return cls(inner or tf.train.GradientDescentOptimizer(1.0), replicas_to_aggregate=1,
               **kwargs)


def _ops(graph):
    return len(graph.get_operations())


def test_builder_without_count_skipped_steps_is_refused_before_any_op(graph):
    gs, _, w, loss = fed_linear_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
    scaler.add(loss, _sync(), var_list=[w])
    before = _ops(graph)
    with pytest.raises(ValueError, match=r"count_skipped_steps=False with a SyncReplicas"
                                         r".*waiting forever.*count_skipped_steps=True"):
        scaler.build(global_step=gs)
    assert _ops(graph) == before
    assert scaler.build(global_step=gs, count_skipped_steps=True).applied is None


def test_lso_around_sync_without_count_skipped_steps_is_refused_before_any_op(graph):
    gs, _, w, loss = fed_linear_model()
    opt = nl.LossScaleOptimizer(_sync(), nl.DynamicLossScaleManager())
    grads = opt.compute_gradients(loss, var_list=[w])
    before = _ops(graph)
    with pytest.raises(ValueError, match="LossScaleOptimizer.apply_gradients: "
                                         "count_skipped_steps=False"):
        opt.apply_gradients(grads, global_step=gs)
    assert _ops(graph) == before


def test_lso_inside_sync_without_count_skipped_steps_is_refused(graph):
    gs, _, w, loss = fed_linear_model()
    sync = _sync(nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0),
                                       nl.DynamicLossScaleManager()),
                 cls=tf.train.SyncReplicasOptimizer)
    with pytest.raises(ValueError, match="aggregated gradients with count_skipped_steps=False"
                                         ".*Pass count_skipped_steps=True"):
        sync.minimize(loss, global_step=gs)


def test_sync_without_global_step_is_refused(graph):
    _, _, w, loss = fed_linear_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
    scaler.add(loss, _sync(), var_list=[w])
    with pytest.raises(ValueError, match="needs global_step, got None.*get_or_create_global_step"):
        scaler.build(count_skipped_steps=True)


def test_sync_beside_another_group_is_refused(graph):
    gs, x, w, loss = fed_linear_model()
    v = tf.Variable(1.0, name="v")
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
    scaler.add(loss, _sync(), var_list=[w], name="d")
    scaler.add(v * v, tf.train.GradientDescentOptimizer(1.0), var_list=[v], name="g")
    with pytest.raises(ValueError, match=r"group 'd'.*only group, got 2 groups.*#11071"):
        scaler.build(global_step=gs, count_skipped_steps=True)


def test_sync_with_accumulation_is_refused(graph):
    gs, _, w, loss = fed_linear_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
    scaler.add(loss, _sync(), var_list=[w])
    with pytest.raises(ValueError, match="accumulation_steps=3 with a SyncReplicas"):
        scaler.build(global_step=gs, count_skipped_steps=True, accumulation_steps=3)


def test_sync_with_an_engine_is_refused(npu_shim, graph):
    gs, _, w, loss = fed_linear_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), distributed="hccl",
                                        backend="is_finite")
    scaler.add(loss, _sync(), var_list=[w])
    with pytest.raises(ValueError, match="distributed='hccl' with a SyncReplicas.*unset"):
        scaler.build(global_step=gs, count_skipped_steps=True)


def test_sync_with_update_ops_or_per_group_ops_is_refused(graph):
    gs, _, w, loss = fed_linear_model()
    counter = tf.Variable(0.0, name="bn_mean")
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
    scaler.add(loss, _sync(), var_list=[w])
    with pytest.raises(ValueError, match="update_ops with a SyncReplicas.*cannot be gated"):
        scaler.build(global_step=gs, count_skipped_steps=True,
                     update_ops=[tf.assign_add(counter, 1.0)])
    with pytest.raises(ValueError, match="per_group_ops=True with a SyncReplicas"):
        scaler.build(global_step=gs, count_skipped_steps=True, per_group_ops=True)


def test_sync_inside_sync_is_refused_at_construction(graph):
    """Issue 32: a SyncReplicasOptimizer wrapping another gets a clear error
    that names the fix, before any op."""
    before = len(tf.get_default_graph().get_operations())
    with pytest.raises(ValueError, match=r"opt is another SyncReplicasOptimizer.*Wrap the plain "
                                         r"optimizer in one SyncReplicasOptimizer"):
        _sync(_sync(tf.train.GradientDescentOptimizer(1.0), cls=tf.train.SyncReplicasOptimizer))
    assert len(tf.get_default_graph().get_operations()) == before


@pytest.mark.parametrize("api", ["builder", "optimizer"])
@pytest.mark.parametrize("inner", ["plain", "ours"])
def test_tfs_own_class_on_the_outer_routes_is_refused_before_any_op(graph, api, inner):
    """TF's class applies the aggregate through its own optimizer, where the
    step cannot decide: the message names ours, which takes the same
    arguments, and the inner route."""
    gs, _, w, loss = fed_linear_model()
    wrapped = (tf.train.GradientDescentOptimizer(1.0) if inner == "plain"
               else _sync(tf.train.GradientDescentOptimizer(1.0)))
    sync = _sync(wrapped, cls=tf.train.SyncReplicasOptimizer)
    manager = nl.DynamicLossScaleManager()
    if api == "builder":
        scaler = nl.MultiOptimizerLossScale(manager)
        scaler.add(loss, sync, var_list=[w])
    else:
        opt = nl.LossScaleOptimizer(sync, manager, count_skipped_steps=True)
        grads = opt.compute_gradients(loss, var_list=[w])
    before = len(tf.get_default_graph().get_operations())
    with pytest.raises(TypeError) as raised:
        if api == "builder":
            scaler.build(global_step=gs, count_skipped_steps=True)
        else:
            opt.apply_gradients(grads, global_step=gs)
    assert len(tf.get_default_graph().get_operations()) == before
    for fragment in ("optimizer is tf.train.SyncReplicasOptimizer 'sync_replicas'",
                     "Construct npu_lossscale.SyncReplicasOptimizer in its place (same "
                     "arguments)", "tf.train.SyncReplicasOptimizer(LossScaleOptimizer("):
        assert fragment in str(raised.value), str(raised.value)


def test_ours_is_tfs_class_with_the_wrapped_optimizers_slots(graph):
    """Outside a step, ours applies plainly through ``opt`` (so the inner
    route works with it too), and forwards slots and variables to it."""
    gs, _, w, loss = fed_linear_model()
    momentum = tf.train.MomentumOptimizer(0.5, 0.9)
    sync = nl.SyncReplicasOptimizer(momentum, replicas_to_aggregate=1)
    assert isinstance(sync, tf.train.SyncReplicasOptimizer)
    assert sync.chief.optimizer is momentum
    train = sync.minimize(loss, global_step=gs)
    assert sync.get_slot(w, "momentum") is momentum.get_slot(w, "momentum")
    assert sync.get_slot_names() == ["momentum"]
    assert set(sync.variables()) == set(momentum.variables())
    chief = op_ancestors(sync.get_chief_queue_runner().enqueue_ops[0])
    assert [op.type for op in chief if "ApplyMomentum" in op.type]
    assert train is not None and sync.make_session_run_hook(True) is not None


def test_sync_around_a_loss_scale_wrapper_in_the_builder_is_refused(graph):
    gs, _, w, loss = fed_linear_model()
    inner = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0),
                                  nl.DynamicLossScaleManager(), count_skipped_steps=True)
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
    scaler.add(loss, _sync(inner), var_list=[w])
    with pytest.raises(TypeError, match="the optimizer the SyncReplicasOptimizer wraps is "
                                        "already a loss-scale wrapper"):
        scaler.build(global_step=gs, count_skipped_steps=True)


def test_a_manager_off_the_parameter_servers_is_refused(graph):
    """Made outside replica_device_setter, the scale would be each worker's
    own: the chief would halve a copy the others never read."""
    outside = nl.DynamicLossScaleManager()
    with tf.device(tf.train.replica_device_setter(ps_tasks=1)):
        gs, _, w, loss = fed_linear_model()
        inside = nl.DynamicLossScaleManager()
    for manager, refused in ((outside, True), (inside, False)):
        with tf.device(tf.train.replica_device_setter(ps_tasks=1)):
            scaler = nl.MultiOptimizerLossScale(manager)
            scaler.add(loss, _sync(), var_list=[w])
            if refused:
                with pytest.raises(ValueError, match="not on job 'ps' beside global_step.*"
                                                     "replica_device_setter"):
                    scaler.build(global_step=gs, count_skipped_steps=True)
            else:
                scaler.build(global_step=gs, count_skipped_steps=True)


def test_the_workers_step_pushes_ungated_and_the_chief_gates(graph):
    """The worker's update_op holds the pushes and the token dequeue, no
    gate; the chief's sync op holds the gate around the wrapped optimizer's
    apply and the manager's update."""
    gs, _, w, loss = fed_linear_model()
    sync = _sync()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
    scaler.add(loss, sync, var_list=[w])
    train = scaler.build(global_step=gs, count_skipped_steps=True)
    worker = op_ancestors(train.update_op)
    chief = op_ancestors(sync.get_chief_queue_runner().enqueue_ops[0])
    pushes = [op for op in worker if "AccumulatorApplyGradient" in op.type]
    assert len(pushes) == 2  # w's gradient and the overflow flag
    assert any(op.type == "QueueDequeueV2" for op in worker)
    assert not any("sync_chief" in op.name for op in worker)
    applies = [op for op in chief if op.type in ("ApplyGradientDescent",
                                                 "ResourceApplyGradientDescent")]
    assert len(applies) == 1 and "sync_chief" in applies[0].name
    assert any(op.name.startswith("loss_scale/sync_chief/") and "pivot" in op.name
               or op.type in ("If", "StatelessIf") for op in chief)


# -- LossScaleOptimizer's count_skipped_steps, without SyncReplicas -------------

@pytest.mark.parametrize("count, steps", [(False, [1, 1, 2]), (True, [1, 2, 3])])
def test_loss_scale_optimizer_counts_skipped_steps_when_asked(graph, count, steps):
    """An inf at the second of three steps: global_step skips it unless
    count_skipped_steps=True; w is skipped either way."""
    gs, x, w, loss = fed_linear_model()
    opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0),
                                nl.DynamicLossScaleManager(initial_scale=1024),
                                count_skipped_steps=count)
    train = opt.minimize(loss, global_step=gs, var_list=[w])
    seen = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for step in range(3):
            sess.run(train, {x: [np.inf, 0.5] if step == 1 else [0.25, 0.5]})
            seen.append(sess.run(gs))
        assert sess.run(w).tolist() == [0.5, 1.0]
    assert seen == steps


def test_count_skipped_steps_must_be_a_bool():
    with pytest.raises(TypeError, match="count_skipped_steps"):
        nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0),
                              nl.FixedLossScaleManager(8), count_skipped_steps="yes")


# -- a localhost cluster: one parameter server, two workers ---------------------

def _free_ports(count):
    sockets = []
    for _ in range(count):
        handle = socket.socket()
        handle.bind(("127.0.0.1", 0))
        sockets.append(handle)
    ports = [handle.getsockname()[1] for handle in sockets]
    for handle in sockets:
        handle.close()
    return ports


def _cluster(out_dir, mode):
    """Runs ps_worker.py as a parameter server and two workers; returns the
    workers' results. A run past CLUSTER_TIMEOUT fails, naming each worker's
    last finished run."""
    ports = ",".join(str(port) for port in _free_ports(3))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    procs = [warm_python.Popen([sys.executable, PS_WORKER, str(out_dir), ports, role, str(task),
                               mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, env=env, cwd=REPO)
             for role, task in (("ps", 0), ("worker", 0), ("worker", 1))]
    start = time.time()
    try:
        outputs = []
        for proc in procs[1:]:
            left = max(1.0, CLUSTER_TIMEOUT - (time.time() - start))
            outputs.append(proc.communicate(timeout=left)[0])
    except subprocess.TimeoutExpired:
        stalled = []
        for task in (0, 1):
            path = os.path.join(str(out_dir), "worker%d.progress" % task)
            lines = open(path).read().split("\n") if os.path.exists(path) else []
            stalled.append("worker %d: %s" % (task, [l for l in lines if l][-1:] or "no run"))
        pytest.fail("the cluster ran past %ds: %s" % (CLUSTER_TIMEOUT, "; ".join(stalled)))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for task, (proc, output) in enumerate(zip(procs[1:], outputs)):
        assert proc.returncode == 0, "worker %d:\n%s" % (task, output[-4000:])
    return [json.load(open(os.path.join(str(out_dir), "worker%d.json" % task)))
            for task in (0, 1)]


@pytest.mark.parametrize("mode", ["builder", "outside", "inside"])
def test_parameter_server_sync_skips_the_poisoned_aggregate_once(tmp_path, mode):
    """Worker 1's batch is inf at its run 2: that aggregated step is skipped
    on the chief, exactly once; the scale halves once; both workers read
    the same end state: six aggregated steps, five of them applied."""
    workers = _cluster(tmp_path, mode)
    for result in workers:
        state = result["state"]
        assert state["global_step"] == 6
        assert state["w"] == EXPECTED[-1]["w"]
        assert state["scales"] == [512.0]
        if mode == "builder":
            assert state["skipped_steps"] == 1
    assert workers[0]["state"] == workers[1]["state"]
    if mode == "builder":  # each worker's own check, pushed to the chief
        assert [r["is_finite"] for r in workers[0]["records"]] == [True] * 6
        assert [r["is_finite"] for r in workers[1]["records"]] == [
            True, True, False, True, True, True]


def test_parameter_server_async_a_skip_drops_that_workers_update_only(tmp_path):
    """No SyncReplicas (distributed=False): each worker applies its own
    gradients. Worker 1's inf run skips its own update alone and halves its
    own manager's scale; worker 0's scale stays; 11 of the 12 worker-steps
    reach w and global_step."""
    workers = _cluster(tmp_path, "async")
    for result in workers:
        state = result["state"]
        assert state["global_step"] == 11
        assert state["w"] == [1.0 - 11 * 0.25, 2.0 - 11 * 0.5]
        assert state["scales"] == [1024.0, 512.0]
        assert state["skipped_steps"] == 1
    assert [r["applied"] for r in workers[0]["records"]] == [True] * 6
    assert [r["applied"] for r in workers[1]["records"]] == [True, True, False, True, True, True]
    assert workers[0]["state"] == workers[1]["state"]


# -- the audit: NLS012 on the table's patterns -----------------------------------

class _CountingWrapper(tf.train.Optimizer):
    """TF's MixedPrecisionLossScaleOptimizer with global_step advanced after
    it on every step (or, with ``advance=False``, never)."""

    def __init__(self, mixed, advance=True):
        super(_CountingWrapper, self).__init__(False, "Counting")
        self._mixed, self._advance = mixed, advance

    def compute_gradients(self, *args, **kwargs):
        return self._mixed.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        applied = self._mixed.apply_gradients(grads_and_vars, name=name)
        if not self._advance:
            return applied
        with tf.control_dependencies([applied]):
            return tf.assign_add(global_step, 1).op


def _mixed():
    return tf.train.experimental.MixedPrecisionLossScaleOptimizer(
        tf.train.GradientDescentOptimizer(1.0), "dynamic")


def _stalls(graph, fetches=None):
    return [f for f in nl.audit(graph.as_graph_def() if fetches == "graph_def" else graph,
                                None if fetches == "graph_def" else fetches)
            if f.code == "NLS012-sync-token-stall"]


@pytest.mark.parametrize("pattern, stalls", [
    ("tf_mixed_precision", True),         # the table's hanging row
    ("never_advanced", True),             # a wrapper that drops global_step
    ("tf_mixed_precision_counting", False),
    ("plain", False),                     # SyncReplicasOptimizer(SGD)
    ("ours_inside", False),
    ("ours_outside", False),
    ("builder", False),
])
def test_audit_reports_a_step_that_stops_inside_sync_replicas(graph, pattern, stalls):
    gs, _, w, loss = fed_linear_model()
    manager = nl.DynamicLossScaleManager()
    if pattern == "builder":
        scaler = nl.MultiOptimizerLossScale(manager)
        scaler.add(loss, _sync(), var_list=[w])
        train = scaler.build(global_step=gs, count_skipped_steps=True).update_op
    elif pattern == "ours_outside":
        train = nl.LossScaleOptimizer(_sync(), manager, count_skipped_steps=True).minimize(
            loss, global_step=gs)
    else:
        inner = {
            "tf_mixed_precision": _mixed,
            "never_advanced": lambda: _CountingWrapper(_mixed(), advance=False),
            "tf_mixed_precision_counting": lambda: _CountingWrapper(_mixed()),
            "plain": lambda: tf.train.GradientDescentOptimizer(1.0),
            "ours_inside": lambda: nl.LossScaleOptimizer(
                tf.train.GradientDescentOptimizer(1.0), manager, count_skipped_steps=True),
        }[pattern]()
        train = _sync(inner, cls=tf.train.SyncReplicasOptimizer).minimize(
            loss, global_step=gs)
    for fetches in (None, [train], "graph_def"):  # the worker's fetch, and a GraphDef
        found = _stalls(graph, fetches)
        assert len(found) == (1 if stalls else 0), (fetches, found)
    if stalls:
        finding = found[0]
        assert finding.severity == "error"
        assert "sync_token_q_EnqueueMany" in finding.ops and "global_step" in finding.ops
        for fragment in ("waiting for its token forever", "count_skipped_steps=True",
                         "only inside a cond" if pattern == "tf_mixed_precision"
                         else "nowhere before it"):
            assert fragment in finding.message, finding.message
