"""A backend defined here, outside the library, plugs into every entry point.

``Threshold`` is a third overflow check: it counts the gradient elements
whose magnitude exceeds a limit (a count, so flags above 1 and their sums
are exercised too). The library is not edited to know of it: the instance is
passed as ``backend=``. The numbers are worked by hand: the loss
``sum(w * x)`` has the gradient ``x``, the builder's check sees
``scale * x``, plain SGD moves ``w`` by ``-lr * x``.
"""


import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from readme_blocks import block
from npu_lossscale.backends import Backend

SCALE = 4.0
LIMIT = 100.0  # on the scaled gradient: |x| > 25 skips
LR = 0.5
W0 = [1.0, 2.0]
SMALL = [10.0, -20.0]  # scaled: 40, -80: passes
LARGE = [30.0, 1.0]  # scaled: 120: one element over the limit


class Threshold(Backend):
    """Flags a step whose (scaled) gradients hold an element above ``limit``.

    Records each call's tensors and ``after``, so the tests can see what the
    step handed over.
    """

    name = "threshold"

    def __init__(self, limit):
        self.limit = limit
        self.calls = []

    def overflow_flag(self, tensors, after=()):
        self.calls.append((list(tensors), list(after)))
        counts = []
        for tensor in tensors:
            values = tf.cast(getattr(tensor, "values", tensor), tf.float32)
            counts.append(tf.reduce_sum(tf.cast(tf.abs(values) > self.limit, tf.float32)))
        return tf.add_n(counts)


def _two_groups():
    """Two linear groups a, b: loss_g = sum(w_g * x_g), so grad(w_g) = x_g."""
    xs = {name: tf.placeholder(tf.float32, [2], name="x_" + name) for name in "ab"}
    ws = {name: tf.Variable(W0, name="w_" + name) for name in "ab"}
    losses = {name: tf.reduce_sum(ws[name] * xs[name]) for name in "ab"}
    return xs, ws, losses


def _moved(x):
    return np.array(W0) - LR * np.array(x)


def _build(skip_policy, backend, manager=None):
    xs, ws, losses = _two_groups()
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(manager or nl.FixedLossScaleManager(SCALE),
                                        backend=backend, skip_policy=skip_policy)
    for name in "ab":
        scaler.add(losses[name], tf.train.GradientDescentOptimizer(LR),
                   var_list=[ws[name]], name=name)
    assert scaler.backend == "threshold"
    return scaler.build(global_step=gs), xs, ws, losses, gs


@pytest.mark.parametrize("x_a, x_b, applied", [
    (SMALL, SMALL, True),
    (LARGE, SMALL, False),
    (SMALL, LARGE, False),
])
def test_builder_skip_policy_all(graph, x_a, x_b, applied):
    backend = Threshold(LIMIT)
    train, xs, ws, losses, gs = _build("all", backend)
    # One check for the step: every gradient element (the two small
    # gradients may come stacked), after both losses.
    [(tensors, after)] = backend.calls
    assert sum(t.shape.num_elements() for t in tensors) == 4
    assert sorted(t.name for t in after) == sorted(t.name for t in losses.values())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        _, finite = sess.run([train.update_op, train.is_finite],
                             {xs["a"]: x_a, xs["b"]: x_b})
        assert finite == applied
        for name, x in (("a", x_a), ("b", x_b)):
            expected = _moved(x) if applied else np.array(W0)
            np.testing.assert_array_equal(sess.run(ws[name]), expected)
        assert sess.run(gs) == (1 if applied else 0)


def test_builder_skip_policy_per_group(graph):
    backend = Threshold(LIMIT)
    train, xs, ws, _, gs = _build("per_group", backend)
    assert len(backend.calls) == 2  # one check per group
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        _, decisions = sess.run([train.update_op, _finite(train)],
                                {xs["a"]: LARGE, xs["b"]: SMALL})
        assert decisions == {"a": False, "b": True}
        np.testing.assert_array_equal(sess.run(ws["a"]), W0)  # skipped: unchanged
        np.testing.assert_array_equal(sess.run(ws["b"]), _moved(SMALL))
        assert sess.run(gs) == 1


