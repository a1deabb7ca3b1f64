"""Sub-steps in one op (issue 47): ``build(sequence=["d", "d", "g"])``.

The reference is the alternating loop it replaces: the same builder's groups
with ``per_group_ops=True``, run as three ``session.run``s (d, d, g). On the
same data (a tf.data pipeline: each sub-step, like each run, takes the next
batch) and with an overflow injected into the second d sub-step, the
sequence must end with the same weights, slots, scales and skip count, bit
for bit, on is_finite and on the float-status register (saturation mode),
under control flow v1 and v2 (the v1 leg runs this file again). Then: it
loops under the device-loop emulation, the skip record names the sub-step,
and what a sequence cannot take is refused.
"""
import warnings

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import diagnostics

SEQUENCE = ("d", "d", "g")
RUNS = 4
#: The batch whose factor overflows the discriminator's float16 logits: the
#: second d sub-step of the second sequence.
POISONED = 4


def _data():
    rng = np.random.RandomState(11)
    batches = rng.normal(0, 1, [RUNS * len(SEQUENCE), 8, 4]).astype(np.float32)
    factors = np.ones([len(batches)], np.float32)
    factors[POISONED] = np.inf
    iterator = tf.data.make_initializable_iterator(
        tf.data.Dataset.from_tensor_slices((batches, factors)))
    return iterator


def _networks():
    """The two networks' variables, made once (the loss callables reuse them)."""
    rng = np.random.RandomState(3)
    init = lambda shape: tf.constant_initializer(rng.normal(0, 0.5, shape).astype(np.float32))
    with tf.variable_scope("generator"):
        g_w = tf.get_variable("w", [4, 4], initializer=init([4, 4]))
    with tf.variable_scope("discriminator"):
        d_w = tf.get_variable("w", [4, 1], initializer=init([4, 1]))
    return g_w, d_w


def _losses(iterator, g_w, d_w):
    """(d_loss, g_loss) on the next batch: float16 compute, float32 losses;
    the batch's factor multiplies the discriminator's real logits."""
    x, factor = iterator.get_next()
    fake = tf.tanh(tf.matmul(tf.cast(x, tf.float16), tf.cast(g_w, tf.float16)))
    real = tf.matmul(tf.cast(x, tf.float16), tf.cast(d_w, tf.float16)) * tf.cast(
        factor, tf.float16)
    fake_logits = tf.matmul(fake, tf.cast(d_w, tf.float16))
    d_loss = (tf.reduce_mean(tf.nn.softplus(-tf.cast(real, tf.float32)))
              + tf.reduce_mean(tf.nn.softplus(tf.cast(fake_logits, tf.float32))))
    g_loss = tf.reduce_mean(tf.nn.softplus(-tf.cast(fake_logits, tf.float32)))
    return d_loss, g_loss


def _scaler(backend, manager=None):
    return nl.MultiOptimizerLossScale(
        manager or nl.DynamicLossScaleManager(initial_scale=2.0 ** 12, growth_steps=2),
        backend=backend)


