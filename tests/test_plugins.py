"""Capabilities are values: the shipped plug-ins are public and compose,
and the keywords that name them are sugar, one row of ``sugar.TABLE`` each
(issue 45, part 1).

The references: the same model built twice, once with the keywords and
once with the plug-ins they name, run the same steps to the same weights,
scales and counters, bit for bit.
"""

import ast
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import seams, skips, sugar, transforms, underflow
from models import two_group_gan

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The packages and modules of the optional capabilities.
_FEATURES = ("npu_lossscale.transforms", "npu_lossscale.skips", "npu_lossscale.underflow",
             "npu_lossscale.distributed", "npu_lossscale.sequence",
             "npu_lossscale.diagnostics.record")


def _negate_half(pairs):
    return [(-0.5 * grad, var) for grad, var in pairs]


def _run(make_train, steps=4):
    """Builds the two-group model in a graph of its own with
    ``make_train(scaler, model, global_step)`` and runs ``steps`` steps
    (the generator's loss poisoned on step 2): the weights, scale, skip count
    and global step after each step."""
    with tf.Graph().as_default():
        model = two_group_gan(compute_dtype=tf.float16)
        global_step = tf.train.get_or_create_global_step()
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(
            initial_scale=2.0 ** 8, growth_steps=2))
        train = make_train(scaler, model, global_step)
        variables = model.d_vars + model.g_vars
        seen = []
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for step in range(steps):
                feed = dict(model.feed)
                if step == 2:
                    feed[model.poison_g] = float("inf")
                sess.run(train.update_op, feed)
                seen.append(sess.run(variables + [train.loss_scale, train.skipped_steps,
                                                  global_step], model.feed))
            underflow_keys = sorted(train.underflow)
        return seen, underflow_keys


def _assert_same(first, second):
    assert first[1] == second[1]
    for one, other in zip(first[0], second[0]):
        for a, b in zip(one, other):
            assert np.array_equal(a, b)


def _with_keywords(scaler, model, global_step):
    scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.d_vars,
               name="d", transform_grads_fn=_negate_half, clip_norm=0.25)
    scaler.add(model.g_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.g_vars,
               name="g", clip_norm=0.5)
    return scaler.build(global_step=global_step, count_skipped_steps=True,
                        skip_global_steps=[1], skip_loss_spikes=50.0,
                        measure_underflow=True, measure_first_scale=True)


def _with_values(scaler, model, global_step):
    scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.d_vars,
               name="d", transform_grads_fn=transforms.chain(
                   _negate_half, transforms.clip_by_global_norm(0.25)))
    scaler.add(model.g_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.g_vars,
               name="g", transform_grads_fn=transforms.clip_by_global_norm(0.5))
    return scaler.build(global_step=global_step, count_skipped_steps=True,
                        skip_conditions=[skips.requested([1]), skips.loss_spikes(50.0)],
                        observers=[underflow.measure_first_scale(),
                                   underflow.measure_underflow()])


def test_the_plug_ins_compose_to_what_the_keywords_build():
    keywords, values = _run(_with_keywords), _run(_with_values)
    _assert_same(keywords, values)
    assert keywords[1] == ["d", "g"]
    scales_and_counts = [row[-3:] for row in keywords[0]]
    assert [int(row[1]) for row in scales_and_counts] == [0, 1, 2, 2]  # requested, poisoned
    assert [int(row[2]) for row in scales_and_counts] == [1, 2, 3, 4]


def test_a_chain_is_one_transform_applied_in_order():
    halve = transforms.chain(_negate_half, _negate_half)
    assert isinstance(halve, seams.GradientTransform) and halve.keeps_finite is False
    assert len(halve.transforms) == 2
    assert transforms.chain(halve, transforms.clip_by_global_norm(1.0)).transforms[:2] == \
        halve.transforms
    assert transforms.chain(transforms.clip_by_global_norm(1.0)).keeps_finite is True
    with tf.Graph().as_default():
        var = tf.Variable([1.0, 2.0])
        [(grad, _)] = halve.transform(None, [(tf.constant([4.0, -8.0]), var)])
        with tf.Session() as sess:
            assert sess.run(grad).tolist() == [1.0, -2.0]


def test_the_constructors_check_their_arguments():
    with pytest.raises(ValueError, match=r"^k must be a finite number > 1, got 1\.0\."):
        skips.loss_spikes(1.0)
    with pytest.raises(TypeError, match=r"^norm must be a number"):
        transforms.clip_by_global_norm("1")
    with pytest.raises(ValueError, match=r"^first_scale_margin must be in 0\.\.15"):
        underflow.measure_first_scale(16)
    with pytest.raises(TypeError, match=r"^skip_global_steps must hold int global steps"):
        skips.requested([1.5])


def test_a_requested_skip_passed_as_a_value_is_checked_as_the_keyword_is(graph):
    model = two_group_gan(compute_dtype=tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.d_vars)
    with pytest.raises(ValueError, match=r"names global steps, but build\(\) got no "
                                         r"global_step"):
        scaler.build(skip_conditions=[skips.requested([3])])


def test_build_refuses_an_unknown_keyword_as_python_would(graph):
    model = two_group_gan(compute_dtype=tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.d_vars)
    with pytest.raises(TypeError, match=r"^build\(\) got an unexpected keyword argument "
                                        r"'skip_loss_spike'; besides its own it takes "
                                        r".*skip_loss_spikes"):
        scaler.build(skip_loss_spike=3.0)
    assert scaler.build().update_op is not None  # nothing was built by the refusal


