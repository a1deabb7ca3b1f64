"""ListeningLossScaleManager and the protocol's optional underflow hooks
(managers/listening.py, managers/base.py; issue 26, item 5)."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
import soak
from npu_lossscale.managers import base as manager_base
from test_underflow import _conv3d_net, _float32_model

FLOAT16_MAX = 65504.0


def _seed_step(manager, gate="pivot", poison=None):
    """The float16 seed net (a float16 loss) trained at learning rate 0
    through the builder: the gradients are the same on every step."""
    loss16, w16 = _conv3d_net(tf.float16)
    if poison is not None:
        loss16 = loss16 * tf.cast(poison, tf.float16)
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite", gate=gate)
    scaler.add(loss16, tf.train.GradientDescentOptimizer(0.0), var_list=w16, name="net")
    return scaler.build()


def _run_traced(sess, fetches, feed=None):
    """``sess.run`` that also says whether the float32 view's convolutions
    ran (a gate's Switch ops, and the constants of a function inlined under
    v1 behaviour, run on either branch)."""
    options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
    metadata = tf.RunMetadata()
    result = sess.run(fetches, feed, options=options, run_metadata=metadata)
    measured = any(node.node_name.endswith("float32_view/Conv3D")
                   for device in metadata.step_stats.dev_stats for node in device.node_stats)
    return result, measured


@pytest.mark.parametrize("gate", ["pivot", "cond"])
def test_raises_early_by_the_headroom_and_measures_every_n_updates(gate):
    with tf.Graph().as_default():
        manager = nl.ListeningLossScaleManager(initial_scale=1, growth_steps=1000,
                                               measure_every_n_steps=3)
        train = _seed_step(manager, gate)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            used, measured, heard = [], [], []
            for _ in range(7):
                (_, scale, finite), ran = _run_traced(
                    sess, [train.update_op, train.loss_scale, train.is_finite])
                assert finite
                used.append(float(scale))
                measured.append(ran)
                heard.append(list(sess.run(manager.heard)))
    # The first update is measured: at scale 1 every float16 gradient is 0
    # (underflow share 1). The float32 view's magnitudes (1e-10 to 1e-6)
    # need 2**19 for at most 0.25 % (the raise's target, a quarter of 1 %)
    # below 2**-14; the largest gradient is the
    # float16 loss's own, 1, so the headroom is log2(65504) = 15.9993 bits,
    # less the 2-bit margin 13 doublings: 2**13.
    assert used == [1.0] + [2.0 ** 13] * 6
    assert measured == [True, False, False, True, False, False, True]
    # [update count mod 3, m, underflow share, log2(needed), measured this
    # run]: m is 1 (scale-free).
    assert heard[0] == [1.0, 1.0, 1.0, 19.0, 0.0]
    # At 2**13 some gradients are still subnormal (the share is above 1 %),
    # but 0.9993 bits of headroom less the margin leave no doubling: kept.
    assert heard[3][:2] == [1.0, 1.0] and heard[3][3:] == [19.0, 0.0]
    assert 0.01 < heard[3][2] < 0.5
    assert [h[0] for h in heard] == [1.0, 2.0, 0.0, 1.0, 2.0, 0.0, 1.0]


def _executed_ops(manager, gate, layers):
    """Ops a run of the step executes, on a 3-D conv net ``layers`` deep,
    on a run that does not measure."""
    with tf.Graph().as_default():
        rng = np.random.RandomState(0)
        x, weights = tf.ones([1, 8, 8, 8, 1], tf.float16), []
        for i, (cin, cout) in enumerate([(1, 4)] + [(4, 4)] * (layers - 1)):
            weights.append(tf.get_variable("conv%d" % i, initializer=rng.normal(
                0.0, 0.3, [3, 3, 3, cin, cout]).astype(np.float32)))
            x = tf.nn.relu(tf.nn.conv3d(x, tf.cast(weights[-1], tf.float16), [1] * 5, "SAME"))
        scaler = nl.MultiOptimizerLossScale(manager(), backend="is_finite", gate=gate)
        scaler.add(tf.reduce_mean(x), tf.train.GradientDescentOptimizer(0.0), var_list=weights)
        train = scaler.build()
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(train.update_op)  # the listening manager measures this one
            options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
            metadata = tf.RunMetadata()
            sess.run(train.update_op, options=options, run_metadata=metadata)
    return sum(len(device.node_stats) for device in metadata.step_stats.dev_stats)


@pytest.mark.parametrize("gate", ["pivot", "cond"])
def test_a_run_that_does_not_measure_costs_a_few_ops_whatever_the_model(gate):
    """The measurement sits in one function call behind the gate: a closed
    gate skips one op, not the float32 view's copy of the model (which,
    skipped op by op, made every step of the demo GAN 60 % slower)."""
    extra = {}
    for layers in (2, 4):
        extra[layers] = (
            _executed_ops(lambda: nl.ListeningLossScaleManager(measure_every_n_steps=1000),
                          gate, layers)
            - _executed_ops(nl.DynamicLossScaleManager, gate, layers))
    # Measured: 72 to 120 (the listening update, the gate, and under a cond
    # a Switch per captured tensor); two more layers add at most 6.
    assert extra[2] < 130 and extra[4] - extra[2] <= 8, extra


def test_never_grows_into_an_overflow_the_dynamic_rule_probes():
    """A float16 loss: 2**16 is inf in float16, so the dynamic rule's growth
    from 2**15 overflows every time; the listening manager's measurement
    (the loss's own gradient, 1, times 2**16 > 65504) forbids that growth."""
    runs = {}
    for name, make in (("dynamic", nl.DynamicLossScaleManager),
                       ("listening", nl.ListeningLossScaleManager)):
        extra = {"measure_every_n_steps": 1} if name == "listening" else {}
        with tf.Graph().as_default():
            manager = make(initial_scale=2 ** 14, growth_steps=1, **extra)
            train = _seed_step(manager)
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                runs[name] = [tuple(sess.run([train.update_op, train.loss_scale,
                                              train.is_finite])[1:]) for _ in range(6)]
    assert runs["dynamic"] == [(2.0 ** 14, True), (2.0 ** 15, True), (2.0 ** 16, False),
                               (2.0 ** 15, True), (2.0 ** 16, False), (2.0 ** 15, True)]
    assert runs["listening"] == [(2.0 ** 14, True)] + [(2.0 ** 15, True)] * 5


def test_an_overflowed_measurement_keeps_the_last_finite_one():
    with tf.Graph().as_default():
        poison = tf.placeholder_with_default(tf.constant(1.0), [])
        manager = nl.ListeningLossScaleManager(initial_scale=4, growth_steps=1000,
                                               measure_every_n_steps=1,
                                               raise_above_underflow_share=1.0)
        train = _seed_step(manager, poison=poison)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(train.update_op)
            first = list(sess.run(manager.heard))
            _, finite, scale = sess.run([train.update_op, train.is_finite, train.loss_scale],
                                        {poison: np.inf})
            after = list(sess.run(manager.heard))
            state = sess.run(manager.state)
    # The first measurement: underflow share 1 at scale 4 (all flushed),
    # which reaches the threshold 1.0. The raise aims at a quarter of it:
    # the float32 view has 24.7 % of its elements below 2**-14 at 2**12
    # (tests/test_underflow.py's magnitudes), 36.7 % at 2**11: 10 doublings.
    assert first == [0.0, 1.0, 1.0, 12.0, 0.0]
    assert not finite and scale == 2.0 ** 12
    # The poisoned run measured inf: the last finite measurement stays,
    # marked as not of this run; the dynamic rule halved the scale.
    assert after == [0.0, 1.0, 1.0, 12.0, 0.0]
    assert state[0] == 2.0 ** 11


def test_without_a_measurement_it_is_the_dynamic_manager():
    """Through LossScaleOptimizer (gradients, no loss) nothing is measured:
    the scale moves exactly as DynamicLossScaleManager's."""
    scales = {}
    for make in (nl.DynamicLossScaleManager, nl.ListeningLossScaleManager):
        with tf.Graph().as_default():
            poison = tf.placeholder_with_default(tf.constant(1.0), [])
            loss16, w16 = _conv3d_net(tf.float16)
            manager = make(initial_scale=2 ** 10, growth_steps=2)
            opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(0.0), manager,
                                        backend="is_finite")
            step = opt.minimize(loss16 * tf.cast(poison, tf.float16), var_list=w16)
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                used = []
                for k in range(7):
                    used.append(float(sess.run(manager.loss_scale)))
                    sess.run(step, {poison: np.nan} if k == 3 else None)
                scales[make.__name__] = used
    assert scales["ListeningLossScaleManager"] == scales["DynamicLossScaleManager"] == [
        2.0 ** 10, 2.0 ** 10, 2.0 ** 11, 2.0 ** 11, 2.0 ** 10, 2.0 ** 10, 2.0 ** 11]


