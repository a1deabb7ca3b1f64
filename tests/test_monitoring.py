"""Handles a user watches: summaries, the logging hook, all_finite, object
checkpoints of LossScaleOptimizer, callables, and the warning about a second
reader of Ascend's float-status register."""

import warnings

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from readme_blocks import block
import skip_faults
from conftest import snapshot_globals
from models import add_gan_groups, two_group_gan


def _train(manager=None):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(manager or nl.FixedLossScaleManager(8.0),
                                        backend="is_finite")
    add_gan_groups(scaler, model)
    return model, scaler.build(global_step=tf.train.get_or_create_global_step())


def test_summaries_report_scale_applied_and_skips(graph):
    model, train = _train()
    summaries = nl.summaries(train, step_applied=True)
    assert tf.get_collection(tf.GraphKeys.SUMMARIES) == summaries[:-1]
    merged = tf.summary.merge(summaries)
    poison = dict(model.feed)
    poison[model.poison_g] = np.inf
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        values = []
        for feed in (model.feed, poison, model.feed, model.feed):
            blob = sess.run([merged, train.update_op], feed)[0]
            summary = tf.Summary.FromString(blob)
            values.append(dict((v.tag, v.simple_value) for v in summary.value))
    assert [v["loss_scale/scale"] for v in values] == [8.0, 8.0, 8.0, 8.0]
    assert [v["loss_scale/step_applied"] for v in values] == [1.0, 0.0, 1.0, 1.0]
    # The count before each run: the skip of the second run shows from the third.
    assert [v["loss_scale/skipped_total"] for v in values] == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("per_group_ops", [False, True])
def test_merged_summaries_fetched_alone_run_no_step(graph, per_group_ops):
    """merge_all() fetched on its own (at logging time, or with a per-group
    op) reads the state and changes nothing: no weight, no slot, no step, no
    manager state; with a per-group op it runs that step alone, once."""
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(initial_scale=8.0),
                                        backend="is_finite")
    add_gan_groups(scaler, model)
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs, per_group_ops=per_group_ops)
    nl.summaries(train)
    merged = tf.summary.merge_all()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        start = snapshot_globals(sess)
        for _ in range(3):
            sess.run(merged, model.feed)
        after = snapshot_globals(sess)
        assert sorted(start) == sorted(after)
        for name in start:
            assert np.array_equal(start[name], after[name]), name
        if per_group_ops:
            sess.run([merged, train.per_group["d"]], model.feed)
            assert sess.run(gs) == 1


def test_hook_logs_every_n_runs(graph):
    model, train = _train()
    hook = nl.LossScaleHook(train, every_n_steps=2)
    poison = dict(model.feed)
    poison[model.poison_g] = np.nan
    with tf.train.MonitoredSession(hooks=[hook]) as sess:
        sess.run(train.update_op, poison)
        assert hook.last is None
        sess.run(train.update_op, model.feed)
        assert hook.last == {"scale": 8.0, "skipped_steps": 1, "skipped_since_last_log": None}
        sess.run(train.update_op, poison)
        sess.run(train.update_op, model.feed)
        assert hook.last == {"scale": 8.0, "skipped_steps": 2, "skipped_since_last_log": 1}


def test_hook_and_summaries_reject_other_objects():
    with pytest.raises(TypeError, match="TrainOps"):
        nl.LossScaleHook(object())
    with pytest.raises(TypeError, match="TrainOps"):
        nl.summaries({"loss_scale": 1})


def test_hook_rejects_a_bad_period(graph):
    _, train = _train()
    with pytest.raises(ValueError, match="every_n_steps"):
        nl.LossScaleHook(train, every_n_steps=0)
    with pytest.raises(TypeError, match="every_n_steps must be a whole number, got 2.5"):
        nl.LossScaleHook(train, every_n_steps=2.5)


