"""Managers misused the way real scripts misuse them (issue 20): each gets a
clear error that names the argument or the manager's class, shows the value
and says the fix, at build time where the mistake is visible then, else at the
first run that meets it, before any weight moves.

* the constructors' arguments (a scale that is no power of two, a period
  of 0 or 2.5, a ratio on the wrong side of 1, ...).
* ``check_floor`` with a session of another graph, or no session.
* a custom ``update_loss_scale`` that returns no op (None, a number...).
* a custom scale outside [2**-126, float32 max]: 0 (NaN weights before),
  NaN or inf (every step skipped, no word), negative or subnormal: the run
  fails and no weight, slot, statistic or step moves.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import raises_with as _raises
from models import two_group_gan

FLOAT32_MAX = float(np.finfo(np.float32).max)


def _message_has(error, *fragments):
    message = str(error.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# -- check_floor with the wrong session ----------------------------------------

def test_check_floor_with_a_session_of_another_graph_names_the_fix():
    with tf.Graph().as_default():
        manager = nl.DynamicLossScaleManager()
    other = tf.Graph()
    with other.as_default():
        tf.constant(1.0)  # not empty: TF's own error would then blame a tensor
        with tf.Session() as sess:
            with pytest.raises(ValueError) as error:
                manager.check_floor(sess)
    _message_has(error, "session", "DynamicLossScaleManager", "another graph",
                 repr(sess), "tf.Session(graph=")


@pytest.mark.parametrize("session", [None, "sess", 3])
def test_check_floor_without_a_session_names_the_argument(graph, session):
    manager = nl.ExponentialUpdateLossScaleManager(8, 10)
    with pytest.raises(TypeError) as error:
        manager.check_floor(session)
    _message_has(error, "session must be a tf.Session", repr(session))


def test_check_floor_still_reads_its_own_graph(graph):
    manager = nl.DynamicLossScaleManager(initial_scale=1, floor_warning_after=1)
    update = manager.update_loss_scale(tf.constant(False))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert manager.check_floor(sess) is False
        sess.run(update)  # one overflow at the floor of 1
        with pytest.warns(RuntimeWarning):
            assert manager.check_floor(sess) is True


# -- update_loss_scale that returns no op ---------------------------------------

class _ReturnsWhatItIsGiven(object):
    """A custom manager whose update returns ``returned``."""

    def __init__(self, returned):
        self.returned = returned

    def get_loss_scale(self):
        return tf.constant(4.0)

    def update_loss_scale(self, finite_grads):
        del finite_grads
        return self.returned


def _build(manager, path, optimizer=None):
    """One group on the GAN's generator: ``(update op, model)``."""
    model = two_group_gan()
    optimizer = optimizer or tf.train.AdamOptimizer(0.1)
    global_step = tf.train.get_or_create_global_step()
    if path == "builder":
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(model.g_loss, optimizer, var_list=model.g_vars, name="g")
        return scaler.build(global_step=global_step).update_op, model
    wrapped = nl.LossScaleOptimizer(optimizer, manager, backend="is_finite")
    return wrapped.minimize(model.g_loss, global_step=global_step,
                            var_list=model.g_vars), model


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("returned", [None, 3, "assign", [1.0]])
def test_update_returning_no_op_is_a_type_error_naming_the_class(graph, path, returned):
    with pytest.raises(TypeError) as error:
        _build(_ReturnsWhatItIsGiven(returned), path)
    _message_has(error, "_ReturnsWhatItIsGiven.update_loss_scale", repr(returned),
                 "Return the assign op", "tf.no_op()")


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("form", ["operation", "tensor", "assign"])
def test_update_returning_an_op_a_tensor_or_an_assign_runs(graph, path, form):
    """What contrib's and npu_bridge's tf.group accept stays accepted; the
    update runs once per step."""
    counter = tf.Variable(0.0, trainable=False, name="updates")

    class Counting(_ReturnsWhatItIsGiven):
        def update_loss_scale(self, finite_grads):
            added = tf.assign_add(counter, tf.cast(finite_grads, tf.float32))
            if form == "operation":
                return tf.group(added)
            if form == "tensor":
                return tf.convert_to_tensor(added)
            return added  # a tensor (ref variable) or an unread variable (resource)

    update, model = _build(Counting(None), path)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(2):
            sess.run(update, model.feed)
        assert sess.run(counter) == 2.0


