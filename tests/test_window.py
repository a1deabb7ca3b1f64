"""Phase 3 of the step, the accumulation window (npu_lossscale/core/window.py):
micro-batches against one big-batch step, an overflow voiding its window, a
restore in mid-window, and ``accumulate_op``."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import snapshot_globals
from models import accumulating as _accumulating
from models import big_batch_reference as _big_batch_reference
from models import micro_feeds as _micro_feeds


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


def test_an_integral_float_counts_as_accumulation_steps(gan):
    """The one count policy (checks.check_count): 2.0 is 2, as TF's own tests
    pass counts, and the managers' periods accept."""
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    scaler.add(gan.d_loss, tf.train.AdamOptimizer(), var_list=gan.d_vars)
    train = scaler.build(global_step=gs, accumulation_steps=2.0)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(4):
            sess.run(train.update_op, gan.feed)
        assert sess.run(gs) == 2


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


def test_accumulate_op_is_none_without_accumulation(gan):
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8))
    scaler.add(gan.d_loss, tf.train.AdamOptimizer(), var_list=gan.d_vars)
    assert scaler.build().accumulate_op is None
