"""The seams and the skips, misused as users misuse them (issue 44): each
misuse gets a clear error at build time (or at run time where only the run
can know), or works; docs/errors.md says what each gets.

Each test holds the step against an independent reference: hand-computed
gradients and norms, TF's own ops, a counter of the user's.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import seams

#: ``_net``'s gradient: ``C`` itself, global norm 50.
C = np.array([30.0, 40.0], np.float32)


def _net(name="w"):
    """A float32 ``w`` of two elements and the loss ``w . C`` (gradient
    ``C``, norm 50), fed nothing."""
    w = tf.get_variable(name, initializer=np.array([1.0, 2.0], np.float32))
    return w, tf.reduce_sum(w * tf.constant(C))


class NormAbove(seams.SkipCondition):
    """Skips when the global norm of the gradients it sees exceeds
    ``limit``; remembers the norm it saw."""

    reason = "norm_above_limit"
    fix = "the gradient norm exceeds the limit: lower the learning rate."

    def __init__(self, limit):
        self.limit = limit
        self.norm = None

    def flag(self, state):
        self.norm = tf.global_norm([grad for pairs in state.grads.values()
                                    for grad, _ in pairs])
        return tf.cast(self.norm > self.limit, tf.float32)


class ReportNorm(seams.StepObserver):
    """Reports the global norm of the gradients it sees."""

    def report(self, state):
        return tf.global_norm([grad for pairs in state.grads.values() for grad, _ in pairs])


@pytest.mark.parametrize("clip_norm", [None, 1.0], ids=["unclipped", "clip_norm"])
@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_conditions_observers_and_grads_and_vars_see_the_unclipped_gradients(
        graph, clip_norm, accumulation_steps):
    """Issue 44: the clip was fused into the unscale, so a condition on the
    norm of ``state.grads`` saw the clipped norm (1) and never fired on a
    norm-50 gradient, while with accumulation it saw the unclipped one. Now
    conditions, observers' reports and ``TrainOps.grads_and_vars`` all see
    this run's unscaled gradients before any transform: norm 50 in every
    case, and the condition skips."""
    w, loss = _net()
    condition = NormAbove(10.0)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 8), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net",
               clip_norm=clip_norm)
    train = scaler.build(accumulation_steps=accumulation_steps, skip_conditions=[condition],
                         observers=[ReportNorm()])
    fields = tf.global_norm([grad for grad, _ in train.grads_and_vars["net"]])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(accumulation_steps):
            seen, reported, listed, applied = sess.run(
                [condition.norm, train.observed["ReportNorm"], fields, train.applied,
                 train.update_op])[:4]
            assert seen == reported == listed == pytest.approx(50.0, rel=1e-6)
        assert not applied
        np.testing.assert_array_equal(sess.run(w), [1.0, 2.0])


def _counter(name):
    return tf.Variable(0, dtype=tf.int64, trainable=False, use_resource=True, name=name)


class CountSkips(seams.StepObserver):
    """Counts skipped steps in ``on_skip``, through ``wrap`` (which gets
    ``make``, a function making the count's update, and returns what the
    hook returns)."""

    def __init__(self, wrap, premade):
        self.count = _counter("skips")
        self.wrap = wrap
        self.premade = tf.assign_add(self.count, 1) if premade else None

    def on_skip(self, state):
        return self.wrap(self.premade if self.premade is not None
                         else tf.assign_add(self.count, 1))


#: Ways to hand back an update made before the hook, each of which would
#: run it on every step.
BYPASSES = {
    "tf.group": lambda update: [tf.group(update)],
    "control_dependencies": lambda update: _after(update),
    "identity": lambda update: [tf.identity(update)],
    "nested tf.group": lambda update: tf.group(tf.group(update), tf.no_op()),
}


def _after(update):
    with tf.control_dependencies([update]):
        return [tf.no_op()]


def _skipping_net(observers=(), conditions=()):
    """``_net`` with a flag fed as ``skip``; returns (w, skip, train)."""
    w, loss = _net()
    skip = tf.placeholder_with_default(0.0, [], name="skip")
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    scaler.add(loss * (1.0 + skip), tf.train.GradientDescentOptimizer(0.1), var_list=[w])
    return w, skip, scaler.build(observers=list(observers), skip_conditions=list(conditions))


class Fed(seams.SkipCondition):
    """Skips where ``flag_of(state)``'s value is not 0.0."""

    reason = "fed"
    fix = "it was fed."

    def __init__(self, flag_of, on_apply=None):
        self.flag_of = flag_of
        self.applies = on_apply

    def flag(self, state):
        return self.flag_of(state)

    def on_apply(self, state):
        return [] if self.applies is None else self.applies(state)


