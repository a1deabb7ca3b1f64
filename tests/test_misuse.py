"""Every refusal of the builder and ``LossScaleOptimizer``, in one place.

Each misuse is rejected at graph-build time, before any op is made, with a
ValueError or TypeError whose message names the argument, shows the value and
says the fix (issue #20), or, where what the user meant is clear, made to do
it. The sections follow the module that refuses: the arguments
(npu_lossscale/core/checks.py), the backend (backends/), the manager passed in
(managers/base.py), the graph context (context.py), the ``update_ops``
argument (update_ops.py) and the environment (distributed.py). The managers'
own refusals (their constructors' arguments, custom managers at run time) are
in test_manager_misuse.py. References are TF's own ops and unscaled twins.
"""

import re
import sys
import textwrap

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import backends as nl_backends
from npu_lossscale.builder import CLIP_NORM_RANGE
from conftest import GRAPH_MODE, REPO, fresh_process
from conftest import raises_with as _raises
from models import ManagerReturning as _ManagerReturning
from models import add_gan_groups, two_group_gan
from models import batch_norm as _batch_norm
from models import bn_net as _bn_net
from models import counter_model as _counter_model
from models import sgd_group as _sgd_step
from models import two_nets as _two_nets
import warm_python

SCALE = 2.0 ** 10  # a power of two: scaling and unscaling are exact


def _scaler():
    return nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="is_finite")


# -- losses, variables, optimizers and groups (checks.py) --

def test_loss_not_a_scalar(gan):
    vector = tf.reduce_mean(gan.g_vars[0], axis=0)
    with _raises(ValueError, "loss", "shape", "reduce_mean"):
        _scaler().add(vector, tf.train.AdamOptimizer(), var_list=gan.g_vars)


def test_loss_not_floating(gan):
    with _raises(TypeError, "loss", "int32", "tf.cast"):
        _scaler().add(tf.constant(3), tf.train.AdamOptimizer(), var_list=gan.g_vars)


def test_loss_not_a_tensor(gan):
    with _raises(TypeError, "loss", "3.0"):
        _scaler().add(3.0, tf.train.AdamOptimizer(), var_list=gan.g_vars)


def test_empty_var_list(gan):
    with _raises(ValueError, "var_list", "'group_0'", "empty", "tf.trainable_variables"):
        _scaler().add(gan.g_loss, tf.train.AdamOptimizer(), var_list=[])


def test_var_list_given_as_a_string(gan):
    with _raises(TypeError, "var_list", "'generator'", "var_list=[v]"):
        _scaler().add(gan.g_loss, tf.train.AdamOptimizer(), var_list="generator")


def test_a_single_variable_is_its_var_list_as_minimize_takes_it(gan):
    """TF's Optimizer.minimize(var_list=v) flattens one variable to [v]; so
    does add()."""
    scaler = _scaler()
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars[0], name="g")
    train = scaler.build()
    assert [var for _, var in train.grads_and_vars["g"]] == [gan.g_vars[0]]


def test_variable_in_two_groups(gan):
    scaler = _scaler()
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars, name="g")
    with _raises(ValueError, "generator/w", "'g'", "'d'"):
        scaler.add(gan.d_loss, tf.train.AdamOptimizer(),
                   var_list=gan.d_vars + gan.g_vars[:1], name="d")


def test_same_optimizer_in_two_groups(gan):
    scaler = _scaler()
    opt = tf.train.AdamOptimizer()
    scaler.add(gan.g_loss, opt, var_list=gan.g_vars, name="g")
    with _raises(ValueError, "optimizer", "already group 'g''s", "its own optimizer"):
        scaler.add(gan.d_loss, opt, var_list=gan.d_vars, name="d")


def test_duplicate_group_names(gan):
    scaler = _scaler()
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars, name="net")
    with _raises(ValueError, "name", "'net'", "its own name"):
        scaler.add(gan.d_loss, tf.train.AdamOptimizer(), var_list=gan.d_vars, name="net")


def test_invalid_group_name(gan):
    with _raises(ValueError, "name", "'my net'"):
        _scaler().add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars,
                      name="my net")


def test_group_with_no_gradients(gan):
    lonely = tf.get_variable("lonely", [2])
    scaler = _scaler()
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=[lonely], name="g")
    with _raises(ValueError, "'g'", "depends on none of its 1 variables", "var_list"):
        scaler.build()


