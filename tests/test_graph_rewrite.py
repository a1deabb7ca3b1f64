"""Graph-rewrite mixed precision: a float32 model whose matrix ops the graph
optimizer computes in float16, with our loss scaling (issue 27, item 3).

* CPU/GPU: grappler's auto mixed precision. On a GPU it is
  ``rewrite_options.auto_mixed_precision``; on CPU, TF 2.x's
  ``auto_mixed_precision_cpu`` (in TF 2.15 and 2.21, not in 1.15) inserts the
  same float16 casts around MatMul and the ops between them (computing in
  float32 inside each op, rounding at its boundaries), with no environment
  variable and no CPU feature required. A fetched tensor is kept in float32
  (grappler preserves fetch nodes), so these tests fetch weights, decisions
  and scales, never the rewritten gradients.
* Ascend: GE's ``precision_mode="allow_mix_precision"``, emulated by the
  shim (``npu_bridge._emulation.apply_session_config``): MatMul results are
  rounded to float16, saturated and flagged in the register in saturation
  mode.
* TF's ``enable_mixed_precision_graph_rewrite(opt)`` wraps ``opt`` in its own
  loss-scale optimizer: with ours on either side of it, a build-time
  TypeError that names it and the fix.
"""


import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from tensorflow.core.protobuf import rewriter_config_pb2

import npu_lossscale as nl
from readme_blocks import block

#: The loss multiplier that puts dL/dY (2**-30 / 16 and below) under
#: float16's smallest subnormal, 2**-24: 0 once rounded to float16.
_TINY = 2.0 ** -30
#: A learning rate that brings those gradients back to weight changes of
#: order 1, so (w_before - w_after) / lr recovers them from the weights.
_UNDERFLOW_LR = 2.0 ** 33
#: A scale that lifts them into float16's normal range (above 2**-14).
_RESCUE_SCALE = 2.0 ** 20

_RNG = np.random.RandomState(0)
_X = _RNG.normal(size=[8, 4]).astype(np.float32)
_W = _RNG.normal(size=[4, 2]).astype(np.float32)


def _rewrite_config():
    """A session config with the CPU auto mixed precision rewrite on."""
    config = tf.ConfigProto()
    config.graph_options.rewrite_options.auto_mixed_precision_cpu = (
        rewriter_config_pb2.RewriterConfig.ON)
    return config


def _tanh_model():
    """x [8, 4] -> tanh(x @ w) -> mean * 2**-30: every dL/dY is below
    float16's range."""
    w = tf.Variable(_W, name="w")
    loss = tf.reduce_mean(tf.tanh(tf.matmul(tf.constant(_X), w))) * _TINY
    return w, loss


def _train(make_step, config, runs=1, model=_tanh_model):
    """Builds ``model`` and ``make_step(loss, w)`` in a fresh graph, runs the
    step ``runs`` times under ``config``; returns (fetched per run, w)."""
    with tf.Graph().as_default():
        w, loss = model()
        step = make_step(loss, w)
        with tf.Session(config=config) as sess:
            sess.run(tf.global_variables_initializer())
            results = [sess.run(step) for _ in range(runs)]
            return results, sess.run(w)


def _builder_step(manager, optimizer, backend="is_finite"):
    def make(loss, w):
        scaler = nl.MultiOptimizerLossScale(manager(), backend=backend)
        scaler.add(loss, optimizer(), var_list=[w], name="w")
        train = scaler.build(global_step=tf.train.get_or_create_global_step())
        return {"update": train.update_op, "finite": train.is_finite,
                "scale": train.loss_scale}
    return make


def _plain_step(optimizer):
    def make(loss, w):
        return {"update": optimizer().minimize(loss, var_list=[w])}
    return make


def _sgd(learning_rate):
    return lambda: tf.train.GradientDescentOptimizer(learning_rate)


# -- the CPU rewrite --------------------------------------------------------