def _soak_skips(manager, config):
    """The soak's model and injection plan (tests/soak.py) under ``manager``:
    per step, injected, finite and the scale used."""
    graph = tf.Graph()
    with graph.as_default():
        model = soak.build_model(config.batch, config.seed + 1)
        scaler = nl.MultiOptimizerLossScale(manager(), backend="is_finite")
        scaler.add(model.d_loss, tf.train.AdamOptimizer(1e-3, beta1=0.5),
                   var_list=model.d_vars, name="discriminator")
        scaler.add(model.g_loss, tf.train.AdamOptimizer(1e-3, beta1=0.5),
                   var_list=model.g_vars, name="generator")
        train = scaler.build(global_step=tf.train.get_or_create_global_step())
        with tf.Session(graph=graph) as sess:
            sess.run(tf.global_variables_initializer())
            step = sess.make_callable([train.update_op, train.is_finite, train.loss_scale],
                                      feed_list=[model.real, model.z, model.poison_d,
                                                 model.poison_g])
            codes, _ = soak.injection_plan(config)
            rng = np.random.RandomState(config.seed + 2)
            finite = np.zeros(config.steps, bool)
            scale = np.zeros(config.steps, np.float32)
            for k in range(config.steps):
                real, z = soak.sample_batches(rng, config.batch)
                _, finite[k], scale[k] = step(*soak.poisoned_feed(model, codes[k], real, z))
    return codes > 0, finite, scale


