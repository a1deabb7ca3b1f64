"""Training-loop features: accumulation, clipping, skip policy, per-group
managers, shared losses and count_skipped_steps."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import snapshot_globals
from models import add_gan_groups, two_group_gan

DIM = 5
RNG = np.random.RandomState(3)
BIG_X = RNG.normal(0, 1, [64, DIM]).astype(np.float32)
BIG_Y = RNG.normal(0, 1, [64, 1]).astype(np.float32)


def _regression():
    """Two groups on one mean-squared loss: w (SGD/Adam) and b (SGD)."""
    x = tf.placeholder(tf.float32, [None, DIM])
    y = tf.placeholder(tf.float32, [None, 1])
    poison = tf.placeholder_with_default(1.0, [])
    w = tf.get_variable("w", initializer=np.linspace(-1, 1, DIM).reshape(DIM, 1).astype(np.float32))
    b = tf.get_variable("b", initializer=np.array([0.3], np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y)) * poison
    return x, y, poison, w, b, loss


def _micro_feeds(x, y, n=4):
    size = 64 // n
    return [{x: BIG_X[i * size:(i + 1) * size], y: BIG_Y[i * size:(i + 1) * size]}
            for i in range(n)]


def _accumulating(make_opt, n=4, manager=None, clip_norm=None, global_step=True):
    x, y, poison, w, b, loss = _regression()
    scaler = nl.MultiOptimizerLossScale(manager or nl.FixedLossScaleManager(2.0 ** 10),
                                        backend="is_finite")
    scaler.add(loss, make_opt(), var_list=[w], name="w", clip_norm=clip_norm)
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.05), var_list=[b], name="b")
    gs = tf.train.get_or_create_global_step() if global_step else None
    train = scaler.build(global_step=gs, accumulation_steps=n)
    return train, (x, y, poison, w, b), gs


def _big_batch_reference(make_opt, clip_norm=None):
    with tf.Graph().as_default():
        x, y, _, w, b, loss = _regression()
        gw, gb = tf.gradients(loss, [w, b])
        if clip_norm is not None:
            (gw,), _ = tf.clip_by_global_norm([gw], clip_norm)
        with tf.control_dependencies([gw, gb]):
            step = tf.group(make_opt().apply_gradients([(gw, w)]),
                            tf.train.GradientDescentOptimizer(0.05).apply_gradients([(gb, b)]))
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(step, {x: BIG_X, y: BIG_Y})
            return sess.run([w, b])


@pytest.mark.parametrize("make_opt", [
    lambda: tf.train.GradientDescentOptimizer(0.1),
    lambda: tf.train.AdamOptimizer(0.1),
], ids=["sgd", "adam"])
def test_four_micro_batches_equal_one_big_batch_step(graph, make_opt):
    train, (x, y, _, w, b), gs = _accumulating(make_opt)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        start = sess.run([w, b])
        for i, feed in enumerate(_micro_feeds(x, y)):
            out = sess.run({"u": train.update_op, "applied": train.applied,
                            "end": train.window_end, "gs": gs}, feed)
            assert out["end"] == (i == 3) and out["applied"] == (i == 3)
            if i < 3:  # inside a window no weight moves
                for before, now in zip(start, sess.run([w, b])):
                    assert np.array_equal(before, now)
        ours = sess.run([w, b])
        assert sess.run(gs) == 1
    for a, r in zip(ours, _big_batch_reference(make_opt)):
        np.testing.assert_allclose(a, r, rtol=0, atol=1e-6)


def test_overflow_in_one_micro_step_voids_the_window(graph):
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 10, growth_steps=1000)
    train, (x, y, poison, w, b), gs = _accumulating(
        lambda: tf.train.GradientDescentOptimizer(0.1), manager=manager)
    feeds = _micro_feeds(x, y)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        start = snapshot_globals(sess)
        scales = []
        for i, feed in enumerate(feeds):
            feed = dict(feed)
            if i == 1:
                feed[poison] = np.nan  # micro-step 2 overflows
            finite, _, scale = sess.run([train.is_finite, train.update_op, train.loss_scale], feed)
            assert finite == (i != 1)
            scales.append(scale)
        assert scales == [2.0 ** 10] * 4  # constant within the window
        after = snapshot_globals(sess)
        for name in ("w", "b", "global_step"):
            assert np.array_equal(start[name], after[name]), name
        accumulators = [v for v in tf.global_variables() if "accumulate/" in v.name]
        assert accumulators and all(not np.any(sess.run(v)) for v in accumulators)
        assert sess.run(manager.get_loss_scale()) == 2.0 ** 9  # one update per window
        # The next window is clean and applies.
        applied = [sess.run([train.update_op, train.applied], f)[1] for f in feeds]
        assert applied == [False, False, False, True]
        assert sess.run(gs) == 1
        assert sess.run(manager.get_loss_scale()) == 2.0 ** 9


def test_restore_in_mid_window_continues_identically(tmp_path):
    path = str(tmp_path / "mid")
    make_opt = lambda: tf.train.AdamOptimizer(0.1)

    def run(restore, steps):
        with tf.Graph().as_default():
            train, (x, y, _, w, b), gs = _accumulating(make_opt)
            feeds = _micro_feeds(x, y)
            saver = tf.train.Saver()
            with tf.Session() as sess:
                if restore:
                    saver.restore(sess, path)
                else:
                    sess.run(tf.global_variables_initializer())
                for i in steps:
                    sess.run(train.update_op, feeds[i % 4])
                if not restore:
                    saver.save(sess, path)
                return snapshot_globals(sess)

    straight = run(False, range(6))  # one window and a half, then saved
    first = run(False, range(2))     # two micro-steps in, saved
    resumed = run(True, range(2, 6))
    assert sorted(straight) == sorted(resumed)
    for name in straight:
        assert np.array_equal(straight[name], resumed[name]), name
    assert resumed["loss_scale/accumulate/micro_step"] == 2
    assert first["w"].tolist() == run(False, [])["w"].tolist()


@pytest.mark.parametrize("accumulation_steps", [1, 4])
def test_clipping_equals_clip_by_global_norm_on_unscaled_gradients(graph, accumulation_steps):
    make_opt = lambda: tf.train.GradientDescentOptimizer(0.1)
    train, (x, y, _, w, b), _ = _accumulating(make_opt, n=accumulation_steps, clip_norm=0.05)
    feeds = [{x: BIG_X, y: BIG_Y}] if accumulation_steps == 1 else _micro_feeds(x, y)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for feed in feeds:
            sess.run(train.update_op, feed)
        ours = sess.run([w, b])
    reference = _big_batch_reference(make_opt, clip_norm=0.05)
    unclipped = _big_batch_reference(make_opt)
    assert not np.allclose(reference[0], unclipped[0])  # the clip did bite
    for a, r in zip(ours, reference):
        np.testing.assert_allclose(a, r, rtol=0, atol=1e-6)


def _per_group_run(policy, backend="is_finite"):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(2.0 ** 8),
                                        backend=backend, skip_policy=policy)
    add_gan_groups(scaler, model)
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        before = sess.run(model.d_vars + model.g_vars)
        feed = dict(model.feed)
        feed[model.poison_g] = np.inf  # only the generator's gradients break
        out = sess.run({"u": train.update_op, "finite": train.is_finite,
                        "groups": train.group_is_finite, "applied": train.applied}, feed)
        after = sess.run(model.d_vars + model.g_vars)
        moved = [not np.array_equal(x, y) for x, y in zip(before, after)]
        return out, moved[:2], moved[2:], sess.run(gs)


def test_per_group_policy_skips_only_the_broken_group(graph):
    out, d_moved, g_moved, step = _per_group_run("per_group")
    assert out["groups"] == {"d": True, "g": False}
    assert not out["finite"] and out["applied"]
    assert all(d_moved) and not any(g_moved)
    assert step == 1  # a step where any group applied counts


def test_all_policy_skips_both(graph):
    out, d_moved, g_moved, step = _per_group_run("all")
    assert not out["finite"] and not out["applied"]
    assert not any(d_moved) and not any(g_moved)
    assert step == 0


def test_per_group_managers_move_independently(graph):
    model = two_group_gan()
    d_manager = nl.DynamicLossScaleManager(2.0 ** 8, growth_steps=1)
    g_manager = nl.DynamicLossScaleManager(2.0 ** 12, growth_steps=1)
    scaler = nl.MultiOptimizerLossScale(d_manager, backend="is_finite", skip_policy="per_group")
    add_gan_groups(scaler, model, g_manager=g_manager)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        used = sess.run([train.update_op, train.loss_scales], model.feed)[1]
        assert used == {"d": 2.0 ** 8, "g": 2.0 ** 12}
        assert sess.run([d_manager.get_loss_scale(), g_manager.get_loss_scale()]) == [2.0 ** 9, 2.0 ** 13]
        feed = dict(model.feed)
        feed[model.poison_g] = np.inf
        sess.run(train.update_op, feed)  # g overflows: g shrinks, d still grows
        assert sess.run([d_manager.get_loss_scale(), g_manager.get_loss_scale()]) == [2.0 ** 10, 2.0 ** 12]


def test_per_group_manager_under_all_policy_updates_on_its_own_group(graph):
    model = two_group_gan()
    d_manager = nl.DynamicLossScaleManager(2.0 ** 8, growth_steps=1)
    g_manager = nl.DynamicLossScaleManager(2.0 ** 12, growth_steps=1)
    scaler = nl.MultiOptimizerLossScale(d_manager, backend="is_finite")
    add_gan_groups(scaler, model, g_manager=g_manager)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        feed = dict(model.feed)
        feed[model.poison_g] = np.inf
        assert not sess.run([train.is_finite, train.update_op], feed)[0]  # both skip
        assert sess.run([d_manager.get_loss_scale(), g_manager.get_loss_scale()]) == [2.0 ** 9, 2.0 ** 11]


@pytest.mark.parametrize("count", [False, True])
def test_count_skipped_steps(graph, count):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(2.0 ** 8), backend="is_finite")
    scaler.add(model.d_loss, tf.train.AdamOptimizer(0.01), var_list=model.d_vars, name="d")
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs, count_skipped_steps=count)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for ok in [True, False, True]:
            feed = dict(model.feed)
            if not ok:
                feed[model.x] = np.full_like(feed[model.x], np.inf)
            sess.run(train.update_op, feed)
        assert sess.run(gs) == (3 if count else 2)


@pytest.mark.parametrize("value, error, fragment", [
    (0, ValueError, "accumulation_steps must be >= 1, got 0"),
    (2.5, TypeError, "accumulation_steps must be a whole number, got 2.5"),
    (float("nan"), ValueError, "accumulation_steps must be a finite number, got nan"),
    (True, TypeError, "accumulation_steps must be a whole number, got True"),
    ("4", TypeError, "accumulation_steps must be a whole number, got '4'"),
])
def test_bad_accumulation_steps(graph, value, error, fragment):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars)
    with pytest.raises(error) as info:
        scaler.build(accumulation_steps=value)
    assert fragment in str(info.value)


def test_an_integral_float_counts_as_accumulation_steps(graph):
    """The one count policy (checks.check_count): 2.0 is 2, as TF's own tests
    pass counts, and the managers' periods accept."""
    model = two_group_gan()
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars)
    train = scaler.build(global_step=gs, accumulation_steps=2.0)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(4):
            sess.run(train.update_op, model.feed)
        assert sess.run(gs) == 2


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1.0, ValueError), ("1", TypeError)])
def test_bad_clip_norm(graph, value, error):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    with pytest.raises(error, match="clip_norm"):
        scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars, clip_norm=value)


