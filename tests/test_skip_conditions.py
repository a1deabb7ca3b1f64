"""build(skip_global_steps=...) and build(skip_loss_spikes=k): skips asked
for, and loss spikes, through the step's own gate.

Each skip is checked against the state before it (weights, the dynamic
manager's [scale, good, bad, streak], the spike average), the reason
against ``diagnostics.REASONS`` (TrainOps.diagnosis.skip_reason, read_last_skip and
summaries()), and the refusals against their messages.
"""

import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import diagnostics

REQUESTED = diagnostics.REASONS.index("requested")
LOSS_SPIKE = diagnostics.REASONS.index("loss_spike")
LOSS_NOT_FINITE = diagnostics.REASONS.index("loss_not_finite")


class Net(object):
    """A float16 loss ``(w . c + 10) * spike`` over a float32 ``w`` (its
    gradient ``c * spike``), with ``c`` and ``spike`` fed (defaults
    ``c0`` and 1). The loss starts at 11; SGD(0.01) keeps it near there for
    hundreds of steps."""

    def __init__(self, name="w", c0=(0.5, 0.25)):
        self.c = tf.placeholder_with_default(np.array(c0, np.float32), [2], name="c_" + name)
        self.spike = tf.placeholder_with_default(1.0, [], name="spike_" + name)
        self.w = tf.get_variable(name, initializer=np.array([1.0, 2.0], np.float32))
        dot = tf.reduce_sum(tf.cast(self.w, tf.float16) * tf.cast(self.c, tf.float16))
        self.loss = tf.cast(dot + 10.0, tf.float32) * self.spike


def _one_group(learning_rate=0.5, **build_kwargs):
    """One group "net" (SGD) with a dynamic manager at 2**10 and a global
    step. Returns (net, manager, global_step, train)."""
    net = Net()
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 10)
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(manager)
    scaler.add(net.loss, tf.train.GradientDescentOptimizer(learning_rate), var_list=[net.w],
               name="net")
    return net, manager, gs, scaler.build(global_step=gs, **build_kwargs)


def _session():
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    return sess


def _summary_values(sess, summaries):
    """Fetched ``summaries()`` as a dict from tag to value."""
    values = {}
    for serialized in sess.run(summaries):
        for value in tf.Summary.FromString(serialized).value:
            values[value.tag] = value.simple_value
    return values


def _variable(name):
    found = [v for v in tf.global_variables() if v.op.name == name]
    assert len(found) == 1, [v.op.name for v in tf.global_variables()]
    return found[0]


# -- skip_global_steps --

SKIPPED = (2, 4)


@pytest.mark.parametrize("steps", [[4, 2], {2, 4}, range(2, 5, 2), range(4, 1, -2),
                                   np.array([2, 4, 4]), "tensor"],
                         ids=["list", "set", "range", "descending_range", "array", "tensor"])
def test_requested_steps_skip_and_hold_the_scale(graph, steps):
    requested = tf.placeholder_with_default(False, [], name="requested")
    net, manager, gs, train = _one_group(
        skip_global_steps=requested if isinstance(steps, str) else steps,
        count_skipped_steps=True)
    summaries = nl.summaries(train)
    fetches = [train.update_op, train.applied, train.diagnosis.skip_reason]
    with _session() as sess:
        for step in range(6):
            feed = {requested: step in SKIPPED} if isinstance(steps, str) else None
            state, w = sess.run([manager.state, net.w])
            applied, reason = sess.run(fetches, feed)[1:]
            assert (applied, reason) == ((False, REQUESTED) if step in SKIPPED else (True, 0))
            if step in SKIPPED:  # no weight moves, no manager count moves
                assert sess.run(net.w).tolist() == w.tolist()
                assert sess.run(manager.state).tolist() == state.tolist()
            else:  # a good step counted, SGD(0.5) moved w by c / 2
                assert sess.run(manager.state).tolist() == [2.0 ** 10, state[1] + 1, 0.0, 0.0]
                assert (w - sess.run(net.w)).tolist() == [0.25, 0.125]
            assert sess.run(gs) == step + 1  # count_skipped_steps=True
        assert sess.run(train.skipped_steps) == 2
        skip = diagnostics.read_last_skip(sess, train)
        assert (skip.number, skip.global_step, skip.reason) == (2, 4, "requested")
        assert skip.groups == () and skip.variables == ()
        assert "nothing to fix" in diagnostics.describe(skip)
        values = _summary_values(sess, summaries)
    assert values["loss_scale/skips_requested"] == 2
    assert values["loss_scale/skipped_total"] == 2
    assert sum(value for tag, value in values.items()
               if tag.startswith("loss_scale/skips_")) == 2


