"""The capabilities as values (issue 45), misused as users misuse them:
``transforms.chain`` and ``clip_by_global_norm``, ``skips.requested`` and
``loss_spikes`` in ``skip_conditions``, the underflow observers in
``observers``, the sugar keywords, the seams' views and
``diagnostics.reasons_of``/``decode``. Each misuse gets a clear error at
build time, before any op is made, or works; docs/errors.md says what each
gets.

The numbers are checked by hand: ``_net``'s gradient is ``C`` (norm 50),
so a clip to 1 gives ``[0.6, 0.8]`` and a step of 0.1 moves ``w`` from
``[1, 2]`` to ``[0.94, 1.92]``.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import diagnostics, seams, skips, transforms, underflow
from models import fed_linear_model, two_group_gan

#: ``_net``'s gradient: ``C`` itself, global norm 50.
C = np.array([30.0, 40.0], np.float32)


def _net(name="w"):
    """A float32 ``w`` of two elements and the loss ``w . C``."""
    w = tf.get_variable(name, initializer=np.array([1.0, 2.0], np.float32))
    return w, tf.reduce_sum(w * tf.constant(C))


def _scaler(manager=None):
    return nl.MultiOptimizerLossScale(manager or nl.FixedLossScaleManager(2.0 ** 8),
                                      backend="is_finite")


def _one_group(name="net", **add):
    """A builder with ``_net``'s one group, and ``w``."""
    w, loss = _net()
    scaler = _scaler()
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name=name, **add)
    return scaler, w


def _two_groups():
    """A builder with two groups of ``_net``, "a" over ``w`` and "b" over
    ``v``; returns the builder, ``w`` and ``v``."""
    w, loss = _net()
    v, loss_v = _net("v")
    scaler = _scaler()
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="a")
    scaler.add(loss_v, tf.train.GradientDescentOptimizer(0.1), var_list=[v], name="b")
    return scaler, w, v


def _step_once(train, w):
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        return sess.run(w)


def _no_op_made(graph, before):
    """No op was added to ``graph`` since it held ``before`` of them."""
    assert len(graph.get_operations()) == before


# transforms.chain and clip_by_global_norm

def test_an_empty_chain_is_the_identity(graph):
    """Correct: as optax's ``chain()``, no transform at all."""
    scaler, w = _one_group(transform_grads_fn=transforms.chain())
    np.testing.assert_allclose(_step_once(scaler.build(), w), [1.0 - 3.0, 2.0 - 4.0])


@pytest.mark.parametrize("value", [3, "clip", [lambda pairs: pairs]],
                         ids=["number", "str", "list"])
def test_a_chain_of_a_non_transform_is_refused(graph, value):
    """Was CONFUSING: "transform_grads_fn must be a function ...", an
    argument the call to ``chain`` does not have."""
    with pytest.raises(TypeError, match=r"^transforms\.chain\(\) takes GradientTransform "
                                        r"instances or functions .* got .* Pass e\.g\. "
                                        r"transforms\.clip_by_global_norm\(1\.0\)\.$"):
        transforms.chain(value)


def test_a_chain_of_a_class_or_a_two_argument_function_is_refused(graph):
    """The class was CONFUSING too ("e.g. transform_grads_fn=...")."""
    with pytest.raises(TypeError, match=r"^transforms\.chain\(\) got the class .*"
                                        r"ClipByGlobalNorm'>; pass an instance, e\.g\. "
                                        r"transforms\.chain\(ClipByGlobalNorm\(\.\.\.\)\)\.$"):
        transforms.chain(transforms.ClipByGlobalNorm)
    with pytest.raises(TypeError, match=r"cannot be called with 1 argument"):
        transforms.chain(lambda pairs, extra: pairs)


def test_a_nested_chain_is_flattened(graph):
    """Correct: a chain in a chain gives its parts, in order."""
    halve = transforms.chain(lambda pairs: [(g / 2, v) for g, v in pairs])
    clip = transforms.clip_by_global_norm(1.0)
    nested = transforms.chain(transforms.chain(halve, clip), clip)
    assert nested.transforms == halve.transforms + (clip, clip)


