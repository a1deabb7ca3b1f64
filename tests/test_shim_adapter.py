"""The shim's user-facing npu_bridge surface, checked against tf_adapter.

Every behaviour tested here comes from Huawei's tf_adapter source
(hicann/tensorflow master, and Ascend/tensorflow for the older optimizer);
each test names the file.  Paths are relative to
tf_adapter/python/npu_bridge/ unless they start with tf_adapter/ or docs/.

Each test puts shims/ on sys.path (fixture ``npu``) and removes it, the
npu_bridge modules and the shim's op callback afterwards.
"""
import inspect
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import seed003
import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS = os.path.join(os.path.dirname(HERE), "shims")
DCGAN = os.path.join(HERE, "data", "modelzoo_dcgan.py")
F16_MAX = 65504.0
_ENV = ("NPU_SHIM_OVERFLOW_MODE", "INF_NAN_MODE_ENABLE", "NPU_SHIM_OP_SET", "RANK_SIZE",
        "CM_WORKER_SIZE", "RANK_ID", "JOB_ID", "NPU_SHIM_HCCL_DIR")


def _unload():
    emu = sys.modules.get("npu_bridge._emulation")
    if emu is not None:
        emu.uninstall()
    for name in list(sys.modules):
        if name == "npu_bridge" or name.startswith("npu_bridge."):
            del sys.modules[name]


@pytest.fixture
def npu(monkeypatch):
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    _unload()
    sys.path.insert(0, SHIMS)
    try:
        from npu_bridge import _emulation
        from npu_bridge import npu_init
        from npu_bridge.estimator.npu import npu_hook, npu_loss_scale_optimizer, npu_optimizer
        from npu_bridge.estimator.npu import npu_loss_scale_manager, npu_plugin, util
        from npu_bridge.hccl import hccl_ops
        _emulation.reset()
        yield types.SimpleNamespace(
            emu=_emulation, init=npu_init, plugin=npu_plugin, util=util, hccl=hccl_ops,
            lsm=npu_loss_scale_manager, lso=npu_loss_scale_optimizer, opt=npu_optimizer,
            hook=npu_hook)
    finally:
        _unload()
        while SHIMS in sys.path:
            sys.path.remove(SHIMS)


def _state(manager):
    return [tf.convert_to_tensor(manager.get_loss_scale()),
            tf.convert_to_tensor(manager._num_good_steps),
            tf.convert_to_tensor(manager._num_bad_steps)]


def _ancestors(op):
    """Every op ``op`` depends on (data and control inputs)."""
    seen, stack = set(), [op]
    while stack:
        cur = stack.pop()
        for dep in [t.op for t in cur.inputs] + list(cur.control_inputs):
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return seen


def _one_weight_model(dtype_scale=1000.0):
    """loss = x * w * 1000 in float16: x = 100 overflows float16."""
    x = tf.placeholder(tf.float16, [])
    w = tf.Variable(1.0)
    loss = tf.cast(x * tf.cast(w, tf.float16) * dtype_scale, tf.float32)
    return x, w, loss


# ------------------------------------------------------------ npu_plugin
def test_overflow_mode_follows_set_device_sat_mode_default_inf_nan(npu, monkeypatch):
    # estimator/npu/npu_plugin.py: is_inf_nan_enabled() is
    # GetDeviceSatMode() == 1 (tf_adapter/util/ge_plugin.cc,
    # aclrtGetDeviceSatMode); docs/en/tfadapter_1/apiref/npu_plugin/
    # set_device_sat_mode.md: 0 saturation, 1 INF/NaN, default 1 on Atlas A2/A3.
    plugin, emu = npu.plugin, npu.emu
    assert plugin.is_inf_nan_enabled() is True
    monkeypatch.setenv("INF_NAN_MODE_ENABLE", "0")      # torch_npu's, never read
    emu.reset()
    assert plugin.is_inf_nan_enabled() is True
    assert plugin.set_device_sat_mode(0) is None
    assert plugin.is_inf_nan_enabled() is False
    plugin.set_device_sat_mode(7)                        # runtime error: logged only
    assert plugin.is_inf_nan_enabled() is False
    with pytest.raises(TypeError):                       # tf_adapter/swig/ge_plugin.i: uint32_t
        plugin.set_device_sat_mode("1")
    plugin.set_device_sat_mode(1)
    assert plugin.is_inf_nan_enabled() is True
    monkeypatch.setenv("NPU_SHIM_OVERFLOW_MODE", "saturation")   # shim-only, for tests
    emu.reset()
    assert plugin.is_inf_nan_enabled() is False
    assert npu.init.npu_plugin is plugin


