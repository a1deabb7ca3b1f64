"""The shim's device loop (``iterations_per_loop``) and the npu_bridge surface
ModelZoo's looped scripts use, checked against tf_adapter.

Each behaviour comes from Huawei's tf_adapter source (hicann/tensorflow
master); each test names the file (paths under
tf_adapter/python/npu_bridge/ unless they start with tf_adapter/):

* estimator/npu/util.py: ``set_iteration_per_loop``, ``IterationPerLoop``,
  ``create_or_get_var``, the argument checks;
* tf_adapter/kernels/geop_npu.cc (``GeOp::AddNodeAttrs``): the subgraph
  holding the node named exactly ``IterationOp`` loops, as many times as the
  session config's ``NpuOptimizer`` says;
* tf_adapter/optimizers/om_partition_subgraphs_pass.cc: a ``OneShotIterator``
  with ``iterations_per_loop`` != 1 is fatal;
* estimator/npu/npu_config.py, npu_estimator.py, npu_hook.py: NPURunConfig's
  argument errors, NPUEstimator's loop (``SetIterationsVarHook`` and
  ``tf.group(train_op, name="IterationOp")``), ``host_call``;
* estimator/npu_ops.py: ``dropout``, ``initialize_system``.

The Estimator tests need tf.estimator (TF <= 2.15): ``make test`` runs this
file on TF 2.15.1 too.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

ESTIMATOR = getattr(tf, "estimator", None)
needs_estimator = pytest.mark.skipif(
    ESTIMATOR is None, reason="tf.estimator was removed in TF 2.16; make test runs this "
                              "file on TF 2.15.1")


def _session(iterations):
    """A session made the ModelZoo way: npu_config_proto plus the
    NpuOptimizer's iterations_per_loop."""
    from npu_bridge.npu_init import npu_config_proto
    config = npu_config_proto()
    custom = config.graph_options.rewrite_options.custom_optimizers[0]
    custom.parameter_map["iterations_per_loop"].i = iterations
    return tf.Session(config=config)


def _counting_step():
    """A step that counts its runs and writes the next element of a dataset
    plus a feed; returns (step op, counter, the written value, the feed's
    placeholder, the iterator)."""
    counter = tf.Variable(0, dtype=tf.int64, name="counter")
    iterator = tf.data.make_initializable_iterator(tf.data.Dataset.range(100))
    element = iterator.get_next()
    fed = tf.placeholder(tf.int64, [])
    seen = tf.Variable(0, dtype=tf.int64, name="seen")
    written = tf.assign(seen, element + fed)
    with tf.control_dependencies([written]):
        step = tf.assign_add(counter, 1).op
    return step, counter, written, fed, iterator


def test_set_iteration_per_loop_loops_the_iteration_op(graph, npu_shim):
    """util.py: the IterationOp is ``tf.group(train_op, name="IterationOp")``
    and the loop bound ``iterations_per_loop - 1`` is loaded; geop_npu.cc:
    one run of it runs the subgraph N times, the input pipeline advancing
    and the feed held; the host gets the last iteration's values."""
    from npu_bridge.npu_init import util
    step, counter, seen, fed, iterator = _counting_step()
    sess = _session(10)
    sess.run([tf.global_variables_initializer(), iterator.initializer])
    loop = util.set_iteration_per_loop(sess, step, 10)
    assert loop.name == "IterationOp"
    assert loop.control_inputs == [step]
    bound = tf.get_collection("npu_runconfig_iterations_per_loop")[0]
    assert bound.op.name == "npu_runconfig/iterations_per_loop"
    assert sess.run(bound) == 9
    _, last = sess.run([loop, seen], {fed: 1000})
    assert sess.run(counter) == 10
    assert last == 1009  # the tenth element (9) plus the feed
    assert sess.run([step, seen], {fed: 0})[1] == 10  # another fetch: one iteration
    assert sess.run(counter) == 11


def test_one_iteration_returns_the_train_op_itself(graph, npu_shim):
    """util.py: ``if iterations_per_loop == 1: return train_op``."""
    from npu_bridge.npu_init import util
    step, counter, _, fed, iterator = _counting_step()
    sess = _session(1)
    sess.run([tf.global_variables_initializer(), iterator.initializer])
    assert util.set_iteration_per_loop(sess, step, 1) is step
    sess.run(step, {fed: 0})
    assert sess.run(counter) == 1


