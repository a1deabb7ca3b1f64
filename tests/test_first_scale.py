"""A measured first loss scale (underflow/first_scale.py):
``build(measure_first_scale=True, first_scale_margin=m)``.

The reference is computed here, independently of the library's float32
view: a float32 twin of a float16 model written by hand, differentiated
with ``tf.gradients`` with respect to every tensor the model computes in
float16 downstream of the group's variables (listed by hand) and the
variables themselves; its largest magnitude ``amax`` gives the largest
power of two ``s`` with ``s * amax <= 65504 / 2**m``, found in numpy.
"""

import collections
import functools
import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import fresh_process, raises_with
from models import add_gan_groups, two_group_gan
from readme_blocks import run_example

FLOAT16_MAX = 65504.0
BATCH, DIM, HIDDEN = 8, 3, 5
_RNG = np.random.RandomState(17)
INIT = collections.OrderedDict([
    ("w1", _RNG.normal(0, 1.0, [DIM, HIDDEN])),
    ("b1", _RNG.normal(0, 0.5, [HIDDEN])),
    ("w2", _RNG.normal(0, 4.0, [HIDDEN, 1])),
])
X = _RNG.normal(0, 2.0, [BATCH, DIM]).astype(np.float32)
Y = _RNG.normal(3.0, 1.0, [BATCH, 1]).astype(np.float32)
#: Two groups over the model's two losses (a: w2 on the squared error, b:
#: w1 and b1 on a softplus of the same output).
GROUPS = collections.OrderedDict([("a", ["w2"]), ("b", ["w1", "b1"])])

Model = collections.namedtuple("Model", ["x", "losses", "variables", "tracked"])


def _variables(dtype=tf.float32):
    return collections.OrderedDict(
        (name, tf.get_variable(name, initializer=value.astype(dtype.as_numpy_dtype)))
        for name, value in INIT.items())


def hand_model(dtype, gain=1.0, variables=None):
    """A tanh layer and a linear output, computed in ``dtype``, with two
    float32 losses: "a", ``gain`` times the summed squared error, and "b",
    ``gain`` times a mean softplus.

    Returns a ``Model`` whose ``tracked`` lists each tensor computed in
    ``dtype`` with the variables it depends on (by hand).
    """
    variables = variables or _variables()
    x = tf.placeholder(tf.float32, [BATCH, DIM], name="x")
    tracked = []

    def track(tensor, *names):
        tracked.append((tensor, set(names)))
        return tensor

    cast = dict((name, track(tf.cast(var, dtype), name)) for name, var in variables.items())
    everything = list(variables)
    pre = track(tf.matmul(tf.cast(x, dtype), cast["w1"]), "w1")
    hidden = track(tf.tanh(track(pre + cast["b1"], "w1", "b1")), "w1", "b1")
    out = track(tf.matmul(hidden, cast["w2"]), *everything)
    error = track(out - tf.constant(Y, dtype), *everything)
    summed = track(tf.reduce_sum(track(tf.square(error), *everything)), *everything)
    soft = track(tf.reduce_mean(track(tf.nn.softplus(track(-out, *everything)), *everything)),
                 *everything)
    losses = {"a": tf.cast(summed, tf.float32) * gain, "b": tf.cast(soft, tf.float32) * gain}
    return Model(x, losses, variables, tracked)


def reference_amax(groups, gain=1.0):
    """The largest |gradient| of the float32 twin over the groups' variables
    and the tensors their float16 backprop holds (downstream of them), on
    the batch X. ``groups``: a dict from loss name to variable names."""
    return _reference_amax(tuple((name, tuple(names)) for name, names in groups.items()), gain)


