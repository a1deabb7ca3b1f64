"""The four seams (npu_lossscale/seams.py), each extended here, in the test
file, with no edit to the library, and plugged in through the public API:
a GradientTransform (add(transform_grads_fn=...)), a SkipCondition with a
reason of its own (build(skip_conditions=...)), a StepObserver
(build(observers=...), TrainOps.observed) and a ReductionEngine
(MultiOptimizerLossScale(distributed=...)).

The classes are the ones docs/extending.md shows; the last tests run its
examples and check that they define these classes, word for word.
"""

import ast
import collections
import contextlib
import inspect
import io
import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import diagnostics, seams
from conftest import GRAPH_MODE
from readme_blocks import block


@pytest.fixture(autouse=True)
def _reasons_untouched():
    """A build keeps the reasons of its own conditions in its record: the
    shipped ones, which every test file reads, are the same after each test."""
    before = (diagnostics.REASONS, diagnostics.FIXES, diagnostics.HOLDING_REASONS)
    yield
    assert (diagnostics.REASONS, diagnostics.FIXES, diagnostics.HOLDING_REASONS) == before


# -- the classes of docs/extending.md --

class Halve(seams.GradientTransform):
    """Halves a group's gradients: finite in, finite out, so the step
    need not check what it returns."""

    keeps_finite = True

    def transform(self, group, grads_and_vars):
        return [(0.5 * grad, var) for grad, var in grads_and_vars]


class SkipNegativeLoss(seams.SkipCondition):
    """Skips a step on which a group's loss is negative."""

    reason = "negative_loss"
    fix = "the loss went negative: check the data."

    def flag(self, state):
        losses = [tf.cast(group.loss, tf.float32) for group in state.plan.groups]
        return tf.cast(tf.reduce_any(tf.stack(losses) < 0.0), tf.float32)


class CountSkips(seams.StepObserver):
    """Counts the skipped steps in a variable of its own, and reports the
    global norm of the unscaled gradients."""

    def __init__(self):
        self.skips = tf.Variable(0.0, trainable=False, use_resource=True,
                                 name="observed_skips")

    def on_skip(self, state):
        return [tf.assign_add(self.skips, 1.0).op]

    def report(self, state):
        return tf.global_norm([grad for pairs in state.grads.values() for grad, _ in pairs])


class LoopbackPeer(seams.ReductionEngine):
    """A second worker, simulated: its overflow flag is fed, and its
    gradients are three times ours, so their mean is twice ours."""

    mode = "workers"

    def __init__(self):
        self.peer_flag = tf.placeholder_with_default(0.0, [], name="peer_flag")
        self.calls = 0

    def reduce(self, flags, grads, allreduce_gradients):
        self.calls += 1
        flags = collections.OrderedDict(
            (name, flag + self.peer_flag) for name, flag in flags.items())
        if allreduce_gradients:
            grads = collections.OrderedDict(
                (name, [((grad + 3.0 * grad) / 2.0, var) for grad, var in pairs])
                for name, pairs in grads.items())
        return flags, grads


# -- a model whose numbers are checked by hand --

def _linear():
    """A float16 loss ``w . c`` over a float32 ``w = [1, 2]``: its gradient
    is ``c`` (fed, default [3, 4]), exact at any power-of-two scale."""
    c = tf.placeholder_with_default(np.array([3.0, 4.0], np.float32), [2], name="c")
    w = tf.get_variable("w", initializer=np.array([1.0, 2.0], np.float32))
    loss = tf.cast(tf.reduce_sum(tf.cast(w, tf.float16) * tf.cast(c, tf.float16)), tf.float32)
    return c, w, loss


def _step(transform=None, manager=None, distributed=None, **build_kwargs):
    """One group "net" (SGD 0.5) over ``_linear``, a global step.
    Returns (c, w, manager, global_step, train)."""
    c, w, loss = _linear()
    manager = manager or nl.DynamicLossScaleManager(initial_scale=2.0 ** 10)
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(manager, distributed=distributed)
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.5), var_list=[w], name="net",
               transform_grads_fn=transform)
    return c, w, manager, gs, scaler.build(global_step=gs, **build_kwargs)


