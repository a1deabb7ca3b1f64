"""Seed 000: float16 gradients underflow to zero unless the loss is scaled."""

import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import fresh_process
from readme_blocks import run_example

# The loss is multiplied by this, so that every upstream gradient element
# (TINY / 2048 ~ 5e-9) lies below float16's smallest subnormal (6e-8).
TINY = 1e-5


def _conv3d_net(dtype):
    """A small 3-D conv net on a ones volume, like the seed's reproducer."""
    rng = np.random.RandomState(0)
    volume = tf.ones([1, 8, 8, 8, 1], dtype)
    weights = []
    x = volume
    for i, (cin, cout) in enumerate([(1, 4), (4, 4)]):
        w = tf.get_variable("conv%d" % i, initializer=rng.normal(
            0, 0.3, [3, 3, 3, cin, cout]).astype(np.float32))
        weights.append(w)
        x = tf.nn.relu(tf.nn.conv3d(x, tf.cast(w, dtype), [1, 1, 1, 1, 1], "SAME"))
    loss = tf.reduce_mean(x) * tf.cast(TINY, dtype)
    return loss, weights


def test_float16_gradients_underflow_without_scaling_and_match_float32_with_it():
    with tf.Graph().as_default():
        loss16, w16 = _conv3d_net(tf.float16)
        raw16 = tf.gradients(loss16, w16)
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")
        scaler.add(loss16, tf.train.GradientDescentOptimizer(0.0), var_list=w16, name="net")
        train = scaler.build()
        scaled16 = [g for g, _ in train.grads_and_vars["net"]]
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            raw, scaled, finite = sess.run([raw16, scaled16, train.is_finite])
    with tf.Graph().as_default():
        loss32, w32 = _conv3d_net(tf.float32)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            ref = sess.run(tf.gradients(loss32, w32))

    assert finite
    for g in raw:
        assert not np.any(g), "unscaled float16 gradients should underflow to exactly zero"
    for g, r in zip(scaled, ref):
        assert np.abs(r).max() > 1e-9  # the float32 reference is not zero
        np.testing.assert_allclose(g, r, rtol=2e-2, atol=1e-3 * np.abs(r).max())


# -- the underflow measurement (issue 26, item 4) ----------------------------

FLOAT16_MAX = 65504.0


def _seed_net_measured(scale):
    """The float16 seed net at a fixed scale, measured; and, in the same
    graph, its float16 gradients at that scale computed by hand."""
    loss16, w16 = _conv3d_net(tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(scale), backend="is_finite")
    scaler.add(loss16, tf.train.GradientDescentOptimizer(0.0), var_list=w16, name="net")
    train = scaler.build(measure_underflow=True)
    by_hand = tf.gradients(tf.cast(loss16, tf.float32) * scale, w16)
    return train, by_hand


def _float32_reference():
    """The seed net's gradients built in float32 (its own graph)."""
    with tf.Graph().as_default():
        loss32, w32 = _conv3d_net(tf.float32)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            return sess.run(tf.gradients(loss32, w32))


def test_measurement_on_the_seed_net_flushes_all_at_scale_1_and_none_at_2_15():
    ref = np.concatenate([g.ravel() for g in _float32_reference()])
    true_zero_share = np.float32(np.sum(ref == 0)) / ref.size
    assert 0.0 < true_zero_share < 0.5  # dead ReLU units: zero in float32 too
    measured = {}
    for scale in (1.0, 2.0 ** 15):
        with tf.Graph().as_default():
            train, by_hand = _seed_net_measured(scale)
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                underflow, raw = sess.run([train.underflow, by_hand])
        measured[scale] = underflow["net"], np.concatenate([g.ravel() for g in raw])

    at_1, raw_1 = measured[1.0]
    assert at_1.elements == ref.size == raw_1.size == 27 * 1 * 4 + 27 * 4 * 4
    assert not np.any(raw_1)  # the seed's report: every float16 gradient is 0
    assert at_1.flushed_share >= 0.99
    assert at_1.flushed == np.sum(ref != 0) and at_1.flushed_share == 1.0
    assert at_1.zero_share == 1.0
    np.testing.assert_allclose(at_1.float32_zero_share, true_zero_share, rtol=1e-6)
    assert at_1.subnormal_share == 0.0
    # A float16 loss: the backprop starts from the scale, 1 here; nothing
    # else of it is larger.
    assert at_1.max_abs == 1.0
    np.testing.assert_allclose(at_1.headroom, np.log2(FLOAT16_MAX), rtol=1e-6)

    at_15, raw_15 = measured[2.0 ** 15]
    # At Keras' default scale nothing is flushed: the zeros are exactly
    # float32's true zeros.
    assert at_15.flushed == 0 and at_15.flushed_share == 0.0
    assert at_15.zeros == at_15.float32_zeros == np.sum(ref == 0)
    np.testing.assert_allclose(at_15.zero_share, true_zero_share, rtol=1e-6)
    assert np.array_equal(raw_15 == 0, ref == 0)
    magnitude = np.abs(raw_15)
    assert at_15.subnormal == np.sum((magnitude > 0) & (magnitude < 2.0 ** -14)) > 0
    # Subnormal: of the elements float32 keeps non-zero.
    np.testing.assert_allclose(at_15.subnormal_share, at_15.subnormal / np.sum(ref != 0),
                               rtol=1e-6)
    assert at_15.max_abs == 2.0 ** 15  # the float16 loss's own gradient
    np.testing.assert_allclose(at_15.headroom, np.log2(FLOAT16_MAX / 2.0 ** 15), rtol=1e-6)
    np.testing.assert_allclose(at_15.float32_max_abs, 1.0)  # d loss / d loss
    assert at_15.scale == 2.0 ** 15
    # The prediction from the float32 view's binary exponents, by hand: an
    # element in [2**e, 2**(e + 1)) is below 2**-14 at scale 2**(15 + k)
    # when e + 1 + 15 + k <= -14.
    exponents = np.floor(np.log2(np.abs(ref[ref != 0])))
    for k in (0, 1, 2, 5):
        np.testing.assert_allclose(at_15.underflow_by_raise[k],
                                   np.mean(exponents + 16 + k <= -14), rtol=1e-6)
    np.testing.assert_allclose(at_15.underflow_by_raise[0],
                               at_15.flushed_share + at_15.subnormal_share, rtol=1e-6)
    np.testing.assert_allclose(at_1.underflow_by_raise[15:], at_15.underflow_by_raise[:50])


