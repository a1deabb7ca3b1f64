"""Our step under a device loop (issue 43): ``iterations_per_loop`` steps per
``session.run`` end where as many runs of one step end.

The loop is the shim's emulation of tf_adapter's (``util.set_iteration_per_loop``
and the session config's ``NpuOptimizer`` ``iterations_per_loop``; see
tests/test_device_loop.py): the whole step graph runs again per iteration,
the float-status clear and read, the gate and the managers' updates
included, with the next batch of the input pipeline. The twin runs the same
script, data and seed one step per ``session.run``. Both must end with the
same weights and slots, bit for bit, the same loss scale, skip count, global
step and skip record, on is_finite and on the npu backend in INF/NaN and
saturation mode, for the builder and for ``LossScaleOptimizer``; the v1 leg
runs the file again with ref variables and Switch/Merge.
"""
import json
import os
import sys
import warnings

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
import warm_python
from conftest import fresh_process
from npu_lossscale import diagnostics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "gan", "dcgan_loop.py")

ITERATIONS = 10
STEPS = 20
#: The steps whose batch overflows float16: a run of three, and one alone.
POISONED = (3, 4, 5, 14)
#: (backend, the shim's overflow mode).
CASES = [("is_finite", "inf_nan"), ("npu", "inf_nan"), ("npu", "saturation")]


def _poison(poisoned):
    poison = np.ones([STEPS], np.float32)
    poison[list(poisoned)] = np.inf
    return poison


def _model(poisoned=POISONED):
    """A float16 two-network model fed by a tf.data pipeline: each element
    a batch and a factor, inf on the POISONED steps, that multiplies the
    float16 logits (inf in INF/NaN mode; +-65504 and the register set in
    saturation mode)."""
    rng = np.random.RandomState(5)
    batches = rng.normal(0, 1, [STEPS, 8, 4]).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((batches, _poison(poisoned)))
    iterator = tf.data.make_initializable_iterator(data)
    x, factor = iterator.get_next()
    init = lambda shape: tf.constant_initializer(rng.normal(0, 0.5, shape).astype(np.float32))
    with tf.variable_scope("generator"):
        g_w = tf.get_variable("w", [4, 4], initializer=init([4, 4]))
    with tf.variable_scope("discriminator"):
        d_w = tf.get_variable("w", [4, 1], initializer=init([4, 1]))
    fake = tf.tanh(tf.matmul(tf.cast(x, tf.float16), tf.cast(g_w, tf.float16)))
    logits = tf.matmul(fake, tf.cast(d_w, tf.float16)) * tf.cast(factor, tf.float16)
    d_loss = tf.reduce_mean(tf.nn.softplus(tf.cast(logits, tf.float32)))
    g_loss = tf.reduce_mean(tf.nn.softplus(-tf.cast(logits, tf.float32)))
    return iterator, (d_loss, [d_w]), (g_loss, [g_w])


def _session_config(iterations):
    """A ModelZoo session config: npu_config_proto and the NpuOptimizer's
    iterations_per_loop."""
    from npu_bridge.npu_init import npu_config_proto
    config = npu_config_proto()
    config.graph_options.rewrite_options.custom_optimizers[0].parameter_map[
        "iterations_per_loop"].i = iterations
    return config


def _session(iterations):
    return tf.Session(config=_session_config(iterations))


def _record_values(sess):
    """The values of every skip record in the graph (no collection holds them)."""
    handles = [op for op in tf.get_default_graph().get_operations()
               if op.type == "VarHandleOp" and op.name.endswith("last_skip")]
    return [sess.run(tf.raw_ops.ReadVariableOp(resource=op.outputs[0], dtype=tf.int64))
            for op in handles
            if sess.run(tf.raw_ops.VarIsInitializedOp(resource=op.outputs[0]))]