def _session():
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    return sess


# -- what the hooks are given: the seams' own records --

class _Seen(seams.StepObserver, seams.GradientTransform):
    """Keeps the state each hook is given, and the group a transform is."""

    keeps_finite = True

    def __init__(self):
        self.states, self.groups = [], []

    def transform(self, group, grads_and_vars):
        self.groups.append(group)
        return grads_and_vars

    def before_update(self, state):
        self.states.append(state)

    def on_skip(self, state):
        self.states.append(state)


def test_the_hooks_are_given_the_seams_own_records(graph):
    seen = _Seen()
    c, w, manager, gs, train = _step(seen, observers=[seen])
    before, closed = seen.states
    assert isinstance(before.plan, seams.PlanView)
    assert before.plan.group_names == ("net",)
    group = before.plan.group("net")
    assert isinstance(group, seams.GroupView) and seen.groups == [group]
    assert (group.var_list, group.manager, group.checked) == ((w,), manager, True)
    assert [(use.name, use.manager, use.groups) for use in before.plan.managers] == [
        ("shared", manager, ("net",))]
    assert (before.plan.gate_kind, before.global_step) == ("pivot", gs)
    assert isinstance(before.plan.engine, seams.ReductionEngine)
    assert [type(scale) for scale in before.scales.values()] == [seams.ScaleView]
    assert list(before.loss_scales) == ["net"]
    assert before.loss_scales["net"] is before.scales["shared"].value
    assert isinstance(closed.closing, seams.CloseView) and closed.closing.mean_over == 1
    assert list(closed.reduced_flags) == list(before.flags) == ["shared"]
    with _session() as sess:
        assert sess.run(before.loss_scales["net"]) == 1024.0


# -- GradientTransform --

def test_a_gradient_transform_of_the_users(graph):
    # Gradient [3, 4], halved: SGD(0.5) takes [1, 2] to [0.25, 1].
    c, w, _, _, train = _step(Halve())
    with _session() as sess:
        sess.run(train.update_op)
        assert sess.run(w).tolist() == [0.25, 1.0]


class _Times(seams.GradientTransform):
    """Multiplies the gradients by a fed factor; records the group it was
    called for."""

    def __init__(self, keeps_finite):
        self.keeps_finite = keeps_finite
        self.factor = tf.placeholder_with_default(1.0, [], name="factor")
        self.groups = []

    def transform(self, group, grads_and_vars):
        self.groups.append(group.name)
        return [(grad * self.factor, var) for grad, var in grads_and_vars]


class _Third(seams.GradientTransform):
    """Divides the gradients by 3; with ``fused`` it also offers that as
    ``unscale_factor``, which the step then uses instead of ``transform``."""

    keeps_finite = True

    def __init__(self):
        self.transform_calls = 0

    def transform(self, group, grads_and_vars):
        self.transform_calls += 1
        return [(grad / 3.0, var) for grad, var in grads_and_vars]


class _FusedThird(_Third):

    def unscale_factor(self, group, scaled_pairs, inverse):
        return inverse / 3.0


def test_an_overridden_unscale_factor_is_one_multiply_with_the_unscale(graph):
    # Gradient [3, 4] / 3 = [1, 4/3]; SGD(0.5): w = [1 - 0.5, 2 - 2/3].
    assert _FusedThird.fuses_with_unscale() and not _Third.fuses_with_unscale()
    results = []
    for kind in (_Third, _FusedThird):
        with tf.Graph().as_default():
            transform = kind()
            _, w, _, _, train = _step(transform)
            with _session() as sess:
                sess.run(train.update_op)
                results.append(sess.run(w))
        assert transform.transform_calls == (1 if kind is _Third else 0)
    np.testing.assert_allclose(results[0], [0.5, 2.0 - 2.0 / 3.0], rtol=1e-6)
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6)