@pytest.mark.parametrize("wrap", sorted(BYPASSES))
def test_an_update_made_before_on_skip_is_refused_through_any_wrapper(graph, wrap):
    """Issue 44: ``tf.group(premade)`` passed the made-before check, and
    the premade count then ran on every step (4 after 1 skip)."""
    with pytest.raises(ValueError, match=r"CountSkips\.on_skip returned .* which runs "
                                         r"'skips/AssignAddVariableOp|CountSkips\.on_skip "
                                         r"returned .* an op made before"):
        _skipping_net(observers=[CountSkips(BYPASSES[wrap], premade=True)])


@pytest.mark.parametrize("wrap", sorted(BYPASSES))
def test_an_update_made_inside_on_skip_runs_only_on_skipped_steps(graph, wrap):
    """The same wrappers around an update made inside the hook: accepted,
    and the count is the number of skipped steps."""
    observer = CountSkips(BYPASSES[wrap], premade=False)
    grads = lambda state: tf.cast(tf.reduce_any(tf.stack(
        [tf.reduce_any(g > 100.0) for pairs in state.grads.values() for g, _ in pairs])),
        tf.float32)
    _, skip, train = _skipping_net(observers=[observer], conditions=[Fed(grads)])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        applied = [sess.run([train.update_op, train.applied], {skip: value})[1]
                   for value in (0.0, 9.0, 0.0, 0.0)]
        assert applied == [True, False, True, True]
        assert sess.run(observer.count) == 1


def test_an_update_made_before_on_apply_is_refused(graph):
    """``SkipCondition.on_apply`` gets the same check."""
    count = _counter("applies")
    premade = tf.assign_add(count, 1)
    condition = Fed(lambda state: tf.constant(0.0), on_apply=lambda state: [tf.group(premade)])
    with pytest.raises(ValueError, match=r"Fed\.on_apply returned .* which runs "):
        _skipping_net(conditions=[condition])


def test_a_float32_variable_is_a_flag(graph):
    """Issue 44: a float32 scalar variable as the flag got "return a
    float32 scalar tensor". It is read: the step skips while it holds 1.0."""
    held = tf.Variable(0.0, trainable=False, name="held")
    w, _, train = _skipping_net(conditions=[Fed(lambda state: held)])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.applied])[1]
        sess.run(held.assign(1.0))
        after = sess.run(w)
        assert not sess.run([train.update_op, train.applied])[1]
        np.testing.assert_array_equal(sess.run(w), after)


@pytest.mark.parametrize("make, fix", [
    (lambda: tf.placeholder(tf.float32, None, name="any_shape"), r"tf\.reshape\(flag, \[\]\)"),
    (lambda: tf.Variable(0, name="count"), r"tf\.cast\(flag, tf\.float32\)"),
    (lambda: tf.zeros([3]), r"tf\.reduce_max\(flag\)"),
    (lambda: True, r"tf\.cast\(skip, tf\.float32\)"),
], ids=["unknown_shape", "int_variable", "vector", "python_bool"])
def test_a_wrong_flag_is_told_what_to_change(graph, make, fix):
    """A flag of unknown shape, of another dtype, of several values or no
    tensor: the message says the change that makes it a flag."""
    value = make()
    with pytest.raises(TypeError, match=r"^skip condition 'Fed' returned .* return a float32 "
                                        r"scalar tensor \(0\.0 to apply\): .*" + fix):
        _skipping_net(conditions=[Fed(lambda state: value)])