def test_hook_takes_an_integral_float_period(graph):
    """The one count policy: 100.0 counts as 100, as the managers' periods."""
    model, train = _train()
    hook = nl.LossScaleHook(train, every_n_steps=2.0)
    with tf.train.MonitoredSession(hooks=[hook]) as sess:
        sess.run(train.update_op, model.feed)
        assert hook.last is None
        sess.run(train.update_op, model.feed)
        assert hook.last is not None


def test_all_finite_is_the_builders_decision(graph):
    a = tf.placeholder(tf.float32, [3])
    b = tf.placeholder(tf.float16, [2])
    finite = nl.all_finite([a, None, b], backend="is_finite")
    with tf.Session() as sess:
        assert sess.run(finite, {a: [1, 2, 3], b: [1, 2]})
        assert not sess.run(finite, {a: [1, np.inf, 3], b: [1, 2]})
        assert not sess.run(finite, {a: [1, 2, 3], b: [np.nan, 2]})
    with pytest.raises(ValueError, match="no gradient"):
        nl.all_finite([None])


def _all_finite_misuses():
    """What scripts pass to all_finite instead of a list of gradients."""
    g = tf.placeholder(tf.float32, [2], name="g")
    w = tf.Variable([1.0, 2.0], name="w")
    step = tf.placeholder(tf.int32, [2], name="step")
    with tf.Graph().as_default():
        foreign = tf.placeholder(tf.float32, [2], name="foreign")
    return {
        "None": (None, TypeError, ["grads must be a list", "None", "grads_and_vars"]),
        "tensor": (g, TypeError, ["got the single", "'g:0'", "[grad]"]),
        "pairs": ([(g, w)], TypeError, ["grads[0] must be a gradient, got the pair",
                                        "[g for g, _ in grads_and_vars]"]),
        "float": (1.5, TypeError, ["grads must be a list", "1.5", "(float)"]),
        "str": ("g", TypeError, ["grads must be a list", "'g'", "(str)"]),
        "float entry": ([g, 2.0], TypeError, ["grads[1] must be a tf.Tensor, tf.IndexedSlices or None",
                                              "2.0", "grads_and_vars"]),
        "int tensor": ([step], TypeError, ["grads[0] must be a floating-point",
                                           "int32", "Leave it out"]),
        "other graph": ([foreign], ValueError, ["grads[0]", "another graph",
                                                "all_finite() in that graph"]),
        "empty": ([], ValueError, ["no gradient", "[]"]),
    }


@pytest.mark.parametrize("misuse", ["None", "tensor", "pairs", "float", "str",
                                    "float entry", "int tensor", "other graph", "empty"])
def test_all_finite_refuses_what_is_not_a_gradient_list(graph, misuse):
    """Before: None and a float raised Python's 'not iterable', a tensor TF's
    'iterating over tf.Tensor', a str 'object has no attribute dtype'; a
    pair list built a check of the variables too."""
    grads, error, fragments = _all_finite_misuses()[misuse]
    count = len(graph.get_operations())
    with pytest.raises(error) as raised:
        nl.all_finite(grads, backend="is_finite")
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))
    assert len(graph.get_operations()) == count  # refused before any op


def test_all_finite_takes_a_tuple_and_indexed_slices(graph):
    dense = tf.placeholder(tf.float16, [2])
    values = tf.placeholder(tf.float32, [1, 3])
    sparse = tf.IndexedSlices(values, tf.constant([0]), tf.constant([4, 3]))
    finite = nl.all_finite((dense, sparse), backend="is_finite")
    with tf.Session() as sess:
        assert sess.run(finite, {dense: [1, 2], values: [[1, 2, 3]]})
        assert not sess.run(finite, {dense: [1, 2], values: [[1, np.nan, 3]]})


def test_all_finite_bound_on_large_finite_gradients(graph):
    """The documented bound: the check sums in float32, so finite values whose
    sum passes float32's maximum (~3.4e38) read as an overflow."""
    g = tf.placeholder(tf.float32, [2])
    finite = nl.all_finite([g], backend="is_finite")
    with tf.Session() as sess:
        assert sess.run(finite, {g: [1e38, 1e38]})
        assert not sess.run(finite, {g: [3e38, 3e38]})