@pytest.mark.parametrize("op_set", ["v1", "v2"])
def test_inf_nan_mode_register_read_misses_overflow_is_finite_sees_it(npu, op_set):
    # estimator/npu/npu_loss_scale_optimizer.py: in INF/NaN mode tf_adapter
    # never reads the status register (contrib's is_finite path).  The shim
    # makes a register read there useless: it reports no overflow, so a
    # library that relies on it skips nothing.
    gen = sys.modules["npu_bridge._gen_npu_ops"]
    with npu.emu.op_set(op_set), tf.Graph().as_default():
        x, w, loss = _one_weight_model()
        grad = tf.gradients(loss, [w])[0]
        with tf.control_dependencies([grad, loss]):
            if op_set == "v2":
                status = gen.npu_get_float_status_v2()
            else:
                status = gen.npu_get_float_status(gen.npu_alloc_float_status())
        register_says_finite = tf.reduce_all(tf.equal(status, 0))
        is_finite = tf.reduce_all(tf.is_finite(grad))
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            lv, finite_reg, finite_isf = sess.run([loss, register_says_finite, is_finite],
                                                  {x: 100.0})
    assert np.isinf(lv)                 # IEEE inf, not saturated
    assert finite_reg                   # the register read misses it
    assert not finite_isf               # is_finite catches it


# -------------------------------------------------------------- managers
def test_manager_signatures_and_defaults(npu):
    # estimator/npu/npu_loss_scale_manager.py
    lsm = npu.lsm
    sig = inspect.signature(lsm.ExponentialUpdateLossScaleManager.__init__)
    assert list(sig.parameters) == ["self", "init_loss_scale", "incr_every_n_steps",
                                    "decr_every_n_nan_or_inf", "incr_ratio", "decr_ratio"]
    assert [sig.parameters[p].default for p in list(sig.parameters)[3:]] == [2, 2, 0.8]
    sig = inspect.signature(lsm.FixedLossScaleManager.__init__)
    assert list(sig.parameters) == ["self", "loss_scale", "enable_overflow_check"]
    assert sig.parameters["enable_overflow_check"].default is True
    assert npu.init.ExponentialUpdateLossScaleManager is lsm.ExponentialUpdateLossScaleManager
    assert npu.init.FixedLossScaleManager is lsm.FixedLossScaleManager


def test_exponential_manager_variables_and_no_is_finite(npu):
    # estimator/npu/npu_loss_scale_manager.py (+ contrib loss_scale_manager.py
    # for the variables): loss_scale f32, good_steps/bad_steps i32, not
    # trainable; the growth test is less(), there is no IsFinite op.
    with tf.Graph().as_default() as g:
        m = npu.lsm.ExponentialUpdateLossScaleManager(init_loss_scale=2 ** 32,
                                                      incr_every_n_steps=1000)
        assert sorted(v.op.name for v in tf.global_variables()) == \
            ["bad_steps", "good_steps", "loss_scale"]
        assert tf.trainable_variables() == []
        dtypes = {v.op.name: v.dtype.base_dtype for v in tf.global_variables()}
        assert dtypes == {"loss_scale": tf.float32, "good_steps": tf.int32,
                          "bad_steps": tf.int32}
        assert m.get_loss_scale() in tf.global_variables()   # the variable itself
        g.get_tensor_by_name("loss_scale:0")
        before = set(op.name for op in g.get_operations())
        m.update_loss_scale(tf.placeholder(tf.bool, []))
        gd = g.as_graph_def()
        types_ = [n.op for n in gd.node if n.name not in before]
        types_ += [n.op for f in gd.library.function for n in f.node_def]
        assert "IsFinite" not in types_ and "Less" in types_
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            assert sess.run(tf.convert_to_tensor(m.get_loss_scale())) == 2.0 ** 32


def _reference_rule(scale, good, bad, finite, incr_n, decr_n, incr_ratio, decr_ratio):
    """npu_loss_scale_manager.py's update rule in float32 numpy."""
    f32 = np.float32
    if finite:
        if good + 1 >= incr_n:
            if f32(scale) < f32(3.4e38 / incr_ratio):
                scale = f32(f32(scale) * f32(incr_ratio))
            return scale, 0, 0
        return scale, good + 1, bad
    if bad + 1 >= decr_n:
        return max(f32(1.0), f32(f32(scale) * f32(decr_ratio))), 0, 0
    return scale, 0, bad + 1


@pytest.mark.parametrize("init,incr_n,decr_n,incr_ratio,decr_ratio", [
    (2.0 ** 32, 2, 2, 2, 0.5),
    (1.0e38, 1, 1, 2, 0.8),      # 1e38 < 1.7e38: grows once to 2e38, then stays
    (3.0, 3, 2, 3, 0.3),         # floor 1.0
])
def test_exponential_manager_matches_reference_rule(npu, init, incr_n, decr_n, incr_ratio,
                                                    decr_ratio):
    # estimator/npu/npu_loss_scale_manager.py: ceiling less(scale, 3.4e38 /
    # incr_ratio), floor maximum(1., scale * decr_ratio), counters as contrib.
    rng = np.random.RandomState(0)
    pattern = [True, True, True, False, True, False, False, False, True, True] + \
        list(rng.rand(30) > 0.3)
    with tf.Graph().as_default():
        m = npu.lsm.ExponentialUpdateLossScaleManager(init, incr_n, decr_n, incr_ratio,
                                                      decr_ratio)
        finite = tf.placeholder(tf.bool, [])
        update = m.update_loss_scale(finite)
        state = _state(m)
        want = (np.float32(init), 0, 0)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for f in pattern:
                sess.run(update, {finite: bool(f)})
                want = _reference_rule(*want, bool(f), incr_n, decr_n, incr_ratio, decr_ratio)
                got = sess.run(state)
                assert (np.float32(got[0]), got[1], got[2]) == \
                    (np.float32(want[0]), want[1], want[2])
                assert got[0] >= 1.0 and np.isfinite(got[0])