def test_no_more_skips_than_the_dynamic_manager_in_the_soak():
    config = soak.default_config(700, seed=7, bursts=(300,))
    rule = dict(initial_scale=config.initial_scale, growth_steps=config.growth_steps,
                multiplier=config.multiplier, min_loss_scale=config.min_loss_scale,
                max_loss_scale=config.max_loss_scale)
    injected, dynamic_finite, dynamic_scale = _soak_skips(
        lambda: nl.DynamicLossScaleManager(**rule), config)
    _, listening_finite, listening_scale = _soak_skips(
        lambda: nl.ListeningLossScaleManager(**rule), config)
    # Every injected overflow is skipped by both.
    assert not dynamic_finite[injected].any() and not listening_finite[injected].any()
    # The dynamic manager also skips its probes of 2**16 (inf in float16, for
    # these float16 losses); the listening one never makes them.
    dynamic_own = ~dynamic_finite & ~injected
    assert dynamic_own.sum() > 5 and (dynamic_scale[dynamic_own] == 2.0 ** 16).all()
    assert listening_finite[~injected].all()
    assert (~listening_finite).sum() < (~dynamic_finite).sum()
    assert listening_scale.max() == 2.0 ** 15


class _Recorder(nl.LossScaleManager):
    """A manager written here against the protocol alone: a constant scale
    that records the flushed share it hears, every run."""

    def __init__(self, scale):
        self.scale = tf.Variable(scale, trainable=False, name="recorder_scale")
        self.heard = tf.Variable(-1.0, trainable=False, name="recorder_heard")

    def get_loss_scale(self):
        return self.scale.read_value()

    def update_loss_scale(self, finite_grads):
        del finite_grads
        return tf.no_op()

    def underflow_due(self):
        return tf.constant(True)

    def observe_underflow(self, measurement):
        return tf.assign(self.heard, measurement.flushed_share)