def test_loss_scale_optimizer_accepts_a_callable_loss(graph):
    model = two_group_gan()
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), nl.FixedLossScaleManager(8.0),
                                backend="is_finite")
    train = opt.minimize(lambda: model.d_loss, var_list=model.d_vars)
    pairs = opt.compute_gradients(lambda: model.g_loss, var_list=model.g_vars)
    assert all(g is not None for g, _ in pairs)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train, model.feed)


def test_object_checkpoint_saves_the_loss_scale_state(graph, tmp_path):
    """tf.train.Checkpoint(optimizer=LossScaleOptimizer) restores the scale and
    counters bit for bit, as the name-based Saver does."""
    model = two_group_gan()
    manager = nl.DynamicLossScaleManager(2.0 ** 10, growth_steps=3)
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), manager, backend="is_finite")
    train = opt.minimize(model.d_loss, var_list=model.d_vars)
    checkpoint = tf.train.Checkpoint(optimizer=opt)
    poison = dict(model.feed)
    poison[model.poison_g] = np.inf
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for feed in (model.feed, model.feed, model.feed, model.feed):
            sess.run(train, feed)
        saved = sess.run(manager.variables)
        path = checkpoint.save(str(tmp_path / "ckpt"), session=sess)
        sess.run(tf.global_variables_initializer())
        assert not all(np.array_equal(a, b) for a, b in zip(saved, sess.run(manager.variables)))
        checkpoint.restore(path).run_restore_ops(session=sess)
        restored = sess.run(manager.variables)
    for before, after in zip(saved, restored):
        assert np.array_equal(before, after)


def test_a_second_register_reader_is_warned_about(graph, saturation_mode):
    model = two_group_gan(compute_dtype=tf.float16)
    d_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), nl.FixedLossScaleManager(8.0),
                                  backend="npu")
    g_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), nl.FixedLossScaleManager(8.0),
                                  backend="npu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d_opt.minimize(model.d_loss, var_list=model.d_vars)
    with pytest.warns(UserWarning, match="cannot tell their overflows apart.*neither "
                                         "misses an overflow.*also skips"):
        g_opt.minimize(model.g_loss, var_list=model.g_vars)