def test_a_requested_range_is_no_collapse(graph):
    net, manager, gs, train = _one_group(skip_global_steps=range(0, 5),
                                         count_skipped_steps=True)
    monitor = nl.CollapseMonitor(train, collapse_after=3, on_collapse="raise")
    with _session() as sess:
        for _ in range(6):
            reason = sess.run([train.update_op, train.diagnosis.skip_reason])[1]
            assert monitor.observe(reason, sess) is None
        assert sess.run(train.skipped_steps) == 5


def test_a_requested_tensor_needs_no_global_step(graph):
    net = Net()
    requested = tf.placeholder_with_default(False, [])
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    scaler.add(net.loss, tf.train.GradientDescentOptimizer(0.5), var_list=[net.w])
    train = scaler.build(skip_global_steps=requested)
    with _session() as sess:
        assert sess.run([train.update_op, train.diagnosis.skip_reason], {requested: True})[1] == REQUESTED
        assert sess.run(net.w).tolist() == [1.0, 2.0]
        assert sess.run([train.update_op, train.diagnosis.skip_reason])[1] == 0
        assert sess.run(net.w).tolist() == [0.75, 1.875]


def test_an_overflow_on_a_requested_step_is_the_reason(graph):
    """Where a check says overflow, the reason is the overflow's; the scale
    backs off as for any overflow. The loss stays finite (60011.5), its
    gradient 60000 times 2**10 overflows float16."""
    net, manager, gs, train = _one_group(skip_global_steps=[0], count_skipped_steps=True)
    with _session() as sess:
        assert sess.run([train.update_op, train.diagnosis.skip_reason],
                        {net.c: [60000.0, 0.25]})[1] == diagnostics.REASONS.index(
                            "gradients_overflowed")
        assert sess.run(manager.state)[0] == 2.0 ** 9


def _refusal(graph, error, pattern, **build_kwargs):
    """``build(**build_kwargs)`` raises ``error`` matching ``pattern``
    before it makes any op."""
    net = Net()
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    scaler.add(net.loss, tf.train.GradientDescentOptimizer(0.5), var_list=[net.w])
    build_kwargs.setdefault("global_step", gs)
    build_kwargs.setdefault("count_skipped_steps", True)
    made = len(graph.get_operations())
    with pytest.raises(error, match=pattern):
        scaler.build(**build_kwargs)
    assert len(graph.get_operations()) == made


def test_requested_steps_need_a_global_step(graph):
    _refusal(graph, ValueError, r"^skip_global_steps=\[3\] names global steps, but build\(\) "
                                r"got no global_step\. Pass global_step=",
             skip_global_steps=[3], global_step=None)


def test_requested_steps_need_count_skipped_steps(graph):
    _refusal(graph, ValueError, r"^skip_global_steps=range\(3, 5\) with count_skipped_steps="
                                r"False: .* Pass count_skipped_steps=True\.$",
             skip_global_steps=range(3, 5), count_skipped_steps=False)


def test_a_tensor_computed_from_the_global_step_needs_count_skipped_steps(graph):
    """Without it a skipped step leaves global_step where it is: the same
    step would be skipped forever (as for a collection of steps)."""
    gs = tf.train.get_or_create_global_step()
    every_other = tf.equal(gs % 2, 1)
    _refusal(graph, ValueError, r"^skip_global_steps=.* is computed from global_step, with "
                                r"count_skipped_steps=False: .* Pass count_skipped_steps=True\.$",
             skip_global_steps=every_other, count_skipped_steps=False)