@functools.lru_cache(maxsize=None)
def _reference_amax(groups, gain):
    with tf.Graph().as_default():
        model = hand_model(tf.float32, gain)
        maxima = []
        for name, var_names in groups:
            held = [tensor for tensor, depends in model.tracked if depends & set(var_names)]
            targets = [model.variables[v] for v in var_names] + held
            grads = [g for g in tf.gradients(model.losses[name], targets) if g is not None]
            maxima += [tf.reduce_max(tf.abs(g)) for g in grads]
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            return float(np.max(sess.run(maxima, {model.x: X})))


def largest_power_of_two(amax, margin, low=2.0 ** -126, high=2.0 ** 126):
    """The largest power of two s with s * amax <= 65504 / 2**margin, within
    [low, high] (a manager's bounds): exact comparisons in float64."""
    limit = FLOAT16_MAX / 2.0 ** margin
    scale = 2.0 ** np.floor(np.log2(limit / amax))
    while scale * amax > limit:
        scale /= 2.0
    while 2.0 * scale * amax <= limit:
        scale *= 2.0
    return float(np.clip(scale, low, high))


def _build(model, manager, groups=GROUPS, learning_rate=0.01, global_step=True,
           **build_args):
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    for name, var_names in groups.items():
        scaler.add(model.losses[name], tf.train.GradientDescentOptimizer(learning_rate),
                   var_list=[model.variables[v] for v in var_names], name=name)
    return scaler.build(global_step=tf.train.get_or_create_global_step() if global_step
                        else None, **build_args)


def _first_run(train, feed):
    """The first run's scale (the one its step used) and its decision."""
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        _, scale, finite = sess.run([train.update_op, train.loss_scale, train.is_finite], feed)
    return float(scale), bool(finite)


# -- the measured scale against the reference --

@pytest.mark.parametrize("gain", [1e-4, 1.0, 300.0])
def test_the_first_scale_is_the_largest_power_of_two_under_the_limit(graph, gain):
    """Two groups on one manager, margins 0, 1 and 3 (a builder each, which
    applies nothing): the first run's scale is the reference's, exactly, and
    that float16 step at that scale on the same batch is finite."""
    model = hand_model(tf.float16, gain)
    trains = {}
    for margin in (0, 1, 3):
        with tf.name_scope("margin%d" % margin):
            manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 20,
                                                 min_loss_scale=2.0 ** -20)
            trains[margin] = _build(model, manager, learning_rate=0.0, global_step=None,
                                    measure_first_scale=True, first_scale_margin=margin)
    amax = reference_amax(GROUPS, gain)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for margin, train in trains.items():
            got = sess.run([train.update_op, train.loss_scale, train.is_finite], {model.x: X})
            assert got[1:] == [largest_power_of_two(amax, margin), True], margin


def test_each_group_measures_only_what_its_backprop_holds(graph):
    """Loss a over w2 alone: its backprop holds only the tensors downstream
    of w2, whose gradients are smaller than those upstream (w2 is large)."""
    model = hand_model(tf.float16, 1.0)
    only_a = collections.OrderedDict([("a", ["w2"])])
    train = _build(model, nl.DynamicLossScaleManager(), groups=only_a,
                   measure_first_scale=True, first_scale_margin=0)
    want = largest_power_of_two(reference_amax(only_a), 0)
    assert want > largest_power_of_two(reference_amax({"a": ["w1", "b1", "w2"]}), 0)
    assert _first_run(train, {model.x: X}) == (want, True)


def _exact_power_model(gain=1.0):
    """loss = gain * sum(w * c), in float16 but for the gain, with
    c = 2047/1024 (exact in float16): with a gain of 1 the largest gradient
    is c, and 65504 / c = 2**15 exactly."""
    w = tf.get_variable("w", initializer=np.ones([4], np.float32))
    c = tf.constant(np.full([4], 2047.0 / 1024.0, np.float16))
    return tf.cast(tf.reduce_sum(tf.cast(w, tf.float16) * c), tf.float32) * gain, w