def test_keras_optimizer_is_rejected(gan):
    import keras  # the Keras that ships with this TF
    with _raises(TypeError, "optimizer", "tf.compat.v1.train.Optimizer", "Keras"):
        _scaler().add(gan.g_loss, keras.optimizers.Adam(), var_list=gan.g_vars)


def test_already_wrapped_optimizer_is_rejected(gan):
    """The seed-002 trap: a wrapper patched or wrapped a second time."""
    wrapped = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), nl.FixedLossScaleManager(8),
                                    backend="is_finite")
    with _raises(TypeError, "already a loss-scale wrapper", "LossScaleOptimizer"):
        _scaler().add(gan.g_loss, wrapped, var_list=gan.g_vars)
    tf_wrapped = tf.mixed_precision.MixedPrecisionLossScaleOptimizer(
        tf.train.AdamOptimizer(), loss_scale=8)
    with _raises(TypeError, "MixedPrecisionLossScaleOptimizer"):
        _scaler().add(gan.g_loss, tf_wrapped, var_list=gan.g_vars)


def test_wrong_optimizer_type(graph):
    with pytest.raises(TypeError, match="opt must be a tf.compat.v1.train.Optimizer"):
        nl.LossScaleOptimizer("adam", nl.FixedLossScaleManager(8))


def test_apply_gradients_with_no_gradient(gan):
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), nl.FixedLossScaleManager(8),
                                backend="is_finite")
    with pytest.raises(ValueError, match="only None gradients"):
        opt.apply_gradients([(None, gan.g_vars[0])])


def test_global_step_not_an_integer_variable(gan):
    scaler = _scaler()
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars)
    with _raises(TypeError, "global_step", "get_or_create_global_step"):
        scaler.build(global_step=tf.Variable(0.0))


# -- build() and its options (checks.py) --

def test_add_after_build(gan):
    scaler = _scaler()
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars)
    scaler.build()
    with _raises(ValueError, "add() came after build()", "then build() once"):
        scaler.add(gan.d_loss, tf.train.AdamOptimizer(), var_list=gan.d_vars)


def test_build_twice(gan):
    scaler = _scaler()
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars)
    scaler.build()
    with _raises(ValueError, "build() was already called"):
        scaler.build()


def test_build_without_groups(graph):
    with _raises(ValueError, "no groups", "add("):
        _scaler().build()


def test_rejected_build_makes_no_op_and_can_be_retried(graph, gan):
    lonely = tf.get_variable("lonely", [2])
    scaler = _scaler()
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars, name="g")
    scaler.add(gan.d_loss, tf.train.AdamOptimizer(), var_list=[lonely], name="d")
    before = len(graph.get_operations())
    with _raises(ValueError, "'d'", "depends on none"):
        scaler.build(accumulation_steps=2)
    assert len(graph.get_operations()) == before  # nothing left behind
    with _raises(TypeError, "count_skipped_steps"):
        scaler.build(count_skipped_steps=1)
    assert len(graph.get_operations()) == before


@pytest.mark.parametrize("value, error, fragment", [
    (0, ValueError, "accumulation_steps must be >= 1, got 0"),
    (2.5, TypeError, "accumulation_steps must be a whole number, got 2.5"),
    (float("nan"), ValueError, "accumulation_steps must be a finite number, got nan"),
    (True, TypeError, "accumulation_steps must be a whole number, got True"),
    ("4", TypeError, "accumulation_steps must be a whole number, got '4'"),
])
def test_bad_accumulation_steps(gan, value, error, fragment):
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    scaler.add(gan.d_loss, tf.train.AdamOptimizer(), var_list=gan.d_vars)
    with pytest.raises(error) as info:
        scaler.build(accumulation_steps=value)
    assert fragment in str(info.value)


def test_bad_skip_policy(graph):
    with pytest.raises(ValueError, match="skip_policy must be one of .* got 'some'"):
        nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), skip_policy="some")


def test_per_group_ops_with_accumulation_are_refused(gan):
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE), backend="is_finite")
    add_gan_groups(scaler, gan)
    with pytest.raises(ValueError, match="need accumulation_steps=1, got 2"):
        scaler.build(accumulation_steps=2, per_group_ops=True)