@pytest.mark.parametrize("keeps_finite", [False, True])
def test_keeps_finite_decides_whether_the_step_checks_the_output(graph, keeps_finite):
    transform = _Times(keeps_finite)
    _, w, _, _, train = _step(transform, manager=nl.FixedLossScaleManager(2.0 ** 10))
    assert transform.groups == ["net"]
    with _session() as sess:
        applied = sess.run([train.update_op, train.applied], {transform.factor: np.inf})[1]
        if keeps_finite:  # trusted: nothing checks the output, which applies
            assert applied and np.isinf(sess.run(w)).all()
        else:
            assert not applied and sess.run(w).tolist() == [1.0, 2.0]


# -- SkipCondition --

def test_a_skip_condition_with_a_reason_of_its_own(graph):
    c, w, manager, gs, train = _step(skip_conditions=[SkipNegativeLoss()])
    reasons = diagnostics.reasons_of(train)
    code = reasons.code("negative_loss")
    assert code == len(diagnostics.REASONS)  # the first after the shipped ones
    assert reasons.fix("negative_loss") == "the loss went negative: check the data."
    summaries = nl.summaries(train)
    fetches = [train.update_op, train.applied, train.diagnosis.skip_reason]
    with _session() as sess:
        assert sess.run(fetches)[1:] == [True, 0]
        state, before = sess.run([manager.state, w])
        # w is [-0.5, 0] now: the loss is -1.
        assert sess.run(fetches, {c: [2.0, 0.0]})[1:] == [False, code]
        assert sess.run(w).tolist() == before.tolist()
        assert sess.run(manager.state).tolist() == state.tolist()  # moves_scale False
        assert sess.run([gs, train.skipped_steps]) == [1, 1]
        skip = diagnostics.read_last_skip(sess, train)
        assert (skip.reason, skip.global_step, skip.groups) == ("negative_loss", 1, ())
        assert diagnostics.describe(skip) == (
            "skip #1 at global step 1: negative_loss. Fix: the loss went negative: check "
            "the data.")
        values = dict((value.tag, value.simple_value) for serialized in sess.run(summaries)
                      for value in tf.Summary.FromString(serialized).value)
    assert values["loss_scale/skips_negative_loss"] == 1
    assert values["loss_scale/skips_gradients_overflowed"] == 0


class _NegativeLossMovesScale(SkipNegativeLoss):
    moves_scale = True


def test_a_condition_that_moves_the_scale_counts_as_an_overflow(graph):
    c, w, manager, _, train = _step(skip_conditions=[_NegativeLossMovesScale()])
    with _session() as sess:
        sess.run(train.update_op, {c: [-3.0, 1.0]})
        assert sess.run(manager.state).tolist() == [2.0 ** 9, 0.0, 0.0, 1.0]
        assert diagnostics.read_last_skip(sess, train).reason == "negative_loss"


class _AppliedSteps(SkipNegativeLoss):
    """Also counts the applied steps, in ``on_apply``."""

    def __init__(self):
        self.applied = tf.Variable(0.0, trainable=False, name="applied_steps")

    def on_apply(self, state):
        return [tf.assign_add(self.applied, 1.0).op]


def test_on_apply_runs_only_on_applied_steps(graph):
    condition = _AppliedSteps()
    c, _, _, _, train = _step(skip_conditions=condition)
    with _session() as sess:
        # Losses 11 (applied: w becomes [-0.5, 0]), -1, inf, 0.5 (applied).
        for feed in (None, {c: [2.0, 0.0]}, {c: [np.inf, 1.0]}, {c: [-1.0, 0.0]}):
            sess.run(train.update_op, feed)
        assert sess.run(condition.applied) == 2


class _Returning(seams.SkipCondition):
    reason = "returning"

    def __init__(self, value):
        self.value = value

    def flag(self, state):
        return self.value() if callable(self.value) else self.value


