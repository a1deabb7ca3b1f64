"""Each manager's rule, stepped by hand, and cross-checked against TF."""

import warnings

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl


def _stepper(manager):
    """Returns step(finite) -> (scale, good, bad) after the update."""
    finite = tf.placeholder(tf.bool, [])
    update = manager.update_loss_scale(finite)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())

    def step(value):
        sess.run(update, {finite: value})
        # The state is one float32 vector [scale, good, bad, streak]; compare
        # the first three as Python floats (1024.0 == 1024).
        return tuple(float(x) for x in sess.run(manager.state)[:3])
    return step


def test_exponential_follows_contrib_rule_by_hand(graph):
    manager = nl.ExponentialUpdateLossScaleManager(
        init_loss_scale=1024, incr_every_n_steps=3, decr_every_n_nan_or_inf=2,
        incr_ratio=2, decr_ratio=0.5)
    step = _stepper(manager)
    # (finite, expected (scale, good, bad) after the step)
    walk = [
        (True, (1024, 1, 0)),
        (True, (1024, 2, 0)),
        (True, (2048, 0, 0)),   # good+1 == 3: grow, both counters reset
        (False, (2048, 0, 1)),  # first bad step: bad += 1, good = 0
        (True, (2048, 1, 1)),   # finite without growth keeps bad (contrib)
        (False, (1024, 0, 0)),  # bad+1 == 2: shrink by 0.5, reset
        (False, (1024, 0, 1)),
        (False, (512, 0, 0)),   # 1024 -> 512 after two bad steps
    ]
    for i, (finite, expected) in enumerate(walk):
        assert step(finite) == expected, "step %d" % i


def test_exponential_floor_is_one_and_default_decr_ratio(graph):
    manager = nl.ExponentialUpdateLossScaleManager(
        init_loss_scale=2, incr_every_n_steps=10, decr_every_n_nan_or_inf=1)
    step = _stepper(manager)
    assert step(False)[0] == pytest.approx(2 * 0.8)  # contrib's default 0.8
    assert step(False)[0] == pytest.approx(2 * 0.8 * 0.8)
    for _ in range(5):
        scale = step(False)[0]
    assert scale == 1.0  # max(1, scale * decr_ratio)


def test_exponential_growth_only_below_npu_bridges_ceiling(graph):
    """npu_bridge grows only while scale < 3.4e38 / incr_ratio; with
    incr_ratio 16 that is 2.125e37, below the 2**126 cap (8.5e37)."""
    big = float(np.float32(2.2e37))  # >= 2.125e37: stays, the counters reset
    step = _stepper(nl.ExponentialUpdateLossScaleManager(
        init_loss_scale=big, incr_every_n_steps=1, incr_ratio=16))
    assert step(True) == (big, 0, 0)
    step = _stepper(nl.ExponentialUpdateLossScaleManager(
        init_loss_scale=2.0 ** 121, incr_every_n_steps=1, incr_ratio=16))
    assert step(True) == (2.0 ** 125, 0, 0)  # 2**121 < 2.125e37: grows


#: 3 * 2**123, 2.55e37: doubling it twice passes 2**126.
_NEAR_CAP = 3.0 * 2.0 ** 123


@pytest.mark.parametrize("kind", ["dynamic", "exponential"])
@pytest.mark.parametrize("max_loss_scale", [None, float(np.finfo(np.float32).max)])
def test_growth_stops_at_2_126(graph, kind, max_loss_scale):
    """By hand, growing by 2 on every finite step: 3 * 2**123 -> 3 * 2**124
    -> min(3 * 2**125, 2**126) = 2**126 -> 2**126 (TF, contrib and npu_bridge
    reach 2**127, whose inverse 2**-127 is subnormal and read as 0), and an
    overflow halves it to 2**125. A max_loss_scale above 2**126 does not lift
    the cap."""
    if kind == "dynamic":
        manager = nl.DynamicLossScaleManager(_NEAR_CAP, growth_steps=1,
                                             max_loss_scale=max_loss_scale)
    else:
        manager = nl.ExponentialUpdateLossScaleManager(
            _NEAR_CAP, 1, decr_every_n_nan_or_inf=1, decr_ratio=0.5,
            max_loss_scale=max_loss_scale)
    step = _stepper(manager)
    scales = [step(finite)[0] for finite in (True, True, True, False)]
    assert scales == [3.0 * 2.0 ** 124, 2.0 ** 126, 2.0 ** 126, 2.0 ** 125]
    assert np.float32(1.0) / np.float32(2.0 ** 126) == 2.0 ** -126  # normal: not flushed