def test_iteration_per_loop_class_makes_the_op_before_the_session(graph, npu_shim):
    """util.py ``IterationPerLoop``: create the op, then load the count."""
    from npu_bridge.npu_init import util
    step, counter, _, fed, iterator = _counting_step()
    looper = util.IterationPerLoop()
    loop = looper.create_iteration_per_loop_var(step)
    sess = _session(4)
    sess.run([tf.global_variables_initializer(), iterator.initializer])
    looper.load_iteration_per_loop_var(sess, 4)
    sess.run(loop, {fed: 0})
    sess.run(loop, {fed: 0})
    assert sess.run(counter) == 8


@pytest.mark.parametrize("train_op, count, error", [
    ("tensor", 2, ValueError), ("op", 0, ValueError), ("op", "2", TypeError),
    ("op", 2.0, TypeError)])
def test_set_iteration_per_loop_checks_its_arguments(graph, npu_shim, train_op, count, error):
    """util.py: a train_op that is not an Operation is a ValueError;
    ``check_positive_integer``: TypeError for a non-int, ValueError for <= 0."""
    from npu_bridge.npu_init import util
    step, _, _, _, _ = _counting_step()
    value = tf.constant(1.0) if train_op == "tensor" else step
    with pytest.raises(error):
        util.set_iteration_per_loop(_session(2), value, count)


def test_a_session_config_with_another_count_is_refused(graph, npu_shim):
    """geop_npu.cc loops as many times as the NpuOptimizer's parameter says;
    the shim refuses a loaded count that disagrees with it."""
    from npu_bridge.npu_init import util
    step, _, _, _, iterator = _counting_step()
    sess = _session(5)
    sess.run([tf.global_variables_initializer(), iterator.initializer])
    with pytest.raises(ValueError, match="iterations_per_loop=5"):
        util.set_iteration_per_loop(sess, step, 10)


def test_a_one_shot_iterator_cannot_loop(graph, npu_shim):
    """om_partition_subgraphs_pass.cc: "iterator_per_loop only support 1 when
    using OneShotIterator"."""
    from npu_bridge.npu_init import util
    value = tf.data.make_one_shot_iterator(tf.data.Dataset.range(10)).get_next()
    if not any(op.type == "OneShotIterator" for op in tf.get_default_graph().get_operations()):
        pytest.skip("this TF makes one-shot iterators without a OneShotIterator op")
    total = tf.Variable(0, dtype=tf.int64)
    step = tf.assign_add(total, value).op
    sess = _session(3)
    sess.run(tf.global_variables_initializer())
    loop = util.set_iteration_per_loop(sess, step, 3)
    with pytest.raises(RuntimeError, match="make_initializable_iterator"):
        sess.run(loop)


def test_npu_ops_dropout_and_the_system_ops(graph, npu_shim):
    """estimator/npu_ops.py: a float ``keep_prob`` of 1.0 returns x itself;
    one outside (0, 1] or an integer x is a ValueError; kept elements are
    scaled by 1 / keep_prob; initialize_system / shutdown_system are ops."""
    from npu_bridge.npu_init import npu_ops
    x = tf.ones([1000])
    assert npu_ops.dropout(x, 1.0) is x
    with pytest.raises(ValueError, match="keep_prob"):
        npu_ops.dropout(x, 1.5)
    with pytest.raises(ValueError, match="floating point"):
        npu_ops.dropout(tf.ones([3], tf.int32), 0.5)
    dropped = npu_ops.dropout(x, 0.5, seed=3)
    init, shutdown = npu_ops.initialize_system(), npu_ops.shutdown_system()
    assert isinstance(init, tf.Operation) and isinstance(shutdown, tf.Operation)
    with tf.Session() as sess:
        sess.run(init)
        values = sess.run(dropped)
        sess.run(shutdown)
    assert set(np.unique(values)) <= {0.0, 2.0}
    assert 300 < np.count_nonzero(values) < 700


@needs_estimator
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(iterations_per_loop=0), ValueError, "positive"),
    (dict(iterations_per_loop="10"), TypeError, "must be int"),
    (dict(iterations_per_loop=10, mix_compile_mode=True), ValueError, "mix_compile_mode"),
    (dict(mix_compile_mode=1), TypeError, "mix_compile_mode"),
    (dict(dump_config="dump"), ValueError, "DumpConfig"),
    (dict(horovod_mode=1), ValueError, "horovod_mode"),
    (dict(graph_run_mode=2), ValueError, "graph_run_mode")])