def test_one_builder_with_per_group_ops_is_one_reader(graph, saturation_mode):
    model = two_group_gan(compute_dtype=tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="npu")
    add_gan_groups(scaler, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.build(per_group_ops=True)


def test_all_finite_inside_a_cond_branch_takes_the_outer_graphs_gradients(graph):
    """A cond branch (a function graph under control flow v2) captures the
    outer graph's tensors: they are not "another graph"."""
    g = tf.placeholder(tf.float32, [2])
    pred = tf.placeholder_with_default(True, [])
    decision = tf.cond(pred, lambda: nl.all_finite([g], backend="is_finite"),
                       lambda: tf.constant(False))
    with tf.Session() as sess:
        assert sess.run(decision, {g: [1.0, 2.0]})
        assert not sess.run(decision, {g: [1.0, np.inf]})


# -- skips by reason, and the collapse policy (issue 26) ----------------------

def test_summaries_count_skips_by_reason_and_group(graph):
    """State reads of the last-skip record: fetched alone they run no step."""
    model, train = _train()
    nl.summaries(train)
    merged = tf.summary.merge_all()
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for feed in (model.feed, nan_loss, nan_loss, model.feed):
            sess.run(train.update_op, feed)
        values = dict((v.tag, v.simple_value)
                      for v in tf.Summary.FromString(sess.run(merged)).value)
    assert values == {"loss_scale/scale": 8.0, "loss_scale/skipped_total": 2.0,
                      "loss_scale/skips_loss_not_finite": 2.0,
                      "loss_scale/skips_gradients_overflowed": 0.0,
                      "loss_scale/skips_other_worker_overflowed": 0.0,
                      "loss_scale/skips_register_outside_gradients": 0.0,
                      "loss_scale/skips_requested": 0.0, "loss_scale/skips_loss_spike": 0.0,
                      "loss_scale/skips_backend_flagged": 0.0,
                      "loss_scale/overflows_d": 0.0, "loss_scale/overflows_g": 2.0}


def _collapsing_run(hook, model, train, collapse_at, runs=40):
    """Runs update_op under a MonitoredTrainingSession with ``hook``: clean
    batches, then a NaN generator loss on every run from ``collapse_at``.

    Returns:
      The number of runs made before ``should_stop()``.
    """
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    made = 0
    with tf.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        while not sess.should_stop() and made < runs:
            sess.run(train.update_op, nan_loss if made >= collapse_at else model.feed)
            made += 1
    return made


@pytest.mark.parametrize("collapse_after", [1, 5])
def test_stop_policy_stops_the_session_at_the_nth_skip(graph, collapse_after):
    """A forced collapse from run 10: the session stops right after the
    collapse_after-th consecutive skip; the message says why and what to do."""
    model, train = _train()
    hook = nl.LossScaleHook(train, on_collapse="stop", collapse_after=collapse_after)
    assert _collapsing_run(hook, model, train, collapse_at=10) == 10 + collapse_after
    collapse = hook.monitor.collapse
    assert (collapse.skips, collapse.reasons, collapse.floors) == (
        collapse_after, {"loss_not_finite": collapse_after}, ())
    assert collapse.last_skip == nl.diagnostics.Skip(
        collapse_after, 10, "loss_not_finite", ("g",), ("generator/w", "generator/b"))
    assert collapse.message == (
        "npu_lossscale: the loss scale collapsed: %d consecutive skipped steps "
        "(loss_not_finite %d). Last skip #%d at global step 10: loss_not_finite; groups g; "
        "variables generator/w, generator/b. Fix: %s"
        % (collapse_after, collapse_after, collapse_after, nl.diagnostics.FIXES[1]))


def test_raise_policy_raises_from_the_nth_skip(graph):
    model, train = _train()
    hook = nl.LossScaleHook(train, on_collapse="raise", collapse_after=3)
    with pytest.raises(nl.LossScaleCollapse, match=r"3 consecutive skipped steps "
                                                   r"\(loss_not_finite 3\)") as raised:
        _collapsing_run(hook, model, train, collapse_at=2)
    assert raised.value.collapse.last_skip.number == 3


def test_warn_policy_warns_once_per_collapse_and_rearms_after_an_applied_step(graph):
    """Plain loop: a warning at the 3rd consecutive skip, none while the
    collapse lasts, and again after an applied step and 3 more skips.
    Each reason of the streak gets its fix."""
    model = skip_faults.build_model()
    train = skip_faults.build_step(model, "is_finite")
    monitor = nl.CollapseMonitor(train, collapse_after=3)
    inf_grad = skip_faults.fault_feed(model, skip_faults.Fault(
        skip_faults.INF_GRADIENT, ("a",), ("a/w",)))
    nan_loss = skip_faults.fault_feed(model, skip_faults.Fault(skip_faults.NAN_LOSS, ("b",), ()))
    feeds = [inf_grad, nan_loss, nan_loss, nan_loss, model.feed] + [nan_loss] * 3
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        seen = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for feed in feeds:
                reason = sess.run([train.update_op, train.diagnosis.skip_reason], feed)[1]
                seen.append((int(reason), monitor.observe(reason, sess) is not None))
    collapse_warnings = [str(w.message) for w in caught if "collapsed" in str(w.message)]
    assert [code for code, _ in seen] == [2, 1, 1, 1, 0, 1, 1, 1]
    assert [fired for _, fired in seen] == [False, False, True, True, False, False, False, True]
    assert len(collapse_warnings) == 2
    first = collapse_warnings[0]
    assert "(loss_not_finite 2, gradients_overflowed 1)" in first
    assert "Fix for gradients_overflowed: " + nl.diagnostics.FIXES[2] in first


def test_the_hook_does_not_count_runs_of_no_step(graph):
    """Runs that run no step op (an evaluation of the loss, the summaries)
    fetch nothing of the step: they run no step and count as nothing."""
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    add_gan_groups(scaler, model)
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs, per_group_ops=True)
    nl.summaries(train)
    merged = tf.summary.merge_all()
    hook = nl.LossScaleHook(train, on_collapse="raise", collapse_after=1)
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    with tf.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        sess.run([model.g_loss, merged], nan_loss)
        sess.run({"step": train.update_op}, model.feed)
        assert hook.monitor.skips == 0 and sess.run(gs) == 1
        with pytest.raises(nl.LossScaleCollapse):
            sess.run({"step": train.update_op}, nan_loss)