def _requested(skip_global_steps, count_skipped_steps=False):
    """``_net`` with a global step and ``skip_global_steps``; returns
    (w, global_step, train)."""
    w, loss = _net()
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w])
    return w, gs, scaler.build(global_step=gs, skip_global_steps=skip_global_steps,
                               count_skipped_steps=count_skipped_steps)


def test_a_bool_variable_as_skip_global_steps_is_read_on_each_run(graph):
    """Issue 44: a bool variable failed with "Iterating over a symbolic
    tf.Tensor" (a resource variable is no tf.Variable of compat.v1). It is
    read each run: the step skips while it holds True."""
    hold = tf.Variable(False, trainable=False, name="hold")
    w, gs, train = _requested(hold)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.applied])[1]
        sess.run(hold.assign(True))
        before = sess.run(w)
        assert not sess.run([train.update_op, train.applied])[1]
        np.testing.assert_array_equal(sess.run(w), before)
        sess.run(hold.assign(False))
        assert sess.run([train.update_op, train.applied])[1] and sess.run(gs) == 2


@pytest.mark.parametrize("fed, count_skipped_steps, want", [
    ("loop count", False, [True, True, False, True, True]),
    ("global_step", True, [True, True, False, True, True]),
    ("global_step", False, [True, True, False, False, False]),
])
def test_a_skip_computed_from_a_fed_step(graph, fed, count_skipped_steps, want):
    """Issue 44: a tensor computed from a step fed from Python cannot be
    traced to ``global_step`` at build time. Fed the loop's own count, or
    ``global_step`` with ``count_skipped_steps=True``, it skips step 2
    once; fed ``global_step`` with the default False, step 2 comes back
    and skips forever, as docs/features.md says."""
    step = tf.placeholder(tf.int64, [], name="fed_step")
    _, gs, train = _requested(tf.equal(step, 2), count_skipped_steps)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        got = []
        for count in range(5):
            value = count if fed == "loop count" else sess.run(gs)
            got.append(sess.run([train.update_op, train.applied], {step: value})[1])
    assert got == want


class ScaleAbove(seams.SkipCondition):
    """Skips while the scale read by ``read(state)`` exceeds 100."""

    reason = "scale_above_100"
    fix = "the scale is above 100."

    def __init__(self, read, moves_scale):
        self.read = read
        self.moves_scale = moves_scale

    def flag(self, state):
        return tf.cast(tf.cast(self.read(state), tf.float32) > 100.0, tf.float32)


def _dynamic_net(conditions):
    """``_net`` under a dynamic manager starting at 2**10; returns
    (manager, train)."""
    w, loss = _net()
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 10, growth_steps=1000)
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w])
    return manager, scaler.build(skip_conditions=conditions)


@pytest.mark.parametrize("read", [
    lambda state: list(state.scales.values())[0].value,
    lambda state: 1.0 / list(state.scales.values())[0].inverse,
    lambda state: state.plan.groups[0].manager.get_loss_scale(),
], ids=["scale", "inverse", "manager"])
def test_a_flag_from_the_scale_that_holds_the_scale_is_refused(graph, read):
    """Issue 44: with ``moves_scale=False`` a flag computed from the scale
    skips, the scale stays, and it skips every step after, quietly."""
    with pytest.raises(ValueError, match=r"^skip condition 'ScaleAbove': its flag .* is "
                                         r"computed from the loss scale and moves_scale is "
                                         r"False.* Set moves_scale = True"):
        _dynamic_net([ScaleAbove(read, moves_scale=False)])


def test_a_flag_from_the_scale_that_moves_the_scale_backs_off(graph):
    """With ``moves_scale=True`` the same flag is accepted: each skip
    halves the scale, from 1024 down to 64, where the steps apply."""
    class ScaleAboveBacksOff(ScaleAbove):
        reason = "scale_above_100_backs_off"

    manager, train = _dynamic_net([ScaleAboveBacksOff(
        lambda state: list(state.scales.values())[0].value, moves_scale=True)])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        applied = [sess.run([train.update_op, train.applied])[1] for _ in range(6)]
        assert applied == [False, False, False, False, True, True]
        assert sess.run(manager.loss_scale) == 64.0