def test_two_clips_in_a_chain_or_a_chain_and_clip_norm_apply_in_order(graph):
    """Correct: each clip applies in turn; the chain's first, then
    ``clip_norm``'s (the order add() documents). Clipped to 1 then 2 is a
    norm of 1: ``w`` moves by 0.1 * [0.6, 0.8]."""
    scaler, w = _one_group(transform_grads_fn=transforms.chain(
        transforms.clip_by_global_norm(1.0), transforms.clip_by_global_norm(2.0)))
    np.testing.assert_allclose(_step_once(scaler.build(), w), [0.94, 1.92], rtol=1e-6)
    with tf.Graph().as_default():
        scaler, w = _one_group(transform_grads_fn=transforms.chain(
            transforms.clip_by_global_norm(1.0)), clip_norm=2.0)
        assert [t.clip_norm for t in scaler._groups[0].transforms] == [1.0, 2.0]
        np.testing.assert_allclose(_step_once(scaler.build(), w), [0.94, 1.92], rtol=1e-6)


def test_a_clip_before_another_transform_is_not_the_last_word(graph):
    """Correct: a clip that is not last is followed, not fused away: clipped
    to norm 1, then times 10, ``w`` moves by 0.1 * [6, 8]."""
    scaler, w = _one_group(transform_grads_fn=transforms.chain(
        transforms.clip_by_global_norm(1.0), lambda pairs: [(g * 10, v) for g, v in pairs]))
    np.testing.assert_allclose(_step_once(scaler.build(), w), [0.4, 1.2], rtol=1e-6)


def test_one_clip_object_in_two_groups_clips_each(graph):
    """Correct: a transform holds no state of a group, so one object may
    serve two."""
    w, loss = _net()
    v, loss_v = _net("v")
    clip = transforms.clip_by_global_norm(1.0)
    scaler = _scaler()
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="a",
               transform_grads_fn=clip)
    scaler.add(loss_v, tf.train.GradientDescentOptimizer(0.1), var_list=[v], name="b",
               transform_grads_fn=clip)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        for value in sess.run([w, v]):
            np.testing.assert_allclose(value, [0.94, 1.92], rtol=1e-6)


@pytest.mark.parametrize("norm, error, message", [
    (0, ValueError, r"^norm must be in \["), (-1.0, ValueError, r"^norm must be in \["),
    (float("inf"), ValueError, r"^norm must be a finite number, got inf\."),
    ("1.0", TypeError, r"^norm must be a number, got '1\.0' \(str\)\."),
    (True, TypeError, r"^norm must be a number, got True \(bool\)\."),
], ids=["zero", "negative", "inf", "str", "bool"])
def test_clip_by_global_norm_refuses_a_bad_norm(graph, norm, error, message):
    with pytest.raises(error, match=message + r".* Pass a global norm such as 1\.0\.$"):
        transforms.clip_by_global_norm(norm)


def test_clip_by_global_norm_refuses_a_tensor(graph):
    with pytest.raises(TypeError, match=r"^norm must be a number, got <tf\.Tensor"):
        transforms.clip_by_global_norm(tf.constant(1.0))


def test_a_skip_condition_as_a_transform_is_refused(graph):
    w, loss = _net()
    with pytest.raises(TypeError, match=r"^transform_grads_fn must be a function .* got "
                                        r"<npu_lossscale\.skips\.spikes\.LossSpikes"):
        _scaler().add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w],
                      transform_grads_fn=skips.loss_spikes(2.0))


# skips.requested and skips.loss_spikes as values

@pytest.mark.parametrize("steps, error", [(5, TypeError), ("5", TypeError), ([1.5], TypeError),
                                          ([-1], ValueError)],
                         ids=["int", "str", "float", "negative"])
def test_requested_refuses_a_bad_collection(graph, steps, error):
    """Clear error, in the words of the keyword it is the value of."""
    with pytest.raises(error, match=r"^skip_global_steps must .*%s" % "got"):
        skips.requested(steps)


@pytest.mark.parametrize("factor, error", [(1, ValueError), (0.5, ValueError),
                                           (float("inf"), ValueError), (True, TypeError),
                                           ("3", TypeError)],
                         ids=["one", "below-one", "inf", "bool", "str"])