@pytest.mark.parametrize("value", [0.0, lambda: tf.constant(0), lambda: tf.zeros([1])],
                         ids=["float", "int_tensor", "vector"])
def test_refuses_a_flag_that_is_no_float32_scalar(graph, value):
    with pytest.raises(TypeError, match=r"^skip condition '_Returning' returned .* from "
                                        r"flag\(state\); return a float32 scalar tensor"):
        _step(skip_conditions=[_Returning(value)])


def test_refuses_a_condition_without_a_reason(graph):
    class NoReason(seams.SkipCondition):
        def flag(self, state):
            return tf.constant(0.0)

    with pytest.raises(TypeError, match=r"reason and fix must be str, got reason=None"):
        _step(skip_conditions=[NoReason()])


def test_summaries_of_a_step_built_before_a_new_reason(graph):
    _, _, _, _, train = _step()
    with tf.Graph().as_default():
        class LaterReason(SkipNegativeLoss):
            reason = "registered_later"

        _step(skip_conditions=[LaterReason()])
    summaries = nl.summaries(train)
    with _session() as sess:
        sess.run(train.update_op)
        tags = [value.tag for serialized in sess.run(summaries)
                for value in tf.Summary.FromString(serialized).value]
    assert "loss_scale/skips_loss_spike" in tags


# -- StepObserver --

def test_a_step_observer_reports_and_runs_only_on_skipped_steps(graph):
    observer = CountSkips()
    c, _, _, _, train = _step(observers=[observer])
    assert list(train.observed) == ["CountSkips"]
    fetches = [train.update_op, train.applied, train.observed["CountSkips"]]
    with _session() as sess:
        assert sess.run(fetches)[1:] == [True, 5.0]  # the norm of [3, 4]
        assert sess.run(observer.skips) == 0.0
        applied, norm = sess.run(fetches, {c: [60000.0, 0.0]})[1:]  # overflows at 2**10
        assert not applied and np.isinf(norm)
        assert sess.run(observer.skips) == 1.0
        applied, norm = sess.run(fetches, {c: [0.75, 1.0]})[1:]
        assert applied and norm == 1.25
        sess.run(train.update_op, {c: [np.nan, 0.0]})
        assert sess.run(observer.skips) == 2.0
        assert sess.run(train.skipped_steps) == 2


# -- ReductionEngine --

def test_a_reduction_engine_of_the_users(graph):
    engine = LoopbackPeer()
    c, w, manager, gs, train = _step(distributed=engine)
    assert engine.calls == 1
    fetches = [train.update_op, train.applied, train.is_finite, train.diagnosis.skip_reason]
    with _session() as sess:
        # The mean gradient is twice [3, 4]: SGD(0.5) takes [1, 2] to [-2, -2].
        assert sess.run(fetches)[1:] == [True, True, 0]
        assert sess.run(w).tolist() == [-2.0, -2.0]
        # The peer overflowed, this worker did not.
        assert sess.run(fetches, {engine.peer_flag: 1.0})[1:] == [
            False, False, diagnostics.REASONS.index("other_worker_overflowed")]
        assert sess.run(w).tolist() == [-2.0, -2.0]
        assert sess.run(manager.state)[0] == 2.0 ** 9
        assert sess.run(gs) == 1


def test_an_engine_that_averages_nothing_when_told_not_to(graph):
    c, w, loss = _linear()
    engine = LoopbackPeer()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10),
                                        distributed=engine, allreduce_gradients=False)
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.5), var_list=[w])
    train = scaler.build()
    with _session() as sess:
        sess.run(train.update_op)
        assert sess.run(w).tolist() == [-0.5, 0.0]


# -- a class where an instance belongs: each hook refuses it --