def test_fixed_manager(npu):
    # estimator/npu/npu_loss_scale_manager.py: a 'loss_scale' constant, then
    # contrib's unnamed one; enable_overflow_check; update is a no_op.
    with tf.Graph().as_default() as g:
        m = npu.lsm.FixedLossScaleManager(2 ** 10, enable_overflow_check=False)
        assert m.get_enable_overflow_check() is False
        assert g.get_tensor_by_name("loss_scale:0").dtype == tf.float32
        assert m.get_loss_scale().dtype == tf.float32
        assert m.update_loss_scale(tf.constant(False)).type == "NoOp"
        with pytest.raises(ValueError, match="at least 1"):
            npu.lsm.FixedLossScaleManager(0.5)
        with tf.Session() as sess:
            assert sess.run(m.get_loss_scale()) == 1024.0


# --------------------------------------------------- NPULossScaleOptimizer
def _lso_train(npu, manager, is_distributed=False, lr=0.001):
    x, w, loss = _one_weight_model()
    opt = npu.lso.NPULossScaleOptimizer(tf.train.GradientDescentOptimizer(lr), manager,
                                        is_distributed=is_distributed)
    return x, w, opt, opt.minimize(loss, var_list=[w])


def _run_steps(x, w, train, scale, feeds):
    out = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for xv in feeds:
            sess.run(train, {x: xv})
            out.append((float(sess.run(w)), float(sess.run(scale))))
    return out


def test_lso_signature_and_getattr(npu):
    # estimator/npu/npu_loss_scale_optimizer.py: (opt, loss_scale_manager,
    # is_distributed=False); subclass of contrib's LossScaleOptimizer;
    # __getattr__ forwards to the wrapped optimizer.
    sig = inspect.signature(npu.lso.NPULossScaleOptimizer.__init__)
    assert list(sig.parameters) == ["self", "opt", "loss_scale_manager", "is_distributed"]
    assert sig.parameters["is_distributed"].default is False
    assert npu.init.NPULossScaleOptimizer is npu.lso.NPULossScaleOptimizer
    with tf.Graph().as_default():
        inner = tf.train.MomentumOptimizer(0.1, 0.9, name="Inner")
        opt = npu.lso.NPULossScaleOptimizer(inner, npu.lsm.FixedLossScaleManager(1))
        assert isinstance(opt, tf.train.Optimizer)
        assert opt.get_name() == "NPULossScaleOptimizermodule"
        assert opt._momentum == 0.9 and opt._use_nesterov is False   # from the inner one


@pytest.mark.parametrize("distributed", [False, True])
def test_lso_saturation_v2_path_ops_order_and_names(npu, distributed):
    # estimator/npu/npu_loss_scale_optimizer.py (hicann): in the name scope
    # "NPULossScaleOptimizer" + type(<module optimizer>).__name__: get_v2
    # after the grads, clear_v2 after the get; equal + reduce_all
    # "overflow_status_reduce_all" after the clear; is_distributed:
    # allreduce([status], "sum", fusion=0).
    npu.plugin.set_device_sat_mode(0)
    with tf.Graph().as_default() as g:
        x, w, opt, train = _lso_train(npu, npu.lsm.ExponentialUpdateLossScaleManager(
            4.0, 1000, decr_every_n_nan_or_inf=1, decr_ratio=0.5), distributed)
        emu = npu.emu
        (read,) = emu.find_ops(g, "NpuGetFloatStatusV2")
        (clear,) = emu.find_ops(g, "NpuClearFloatStatusV2")
        assert read.name == "NPULossScaleOptimizermodule/NpuGetFloatStatusV2"
        assert clear.name == "NPULossScaleOptimizermodule/NpuClearFloatStatusV2"
        assert read in clear.control_inputs
        grad_ops = set(c.name for c in read.control_inputs)
        assert grad_ops and all("gradients" in n or "mul" in n for n in grad_ops)
        reduce_all = g.get_operation_by_name("overflow_status_reduce_all")
        equal = reduce_all.inputs[0].op
        assert equal.type == "Equal"
        allreduces = emu.find_ops(g, "HcomAllReduce")
        if distributed:
            (ar,) = allreduces
            assert ar.get_attr("_npu_shim_fusion") == 0
            assert ar.get_attr("_npu_shim_reduction") == b"sum"
            assert ar.outputs[0].shape.as_list() == [1, 8]
            assert ar.outputs[0] in list(equal.inputs) and read in _ancestors(ar)
        else:
            assert allreduces == []
            assert read.outputs[0] in list(equal.inputs)
        assert clear in _ancestors(equal)       # the decision waits for the clear
        assert emu.count_status_reads(g) == 1 and emu.count_ops(g, "NpuAllocFloatStatus") == 0
        steps = _run_steps(x, w, train, opt._loss_scale_manager.get_loss_scale(),
                           [1.0, 100.0, 1.0])
    # step 1 applied (w: 1 - 0.001 * 1000); step 2 overflows: skipped, scale halves
    assert steps == [(0.0, 4.0), (0.0, 2.0), (-1.0, 2.0)]