def test_loss_spikes_refuses_a_bad_factor(graph, factor, error):
    with pytest.raises(error, match=r"^k must be a (finite )?number > 1, got .* Pass e\.g\. "
                                    r"k=3\.0"):
        skips.loss_spikes(factor)


def test_requested_as_a_value_needs_global_step_and_counting(graph):
    scaler, _ = _one_group()
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"names global steps, but build\(\) got no "
                                         r"global_step"):
        scaler.build(skip_conditions=[skips.requested([3])])
    step = tf.train.get_or_create_global_step()
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"with count_skipped_steps=False"):
        scaler.build(global_step=step, skip_conditions=[skips.requested([3])])
    _no_op_made(graph, before)


def test_a_requested_tensor_from_global_step_as_a_value_needs_counting(graph):
    """As the keyword: a skip computed from ``global_step`` without
    ``count_skipped_steps=True`` would skip the same step forever."""
    scaler, _ = _one_group()
    step = tf.train.get_or_create_global_step()
    value = skips.requested(tf.equal(step % 10, 3))
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"is computed from global_step, with "
                                         r"count_skipped_steps=False.* Pass "
                                         r"count_skipped_steps=True\.$"):
        scaler.build(global_step=step, skip_conditions=[value])
    _no_op_made(graph, before)


def test_requested_value_and_keyword_together_skip_both_sets(graph):
    """Correct: the keyword's steps and the value's both skip (each its own
    flag); a skipped step moves no weight, and global_step counts it."""
    scaler, w = _one_group()
    step = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=step, count_skipped_steps=True, skip_global_steps=[0],
                         skip_conditions=[skips.requested([1])])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for expected in (0, 1):
            assert not sess.run([train.applied, train.update_op])[0]
            assert sess.run(step) == expected + 1
            np.testing.assert_array_equal(sess.run(w), [1.0, 2.0])
        assert sess.run([train.applied, train.update_op])[0]


def test_one_condition_listed_twice_is_refused(graph):
    """Was SILENT: its ``on_apply`` ran twice a step, so the spike count
    moved by 2 (a warm-up half as long, the average decayed twice)."""
    scaler, _ = _one_group()
    spikes = skips.loss_spikes(2.0)
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"^skip_conditions: <npu_lossscale\.skips\.spikes\."
                                         r"LossSpikes .* is listed twice; .* List it once\.$"):
        scaler.build(skip_conditions=[spikes, spikes])
    _no_op_made(graph, before)


def test_loss_spikes_value_and_keyword_keep_their_own_state(graph):
    """Correct: two conditions, each with its own average (the lower
    threshold decides)."""
    scaler, _ = _one_group()
    scaler.build(skip_loss_spikes=3.0, skip_conditions=[skips.loss_spikes(2.0)])
    names = sorted(v.op.name for v in tf.global_variables() if "loss_spikes" in v.op.name)
    assert names == ["loss_spikes/applied_steps", "loss_spikes/average_net",
                     "loss_spikes_1/applied_steps", "loss_spikes_1/average_net"]


def test_one_loss_spikes_shared_by_two_builders_of_a_graph_is_refused(graph):
    """Was SILENT: the second builder's group of the same name moved the
    first one's average and count."""
    spikes = skips.loss_spikes(2.0)
    scaler, _ = _one_group()
    scaler.build(skip_conditions=[spikes])
    v, loss_v = _net("v")
    other = _scaler()
    other.add(loss_v * 100.0, tf.train.GradientDescentOptimizer(0.1), var_list=[v], name="net")
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"already keeps the loss averages of another "
                                         r"builder's step in this graph "
                                         r"\(loss_spikes/applied_steps:0\).* Make one "
                                         r"skips\.loss_spikes\(k\) per builder\.$"):
        other.build(skip_conditions=[spikes])
    _no_op_made(graph, before)


