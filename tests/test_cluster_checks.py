"""Multi-worker set-ups that nothing would keep in step are refused at build
time, each naming its route; those that aggregate correctly are built (issue
27, item 2).

A launcher's environment says this process is one of several workers:
Ascend's RANK_SIZE/CM_WORKER_SIZE, a Horovod or MPI launcher's HOROVOD_SIZE,
OMPI_COMM_WORLD_SIZE, PMI_SIZE or MV2_COMM_WORLD_SIZE, a TF_CONFIG cluster.
Without ``distributed=`` each worker would skip on its own overflows and
the replicas would drift apart, unless a SyncReplicasOptimizer's chief
decides, or the optimizers average the gradients before the check. A
``tf.distribute`` strategy with several replicas in one graph is refused
whatever ``distributed`` says.
"""

import json
import os
import sys
import textwrap

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import REPO
from models import fed_linear_model
from npu_lossscale import distributed
from npu_lossscale.backends import Backend
import warm_python

_LAUNCH_VARIABLES = ("RANK_SIZE", "CM_WORKER_SIZE", "TF_CONFIG") + \
    distributed.HOROVOD_SIZE_VARIABLES

TWO_WORKERS = json.dumps({"cluster": {"ps": ["h0:1"], "worker": ["h1:1", "h2:1"]},
                          "task": {"type": "worker", "index": 0}})


@pytest.fixture(autouse=True)
def one_worker(monkeypatch):
    """Each test starts from an environment that names one worker."""
    for name in _LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _builder(optimizer=None, **kwargs):
    gs, x, w, loss = fed_linear_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), **kwargs)
    scaler.add(loss, optimizer or tf.train.GradientDescentOptimizer(1.0), var_list=[w])
    return scaler, gs, x


def _averaged(grads_and_vars):
    """Each gradient through a collective op (TF's CollectiveReduce over
    two members), as an averaging optimizer's are: built, never run."""
    return [(None if grad is None else tf.raw_ops.CollectiveReduce(
        input=grad, group_size=2, group_key=1, instance_key=index + 1, merge_op="Add",
        final_op="Div", subdiv_offsets=[0]), var)
        for index, (grad, var) in enumerate(grads_and_vars)]


class _DistributedOptimizer(tf.train.GradientDescentOptimizer):
    """Named as Horovod names the class of ``hvd.DistributedOptimizer``
    (``horovod/tensorflow/__init__.py``), and averaging its gradients with a
    collective as it does; Horovod is not installed on this leg."""

    def compute_gradients(self, *args, **kwargs):
        return _averaged(super(_DistributedOptimizer, self).compute_gradients(*args, **kwargs))


class _Averaging(tf.train.Optimizer):
    """An averaging wrapper around another optimizer, as
    ``hvd.DistributedOptimizer(LossScaleOptimizer(opt))`` is."""

    def __init__(self, inner):
        super(_Averaging, self).__init__(False, "Averaging")
        self._inner = inner

    def compute_gradients(self, *args, **kwargs):
        return _averaged(self._inner.compute_gradients(*args, **kwargs))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        return self._inner.apply_gradients(grads_and_vars, global_step, name)


# -- the environment, read ------------------------------------------------------

@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"RANK_SIZE": "1"}, None),
    ({"RANK_SIZE": "8"}, ("ascend", 8, "RANK_SIZE/CM_WORKER_SIZE")),
    ({"CM_WORKER_SIZE": "2"}, ("ascend", 2, "RANK_SIZE/CM_WORKER_SIZE")),
    ({"HOROVOD_SIZE": "4"}, ("horovod", 4, "HOROVOD_SIZE")),
    ({"HOROVOD_SIZE": "1"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, ("horovod", 2, "OMPI_COMM_WORLD_SIZE")),
    ({"PMI_SIZE": "3"}, ("horovod", 3, "PMI_SIZE")),
    ({"MV2_COMM_WORLD_SIZE": "2"}, ("horovod", 2, "MV2_COMM_WORLD_SIZE")),
    ({"TF_CONFIG": TWO_WORKERS}, ("tf_config", 2, "TF_CONFIG")),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:1"]}})},
     ("tf_config", 2, "TF_CONFIG")),
    # One trainer beside parameter servers and an evaluator: one worker.
    ({"TF_CONFIG": json.dumps({"cluster": {"ps": ["a:1", "b:1"], "worker": ["c:1"],
                                           "evaluator": ["d:1"]}})}, None),
    ({"TF_CONFIG": json.dumps({"task": {"type": "worker", "index": 0}})}, None),
])
def test_the_environment_read(environ, expected):
    assert distributed.cluster_from_environment(environ) == (
        None if expected is None else distributed.Cluster(*expected))