def test_the_rewrite_is_on_and_rounds_to_float16():
    """The rewritten graph holds grappler's float16 casts, and a gradient of
    2**-33 becomes 0 there: plain training under the rewrite does not move
    the weights, plain float32 training does."""
    with tf.Graph().as_default():
        w, loss = _tanh_model()
        train = tf.train.GradientDescentOptimizer(_UNDERFLOW_LR).minimize(loss)
        with tf.Session(config=_rewrite_config()) as sess:
            sess.run(tf.global_variables_initializer())
            metadata = tf.RunMetadata()
            sess.run(train, options=tf.RunOptions(output_partition_graphs=True),
                     run_metadata=metadata)
            casts = [node.name for graph in metadata.partition_graphs for node in graph.node
                     if node.op == "Cast" and "CastToFp16" in node.name]
            assert casts, "auto_mixed_precision_cpu inserted no float16 cast"
            np.testing.assert_array_equal(sess.run(w), _W)
    _, w_plain = _train(_plain_step(_sgd(_UNDERFLOW_LR)), None)
    assert not np.array_equal(w_plain, _W)


def test_underflow_is_rescued_by_the_scale():
    """Under the rewrite, scale 1 gives zero gradients (the weights stay);
    scale 2**20 gives the float32 twin's gradients to float16's precision."""
    twin = _W - _train(_plain_step(_sgd(_UNDERFLOW_LR)), None)[1]
    _, at_one = _train(_builder_step(lambda: nl.FixedLossScaleManager(1),
                                     _sgd(_UNDERFLOW_LR)), _rewrite_config())
    np.testing.assert_array_equal(at_one, _W)
    results, scaled = _train(
        _builder_step(lambda: nl.DynamicLossScaleManager(initial_scale=_RESCUE_SCALE),
                      _sgd(_UNDERFLOW_LR)), _rewrite_config())
    assert bool(results[0]["finite"]) and float(results[0]["scale"]) == _RESCUE_SCALE
    assert np.abs(twin).min() > 0
    # float16 keeps 11 significant bits: 2**-11 relative, twice (dY, dW).
    np.testing.assert_allclose(_W - scaled, twin, rtol=2e-3)


#: The linear model's weights: small enough that the gradient with respect
#: to its input, dY @ w^T (|row sums| < 0.75), stays in float16 whenever dY
#: does; with gate_gradients it is computed, and on Ascend flagged.
_W_LINEAR = _W / 4


def _linear_model():
    """x = 0.125 [8, 4] -> mean(x @ w) over 16 outputs: dL/dY = 1/16, dL/dw
    = 8 * 0.125 / 16 = 1/16 in every element, exact in float16 at any power
    of two scale that does not overflow."""
    w = tf.Variable(_W_LINEAR, name="w")
    loss = tf.reduce_mean(tf.matmul(tf.constant(np.full([8, 4], 0.125, np.float32)), w))
    return w, loss


def _forward_overflow_model():
    """x @ w = 4 * 256 * 64 = 65536 in every output: inf in float16 (above
    65504), finite in float32; the square loss passes the inf to every
    gradient."""
    w = tf.Variable(np.full([4, 2], 64.0, np.float32), name="w")
    h = tf.matmul(tf.constant(np.full([8, 4], 256.0, np.float32)), w)
    return w, tf.reduce_mean(tf.square(h)) * 2.0 ** -40


def _adam():
    return tf.train.AdamOptimizer(0.1)


def _model_state(sess):
    """Every global variable but the library's (the builder's records and the
    manager's state, which move on a skip by design)."""
    variables = [v for v in tf.global_variables()
                 if not v.op.name.startswith(("loss_scale/", "dynamic_loss_scale/"))]
    return dict(zip([v.op.name for v in variables], sess.run(variables)))


def test_backward_overflow_is_caught_and_the_scale_backs_off():
    """At 2**20, dL/dY = 2**16 = 65536 overflows float16 under the rewrite:
    skipped, weights, slots and step untouched, scale halved; at 2**19 the
    gradient (2**15, unscaled to 1/16 exactly) applies, equal to a float32
    Adam twin bit for bit."""
    with tf.Graph().as_default():
        w, loss = _linear_model()
        step = _builder_step(lambda: nl.DynamicLossScaleManager(initial_scale=2.0 ** 20),
                             _adam)(loss, w)
        with tf.Session(config=_rewrite_config()) as sess:
            sess.run(tf.global_variables_initializer())
            before = _model_state(sess)
            skipped = sess.run(step)
            after_skip = _model_state(sess)
            applied = sess.run(step)
            ours = sess.run(w)
    assert (bool(skipped["finite"]), float(skipped["scale"])) == (False, 2.0 ** 20)
    assert (bool(applied["finite"]), float(applied["scale"])) == (True, 2.0 ** 19)
    assert sorted(before) == sorted(after_skip) and len(before) == 6  # w, m, v, powers, step
    for name in before:
        np.testing.assert_array_equal(before[name], after_skip[name], err_msg=name)
    _, twin = _train(_plain_step(_adam), None, model=_linear_model)
    np.testing.assert_array_equal(ours, twin)
    assert not np.array_equal(ours, _W_LINEAR)