def _two_weight_net():
    """loss = sum(cast(w * x)) with w float32 [2] cast to float16 and x = [3,
    0.5]: d loss / d w = x, and d loss / d (w * x) = 1."""
    w = tf.get_variable("w", initializer=np.array([1.0, 1.0], np.float32))
    x = tf.constant([3.0, 0.5], tf.float16)
    return tf.reduce_sum(tf.cast(tf.cast(w, tf.float16) * x, tf.float32)), w


@pytest.mark.parametrize("scale, max_abs, headroom", [
    (1024.0, 3072.0, np.log2(FLOAT16_MAX / 3072.0)),  # the gradient 3 * 1024
    (2.0 ** 15, np.inf, -np.inf),  # 3 * 2**15 overflows float16
])
def test_headroom_of_a_float32_loss_by_hand(scale, max_abs, headroom):
    with tf.Graph().as_default():
        loss, w = _two_weight_net()
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(scale), backend="is_finite")
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="g")
        train = scaler.build(measure_underflow=True)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            finite, measured = sess.run([train.is_finite, train.underflow["g"]])
    assert finite == np.isfinite(max_abs)
    assert measured.max_abs == max_abs and measured.elements == 2
    np.testing.assert_allclose(measured.headroom, headroom, rtol=1e-6)
    np.testing.assert_allclose(measured.float32_max_abs, 3.0)
    assert measured.flushed_share == 0.0 and measured.float32_zero_share == 0.0


def _executed(sess, fetches, feed=None):
    """The names of the nodes a run executed."""
    options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
    metadata = tf.RunMetadata()
    sess.run(fetches, feed, options=options, run_metadata=metadata)
    return [node.node_name for device in metadata.step_stats.dev_stats
            for node in device.node_stats]


def test_measurement_runs_only_when_fetched_and_changes_no_step():
    weights = {}
    for measure in (False, True):
        with tf.Graph().as_default():
            loss16, w16 = _conv3d_net(tf.float16)
            scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(),
                                                backend="is_finite")
            scaler.add(loss16 * tf.cast(1e4, tf.float16), tf.train.AdamOptimizer(1e-2),
                       var_list=w16, name="net")
            train = scaler.build(measure_underflow=measure)
            assert bool(train.underflow) == measure
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                for step in range(4):
                    ran = _executed(sess, train.update_op)
                    assert not [name for name in ran if "float32_view" in name]
                    if measure:  # fetched with the step: the same run's gradients
                        ran = _executed(sess, [train.update_op, train.underflow])
                        assert [name for name in ran if "float32_view" in name]
                weights[measure] = sess.run(w16)
    for plain, measured in zip(weights[False], weights[True]):
        assert np.array_equal(plain, measured)