# -- clip_norm (checks.py): finite, and in float32's normal range --

@pytest.mark.parametrize("value, error", [(0, ValueError), (-1.0, ValueError), ("1", TypeError)])
def test_bad_clip_norm(gan, value, error):
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    with pytest.raises(error, match="clip_norm"):
        scaler.add(gan.d_loss, tf.train.AdamOptimizer(), var_list=gan.d_vars, clip_norm=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_clip_norm_must_be_finite(gan, value):
    """NaN passes every comparison and inf every lower bound; both are refused."""
    with _raises(ValueError, "clip_norm", repr(value), "finite"):
        _scaler().add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars,
                      clip_norm=value)


def _clip_in_tf(clip_norm):
    """TF's own clip_by_global_norm of a gradient of norm 5 (float32)."""
    with tf.Graph().as_default():
        grad = tf.constant([3.0, 4.0])
        clipped, _ = tf.clip_by_global_norm([grad], clip_norm)
        with tf.Session() as sess:
            return sess.run(clipped[0])


def test_clip_norm_range_is_where_tfs_clip_works():
    """The bounds are float32's normal range for clip_norm and its
    reciprocal. At the top TF's clip leaves a norm-5 gradient unchanged; one
    binade higher 1 / clip_norm is subnormal, flushed to 0, and the gradient
    comes out 0. Below the bottom clip_norm itself is subnormal (the issue's
    1e-40) and TF zeroes the gradient."""
    low, high = CLIP_NORM_RANGE
    assert low == np.finfo(np.float32).tiny and high == 1 / low
    assert np.array_equal(_clip_in_tf(high), [3.0, 4.0])
    assert not np.any(_clip_in_tf(high * 2))
    assert not np.any(_clip_in_tf(1e-40))


@pytest.mark.parametrize("clip_norm", [1e39, 3e38, 1e38, 1e-40, 2.0 ** 127, 2.0 ** -127])
def test_clip_norm_outside_float32s_normal_range_is_refused(graph, clip_norm):
    x = tf.get_variable("x", [2], initializer=tf.ones_initializer())
    loss = tf.reduce_sum(x * x)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"clip_norm must be in \[.*got %s\. .*normal float32"
                       % re.escape(repr(clip_norm))):
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[x],
                   clip_norm=clip_norm)
    assert len(graph.get_operations()) == before


def test_clip_norm_at_the_top_of_the_range_trains_as_unclipped(graph):
    """A huge but representable clip_norm clips nothing: the weights equal
    an unclipped twin's (hand-computed SGD step on x*x: x - 0.1 * 2x)."""
    x = tf.get_variable("x", [2], initializer=tf.ones_initializer())
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    scaler.add(tf.reduce_sum(x * x), tf.train.GradientDescentOptimizer(0.1), var_list=[x],
               clip_norm=CLIP_NORM_RANGE[1])
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        np.testing.assert_array_equal(sess.run(x), np.float32([0.8, 0.8]))
        assert sess.run(gs) == 1


# -- the backend (backends/) --

def test_unknown_backend(graph):
    with _raises(ValueError, "backend", "'tpu'", "is_finite"):
        nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="tpu")


@pytest.mark.parametrize("make", ["builder", "optimizer", "all_finite"])
@pytest.mark.parametrize("value, fragments", [
    (object(), ["backend=<object", "'is_finite'", "Backend instance"]),
    (None, ["backend=None", "'is_finite'", "Backend instance"]),
    (nl_backends.IsFiniteBackend, ["is a class", "backend=IsFiniteBackend()"]),
])
def test_backend_neither_name_nor_instance(graph, make, value, fragments):
    with _raises(TypeError, *fragments):
        if make == "builder":
            nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend=value)
        elif make == "optimizer":
            nl.LossScaleOptimizer(tf.train.AdamOptimizer(), nl.FixedLossScaleManager(8),
                                  backend=value)
        else:
            nl.all_finite([tf.ones([2])], backend=value)


def test_backend_flag_not_a_float32_scalar(graph):
    """A user backend whose flag the step cannot sum and compare: refused at
    build, before the flag is used."""
    class BoolFlag(nl_backends.Backend):
        name = "bool_flag"

        def overflow_flag(self, tensors, after=()):
            return tf.reduce_all(tf.is_finite(tensors[0]))

    with _raises(TypeError, "backend 'bool_flag'", "overflow_flag", "dtype=bool",
                 "float32 scalar"):
        nl.all_finite([tf.ones([2])], backend=BoolFlag())