def test_backward_overflow_skips_nothing_without_the_rewrite():
    results, _ = _train(
        _builder_step(lambda: nl.DynamicLossScaleManager(initial_scale=2.0 ** 20), _adam),
        None, runs=1, model=_linear_model)
    assert bool(results[0]["finite"])


def test_forward_overflow_is_caught_at_every_scale():
    """A float16 overflow in the forward pass makes every gradient inf: each
    step is skipped, the weights stay and the scale halves each time."""
    results, w = _train(
        _builder_step(lambda: nl.DynamicLossScaleManager(initial_scale=2.0 ** 4), _adam),
        _rewrite_config(), runs=3, model=_forward_overflow_model)
    assert [(bool(r["finite"]), float(r["scale"])) for r in results] == [
        (False, 16.0), (False, 8.0), (False, 4.0)]
    np.testing.assert_array_equal(w, np.full([4, 2], 64.0, np.float32))
    results, _ = _train(
        _builder_step(lambda: nl.DynamicLossScaleManager(initial_scale=2.0 ** 4), _adam),
        None, runs=1, model=_forward_overflow_model)
    assert bool(results[0]["finite"])  # float32 alone: no overflow


def test_loss_scale_optimizer_under_the_rewrite():
    """LossScaleOptimizer.minimize: the same skip and back-off, then the
    float32 twin's step."""
    with tf.Graph().as_default():
        w, loss = _linear_model()
        manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 20)
        train = nl.LossScaleOptimizer(_adam(), manager, backend="is_finite").minimize(
            loss, var_list=[w])
        with tf.Session(config=_rewrite_config()) as sess:
            sess.run(tf.global_variables_initializer())
            scales = []
            for _ in range(2):
                sess.run(train)
                scales.append(float(sess.run(manager.loss_scale)))
            ours = sess.run(w)
    assert scales == [2.0 ** 19, 2.0 ** 19]  # halved by the skip, kept by the apply
    _, twin = _train(_plain_step(_adam), None, model=_linear_model)
    np.testing.assert_array_equal(ours, twin)


# -- TF's enable_mixed_precision_graph_rewrite with ours ---------------------

@pytest.fixture
def tf_graph_rewrite(graph):
    """TF's enable_mixed_precision_graph_rewrite, turned off again after the
    test (it sets a process-wide flag that edits every later Session's
    config)."""
    yield tf.train.experimental.enable_mixed_precision_graph_rewrite
    tf.train.experimental.disable_mixed_precision_graph_rewrite()


def _raises_naming_the_fix(excinfo):
    message = str(excinfo.value)
    for fragment in ("MixedPrecisionLossScaleOptimizer", "enable_mixed_precision_graph_rewrite",
                     "Graph-rewrite mixed precision"):
        assert fragment in message, message
    assert "tf.cond" not in message, message


@pytest.mark.parametrize("loss_scale", ["dynamic", 128])
def test_tf_wrapper_around_our_optimizer_is_refused(tf_graph_rewrite, loss_scale):
    """enable_mixed_precision_graph_rewrite(LossScaleOptimizer(...)): TF's
    wrapper would scale the loss again and apply inside its cond. The wrap
    itself is refused (TF asks its wrapper registry, where ours refuses),
    with the fix, before any op; before, the error spoke of tf.cond
    branches (dynamic) or the loss was silently scaled twice (fixed)."""
    w, loss = _linear_model()
    ours = nl.LossScaleOptimizer(_adam(), nl.DynamicLossScaleManager(), backend="is_finite")
    before = len(tf.get_default_graph().get_operations())
    with pytest.raises(TypeError) as excinfo:
        tf_graph_rewrite(ours, loss_scale=loss_scale)
    _raises_naming_the_fix(excinfo)
    assert len(tf.get_default_graph().get_operations()) == before
    # A plain optimizer is still wrapped by TF's own wrapper.
    assert type(tf_graph_rewrite(_adam(), loss_scale=loss_scale)).__name__ == (
        "MixedPrecisionLossScaleOptimizer")