def test_a_float32_model_at_the_cap_applies_its_gradients(graph):
    """Before the cap, this scale reached 2**127 after the second step, and
    the third step unscaled with 1/2**127, subnormal, flushed to 0 on CPU: w
    stayed [0, 1] while the step counted as finite (measured at d944b03).
    With the cap, the scaled run matches its unscaled twin bit for bit
    (powers of two unscale exactly; the gradient 0.5 * 2**126 is finite)."""
    def train(manager):
        with tf.Graph().as_default():
            w = tf.Variable([1.0, 2.0], name="w")
            loss = tf.reduce_sum(w * 0.5)
            scaler = nl.MultiOptimizerLossScale(manager(), backend="is_finite")
            scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w], name="g")
            update = scaler.build(global_step=tf.train.get_or_create_global_step()).update_op
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                for _ in range(3):
                    sess.run(update)
                return sess.run(w)

    scaled = train(lambda: nl.DynamicLossScaleManager(2.0 ** 125, growth_steps=1))
    plain = train(lambda: nl.FixedLossScaleManager(1, enable_overflow_check=False))
    assert scaled.tolist() == plain.tolist() == [-0.5, 0.5]


def test_max_loss_scale_caps_growth(graph):
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 23, growth_steps=1,
                                         max_loss_scale=2.0 ** 24)
    step = _stepper(manager)
    assert step(True)[0] == 2.0 ** 24
    assert step(True)[0] == 2.0 ** 24  # capped


def test_no_cap_by_default(graph):
    """npu_bridge and contrib have no cap but float32's range (npu_bridge's
    examples start at 2**32); the old default cap of 2**24 is gone."""
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 32, growth_steps=1)
    assert manager.max_loss_scale is None
    step = _stepper(manager)
    assert step(True)[0] == 2.0 ** 33


def test_min_loss_scale_floors_back_off(graph):
    manager = nl.DynamicLossScaleManager(initial_scale=64, min_loss_scale=16)
    step = _stepper(manager)
    assert [step(False)[0] for _ in range(4)] == [32, 16, 16, 16]


def test_dynamic_rule_by_hand(graph):
    manager = nl.DynamicLossScaleManager(initial_scale=1024, growth_steps=2, multiplier=2)
    step = _stepper(manager)
    assert step(True) == (1024, 1, 0)
    assert step(True) == (2048, 0, 0)
    assert step(True) == (2048, 1, 0)
    assert step(False) == (1024, 0, 0)  # any overflow halves and restarts
    assert step(False) == (512, 0, 0)
    assert step(True) == (512, 1, 0)


@pytest.mark.parametrize("multiplier", [2.0, 3.0])
def test_dynamic_matches_tf_dynamic_loss_scale(graph, multiplier):
    """Same finite/inf/nan sequence through ours and TF's DynamicLossScale."""
    ours = nl.DynamicLossScaleManager(initial_scale=2.0 ** 10, growth_steps=3,
                                      multiplier=multiplier)
    theirs = tf.mixed_precision.DynamicLossScale(
        initial_loss_scale=2.0 ** 10, increment_period=3, multiplier=multiplier)
    grad = tf.placeholder(tf.float32, [3])
    finite = tf.reduce_all(tf.is_finite(grad))
    ours_update = ours.update_loss_scale(finite)
    theirs_update, _ = theirs.update([grad])
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    rng = np.random.RandomState(7)
    kinds = rng.choice(["ok", "inf", "nan"], size=120, p=[0.8, 0.1, 0.1])
    for i, kind in enumerate(kinds):
        value = {"ok": [1.0, 2.0, 3.0], "inf": [1.0, np.inf, 3.0],
                 "nan": [np.nan, 2.0, 3.0]}[kind]
        sess.run([ours_update, theirs_update], {grad: value})
        a, b = sess.run([ours.get_loss_scale(), theirs()])
        assert a == b, "step %d (%s): ours %r, TF %r" % (i, kind, a, b)


def test_fixed_manager(graph):
    manager = nl.FixedLossScaleManager(128)
    scale = manager.get_loss_scale()
    assert scale.dtype == tf.float32 and scale.shape.ndims == 0
    with tf.Session() as sess:
        sess.run(manager.update_loss_scale(tf.constant(False)))
        assert sess.run(scale) == 128.0
    assert manager.get_enable_overflow_check() is True
    assert nl.FixedLossScaleManager(1, enable_overflow_check=False).get_enable_overflow_check() is False