def test_each_hook_refuses_a_class(graph):
    c, w, loss = _linear()
    with pytest.raises(TypeError, match=r"distributed=<class '[\w.]*LoopbackPeer'> is a "
                                        r"class; pass an instance, distributed=LoopbackPeer"):
        nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), distributed=LoopbackPeer)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    with pytest.raises(TypeError, match=r"transform_grads_fn=<class '[\w.]*Halve'> is a "
                                        r"class; pass an instance"):
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.5), var_list=[w],
                   transform_grads_fn=Halve)
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.5), var_list=[w])
    for kwargs, pattern in [
            (dict(skip_conditions=[SkipNegativeLoss]),
             r"skip_conditions must be a list of SkipCondition instances, got \[<class "),
            (dict(skip_conditions=SkipNegativeLoss),
             r"skip_conditions must be a list of SkipCondition instances, got <class "),
            (dict(skip_conditions=[CountSkips()]),
             r"skip_conditions must be a list of SkipCondition instances, got \[<"),
            (dict(observers=[CountSkips]),
             r"observers must be a list of StepObserver instances, got \[<class ")]:
        with pytest.raises(TypeError, match=pattern + r".*Pass e\.g\."):
            scaler.build(**kwargs)
    with pytest.raises(ValueError, match=r"observers: two of them are named 'CountSkips'.*"
                                         r"set the instance's name attribute"):
        scaler.build(observers=[CountSkips(), CountSkips()])
    renamed = CountSkips()
    renamed.name = "second"
    # None of the refusals left anything behind; named apart, both report.
    assert sorted(scaler.build(observers=[CountSkips(), renamed]).observed) == [
        "CountSkips", "second"]


# -- what a hook returns, checked where the step takes it --

class _FedFlag(seams.SkipCondition):
    """Skips by a fed flag (0.0 by default)."""

    reason = "fed_flag"
    fix = "the test fed a flag."

    def __init__(self):
        self.value = tf.placeholder_with_default(0.0, [], name="fed_flag")

    def flag(self, state):
        return self.value


@pytest.mark.parametrize("value", [-1.0, np.nan, 0.25])
def test_any_flag_but_zero_skips_and_names_its_reason(graph, value):
    """The gate skips on a flag other than 0.0; the diagnosis says why, for
    a negative or a NaN flag too."""
    condition = _FedFlag()
    _, w, _, _, train = _step(skip_conditions=[condition])
    with _session() as sess:
        before = sess.run(w)
        assert sess.run([train.update_op, train.applied, train.diagnosis.skip_reason],
                        {condition.value: value})[1:] == [
                            False, diagnostics.reasons_of(train).code("fed_flag")]
        assert sess.run(w).tolist() == before.tolist()
        assert diagnostics.read_last_skip(sess, train).reason == "fed_flag"


def test_two_builders_in_one_graph_keep_their_own_reasons(graph):
    """Two builders with conditions of their own, each reason the first
    after the shipped ones (the same code), decode their own names and
    fixes: in the skip record and its history, the summaries and the
    collapse policy (which counts the second, its skips move the scale).
    The reasons travel with each builder's record."""
    class MovesScale(_FedFlag):
        moves_scale = True

    with tf.variable_scope("a"):
        c, _, _, _, negative = _step(skip_conditions=[SkipNegativeLoss()])
    fed = MovesScale()
    with tf.variable_scope("b"):
        _, _, _, _, flagged = _step(skip_conditions=[fed])
    code = len(diagnostics.REASONS)
    assert diagnostics.reasons_of(negative).names[code:] == ("negative_loss",)
    assert diagnostics.reasons_of(flagged).names[code:] == ("fed_flag",)
    assert "negative_loss" in diagnostics.reasons_of(negative).holding
    assert "fed_flag" not in diagnostics.reasons_of(flagged).holding
    summaries = nl.summaries(negative, family="a") + nl.summaries(flagged, family="b")
    monitor = nl.CollapseMonitor(flagged, collapse_after=1, on_collapse="stop")
    with _session() as sess:
        runs = [(negative, {c: [-1.0, -1.0]}), (flagged, {fed.value: 1.0})]
        found = [sess.run([train.update_op, train.diagnosis.skip_reason], feed)[1]
                 for train, feed in runs]
        assert found == [code, code]
        for train, condition in ((negative, SkipNegativeLoss), (flagged, _FedFlag)):
            skip = diagnostics.read_last_skip(sess, train)
            assert (skip.reason, skip.fix) == (condition.reason, condition.fix)
            assert condition.fix in diagnostics.describe(skip)
            recent = diagnostics.read_recent_skips(sess, train)
            assert [(item.reason, item.fix) for item in recent] == [
                (condition.reason, condition.fix)]
        collapse = monitor.observe(found[1], sess)
        counts = dict((value.tag, value.simple_value) for serialized in sess.run(summaries)
                      for value in tf.Summary.FromString(serialized).value)
    assert counts["a/skips_negative_loss"] == counts["b/skips_fed_flag"] == 1.0
    assert "a/skips_fed_flag" not in counts and "b/skips_negative_loss" not in counts
    assert collapse.reasons == {"fed_flag": 1} and "the test fed a flag." in collapse.message