@pytest.mark.parametrize("margin", [0, 1, 2, 3])
def test_an_exact_power_of_two_limit_is_reached(graph, margin):
    """Where s * amax equals 65504 / 2**margin exactly, s is taken (the
    logarithm alone rounds it down on some margins): the float16 gradient
    is then 65504 / 2**margin, finite."""
    loss, w = _exact_power_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(2.0 ** 30),
                                        backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.0), var_list=[w])
    train = scaler.build(measure_first_scale=True, first_scale_margin=margin)
    assert _first_run(train, {}) == (2.0 ** (15 - margin), True)


@pytest.mark.parametrize("initial, bounds, want", [
    (2.0 ** 4, dict(max_loss_scale=2.0 ** 6), 2.0 ** 6),
    (2.0 ** 20, dict(min_loss_scale=2.0 ** 18), 2.0 ** 18),
])
def test_the_managers_bounds_clip_it(graph, initial, bounds, want):
    model = hand_model(tf.float16, 1.0)
    assert 2.0 ** 6 < largest_power_of_two(reference_amax(GROUPS), 1) < 2.0 ** 18
    manager = nl.ExponentialUpdateLossScaleManager(initial, 1000, **bounds)
    train = _build(model, manager, measure_first_scale=True)
    assert _first_run(train, {model.x: X})[0] == want


@pytest.mark.parametrize("gain", [0.0, np.inf, np.nan])
def test_a_zero_or_non_finite_measurement_keeps_the_scale(graph, gain):
    """The exact model's loss times 0 (every gradient 0), inf (the float32
    view's gradients inf) or nan: the scale stays where the manager started
    it."""
    loss, w = _exact_power_model(gain)
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(initial_scale=2.0 ** 9),
                                        backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.0), var_list=[w])
    train = scaler.build(measure_first_scale=True)
    assert _first_run(train, {})[0] == 2.0 ** 9


# -- start-up --

def _skips(measure, runs=20):
    with tf.Graph().as_default():
        model = two_group_gan(compute_dtype=tf.float16)
        scaler = nl.MultiOptimizerLossScale(nl.ExponentialUpdateLossScaleManager(2 ** 32, 1000),
                                            backend="is_finite")
        train = add_gan_groups(scaler, model).build(
            global_step=tf.train.get_or_create_global_step(), measure_first_scale=measure)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            return sum(not sess.run([train.update_op, train.is_finite], model.feed)[1]
                       for _ in range(runs))


def test_a_modelzoo_start_at_2_to_the_32_skips_no_step():
    """ExponentialUpdateLossScaleManager(2**32, 1000), as ModelZoo scripts
    start, on a float16 GAN: no skip in 20 runs with the measured scale;
    without it, every run skips while the scale backs off."""
    assert _skips(True) == 0
    assert _skips(False) == 20


def test_towers_are_measured_each_as_its_float16_backprop_runs(graph):
    """Two towers on two CPU devices, tower 0's gradients zero: each tower's
    backprop holds its own gradient c, not the towers' mean c / 2, so the
    scale is 2**(15 - margin) and the measured step is finite."""
    config = tf.ConfigProto(device_count={"CPU": 2})
    x = tf.placeholder(tf.float32, [2, 4])
    w = tf.get_variable("w", initializer=np.ones([4], np.float32))
    losses = []
    for index in range(2):
        with tf.device("/cpu:%d" % index):
            losses.append(tf.cast(tf.reduce_sum(tf.cast(w, tf.float16)
                                                * tf.cast(x[index], tf.float16)), tf.float32))
    scalers = [nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(2.0 ** 30),
                                          backend="is_finite") for _ in range(2)]
    trains = []
    for margin, scaler in enumerate(scalers):
        with tf.name_scope("margin%d" % margin):
            scaler.add(losses, tf.train.GradientDescentOptimizer(0.0), var_list=[w])
            trains.append(scaler.build(measure_first_scale=True, first_scale_margin=margin))
    feed = {x: np.array([[0.0] * 4, [2047.0 / 1024.0] * 4], np.float32)}
    with tf.Session(config=config) as sess:
        sess.run(tf.global_variables_initializer())
        for margin, train in enumerate(trains):
            got = sess.run([train.update_op, train.loss_scale, train.is_finite], feed)[1:]
            assert got == [2.0 ** (15 - margin), True]