class _Reports(seams.StepObserver):
    def __init__(self, name, value):
        self.name, self.value = name, value

    def report(self, state):
        return self.value


@pytest.mark.parametrize("first", ["a", "b"])
def test_observed_and_underflow_are_read_by_name(graph, first):
    model = two_group_gan(compute_dtype=tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.d_vars,
               name="d")
    observers = [_Reports("a", 1), _Reports("b", 2)]
    if first == "b":
        observers.reverse()
    train = scaler.build(observers=observers, measure_underflow=True)
    assert train.observed == {"a": 1, "b": 2}
    assert sorted(train.underflow) == ["d"]


@pytest.mark.parametrize("name", ["underflow", "first_scale", "listening", "skip_diagnosis"])
def test_an_observer_may_not_take_a_shipped_observers_name(graph, name):
    """TrainOps reads the shipped observers' reports by name: a user's
    observer named "underflow" filled TrainOps.underflow with its own
    report, silently. A shipped observer's name is now its own; the
    shipped observer itself is still accepted."""
    model = two_group_gan(compute_dtype=tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.d_vars,
               name="d")
    with pytest.raises(ValueError, match="is named %r, the name of .*Give yours another "
                                         "name" % name):
        scaler.build(observers=[_Reports(name, 7)])
    train = scaler.build(observers=[underflow.measure_underflow()])
    assert sorted(train.underflow) == ["d"]


def test_the_builder_imports_no_feature_module():
    """builder.py reaches the capabilities through ``sugar`` and
    ``assembly`` only; ``diagnostics`` (the reasons table its
    ``register_reason`` block writes) is no feature module."""
    path = os.path.join(_REPO, "npu_lossscale", "builder.py")
    with open(path) as source:
        tree = ast.parse(source.read())
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.append(node.module)
            modules.extend("%s.%s" % (node.module, alias.name) for alias in node.names)
    assert "npu_lossscale.sugar" in modules
    assert [name for name in modules
            if any(name == feature or name.startswith(feature + ".")
                   for feature in _FEATURES)] == []


def test_build_takes_the_steps_parameters_and_the_tables_keywords():
    import inspect  # pylint: disable=import-outside-toplevel
    parameters = inspect.signature(nl.MultiOptimizerLossScale.build).parameters
    assert list(parameters) == ["self", "global_step", "accumulation_steps",
                                "count_skipped_steps", "update_ops", "per_group_ops",
                                "skip_conditions", "observers", "sugar"]
    assert sugar.keywords("build") == ["skip_global_steps", "skip_loss_spikes",
                                       "measure_first_scale", "first_scale_margin",
                                       "measure_underflow", "sequence"]
    documented = {"init": nl.MultiOptimizerLossScale, "add": nl.MultiOptimizerLossScale.add,
                  "build": nl.MultiOptimizerLossScale.build}
    for row in sugar.TABLE:
        assert row.kwarg + ": " in documented[row.entry].__doc__
        assert "SUGAR_KEYWORDS" not in documented[row.entry].__doc__
    init = inspect.signature(nl.MultiOptimizerLossScale).parameters
    add = inspect.signature(nl.MultiOptimizerLossScale.add).parameters
    assert all(name in init for name in sugar.keywords("init"))
    assert all(name in add for name in sugar.keywords("add"))


def test_a_new_keyword_is_one_row_of_the_table(graph, monkeypatch):
    """A row added to ``sugar.TABLE``, and nothing else, gives ``build()`` a
    keyword: here ``skip_first_steps=n``, sugar for ``skips.requested(range(n))``."""
    row = sugar.Row("skip_first_steps", "build", None,
                    lambda n, given: () if n is None else (skips.requested(range(n)),),
                    "conditions", "skip the first n global steps.")
    monkeypatch.setattr(sugar, "TABLE", sugar.TABLE + (row,))
    monkeypatch.setitem(sugar._ROWS, row.kwarg, row)  # pylint: disable=protected-access
    model = two_group_gan(compute_dtype=tf.float16)
    global_step = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.d_vars)
    train = scaler.build(global_step=global_step, count_skipped_steps=True, skip_first_steps=2)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        applied = [sess.run([train.update_op, train.applied], model.feed)[1]
                   for _ in range(3)]
    assert applied == [False, False, True]


def test_the_observers_every_build_makes_are_not_passed(graph):
    """The skip diagnosis and the listening managers' hearing are composed
    by every build() that needs them; one passed in observers would run
    twice (two records written, two hearings), so build() refuses it."""
    from npu_lossscale.diagnostics import record  # pylint: disable=import-outside-toplevel
    model = two_group_gan(compute_dtype=tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1), var_list=model.d_vars,
               name="d")
    skip_record = record.Record([])
    for observer, what in ((underflow.Hearing(), "hearing"),
                           (record.SkipDiagnosis(skip_record), "skip diagnosis")):
        with pytest.raises(ValueError, match="is the %s.*every build\\(\\) makes itself"
                                             ".*Leave it out" % ("listening managers' " + what
                                                                 if what == "hearing"
                                                                 else what)):
            scaler.build(observers=[observer])