def test_lso_second_optimizer_scope_is_uniquified(npu):
    # estimator/npu/npu_loss_scale_optimizer.py: both optimizers use the same
    # scope name; TF uniquifies the second.
    npu.plugin.set_device_sat_mode(0)
    with tf.Graph().as_default() as g:
        _lso_train(npu, npu.lsm.FixedLossScaleManager(1))
        _lso_train(npu, npu.lsm.FixedLossScaleManager(1))
        assert [op.name for op in npu.emu.find_ops(g, "NpuGetFloatStatusV2")] == [
            "NPULossScaleOptimizermodule/NpuGetFloatStatusV2",
            "NPULossScaleOptimizermodule_1/NpuGetFloatStatusV2"]


@pytest.mark.parametrize("distributed", [False, True])
def test_lso_saturation_v1_path_alloc_get_clear(npu, distributed):
    # estimator/npu/npu_loss_scale_optimizer.py of Ascend/tensorflow@82507eb
    # (adapters without the V2 ops): NpuAllocFloatStatus in compute_gradients,
    # get/clear on it after the grads, finite = all(buffer == cleared);
    # distributed: allreduce([buffer], "sum", fusion=0).
    npu.plugin.set_device_sat_mode(0)
    with npu.emu.op_set("v1"), tf.Graph().as_default() as g:
        x, w, opt, train = _lso_train(npu, npu.lsm.ExponentialUpdateLossScaleManager(
            4.0, 1000, decr_every_n_nan_or_inf=1, decr_ratio=0.5), distributed)
        emu = npu.emu
        (alloc,) = emu.find_ops(g, "NpuAllocFloatStatus")
        assert alloc.name == "NPULossScaleOptimizermodule/NpuAllocFloatStatus"
        assert emu.count_ops(g, "NpuGetFloatStatus") == 1
        assert emu.count_ops(g, "NpuClearFloatStatus") == 1
        assert emu.count_ops(g, "NpuGetFloatStatusV2") == 0
        assert len(emu.find_ops(g, "HcomAllReduce")) == (1 if distributed else 0)
        steps = _run_steps(x, w, train, opt._loss_scale_manager.get_loss_scale(),
                           [1.0, 100.0, 1.0])
    assert steps == [(0.0, 4.0), (0.0, 2.0), (-1.0, 2.0)]


@pytest.mark.parametrize("op_set", ["v1", "v2"])
def test_lso_inf_nan_path_uses_is_finite_and_no_register(npu, op_set):
    # estimator/npu/npu_loss_scale_optimizer.py: if is_inf_nan_enabled():
    # return super().apply_gradients(...) (contrib: is_finite of each grad).
    assert npu.plugin.is_inf_nan_enabled()
    with npu.emu.op_set(op_set), tf.Graph().as_default() as g:
        x, w, opt, train = _lso_train(npu, npu.lsm.ExponentialUpdateLossScaleManager(
            4.0, 1000, decr_every_n_nan_or_inf=1, decr_ratio=0.5), is_distributed=True)
        assert npu.emu.count_status_reads(g) == 0 and npu.emu.count_status_clears(g) == 0
        assert npu.emu.find_ops(g, "HcomAllReduce") == []
        assert any(op.type == "IsFinite" for op in g.get_operations())
        steps = _run_steps(x, w, train, opt._loss_scale_manager.get_loss_scale(),
                           [1.0, 100.0, 1.0])
    assert steps == [(0.0, 4.0), (0.0, 2.0), (-1.0, 2.0)]


def test_lso_overflow_check_disabled_by_fixed_manager(npu):
    # estimator/npu/npu_loss_scale_optimizer.py _enable_overflow_check():
    # FixedLossScaleManager(enable_overflow_check=False) -> no status read,
    # finite = constant True: the saturated step is applied.
    npu.plugin.set_device_sat_mode(0)
    with tf.Graph().as_default() as g:
        x, w, opt, train = _lso_train(npu, npu.lsm.FixedLossScaleManager(
            1, enable_overflow_check=False), lr=1e-6)
        assert npu.emu.count_status_reads(g) == 0
        steps = _run_steps(x, w, train, opt._loss_scale_manager.get_loss_scale(), [100.0])
    assert steps[0][0] != 1.0     # applied despite the overflow