# -- a custom scale outside [2**-126, float32 max] ---------------------------------

class _StoredScale(object):
    """A custom manager whose scale is a variable the test sets."""

    def __init__(self, value, dtype=tf.float32):
        self.scale = tf.Variable(value, trainable=False, name="custom_scale", dtype=dtype)

    def get_loss_scale(self):
        return self.scale.read_value()

    def update_loss_scale(self, finite_grads):
        return tf.no_op()


def _state(sess, model, optimizer):
    """Every value a step may change: weights, Adam's slots and beta powers,
    the global step."""
    variables = list(model.g_vars)
    variables += [optimizer.get_slot(v, name) for v in model.g_vars
                  for name in optimizer.get_slot_names()]
    variables += list(optimizer._get_beta_accumulators())  # pylint: disable=protected-access
    variables.append(tf.train.get_global_step())
    return [np.array(value) for value in sess.run(variables)]


#: (dtype of the custom scale, a good scale, the bad one as a function of the
#: variable, what the message prints). All but zero, nan and negative were
#: silent before: every step skipped (inf), or the scale or its inverse
#: outside float32's normal range, flushed to 0, accepted.
_BAD_SCALES = {
    "zero": (tf.float32, 4.0, lambda v: 0.0, "[0]"),
    "nan": (tf.float32, 4.0, lambda v: float("nan"), "[nan]"),
    "negative": (tf.float32, 4.0, lambda v: -4.0, "[-4]"),
    "inf": (tf.float32, 4.0, lambda v: float("inf"), "[inf]"),
    "float64_1e39": (tf.float64, 4.0, lambda v: 1e39, "[inf]"),  # inf in float32
    "float16_overflowed": (tf.float16, 2.0 ** 15, lambda v: v * 2, "[inf]"),  # 65536
    # TF's CPU kernels flush subnormals to zero (ScopedFlushDenormal): read as 0.
    "subnormal": (tf.float32, 4.0, lambda v: 2.0 ** -127, "[0]"),
    # Its inverse, 2**-127, is subnormal: read as 0, it zeroed every gradient.
    "above_2**126": (tf.float32, 4.0, lambda v: 2.0 ** 127, "[1.70141"),
    # Issue 32: a custom manager at 1e-30 flushed every float16 gradient and
    # trained nothing, silently.
    "1e-30": (tf.float32, 4.0, lambda v: 1e-30, "[1e-30]"),
    "below_2**-24": (tf.float32, 4.0, lambda v: 2.0 ** -25, "[2.98023"),
    "float32_max": (tf.float32, 4.0, lambda v: FLOAT32_MAX, "[3.40282"),
}


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("bad", sorted(_BAD_SCALES))
def test_custom_scale_outside_the_range_fails_the_run_and_moves_nothing(graph, path, bad):
    """Before: the builder applied NaN weights at 0, NaN and inf skipped every
    step without a word, a subnormal scale or inverse was taken."""
    dtype, good, make_bad, printed = _BAD_SCALES[bad]
    manager = _StoredScale(good, dtype)
    optimizer = tf.train.AdamOptimizer(0.1)
    update, model = _build(manager, path, optimizer)
    spoil = manager.scale.assign(make_bad(manager.scale))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(update, model.feed)  # a good step: the check lets it through
        before = _state(sess, model, optimizer)
        assert before[-1] == 1
        sess.run(spoil)
        with pytest.raises(tf.errors.InvalidArgumentError) as error:
            sess.run(update, model.feed)
        after = _state(sess, model, optimizer)
    _message_has(error, "_StoredScale", "outside [2**-24, 2**126]",
                 "tf.clip_by_value(new_scale, 1.0, 2.0 ** 64)", printed)
    for old, new in zip(before, after):
        assert old.tobytes() == new.tobytes()