def test_npu_backend_without_npu_bridge(graph):
    with _raises(ValueError, "backend='npu'", "npu_bridge", "CANN", "is_finite"):
        nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="npu")


def test_auto_backend_without_npu_bridge_is_is_finite(graph):
    assert nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8)).backend == "is_finite"


# -- the manager passed in (managers/base.py) --

def test_manager_without_protocol(graph):
    with _raises(TypeError, "loss_scale_manager", "get_loss_scale"):
        nl.MultiOptimizerLossScale(1024)


def test_manager_class_instead_of_instance(graph):
    with _raises(TypeError, "loss_scale_manager", "class DynamicLossScaleManager",
                 "DynamicLossScaleManager()"):
        nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager)


def test_none_as_the_manager_is_a_value_error(graph):
    """As TF's own wrapper: tensorflow/python/training/experimental/
    loss_scale_optimizer_test.py testPassingNoneToLossScale expects
    ValueError('loss_scale cannot be None') from
    MixedPrecisionLossScaleOptimizer(opt, None)."""
    with pytest.raises(ValueError, match="loss_scale cannot be None"):
        tf.mixed_precision.MixedPrecisionLossScaleOptimizer(
            tf.train.GradientDescentOptimizer(1.0), None)
    with _raises(ValueError, "loss_scale_manager", "got None", "DynamicLossScaleManager()"):
        nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0), None)
    with _raises(ValueError, "loss_scale_manager", "got None"):
        nl.MultiOptimizerLossScale(None)


def test_bad_per_group_manager(gan):
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
    with pytest.raises(TypeError, match="loss_scale_manager must have get_loss_scale"):
        scaler.add(gan.d_loss, tf.train.AdamOptimizer(), var_list=gan.d_vars,
                   loss_scale_manager="dynamic")


@pytest.mark.parametrize("value, error, fragment", [
    (None, TypeError, "returned None"),
    ([1024.0, 512.0], ValueError, "shape (2,)"),
    ("big", TypeError, "not a number"),
])
def test_custom_manager_returning_a_bad_scale(gan, value, error, fragment):
    scaler = nl.MultiOptimizerLossScale(_ManagerReturning(value), backend="is_finite")
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars)
    with _raises(error, "get_loss_scale()", fragment):
        scaler.build()


def test_group_named_shared_with_its_own_manager(gan):
    scaler = _scaler()
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars, name="shared",
               loss_scale_manager=nl.FixedLossScaleManager(1024))
    with _raises(ValueError, "'shared'", "its own manager", "name='shared_net'"):
        scaler.build()


# -- the graph context (context.py): graph mode, the top level, one graph --

@fresh_process
def test_eager_mode_is_rejected():
    """Eager is process-global, so this runs in a fresh interpreter."""
    code = textwrap.dedent("""
        import tensorflow.compat.v1 as tf
        import npu_lossscale as nl
        try:
            nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="is_finite")
        except ValueError as error:
            assert "cannot run eagerly" in str(error), error
            assert "disable_eager_execution" in str(error), error
            print("OK")
    """)
    out = warm_python.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip().endswith("OK"), out.stderr[-2000:]


def _build_where(where, build):
    """Calls ``build`` inside ``where`` ("cond", "while" or "function") of the
    default graph and returns (the error it raised, the ops it made there)."""
    result = {}

    def inside():
        made_in = tf.get_default_graph()
        before = len(made_in.get_operations())
        with pytest.raises(ValueError) as info:
            build()
        result["error"] = str(info.value)
        result["made"] = len(made_in.get_operations()) - before
        return tf.constant(True)

    if where == "cond":
        tf.cond(tf.placeholder_with_default(True, []), inside, lambda: tf.constant(True))
    elif where == "while":
        tf.while_loop(lambda i: i < 2, lambda i: tf.identity(i + tf.cast(inside(), tf.int32)),
                      [tf.constant(0)])
    else:
        tf.function(inside, autograph=False)()
    return result["error"], result["made"]