# ------------------------------------------------------------ seed 003
def _gan(npu, sequenced):
    """Seed 003's model (tests/seed003.py) with one npu_bridge
    NPULossScaleOptimizer per network."""
    model = seed003.model()
    lsm, lso = npu.lsm, npu.lso
    d_opt = lso.NPULossScaleOptimizer(tf.train.GradientDescentOptimizer(0.1),
                                      lsm.FixedLossScaleManager(1))
    g_opt = lso.NPULossScaleOptimizer(tf.train.GradientDescentOptimizer(0.1),
                                      lsm.FixedLossScaleManager(1))
    d_train = d_opt.minimize(model.d_loss, var_list=[model.wd])
    if sequenced:   # G's step after D's, in the same run
        with tf.control_dependencies([d_train]):
            g_train = g_opt.minimize(model.g_loss, var_list=[model.wg])
    else:
        g_train = g_opt.minimize(model.g_loss, var_list=[model.wg])
    return types.SimpleNamespace(wg=model.wg, wd=model.wd, d_train=d_train, g_train=g_train,
                                 feed=model.feed, inject=model.inject)


_applied = seed003.applied


def test_seed003_two_lso_in_one_run_wrong_decision_alternating_right(npu):
    # Seed 003 (tf_adapter docs/en/tfadapter_1/migration/faq/
    # multi_optimizer_fp_exception_detection.md): NPULossScaleOptimizer
    # (estimator/npu/npu_loss_scale_optimizer.py) reads and clears the one
    # device register per optimizer.  Saturation mode, injected overflow in
    # the forward pass both losses share: the right decision is "skip both".
    npu.plugin.set_device_sat_mode(0)
    # One session.run, G's step sequenced after D's: D's read sees the
    # overflow and clears the register; G's read then sees a clean register,
    # so G applies a step computed from saturated values.
    with tf.Graph().as_default():
        model = _gan(npu, sequenced=True)
        with tf.Session() as sess:
            assert _applied(sess, model, [[model.d_train, model.g_train]]) == (False, True)
            model.feed[model.inject] = 1.0                 # no overflow: both apply
            assert _applied(sess, model, [[model.d_train, model.g_train]]) == (True, True)
    with tf.Graph().as_default():
        model = _gan(npu, sequenced=False)
        with tf.Session() as sess:
            # The pattern the FAQ recommends: one session.run per optimizer.
            assert _applied(sess, model, [[model.d_train], [model.g_train]]) == (False, False)
            # One session.run, no order between the two: the reads and clears
            # race.  The first read always sees the overflow, so never both
            # apply; whether the second sees it is up to the scheduler.
            outcomes = set(_applied(sess, model, [[model.d_train, model.g_train]])
                           for _ in range(5))
            assert (True, True) not in outcomes
            model.feed[model.inject] = 1.0
            assert _applied(sess, model, [[model.d_train], [model.g_train]]) == (True, True)


def test_seed003_in_inf_nan_mode_one_run_is_right(npu):
    # estimator/npu/npu_loss_scale_optimizer.py: in INF/NaN mode each
    # optimizer checks its own gradients with is_finite, so one run decides
    # as alternating runs do.  (Here D's gradient is inf and D skips; G's
    # gradient does not depend on the overflowed value, stays finite and
    # exact, and G applies.)
    assert npu.plugin.is_inf_nan_enabled()
    for sequenced in (False, True):
        with tf.Graph().as_default():
            model = _gan(npu, sequenced)
            with tf.Session() as sess:
                one_run = _applied(sess, model, [[model.d_train, model.g_train]])
                alternating = _applied(sess, model, [[model.d_train], [model.g_train]])
        assert one_run == alternating == (False, True)


# ----------------------------------------------------------- npu_optimizer
def test_npu_optimizer_signature_and_loss_scale(npu, monkeypatch):
    # estimator/npu/npu_optimizer.py NPUOptimizer: ValueError without a
    # manager when is_loss_scale; one get_v2/clear_v2 pair after the grads;
    # never asks is_inf_nan_enabled().
    sig = inspect.signature(npu.opt.NPUOptimizer.__init__)
    assert list(sig.parameters) == ["self", "opt", "loss_scale_manager", "is_distributed",
                                    "is_loss_scale", "is_tailing_optimization", "name"]
    assert [sig.parameters[p].default for p in list(sig.parameters)[2:]] == \
        [None, False, False, False, None]
    npu.plugin.set_device_sat_mode(0)
    with tf.Graph().as_default() as g:
        with pytest.raises(ValueError, match="loss_scale_manager can not be None"):
            npu.opt.NPUOptimizer(tf.train.GradientDescentOptimizer(0.1), is_loss_scale=True)
        x, w, loss = _one_weight_model()
        manager = npu.lsm.ExponentialUpdateLossScaleManager(4.0, 1000, 1, 2, 0.5)
        opt = npu.opt.NPUOptimizer(tf.train.GradientDescentOptimizer(0.001), manager,
                                   is_loss_scale=True)
        assert opt.get_name() == "NPUOptimizerGradientDescentOptimizer"
        train = opt.minimize(loss, var_list=[w])
        assert npu.emu.count_ops(g, "NpuGetFloatStatusV2") == 1
        assert npu.emu.count_ops(g, "NpuClearFloatStatusV2") == 1
        steps = _run_steps(x, w, train, manager.get_loss_scale(), [1.0, 100.0, 1.0])
    assert steps == [(0.0, 4.0), (0.0, 2.0), (-1.0, 2.0)]