def _train(api, backend, mode, iterations, steps=STEPS):
    """Trains ``steps`` steps, ``iterations`` per session.run; returns every
    global variable's value by name, the skip records and the decoded
    history (builder only)."""
    from npu_bridge import _emulation
    from npu_bridge.npu_init import util
    with tf.Graph().as_default():
        tf.set_random_seed(0)
        _emulation.set_overflow_mode(mode)
        global_step = tf.train.get_or_create_global_step()
        iterator, (d_loss, d_vars), (g_loss, g_vars) = _model()
        manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 12, growth_steps=3)
        train = None
        if api == "builder":
            scaler = nl.MultiOptimizerLossScale(manager, backend=backend, skip_history=8)
            scaler.add(d_loss, tf.train.AdamOptimizer(0.01), var_list=d_vars, name="d")
            scaler.add(g_loss, tf.train.AdamOptimizer(0.01), var_list=g_vars, name="g")
            train = scaler.build(global_step=global_step, count_skipped_steps=True)
            step = train.update_op
        else:
            opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.01), manager,
                                        backend=backend, count_skipped_steps=True)
            step = opt.minimize(d_loss + g_loss, global_step=global_step,
                                var_list=d_vars + g_vars)
        sess = _session(iterations)
        sess.run([tf.global_variables_initializer(), tf.local_variables_initializer(),
                  iterator.initializer])
        if iterations > 1:
            step = util.set_iteration_per_loop(sess, step, iterations)
        for _ in range(steps // iterations):
            sess.run(step)
        values = dict((var.op.name, sess.run(var)) for var in tf.global_variables())
        history = (diagnostics.read_recent_skips(sess, train), diagnostics.read_last_skip(
            sess, train)) if train is not None else None
        return values, _record_values(sess), history


@pytest.mark.parametrize("api", ["builder", "optimizer"])
@pytest.mark.parametrize("backend, mode", CASES)
def test_a_looped_run_equals_one_step_per_run(npu_shim, api, backend, mode):
    """Ten iterations per run, twice, against twenty runs of one: the same
    weights, slots, scales, counters and records, bit for bit; each
    poisoned step skipped (the global step counts it, the skip count too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        looped = _train(api, backend, mode, ITERATIONS)
        plain = _train(api, backend, mode, 1)
    values, records, history = looped
    assert sorted(values) == sorted(plain[0])
    for name in values:
        np.testing.assert_array_equal(values[name], plain[0][name], err_msg=name)
    assert values["global_step"] == STEPS
    skipped = [value for name, value in values.items() if name.endswith("skipped_steps")]
    if api == "optimizer":  # no record, no skip count: the weights say it all
        assert records == plain[1] == [] and skipped == []
        return
    assert len(records) == 1
    np.testing.assert_array_equal(records[0], plain[1][0])
    assert skipped == [len(POISONED)]
    if history is not None:
        assert history == plain[2]
        recent, last = history
        assert [(skip.global_step, skip.streak) for skip in recent] == [
            (3, 1), (4, 2), (5, 3), (14, 1)]
        assert last.global_step == 14 and last.number == len(POISONED)


@pytest.mark.parametrize("backend, mode", CASES)
def test_a_skip_in_an_iteration_changes_nothing_and_the_next_applies(npu_shim, backend, mode):
    """The poisoned steps 3, 4 and 5 leave the weights as step 2 left them,
    and step 6 applies (so, by the test above, do the iterations of a looped
    run); the looped run's history names each skip with its global step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recent = _train("builder", backend, mode, ITERATIONS)[2][0]
        before, after, applied = [_train("builder", backend, mode, 1, steps)[0]
                                  for steps in (3, 6, 7)]
    for name in ("generator/w", "discriminator/w"):
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
        assert np.any(applied[name] != after[name]), name
    assert [skip.global_step for skip in recent] == list(POISONED)



def _builder_step(poisoned, per_group_ops=False, count_skipped_steps=True):
    """The builder's two-group step on ``_model(poisoned)``; returns
    (iterator, TrainOps)."""
    global_step = tf.train.get_or_create_global_step()
    iterator, (d_loss, d_vars), (g_loss, g_vars) = _model(poisoned)
    scaler = nl.MultiOptimizerLossScale(
        nl.DynamicLossScaleManager(initial_scale=2.0 ** 12), backend="is_finite")
    scaler.add(d_loss, tf.train.AdamOptimizer(0.01), var_list=d_vars, name="d")
    scaler.add(g_loss, tf.train.AdamOptimizer(0.01), var_list=g_vars, name="g")
    return iterator, scaler.build(global_step=global_step, per_group_ops=per_group_ops,
                                  count_skipped_steps=count_skipped_steps)


def _monitored(poisoned, iterations, runs):
    """A plain loop fed to a CollapseMonitor(collapse_after=3): each run's
    ``observe`` result (the Collapse's skip count, or None)."""
    from npu_bridge.npu_init import util
    with tf.Graph().as_default():
        iterator, train = _builder_step(poisoned)
        sess = _session(iterations)
        sess.run([tf.global_variables_initializer(), iterator.initializer])
        step = (util.set_iteration_per_loop(sess, train.update_op, iterations)
                if iterations > 1 else train.update_op)
        monitor = nl.CollapseMonitor(train, collapse_after=3, on_collapse="stop")
        seen = []
        for _ in range(runs):
            _, reason = sess.run([step, train.diagnosis.skip_reason])
            collapse = monitor.observe(reason, sess)
            seen.append(None if collapse is None else collapse.skips)
        return seen


@pytest.mark.parametrize("poisoned, looped, plain", [
    # Four poisoned batches inside one loop of ten: the alarm after that run.
    ((3, 4, 5, 6), [3, None], [None] * 5 + [3, 3] + [None] * 13),
    # Two runs of two: no alarm, though the run ends on a skip.
    ((3, 4, 8, 9), [None, None], [None] * 20),
    # A run of four across the two loops: the alarm after the second.
    ((8, 9, 10, 11), [None, 3], [None] * 10 + [3, 3] + [None] * 8)])
def test_the_collapse_monitor_sees_every_skip_of_a_looped_run(npu_shim, poisoned, looped,
                                                             plain):
    """Fed as in a plain loop, one ``observe`` per session.run, the monitor
    reads the record's history after a looped run: its alarms come after
    the run that held the collapse, as the plain loop's come at the step."""
    assert _monitored(poisoned, ITERATIONS, 2) == looped
    assert _monitored(poisoned, 1, 20) == plain


def _hooked(hooks_for, fetch_for, runs=2, **build):
    """Runs ``runs`` runs of a MonitoredSession over the builder's step,
    the loop made as NPUEstimator makes it (IterationPerLoop's op and
    SetIterationsVarHook); returns the session's results."""
    from npu_bridge.npu_init import SetIterationsVarHook, util
    with tf.Graph().as_default():
        iterator, train = _builder_step((3, 4, 5, 6), **build)
        loop = util.IterationPerLoop().create_iteration_per_loop_var(fetch_for(train))
        scaffold = tf.train.Scaffold(local_init_op=tf.group(
            tf.local_variables_initializer(), iterator.initializer))
        creator = tf.train.ChiefSessionCreator(scaffold=scaffold,
                                               config=_session_config(ITERATIONS))
        hooks = [SetIterationsVarHook(ITERATIONS)] + hooks_for(train)
        with tf.train.MonitoredSession(session_creator=creator, hooks=hooks) as sess:
            return [sess.run(loop) for _ in range(runs)]


def test_the_hook_raises_the_collapse_of_a_looped_run(npu_shim):
    """LossScaleHook(on_collapse="raise") on a MonitoredSession whose run
    loops ten iterations: four poisoned ones in a row raise after it."""
    with pytest.raises(nl.LossScaleCollapse, match="3 consecutive skipped steps"):
        _hooked(lambda train: [nl.LossScaleHook(train, on_collapse="raise",
                                                collapse_after=3)],
                lambda train: train.update_op)


def test_a_loop_over_one_per_group_op_of_two_is_refused(npu_shim):
    """Only the op named IterationOp loops: looping per_group['d'] would train
    d ten times per run of g. The hook refuses it when the session starts."""
    with pytest.raises(ValueError, match=r"per_group\['d'\].*'g' would run once"):
        _hooked(lambda train: [nl.LossScaleHook(train)],
                lambda train: train.per_group["d"], per_group_ops=True)


def test_a_loop_whose_global_step_stands_still_on_skips_is_refused(npu_shim):
    """NPURunConfig counts iterations_per_loop steps per run: a step that does
    not count its skips would move max_steps and the checkpoints."""
    with pytest.raises(ValueError, match=r"count_skipped_steps=True"):
        _hooked(lambda train: [nl.LossScaleHook(train)], lambda train: train.update_op,
                count_skipped_steps=False)


def test_without_a_loop_the_hook_takes_both_patterns(npu_shim):
    """The refusals above are of the loop: without one, per-group ops run
    one per session.run and a step that does not count its skips are fine."""
    with tf.Graph().as_default():
        iterator, train = _builder_step((3,), per_group_ops=True, count_skipped_steps=False)
        hook = nl.LossScaleHook(train, on_collapse="raise", collapse_after=3)
        scaffold = tf.train.Scaffold(local_init_op=tf.group(
            tf.local_variables_initializer(), iterator.initializer))
        with tf.train.MonitoredSession(tf.train.ChiefSessionCreator(scaffold=scaffold),
                                       hooks=[hook]) as sess:
            for name in ("d", "g", "d", "g"):
                sess.run(train.per_group[name])
            assert sess.run(tf.train.get_global_step()) == 3


@fresh_process
@pytest.mark.parametrize("mode, sequence", [("sessrun", None), ("sessrun", "d,g"),
                                            ("estimator", None)])
def test_the_example_trains_on_a_loop_as_one_step_per_run(mode, sequence, tmp_path):
    """examples/gan/dcgan_loop.py, a ModelZoo-style script, run unchanged
    with --iterations_per_loop 10 and 1: the same global step, skips (each
    with its global step, sub-step and reason), loss scale and variables,
    with a joint step and with the sub-steps d, g in one op (issue 47).
    Started at a scale of 2**24, its first steps overflow. The Estimator
    mode needs tf.estimator (the TF 2.15 leg); the sess.run mode runs on
    TF 2.21."""
    if (mode == "estimator") != (getattr(tf, "estimator", None) is not None):
        pytest.skip("the estimator mode runs on the TF 2.15 leg, sess.run mode on TF 2.21")
    # On TF 2.15 this example's weights depend on how its kernels' work is
    # spread over the intra-op threads (the sess.run mode's too, which runs
    # on TF 2.21 here, where they do not): a run gave one of two digests at
    # random, with 10 and with 1 iterations alike and with oneDNN off; with
    # one intra-op thread (read when the child's session makes its pool)
    # always one, whatever the inter-op pool: scheduling in a kernel, not a
    # read racing a write in the graph.
    threads = {"TF_NUM_INTRAOP_THREADS": "1"} if mode == "estimator" else {}
    results = []
    for iterations in (10, 1):
        out = str(tmp_path / str(iterations))
        proc = warm_python.run(
            [sys.executable, EXAMPLE, "--npu-shim", "--mode", mode, "--steps", "20",
             "--batch-size", "4", "--loss-scale", "dynamic:16777216",
             "--iterations_per_loop", str(iterations), "--out", out]
            + ([] if sequence is None else ["--sequence", sequence]),
            env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3", **threads),
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(os.path.join(out, "metrics.json")) as handle:
            results.append(json.load(handle))
    looped, plain = results
    assert looped.pop("iterations_per_loop") == 10 and plain.pop("iterations_per_loop") == 1
    assert looped == plain
    assert looped["global_step"] == 20 and looped["skipped_steps"] > 0
    assert looped["skips"][0][0] == 0
    if sequence:  # both sub-steps of the first step skipped, at scale 2**24
        assert [substep for _, substep, _ in looped["skips"][:2]] == [0, 1]


def test_the_loop_summary_counts_the_runs_skips(npu_shim):
    """summaries(iterations_per_loop=10)'s skipped_in_loop, fetched with the
    loop's op, is the number of that run's skipped iterations (3, then 1 for
    POISONED); it needs a step that counts its skips."""
    from npu_bridge.npu_init import util
    with tf.Graph().as_default():
        iterator, train = _builder_step(POISONED)
        in_loop = nl.summaries(train, iterations_per_loop=ITERATIONS)[-1]
        assert in_loop.op.name == "loss_scale/skipped_in_loop"
        assert in_loop not in tf.get_collection(tf.GraphKeys.SUMMARIES)
        sess = _session(ITERATIONS)
        sess.run([tf.global_variables_initializer(), iterator.initializer])
        loop = util.set_iteration_per_loop(sess, train.update_op, ITERATIONS)
        counts = []
        for _ in range(2):
            summary = tf.Summary.FromString(sess.run([loop, in_loop])[1])
            counts.append(summary.value[0].simple_value)
        assert counts == [3.0, 1.0]
    with tf.Graph().as_default():
        _, uncounted = _builder_step(POISONED, count_skipped_steps=False)
        with pytest.raises(ValueError, match="count_skipped_steps=True"):
            nl.summaries(uncounted, iterations_per_loop=ITERATIONS)


def _estimator_run(tmp_path, count_skipped_steps, hooks=True):
    """NPUEstimator with iterations_per_loop=5, save_checkpoints_steps=10 and
    max_steps=20 over the builder's two groups, POISONED batches skipping;
    returns (the saved steps, the final global step, the skip count)."""
    from npu_bridge.npu_init import NPUEstimator, NPUEstimatorSpec, NPURunConfig
    rng = np.random.RandomState(5)
    batches = rng.normal(0, 1, [STEPS, 8, 4]).astype(np.float32)

    def input_fn():
        return tf.data.Dataset.from_tensor_slices((batches, _poison(POISONED)))

    def model_fn(features, labels, mode):
        x, factor = features, labels  # the dataset's pairs
        with tf.variable_scope("d"):
            d_w = tf.get_variable("w", [4, 1])
        logits = tf.matmul(tf.cast(x, tf.float16), tf.cast(d_w, tf.float16))
        loss = tf.reduce_mean(tf.nn.softplus(tf.cast(logits * tf.cast(factor, tf.float16),
                                                     tf.float32)))
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")
        scaler.add(loss, tf.train.AdamOptimizer(0.01), var_list=[d_w], name="d")
        train = scaler.build(global_step=tf.train.get_global_step(),
                             count_skipped_steps=count_skipped_steps)
        tf.identity(train.skipped_steps, name="skips_read")
        return NPUEstimatorSpec(mode, loss=loss, train_op=train.update_op,
                                training_hooks=[nl.LossScaleHook(train)] if hooks else [])

    config = NPURunConfig(iterations_per_loop=5, save_checkpoints_steps=10,
                          model_dir=str(tmp_path), keep_checkpoint_max=10)
    estimator = NPUEstimator(model_fn=model_fn, config=config)
    estimator.train(input_fn, max_steps=20)
    state = tf.train.get_checkpoint_state(str(tmp_path))
    saved = sorted(int(path.split("-")[-1]) for path in state.all_model_checkpoint_paths)
    return (saved, estimator.get_variable_value("global_step"),
            estimator.get_variable_value("loss_scale/skipped_steps"))


@pytest.mark.skipif(getattr(tf, "estimator", None) is None,
                    reason="tf.estimator exists up to TF 2.15: the TF 2.15 leg runs it")
def test_npu_estimator_checkpoints_land_where_asked_with_skips(npu_shim, tmp_path):
    """NPURunConfig's promise: the global step moves iterations_per_loop
    steps per run, so max_steps=20 and save_checkpoints_steps=10 land at 20,
    10 and 20 although four steps skip; a step that does not count its
    skips is refused by LossScaleHook before it drifts."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _estimator_run(tmp_path / "counted", True) == ([0, 10, 20], 20, len(POISONED))
        with pytest.raises(ValueError, match="count_skipped_steps=True"):
            _estimator_run(tmp_path / "uncounted", False)
        drifted = _estimator_run(tmp_path / "drifting", False, hooks=False)
    # What the refusal prevents: the data's 20 batches end at global step 16,
    # with a checkpoint at 11 where 10 was asked for.
    assert drifted == ([0, 11, 16], 16, len(POISONED))


def test_the_monitor_refuses_a_loop_over_one_per_group_op_of_two(npu_shim):
    """A plain loop with a CollapseMonitor, no hook: its first observe after
    a looped run of per_group['d'] says that g would run once per run."""
    from npu_bridge.npu_init import util
    with tf.Graph().as_default():
        iterator, train = _builder_step((3,), per_group_ops=True)
        sess = _session(ITERATIONS)
        sess.run([tf.global_variables_initializer(), iterator.initializer])
        loop = util.set_iteration_per_loop(sess, train.per_group["d"], ITERATIONS)
        monitor = nl.CollapseMonitor(train, collapse_after=3)
        sess.run(loop)
        with pytest.raises(ValueError, match=r"CollapseMonitor: .*per_group\['d'\]"):
            monitor.observe(0, sess, step="d")


def _applied_step_ops(history):
    """The ops one applied step of the two-group model executes (a
    FULL_TRACE run's node stats), with a record of ``history`` skips."""
    from tensorflow.core.protobuf import config_pb2
    with tf.Graph().as_default():
        global_step = tf.train.get_or_create_global_step()
        iterator, (d_loss, d_vars), (g_loss, g_vars) = _model(poisoned=())
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite",
                                            skip_history=history)
        scaler.add(d_loss, tf.train.AdamOptimizer(0.01), var_list=d_vars, name="d")
        scaler.add(g_loss, tf.train.AdamOptimizer(0.01), var_list=g_vars, name="g")
        train = scaler.build(global_step=global_step, count_skipped_steps=True)
        with tf.Session() as sess:
            sess.run([tf.global_variables_initializer(), iterator.initializer])
            sess.run(train.update_op)
            metadata = config_pb2.RunMetadata()
            sess.run(train.update_op, options=tf.RunOptions(trace_level=3),
                     run_metadata=metadata)
    return sorted(node.node_name for device in metadata.step_stats.dev_stats
                  for node in device.node_stats if node.node_name != "_SOURCE")


def test_an_applied_step_executes_nothing_of_the_skip_history():
    """The history lives in the skip record's one variable, written only in
    the skip branch: an applied step executes the same ops with a history
    of 1 and of 1000, and none of the history's reads."""
    small, large = _applied_step_ops(1), _applied_step_ops(1000)
    assert small == large
    assert not [name for name in large if "recent_skips" in name or "history" in name]