def test_one_loss_spikes_in_two_graphs_starts_afresh_in_each():
    """Was CONFUSING: TF's "must be from the same graph" from inside the
    step. Now the condition makes its state in each graph it is built in."""
    spikes = skips.loss_spikes(2.0)
    for _ in range(2):
        with tf.Graph().as_default():
            scaler, w = _one_group()
            train = scaler.build(skip_conditions=[spikes])
            assert spikes._count.graph is tf.get_default_graph()
            np.testing.assert_allclose(_step_once(train, w), [-2.0, -2.0])


def test_one_loss_spikes_kept_by_the_builders_retry_after_a_failed_build(graph):
    """Correct: the same builder's retry after a build that failed half-way
    (its manager's update returned no op, after the condition made its
    variables) keeps the condition's state, and trains; another builder's
    step is refused (above)."""
    class BrokenOnce(nl.FixedLossScaleManager):
        broken = True

        def update_loss_scale(self, finite_grads):
            if self.broken:
                return None
            return super(BrokenOnce, self).update_loss_scale(finite_grads)

    spikes = skips.loss_spikes(2.0)
    manager = BrokenOnce(8.0)
    w, loss = _net()
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net")
    with pytest.raises(TypeError, match="not an op"):
        scaler.build(skip_conditions=[spikes])
    manager.broken = False
    train = scaler.build(skip_conditions=[spikes])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        np.testing.assert_allclose(sess.run(w), [-2.0, -2.0])
        assert sess.run(spikes._count) == 1


def test_one_requested_shared_by_two_builders_is_checked_by_each(graph):
    """Correct: a requested skip holds no state; each build checks it
    against its own global_step."""
    requested = skips.requested([0])
    step = tf.train.get_or_create_global_step()
    scaler, _ = _one_group()
    scaler.build(global_step=step, count_skipped_steps=True, skip_conditions=[requested])
    v, loss_v = _net("v")
    other = _scaler()
    other.add(loss_v, tf.train.GradientDescentOptimizer(0.1), var_list=[v], name="b")
    with pytest.raises(ValueError, match=r"names global steps, but build\(\) got no "):
        other.build(skip_conditions=[requested])


def test_loss_spikes_with_per_group_ops_keep_one_average_per_group(graph):
    scaler = _two_groups()[0]
    scaler.build(skip_conditions=[skips.loss_spikes(2.0)], per_group_ops=True)
    assert sorted(x.op.name for x in tf.global_variables() if "spike" in x.op.name) == [
        "loss_spikes/applied_steps", "loss_spikes/average_a", "loss_spikes/average_b"]


def test_a_condition_passed_bare_is_taken_as_a_list_of_one(graph):
    """Correct: one instance, not in a list, is a list of one."""
    scaler, w = _one_group()
    train = scaler.build(skip_conditions=skips.loss_spikes(2.0))
    np.testing.assert_allclose(_step_once(train, w), [-2.0, -2.0])


@pytest.mark.parametrize("where, value, message", [
    ("skip_conditions", skips.LossSpikes, r"^skip_conditions must be a list of SkipCondition"),
    ("skip_conditions", "transform", r"^skip_conditions must be a list of SkipCondition"),
    ("skip_conditions", "observer", r"^skip_conditions must be a list of SkipCondition"),
    ("observers", "condition", r"^observers must be a list of StepObserver"),
], ids=["a-class", "a-transform", "an-observer", "a-condition-as-observer"])
def test_a_plugin_of_another_seam_is_refused(graph, where, value, message):
    value = {"transform": transforms.clip_by_global_norm(1.0),
             "observer": underflow.measure_underflow(),
             "condition": skips.loss_spikes(2.0)}.get(value, value)
    scaler, _ = _one_group()
    with pytest.raises(TypeError, match=message):
        scaler.build(**{where: [value]})


def test_a_requested_value_with_accumulation_skips_the_whole_window(graph):
    """Correct: step 0 asked for, the window of runs 1-2 skips (global_step
    counts it), the next window applies the mean gradient C."""
    scaler, w = _one_group()
    step = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=step, count_skipped_steps=True, accumulation_steps=2,
                         skip_conditions=[skips.requested([0])])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        seen = []
        for _ in range(4):
            sess.run(train.update_op)
            seen.append((int(sess.run(step)), sess.run(w).tolist()))
    assert seen == [(0, [1.0, 2.0]), (1, [1.0, 2.0]), (1, [1.0, 2.0]), (2, [-2.0, -2.0])]