def test_any_manager_with_both_hooks_hears_its_groups():
    assert manager_base.listens_to_underflow(nl.ListeningLossScaleManager.__new__(
        nl.ListeningLossScaleManager))
    assert not manager_base.listens_to_underflow(nl.LossScaleManager())
    for scale, share in ((1.0, 1.0), (2.0 ** 15, 0.0)):
        with tf.Graph().as_default():
            manager = _Recorder(scale)
            train = _seed_step(manager)
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                sess.run(train.update_op)
                assert sess.run(manager.heard) == share


def test_observe_underflow_must_return_an_op():
    class Broken(_Recorder):
        def observe_underflow(self, measurement):
            return 3

    with tf.Graph().as_default():
        with pytest.raises(TypeError, match="observe_underflow.* returned 3, not an op"):
            _seed_step(Broken(1.0))


def test_per_group_ops_listen_too():
    with tf.Graph().as_default():
        manager = nl.ListeningLossScaleManager(initial_scale=1, measure_every_n_steps=2)
        loss16, w16 = _conv3d_net(tf.float16)
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(loss16, tf.train.GradientDescentOptimizer(0.0), var_list=w16, name="net")
        train = scaler.build(per_group_ops=True)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(train.per_group["net"])
            assert sess.run(manager.loss_scale) == 2.0 ** 13
            with pytest.raises(tf.errors.InvalidArgumentError, match="two step ops"):
                sess.run([train.update_op, train.per_group["net"]])


@pytest.mark.parametrize("argument, value, error, fragment", [
    ("measure_every_n_steps", 0, ValueError, "measure_every_n_steps"),
    ("measure_every_n_steps", 2.5, TypeError, "measure_every_n_steps"),
    ("raise_above_underflow_share", 0.0, ValueError, "raise_above_underflow_share"),
    ("raise_above_underflow_share", 1.5, ValueError, "raise_above_underflow_share"),
    ("raise_above_underflow_share", "1%", TypeError, "raise_above_underflow_share"),
    ("headroom_margin_bits", -1, ValueError, "headroom_margin_bits"),
    ("headroom_margin_bits", float("nan"), ValueError, "headroom_margin_bits"),
])
def test_bad_arguments_are_refused_before_any_variable(argument, value, error, fragment):
    with tf.Graph().as_default() as graph:
        with pytest.raises(error, match=fragment):
            nl.ListeningLossScaleManager(**{argument: value})
        assert not graph.get_operations()


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_a_float32_or_bfloat16_model_is_refused_to_a_listening_manager(dtype):
    """Nothing float16 to listen to: refused before any op of the step (a
    float32 model's gradients below 2**-14 read as underflow raised the
    scale for nothing; a graph rewrite's float16 gradients, and the float32
    view that the rewrite turned float16 too, left it at 1 while nothing
    trained)."""
    with tf.Graph().as_default() as graph:
        manager = nl.ListeningLossScaleManager(initial_scale=1)
        loss, w = _float32_model(dtype)
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="g")
        ops = len(graph.get_operations())
        with pytest.raises(ValueError) as raised:
            scaler.build()
        assert len(graph.get_operations()) == ops
    for fragment in ("group 'g' computes nothing in float16", "ListeningLossScaleManager",
                     "Use a DynamicLossScaleManager instead."):
        assert fragment in str(raised.value), str(raised.value)