def test_npu_optimizer_distributed_averages(npu, monkeypatch):
    # estimator/npu/npu_optimizer.py: is_distributed -> every gradient
    # through allreduce(grad, True) = HcomAllReduce "sum" / rank size, in
    # name_scope(name + "_Allreduce"); the size comes from NPUBasics, which
    # needs JOB_ID (estimator/npu/npu_common.py).
    with tf.Graph().as_default() as g:
        x, w, loss = _one_weight_model()
        opt = npu.opt.NPUOptimizer(tf.train.GradientDescentOptimizer(0.1), is_distributed=True)
        with pytest.raises(RuntimeError, match="JOB_ID"):
            opt.compute_gradients(loss, var_list=[w])
        monkeypatch.setenv("JOB_ID", "1")
        gv = opt.compute_gradients(loss, var_list=[w])
        (ar,) = npu.emu.find_ops(g, "HcomAllReduce")
        assert ar.name.startswith("NPUOptimizerGradientDescentOptimizer_Allreduce")
        assert gv[0][0].op.type in ("RealDiv", "Div")
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            assert sess.run(gv[0][0], {x: 1.0}) == pytest.approx(1000.0)


def test_distributed_optimizer_and_wrapper_average_over_ranks(npu, monkeypatch, tmp_path):
    # estimator/npu/npu_optimizer.py: NPUDistributedOptimizer and
    # npu_distributed_optimizer_wrapper average only when
    # int(util.get_ranksize()) > 1; the wrapper patches the instance in place
    # and reads the rank size once, when it is called.
    opt_mod = npu.opt
    with tf.Graph().as_default() as g:
        x, w, loss = _one_weight_model()
        dist = opt_mod.NPUDistributedOptimizer(tf.train.GradientDescentOptimizer(0.1))
        assert dist.get_name() == "DistributedGradientDescentOptimizer"
        dist.compute_gradients(loss, var_list=[w])
        assert npu.emu.find_ops(g, "HcomAllReduce") == []          # one rank
        inner = tf.train.GradientDescentOptimizer(0.1)
        original = inner.compute_gradients
        wrapped = opt_mod.npu_distributed_optimizer_wrapper(inner)
        assert wrapped is inner and inner.compute_gradients is not original
        assert getattr(inner.compute_gradients, opt_mod.WRAPPED_MARK)
        assert npu.init.npu_tf_optimizer(inner).__class__ is opt_mod.NPUDistributedOptimizer

    # Two ranks: this process is rank 0, rank 1's gradient is written by hand.
    monkeypatch.setenv("RANK_SIZE", "2")
    monkeypatch.setenv("RANK_ID", "0")
    monkeypatch.setenv("JOB_ID", "1")
    monkeypatch.setenv("NPU_SHIM_HCCL_DIR", str(tmp_path))
    for name in ("distributed", "wrapper"):
        with tf.Graph().as_default() as g:
            x, w, loss = _one_weight_model()
            if name == "distributed":
                opt = opt_mod.NPUDistributedOptimizer(tf.train.GradientDescentOptimizer(0.1))
                scope = "DistributedGradientDescentOptimizer_Allreduce/"
            else:
                opt = opt_mod.npu_distributed_optimizer_wrapper(
                    tf.train.GradientDescentOptimizer(0.1))
                scope = "Npu_Distributed_optimizer_Allreduce/"
            gv = opt.compute_gradients(loss, var_list=[w])
            (ar,) = npu.emu.find_ops(g, "HcomAllReduce")
            assert ar.name.startswith(scope)
            np.save(str(tmp_path / "hcom0.0.1.npy"), np.array(3000.0, np.float32))
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                assert sess.run(gv[0][0], {x: 1.0}) == pytest.approx((1000.0 + 3000.0) / 2)
            for f in os.listdir(str(tmp_path)):
                os.remove(str(tmp_path / f))


# ------------------------------------------------------- ranks and hccl
def test_get_ranksize(npu, monkeypatch):
    # estimator/npu/util.py get_ranksize(): RANK_SIZE, else CM_WORKER_SIZE,
    # else "1" (a string); ValueError when both are set.
    get = npu.util.get_ranksize
    assert get() == "1"
    monkeypatch.setenv("CM_WORKER_SIZE", "4")
    assert get() == "4"
    monkeypatch.setenv("RANK_SIZE", "2")
    with pytest.raises(ValueError, match="cannot be configured at the same time"):
        get()
    monkeypatch.delenv("CM_WORKER_SIZE")
    assert get() == "2"
    assert npu.init.util is npu.util