def test_a_requested_value_in_per_group_ops_skips_the_op_of_that_step(graph):
    scaler, w, v = _two_groups()
    step = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=step, count_skipped_steps=True, per_group_ops=True,
                         skip_conditions=[skips.requested([0])])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        seen = []
        for name in ("a", "b", "a"):
            sess.run(train.per_group[name])
            seen.append((int(sess.run(step)), sess.run(w).tolist(), sess.run(v).tolist()))
    assert seen == [(1, [1.0, 2.0], [1.0, 2.0]), (2, [1.0, 2.0], [-2.0, -2.0]),
                    (3, [-2.0, -2.0], [-2.0, -2.0])]


@pytest.mark.parametrize("condition", ["requested", "loss_spikes"])
def test_skip_values_build_with_a_sync_replicas_group(graph, condition):
    """Correct: the values build on the chief's route as the keywords do
    (the requested skip's run under SyncReplicas: test_sync_replicas.py)."""
    step, _, w, loss = fed_linear_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
    scaler.add(loss, nl.SyncReplicasOptimizer(tf.train.GradientDescentOptimizer(1.0),
                                              replicas_to_aggregate=1), var_list=[w])
    value = skips.requested([4]) if condition == "requested" else skips.loss_spikes(3.0)
    assert scaler.build(global_step=step, count_skipped_steps=True,
                        skip_conditions=[value]).applied is None


def test_loss_spikes_value_with_towers(graph):
    w = tf.get_variable("w", initializer=np.array([1.0, 2.0], np.float32))
    scaler = _scaler()
    scaler.add([tf.reduce_sum(w * C), tf.reduce_sum(w * C)],
               tf.train.GradientDescentOptimizer(0.1), var_list=[w])
    train = scaler.build(skip_conditions=[skips.loss_spikes(2.0)])
    np.testing.assert_allclose(_step_once(train, w), [-2.0, -2.0])


def test_a_chain_with_accumulation_and_with_per_group_ops(graph):
    """Correct: the chain (times 2, then the clip to 1) applies to the
    window's mean, and in a per-group op."""
    double = transforms.chain(lambda pairs: [(g * 2, v) for g, v in pairs],
                              transforms.clip_by_global_norm(1.0))
    scaler, w = _one_group(transform_grads_fn=double)
    train = scaler.build(accumulation_steps=2)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        sess.run(train.update_op)
        np.testing.assert_allclose(sess.run(w), [0.94, 1.92], rtol=1e-6)
    with tf.Graph().as_default():
        scaler, w = _one_group(name="a", transform_grads_fn=double)
        train = scaler.build(per_group_ops=True)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(train.per_group["a"])
            np.testing.assert_allclose(sess.run(w), [0.94, 1.92], rtol=1e-6)


# The underflow observers as values

@pytest.mark.parametrize("margin, error", [(-1, ValueError), (16, ValueError),
                                           (1.5, TypeError), (True, TypeError),
                                           ("1", TypeError), (None, TypeError)],
                         ids=["negative", "sixteen", "float", "bool", "str", "none"])
def test_measure_first_scale_refuses_a_bad_margin(margin, error):
    with pytest.raises(error, match=r"^first_scale_margin must be .* Pass e\.g\. 1"):
        underflow.measure_first_scale(margin)


def _float16_group(graph, manager=None):
    model = two_group_gan(compute_dtype=tf.float16)
    scaler = nl.MultiOptimizerLossScale(manager or nl.DynamicLossScaleManager(2.0 ** 32))
    scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.d_vars,
               name="d")
    return scaler, model


@pytest.mark.parametrize("keyword, observer", [
    ("measure_first_scale", underflow.measure_first_scale),
    ("measure_underflow", underflow.measure_underflow)])
def test_an_observer_passed_as_keyword_and_value_is_refused(graph, keyword, observer):
    """Was CONFUSING: "two of them are named ...; set the instance's name
    attribute", a fix that would measure twice."""
    scaler, _ = _float16_group(graph)
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"^observers: .* is what %s=True makes too, and "
                                         r"both would run\. Pass %s=True or the observer, "
                                         r"not both\.$" % (keyword, keyword)):
        scaler.build(observers=[observer()], **{keyword: True})
    _no_op_made(graph, before)