def test_refuses_steps_the_global_steps_dtype_cannot_hold(graph):
    """An int64 step (the default) holds 2**40; an int32 one does not."""
    net = Net()
    gs32 = tf.Variable(0, dtype=tf.int32, trainable=False, name="step32")
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    scaler.add(net.loss, tf.train.GradientDescentOptimizer(0.5), var_list=[net.w])
    with pytest.raises(ValueError, match=r"^skip_global_steps=\[1, 1099511627776\] holds a "
                                         r"step above 2147483647, the largest int32 global_step"):
        scaler.build(global_step=gs32, skip_global_steps=[1, 2 ** 40], count_skipped_steps=True)


def test_refuses_a_step_above_int64(graph):
    _refusal(graph, ValueError, r"holds a step above 9223372036854775807, the largest int64",
             skip_global_steps=[2 ** 70])


@pytest.mark.parametrize("steps", [True, "12", 3, 3.0, b"12"])
def test_refuses_what_is_no_collection(graph, steps):
    _refusal(graph, TypeError, r"^skip_global_steps must be a collection of global steps or a "
                               r"bool scalar tensor, got %s\. Pass e\.g\. range\("
             % re.escape(repr(steps)), skip_global_steps=steps)


@pytest.mark.parametrize("steps", [[True], ["3"], [1.5], [2, np.float32(3)]])
def test_refuses_entries_that_are_no_int(graph, steps):
    _refusal(graph, TypeError, r"^skip_global_steps must hold int global steps, got %s\. "
             % re.escape(repr(steps)), skip_global_steps=steps)


def test_refuses_negative_steps(graph):
    _refusal(graph, ValueError, r"^skip_global_steps must hold global steps >= 0, got "
                                r"\[3, -1\]\. Drop the negative ones\.$",
             skip_global_steps=[3, -1])


@pytest.mark.parametrize("make", [lambda: tf.constant(1), lambda: tf.constant([True, False]),
                                  lambda: tf.placeholder(tf.bool)],
                         ids=["int", "bool_vector", "unknown_shape"])
def test_refuses_a_tensor_that_is_no_bool_scalar(graph, make):
    tensor = make()
    _refusal(graph, TypeError, r"^skip_global_steps must be a bool scalar tensor or a "
                               r"collection of global steps, got %s\." % re.escape(repr(tensor)),
             skip_global_steps=tensor)


def test_refuses_a_tensor_of_another_graph(graph):
    with tf.Graph().as_default():
        other = tf.constant(True)
    _refusal(graph, ValueError, r"belongs to another graph\. Build it in the graph of the "
                                r"losses\.", skip_global_steps=other)


def test_an_empty_collection_skips_nothing(graph):
    net, _, gs, train = _one_group(skip_global_steps=[])
    with _session() as sess:
        sess.run(train.update_op)
        assert sess.run(gs) == 1 and sess.run(train.skipped_steps) == 0


# -- skip_loss_spikes --

WARMUP = 100


def _average(group="net"):
    return _variable("loss_spikes/average_%s" % group)


def _warm_up(sess, train, net, spike_at=None):
    """Runs the warm-up's applied steps; at run ``spike_at`` the loss is 5
    times the others (it applies: the warm-up is not over)."""
    for run in range(WARMUP):
        feed = {net.spike: 5.0} if run == spike_at else None
        assert sess.run([train.update_op, train.applied], feed)[1], run