def test_bad_skip_policy(graph):
    with pytest.raises(ValueError, match="skip_policy must be one of .* got 'some'"):
        nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), skip_policy="some")


def test_bad_per_group_manager(graph):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    with pytest.raises(TypeError, match="loss_scale_manager must have get_loss_scale"):
        scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars,
                   loss_scale_manager="dynamic")


def test_accumulate_op_loop_equals_update_op_every_run(graph):
    """accumulate_op for the first micro-batches and update_op for the last
    (the loop an engine requires) gives bit for bit what running update_op
    for every micro-batch gives; accumulate_op refuses a window's last."""
    make_opt = lambda: tf.train.AdamOptimizer(0.1)

    def run(use_accumulate_op):
        with tf.Graph().as_default():
            train, (x, y, _, w, b), _ = _accumulating(make_opt)
            feeds = _micro_feeds(x, y)
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                for i, feed in enumerate(feeds * 2):  # two windows
                    last = i % 4 == 3
                    sess.run(train.accumulate_op if use_accumulate_op and not last
                             else train.update_op, feed)
                result = snapshot_globals(sess)
                if use_accumulate_op:  # a third window, closed wrongly
                    for feed in feeds[:3]:
                        sess.run(train.accumulate_op, feed)
                    before = snapshot_globals(sess)
                    with pytest.raises(tf.errors.InvalidArgumentError,
                                       match="Run update_op for the last micro-batch"):
                        sess.run(train.accumulate_op, feeds[3])
                    after = snapshot_globals(sess)
                    for name in before:
                        assert np.array_equal(before[name], after[name]), name
                return result

    every_run, split = run(False), run(True)
    assert every_run["global_step"] == 2
    assert sorted(every_run) == sorted(split)
    for name in every_run:
        assert np.array_equal(every_run[name], split[name]), name


def test_accumulate_op_is_none_without_accumulation(graph):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8))
    scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars)
    assert scaler.build().accumulate_op is None


def test_clipping_float16_variables_with_a_large_norm_stays_finite(graph):
    """float16 squares overflow past a norm of ~256; the clip norm is taken
    in float32, so a finite step never writes NaN (a float16 and a float32
    variable in one group also works)."""
    w16 = tf.Variable(np.full([4], 100.0, np.float16))
    w32 = tf.Variable(np.full([2], 1.0, np.float32))
    loss = tf.reduce_sum(tf.cast(w16, tf.float32) ** 2) + tf.reduce_sum(w32)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w16, w32],
               clip_norm=1.0)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        finite = sess.run([train.update_op, train.is_finite])[1]
        values = sess.run(w16)
    assert finite and np.all(np.isfinite(values))
    # gradient 200 per element, norm 400 (plus w32's): clipped to a norm of 1.
    assert np.all(values < 100.0) and np.all(values > 99.0)