@pytest.mark.parametrize("where", ["cond", "while", "function"])
@pytest.mark.parametrize("api", ["minimize", "apply_gradients", "build"])
def test_building_inside_control_flow_or_a_function_is_refused(graph, where, api):
    """Inside a tf.cond branch, a tf.while_loop body or a graph-mode
    tf.function, every backend (is_finite here) refuses before making an op,
    naming the call and the fix (was: "belongs to another graph", or a step
    whose scale update and global_step are made for another run)."""
    if where == "function" and GRAPH_MODE == "v1":
        pytest.skip("a tf.function body is a v2 function graph; v1 runs cond and while")
    model = two_group_gan()
    gs = tf.train.get_or_create_global_step()
    manager = nl.DynamicLossScaleManager()
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), manager, backend="is_finite")
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars)
    grads = tf.gradients(model.g_loss, model.g_vars)
    builds = {
        "minimize": lambda: opt.minimize(model.g_loss, global_step=gs, var_list=model.g_vars),
        "apply_gradients": lambda: opt.apply_gradients(zip(grads, model.g_vars),
                                                       global_step=gs),
        "build": lambda: scaler.build(global_step=gs),
    }
    message, made = _build_where(where, builds[api])
    for fragment in ("top level of the graph", "tf.cond, tf.while_loop and tf.function",
                     "session.run"):
        assert fragment in message, (fragment, message)
    assert made == 0
    # The same calls at the top level build and train.
    train = builds[api]()
    update = train.update_op if api == "build" else train
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        before = sess.run(model.g_vars)
        sess.run(update, model.feed)
        assert sess.run(gs) == 1
        assert not np.array_equal(before[0], sess.run(model.g_vars[0]))


_EAGER_FUNCTION = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf2
    import tensorflow.compat.v1 as tf
    import npu_lossscale as nl

    assert tf.executing_eagerly()
    init = np.array([0.5, -1.5, 2.0], np.float32)
    ours_w, plain_w = tf.Variable(init), tf.Variable(init)
    poison = tf.Variable(1.0)
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.1),
                                nl.FixedLossScaleManager(2.0 ** 6), backend="is_finite")
    plain = tf.train.AdamOptimizer(0.1)

    @tf2.function
    def ours_step():
        opt.minimize(tf.reduce_sum(ours_w * ours_w * ours_w) * poison, var_list=[ours_w])

    @tf2.function
    def plain_step():
        plain.minimize(tf.reduce_sum(plain_w * plain_w * plain_w), var_list=[plain_w])

    for _ in range(3):
        ours_step()
        plain_step()
    # The plain optimizer as the reference: a power-of-two scale is exact.
    assert ours_w.numpy().tobytes() == plain_w.numpy().tobytes()
    assert not np.array_equal(ours_w.numpy(), init)
    slots = [opt.get_slot(ours_w, name).numpy() for name in ("m", "v")]
    before = ours_w.numpy()
    poison.assign(np.inf)
    ours_step()  # an overflow: skipped, weights and slots untouched
    assert ours_w.numpy().tobytes() == before.tobytes()
    for name, slot in zip(("m", "v"), slots):
        assert opt.get_slot(ours_w, name).numpy().tobytes() == slot.tobytes()

    @tf2.function
    def builder_step():
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0),
                                            backend="is_finite")
        scaler.add(tf.reduce_sum(ours_w), tf.train.AdamOptimizer(), var_list=[ours_w])
        scaler.build()

    try:
        builder_step()
    except ValueError as error:
        for fragment in ("MultiOptimizerLossScale", "eager program's tf.function",
                         "Disable eager execution", "LossScaleOptimizer"):
            assert fragment in str(error), (fragment, str(error))
    print("OK")