def test_builder_with_dynamic_manager_matches_unscaled_twin(graph):
    """Adam over four steps, the second skipped by the check (scale 4: 120 >
    100), the scale halving there; the twin applies the same steps unscaled
    with plain Adam. Weights and slots agree; the skipped step moved nothing."""
    feeds = [SMALL, LARGE, SMALL, [5.0, 5.0]]
    manager = nl.DynamicLossScaleManager(initial_scale=SCALE, growth_steps=1000)
    xs, ws, losses = _two_groups()
    scaler = nl.MultiOptimizerLossScale(manager, backend=Threshold(LIMIT))
    opt = tf.train.AdamOptimizer(0.1)
    scaler.add(losses["a"], opt, var_list=[ws["a"]], name="a")
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        seen = []
        for x in feeds:
            before = sess.run(ws["a"])
            finite, _ = sess.run([train.is_finite, train.update_op], {xs["a"]: x})
            seen.append(bool(finite))
            if not finite:
                np.testing.assert_array_equal(sess.run(ws["a"]), before)
        assert seen == [True, False, True, True]
        assert sess.run(manager.get_loss_scale()) == SCALE / 2
        ours = sess.run([ws["a"], opt.get_slot(ws["a"], "m"), opt.get_slot(ws["a"], "v")])

    with tf.Graph().as_default():
        x = tf.placeholder(tf.float32, [2])
        w = tf.Variable(W0)
        twin = tf.train.AdamOptimizer(0.1)
        step = twin.minimize(tf.reduce_sum(w * x))
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for feed, finite in zip(feeds, seen):
                if finite:
                    sess.run(step, {x: feed})
            theirs = sess.run([w, twin.get_slot(w, "m"), twin.get_slot(w, "v")])
    for mine, reference in zip(ours, theirs):
        np.testing.assert_allclose(mine, reference, rtol=1e-6)


@pytest.mark.parametrize("x, applied", [(SMALL, True), (LARGE, False)])
def test_loss_scale_optimizer(graph, x, applied):
    """apply_gradients checks the gradients it is given: unscaled, so the
    limit is 25 here (30 skips, 20 passes)."""
    backend = Threshold(LIMIT / SCALE)
    xs, ws, losses = _two_groups()
    gs = tf.train.get_or_create_global_step()
    opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(LR),
                                nl.FixedLossScaleManager(SCALE), backend=backend)
    train = opt.minimize(losses["a"], global_step=gs, var_list=[ws["a"]])
    assert len(backend.calls) == 1
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train, {xs["a"]: x})
        np.testing.assert_array_equal(sess.run(ws["a"]), _moved(x) if applied else W0)
        assert sess.run(gs) == (1 if applied else 0)


def test_all_finite(graph):
    grads = tf.placeholder(tf.float32, [3])
    finite = nl.all_finite([grads, tf.ones([2])], backend=Threshold(LIMIT))
    with tf.Session() as sess:
        assert sess.run(finite, {grads: [1.0, -100.0, 99.0]})  # the limit itself passes
        assert not sess.run(finite, {grads: [1.0, -101.0, 0.0]})
        assert not sess.run(finite, {grads: [101.0, -101.0, 0.0]})  # flag 2


def test_default_name_is_the_class_name(graph):
    class Unnamed(Backend):
        def overflow_flag(self, tensors, after=()):
            return tf.zeros([])

    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE),
                                        backend=Unnamed())
    assert scaler.backend == "Unnamed"


def test_readme_example_plugs_in(graph):
    """The docs' "Adding a backend" class (docs/features.md), as written,
    drives the builder."""
    code = block("backend-example")
    assert code, "the docs lost their backend example"
    namespace = {}
    exec(code, namespace)  # pylint: disable=exec-used
    xs, ws, losses = _two_groups()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE),
                                        backend=namespace["AboveLimit"](LIMIT))
    scaler.add(losses["a"], tf.train.GradientDescentOptimizer(LR), var_list=[ws["a"]])
    train = scaler.build()
    assert scaler.backend == "above_limit"
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert not sess.run([train.is_finite, train.update_op], {xs["a"]: LARGE})[0]
        np.testing.assert_array_equal(sess.run(ws["a"]), W0)
        assert sess.run([train.is_finite, train.update_op], {xs["a"]: SMALL})[0]
        np.testing.assert_array_equal(sess.run(ws["a"]), _moved(SMALL))


def _finite(train):
    """Each group's decision of the run, by group name."""
    return dict((name, group.is_finite) for name, group in train.groups.items())