def test_a_build_changes_no_module_global_reason_table(graph):
    """The builder collects its reasons into its own record: no global of
    the diagnostics modules, the skip conditions' or the seams' is rebound
    or changed by a build with conditions and a transform of its own."""
    import sys  # pylint: disable=import-outside-toplevel

    def globals_of_modules():
        return dict(
            (name, dict((key, (value, repr(value))) for key, value in vars(module).items()
                        if isinstance(value, (tuple, list, dict, set, frozenset))))
            for name, module in sorted(sys.modules.items())
            if name.startswith(("npu_lossscale.diagnostics", "npu_lossscale.skips",
                                "npu_lossscale.seams")))

    before = globals_of_modules()
    _step(transform=lambda pairs: pairs, skip_conditions=[SkipNegativeLoss(), _FedFlag()])
    after = globals_of_modules()
    assert sorted(after) == sorted(before)
    for name, values in before.items():
        assert sorted(after[name]) == sorted(values), name
        for key, (value, shown) in values.items():
            assert after[name][key][0] is value and after[name][key][1] == shown, (name, key)
    assert not hasattr(diagnostics, "register_reason")


def test_flags_of_a_window_cannot_cancel(graph):
    """+1 on the first micro-batch and -1 on the second skip the window."""
    condition = _FedFlag()
    _, w, _, _, train = _step(skip_conditions=[condition], accumulation_steps=2)
    with _session() as sess:
        before = sess.run(w)
        sess.run(train.update_op, {condition.value: 1.0})
        sess.run(train.update_op, {condition.value: -1.0})
        assert sess.run(w).tolist() == before.tolist()
        assert diagnostics.read_last_skip(sess, train).reason == "fed_flag"


def test_a_flag_of_another_graph_is_refused(graph):
    with tf.Graph().as_default():
        other = tf.constant(0.0)
    with pytest.raises(ValueError, match=r"skip condition '_Returning' returned .* a tensor of "
                                         r"another graph"):
        _step(skip_conditions=[_Returning(other)])


@pytest.mark.parametrize("reason", ["applied", "gradients_overflowed"])
def test_a_condition_cannot_take_a_checks_reason(graph, reason):
    class Shadowing(SkipNegativeLoss):
        pass

    Shadowing.reason = reason
    with pytest.raises(ValueError, match=r"reason %r is one of the step's own" % reason):
        _step(skip_conditions=[Shadowing()])


def test_one_reason_has_one_fix(graph):
    class Other(SkipNegativeLoss):
        fix = "another fix."

    with pytest.raises(ValueError, match=r"reason 'negative_loss' is registered already with "
                                         r"fix 'the loss went negative: check the data\.'"):
        _step(skip_conditions=[SkipNegativeLoss(), Other()])
    class Requested(SkipNegativeLoss):
        reason = "requested"

    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=r"reason 'requested' is registered already"):
            _step(skip_conditions=[Requested()])


class _Returns(seams.GradientTransform):
    """Returns what ``edit`` makes of the pairs."""

    def __init__(self, edit):
        self.edit = edit

    def transform(self, group, grads_and_vars):
        return self.edit(grads_and_vars)