def test_the_range_is_where_the_scale_and_its_inverse_are_normal():
    """SCALE_RANGE's ends are float32's smallest normal and its inverse. TF
    reads a subnormal as 0: one binade outside, the scale (below) or
    ``tf.reciprocal`` of it (above) is 0 in TF, while both ends are exact."""
    from npu_lossscale.core.gradients import SCALE_RANGE  # pylint: disable=import-outside-toplevel
    low, high = SCALE_RANGE
    assert low == np.finfo(np.float32).tiny and high == 1 / low
    with tf.Graph().as_default():
        scales = tf.constant([low / 2, low, high, high * 2], tf.float32)
        with tf.Session() as sess:
            seen, inverse = sess.run([scales + 0.0, tf.reciprocal(scales)])
    assert seen.tolist() == [0.0, low, high, high * 2]
    assert inverse.tolist() == [float("inf"), high, low, 0.0]


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("scale", [2.0 ** -20, 2.0 ** 100])
def test_custom_scale_below_one_is_accepted_and_trains_exactly(path, scale):
    """A scale below 1 is legitimate (PyTorch's GradScaler may back off below
    1); with float32 gradients and a power of two, scaling and unscaling are
    exact: three steps at 2**-20 (and at 2**100) equal an unscaled twin's
    (plain Adam) bit for bit."""
    def run(use_manager):
        with tf.Graph().as_default():
            optimizer = tf.train.AdamOptimizer(0.1)
            if use_manager:
                update, model = _build(_StoredScale(scale), path, optimizer)
            else:
                model = two_group_gan()
                update = optimizer.minimize(
                    model.g_loss, var_list=model.g_vars,
                    global_step=tf.train.get_or_create_global_step())
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                for _ in range(3):
                    sess.run(update, model.feed)
                return _state(sess, model, optimizer)

    scaled, plain = run(True), run(False)
    assert scaled[-1] == 3
    for ours, twin in zip(scaled, plain):
        assert ours.tobytes() == twin.tobytes()


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("scale", [2.0 ** -24, 2.0 ** 126])
def test_custom_scale_at_the_ends_of_the_range_runs(graph, path, scale):
    """The check lets both ends through, and the step applies. Below 2**-24
    (float16's smallest subnormal) a custom manager's scale fails the run
    (issue 32: at 1e-30 every float16 gradient flushed and nothing
    trained, silently)."""
    update, model = _build(_StoredScale(scale), path)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(update, model.feed)
        assert sess.run(tf.train.get_global_step()) == 1


def _check_ops(graph):
    return [op for op in graph.get_operations() if op.type == "Assert"]


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("make", [
    lambda: nl.FixedLossScaleManager(8),
    lambda: nl.DynamicLossScaleManager(),
    lambda: nl.ExponentialUpdateLossScaleManager(2.0 ** 32, 1000),
])
def test_own_managers_get_no_scale_check(graph, path, make):
    _build(make(), path)
    assert _check_ops(graph) == []


@pytest.mark.parametrize("path", ["builder", "optimizer"])
def test_subclasses_and_custom_managers_get_the_check(path):
    class Subclass(nl.DynamicLossScaleManager):
        pass

    for make in [Subclass, lambda: _StoredScale(4.0)]:
        with tf.Graph().as_default() as graph:
            _build(make(), path)
            checks = _check_ops(graph)
            assert [op.name.split("/")[-1] for op in checks] == ["check_scale"], checks


class _DeclaredInRange(_StoredScale):
    """A custom manager (no base class of ours) that declares the promise."""
    keeps_scale_in_range = True


class _InheritsTheDeclaration(_DeclaredInRange):
    """Inherits the attribute but does not set it itself."""


class _DynamicRedeclared(nl.DynamicLossScaleManager):
    keeps_scale_in_range = True


class _DynamicWithOwnRule(nl.DynamicLossScaleManager):
    """Overrides the update: the promise it inherits must not count."""

    def update_loss_scale(self, finite_grads):
        return tf.assign(self.state, [0.0, 0.0, 0.0, 0.0]).op


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("make, checked", [
    (lambda: _DeclaredInRange(4.0), False),
    (lambda: _InheritsTheDeclaration(4.0), True),
    (_DynamicRedeclared, False),
    (_DynamicWithOwnRule, True),
])
def test_the_in_range_promise_counts_in_the_class_that_sets_it(path, make, checked):
    """``keeps_scale_in_range`` is read from the manager's own class only
    (managers.declares_scale_in_range): setting it drops the check for any
    manager, ours or not; a subclass that does not set it again gets the
    check, whether or not it overrides the rule."""
    with tf.Graph().as_default() as graph:
        manager = make()
        assert nl.managers.declares_scale_in_range(manager) is not checked
        _build(manager, path)
        names = [op.name.split("/")[-1] for op in _check_ops(graph)]
        assert names == (["check_scale"] if checked else []), names