@pytest.mark.parametrize("make", [
    lambda: nl.DynamicLossScaleManager(),
    lambda: nl.ExponentialUpdateLossScaleManager(2 ** 15, 1000),
])
def test_state_is_nontrainable_global_and_checkpointed(tmp_path, make):
    path = str(tmp_path / "ckpt")
    with tf.Graph().as_default():
        manager = make()
        assert manager.get_loss_scale().dtype == tf.float32
        state = manager.variables
        # One float32[4] variable (issue 16: no int32 state, one assign).
        assert state == [manager.state] and state[0].dtype.base_dtype == tf.float32
        assert state[0].shape.as_list() == [4]
        assert all(v in tf.global_variables() for v in state)
        assert not any(v in tf.trainable_variables() for v in state)
        update = manager.update_loss_scale(tf.constant(False))
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(3):
                sess.run(update)
            saved = sess.run(state)
            tf.train.Saver().save(sess, path)
    with tf.Graph().as_default():
        manager = make()
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, path)
            restored = sess.run(manager.variables)
    assert [list(x) for x in restored] == [list(x) for x in saved]
    assert restored[0][0] < 2 ** 15  # it did move before the save
    assert restored[0][3] == 3  # three consecutive overflows


def _warning_manager(initial_scale, after):
    """(manager, finite placeholder, update op)."""
    manager = nl.DynamicLossScaleManager(initial_scale=initial_scale,
                                         floor_warning_after=after)
    finite = tf.placeholder(tf.bool, [])
    return manager, finite, manager.update_loss_scale(finite)


def test_collapse_warning_is_given_once(graph):
    """4 -> 2 -> 1 on the first two overflows; the warning is due when the
    scale sits at its floor (1) and the last 3 steps overflowed: after the
    3rd overflow. It is given once per manager."""
    manager, finite, update = _warning_manager(4, 3)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        with _no_warning():
            for _ in range(2):
                sess.run(update, {finite: False})
                assert manager.check_floor(sess) is False
        sess.run(update, {finite: False})
        with pytest.warns(RuntimeWarning, match=r"sits at its floor \(1\) after 3 "):
            assert manager.check_floor(sess) is True
        sess.run(update, {finite: True})  # a finite step resets the streak
        assert sess.run(manager.overflow_streak) == 0
        assert manager.check_floor(sess) is False
        with _no_warning():
            for _ in range(6):
                sess.run(update, {finite: False})
                manager.check_floor(sess)  # due again, but given once only
        assert sess.run(manager.get_loss_scale()) == 1.0


def test_collapse_warning_hook_in_a_monitored_session(graph):
    manager, finite, update = _warning_manager(2, 2)
    hook = manager.floor_warning_hook(every_n_steps=2)
    with tf.train.MonitoredSession(hooks=[hook]) as sess:
        with pytest.warns(RuntimeWarning, match="sits at its floor") as record:
            for _ in range(8):
                sess.run(update, {finite: False})
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1


def test_check_floor_and_the_hook_warn_once_between_them(graph):
    """The once-per-manager record is shared: after check_floor warned of the
    first manager, the hook's read warns of the second one only."""
    first, finite, update = _warning_manager(1, 1)
    second = nl.ExponentialUpdateLossScaleManager(1, 1, floor_warning_after=1)
    updates = [update, second.update_loss_scale(finite)]
    hook = nl.monitoring.FloorWarningHook([first, second], every_n_steps=3)
    with tf.train.MonitoredSession(hooks=[hook]) as sess:
        sess.run(updates, {finite: False})  # run 1: the hook does not read
        with pytest.warns(RuntimeWarning, match=r"DynamicLossScaleManager sits at its floor"):
            assert first.check_floor(sess) is True  # run 2 (check_floor's own)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            sess.run(updates, {finite: False})  # run 3: the hook reads both
            assert nl.monitoring.check_floor(first, sess) is True
    given = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(given) == 1 and "ExponentialUpdateLossScaleManager sits" in given[0], given


def test_floor_warning_hook_names_the_missing_properties(graph):
    with pytest.raises(TypeError) as error:
        nl.monitoring.FloorWarningHook([nl.FixedLossScaleManager(8)])
    message = str(error.value)
    for fragment in ("managers", "FixedLossScaleManager", "without loss_scale, "
                     "overflow_streak, min_loss_scale, floor_warning_after"):
        assert fragment in message, message


def test_no_warning_when_disabled(graph):
    manager, finite, update = _warning_manager(1, None)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        with _no_warning():
            for _ in range(5):
                sess.run(update, {finite: False})
                assert manager.check_floor(sess) is False


class _no_warning(object):
    """Fails if a RuntimeWarning is given inside the block."""

    def __enter__(self):
        import warnings
        self._catch = warnings.catch_warnings(record=True)
        self._record = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        given = [w for w in self._record if issubclass(w.category, RuntimeWarning)]
        assert not given, [str(w.message) for w in given]


def test_check_floor_adds_no_op_to_a_finalized_graph(graph):
    manager, finite, update = _warning_manager(1, 1)
    init = tf.global_variables_initializer()
    graph.finalize()
    with tf.Session() as sess:
        sess.run(init)
        sess.run(update, {finite: False})
        with pytest.warns(RuntimeWarning):
            assert manager.check_floor(sess) is True