def test_npu_run_config_refuses_as_tf_adapter_does(npu_shim, kwargs, error, match):
    """estimator/npu/npu_config.py: NPURunConfig's own argument errors."""
    from npu_bridge.npu_init import NPURunConfig
    with pytest.raises(error, match=match):
        NPURunConfig(**kwargs)


@needs_estimator
def test_npu_run_config_keeps_the_fields_modelzoo_sets(npu_shim, tmp_path):
    """estimator/npu/npu_config.py: the fields ModelZoo's scripts set, and
    save_checkpoints_steps 100 when neither it nor _secs is given."""
    from npu_bridge.npu_init import DumpConfig, NPURunConfig
    dump = DumpConfig(enable_dump=True, dump_path=str(tmp_path))
    config = NPURunConfig(iterations_per_loop=10, precision_mode="allow_mix_precision",
                          enable_data_pre_proc=True, hcom_parallel=True,
                          mix_compile_mode=False, dump_config=dump, horovod_mode=False,
                          keep_checkpoint_max=3, model_dir=str(tmp_path),
                          session_config=tf.ConfigProto())
    assert config.iterations_per_loop == 10 and config.enable_data_pre_proc
    assert config._precision_mode == "allow_mix_precision" and config._dump_config is dump
    assert config.save_checkpoints_steps == 100 and config.keep_checkpoint_max == 3
    assert NPURunConfig(save_checkpoints_secs=60).save_checkpoints_steps is None


def _estimator_model_fn(features, labels, mode, params):
    """A counting model_fn whose host call counts the iterations it sees."""
    global_step = tf.train.get_or_create_global_step()
    w = tf.get_variable("w", [1], initializer=tf.zeros_initializer())
    loss = tf.reduce_mean(tf.square(w - tf.cast(features, tf.float32)))
    train_op = tf.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=global_step)
    calls = tf.get_variable("host_calls", [], tf.int64, tf.zeros_initializer(),
                            trainable=False)
    last = tf.get_variable("host_last", [], tf.int64, tf.zeros_initializer(), trainable=False)

    def host_fn(step):
        return [tf.assign_add(calls, 1), tf.assign(last, step)]

    from npu_bridge.npu_init import NPUEstimatorSpec
    return NPUEstimatorSpec(mode, loss=loss, train_op=train_op,
                            host_call=(host_fn, [global_step]))


@needs_estimator
def test_npu_estimator_loops_and_the_global_step_lands_where_asked(npu_shim, tmp_path):
    """npu_estimator.py: with iterations_per_loop=5 the train op becomes the
    IterationOp and SetIterationsVarHook loads the loop; the global step
    moves 5 per run, so max_steps=20 is 4 runs and save_checkpoints_steps=10
    saves at 10 and 20 (and 0, at the start); the host call runs once per iteration."""
    from npu_bridge.npu_init import NPUEstimator, NPURunConfig

    def input_fn():
        return tf.data.Dataset.range(1000).map(lambda i: tf.cast(i % 7, tf.float32))

    runs = []

    class Count(tf.train.SessionRunHook):
        def after_run(self, run_context, run_values):
            runs.append(run_context.session.run(tf.train.get_global_step()))

    config = NPURunConfig(iterations_per_loop=5, save_checkpoints_steps=10,
                          model_dir=str(tmp_path), keep_checkpoint_max=10)
    estimator = NPUEstimator(model_fn=_estimator_model_fn, config=config)
    estimator.train(input_fn, max_steps=20, hooks=[Count()])
    assert runs == [5, 10, 15, 20]
    steps = sorted(int(path.split("-")[-1]) for path in
                   tf.train.get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths)
    assert steps == [0, 10, 20]  # the saver hook also saves when the session starts
    assert estimator.get_variable_value("host_calls") == 20
    assert estimator.get_variable_value("host_last") == 20  # read after its iteration's step


@needs_estimator
def test_npu_estimator_refuses_a_config_that_is_not_npu_run_config(npu_shim):
    """npu_estimator.py: "`config` must be provided with type `NPUConfigs`"."""
    from npu_bridge.npu_init import NPUEstimator
    with pytest.raises(ValueError, match="NPUConfigs"):
        NPUEstimator(model_fn=_estimator_model_fn, config=tf.estimator.RunConfig())