def test_collectives_count_ranks_with_cm_worker_size(npu, monkeypatch):
    # HcomAllReduce's group size as tf_adapter counts ranks (estimator/npu/util.py).
    monkeypatch.setenv("CM_WORKER_SIZE", "2")
    with tf.Graph().as_default():
        with pytest.raises(NotImplementedError, match="NPU_SHIM_HCCL_DIR"):
            npu.hccl.allreduce(tf.constant([1.0]), "sum")
        monkeypatch.setenv("RANK_SIZE", "2")
        with pytest.raises(ValueError, match="same time"):
            npu.hccl.allreduce(tf.constant([1.0]), "sum")


def test_hccl_broadcast(npu, monkeypatch, tmp_path):
    # hccl/hccl_ops.py broadcast(tensor, root_rank, fusion=2, fusion_id=0,
    # group="hccl_world_group"); HcomBroadcast takes and returns a list
    # (tf_adapter/ops/hccl/hccl_ops.cc: T: list(type)).
    sig = inspect.signature(npu.hccl.broadcast)
    assert [(p.name, p.default) for p in sig.parameters.values()][1:] == [
        ("root_rank", inspect.Parameter.empty), ("fusion", 2), ("fusion_id", 0),
        ("group", "hccl_world_group")]
    with tf.Graph().as_default():
        a, b = tf.constant([1.0, 2.0]), tf.constant(3, tf.int32)
        out = npu.hccl.broadcast([a, b], 0)
        assert isinstance(out, list) and [t.dtype for t in out] == [tf.float32, tf.int32]
        assert npu.emu.shim_op_type(out[0].op) == "HcomBroadcast"
        assert out[0].op.get_attr("_npu_shim_fusion") == 2
        with pytest.raises(ValueError, match="root_rank"):
            npu.hccl.broadcast([a], 1)
        with tf.Session() as sess:
            av, bv = sess.run(out)
        np.testing.assert_array_equal(av, [1.0, 2.0])
        assert bv == 3
    monkeypatch.setenv("RANK_SIZE", "2")
    monkeypatch.setenv("RANK_ID", "0")
    monkeypatch.setenv("NPU_SHIM_HCCL_DIR", str(tmp_path))
    with tf.Graph().as_default():
        (got,) = npu.hccl.broadcast([tf.constant([1.0, 2.0])], root_rank=1)
        np.save(str(tmp_path / "hcom0.0.1.npy"), np.array([7.0, 8.0], np.float32))
        with tf.Session() as sess:
            np.testing.assert_array_equal(sess.run(got), [7.0, 8.0])


def test_broadcast_hook_single_rank_does_nothing(npu, monkeypatch, tmp_path):
    # estimator/npu/npu_hook.py NPUBroadcastGlobalVariablesHook: only with
    # more than one rank; npu_init.py npu_hooks_append adds it with root 0.
    hooks = npu.init.npu_hooks_append()
    assert len(hooks) == 1 and isinstance(hooks[0], npu.hook.NPUBroadcastGlobalVariablesHook)
    with tf.Graph().as_default() as g:
        tf.Variable(1.0)
        hooks[0].begin()
        assert npu.emu.find_ops(g, "HcomBroadcast") == []
        monkeypatch.setenv("RANK_SIZE", "2")
        monkeypatch.setenv("RANK_ID", "0")
        monkeypatch.setenv("NPU_SHIM_HCCL_DIR", str(tmp_path))
        hook = npu.hook.NPUBroadcastGlobalVariablesHook(0, 0)
        hook.begin()
        assert len(npu.emu.find_ops(g, "HcomBroadcast")) == 1


# ---------------------------------------------------------------- npu_init
def test_npu_config_proto(npu):
    # npu_init.py npu_config_proto: custom optimizer "NpuOptimizer" (once;
    # memory_optimization OFF when added), remapping OFF, soft placement on,
    # device placement logging off, XLA JIT off; a given ConfigProto is edited.
    init = npu.init
    rc = init.RewriterConfig
    config = init.npu_config_proto()
    opts = config.graph_options.rewrite_options
    assert [c.name for c in opts.custom_optimizers] == ["NpuOptimizer"]
    assert opts.memory_optimization == rc.OFF and opts.remapping == rc.OFF
    assert config.allow_soft_placement and not config.log_device_placement
    assert config.graph_options.optimizer_options.global_jit_level == \
        init.config_pb2.OptimizerOptions.OFF
    mine = tf.ConfigProto(inter_op_parallelism_threads=2)
    assert init.npu_config_proto(mine) is mine
    assert init.npu_config_proto(mine) is mine
    assert [c.name for c in mine.graph_options.rewrite_options.custom_optimizers] == \
        ["NpuOptimizer"]
    with tf.Graph().as_default(), tf.Session(config=config) as sess:   # runs on CPU
        assert sess.run(tf.constant(2.0) * 3.0) == 6.0