def test_tf_wrapper_as_our_optimizer_is_refused(tf_graph_rewrite):
    """TF's wrapper passed to the builder or to LossScaleOptimizer."""
    w, loss = _linear_model()
    wrapped = tf_graph_rewrite(_adam())
    with pytest.raises(TypeError) as excinfo:
        nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager()).add(loss, wrapped,
                                                                      var_list=[w])
    _raises_naming_the_fix(excinfo)
    with pytest.raises(TypeError) as excinfo:
        nl.LossScaleOptimizer(wrapped, nl.DynamicLossScaleManager())
    _raises_naming_the_fix(excinfo)


def test_the_rewrite_flag_with_the_plain_optimizer_works(tf_graph_rewrite):
    """The fix: the optimizer given to enable_mixed_precision_graph_rewrite,
    in our builder (the flag that call set only turns on the GPU rewrite in
    new sessions' configs; on CPU the config adds auto_mixed_precision_cpu):
    the float32 twin's step."""
    tf_graph_rewrite(_adam())
    w, loss = _linear_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(initial_scale=2.0 ** 18),
                                        backend="is_finite")
    scaler.add(loss, _adam(), var_list=[w])
    train = scaler.build()
    with tf.Session(config=_rewrite_config()) as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run({"update": train.update_op, "finite": train.is_finite})["finite"]
        ours = sess.run(w)
    _, twin = _train(_plain_step(_adam), None, model=_linear_model)
    np.testing.assert_array_equal(ours, twin)


def test_npu_wrapper_around_our_optimizer_is_refused(graph, npu_shim):
    """NPULossScaleOptimizer(LossScaleOptimizer(...)): two loss scales."""
    from npu_bridge.npu_init import FixedLossScaleManager, NPULossScaleOptimizer
    w, loss = _linear_model()
    ours = nl.LossScaleOptimizer(_adam(), nl.DynamicLossScaleManager(), backend="is_finite")
    with pytest.raises(ValueError, match=r"inside a tf.cond.*If another loss-scale wrapper "
                                         r"\(NPULossScaleOptimizer"):
        NPULossScaleOptimizer(ours, FixedLossScaleManager(8)).minimize(loss, var_list=[w])


# -- Ascend: precision_mode="allow_mix_precision", emulated by the shim -----

def _npu_config(precision_mode=None):
    """The session config an Ascend script writes: npu_config_proto() and,
    if given, GE's precision_mode on the NpuOptimizer custom optimizer; the
    shim takes the mode from it (apply_session_config)."""
    from npu_bridge import _emulation
    from npu_bridge.npu_init import npu_config_proto
    config = npu_config_proto()
    if precision_mode is not None:
        custom = [c for c in config.graph_options.rewrite_options.custom_optimizers
                  if c.name == "NpuOptimizer"][0]
        custom.parameter_map["precision_mode"].s = tf.compat.as_bytes(precision_mode)
    _emulation.apply_session_config(config)
    return config


def _npu_train(make_step, precision_mode, runs=1, model=_tanh_model):
    """``_train`` under the config of ``_npu_config(precision_mode)``, which
    also sets the shim's precision mode for the ops built after it."""
    return _train(make_step, _npu_config(precision_mode), runs, model)


def _npu_builder_step(manager, optimizer):
    """``_builder_step`` with the backend an Ascend script gets by default."""
    return _builder_step(manager, optimizer, backend="auto")


@pytest.fixture(params=["inf_nan", "saturation"])
def overflow_mode(request, npu_shim):
    """Each of the device's overflow modes, set the real way."""
    from npu_bridge.estimator.npu import npu_plugin
    npu_plugin.set_device_sat_mode(1 if request.param == "inf_nan" else 0)
    return request.param


def test_the_config_sets_the_shims_precision_mode(npu_shim, monkeypatch):
    from npu_bridge import _emulation
    assert _emulation.get_precision_mode() == "must_keep_origin_dtype"
    _npu_config("allow_mix_precision")
    assert _emulation.get_precision_mode() == "allow_mix_precision"
    _npu_config()  # no precision_mode entry: GE keeps the graph's dtypes
    assert _emulation.get_precision_mode() == "must_keep_origin_dtype"
    with pytest.raises(ValueError, match="force_fp16"):
        _npu_config("force_fp16")  # a real mode the shim does not emulate
    monkeypatch.setenv("NPU_SHIM_PRECISION_MODE", "allow_mix_precision")
    _emulation.reset()
    assert _emulation.get_precision_mode() == "allow_mix_precision"