def test_an_overridden_rule_that_breaks_the_range_fails_the_run(graph):
    """Why the promise is not inherited: this subclass writes a scale of 0,
    and the inherited declaration would have let it apply NaN updates."""
    update, model = _build(_DynamicWithOwnRule(), "builder")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(update, model.feed)  # the first step reads 2**15, then writes 0
        with pytest.raises(tf.errors.InvalidArgumentError, match="_DynamicWithOwnRule"):
            sess.run(update, model.feed)


@pytest.mark.parametrize("kind", ["dynamic", "exponential"])
def test_own_managers_keep_the_scale_in_range_at_the_extremes(graph, kind):
    """Why our managers need no check: from any state they can reach, the
    scale stays within [min_loss_scale, 2**126] (SCALE_RANGE), at the growth
    ceiling with a huge growth factor (2**20 grows to 2**120, then stops: the
    next product overflows) and at the floor with a tiny back-off."""
    if kind == "dynamic":
        manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 20,
                                             growth_steps=1, multiplier=2.0 ** 100)
    else:
        manager = nl.ExponentialUpdateLossScaleManager(
            2.0 ** 20, 1, decr_every_n_nan_or_inf=1, incr_ratio=2.0 ** 100,
            decr_ratio=1e-30)
    finite = tf.placeholder(tf.bool, [])
    update = manager.update_loss_scale(finite)
    pattern = [True] * 3 + [False] * 5 + [True] * 4 + [False] * 3
    seen = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for value in pattern:
            sess.run(update, {finite: value})
            scale = float(sess.run(manager.loss_scale))
            assert 1.0 <= scale <= nl.managers.SCALE_RANGE[1], (value, scale)
            seen.append(scale)
        assert max(seen) == 2.0 ** 120
        # The floor was reached, and the ceiling held off growth past float32.
        assert scale == 1.0


# -- feeding the step's scale ------------------------------------------------------

def _scale_tensors(graph):
    """The step's scale tensors: the snapshot every use reads and its inverse."""
    return [op.outputs[0] for op in graph.get_operations()
            if (op.type, op.name.split("/")[-1]) in (("Snapshot", "scale"),
                                                     ("Reciprocal", "inv_scale"))]


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("fed", [0.0, 1.0])
def test_the_steps_scale_cannot_be_fed_and_can_be_fetched(graph, path, fed):
    """Before: feeding train.loss_scale=0 applied NaN weights with is_finite
    True (and 1.0 silently trained at another scale). Now session.run refuses
    the feed (TF's ValueError, "may not be fed") before anything runs, for the
    snapshot and its inverse; fetching them still works."""
    manager = nl.DynamicLossScaleManager(1024.0)
    optimizer = tf.train.AdamOptimizer(0.1)
    if path == "builder":
        model = two_group_gan()
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(model.g_loss, optimizer, var_list=model.g_vars, name="g")
        train = scaler.build(global_step=tf.train.get_or_create_global_step())
        update, loss_scale = train.update_op, train.loss_scale
    else:
        update, model = _build(manager, path, optimizer)
        loss_scale = None
    tensors = _scale_tensors(graph)
    assert len(tensors) == 2, tensors
    if loss_scale is not None:
        assert loss_scale in tensors
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        before = _state(sess, model, optimizer)
        for tensor in tensors:
            assert not graph.is_feedable(tensor)
            feed = dict(model.feed)
            feed[tensor] = fed
            with pytest.raises(ValueError, match="may not be fed"):
                sess.run(update, feed)
        assert [a.tobytes() for a in _state(sess, model, optimizer)] == [
            b.tobytes() for b in before]
        assert sess.run(tensors) == [1024.0, 1.0 / 1024]
        sess.run(update, model.feed)
        assert sess.run(tf.train.get_global_step()) == 1