def test_a_loss_spike_skips_after_the_warm_up(graph):
    net, manager, gs, train = _one_group(skip_loss_spikes=3.0, learning_rate=0.01)
    average, applied_steps = _average(), _variable("loss_spikes/applied_steps")
    fetches = [train.update_op, train.applied, train.diagnosis.skip_reason]
    with _session() as sess:
        _warm_up(sess, train, net, spike_at=50)
        assert sess.run(applied_steps) == WARMUP and sess.run(gs) == WARMUP

        def loss_at(ratio):  # the spike factor that makes the loss ratio * the average
            return ratio * sess.run(average) / sess.run(net.loss)

        # Just under 3x: applies, and the average moves by 1 % toward it.
        mean = sess.run(average)
        spike = loss_at(2.9)
        assert sess.run(fetches, {net.spike: spike})[1:] == [True, 0]
        np.testing.assert_allclose(sess.run(average), 0.99 * mean + 0.01 * 2.9 * mean,
                                   rtol=1e-5)
        # Just over 3x: skips, and nothing moves.
        state, w, mean = sess.run([manager.state, net.w, average])
        assert sess.run(fetches, {net.spike: loss_at(3.1)})[1:] == [False, LOSS_SPIKE]
        assert sess.run(average) == mean and sess.run(applied_steps) == WARMUP + 1
        assert sess.run(manager.state).tolist() == state.tolist()
        assert sess.run(net.w).tolist() == w.tolist()
        assert sess.run(gs) == WARMUP + 1  # count_skipped_steps=False
        skip = diagnostics.read_last_skip(sess, train)
        assert (skip.reason, skip.global_step) == ("loss_spike", WARMUP + 1)
        assert "skip_loss_spikes" in skip.fix
        # A NaN loss is an overflow, not a spike: the scale backs off.
        assert sess.run(fetches, {net.spike: np.nan})[1:] == [False, LOSS_NOT_FINITE]
        assert sess.run(average) == mean
        assert sess.run(manager.state)[0] == state[0] / 2
        assert sess.run(train.skipped_steps) == 2
        assert diagnostics.read_last_skip(sess, train).reason == "loss_not_finite"


def test_the_average_starts_at_the_first_loss_and_moves_only_on_applied_steps(graph):
    net, _, _, train = _one_group(skip_loss_spikes=2.0, learning_rate=0.01)
    with _session() as sess:
        first = sess.run(net.loss)
        sess.run(train.update_op)
        assert sess.run(_average()) == first
        second = sess.run(net.loss)
        assert not sess.run([train.update_op, train.applied], {net.c: [np.inf, 0.0]})[1]
        assert sess.run(_average()) == first
        sess.run(train.update_op)
        np.testing.assert_allclose(sess.run(_average()), 0.99 * first + 0.01 * second,
                                   rtol=1e-6)


@pytest.fixture
def ref_variables_and_control_flow_v2():
    """TF 1.15 with control flow v2 on (Ascend's ENABLE_FORCE_V2_CONTROL):
    tf.Variable makes ref variables, and gate="cond" is a functional If."""
    resource, cf_v2 = tf.resource_variables_enabled(), tf.control_flow_v2_enabled()
    tf.disable_resource_variables()
    tf.enable_control_flow_v2()
    try:
        yield
    finally:
        if resource:
            tf.enable_resource_variables()
        if not cf_v2:
            tf.disable_control_flow_v2()


def test_the_spike_state_is_written_inside_a_functional_if(
        ref_variables_and_control_flow_v2, graph):
    w = tf.get_variable("w", initializer=np.array([1.0, 2.0], np.float32), use_resource=True)
    spike = tf.placeholder_with_default(1.0, [])
    loss = (tf.reduce_sum(w * [0.5, 0.25]) + 10.0) * spike
    gs = tf.get_variable("global_step", initializer=np.int64(0), trainable=False,
                         use_resource=True)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), gate="cond")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.01), var_list=[w])
    train = scaler.build(global_step=gs, skip_loss_spikes=3.0)
    assert "If" in [op.type for op in graph.get_operations()]
    with _session() as sess:
        first = sess.run(loss)
        sess.run(train.update_op)
        assert sess.run(_average("group_0")) == first


@pytest.mark.parametrize("factor,error", [
    (1, ValueError), (1.0, ValueError), (0.5, ValueError), (-3, ValueError),
    (float("inf"), ValueError), (float("nan"), ValueError),
    (True, TypeError), ("3", TypeError), ([3.0], TypeError)])