def _train(backend, sequenced, loop=1):
    """RUNS sequences (or 3 * RUNS alternating runs); every global variable's
    value by name, and the decoded skip history."""
    from npu_bridge.npu_init import npu_config_proto, util
    with tf.Graph().as_default():
        iterator = _data()
        g_w, d_w = _networks()
        global_step = tf.train.get_or_create_global_step()
        scaler = _scaler(backend)
        if sequenced:
            scaler.add(lambda: _losses(iterator, g_w, d_w)[0], tf.train.AdamOptimizer(0.01),
                       var_list=[d_w], name="d")
            scaler.add(lambda: _losses(iterator, g_w, d_w)[1], tf.train.AdamOptimizer(0.01),
                       var_list=[g_w], name="g")
            train = scaler.build(global_step=global_step, sequence=list(SEQUENCE))
            fetches = [train.update_op]
        else:
            d_loss, g_loss = _losses(iterator, g_w, d_w)
            scaler.add(d_loss, tf.train.AdamOptimizer(0.01), var_list=[d_w], name="d")
            scaler.add(g_loss, tf.train.AdamOptimizer(0.01), var_list=[g_w], name="g")
            train = scaler.build(global_step=global_step, per_group_ops=True)
            fetches = [train.per_group[name] for name in SEQUENCE]
        config = npu_config_proto()
        config.graph_options.rewrite_options.custom_optimizers[0].parameter_map[
            "iterations_per_loop"].i = loop
        with tf.Session(config=config) as sess:
            sess.run([tf.global_variables_initializer(), iterator.initializer])
            if loop > 1:
                fetches = [util.set_iteration_per_loop(sess, fetches[0], loop)]
            for _ in range(RUNS // loop):
                for fetch in fetches:
                    sess.run(fetch)
            values = dict((var.op.name, sess.run(var)) for var in tf.global_variables())
            return values, diagnostics.read_recent_skips(sess, train)


def _compare(got, want, skip=("global_step",)):
    assert sorted(got) == sorted(want)
    for name in got:
        if name not in skip:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("backend, mode", [("is_finite", "inf_nan"), ("npu", "saturation")])
def test_a_sequence_equals_its_per_group_runs(npu_shim, backend, mode):
    """["d", "d", "g"] in one op against per_group d, d, g in three runs:
    weights, Adam's slots and powers, the scale and the skip count bit for
    bit; the poisoned second d sub-step skipped alone (the g sub-step after
    it applied on d's unchanged weights). The global step moves once per
    sequence, where the alternating runs move it once per applied run."""
    from npu_bridge import _emulation
    _emulation.set_overflow_mode(mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sequenced, recent = _train(backend, True)
        alternating, _ = _train(backend, False)
    _compare(sequenced, alternating)
    assert sequenced["loss_scale/skipped_steps"] == 1
    assert sequenced["global_step"] == RUNS
    assert alternating["global_step"] == RUNS * len(SEQUENCE) - 1
    assert [(skip.global_step, skip.substep, skip.groups) for skip in recent] == [
        (1, 1, ("d",))]


def test_a_sequence_loops_on_the_device(npu_shim):
    """Under set_iteration_per_loop, two iterations per run of the sequence op
    end as two runs of it end."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        looped, looped_recent = _train("is_finite", True, loop=2)
        plain, plain_recent = _train("is_finite", True)
    _compare(looped, plain, skip=())
    assert looped_recent == plain_recent and len(plain_recent) == 1


def test_each_sub_step_reads_the_weights_the_last_one_wrote(graph):
    """Two sub-steps of one group, GradientDescent at rate 1 on
    loss = w * x: the second sub-step's forward pass reads w after the
    first's update (w = 1 - 1 - 1 = -1 after one run), as TF-GAN's
    rebuilt sub-steps do; the batch-norm-like update its callable adds to
    UPDATE_OPS runs once per applied sub-step."""
    w = tf.Variable(1.0, name="w")
    seen = tf.Variable(0.0, name="seen", trainable=False)
    counted = tf.Variable(0.0, name="counted", trainable=False)

    def loss():
        tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, tf.assign_add(counted, 1.0).op)
        with tf.control_dependencies([tf.assign(seen, w.read_value())]):
            return w * 1.0

    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w], name="net")
    train = scaler.build(sequence=["net", "net"])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        assert sess.run([w, seen, counted]) == [-1.0, 0.0, 2.0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(sequence=["d", "x"]), "'x', which is no group"),
    (dict(sequence=["d"]), "leaves out group 'g'"),
    (dict(sequence=[]), "has no sub-step"),
    (dict(sequence=["d", "g"], accumulation_steps=2), "cannot take accumulation_steps"),
    (dict(sequence=["d", "g"], per_group_ops=True), "cannot take per_group_ops"),
    (dict(sequence=["d", "g"], measure_underflow=True), "cannot take measure_underflow"),
    (dict(sequence=["d", "g"], update_ops=[]), "cannot take update_ops")])
def test_what_a_sequence_cannot_take_is_refused_before_any_op(graph, kwargs, match):
    iterator = _data()
    g_w, d_w = _networks()
    scaler = _scaler("is_finite")
    scaler.add(lambda: _losses(iterator, g_w, d_w)[0], tf.train.AdamOptimizer(), var_list=[d_w],
               name="d")
    scaler.add(lambda: _losses(iterator, g_w, d_w)[1], tf.train.AdamOptimizer(), var_list=[g_w],
               name="g")
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=match):
        scaler.build(**kwargs)
    assert len(graph.get_operations()) == before


def test_a_tensor_loss_in_a_sequence_is_refused(graph):
    """A tensor is built once: it cannot read an earlier sub-step's weights."""
    iterator = _data()
    g_w, d_w = _networks()
    d_loss, _ = _losses(iterator, g_w, d_w)
    scaler = _scaler("is_finite")
    scaler.add(d_loss, tf.train.AdamOptimizer(), var_list=[d_w], name="d")
    with pytest.raises(ValueError, match=r"group 'd''s loss is a tensor.*add\(lambda"):
        scaler.build(sequence=["d", "d"])
    with pytest.raises(TypeError, match="list of group names"):
        scaler.build(sequence="dd")


def test_the_audit_finds_no_race_and_no_double_update_in_a_sequence(npu_shim):
    """On the register each sub-step's reads follow a clear of its own, made
    after the sub-step before (NLS001, the check that guards seed 003, finds
    no clear between an overflow and the read that should see it); the
    sub-steps' updates of one variable and one manager follow each other, as
    separate runs' would (no NLS010 or NLS011)."""
    from npu_bridge import _emulation
    _emulation.set_overflow_mode("saturation")
    with tf.Graph().as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        iterator = _data()
        g_w, d_w = _networks()
        scaler = _scaler("npu")
        scaler.add(lambda: _losses(iterator, g_w, d_w)[0], tf.train.AdamOptimizer(0.01),
                   var_list=[d_w], name="d")
        scaler.add(lambda: _losses(iterator, g_w, d_w)[1], tf.train.AdamOptimizer(0.01),
                   var_list=[g_w], name="g")
        train = scaler.build(global_step=tf.train.get_or_create_global_step(),
                             sequence=list(SEQUENCE))
        clears = [op for op in tf.get_default_graph().get_operations()
                  if op.type == "NoOp" and op.name.startswith("loss_scale/clear_status")]
        assert len(clears) == len(SEQUENCE)
        assert [finding.code for finding in nl.audit(fetches=[train.update_op])] == []


def test_clipping_and_requested_skips_work_per_sub_step(graph):
    """A group's clip_norm clips each of its sub-steps; skip_global_steps
    skips every sub-step of the runs it names, holding the scale
    (count_skipped_steps=True moves the global step each run)."""
    w = tf.Variable(0.0, name="w")
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(initial_scale=4.0),
                                        backend="is_finite")
    # d(loss)/dw = -100 until w reaches 100: clipped to a norm of 1, each
    # sub-step moves w by exactly 1.
    scaler.add(lambda: -100.0 * w, tf.train.GradientDescentOptimizer(1.0), var_list=[w],
               name="net", clip_norm=1.0)
    step = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=step, count_skipped_steps=True, skip_global_steps=[1],
                         sequence=["net", "net"])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        assert sess.run([w, step, train.skipped_steps]) == [2.0, 1, 0]
        sess.run(train.update_op)  # global step 1: both sub-steps skip
        assert sess.run([w, step, train.skipped_steps, train.loss_scale]) == [2.0, 2, 2, 4.0]
        recent = diagnostics.read_recent_skips(sess, train)
        assert [(skip.reason, skip.substep) for skip in recent] == [
            ("requested", 0), ("requested", 1)]
        sess.run(train.update_op)
        assert sess.run(w) == 4.0