def _two_variables(transform):
    w = tf.get_variable("w", initializer=np.array([1.0, 2.0], np.float32))
    v = tf.get_variable("v", initializer=np.array([3.0], np.float32))
    loss = tf.reduce_sum(w) + tf.reduce_sum(v)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0))
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.5), var_list=[w, v], name="net",
               transform_grads_fn=transform)
    return scaler.build()


@pytest.mark.parametrize("edit,error,pattern", [
    (lambda pairs: pairs[:1], ValueError, r"returned pairs for \['w'\], given \['w', 'v'\]"),
    (lambda pairs: pairs + pairs, ValueError, r"returned pairs for \['w', 'v', 'w', 'v'\]"),
    (lambda pairs: [(tf.cast(g, tf.float16), v) for g, v in pairs], TypeError,
     r"returned a float16 gradient for w, a float32 variable\. Cast it back"),
    (lambda pairs: [(tf.reshape(g, [-1, 1]), v) for g, v in pairs], ValueError,
     r"returned a gradient of shape \(2, 1\) for w, of shape \(2,\)")],
    ids=["left_out", "twice", "float16", "shape"])
def test_a_transform_returns_each_variable_once_in_its_dtype_and_shape(graph, edit, error,
                                                                       pattern):
    with pytest.raises(error, match=r"group 'net': _Returns " + pattern):
        _two_variables(_Returns(edit))


class _Factor(Halve):
    """Fuses with the unscale through ``factor(inverse)``."""

    def __init__(self, factor):
        self.factor = factor

    def unscale_factor(self, group, scaled_pairs, inverse):
        return self.factor(inverse)


@pytest.mark.parametrize("factor,error,pattern", [
    (lambda inverse: 0.5, TypeError, r"returned 0\.5; return a float32 scalar tensor"),
    (lambda inverse: tf.constant(0.5), ValueError, r"returned .*, which is not computed from "
                                                   r"inverse")])
def test_an_unscale_factor_is_a_scalar_computed_from_inverse(graph, factor, error, pattern):
    with pytest.raises(error, match=r"group 'net': _Factor\.unscale_factor " + pattern):
        _step(_Factor(factor))


def test_seam_flags_are_bools(graph):
    class Vague(Halve):
        keeps_finite = "no"

    with pytest.raises(TypeError, match=r"Vague\.keeps_finite must be a bool, got 'no'"):
        _step(Vague())

    class Moving(SkipNegativeLoss):
        moves_scale = "False"

    with tf.Graph().as_default():
        with pytest.raises(TypeError, match=r"Moving\.moves_scale must be a bool, got "
                                            r"'False'"):
            _step(skip_conditions=[Moving()])


class _Hooks(seams.StepObserver):
    """Returns ``on_skip``'s and ``before_update``'s values as given."""

    def __init__(self, on_skip=None, before_update=None):
        self.skips = tf.Variable(0.0, trainable=False, use_resource=True, name="hook_skips")
        self._on_skip, self._before_update = on_skip, before_update

    def on_skip(self, state):
        return self._on_skip(self) if callable(self._on_skip) else self._on_skip

    def before_update(self, state):
        return self._before_update


def test_an_observer_hook_may_return_nothing(graph):
    c, w, _, _, train = _step(observers=[_Hooks()])
    with _session() as sess:
        sess.run(train.update_op, {c: [np.inf, 1.0]})
        assert sess.run(train.skipped_steps) == 1


def test_an_observer_hook_that_returns_the_wrong_thing_is_named(graph):
    with pytest.raises(TypeError, match=r"_Hooks\.before_update returned \[\]; return a "
                                        r"seams\.Hooked"):
        _step(observers=[_Hooks(before_update=[])])
    with tf.Graph().as_default():
        with pytest.raises(TypeError, match=r"_Hooks\.on_skip returned 'count'; return a list "
                                            r"of ops"):
            _step(observers=[_Hooks(on_skip="count")])