def test_indexed_slices_count_their_rows():
    with tf.Graph().as_default():
        table = tf.get_variable("table", initializer=np.arange(12, dtype=np.float32)
                                .reshape(6, 2) / 12.0)
        rows = tf.cast(tf.gather(table, [1, 4, 4]), tf.float16)
        loss = tf.reduce_sum(rows * tf.constant(1e-3, tf.float16))
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[table], name="e")
        train = scaler.build(measure_underflow=True)
        assert isinstance(train.grads_and_vars["e"][0][0], tf.IndexedSlices)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            measured = sess.run(train.underflow["e"])
    # Three gathered rows of two: 1e-3 is a float16 normal number, kept.
    assert measured.elements == 6 and measured.zeros == 0 and measured.flushed == 0
    # d loss / d loss: the largest gradient of a float16 tensor that depends
    # on the table (the constant 1e-3 does not; its gradient, 3.25, is not
    # part of the float16 backprop).
    np.testing.assert_allclose(measured.float32_max_abs, 1.0)


def test_summaries_of_the_measurement_are_fetched_on_demand():
    with tf.Graph().as_default():
        train, _ = _seed_net_measured(1.0)
        scalars = nl.underflow_summaries(train.underflow, family="uf")
        assert not tf.get_collection(tf.GraphKeys.SUMMARIES)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            summary = tf.Summary()
            summary.ParseFromString(sess.run(tf.summary.merge(scalars)))
    values = dict((value.tag, value.simple_value) for value in summary.value)
    assert sorted(values) == ["uf/net/float32_zero_share", "uf/net/flushed_share",
                              "uf/net/headroom", "uf/net/subnormal_share"]
    assert values["uf/net/flushed_share"] == 1.0
    with pytest.raises(ValueError, match="measure_underflow=True"):
        nl.underflow_summaries({})
    with pytest.raises(TypeError, match="train.underflow"):
        nl.underflow_summaries([1.0])


def test_no_float32_view_is_refused_before_any_op():
    with tf.Graph().as_default() as graph:
        w = tf.get_variable("w16", initializer=np.ones([2], np.float16))
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
        scaler.add(tf.reduce_sum(w * w), tf.train.GradientDescentOptimizer(0.1), var_list=[w])
        ops = len(graph.get_operations())
        with pytest.raises(ValueError, match="variable 'w16:0' is float16"):
            scaler.build(measure_underflow=True)
        assert len(graph.get_operations()) == ops
    with tf.Graph().as_default() as graph:
        w = tf.get_variable("w", initializer=np.ones([2], np.float32))
        doubled = tf.while_loop(lambda i, x: i < 2, lambda i, x: (i + 1, x * 2.0),
                                [0, tf.cast(w, tf.float16)])[1]
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
        scaler.add(tf.reduce_sum(doubled), tf.train.GradientDescentOptimizer(0.1),
                   var_list=[w])
        ops = len(graph.get_operations())
        with pytest.raises(ValueError, match="cannot copy op .*control flow"):
            scaler.build(measure_underflow=True)
        assert len(graph.get_operations()) == ops
        with pytest.raises(TypeError, match="measure_underflow"):
            scaler.build(measure_underflow=1)


#: 1 + 2**-10, exact in float16 (11 significant bits); its square, 1 + 2**-9
#: + 2**-20, is exact in float32 and rounds to 1 + 2**-9 in float16.
_ROUNDED = 1.0 + 2.0 ** -10


def test_subnormal_share_leaves_out_what_float32_holds_at_zero():
    """loss = sum(cast(w16 * r16 * r16)) - w[0] * r**2 (float32), r = 1 +
    2**-10: d loss / d w[0] is r**2 - r**2 = 0 exactly in float32, and
    (1 + 2**-9) - r**2 = -2**-20 on the float16 side, where the product
    rounds: a residue below 2**-14 where float32 holds 0, which is no
    underflow (it counted as subnormal before). d loss / d w[1] = 1 + 2**-9:
    normal, kept."""
    with tf.Graph().as_default():
        w = tf.get_variable("w", initializer=np.ones([2], np.float32))
        r16 = tf.constant(_ROUNDED, tf.float16)
        product = tf.cast(tf.cast(w, tf.float16) * r16 * r16, tf.float32)
        exact = np.float32(_ROUNDED) * np.float32(_ROUNDED)
        assert exact == 1.0 + 2.0 ** -9 + 2.0 ** -20
        loss = tf.reduce_sum(product) - tf.reduce_sum(w * tf.constant([exact, 0.0]))
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="g")
        train = scaler.build(measure_underflow=True)
        (grad, _), = train.grads_and_vars["g"]
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            measured, unscaled = sess.run([train.underflow["g"], grad])
    np.testing.assert_array_equal(unscaled, [-2.0 ** -20, 1.0 + 2.0 ** -9])
    assert (measured.elements, measured.float32_zeros, measured.zeros) == (2, 1, 0)
    assert measured.subnormal == 0 and measured.subnormal_share == 0.0
    assert measured.flushed == 0 and measured.flushed_share == 0.0