@pytest.mark.parametrize("value", ["{not json", "[1, 2]", json.dumps({"cluster": [1]})])
def test_a_bad_tf_config_is_refused(value):
    with pytest.raises(ValueError, match=r"TF_CONFIG must be JSON with a 'cluster' dict.*%s"
                       % "got"):
        distributed.cluster_from_environment({"TF_CONFIG": value})


# -- refused without distributed=, naming the route ------------------------------

@pytest.mark.parametrize("name, value, route", [
    ("RANK_SIZE", "2", "distributed='hccl'"),
    ("CM_WORKER_SIZE", "4", "distributed='hccl'"),
    ("HOROVOD_SIZE", "2", "distributed='horovod'"),
    ("OMPI_COMM_WORLD_SIZE", "2", "distributed='horovod'"),
    ("PMI_SIZE", "2", "distributed='horovod'"),
    ("TF_CONFIG", TWO_WORKERS, "npu_lossscale.SyncReplicasOptimizer"),
])
def test_builder_refused_in_a_cluster_before_any_op(graph, monkeypatch, name, value, route):
    monkeypatch.setenv(name, value)
    scaler, gs, _ = _builder()  # no longer refused here: the groups decide
    before = len(graph.get_operations())
    with pytest.raises(ValueError) as error:
        scaler.build(global_step=gs)
    message = str(error.value)
    for fragment in ("MultiOptimizerLossScale.build: this process is one of", "drift apart",
                     route, "or pass distributed=False"):
        assert fragment in message, message
    assert len(graph.get_operations()) == before


@pytest.mark.parametrize("name, value, route", [
    ("RANK_SIZE", "2", "is_distributed=True"),
    ("HOROVOD_SIZE", "2", "hvd.DistributedOptimizer"),
    ("TF_CONFIG", TWO_WORKERS, "npu_lossscale.SyncReplicasOptimizer (count_skipped_steps=True)"),
])
def test_loss_scale_optimizer_refused_in_a_cluster(graph, monkeypatch, name, value, route):
    monkeypatch.setenv(name, value)
    gs, _, w, loss = fed_linear_model()
    opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0),
                                nl.DynamicLossScaleManager())
    with pytest.raises(ValueError) as error:
        opt.minimize(loss, global_step=gs, var_list=[w])
    message = str(error.value)
    for fragment in ("LossScaleOptimizer.apply_gradients: this process is one of", route,
                     "or pass is_distributed=False"):
        assert fragment in message, message


# -- built: set-ups that aggregate correctly, or declared independent ------------

@pytest.mark.parametrize("name, value", [("RANK_SIZE", "2"), ("HOROVOD_SIZE", "2"),
                                         ("TF_CONFIG", TWO_WORKERS)])
def test_declared_independent_workers_build_and_train(graph, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    scaler, gs, x = _builder(distributed=False)
    train = scaler.build(global_step=gs)
    opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0),
                                nl.DynamicLossScaleManager(), is_distributed=False)
    v = tf.Variable(3.0, name="v")
    minimize = opt.minimize(v * v, var_list=[v])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.applied], {x: [0.25, 0.5]})[1]
        sess.run(minimize)
        assert sess.run(v) == 3.0 - 6.0