def test_an_op_made_before_on_skip_is_refused(graph):
    """It would run on every step, not only in the skip branch."""
    early = _Hooks()
    made = tf.assign_add(early.skips, 1.0).op
    early._on_skip = [made]
    with pytest.raises(ValueError, match=r"_Hooks\.on_skip returned '%s', an op made before "
                                         r"the hook was called" % made.name):
        _step(observers=[early])


def test_a_transform_of_the_wrong_signature_is_named_at_add(graph):
    class OneArgument(seams.GradientTransform):
        def transform(self, grads_and_vars):
            return grads_and_vars

    with pytest.raises(TypeError, match=r"OneArgument\.transform cannot be called with 2 "
                                        r"arguments .* Write def transform\(self, group, "
                                        r"grads_and_vars\)"):
        _step(OneArgument())
    with tf.Graph().as_default():
        with pytest.raises(TypeError, match=r"transform_grads_fn=.* cannot be called with 1 "
                                            r"argument .* takes two\)"):
            _step(lambda group, pairs: pairs)


@pytest.mark.skipif(GRAPH_MODE == "v1", reason="control flow v2's functional If")
def test_a_ref_variable_written_in_on_skip_under_a_functional_if_names_the_fix(graph):
    class RefCount(seams.StepObserver):
        def __init__(self):
            self.count = tf.Variable(0.0, trainable=False, use_resource=False, name="ref")

        def on_skip(self, state):
            return [tf.assign_add(self.count, 1.0).op]

    with pytest.raises(TypeError, match=r"RefCount\.on_skip: .* must be a resource variable: "
                                        r"make it with tf\.Variable\(\.\.\., "
                                        r"use_resource=True\)"):
        _, w, loss = _linear()
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), gate="cond")
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.5), var_list=[w], name="net")
        scaler.build(observers=[RefCount()])


def test_a_margin_without_measure_first_scale_is_refused(graph):
    with pytest.raises(ValueError, match=r"first_scale_margin=3 has no effect without "
                                         r"measure_first_scale=True"):
        _step(first_scale_margin=3)


# -- docs/extending.md: its examples run, and define the classes above --

def _class_source(code, name):
    """The text of ``class name`` in ``code``, up to the next top-level line."""
    lines = code.split("\n")
    start = [i for i, line in enumerate(lines) if line.startswith("class %s(" % name)]
    assert len(start) == 1, name
    end = start[0] + 1
    while end < len(lines) and (not lines[end] or lines[end][0] == " "):
        end += 1
    return "\n".join(lines[start[0]:end]).rstrip() + "\n"


#: The examples of docs/extending.md, by the class each defines.
EXAMPLES = [("extending-transform", Halve, block("extending-transform")),
            ("extending-condition", SkipNegativeLoss, block("extending-condition")),
            ("extending-observer", CountSkips, block("extending-observer")),
            ("extending-engine", LoopbackPeer, block("extending-engine"))]


@pytest.mark.parametrize("name,cls,code", EXAMPLES, ids=[name for name, _, _ in EXAMPLES])
def test_the_docs_example_imports_nothing_of_core(name, cls, code):
    del cls
    imported = [node.module if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(ast.parse(code, name))
                if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names]
    assert imported and not [module for module in imported
                             if module.startswith("npu_lossscale.core")], imported


@pytest.mark.parametrize("name,cls,code", EXAMPLES, ids=[name for name, _, _ in EXAMPLES])
def test_the_docs_example(name, cls, code):
    assert code, "docs/extending.md lost its %r block" % name
    assert _class_source(code, cls.__name__) == inspect.getsource(cls)
    printed = io.StringIO()
    with tf.Graph().as_default(), contextlib.redirect_stdout(printed):
        exec(compile(code, name, "exec"), {"__name__": "__main__"})  # pylint: disable=exec-used
    shown = block(name + "-output", "text")
    assert printed.getvalue() == shown, printed.getvalue()
    assert re.search(r"\S", shown)