def test_a_manager_at_its_floor_is_named(graph):
    manager = nl.DynamicLossScaleManager(initial_scale=2.0, min_loss_scale=1.0)
    model, train = _train(manager)
    hook = nl.LossScaleHook(train, on_collapse="stop", collapse_after=3, managers=[manager])
    _collapsing_run(hook, model, train, collapse_at=0)
    collapse = hook.monitor.collapse
    assert collapse.floors == ("DynamicLossScaleManager",)
    assert "(loss_not_finite 3), DynamicLossScaleManager at the floor." in collapse.message


def test_windows_that_do_not_close_are_not_counted(graph):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    add_gan_groups(scaler, model)
    train = scaler.build(accumulation_steps=2)
    monitor = nl.CollapseMonitor(train, collapse_after=2, on_collapse="stop")
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        fired = []
        for _ in range(4):
            _, reason, end = sess.run([train.update_op, train.diagnosis.skip_reason, train.window_end],
                                      nan_loss)
            fired.append(monitor.observe(reason, sess, window_end=end) is not None)
    assert fired == [False, False, False, True] and monitor.skips == 2


@pytest.mark.parametrize("kwargs,error,match", [
    ({"on_collapse": "explode"}, ValueError,
     r"on_collapse must be one of \('warn', 'stop', 'raise'\), got 'explode'"),
    ({"on_collapse": "warn", "collapse_after": 0}, ValueError, r"collapse_after must be"),
    ({"on_collapse": "warn", "collapse_after": 2.5}, TypeError,
     r"collapse_after must be a whole number, got 2.5"),
    ({"on_collapse": "warn", "managers": [object()]}, TypeError, r"managers must expose"),
])
def test_collapse_policy_arguments_are_checked(graph, kwargs, error, match):
    _, train = _train()
    with pytest.raises(error, match=match):
        nl.LossScaleHook(train, **kwargs)


def test_a_step_without_skip_reason_cannot_be_watched(graph):
    """Through a SyncReplicasOptimizer the chief decides: no skip_reason."""
    _, train = _train()
    with pytest.raises(ValueError, match=r"train_ops has no skip_reason: its step goes "
                                         r"through a SyncReplicasOptimizer"):
        nl.CollapseMonitor(train._replace(diagnosis=train.diagnosis._replace(skip_reason=None)))


# -- the collapse policy watches what it is given, or refuses it (issue 32) ---

def _per_group_train():
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    add_gan_groups(scaler, model)
    gs = tf.train.get_or_create_global_step()
    return model, scaler.build(global_step=gs, per_group_ops=True), gs