def test_sync_replicas_on_a_parameter_server_cluster_builds(graph, monkeypatch):
    """TF_CONFIG names two workers and no distributed= is given: the three
    SyncReplicas routes build, since the chief decides for all."""
    monkeypatch.setenv("TF_CONFIG", TWO_WORKERS)
    gs, _, w, loss = fed_linear_model()
    sync = nl.SyncReplicasOptimizer(tf.train.GradientDescentOptimizer(1.0), 2)
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
    scaler.add(loss, sync, var_list=[w])
    assert scaler.build(global_step=gs, count_skipped_steps=True).applied is None
    with tf.Graph().as_default():
        gs, _, w, loss = fed_linear_model()
        outside = nl.LossScaleOptimizer(
            nl.SyncReplicasOptimizer(tf.train.GradientDescentOptimizer(1.0), 2),
            nl.DynamicLossScaleManager(), count_skipped_steps=True)
        outside.minimize(loss, global_step=gs)
    with tf.Graph().as_default():
        gs, _, w, loss = fed_linear_model()
        inside = tf.train.SyncReplicasOptimizer(nl.LossScaleOptimizer(
            tf.train.GradientDescentOptimizer(1.0), nl.DynamicLossScaleManager(),
            count_skipped_steps=True), 2)
        inside.minimize(loss, global_step=gs)


def test_one_trainer_beside_parameter_servers_builds(graph, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": ["a:1"], "worker": ["b:1"]}}))
    scaler, gs, _ = _builder()
    scaler.build(global_step=gs)


def test_an_averaging_optimizer_under_horovod_builds(graph, monkeypatch):
    """Every rank checks the same averaged gradients, so every rank decides
    alike without summing flags: not refused."""
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    scaler, gs, _ = _builder(_DistributedOptimizer(1.0))
    scaler.build(global_step=gs)


def test_a_loss_scale_optimizer_inside_an_averaging_wrapper_builds(graph, monkeypatch):
    """Issue 32: hvd.DistributedOptimizer(LossScaleOptimizer(opt)) hands our
    apply_gradients the averaged gradients, so every rank checks the same
    ones: not refused (it was, with "wrap opt in hvd.DistributedOptimizer")."""
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    gs, _, w, loss = fed_linear_model()
    inner = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0),
                                  nl.DynamicLossScaleManager())
    _Averaging(inner).minimize(loss, global_step=gs, var_list=[w])


class _CondAveraging(_Averaging):
    """Averages inside ``tf.cond(workers > 1, allreduce, identity)``, as
    Horovod 0.28's ``_allreduce_cond`` does: under v2 control flow the
    collective sits in the If op's branch function, not in the graph."""

    def compute_gradients(self, *args, **kwargs):
        workers = tf.placeholder_with_default(2, [], name="workers")
        pairs = self._inner.compute_gradients(*args, **kwargs)
        return [(tf.cond(workers > 1, lambda pair=pair: _averaged([pair])[0][0],
                         lambda grad=grad: tf.identity(grad)), var)
                for pair in pairs for grad, var in [pair]]


def test_gradients_averaged_inside_a_cond_are_seen_as_averaged(graph, monkeypatch):
    """Issue 32: the check looks into the functions a functional op runs,
    so Horovod's averaging inside a cond builds (it was refused under v2
    control flow, where the collective is in the branch's function)."""
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    gs, _, w, loss = fed_linear_model()
    inner = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0),
                                  nl.DynamicLossScaleManager())
    _CondAveraging(inner).minimize(loss, global_step=gs, var_list=[w])
    if not tf.compat.v1.control_flow_v2_enabled():
        return
    assert any(op.type in ("If", "StatelessIf") for op in graph.get_operations())


@pytest.mark.parametrize("api", ["builder", "optimizer"])
def test_a_patched_compute_gradients_without_a_collective_is_refused(graph, monkeypatch, api):
    """Issue 32: the check looks at what the step reduces, not at how the
    optimizer was called: a compute_gradients replaced on the instance that
    averages nothing is refused (it built a graph with no collective)."""
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    opt = tf.train.GradientDescentOptimizer(1.0)
    plain = opt.compute_gradients
    opt.compute_gradients = lambda *args, **kwargs: plain(*args, **kwargs)
    with pytest.raises(ValueError, match=r"one of 2 workers \(HOROVOD_SIZE\), and group .* "
                                         r"gradient of 'w' is not averaged across them"):
        if api == "builder":
            scaler, gs, _ = _builder(opt)
            scaler.build(global_step=gs)
        else:
            gs, _, w, loss = fed_linear_model()
            nl.LossScaleOptimizer(opt, nl.DynamicLossScaleManager()).minimize(
                loss, global_step=gs, var_list=[w])


