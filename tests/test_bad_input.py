"""Every misuse is rejected at graph-build time with a message that names the
argument, shows the value and says the fix."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import backends as nl_backends
from conftest import GRAPH_MODE, REPO, fresh_process
from conftest import raises_with as _raises
from models import ManagerReturning as _ManagerReturning
from models import two_group_gan


def _scaler():
    return nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="is_finite")


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


def test_loss_not_a_scalar(graph):
    model = two_group_gan()
    vector = tf.reduce_mean(model.g_vars[0], axis=0)
    with _raises(ValueError, "loss", "shape", "reduce_mean"):
        _scaler().add(vector, tf.train.AdamOptimizer(), var_list=model.g_vars)


def test_loss_not_floating(graph):
    model = two_group_gan()
    with _raises(TypeError, "loss", "int32", "tf.cast"):
        _scaler().add(tf.constant(3), tf.train.AdamOptimizer(), var_list=model.g_vars)


def test_loss_not_a_tensor(graph):
    model = two_group_gan()
    with _raises(TypeError, "loss", "3.0"):
        _scaler().add(3.0, tf.train.AdamOptimizer(), var_list=model.g_vars)


def test_empty_var_list(graph):
    model = two_group_gan()
    with _raises(ValueError, "var_list", "'group_0'", "empty", "tf.trainable_variables"):
        _scaler().add(model.g_loss, tf.train.AdamOptimizer(), var_list=[])


def test_variable_in_two_groups(graph):
    model = two_group_gan()
    scaler = _scaler()
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars, name="g")
    with _raises(ValueError, "generator/w", "'g'", "'d'"):
        scaler.add(model.d_loss, tf.train.AdamOptimizer(),
                   var_list=model.d_vars + model.g_vars[:1], name="d")


def test_same_optimizer_in_two_groups(graph):
    model = two_group_gan()
    scaler = _scaler()
    opt = tf.train.AdamOptimizer()
    scaler.add(model.g_loss, opt, var_list=model.g_vars, name="g")
    with _raises(ValueError, "optimizer", "already group 'g''s", "its own optimizer"):
        scaler.add(model.d_loss, opt, var_list=model.d_vars, name="d")


def test_duplicate_group_names(graph):
    model = two_group_gan()
    scaler = _scaler()
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars, name="net")
    with _raises(ValueError, "name", "'net'", "its own name"):
        scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars, name="net")


def test_invalid_group_name(graph):
    model = two_group_gan()
    with _raises(ValueError, "name", "'my net'"):
        _scaler().add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars,
                      name="my net")


def test_add_after_build(graph):
    model = two_group_gan()
    scaler = _scaler()
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars)
    scaler.build()
    with _raises(ValueError, "add() came after build()", "then build() once"):
        scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars)


def test_build_twice(graph):
    model = two_group_gan()
    scaler = _scaler()
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars)
    scaler.build()
    with _raises(ValueError, "build() was already called"):
        scaler.build()


def test_build_without_groups(graph):
    with _raises(ValueError, "no groups", "add("):
        _scaler().build()


def test_group_with_no_gradients(graph):
    model = two_group_gan()
    lonely = tf.get_variable("lonely", [2])
    scaler = _scaler()
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=[lonely], name="g")
    with _raises(ValueError, "'g'", "depends on none of its 1 variables", "var_list"):
        scaler.build()


def test_global_step_not_an_integer_variable(graph):
    model = two_group_gan()
    scaler = _scaler()
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars)
    with _raises(TypeError, "global_step", "get_or_create_global_step"):
        scaler.build(global_step=tf.Variable(0.0))


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


def test_manager_without_protocol(graph):
    with _raises(TypeError, "loss_scale_manager", "get_loss_scale"):
        nl.MultiOptimizerLossScale(1024)


def test_keras_optimizer_is_rejected(graph):
    model = two_group_gan()
    import keras  # the Keras that ships with this TF
    with _raises(TypeError, "optimizer", "tf.compat.v1.train.Optimizer", "Keras"):
        _scaler().add(model.g_loss, keras.optimizers.Adam(), var_list=model.g_vars)


def test_already_wrapped_optimizer_is_rejected(graph):
    """The seed-002 trap: a wrapper patched or wrapped a second time."""
    model = two_group_gan()
    wrapped = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), nl.FixedLossScaleManager(8),
                                    backend="is_finite")
    with _raises(TypeError, "already a loss-scale wrapper", "LossScaleOptimizer"):
        _scaler().add(model.g_loss, wrapped, var_list=model.g_vars)
    tf_wrapped = tf.mixed_precision.MixedPrecisionLossScaleOptimizer(
        tf.train.AdamOptimizer(), loss_scale=8)
    with _raises(TypeError, "MixedPrecisionLossScaleOptimizer"):
        _scaler().add(model.g_loss, tf_wrapped, var_list=model.g_vars)


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
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip().endswith("OK"), out.stderr[-2000:]


# -- Misuses found by trying the API as a new user would (issue: plan first) --

@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_clip_norm_must_be_finite(graph, value):
    """NaN passes every comparison and inf every lower bound; both are refused."""
    model = two_group_gan()
    with _raises(ValueError, "clip_norm", repr(value), "finite"):
        _scaler().add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars,
                      clip_norm=value)


def test_manager_class_instead_of_instance(graph):
    with _raises(TypeError, "loss_scale_manager", "class DynamicLossScaleManager",
                 "DynamicLossScaleManager()"):
        nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager)


def test_var_list_given_as_a_string(graph):
    model = two_group_gan()
    with _raises(TypeError, "var_list", "'generator'", "var_list=[v]"):
        _scaler().add(model.g_loss, tf.train.AdamOptimizer(), var_list="generator")


@pytest.mark.parametrize("value, error, fragment", [
    (None, TypeError, "returned None"),
    ([1024.0, 512.0], ValueError, "shape (2,)"),
    ("big", TypeError, "not a number"),
])
def test_custom_manager_returning_a_bad_scale(graph, value, error, fragment):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(_ManagerReturning(value), backend="is_finite")
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars)
    with _raises(error, "get_loss_scale()", fragment):
        scaler.build()


def test_rejected_build_makes_no_op_and_can_be_retried(graph):
    model = two_group_gan()
    lonely = tf.get_variable("lonely", [2])
    scaler = _scaler()
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars, name="g")
    scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=[lonely], name="d")
    before = len(graph.get_operations())
    with _raises(ValueError, "'d'", "depends on none"):
        scaler.build(accumulation_steps=2)
    assert len(graph.get_operations()) == before  # nothing left behind
    with _raises(TypeError, "count_skipped_steps"):
        scaler.build(count_skipped_steps=1)
    assert len(graph.get_operations()) == before


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


def test_group_named_shared_with_its_own_manager(graph):
    model = two_group_gan()
    scaler = _scaler()
    scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars, name="shared",
               loss_scale_manager=nl.FixedLossScaleManager(1024))
    with _raises(ValueError, "'shared'", "its own manager", "name='shared_net'"):
        scaler.build()


# -- Issue #20: confusing messages become argument, value, fix --

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
    out = subprocess.run([sys.executable, "-c", _EAGER_FUNCTION], cwd=REPO,
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


def test_variable_of_another_graph_in_var_list(graph):
    """Named as a variable of another graph when added (was: "reaches none of
    its variables" at build)."""
    model = two_group_gan()
    with tf.Graph().as_default():
        stranger = tf.get_variable("stranger", [4, 4])
    scaler = _scaler()
    with _raises(ValueError, "var_list", "'stranger:0'", "another graph", "one graph"):
        scaler.add(model.g_loss, tf.train.AdamOptimizer(),
                   var_list=model.g_vars + [stranger])


@pytest.mark.parametrize("api", ["build", "minimize", "apply_gradients"])
def test_global_step_of_another_graph(graph, api):
    """Named, with the fix, before any op (was TF's raw "must be from the same
    graph" from inside the step, after its ops were made)."""
    model = two_group_gan()
    with tf.Graph().as_default():
        stranger = tf.train.get_or_create_global_step()
    manager = nl.DynamicLossScaleManager()
    if api == "apply_gradients":
        grads = [(tf.ones_like(v), v) for v in model.g_vars]
    before = len(graph.get_operations())
    with _raises(ValueError, "global_step", repr(stranger), "another graph",
                 "get_or_create_global_step() in the graph you train in"):
        if api == "build":
            scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
            scaler.add(model.g_loss, tf.train.AdamOptimizer(), var_list=model.g_vars)
            scaler.build(global_step=stranger)
        else:
            opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), manager, backend="is_finite")
            if api == "minimize":
                opt.minimize(model.g_loss, global_step=stranger, var_list=model.g_vars)
            else:
                opt.apply_gradients(grads, global_step=stranger)
    assert len(graph.get_operations()) == before