@pytest.mark.parametrize("kwargs,error,fragments", [
    ({"collapse_after": 5}, ValueError,
     ["collapse_after=5 acts only with on_collapse", "on_collapse='warn'"]),
    ({"collapse_after": 0}, ValueError, ["collapse_after must be >= 1, got 0"]),
    ({"collapse_after": "twenty"}, TypeError,
     ["collapse_after must be a whole number, got 'twenty'", "e.g. 20"]),
    ({"managers": "manager"}, ValueError,
     ["managers=[<", "act only with on_collapse", "FloorWarningHook"]),
    ({"on_collapse": "warn", "managers": "manager"}, TypeError,
     ["managers must be a list of managers", "managers=[manager]"]),
])
def test_collapse_arguments_that_would_do_nothing_are_refused(graph, kwargs, error,
                                                                fragments):
    """Before: without on_collapse, collapse_after and managers were taken
    and ignored (a hook that never acts), and collapse_after=0 or 'twenty'
    went unchecked."""
    manager = nl.DynamicLossScaleManager()
    _, train = _train(manager)
    if "managers" in kwargs:
        kwargs = dict(kwargs, managers=[manager] if "on_collapse" not in kwargs else manager)
    with pytest.raises(error) as raised:
        nl.LossScaleHook(train, **kwargs)
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))


def test_the_default_hook_still_takes_no_policy(graph):
    _, train = _train()
    assert nl.LossScaleHook(train, every_n_steps=10, managers=[]).monitor is None


def test_the_hook_watches_alternating_per_group_runs(graph):
    """An alternating loop, one per-group op per run: from run 4 the
    generator's loss is NaN, the discriminator still applies. The
    generator's third consecutive skip stops the session, though a D step
    applied between each; an evaluation run counts as nothing. Before, no
    per-group run was watched and the loop ran to its end."""
    model, train, _ = _per_group_train()
    hook = nl.LossScaleHook(train, on_collapse="stop", collapse_after=3)
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    runs = []
    with tf.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        while not sess.should_stop() and len(runs) < 20:
            name = "d" if len(runs) % 2 == 0 else "g"
            if len(runs) == 5:
                sess.run(model.g_loss, nan_loss)  # an evaluation run, no step
            sess.run(train.per_group[name], nan_loss if len(runs) >= 4 else model.feed)
            runs.append(name)
    # G's skips were runs 6, 8 and 10 (1-based), the stop right after; the
    # last at global step 7 (runs 1-5, 7 and 9 applied).
    assert runs == ["d", "g"] * 5
    collapse = hook.monitor.collapse
    assert (collapse.skips, collapse.reasons) == (3, {"loss_not_finite": 3})
    assert collapse.last_skip == nl.diagnostics.Skip(
        3, 7, "loss_not_finite", ("g",), ("generator/w", "generator/b"))
    assert collapse.message.startswith(
        "npu_lossscale: the loss scale collapsed: 3 consecutive skipped steps of "
        "per_group['g'] (loss_not_finite 3). Last skip #3 at global step 7")


def test_a_per_group_streak_ends_with_its_own_applied_step(graph):
    """G skips twice, applies, skips twice: with collapse_after=3 no
    collapse, whatever D does in between."""
    model, train, _ = _per_group_train()
    hook = nl.LossScaleHook(train, on_collapse="raise", collapse_after=3)
    wrapped_g = tf.group(train.per_group["g"])
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    with tf.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        for g_feed in (nan_loss, nan_loss, model.feed, nan_loss, nan_loss):
            sess.run(train.per_group["d"], model.feed)
            sess.run(train.per_group["g"], g_feed)
        assert hook.monitor.skips == 2 and hook.monitor.collapse is None
        with pytest.raises(nl.LossScaleCollapse, match=r"3 consecutive skipped steps of "
                                                       r"per_group\['g'\]"):
            sess.run(wrapped_g, nan_loss)


@pytest.mark.parametrize("wrap", ["group", "control_dependency", "dict_of_group"])
def test_the_hook_watches_an_op_around_update_op(graph, wrap):
    """A loop that fetches tf.group(train.update_op, ...) (or an op built
    under its control dependency, as an Estimator's train_op) is watched as
    update_op is. Before, only a fetch of update_op itself was."""
    model, train = _train()
    counter = tf.Variable(0, name="loop_counter")
    if wrap == "control_dependency":
        with tf.control_dependencies([train.update_op]):
            train_op = tf.assign_add(counter, 1).op
    else:
        train_op = tf.group(train.update_op, tf.assign_add(counter, 1))
    fetch = {"train": [train_op]} if wrap == "dict_of_group" else train_op
    hook = nl.LossScaleHook(train, on_collapse="stop", collapse_after=2)
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    made = 0
    with tf.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        while not sess.should_stop() and made < 10:
            sess.run(fetch, nan_loss if made >= 3 else model.feed)
            made += 1
    assert made == 5
    assert hook.monitor.collapse.skips == 2