def test_an_observer_passed_twice_is_refused(graph):
    scaler, _ = _float16_group(graph)
    with pytest.raises(ValueError, match=r"^observers: two of them are named 'first_scale'"):
        scaler.build(observers=[underflow.measure_first_scale(),
                                underflow.measure_first_scale(2)])


def test_one_first_scale_shared_by_two_builders_measures_each(graph):
    """Correct: the observer keeps one flag per manager, so each builder's
    manager is measured once (2**32 down to 2**14 for this model)."""
    observer = underflow.measure_first_scale()
    scaler, model = _float16_group(graph)
    first = scaler.build(observers=[observer])
    other = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(2.0 ** 32))
    other.add(model.g_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.g_vars,
              name="g")
    second = other.build(observers=[observer])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(first.update_op, model.feed)
        sess.run(second.update_op, model.feed)
        assert sess.run([first.loss_scale, second.loss_scale], model.feed) == [2.0 ** 14] * 2


def test_one_underflow_measurement_shared_by_two_builders_reports_each(graph):
    observer = underflow.measure_underflow()
    scaler, model = _float16_group(graph, nl.FixedLossScaleManager(2.0))
    first = scaler.build(observers=[observer])
    other = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0))
    other.add(model.g_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.g_vars,
              name="g")
    assert (sorted(first.underflow), sorted(other.build(observers=[observer]).underflow)) == (
        ["d"], ["g"])


# The sugar keywords

@pytest.mark.parametrize("keyword", ["skip_loss_spike", "clip_norm", "distributed"],
                         ids=["misspelled", "add-keyword", "init-keyword"])
def test_build_refuses_a_keyword_it_does_not_take(graph, keyword):
    scaler, _ = _one_group()
    with pytest.raises(TypeError, match=r"^build\(\) got an unexpected keyword argument %r; "
                                        r"besides its own it takes skip_global_steps, "
                                        % keyword):
        scaler.build(**{keyword: 3.0})


def test_build_refuses_a_condition_passed_as_global_step(graph):
    scaler, _ = _one_group()
    with pytest.raises(TypeError, match=r"^global_step must be None or an integer "
                                        r"tf\.Variable, got <npu_lossscale\.skips"):
        scaler.build(skips.loss_spikes(2.0))
    with pytest.raises(TypeError, match=r"takes from 1 to 8 positional arguments"):
        scaler.build(None, 1, False, None, False, [], [], 3.0)


def test_add_and_the_constructor_refuse_keywords_of_another_entry(graph):
    w, loss = _net()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'skip_loss_spikes'"):
        _scaler().add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w],
                      skip_loss_spikes=2.0)
    for keyword in ("measure_underflow", "distributd"):
        with pytest.raises(TypeError, match=r"unexpected keyword argument %r" % keyword):
            nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0), **{keyword: True})
    with pytest.raises(TypeError, match=r"^transform_grads_fn must be a function .* got 1\.0\."):
        _scaler().add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w],
                      transform_grads_fn=1.0)


@pytest.mark.parametrize("keywords, error, message", [
    (dict(allreduce_float16="yes"), TypeError, r"^allreduce_float16 must be a bool, got 'yes'\."),
    (dict(allreduce_float16=True), ValueError,
     r"^allreduce_float16=True needs distributed='horovod' or 'hccl', got distributed=None\."),
    (dict(distributed="horovd"), ValueError,
     r"^distributed must be None or one of \('horovod', 'hccl'\), got 'horovd'\."),
], ids=["not-a-bool", "without-an-engine", "misspelled-engine"])
def test_the_constructors_sugar_keywords_are_checked(graph, keywords, error, message):
    with pytest.raises(error, match=message):
        nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0), **keywords)