def _float32_model(dtype):
    """A float32 master weight used in ``dtype`` (float32: no cast)."""
    w = tf.get_variable("w", initializer=np.ones([2, 2], np.float32))
    x = tf.constant(np.full([3, 2], 0.5, np.float32))
    return tf.reduce_mean(tf.cast(tf.matmul(tf.cast(x, dtype), tf.cast(w, dtype)),
                                  tf.float32)), w


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_a_float32_or_bfloat16_model_is_refused_before_any_op(dtype):
    """Nothing of it is float16, so there is nothing to measure (before:
    every gradient element below 2**-14 was reported subnormal)."""
    with tf.Graph().as_default() as graph:
        loss, w = _float32_model(dtype)
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="g")
        ops = len(graph.get_operations())
        with pytest.raises(ValueError) as raised:
            scaler.build(measure_underflow=True)
        assert len(graph.get_operations()) == ops
    for fragment in ("group 'g' computes nothing in float16", "float32 or bfloat16 model",
                     "measure_underflow=True", "Build with measure_underflow=False."):
        assert fragment in str(raised.value), str(raised.value)


@pytest.fixture(params=["inf_nan", "saturation"])
def overflow_mode(request, npu_shim):
    """Each of the device's overflow modes, set the real way
    (tf_adapter npu_bridge/estimator/npu/npu_plugin.py set_device_sat_mode)."""
    from npu_bridge.estimator.npu import npu_plugin
    npu_plugin.set_device_sat_mode(1 if request.param == "inf_nan" else 0)
    return request.param


@pytest.mark.parametrize("scale", [1024.0, 2.0 ** 15])
def test_measurement_on_the_npu_backend(overflow_mode, scale):
    """In INF/NaN mode an overflowing float16 value is inf (npu_bridge then
    checks with is_finite); in saturation mode it is 65504 and sets the
    float-status register (the shim emulates both): the measurement reads
    65504 there, and the float32 view still shows how far beyond it went."""
    with tf.Graph().as_default():
        loss, w = _two_weight_net()
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(scale), backend="npu")
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="g")
        train = scaler.build(measure_underflow=True)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            _, finite, measured = sess.run([train.update_op, train.is_finite,
                                            train.underflow["g"]])
    np.testing.assert_allclose(measured.float32_max_abs, 3.0)
    if scale == 1024.0:  # 3 * 1024 fits float16
        assert finite and measured.max_abs == 3072.0
        np.testing.assert_allclose(measured.headroom, np.log2(FLOAT16_MAX / 3072.0),
                                   rtol=1e-6)
    elif overflow_mode == "inf_nan":
        assert not finite and measured.max_abs == np.inf and measured.headroom == -np.inf
    else:  # saturated: 65504 read, 3 * 2**15 = 98304 by the float32 view
        assert not finite and measured.max_abs == FLOAT16_MAX
        np.testing.assert_allclose(measured.headroom, np.log2(FLOAT16_MAX / 98304.0),
                                   rtol=1e-6)


# -- the docs' example ------------------------------------------------------

_EXAMPLE_LINE = re.compile(r"(\w+) step (\d+): scale (\S+), flushed (\d+) %, subnormal (\d+) %, "
                           r"headroom (\S+) bits")


@fresh_process
def test_the_readme_underflow_example_runs_and_prints_what_it_shows(tmp_path):
    """docs/diagnosis.md, "Is the scale too low?": the script runs as
    written and prints the lines shown (the scales exactly, the percentages
    to 1 point); from scale 1 every gradient element underflows, the dynamic
    manager stays there, and the listening manager's raise leaves at most
    1 % underflowed and keeps its 2-bit margin below 65504."""
    stdout, shown = run_example("underflow-example", tmp_path)
    assert shown, "the docs lost their underflow-example-output block"
    printed = [_EXAMPLE_LINE.match(line).groups() for line in stdout.splitlines()]
    expected = [_EXAMPLE_LINE.match(line).groups() for line in shown.splitlines()]
    assert [row[:3] for row in printed] == [row[:3] for row in expected]
    for row, want in zip(printed, expected):
        assert abs(int(row[3]) - int(want[3])) <= 1 and abs(int(row[4]) - int(want[4])) <= 1
        np.testing.assert_allclose(float(row[5]), float(want[5]), atol=0.2)
    rows = dict(((name, int(step)), (float(scale), int(flushed) + int(subnormal),
                                     float(headroom)))
                for name, step, scale, flushed, subnormal, headroom in printed)
    for name in ("DynamicLossScaleManager", "ListeningLossScaleManager"):
        assert rows[(name, 0)][0] == 1.0 and rows[(name, 0)][1] >= 99  # shares rounded
    assert rows[("DynamicLossScaleManager", 200)][0] == 1.0
    scale, underflowed, headroom = rows[("ListeningLossScaleManager", 100)]
    assert scale > 1.0 and underflowed <= 1 and headroom >= 2.0