""")


@fresh_process
def test_tf_function_in_an_eager_program():
    """In an eager program (TF2 behaviour, a fresh interpreter),
    LossScaleOptimizer.minimize inside a tf.function, with the manager made
    outside, trains bit for bit like the plain optimizer and skips an
    overflow; the builder, which makes variables of its own, is refused with
    the fix (was: AttributeError: Tensor.op is undefined)."""
    out = warm_python.run([sys.executable, "-c", _EAGER_FUNCTION], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_manager_made_before_reset_default_graph():
    """A manager from before tf.reset_default_graph() keeps its state in the
    old graph: named, with the fix, at construction (was: "belongs to another
    graph" deep inside build)."""
    tf.reset_default_graph()
    try:
        old = nl.DynamicLossScaleManager()
        tf.reset_default_graph()
        model = two_group_gan()
        fragments = ["loss_scale_manager", "another graph", "reset_default_graph",
                     "Make the manager in the graph you train in"]
        with _raises(ValueError, *fragments):
            nl.MultiOptimizerLossScale(old)
        with _raises(ValueError, *fragments):
            nl.LossScaleOptimizer(tf.train.AdamOptimizer(), old)
        scaler = _scaler()
        with _raises(ValueError, *fragments):
            scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars,
                       loss_scale_manager=old)
        # A LossScaleOptimizer made with it in its graph, used in a new one.
        with tf.Graph().as_default():
            manager = nl.DynamicLossScaleManager()
            opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), manager)
        before = len(tf.get_default_graph().get_operations())
        with _raises(ValueError, *fragments):
            opt.minimize(model.g_loss, var_list=model.g_vars)
        with _raises(ValueError, *fragments):
            opt.apply_gradients([(tf.ones([4, 4]), model.g_vars[0])])
        assert len(tf.get_default_graph().get_operations()) == before + 1  # the tf.ones
    finally:
        tf.reset_default_graph()


def test_variable_of_another_graph_in_var_list(graph, gan):
    """Named as a variable of another graph when added (was: "reaches none of
    its variables" at build)."""
    with tf.Graph().as_default():
        stranger = tf.get_variable("stranger", [4, 4])
    scaler = _scaler()
    with _raises(ValueError, "var_list", "'stranger:0'", "another graph", "one graph"):
        scaler.add(gan.g_loss, tf.train.AdamOptimizer(),
                   var_list=gan.g_vars + [stranger])


@pytest.mark.parametrize("api", ["build", "minimize", "apply_gradients"])
def test_global_step_of_another_graph(graph, gan, api):
    """Named, with the fix, before any op (was TF's raw "must be from the same
    graph" from inside the step, after its ops were made)."""
    with tf.Graph().as_default():
        stranger = tf.train.get_or_create_global_step()
    manager = nl.DynamicLossScaleManager()
    if api == "apply_gradients":
        grads = [(tf.ones_like(v), v) for v in gan.g_vars]
    before = len(graph.get_operations())
    with _raises(ValueError, "global_step", repr(stranger), "another graph",
                 "get_or_create_global_step() in the graph you train in"):
        if api == "build":
            scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
            scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars)
            scaler.build(global_step=stranger)
        else:
            opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), manager, backend="is_finite")
            if api == "minimize":
                opt.minimize(gan.g_loss, global_step=stranger, var_list=gan.g_vars)
            else:
                opt.apply_gradients(grads, global_step=stranger)
    assert len(graph.get_operations()) == before


# -- the update_ops argument (update_ops.py); what it accepts is in test_update_ops.py --

def test_update_ops_from_a_cond_are_refused(graph):
    """A tf.cond around the updates hides them from the gate: refused, no op
    made."""
    loss, _, _, updates = _bn_net(True, lambda ops: [op.op for op in ops])
    training = tf.placeholder_with_default(True, [])
    wrapped = tf.cond(training, lambda: tf.group(*updates), tf.no_op)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), name="net")
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match="tf.cond or tf.while_loop.*without the cond"):
        scaler.build(update_ops=[wrapped])
    assert len(graph.get_operations()) == before


def test_update_ops_that_update_nothing_are_refused(graph):
    loss, _, moving, _ = _bn_net(True, lambda ops: ops)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), name="net")
    with pytest.raises(ValueError, match="updates no variable"):
        scaler.build(update_ops=[tf.identity(moving[0])])
    with pytest.raises(ValueError, match="updates no variable"):
        scaler.build(update_ops=[tf.no_op()])


def test_updates_made_inside_a_cond_are_refused(graph):
    """The update is made in the cond's branch (a Switch/Merge frame under
    v1, the If's branch function under v2): refused, naming the cond."""
    loss, w, _, counter, _ = _counter_model()
    training = tf.placeholder_with_default(True, [])
    entry = tf.cond(training, lambda: tf.identity(tf.assign_add(counter, 1.0)),
                    lambda: tf.constant(0.0))
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    _sgd_step(scaler, loss, [w])
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"through a tf.cond or tf.while_loop \(op 'cond.*"
                                         r"without the cond"):
        scaler.build(update_ops=[entry])
    assert len(graph.get_operations()) == before