def test_later_runs_compute_nothing_of_the_measurement(graph):
    """After the first run only the flags are read: in the step stats of a
    later run (grappler on, as by default) no op of the float32 view runs,
    but a v1 cond's switches of what it captures."""
    model = hand_model(tf.float16)
    train = _build(model, nl.DynamicLossScaleManager(), measure_first_scale=True)
    metadata = tf.RunMetadata()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(2):
            sess.run(train.update_op, {model.x: X})
        sess.run(train.update_op, {model.x: X},
                 options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
                 run_metadata=metadata)
    ran = [node.node_name for stats in metadata.step_stats.dev_stats
           for node in stats.node_stats]
    assert any("first_scale" in name for name in ran)  # the flags were read
    assert [name for name in ran if "float32_view" in name
            and not re.search(r"/Switch(_\d+)?$", name)] == []


# -- once per manager, saved with checkpoints --

def test_the_measured_flag_is_saved_and_a_restored_run_keeps_its_scale(tmp_path):
    """A checkpoint written after the measurement restores the flag: the
    restored run starts at the saved scale (here set to 2**5 after the
    measurement) and does not measure again; a fresh start measures."""
    def build():
        model = hand_model(tf.float16)
        manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 20)
        return model, manager, _build(model, manager, measure_first_scale=True)

    measured = largest_power_of_two(reference_amax(GROUPS), 1)
    path = str(tmp_path / "model.ckpt")
    with tf.Graph().as_default():
        model, manager, train = build()
        flags = [v.op.name for v in tf.global_variables() if "first_scale_measured" in v.op.name]
        assert flags == ["first_scale_measured"]
        set_scale = manager.assign_loss_scale(tf.constant(2.0 ** 5))
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            assert sess.run([train.update_op, train.loss_scale], {model.x: X})[1] == measured
            sess.run(set_scale)
            tf.train.Saver().save(sess, path)
    with tf.Graph().as_default():
        model, manager, train = build()
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, path)
            assert sess.run([train.update_op, train.loss_scale], {model.x: X})[1] == 2.0 ** 5
            sess.run(tf.global_variables_initializer())
            assert sess.run([train.update_op, train.loss_scale], {model.x: X})[1] == measured


def test_with_per_group_ops_each_groups_first_run_measures_it(graph):
    """per_group["b"] runs first and sets the scale from b's backprop (all
    that its run computes); per_group["a"]'s first run measures a and only
    lowers the scale, so neither skips; update_op then measures nothing. In
    a fresh session update_op runs first and measures both."""
    model = hand_model(tf.float16)
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 20)
    train = _build(model, manager, measure_first_scale=True, per_group_ops=True)
    only_b = largest_power_of_two(reference_amax(collections.OrderedDict([("b", GROUPS["b"])])), 1)
    both = largest_power_of_two(reference_amax(GROUPS), 1)
    assert only_b > both
    feed = {model.x: X}
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.per_group["b"], feed)
        assert sess.run(manager.loss_scale) == only_b
        sess.run(train.per_group["a"], feed)
        assert sess.run([manager.loss_scale, train.skipped_steps]) == [both, 0]
        assert sess.run([train.update_op, train.loss_scale, train.is_finite], feed)[1:] == [
            both, True]
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.loss_scale], feed)[1] == both


# -- the manager hook --