def test_the_hook_counts_closed_windows_only(graph):
    """With accumulation the hook reads window_end itself: two windows of
    two NaN micro-batches make a collapse of 2 at the fourth run."""
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    add_gan_groups(scaler, model)
    train = scaler.build(accumulation_steps=2)
    hook = nl.LossScaleHook(train, on_collapse="stop", collapse_after=2)
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    made = 0
    with tf.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        while not sess.should_stop() and made < 10:
            sess.run(train.update_op, nan_loss)
            made += 1
    assert made == 4 and hook.monitor.collapse.skips == 2


def _observe_misuses(train, model):
    """What loops hand CollapseMonitor.observe instead of a reason code."""
    return {
        "is_finite True": (True, TypeError, ["skip_reason must be a reason code",
                                             "the bool True", "is_finite"]),
        "numpy bool": (np.bool_(False), TypeError, ["got the bool",
                                                    "train.diagnosis.skip_reason"]),
        "numpy float": (np.float32(1.0), TypeError, ["skip_reason must be an int code",
                                                     "float32", "train.diagnosis.skip_reason"]),
        "float": (2.0, TypeError, ["got 2.0 (float)"]),
        "None": (None, TypeError, ["got None (NoneType)"]),
        "tensor": (train.diagnosis.skip_reason, TypeError, ["the value session.run fetched",
                                                   repr(train.diagnosis.skip_reason.name)]),
        "out of range": (99, ValueError, ["skip_reason must be a code in 0..%d, got 99"
                                          % (len(nl.diagnostics.REASONS) - 1)]),
    }


@pytest.mark.parametrize("misuse", ["is_finite True", "numpy bool", "numpy float", "float",
                                    "None", "tensor", "out of range"])
def test_observe_refuses_what_is_not_a_reason_code(graph, misuse):
    """Before: is_finite (True on applied steps) counted as loss_not_finite
    and False as applied, so real skips were missed and a false alarm came;
    a float counted as its int, a tensor or None failed in int()."""
    model, train = _train()
    monitor = nl.CollapseMonitor(train, collapse_after=1)
    value, error, fragments = _observe_misuses(train, model)[misuse]
    with tf.Session() as sess:
        with pytest.raises(error) as raised:
            monitor.observe(value, sess)
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))
    assert monitor.skips == 0


def test_observe_takes_what_session_run_returns(graph):
    """Numpy integers (what session.run returns for an int32 scalar), a 0-d
    array and Python ints are reason codes; numpy bools for window_end."""
    model, train = _train()
    monitor = nl.CollapseMonitor(train, collapse_after=5, on_collapse="stop")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        reason = sess.run([train.update_op, train.diagnosis.skip_reason], model.feed)[1]
        assert isinstance(reason, np.integer)
        assert monitor.observe(reason, sess) is None
        for code in (np.int32(1), np.int64(2), np.array(1, np.int32), 3):
            assert monitor.observe(code, sess, window_end=np.bool_(True)) is None
        assert monitor.skips == 4 and monitor.collapse is None
        assert monitor.observe(0, sess, window_end=np.array(True)) is None
    assert monitor.skips == 0


@pytest.mark.parametrize("session", [None, "sess", "other graph"])
def test_observe_checks_the_session_on_every_run(graph, session):
    """Before: a None session went unnoticed until the collapse read the
    record, collapse_after runs later."""
    model, train = _train()
    monitor = nl.CollapseMonitor(train, collapse_after=20)
    if session == "other graph":
        with tf.Graph().as_default() as other:
            tf.constant(1.0)
        session = tf.Session(graph=other)
        error, fragments = ValueError, ["session must run the graph of train_ops",
                                        "another graph"]
    else:
        error, fragments = TypeError, ["session must be a tf.Session", repr(session)]
    with pytest.raises(error) as raised:
        monitor.observe(0, session)
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))