def test_matmul_results_are_float16(graph, overflow_mode):
    """A float32 MatMul's result is rounded to float16 (1 + 2**-12 -> 1);
    other ops keep float32. Overflow: 70000 saturates to 65504 and sets the
    register in saturation mode, is inf in INF/NaN mode (register clear)."""
    from npu_bridge import _emulation
    _npu_config("allow_mix_precision")
    one = tf.matmul(tf.constant([[1.0 + 2.0 ** -12]]), tf.constant([[1.0]]))
    big = tf.matmul(tf.constant([[70000.0]]), tf.constant([[1.0]]))
    added = tf.constant(1.0 + 2.0 ** -12) + tf.constant(0.0)
    assert one.dtype == tf.float32
    register = _emulation.register_tensor()
    with tf.Session() as sess:
        values = sess.run([one, added, big])
        status = sess.run(register)
    assert values[0] == 1.0 and values[1] == np.float32(1.0 + 2.0 ** -12)
    if overflow_mode == "saturation":
        assert values[2] == 65504.0 and status[0] == 1
    else:
        assert np.isinf(values[2]) and status[0] == 0


def test_npu_forward_overflow_is_caught(overflow_mode):
    """GE's float16 forward overflow in a float32-written graph: skipped,
    weights kept, the scale halving, in both modes (the register in
    saturation mode, is_finite on the inf in INF/NaN mode)."""
    results, w = _npu_train(
        _npu_builder_step(lambda: nl.DynamicLossScaleManager(initial_scale=2.0 ** 4), _adam),
        "allow_mix_precision", runs=2, model=_forward_overflow_model)
    assert [(bool(r["finite"]), float(r["scale"])) for r in results] == [
        (False, 16.0), (False, 8.0)]
    np.testing.assert_array_equal(w, np.full([4, 2], 64.0, np.float32))
    results, _ = _npu_train(
        _npu_builder_step(lambda: nl.DynamicLossScaleManager(initial_scale=2.0 ** 4), _adam),
        None, model=_forward_overflow_model)
    assert bool(results[0]["finite"])  # float32 kept: no overflow


def test_npu_backward_overflow_backs_off_then_matches_the_twin(overflow_mode):
    """The linear model at 2**20: the float16 gradient matmul overflows
    (saturated and flagged, or inf); at 2**19 it applies, equal to a float32
    Adam twin bit for bit."""
    results, ours = _npu_train(
        _npu_builder_step(lambda: nl.DynamicLossScaleManager(initial_scale=2.0 ** 20), _adam),
        "allow_mix_precision", runs=2, model=_linear_model)
    assert [(bool(r["finite"]), float(r["scale"])) for r in results] == [
        (False, 2.0 ** 20), (True, 2.0 ** 19)]
    _, twin = _train(_plain_step(_adam), None, model=_linear_model)
    np.testing.assert_array_equal(ours, twin)


def test_npu_underflow_is_rescued_by_the_scale(overflow_mode):
    """allow_mix_precision rounds the 2**-33 gradients to 0 at scale 1; at
    2**20 they match the float32 twin to float16's precision."""
    twin = _W - _train(_plain_step(_sgd(_UNDERFLOW_LR)), None)[1]
    _, at_one = _npu_train(_npu_builder_step(lambda: nl.FixedLossScaleManager(1),
                                             _sgd(_UNDERFLOW_LR)), "allow_mix_precision")
    np.testing.assert_array_equal(at_one, _W)
    results, scaled = _npu_train(
        _npu_builder_step(lambda: nl.DynamicLossScaleManager(initial_scale=_RESCUE_SCALE),
                          _sgd(_UNDERFLOW_LR)), "allow_mix_precision")
    assert bool(results[0]["finite"])
    np.testing.assert_allclose(_W - scaled, twin, rtol=2e-3)


# -- the underflow measurement and the listening manager under a rewrite ----