class CountHooks(seams.StepObserver):
    """Counts the runs that reach its ``before_update`` and its ``on_skip``
    (ops made inside each hook)."""

    def __init__(self):
        self.updates = _counter("observed_updates")
        self.skips = _counter("observed_skips")

    def before_update(self, state):
        return seams.Hooked([tf.assign_add(self.updates, 1).op])

    def on_skip(self, state):
        return [tf.assign_add(self.skips, 1).op]


def test_observers_observe_the_per_group_ops(graph):
    """Issue 44: observers passed with ``per_group_ops=True`` were accepted
    and never called by the per-group ops. An alternating loop's runs now
    reach them: two of four runs skip (one per-group, one joint)."""
    observer = CountHooks()
    poison = tf.placeholder_with_default(1.0, [], name="poison")
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    for name in ("a", "b"):
        w, loss = _net(name)
        scaler.add(loss * poison, tf.train.GradientDescentOptimizer(0.1), var_list=[w],
                   name=name)
    train = scaler.build(per_group_ops=True, observers=[observer])
    runs = [(train.per_group["a"], 1.0), (train.per_group["b"], np.inf),
            (train.update_op, np.inf), (train.per_group["a"], 1.0)]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for op, value in runs:
            sess.run(op, {poison: value})
        assert sess.run([observer.updates, observer.skips]) == [4, 2]


class DivideByNorm(seams.GradientTransform):
    """Divides each gradient by its norm: 0 / 0 = NaN for a zero one."""

    def transform(self, group, grads_and_vars):
        return [(grad / tf.norm(grad), var) for grad, var in grads_and_vars]


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_a_transforms_own_nan_is_diagnosed_as_the_transforms(graph, accumulation_steps):
    """Issue 44: a transform's NaN on finite gradients was diagnosed as a
    float16 gradient overflow (``gradients_overflowed``). Its reason names
    it (``DivideByNorm_not_finite``), with its group; gradients that
    overflow before it are still ``gradients_overflowed``."""
    from npu_lossscale import diagnostics  # pylint: disable=import-outside-toplevel
    w, loss = _net()
    gain = tf.placeholder_with_default(1.0, [], name="gain")
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 8), backend="is_finite")
    scaler.add(loss * gain, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net",
               transform_grads_fn=DivideByNorm())
    train = scaler.build(accumulation_steps=accumulation_steps)
    fetches = [train.update_op, train.applied]

    def window(value):
        for _ in range(accumulation_steps):
            applied = sess.run(fetches, {gain: value})[1]
        return applied, diagnostics.read_last_skip(sess, train)

    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert window(1.0)[0]
        applied, skip = window(0.0)  # a zero gradient: its norm is 0
        assert not applied and skip.reason == "DivideByNorm_not_finite"
        assert tuple(skip.groups) == ("net",)
        assert "DivideByNorm returned inf or NaN" in diagnostics.describe(skip)
        applied, skip = window(np.inf)
        assert not applied and skip.reason in ("gradients_overflowed", "loss_not_finite")


class CountCalls(seams.GradientTransform):
    """Passes the gradients on, counting its runs in a variable of its own
    (state a transform keeps); counts its ``transform`` calls at build."""

    keeps_finite = True

    def __init__(self):
        self.runs = _counter("transform_runs")
        self.calls = 0

    def transform(self, group, grads_and_vars):
        self.calls += 1
        with tf.control_dependencies([tf.assign_add(self.runs, 1)]):
            return [(tf.identity(grad), var) for grad, var in grads_and_vars]


def test_a_transforms_own_state_moves_on_skipped_steps_too(graph):
    """Issue 44, as docs/extending.md says: a transform's ops run before the
    gate decides, so its own state moves on a skipped step too (three runs,
    one skipped: three counts), and a ``per_group_ops`` op calls it again
    (a second copy of its ops)."""
    transform = CountCalls()
    w, loss = _net()
    poison = tf.placeholder_with_default(1.0, [], name="poison")
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    scaler.add(loss * poison, tf.train.GradientDescentOptimizer(0.1), var_list=[w],
               transform_grads_fn=transform)
    train = scaler.build(per_group_ops=True)
    assert transform.calls == 2
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        applied = [sess.run([train.update_op, train.applied], {poison: value})[1]
                   for value in (1.0, np.inf, 1.0)]
        assert applied == [True, False, True]
        assert sess.run(transform.runs) == 3