def test_another_steps_update_op_is_refused_as_such(graph):
    """Another builder's update_op, or a LossScaleOptimizer's train op, given
    as update_ops: the message says what it is (not a tf.cond the user never
    wrote) and the fix; no op is made."""
    x, y, loss_x, loss_y = _two_nets()
    z = tf.get_variable("z", [2], initializer=tf.ones_initializer())
    first = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    _sgd_step(first, loss_x, [x], name="x")
    other_builder = first.build().update_op
    other_optimizer = nl.LossScaleOptimizer(
        tf.train.GradientDescentOptimizer(0.1), nl.FixedLossScaleManager(8.0),
        backend="is_finite").minimize(tf.reduce_sum(z * z), var_list=[z])
    for other in (other_builder, other_optimizer, tf.group(other_builder)):
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0),
                                            backend="is_finite")
        _sgd_step(scaler, loss_y, [y], name="y")
        before = len(graph.get_operations())
        with pytest.raises(ValueError, match=r"update_ops entry %r runs another training "
                                             r"step .*in its own session.run" % other.name):
            scaler.build(update_ops=[other])
        assert len(graph.get_operations()) == before


@pytest.mark.parametrize("form", ["argument", "entry", "group_entry"])
def test_update_ops_given_by_name_are_a_type_error(graph, form):
    """An op name (a string) is no op: named in full, with the two fixes (it
    used to be iterated and echoed as its first character)."""
    loss, w, _, _, update = _counter_model()
    name = update.op.name
    value = {"argument": name, "entry": [name], "group_entry": {"net": [name]}}[form]
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    _sgd_step(scaler, loss, [w])
    before = len(graph.get_operations())
    with pytest.raises(TypeError, match=r"not names, got the string %s\. Pass "
                                        r"tf.get_default_graph\(\).get_operation_by_name"
                                        % re.escape(repr(name))):
        scaler.build(update_ops=value)
    assert len(graph.get_operations()) == before


def test_update_ops_the_loss_already_depends_on_are_refused(graph):
    x = tf.placeholder(tf.float32, [4, 2])
    h = _batch_norm(x * tf.get_variable("w", [], initializer=tf.ones_initializer()), "bn")
    updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(updates):  # the TF1 idiom
        loss = tf.identity(tf.reduce_mean(h ** 2))
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), name="net")
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match="control_dependencies"):
        scaler.build(update_ops=updates)
    assert len(graph.get_operations()) == before


# -- the environment (distributed.py): the number of devices --

@pytest.mark.parametrize("environ, fragments", [
    ({"RANK_SIZE": "0"}, ["RANK_SIZE", "'0'", "positive"]),
    ({"RANK_SIZE": "-2"}, ["RANK_SIZE", "'-2'"]),
    ({"CM_WORKER_SIZE": "two"}, ["CM_WORKER_SIZE", "'two'"]),
    ({"RANK_SIZE": "2", "CM_WORKER_SIZE": "2"}, ["both", "Unset one"]),
])
def test_bad_rank_size_environment(environ, fragments):
    from npu_lossscale import distributed
    with _raises(ValueError, *fragments):
        distributed.rank_size_from_environment(environ)


def test_rank_size_environment_read_as_tf_adapter_does():
    """tf_adapter npu_bridge/estimator/npu/util.py get_ranksize(): RANK_SIZE,
    else CM_WORKER_SIZE, else one device; both set is an error."""
    from npu_lossscale import distributed
    assert distributed.rank_size_from_environment({}) == 1
    assert distributed.rank_size_from_environment({"RANK_SIZE": "8"}) == 8
    assert distributed.rank_size_from_environment({"CM_WORKER_SIZE": "4"}) == 4


@pytest.mark.parametrize("distributed, value, error, match", [
    (None, True, ValueError, r"allreduce_float16=True needs distributed='horovod' or 'hccl', "
                             r"got distributed=None"),
    (False, True, ValueError, r"got distributed=False"),
    (None, "yes", TypeError, r"allreduce_float16"),
])
def test_float16_allreduce_needs_an_engine(graph, distributed, value, error, match):
    with pytest.raises(error, match=match):
        nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), distributed=distributed,
                                   allreduce_float16=value)