def test_a_requested_value_holds_the_gated_update_ops(graph):
    """A skipped step moves no weight, no gated statistic and no global
    step (``count_skipped_steps`` left off, the skip named by a tensor)."""
    scaler, w = _one_group()
    step = tf.train.get_or_create_global_step()
    runs = tf.Variable(0, name="runs")
    statistic = tf.Variable(0.0, name="statistic")
    first = tf.equal(runs, 0)
    with tf.control_dependencies([first]):
        counted = tf.assign_add(runs, 1)
    train = scaler.build(global_step=step, update_ops=[tf.assign_add(statistic, 1.0)],
                         skip_conditions=[skips.requested(first)])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        assert sess.run([step, statistic]) == [0, 0.0]
        np.testing.assert_array_equal(sess.run(w), [1.0, 2.0])
        sess.run(counted)
        sess.run(train.update_op)
        assert sess.run([step, statistic]) == [1, 1.0]
        np.testing.assert_allclose(sess.run(w), [-2.0, -2.0])


# The views and the reasons

def test_a_hook_cannot_mutate_a_group_view(graph):
    """Correct: a ``GroupView`` is a namedtuple, its ``var_list`` a tuple;
    Python refuses the write before any op."""
    class Mutates(seams.StepObserver):
        def report(self, state):
            state.plan.groups[0].var_list.append(None)

    scaler, _ = _one_group()
    with pytest.raises(AttributeError, match=r"'tuple' object has no attribute 'append'"):
        scaler.build(observers=[Mutates()])


def test_a_group_view_compares_equal_across_step_ops_though_not_identical(graph):
    """Correct, documented: each step op (``update_op``, each of
    ``per_group``) makes its own views, equal field by field; a hook keys on
    ``group.name`` (or the view), never on ``id()``."""
    seen = []

    class Keeps(seams.StepObserver):
        def report(self, state):
            if "a" in state.plan.group_names:
                seen.append(state.plan.group("a"))
            return tf.constant(1.0)

    scaler = _two_groups()[0]
    scaler.build(observers=[Keeps()], per_group_ops=True)
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0] is not seen[1]
    assert len({seen[0]: 1, seen[1]: 2}) == 1


@pytest.mark.parametrize("value", [None, "train", "op"])
def test_reasons_of_refuses_what_is_not_train_ops(graph, value):
    value = tf.no_op() if value == "op" else value
    with pytest.raises(TypeError, match=r"^train_ops must be the TrainOps returned by "):
        diagnostics.reasons_of(value)


class _Negative(seams.SkipCondition):
    reason = "negative_loss"
    fix = "check the data."

    def flag(self, state):
        return tf.cast(state.plan.groups[0].loss < -1e9, tf.float32)


class _Always(seams.SkipCondition):
    reason = "always"
    fix = "remove the condition."

    def flag(self, state):
        return tf.cast(state.plan.groups[0].loss > -1e9, tf.float32)


def test_two_builders_with_their_own_reasons_decode_their_own(graph):
    """Correct with each builder's reasons; ``decode`` without them was
    CONFUSING ("code must be in 0..7, got 8. Pass the value fetched from
    TrainOps.diagnosis.skip_reason", though the value was that one)."""
    scaler, _ = _one_group(name="a")
    first = scaler.build(skip_conditions=[_Negative()])
    v, loss_v = _net("v")
    other = _scaler()
    other.add(loss_v, tf.train.GradientDescentOptimizer(0.1), var_list=[v], name="b")
    second = other.build(skip_conditions=[_Always()])
    assert diagnostics.reasons_of(first).names[-1] == "negative_loss"
    assert diagnostics.reasons_of(second).names[-1] == "always"
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(second.update_op)
        assert diagnostics.read_last_skip(sess, second).reason == "always"
        values = sess.run(second.diagnosis.last_skip)
        skip = diagnostics.decode(values, diagnostics.reasons_of(second))
        assert (skip.reason, skip.fix) == ("always", "remove the condition.")
        with pytest.raises(ValueError, match=r"^reasons=None decodes the shipped reasons "
                                             r"\(codes 0\.\.7\), got code 8, a reason of the "
                                             r"builder's own skip conditions\. Pass "
                                             r"reasons=diagnostics\.reasons_of\(train_ops\)\.$"):
            diagnostics.decode(values)
        assert diagnostics.read_last_skip(sess, first) is None