def test_an_averaging_optimizer_on_the_register_is_refused(graph, monkeypatch):
    """The float-status register sees only this device's overflows, whatever
    the gradients' average says."""
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    scaler, gs, _ = _builder(_DistributedOptimizer(1.0), backend=_RegisterBackend())
    with pytest.raises(ValueError, match="one of 2 workers.*distributed='horovod'"):
        scaler.build(global_step=gs)


class _RegisterBackend(Backend):
    """A backend that says it reads a device-wide register (as the npu one
    does in saturation mode); its flag is a constant 0."""

    name = "register"
    reads_register = True

    def overflow_flag(self, tensors, after=()):
        with tf.control_dependencies(list(after)):
            return tf.constant(0.0)


def test_npu_distributed_optimizer_under_rank_size_builds(npu_shim, graph, monkeypatch,
                                                          tmp_path):
    """npu_bridge's NPUDistributedOptimizer averages with HCCL inside
    compute_gradients; with the is_finite check every device decides alike.
    Built only: running it would wait for the other rank."""
    monkeypatch.setenv("RANK_SIZE", "2")
    monkeypatch.setenv("RANK_ID", "0")
    monkeypatch.setenv("JOB_ID", "1")
    monkeypatch.setenv("NPU_SHIM_HCCL_DIR", str(tmp_path))
    from npu_bridge.estimator.npu.npu_optimizer import NPUDistributedOptimizer
    scaler, gs, _ = _builder(NPUDistributedOptimizer(tf.train.GradientDescentOptimizer(1.0)),
                             backend="is_finite")
    scaler.build(global_step=gs)
    u = tf.Variable(1.0, name="u")
    opt = nl.LossScaleOptimizer(NPUDistributedOptimizer(tf.train.GradientDescentOptimizer(1.0)),
                                nl.DynamicLossScaleManager(), backend="is_finite")
    opt.minimize(u * u, var_list=[u])


def test_horovod_distributed_optimizer_under_horovodrun_env_builds(graph, monkeypatch):
    hvd = pytest.importorskip("horovod.tensorflow",
                              reason="Horovod is built against TF 2.15.1 (.venv-tf215)")
    hvd.init()
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    scaler, gs, _ = _builder(hvd.DistributedOptimizer(tf.train.GradientDescentOptimizer(1.0)))
    scaler.build(global_step=gs)


def test_horovods_wrapper_around_our_optimizer_trains_as_without_the_variable(monkeypatch):
    """Issue 32: hvd.DistributedOptimizer(LossScaleOptimizer(opt)) under
    HOROVOD_SIZE=2 (one process here: Horovod's size is 1) trains as it
    does without the variable, bit for bit."""
    hvd = pytest.importorskip("horovod.tensorflow",
                              reason="Horovod is built against TF 2.15.1 (.venv-tf215)")
    hvd.init()

    def train():
        with tf.Graph().as_default():
            gs, x, w, loss = fed_linear_model()
            opt = hvd.DistributedOptimizer(nl.LossScaleOptimizer(
                tf.train.GradientDescentOptimizer(0.1), nl.DynamicLossScaleManager()))
            step = opt.minimize(loss, global_step=gs, var_list=[w])
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                for value in range(3):
                    sess.run(step, {x: np.full(x.shape.as_list(), value + 1.0, np.float32)})
                return sess.run([w, gs])

    alone = train()
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    ranked = train()
    np.testing.assert_array_equal(ranked[0], alone[0])
    assert ranked[1] == alone[1] == 3


# -- tf.distribute strategies with several replicas in one graph -----------------