def _measured_build(manager, measure_underflow, model=_tanh_model, backend="is_finite"):
    """The ValueError that ``build`` raises for ``model``, and whether it
    made an op first."""
    with tf.Graph().as_default() as graph:
        w, loss = model()
        scaler = nl.MultiOptimizerLossScale(manager(), backend=backend)
        scaler.add(loss, _sgd(1.0)(), var_list=[w], name="w")
        ops = len(graph.get_operations())
        with pytest.raises(ValueError) as raised:
            scaler.build(measure_underflow=measure_underflow)
        return str(raised.value), len(graph.get_operations()) > ops


_ASKED = [
    (lambda: nl.FixedLossScaleManager(1), True,
     ["measure_underflow=True", "Build with measure_underflow=False."]),
    (lambda: nl.ListeningLossScaleManager(initial_scale=1), False,
     ["ListeningLossScaleManager", "Use a DynamicLossScaleManager instead."]),
]


@pytest.mark.parametrize("manager, measure_underflow, fragments", _ASKED,
                         ids=["measure_underflow", "listening"])
def test_a_float32_graph_for_the_rewrite_is_refused_at_build(manager, measure_underflow,
                                                              fragments):
    """The float32 graph that the rewrite turns to float16 at run time: the
    measurement's float32 view is rewritten as well (it reported 0 % flushed
    while every gradient was 0, and a listening manager stayed at scale 1),
    and grappler's auto_mixed_precision pass fails on the view's backprop
    (std::out_of_range, which killed the process with SIGSEGV on fetching
    headroom). Refused before any op, naming what asked and the fix."""
    message, made = _measured_build(manager, measure_underflow)
    assert not made
    for fragment in ["group 'w' computes nothing in float16", "graph rewrite"] + fragments:
        assert fragment in message, message


def _hand_cast_model():
    """``_tanh_model`` with its matrix op written in float16 by hand."""
    w = tf.Variable(_W, name="w")
    product = tf.matmul(tf.constant(_X, tf.float16), tf.cast(w, tf.float16))
    return w, tf.reduce_mean(tf.tanh(tf.cast(product, tf.float32))) * _TINY


@pytest.mark.parametrize("model", [_tanh_model, _hand_cast_model], ids=["float32", "hand_cast"])
@pytest.mark.parametrize("manager, measure_underflow, fragments", _ASKED,
                         ids=["measure_underflow", "listening"])
def test_the_shims_precision_mode_is_refused_at_build(overflow_mode, model, manager,
                                                      measure_underflow, fragments):
    """allow_mix_precision, which the shim applies as the ops are built:
    the float32 view's own matrix ops would be rounded to float16 too (it
    reported 0 % flushed while every gradient was 0). Refused before any op;
    without the mode, the hand-cast model is measured."""
    _npu_config("allow_mix_precision")
    message, made = _measured_build(manager, measure_underflow, model, backend="auto")
    assert not made
    for fragment in ["a float32 MatMul is built as a 'Cast'", "precision mode"] + fragments:
        assert fragment in message, message
    _npu_config()
    with tf.Graph().as_default():
        w, loss = _hand_cast_model()
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1), backend="auto")
        scaler.add(loss, _sgd(1.0)(), var_list=[w], name="w")
        train = scaler.build(measure_underflow=True)
        with tf.Session(config=_npu_config()) as sess:
            sess.run(tf.global_variables_initializer())
            measured = sess.run(train.underflow["w"])
    # Every gradient element is below float16's range at scale 1.
    assert measured.flushed_share == 1.0 and measured.elements == _W.size


def test_the_readme_recipe_runs_with_the_rewrite_on_cpu(graph):
    """The graph-rewrite block of docs/features.md, executed as written but
    for the config field: auto_mixed_precision (GPU) becomes
    auto_mixed_precision_cpu on this CPU. It trains through the rewrite: not
    every step skips."""
    source = block("recipe: graph-rewrite")
    assert source, "the docs lost their graph-rewrite recipe block"
    gpu_line = "rewrite_options.auto_mixed_precision = RewriterConfig.ON"
    assert source.count(gpu_line) == 1
    source = source.replace(gpu_line, gpu_line.replace("precision =", "precision_cpu ="))
    namespace = {"__name__": "recipe"}
    exec(compile(source, "docs graph-rewrite recipe", "exec"), namespace)  # pylint: disable=exec-used
    assert namespace["config"].graph_options.rewrite_options.auto_mixed_precision_cpu == (
        rewriter_config_pb2.RewriterConfig.ON)
    assert namespace["skipped"] < 20 and namespace["result"]["scale"] > 0