class HalvingManager(nl.managers.LossScaleManager):
    """docs/managers.md's example manager, with the optional hook."""

    keeps_scale_in_range = True

    def __init__(self):
        self.scale = tf.Variable(2.0 ** 15, trainable=False)

    def get_loss_scale(self):
        return self.scale.read_value()

    def update_loss_scale(self, finite_grads):
        scale = self.scale.read_value()
        new_scale = tf.where(finite_grads, scale, tf.maximum(scale / 2, 1.0))
        with tf.control_dependencies([new_scale]):
            return tf.assign(self.scale, new_scale).op

    def assign_loss_scale(self, scale):
        return tf.assign(self.scale, tf.where(tf.is_nan(scale), self.scale.read_value(),
                                              scale)).op


def test_a_manager_of_ones_own_takes_the_measured_scale(graph):
    model = hand_model(tf.float16)
    train = _build(model, HalvingManager(), measure_first_scale=True, first_scale_margin=2)
    assert _first_run(train, {model.x: X}) == (
        largest_power_of_two(reference_amax(GROUPS), 2), True)


def test_assign_loss_scale_clips_resets_the_counters_and_ignores_nan(graph):
    manager = nl.ExponentialUpdateLossScaleManager(2.0 ** 10, 1000, min_loss_scale=2.0,
                                                   max_loss_scale=2.0 ** 12)
    value = tf.placeholder(tf.float32, [])
    assign = manager.assign_loss_scale(value)
    bad = manager.update_loss_scale(False)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(bad)
        assert list(sess.run(manager.state)) == [2.0 ** 10, 0.0, 1.0, 1.0]
        for given, want in ((2.0 ** 8, 2.0 ** 8), (2.0 ** 20, 2.0 ** 12), (0.5, 2.0),
                            (np.inf, 2.0 ** 12)):
            sess.run(bad)
            sess.run(assign, {value: given})
            assert list(sess.run(manager.state)) == [want, 0.0, 0.0, 0.0], given
        sess.run(assign, {value: np.nan})
        assert list(sess.run(manager.state)) == [2.0 ** 12, 0.0, 0.0, 0.0]


@fresh_process
def test_the_docs_example_prints_what_the_docs_show(tmp_path):
    """docs/features.md's example, run as written."""
    stdout, shown = run_example("first-scale-example", tmp_path)
    assert shown and stdout == shown


# -- refusals --

def test_a_manager_without_the_hook_is_refused(graph):
    model = hand_model(tf.float16)
    manager = nl.FixedLossScaleManager(2.0 ** 10)
    tf.train.get_or_create_global_step()
    before = len(graph.get_operations())
    with raises_with(ValueError, "measure_first_scale=True", "FixedLossScaleManager",
                     "cannot take a measured scale", "DynamicLossScaleManager"):
        _build(model, manager, measure_first_scale=True)
    assert len(graph.get_operations()) == before  # refused before any op


def test_a_hook_that_returns_no_op_is_refused(graph):
    class ReturnsNothing(HalvingManager):
        def assign_loss_scale(self, scale):
            return None

    model = hand_model(tf.float16)
    with raises_with(TypeError, "ReturnsNothing.assign_loss_scale", "None", "not an op"):
        _build(model, ReturnsNothing(), measure_first_scale=True)


def test_float16_variables_are_refused(graph):
    model = hand_model(tf.float16, variables=_variables(tf.float16))
    with raises_with(ValueError, "'a'", "is float16", "float32"):
        _build(model, nl.DynamicLossScaleManager(), measure_first_scale=True)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_measure_first_scale_must_be_a_bool(graph, value):
    model = hand_model(tf.float16)
    with raises_with(TypeError, "measure_first_scale must be a bool", repr(value)):
        _build(model, nl.DynamicLossScaleManager(), measure_first_scale=value)


@pytest.mark.parametrize("margin, error", [(-1, ValueError), (16, ValueError),
                                           (1.0, TypeError), (True, TypeError),
                                           ("1", TypeError)])
def test_bad_margins_are_refused(graph, margin, error):
    model = hand_model(tf.float16)
    with raises_with(error, "first_scale_margin", repr(margin)):
        _build(model, nl.DynamicLossScaleManager(), measure_first_scale=True,
               first_scale_margin=margin)