_MIRRORED = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, os.path.join(%(repo)r, "tests"))
    from graph_mode import set_graph_mode
    set_graph_mode()
    import tensorflow as tf2
    import tensorflow.compat.v1 as tf
    cpu = tf2.config.list_physical_devices("CPU")[0]
    tf2.config.set_logical_device_configuration(
        cpu, [tf2.config.LogicalDeviceConfiguration()] * 2)
    import npu_lossscale as nl

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def attempt(name, fn):
        try:
            strategy.extended.call_for_each_replica(fn)
            print(name, "BUILT")
        except ValueError as error:
            print(name, "REFUSED", " ".join(str(error).split()))

    with tf.Graph().as_default(), strategy.scope():
        w = tf.Variable([1.0, 2.0])
        shared = nl.DynamicLossScaleManager()

        def builder(manager):
            scaler = nl.MultiOptimizerLossScale(manager or nl.DynamicLossScaleManager())
            scaler.add(tf.reduce_sum(w * 2.0), tf.train.GradientDescentOptimizer(0.1),
                       var_list=[w])
            return scaler.build().update_op

        attempt("shared_manager", lambda: builder(shared))
        attempt("per_replica_manager", lambda: builder(None))
        attempt("loss_scale_optimizer", lambda: nl.LossScaleOptimizer(
            tf.train.GradientDescentOptimizer(0.1), shared).minimize(tf.reduce_sum(w * 2.0)))
        attempt("horovod_route", lambda: nl.MultiOptimizerLossScale(
            shared, distributed=False))
""")


def _two_ranks_of_one_device(monkeypatch, tmp_path):
    """This process as rank 0 of two shim HCCL ranks (built only: running a
    collective would wait for rank 1)."""
    monkeypatch.setenv("RANK_SIZE", "2")
    monkeypatch.setenv("RANK_ID", "0")
    monkeypatch.setenv("JOB_ID", "1")
    monkeypatch.setenv("NPU_SHIM_HCCL_DIR", str(tmp_path))


def test_npu_strategy_one_replica_per_process_is_built_and_reduced_through_hccl(
        npu_shim, graph, monkeypatch, tmp_path):
    """Issue 43, point 5: tf_adapter's NPUStrategy
    (npu_bridge/estimator/npu/npu_strategy.py), what Huawei's converter puts
    for MirroredStrategy: one replica in this process's graph, as many in
    sync as RANK_SIZE. Built in the replica context, as an Estimator's
    model_fn is: the builder with distributed="hccl" sums its flags and
    averages its gradients with HcomAllReduce; without it the launch is
    refused with the HCCL route (it was refused under any engine as "2
    replicas in one graph")."""
    _two_ranks_of_one_device(monkeypatch, tmp_path)
    from npu_bridge.estimator.npu.npu_strategy import NPUStrategy
    strategy = NPUStrategy()
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        gs, x, w, loss = fed_linear_model()

        def build(distributed):
            scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(),
                                                distributed=distributed)
            scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w])
            return scaler.build(global_step=gs)

        train = strategy.extended.call_for_each_replica(build, args=("hccl",))
        types = [op.get_attr("_npu_shim_op_type") for op in tf.get_default_graph().get_operations()
                 if "_npu_shim_op_type" in op.node_def.attr]
        assert types.count(b"HcomAllReduce") == 2  # the flags, w's gradient
        assert train.update_op is not None
        with pytest.raises(ValueError, match=r"one of 2 workers \(RANK_SIZE/CM_WORKER_SIZE\)"
                                             r".*Pass distributed='hccl'"):
            strategy.extended.call_for_each_replica(build, args=(None,))
        u = tf.Variable(1.0, name="u")
        strategy.extended.call_for_each_replica(lambda: nl.LossScaleOptimizer(
            tf.train.GradientDescentOptimizer(1.0), nl.DynamicLossScaleManager(),
            is_distributed=True).minimize(u * u, var_list=[u]))


def test_a_one_device_strategy_is_built(graph):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        scaler, gs, x = _builder()
        train = strategy.extended.call_for_each_replica(lambda: scaler.build(global_step=gs))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, {x: [0.25, 0.5]})
        assert sess.run(gs) == 1


def test_a_mirrored_strategy_with_two_replicas_is_refused():
    """Run in a fresh process: the CPU is split into two logical devices
    before TF starts, which a running test process can no longer do."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    done = warm_python.run([sys.executable, "-c", _MIRRORED % {"repo": REPO}], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=180)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("shared_manager", "per_replica_manager",
                                              "loss_scale_optimizer", "horovod_route"))
    assert len(lines) == 4, done.stdout + done.stderr[-3000:]
    for name, line in lines.items():
        assert line.startswith("REFUSED"), (name, line)
        for fragment in ("under MirroredStrategy", "with 2 replicas in one graph",
                         "distributed='horovod'", "SyncReplicasOptimizer"):
            assert fragment in line, (name, line)