def test_refuses_a_factor_that_is_no_finite_number_above_one(graph, factor, error):
    _refusal(graph, error, r"^skip_loss_spikes must be a (finite )?number > 1, got %s\. "
                           r"Pass e\.g\. skip_loss_spikes=3\.0" % re.escape(repr(factor)),
             skip_loss_spikes=factor)


# -- with accumulation, skip_policy="per_group" and per-group ops --

def test_requested_window_skips_with_accumulation(graph):
    net, manager, gs, train = _one_group(skip_global_steps=[1], count_skipped_steps=True,
                                         accumulation_steps=2)
    fetches = [train.update_op, train.applied, train.window_end, train.diagnosis.skip_reason]
    with _session() as sess:
        assert sess.run(fetches)[1:] == [False, False, 0]
        assert sess.run(fetches)[1:] == [True, True, 0]
        state, w = sess.run([manager.state, net.w])
        assert sess.run(fetches)[1:] == [False, False, 0]
        assert sess.run(fetches)[1:] == [False, True, REQUESTED]
        assert sess.run(manager.state).tolist() == state.tolist()
        assert sess.run(net.w).tolist() == w.tolist()
        assert sess.run([gs, train.skipped_steps]) == [2, 1]
        sess.run(train.update_op)
        assert sess.run(fetches)[1:] == [True, True, 0]
        assert (w - sess.run(net.w)).tolist() == [0.25, 0.125]
        assert diagnostics.read_last_skip(sess, train).reason == "requested"


def test_a_spike_in_one_micro_batch_skips_the_window(graph):
    net, manager, gs, train = _one_group(skip_loss_spikes=3.0, accumulation_steps=2,
                                         learning_rate=0.01)
    with _session() as sess:
        for _ in range(2 * WARMUP):
            sess.run(train.update_op)
        assert sess.run(gs) == WARMUP
        state, w, mean = sess.run([manager.state, net.w, _average()])
        sess.run(train.update_op, {net.spike: 4.0})
        assert sess.run([train.update_op, train.applied, train.diagnosis.skip_reason])[1:] == [
            False, LOSS_SPIKE]
        assert sess.run(_average()) == mean
        assert sess.run(manager.state).tolist() == state.tolist()
        assert sess.run(net.w).tolist() == w.tolist()
        assert sess.run(gs) == WARMUP


def _two_groups(learning_rate=0.5, **build_kwargs):
    """Groups "a" and "b" (SGD) under skip_policy="per_group", one dynamic
    manager. Returns (net_a, net_b, manager, global_step, train)."""
    net_a, net_b = Net("w_a"), Net("w_b")
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 10)
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(manager, skip_policy="per_group")
    for name, net in (("a", net_a), ("b", net_b)):
        scaler.add(net.loss, tf.train.GradientDescentOptimizer(learning_rate),
                   var_list=[net.w], name=name)
    return net_a, net_b, manager, gs, scaler.build(global_step=gs, **build_kwargs)


def test_per_group_policy_a_requested_step_skips_every_group(graph):
    net_a, net_b, manager, gs, train = _two_groups(skip_global_steps=[1],
                                                   count_skipped_steps=True)
    fetches = [train.update_op, train.applied, train.diagnosis.skip_reason,
               dict((name, group.is_finite) for name, group in train.groups.items())]
    with _session() as sess:
        sess.run(train.update_op)
        state, weights = sess.run([manager.state, [net_a.w, net_b.w]])
        applied, reason, finite = sess.run(fetches)[1:]
        assert (applied, reason, finite) == (False, REQUESTED, {"a": True, "b": True})
        assert sess.run(manager.state).tolist() == state.tolist()
        assert np.array_equal(sess.run([net_a.w, net_b.w]), weights)
        # An overflow in b alone on a step not asked for: a applies.
        applied, reason, finite = sess.run(fetches, {net_b.c: [np.inf, 0.0]})[1:]
        assert (applied, reason, finite) == (True, LOSS_NOT_FINITE, {"a": True, "b": False})
        assert sess.run(net_a.w).tolist() == (weights[0] - [0.25, 0.125]).tolist()
        assert sess.run(net_b.w).tolist() == weights[1].tolist()
        assert sess.run([gs, train.skipped_steps]) == [3, 2]