def test_observe_refuses_a_step_name_that_is_not_a_str(graph):
    _, train = _train()
    monitor = nl.CollapseMonitor(train)
    with tf.Session() as sess:
        with pytest.raises(TypeError, match=r"step must be None or a str .*, got 1\."):
            monitor.observe(0, sess, step=1)


def test_accumulation_without_window_end_is_refused(graph):
    """A run inside a window reads skip_reason 0 as an applied step does, so
    without window_end the monitor would never see a collapse (before: the
    window's inner runs re-armed it, and it never fired)."""
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    add_gan_groups(scaler, model)
    train = scaler.build(accumulation_steps=2)
    monitor = nl.CollapseMonitor(train, collapse_after=2, on_collapse="stop")
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        _, reason, end = sess.run([train.update_op, train.diagnosis.skip_reason, train.window_end],
                                  nan_loss)
        with pytest.raises(ValueError) as raised:
            monitor.observe(reason, sess)
        assert "window_end=None" in str(raised.value)
        assert "Pass the run's fetched train.window_end" in str(raised.value)
        with pytest.raises(TypeError, match="window_end must be the bool fetched"):
            monitor.observe(reason, sess, window_end=train.window_end)
        assert monitor.observe(reason, sess, window_end=end) is None


def test_without_accumulation_window_end_is_optional(graph):
    """update_op closes every step: window_end is a constant True."""
    model, train = _train()
    monitor = nl.CollapseMonitor(train, collapse_after=1, on_collapse="stop")
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        reason = sess.run([train.update_op, train.diagnosis.skip_reason], nan_loss)[1]
        assert monitor.observe(reason, sess).skips == 1


def test_the_monitor_takes_a_finalized_graph(graph):
    """It makes no op: a loop may build it after graph.finalize()."""
    model, train = _train()
    init = tf.global_variables_initializer()
    graph.finalize()
    monitor = nl.CollapseMonitor(train, collapse_after=1, on_collapse="stop")
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    with tf.Session() as sess:
        sess.run(init)
        reason = sess.run([train.update_op, train.diagnosis.skip_reason], nan_loss)[1]
        assert monitor.observe(reason, sess) is not None


def test_a_plain_alternating_loop_watches_each_group_as_documented(graph):
    """docs/diagnosis.md's plain loop over per-group ops: the count
    before the run, then the count and the record's reason after it."""
    model, train, _ = _per_group_train()
    monitor = nl.CollapseMonitor(train, collapse_after=2, on_collapse="stop")
    nan_loss = dict(model.feed)
    nan_loss[model.poison_g] = np.nan
    made = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for name in ["d", "g"] * 5:
            feed = nan_loss if len(made) >= 2 else model.feed
            before, _ = sess.run([train.skipped_steps, train.per_group[name]], feed)
            after, reason = sess.run([train.skipped_steps, train.diagnosis.last_skip.reason])
            made.append(name)
            if monitor.observe(reason if after > before else 0, sess, step=name):
                break
    assert made == ["d", "g"] * 3
    assert monitor.collapse.message.startswith(
        "npu_lossscale: the loss scale collapsed: 2 consecutive skipped steps of g "
        "(loss_not_finite 2).")
    # The loop as docs/diagnosis.md shows it, run as it is: G's poisoned
    # runs make a streak of G's, D's applied runs do not break it.
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        shown = {"nl": nl, "tf": tf, "sess": sess, "train": train, "feed": nan_loss,
                 "steps": 3}
        exec(compile(block("collapse-loop"), "collapse-loop", "exec"),  # pylint: disable=exec-used
             shown)
        assert shown["monitor"].skips == 3 and shown["monitor"].collapse is None