@pytest.mark.parametrize("clip_norm", [None, 1.0], ids=["unclipped", "clip_norm"])
def test_with_towers_conditions_see_the_towers_combined_gradients(graph, clip_norm):
    """Two in-graph towers, gradients 2C and 0: the condition, the
    observer and ``grads_and_vars`` see their mean C (norm 50), clipped or
    not, and the condition skips."""
    w = tf.get_variable("w", initializer=np.array([1.0, 2.0], np.float32))
    towers = [tf.reduce_sum(w * tf.constant(2.0 * C)), tf.reduce_sum(w * tf.zeros([2]))]
    condition = NormAbove(10.0)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 8), backend="is_finite")
    scaler.add(towers, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net",
               clip_norm=clip_norm)
    train = scaler.build(skip_conditions=[condition], observers=[ReportNorm()])
    fields = tf.global_norm([grad for grad, _ in train.grads_and_vars["net"]])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        seen, reported, listed, applied = sess.run(
            [condition.norm, train.observed["ReportNorm"], fields, train.applied,
             train.update_op])[:4]
        assert seen == reported == listed == pytest.approx(50.0, rel=1e-6)
        assert not applied
        np.testing.assert_array_equal(sess.run(w), [1.0, 2.0])


def test_a_flag_from_the_global_step_a_manager_holds_is_no_flag_from_the_scale(graph):
    """A manager that keeps the global step as an attribute (a schedule of
    its own) does not make ``skip_global_steps`` a flag from the scale:
    the requested step skips, once."""
    w, loss = _net()
    gs = tf.train.get_or_create_global_step()

    class Scheduled(object):
        """A manager of the user's: its state is its attributes."""

        def __init__(self):
            self.scale = tf.Variable(2.0 ** 10, trainable=False, use_resource=True)
            self.schedule_step = gs

        def get_loss_scale(self):
            return self.scale.read_value()

        def update_loss_scale(self, finite_grads):
            return tf.assign(self.scale, tf.where(finite_grads, self.scale.read_value(),
                                                  self.scale.read_value() / 2.0)).op

    scaler = nl.MultiOptimizerLossScale(Scheduled(), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w])
    train = scaler.build(global_step=gs, skip_global_steps=[1], count_skipped_steps=True)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert [sess.run([train.update_op, train.applied])[1] for _ in range(3)] == [
            True, False, True]


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_a_transforms_own_nan_holds_the_scale(graph, accumulation_steps):
    """Issue 44: a transform's NaN on finite gradients halved the loss
    scale, though the scale was not at fault. The managers now hold on it
    (2**8 stays 2**8), and an overflow of the gradients themselves still
    halves the scale (2**8 -> 2**7), as without a transform."""
    from npu_lossscale import diagnostics  # pylint: disable=import-outside-toplevel
    w, loss = _net()
    gain = tf.placeholder_with_default(1.0, [], name="gain")
    scaler = nl.MultiOptimizerLossScale(
        nl.DynamicLossScaleManager(initial_scale=2.0 ** 8, growth_steps=1000),
        backend="is_finite")
    scaler.add(loss * gain, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net",
               transform_grads_fn=DivideByNorm())
    train = scaler.build(accumulation_steps=accumulation_steps)

    def window(value):
        for _ in range(accumulation_steps):
            applied = sess.run([train.update_op, train.applied], {gain: value})[1]
        return applied, sess.run(train.loss_scale), diagnostics.read_last_skip(sess, train)

    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert window(1.0)[:2] == (True, 2.0 ** 8)
        applied, scale, skip = window(0.0)  # a zero gradient: its norm is 0
        assert (applied, skip.reason) == (False, "DivideByNorm_not_finite")
        assert scale == 2.0 ** 8 and "The loss scale held." in diagnostics.describe(skip)
        applied, scale, skip = window(np.inf)
        assert not applied and skip.reason in ("gradients_overflowed", "loss_not_finite")
        assert scale == 2.0 ** 7