def test_per_group_policy_a_spike_skips_every_group(graph):
    net_a, net_b, manager, gs, train = _two_groups(skip_loss_spikes=3.0, learning_rate=0.01)
    with _session() as sess:
        _warm_up(sess, train, net_a)
        state, weights = sess.run([manager.state, [net_a.w, net_b.w]])
        means = sess.run([_average("a"), _average("b")])
        assert sess.run([train.update_op, train.applied, train.diagnosis.skip_reason],
                        {net_b.spike: 4.0})[1:] == [False, LOSS_SPIKE]
        assert sess.run([_average("a"), _average("b")]) == means
        assert sess.run(manager.state).tolist() == state.tolist()
        assert np.array_equal(sess.run([net_a.w, net_b.w]), weights)


def test_a_requested_skip_in_a_per_group_op(graph):
    net_a, net_b, manager, gs, train = _two_groups(skip_global_steps=[0],
                                                   count_skipped_steps=True,
                                                   per_group_ops=True)
    with _session() as sess:
        state = sess.run(manager.state)
        sess.run(train.per_group["a"])  # global step 0: skipped
        assert sess.run(net_a.w).tolist() == [1.0, 2.0]
        assert sess.run(manager.state).tolist() == state.tolist()
        assert sess.run([gs, train.skipped_steps]) == [1, 1]
        skip = diagnostics.read_last_skip(sess, train)
        assert (skip.reason, skip.global_step) == ("requested", 0)
        sess.run(train.per_group["b"])  # global step 1: applies
        assert sess.run(net_b.w).tolist() == [0.75, 1.875]
        assert sess.run([gs, train.skipped_steps]) == [2, 1]


def test_a_loss_that_is_not_finite_never_enters_the_average(graph):
    """Issue 44: an inf loss with finite gradients (a term no variable
    reaches) applied in the warm-up and made the average inf, so no spike
    was caught again; after the warm-up it was tagged ``loss_spike``. It
    is no spike: it applies as without ``skip_loss_spikes`` (the gradients
    are finite), moves no average and no warm-up count; a later 3.1x spike
    still skips. With its gradients inf too it is ``loss_not_finite`` and
    the scale backs off."""
    net = Net()
    term = tf.placeholder_with_default(0.0, [], name="term")
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 10)
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(manager)
    scaler.add(net.loss + term, tf.train.GradientDescentOptimizer(0.01), var_list=[net.w],
               name="net")
    train = scaler.build(global_step=gs, skip_loss_spikes=3.0)
    average, applied_steps = _average(), _variable("loss_spikes/applied_steps")
    fetches = [train.update_op, train.applied, train.diagnosis.skip_reason]
    with _session() as sess:
        for run in range(WARMUP + 2):
            feed = {term: [np.inf, np.nan][run % 2]} if run in (10, 11) else None
            before = sess.run([average, applied_steps])
            assert sess.run(fetches, feed)[1:] == [True, 0], run
            if feed is not None:
                assert sess.run([average, applied_steps]) == before, run
        assert sess.run(applied_steps) == WARMUP and np.isfinite(sess.run(average))
        for bad in (np.inf, -np.inf, np.nan):
            mean, count = sess.run([average, applied_steps])
            assert sess.run(fetches, {term: bad})[1:] == [True, 0], bad
            assert sess.run([average, applied_steps]) == [mean, count], bad
        ratio = 3.1 * sess.run(average) / sess.run(net.loss)
        assert sess.run(fetches, {net.spike: ratio})[1:] == [False, LOSS_SPIKE]
        scale = sess.run(manager.loss_scale)
        assert sess.run(fetches, {net.spike: np.inf})[1:] == [False, LOSS_NOT_FINITE]
        assert sess.run(manager.loss_scale) == scale / 2