def test_npu_init_star_import_names(npu):
    # npu_init.py (no __all__): the names ModelZoo scripts use.
    namespace = {}
    exec("from npu_bridge.npu_init import *", namespace)  # noqa: S102
    for name in ("NPULossScaleOptimizer", "ExponentialUpdateLossScaleManager",
                 "FixedLossScaleManager", "NPUOptimizer", "NPUDistributedOptimizer",
                 "npu_distributed_optimizer_wrapper", "npu_tf_optimizer", "npu_config_proto",
                 "npu_graph_options", "npu_optimizer_options", "RewriterConfig", "npu_plugin",
                 "npu_hooks_append", "NPUBroadcastGlobalVariablesHook", "NpuEmptyHook",
                 "hccl_ops", "util", "config_pb2", "tf", "os"):
        assert name in namespace, name
    assert namespace["tf"] is tf   # the TF1 API, as `import tensorflow` is on TF 1.15


# ----------------------------------------------------- ModelZoo script
@pytest.mark.parametrize("mode", ["saturation", "inf_nan"])
def test_modelzoo_dcgan_script_runs_unchanged(mode):
    # A script written for the real npu_bridge (tests/data/modelzoo_dcgan.py:
    # npu_init star import, NPULossScaleOptimizer + ExponentialUpdateLoss-
    # ScaleManager(2**32, ...), alternating D/G runs, npu_config_proto) runs
    # on the shim as it is; graph mode from NPU_LOSSSCALE_GRAPH_MODE.
    env = {k: v for k, v in os.environ.items() if k not in _ENV}
    env.update(NPU_SHIM_OVERFLOW_MODE=mode, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([SHIMS, HERE]))
    runner = ("import sys, runpy; from graph_mode import set_graph_mode; set_graph_mode(); "
              "sys.argv = [sys.argv[1], '--steps', '40']; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = warm_python.run([sys.executable, "-c", runner, DCGAN], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["inf_nan_mode"] is (mode == "inf_nan")
    # 2**32 overflows float16 gradients: steps are skipped and the scale
    # halves every 2 bad steps until the gradients fit, then steps apply.
    assert 1.0 <= out["d_loss_scale"] < 2.0 ** 32 and 1.0 <= out["g_loss_scale"] < 2.0 ** 32
    assert 0 < out["d_steps_applied"] < 40
    assert out["finite_weights"] and out["weights_changed"]


# -- npu_bridge's optimizers inside our builder -------------------------------------

def test_builder_rejects_npu_optimizer_that_scales_itself(graph, npu):
    """tf_adapter npu_bridge/estimator/npu/npu_optimizer.py: NPUOptimizer with
    is_loss_scale=True scales the loss itself; inside the builder that would
    scale twice."""
    import npu_lossscale as nl
    from npu_bridge.estimator.npu.npu_optimizer import NPUOptimizer
    from npu_bridge.estimator.npu.npu_loss_scale_manager import FixedLossScaleManager
    w = tf.Variable(1.0)
    opt = NPUOptimizer(tf.train.GradientDescentOptimizer(0.1),
                       loss_scale_manager=FixedLossScaleManager(8), is_loss_scale=True)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="is_finite")
    with pytest.raises(TypeError, match="is_loss_scale=True"):
        scaler.add(w * 2.0, opt, var_list=[w])


def test_builder_detects_npu_distributed_wrapper_reduction(graph, npu, monkeypatch):
    """tf_adapter npu_optimizer.py: npu_distributed_optimizer_wrapper patches the
    optimizer instance in place. Our builder must call its compute_gradients
    (not a shared tf.gradients that would bypass the averaging) and must not
    average a second time."""
    import npu_lossscale as nl
    from npu_lossscale import distributed
    from npu_bridge.estimator.npu.npu_optimizer import npu_distributed_optimizer_wrapper
    w = tf.Variable(1.0)
    wrapped = npu_distributed_optimizer_wrapper(tf.train.GradientDescentOptimizer(0.1))
    assert distributed.reduces_gradients(wrapped)
    assert not distributed.reduces_gradients(tf.train.GradientDescentOptimizer(0.1))
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="is_finite",
                                        distributed="hccl")
    with pytest.raises(ValueError, match="a second time"):
        scaler.add(w * 2.0, wrapped, var_list=[w])
    ok = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="is_finite",
                                    distributed="hccl", allreduce_gradients=False)
    calls = []
    original = wrapped.compute_gradients
    wrapped.compute_gradients = lambda *a, **k: calls.append(1) or original(*a, **k)
    ok.add(w * 2.0, wrapped, var_list=[w], name="w")
    other = tf.Variable(2.0)
    ok.add(other * 3.0, tf.train.GradientDescentOptimizer(0.1), var_list=[other], name="other")
    ok.build()
    assert calls == [1]  # the wrapper's compute_gradients computed the group's gradients