@pytest.mark.parametrize("path", ["builder", "optimizer"])
def test_a_custom_managers_own_scale_fed_is_checked(graph, path):
    """A custom manager's own tensor may be fed (a placeholder may be its
    design); a fed 0 fails the run at the scale check, and nothing moves."""
    manager = _StoredScale(4.0)
    optimizer = tf.train.AdamOptimizer(0.1)
    update, model = _build(manager, path, optimizer)
    (check,) = _check_ops(graph)
    raw = [t for t in check.inputs if t.dtype == tf.float32]  # the scale it reads
    assert len(raw) == 1 and graph.is_feedable(raw[0])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        before = _state(sess, model, optimizer)
        feed = dict(model.feed)
        feed[raw[0]] = 0.0
        with pytest.raises(tf.errors.InvalidArgumentError, match="outside"):
            sess.run(update, feed)
        assert [a.tobytes() for a in _state(sess, model, optimizer)] == [
            b.tobytes() for b in before]


# -- the constructors' arguments: each refused with the argument, the value and the fix --

@pytest.mark.parametrize("kwargs, fragments", [
    (dict(loss_scale=0.5), ["loss_scale", "0.5", "power of two"]),
    (dict(loss_scale="8"), ["loss_scale", "'8'"]),
])
def test_fixed_manager_rejects(graph, kwargs, fragments):
    error = TypeError if isinstance(kwargs["loss_scale"], str) else ValueError
    with _raises(error, *fragments):
        nl.FixedLossScaleManager(**kwargs)


@pytest.mark.parametrize("kwargs, error, fragments", [
    (dict(init_loss_scale=0.5, incr_every_n_steps=10), ValueError, ["init_loss_scale", "0.5"]),
    (dict(init_loss_scale=8, incr_every_n_steps=0), ValueError, ["incr_every_n_steps", "0"]),
    (dict(init_loss_scale=8, incr_every_n_steps=2.5), TypeError, ["incr_every_n_steps", "2.5"]),
    (dict(init_loss_scale=8, incr_every_n_steps=10, incr_ratio=1), ValueError, ["incr_ratio", "1"]),
    (dict(init_loss_scale=8, incr_every_n_steps=10, incr_ratio=0.5), ValueError, ["incr_ratio"]),
    (dict(init_loss_scale=8, incr_every_n_steps=10, decr_ratio=1.0), ValueError, ["decr_ratio", "1.0"]),
    (dict(init_loss_scale=8, incr_every_n_steps=10, decr_ratio=0), ValueError, ["decr_ratio", "0"]),
    (dict(init_loss_scale=8, incr_every_n_steps=10, decr_every_n_nan_or_inf=0), ValueError,
     ["decr_every_n_nan_or_inf"]),
    (dict(init_loss_scale=2.0 ** 32, incr_every_n_steps=10, max_loss_scale=2.0 ** 24),
     ValueError, ["init_loss_scale", "max_loss_scale"]),
])
def test_exponential_manager_rejects(graph, kwargs, error, fragments):
    with _raises(error, *fragments):
        nl.ExponentialUpdateLossScaleManager(**kwargs)


@pytest.mark.parametrize("kwargs, error, fragments", [
    (dict(initial_scale=0.25), ValueError, ["initial_scale", "0.25"]),
    (dict(growth_steps=0), ValueError, ["growth_steps", "0"]),
    (dict(multiplier=1.0), ValueError, ["multiplier", "1.0"]),
    (dict(min_loss_scale=2.0 ** -127), ValueError, ["min_loss_scale", "5.877"]),
    (dict(hysteresis=0), ValueError, ["hysteresis", "0"]),
    (dict(hysteresis=1.5), TypeError, ["hysteresis", "1.5"]),
    (dict(max_loss_scale=2.0 ** 10), ValueError, ["initial_scale", "max_loss_scale"]),
    (dict(floor_warning_after=0), ValueError, ["floor_warning_after", "0", "None"]),
])
def test_dynamic_manager_rejects(graph, kwargs, error, fragments):
    with _raises(error, *fragments):
        nl.DynamicLossScaleManager(**kwargs)
