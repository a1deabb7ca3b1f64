"""Tests of the CPU emulation of npu_bridge in shims/.

Each test puts shims/ on sys.path itself (fixture ``npu``) and removes it,
the npu_bridge* modules and the shim's op-creation callback afterwards, so
other tests run without npu_bridge.

The emulated register is only set in saturation mode (in INF/NaN mode, the
default, tf_adapter never reads it: see tests/test_shim_adapter.py), so the
tests of register semantics choose saturation mode explicitly.
"""
import ast
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import tensorflow as tf2
import tensorflow.compat.v1 as tf
import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS = os.path.join(os.path.dirname(HERE), "shims")
F16_MAX = 65504.0


def _unload_npu_bridge():
    emu = sys.modules.get("npu_bridge._emulation")
    if emu is not None:
        emu.uninstall()
    for name in list(sys.modules):
        if name == "npu_bridge" or name.startswith("npu_bridge."):
            del sys.modules[name]


@pytest.fixture
def npu(monkeypatch):
    monkeypatch.delenv("NPU_SHIM_OVERFLOW_MODE", raising=False)
    monkeypatch.delenv("INF_NAN_MODE_ENABLE", raising=False)
    monkeypatch.delenv("NPU_SHIM_OP_SET", raising=False)
    monkeypatch.delenv("RANK_SIZE", raising=False)
    monkeypatch.delenv("CM_WORKER_SIZE", raising=False)
    _unload_npu_bridge()
    sys.path.insert(0, SHIMS)
    try:
        import npu_bridge
        from npu_bridge import _emulation
        from npu_bridge.helper import helper
        from npu_bridge.hccl import hccl_ops
        from npu_bridge.estimator.npu import npu_plugin
        from npu_bridge.estimator.npu import npu_loss_scale_manager
        _emulation.reset()
        yield types.SimpleNamespace(
            bridge=npu_bridge, emu=_emulation, gen=helper.get_gen_ops(), helper=helper,
            hccl=hccl_ops, plugin=npu_plugin, lsm=npu_loss_scale_manager)
    finally:
        _unload_npu_bridge()
        while SHIMS in sys.path:
            sys.path.remove(SHIMS)


def _status_after(deps, gen):
    with tf.control_dependencies(deps):
        return gen.npu_get_float_status_v2()


# ----------------------------------------------------------------- surface
def test_not_importable_without_shims_path():
    _unload_npu_bridge()
    assert SHIMS not in sys.path
    with pytest.raises(ImportError):
        import npu_bridge  # noqa: F401


def test_shim_sources_parse_as_python37():
    for root, _, files in os.walk(SHIMS):
        for fn in files:
            if fn.endswith(".py"):
                path = os.path.join(root, fn)
                with open(path) as f:
                    ast.parse(f.read(), filename=path, feature_version=(3, 7))


def test_gen_ops_surface_dtypes_shapes_names(npu):
    gen, emu = npu.gen, npu.emu
    assert npu.bridge.IS_CPU_SHIM
    assert npu.helper.version == "v1.15.0"
    with tf.Graph().as_default() as g:
        x = tf.placeholder(tf.float16, [3])
        w = tf.Variable(tf.ones([3], tf.float16))
        grads = tf.gradients(tf.reduce_sum(x * w), [w])
        with tf.control_dependencies(grads):
            st = gen.npu_get_float_status_v2()
        with tf.control_dependencies([st]):
            cl = gen.npu_clear_float_status_v2()
        assert st.dtype == tf.int32 and st.shape.as_list() == [8]
        assert st.op.name == "NpuGetFloatStatusV2"
        assert emu.shim_op_type(st.op) == "NpuGetFloatStatusV2"
        # the read itself carries the control dependency on the gradients
        assert set(c.name for c in st.op.control_inputs) == set(t.op.name for t in grads)
        assert isinstance(cl, tf.Operation) and len(cl.outputs) == 0
        assert cl.name == "NpuClearFloatStatusV2" and st.op in cl.control_inputs
        with tf.name_scope("opt"):
            st2 = gen.npu_get_float_status_v2()
        assert st2.op.name == "opt/NpuGetFloatStatusV2"

        buf = gen.npu_alloc_float_status()
        assert buf.dtype.base_dtype == tf.float32 and buf.dtype._is_ref_dtype
        assert buf.shape.as_list() == [8] and buf.op.name == "NpuAllocFloatStatus"
        local = gen.npu_get_float_status(buf)
        cleared = gen.npu_clear_float_status(local)
        assert local.dtype == tf.float32 and local.shape.as_list() == [8]
        assert cleared.dtype == tf.float32 and cleared.shape.as_list() == [8]
        assert local.op.name == "NpuGetFloatStatus" and cleared.op.name == "NpuClearFloatStatus"
        assert emu.count_status_reads(g) == 3 and emu.count_status_clears(g) == 2
        assert emu.count_ops(g, "NpuAllocFloatStatus") == 1
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            s, b, l_, c = sess.run([st, buf, local, cleared], {x: [1, 2, 3]})
            assert s.dtype == np.int32 and s.shape == (8,) and not s.any()
            assert b.shape == (8,) and not b.any() and not l_.any() and not c.any()


def test_op_set_v1_hides_v2_ops(npu):
    gen, emu = npu.gen, npu.emu
    cached = npu.helper.get_gen_ops()
    assert hasattr(gen, "npu_get_float_status_v2") and hasattr(gen, "npu_clear_float_status_v2")
    with emu.op_set("v1"):
        assert emu.get_op_set() == "v1"
        for m in (gen, cached):
            assert not hasattr(m, "npu_get_float_status_v2")
            assert not hasattr(m, "npu_clear_float_status_v2")
            assert "npu_get_float_status_v2" not in dir(m)
            for name in ("npu_alloc_float_status", "npu_get_float_status",
                         "npu_clear_float_status", "hcom_all_reduce"):
                assert hasattr(m, name)
        with pytest.raises(AttributeError):
            gen.npu_get_float_status_v2  # noqa: B018
    assert hasattr(cached, "npu_get_float_status_v2")
    with pytest.raises(ValueError):
        emu.set_op_set("v3")


def test_op_set_default_from_env(npu, monkeypatch):
    monkeypatch.setenv("NPU_SHIM_OP_SET", "v1")
    npu.emu.reset()
    assert not hasattr(npu.gen, "npu_get_float_status_v2")
    monkeypatch.delenv("NPU_SHIM_OP_SET")
    npu.emu.reset()
    assert hasattr(npu.gen, "npu_get_float_status_v2")


def test_mode_default_from_env_and_plugin(npu, monkeypatch):
    # tf_adapter: npu_plugin.py / util/ge_plugin.cc (runtime sat mode, no env
    # var); the shim's test-only default comes from NPU_SHIM_OVERFLOW_MODE.
    emu, plugin = npu.emu, npu.plugin
    assert emu.get_overflow_mode() == "inf_nan" and plugin.is_inf_nan_enabled()
    monkeypatch.setenv("NPU_SHIM_OVERFLOW_MODE", "saturation")
    emu.reset()
    assert emu.get_overflow_mode() == "saturation" and not plugin.is_inf_nan_enabled()
    monkeypatch.setenv("NPU_SHIM_OVERFLOW_MODE", "1")
    emu.reset()
    assert plugin.is_inf_nan_enabled()
    monkeypatch.setenv("NPU_SHIM_OVERFLOW_MODE", "0")
    emu.reset()
    assert not plugin.is_inf_nan_enabled()
    monkeypatch.setenv("NPU_SHIM_OVERFLOW_MODE", "bogus")
    with pytest.raises(ValueError, match="NPU_SHIM_OVERFLOW_MODE"):
        emu.reset()
    monkeypatch.delenv("NPU_SHIM_OVERFLOW_MODE")
    monkeypatch.setenv("INF_NAN_MODE_ENABLE", "0")   # torch_npu's variable: ignored
    emu.reset()
    assert plugin.is_inf_nan_enabled()
    assert plugin.set_device_sat_mode(0) is None
    assert emu.get_overflow_mode() == "saturation"
    plugin.set_device_sat_mode(1)
    assert emu.get_overflow_mode() == "inf_nan"
    plugin.set_device_sat_mode(2)             # the runtime call fails: logged, mode kept
    assert emu.get_overflow_mode() == "inf_nan"
    with emu.overflow_mode("saturation"):
        assert not plugin.is_inf_nan_enabled()
    assert plugin.is_inf_nan_enabled()


# ------------------------------------------------------ register semantics
def test_no_overflow_status_zero(npu):
    with npu.emu.overflow_mode("saturation"), tf.Graph().as_default():
        x = tf.placeholder(tf.float16, [2])
        w = tf.Variable(tf.constant([2.0, 3.0], tf.float16))
        y = tf.exp(x) * w
        loss = tf.reduce_sum(tf.cast(y, tf.float32))
        grads = tf.gradients(loss, [w])
        st = _status_after(grads + [y], npu.gen)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(3):
                yv, s = sess.run([y, st], {x: [1.0, 9.0]})   # 3 * e^9 = 24309
                assert np.isfinite(yv).all() and not s.any()


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
def test_forward_overflow(npu, mode):
    with npu.emu.overflow_mode(mode), tf.Graph().as_default():
        x = tf.placeholder(tf.float16, [3])
        w = tf.Variable(tf.constant([1.0, 1.0, 1.0], tf.float16))  # resource variable
        y = x * w * 1000.0
        fin = tf.is_finite(y)
        loss = tf.reduce_sum(tf.cast(y, tf.float32))
        grads = tf.gradients(loss, [w])
        st = _status_after(grads + [y], npu.gen)
        nan = tf.sqrt(tf.constant(-1.0, tf.float16) * x[0])
        st_nan = _status_after([nan], npu.gen)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            yv, fv, s = sess.run([y, fin, st], {x: [1.0, 100.0, -100.0]})
            # INF/NaN mode: the register is never set (only is_finite sees it)
            assert s[0] != 0 if mode == "saturation" else not s.any()
            if mode == "saturation":
                assert yv[1] == F16_MAX and yv[2] == -F16_MAX and fv.all()
            else:
                assert np.isposinf(yv[1]) and np.isneginf(yv[2]) and not fv[1:].any()
            assert yv[0] == 1000.0
        with tf.Session() as sess:  # fresh session -> fresh register
            nv, s = sess.run([nan, st_nan], {x: [1.0, 1.0, 1.0]})
            assert s[0] != 0 if mode == "saturation" else not s.any()
            assert (nv == 0.0) if mode == "saturation" else np.isnan(nv)


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
def test_overflow_in_backward_only(npu, mode):
    with npu.emu.overflow_mode(mode), tf.Graph().as_default():
        w = tf.Variable(tf.constant(1.0, tf.float16))
        c = tf.placeholder(tf.float16, [])
        loss = w * c                                   # 60000: finite
        g = tf.gradients(loss, [w], grad_ys=tf.constant(2.0, tf.float16))[0]  # 120000
        st = _status_after([g, loss], npu.gen)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            lv, gv, s = sess.run([loss, g, st], {c: 60000.0})
            assert lv == 60000.0
            assert s[0] != 0 if mode == "saturation" else not s.any()
            assert gv == F16_MAX if mode == "saturation" else np.isinf(gv)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            assert not sess.run(st, {c: 1000.0}).any()


def test_sticky_across_runs_and_clear(npu):
    gen, emu = npu.gen, npu.emu
    with emu.overflow_mode("saturation"), tf.Graph().as_default() as g:
        x = tf.placeholder(tf.float16, [])
        y = x * 1000.0
        st = _status_after([y], gen)
        with tf.control_dependencies([st]):
            read_and_clear = gen.npu_clear_float_status_v2()
        clear_only = gen.npu_clear_float_status_v2()
        peek = emu.register_tensor()
        assert emu.count_status_reads(g) == 1 and emu.count_status_clears(g) == 2
        with tf.Session() as sess:
            assert not sess.run(st, {x: 1.0}).any()
            assert sess.run(st, {x: 100.0})[0] == 1            # overflow
            assert sess.run(st, {x: 1.0})[0] == 1              # sticky, no clear
            sess.run(clear_only)
            assert not sess.run(peek).any()
            assert not sess.run(st, {x: 1.0}).any()            # clear resets
            sess.run(y, {x: 100.0})                            # overflow, no read at all
            assert sess.run(peek)[0] == 1
            s, _ = sess.run([st, read_and_clear], {x: 1.0})    # read then clear
            assert s[0] == 1 and not sess.run(peek).any()


def test_register_is_not_a_variable_and_per_session(npu):
    emu = npu.emu
    with emu.overflow_mode("saturation"), tf.Graph().as_default() as g:
        x = tf.placeholder(tf.float16, [])
        v = tf.Variable(1.0)
        st = _status_after([x * 1000.0], npu.gen)
        handle = g.get_collection(emu.REGISTER_COLLECTION)
        assert len(handle) == 1 and handle[0].dtype == tf.resource
        assert tf.global_variables() == [v] and tf.local_variables() == []
        with tf.Session() as s1, tf.Session() as s2:
            # no initializer needed for the register
            assert s1.run(st, {x: 100.0})[0] == 1
            assert not s2.run(st, {x: 1.0}).any()
            assert s1.run(st, {x: 1.0})[0] == 1


def test_serialised_reads_attribute_shared_forward_to_first_read(npu):
    """clear -> A grads -> read A -> clear -> B grads -> read B: in saturation
    mode an overflow in forward ops shared by A and B is only seen by read A."""
    gen = npu.gen
    with npu.emu.overflow_mode("saturation"), tf.Graph().as_default():
        x = tf.placeholder(tf.float16, [])
        b_scale = tf.placeholder(tf.float16, [])
        wa = tf.Variable(tf.constant(1.0, tf.float16))
        wb = tf.Variable(tf.constant(1.0, tf.float16))
        clear0 = gen.npu_clear_float_status_v2()
        with tf.control_dependencies([clear0]):
            h = x * 1000.0                                   # shared forward
        loss_a = tf.cast(h * wa, tf.float32)
        grads_a = tf.gradients(loss_a, [wa])
        read_a = _status_after(grads_a + [h, loss_a], gen)
        with tf.control_dependencies([read_a]):
            clear1 = gen.npu_clear_float_status_v2()
        with tf.control_dependencies([clear1]):
            loss_b = tf.cast(h * 0.002 * wb * b_scale, tf.float32)
            grads_b = tf.gradients(loss_b, [wb])
        read_b = _status_after(grads_b + [loss_b], gen)
        assert npu.emu.count_status_reads(tf.get_default_graph()) == 2
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            fetch = [read_a, read_b]
            ra, rb = sess.run(fetch, {x: 1.0, b_scale: 1.0})
            assert not ra.any() and not rb.any()
            ra, rb = sess.run(fetch, {x: 100.0, b_scale: 1.0})     # shared overflow
            assert ra[0] == 1 and not rb.any()
            ra, rb = sess.run(fetch, {x: 1.0, b_scale: 60000.0})   # B-only: 2 * 60000
            assert not ra.any() and rb[0] == 1


def test_overflow_inside_cond_branch_and_counting_in_functions(npu):
    emu, gen = npu.emu, npu.gen
    with emu.overflow_mode("saturation"), tf.Graph().as_default() as g:
        x = tf.placeholder(tf.float16, [])
        y = tf.cond(x > 0, lambda: x * 1000.0, lambda: x)
        out = tf.cast(y, tf.float32)
        st = _status_after([out], gen)
        inner = tf.cond(x > 0, lambda: tf.cast(gen.npu_get_float_status_v2(), tf.float32),
                        lambda: tf.zeros([8]))
        assert emu.count_status_reads(g) == 2
        top_level = 1 if tf.control_flow_v2_enabled() else 2   # cond_v2: read in a function
        assert emu.count_status_reads(g, include_functions=False) == top_level
        assert len(emu.find_ops(g, emu.READ_OP_TYPES)) == top_level
        with tf.Session() as sess:
            assert not sess.run(st, {x: 1.0}).any()
            yv, s = sess.run([y, st], {x: 100.0})
            assert yv == F16_MAX and s[0] == 1
            assert sess.run(inner, {x: 1.0})[0] == 1


def test_ops_built_before_install_are_instrumented_at_read(npu):
    emu, gen = npu.emu, npu.gen
    emu.uninstall()
    assert not emu.is_installed()
    with tf.Graph().as_default() as g:
        x = tf.placeholder(tf.float16, [])
        y = x * 1000.0
        z = y + 1.0
    emu.install()
    with emu.overflow_mode("saturation"), g.as_default():
        st = _status_after([z], gen)
        with tf.Session() as sess:
            zv, s = sess.run([z, st], {x: 100.0})
            assert zv == F16_MAX and s[0] == 1
            # limitation: a Python handle to a raw pre-install tensor is unchanged
            assert np.isinf(sess.run(y, {x: 100.0}))


def test_unloaded_shim_callback_is_inert(npu):
    """If npu_bridge is dropped from sys.modules without uninstall() (e.g. by
    another fixture), the left-over callback no longer instruments anything."""
    for name in [m for m in sys.modules if m == "npu_bridge" or m.startswith("npu_bridge.")]:
        del sys.modules[name]
    assert npu.emu.is_installed()
    with npu.emu.overflow_mode("saturation"), tf.Graph().as_default() as g:
        x = tf.placeholder(tf.float16, [])
        y = x * 1000.0
        assert y.op.type == "Mul"
        assert not any(npu.emu.INTERNAL_SCOPE in op.name for op in g.get_operations())
    npu.emu.uninstall()


def test_uninstall_removes_callback(npu):
    from tensorflow.python.eager import context
    assert npu.emu.is_installed()
    npu.emu.uninstall()
    assert not npu.emu.is_installed()
    assert not any(getattr(cb, "_npu_shim_callback", False) for cb in context.context().op_callbacks)
    npu.emu.install()
    npu.emu.install()
    assert len([cb for cb in context.context().op_callbacks
                if getattr(cb, "_npu_shim_callback", False)]) == 1


def test_v1_alloc_buffer_in_place_protocol(npu):
    """Old NPULossScaleOptimizer protocol: finite = all(alloc_buf == cleared)."""
    gen, hccl = npu.gen, npu.hccl
    with npu.emu.op_set("v1"), npu.emu.overflow_mode("saturation"), tf.Graph().as_default():
        assert not hasattr(gen, "npu_get_float_status_v2")
        buf = gen.npu_alloc_float_status()
        x = tf.placeholder(tf.float16, [])
        w = tf.Variable(tf.constant(1.0, tf.float16))
        y = x * w * 1000.0
        grads = tf.gradients(tf.cast(y, tf.float32), [w])
        with tf.control_dependencies(grads + [y]):
            local = gen.npu_get_float_status(buf)
            cleared = gen.npu_clear_float_status(local)
        finite = tf.reduce_all(tf.equal(buf, cleared))
        agg = hccl.allreduce([buf], "sum", fusion=0)
        finite_dist = tf.reduce_all(tf.equal(agg, cleared))
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            f, fd, l_ = sess.run([finite, finite_dist, local], {x: 1.0})
            assert f and fd and not l_.any()
            f, fd, l_, a = sess.run([finite, finite_dist, local, agg], {x: 100.0})
            assert not f and not fd and l_[0] == 1.0 and a.shape == (1, 8)
            assert sess.run(finite, {x: 1.0})           # cleared by previous step


# ------------------------------------------------------------------- hccl
def test_hccl_allreduce_identity(npu, monkeypatch):
    hccl, emu = npu.hccl, npu.emu
    with tf.Graph().as_default() as g:
        t = tf.constant([[1.0, -2.0], [3.0, 4.5]], tf.float16)
        r = hccl.allreduce(t, "sum")
        assert r.dtype == tf.float16 and r.shape.as_list() == [2, 2]
        assert r.op.name == "HcomAllReduce" and emu.shim_op_type(r.op) == "HcomAllReduce"
        assert r.op.get_attr("_npu_shim_fusion") == 1 and r.op.get_attr("_npu_shim_fusion_id") == -1
        assert r.op.get_attr("_npu_shim_group") == b"hccl_world_group"
        s = tf.constant([0, 3, 0, 0, 0, 0, 0, 0], tf.int32)
        packed = hccl.allreduce([s], "sum", fusion=0)
        assert packed.shape.as_list() == [1, 8]
        assert hccl.allreduce(t, "max").dtype == tf.float16
        gr = tf.gradients(tf.reduce_sum(tf.cast(r, tf.float32)), [t])[0]
        with pytest.raises(ValueError):
            hccl.allreduce(t, "mean")
        with pytest.raises(TypeError):
            hccl.allreduce(tf.constant([1.0], tf.float64), "sum")
        monkeypatch.setenv("RANK_SIZE", "2")
        with pytest.raises(NotImplementedError):
            hccl.allreduce(t, "sum")
        monkeypatch.setenv("RANK_SIZE", "1")
        hccl.allreduce(t, "sum")
        assert emu.count_ops(g, "HcomAllReduce") == 4
        with tf.Session() as sess:
            tv, rv, pv, gv = sess.run([t, r, packed, gr])
            np.testing.assert_array_equal(rv, tv)
            np.testing.assert_array_equal(pv, [[0, 3, 0, 0, 0, 0, 0, 0]])
            np.testing.assert_array_equal(gv, np.ones((2, 2)))


# ---------------------------------------------------------------- managers
def test_fixed_loss_scale_manager(npu):
    lsm = npu.lsm
    with tf.Graph().as_default():
        m = lsm.FixedLossScaleManager(128)
        assert m.get_enable_overflow_check() is True
        assert lsm.FixedLossScaleManager(1, enable_overflow_check=False).get_enable_overflow_check() is False
        ls = m.get_loss_scale()
        assert isinstance(ls, tf.Tensor) and ls.dtype == tf.float32 and ls.shape.ndims == 0
        op = m.update_loss_scale(tf.constant(False))
        assert isinstance(op, tf.Operation)
        with pytest.raises(ValueError):
            lsm.FixedLossScaleManager(0.5)
        assert tf.global_variables() == []
        with tf.Session() as sess:
            sess.run(op)
            assert sess.run(ls) == 128.0


def test_exponential_manager_hand_checked_sequence(npu):
    lsm = npu.lsm
    with tf.Graph().as_default():
        m = lsm.ExponentialUpdateLossScaleManager(
            1024, incr_every_n_steps=2, decr_every_n_nan_or_inf=2, incr_ratio=2, decr_ratio=0.5)
        ls = m.get_loss_scale()
        assert isinstance(ls, tf2.Variable) and ls.dtype.base_dtype == tf.float32
        names = sorted(v.op.name for v in tf.global_variables())
        assert names == ["bad_steps", "good_steps", "loss_scale"]
        assert tf.trainable_variables() == []
        finite = tf.placeholder(tf.bool, [])
        upd = m.update_loss_scale(finite)
        # npu_bridge returns its outer cond: an Operation (v1 cond) or a tensor (cond_v2)
        assert isinstance(upd, (tf.Operation, tf.Tensor))
        state = [tf.convert_to_tensor(ls), tf.convert_to_tensor(m._num_good_steps),
                 tf.convert_to_tensor(m._num_bad_steps)]
        steps = [  # (finite, (scale, good, bad) after the step)
            (False, (1024, 0, 1)),
            (False, (512, 0, 0)),   # 2 bad steps -> 1024 * 0.5
            (True, (512, 1, 0)),
            (True, (1024, 0, 0)),   # 2 good steps -> 512 * 2
            (True, (1024, 1, 0)),
            (False, (1024, 0, 1)),  # bad step resets good
            (True, (1024, 1, 1)),   # good step keeps bad (not consecutive)
            (False, (512, 0, 0)),
        ]
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            assert sess.run(state) == [1024.0, 0, 0]
            for fin, want in steps:
                sess.run(upd, {finite: fin})
                assert tuple(sess.run(state)) == want, (fin, want)
        m1 = lsm.ExponentialUpdateLossScaleManager(1, 1000, decr_every_n_nan_or_inf=1, decr_ratio=0.5)
        upd1 = m1.update_loss_scale(tf.constant(False))
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(upd1)
            assert sess.run(m1.get_loss_scale()) == 1.0   # never below 1


# ------------------------------------------------ v1 behaviour (subprocess)
_V1_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import tensorflow.compat.v1 as tf
tf.disable_v2_behavior()
import npu_bridge
from npu_bridge import _emulation as emu
from npu_bridge.helper import helper
from npu_bridge.estimator.npu import npu_loss_scale_manager as lsm
gen = helper.get_gen_ops()
out = {}
for mode in ("inf_nan", "saturation"):
    with emu.overflow_mode(mode):
        g = tf.Graph()
        with g.as_default():
            x = tf.placeholder(tf.float16, [])
            w = tf.Variable(tf.constant(1.0, tf.float16))
            out["var_" + mode] = type(w).__name__
            y = tf.cond(x > 0, lambda: x * w * 1000.0, lambda: x * w)
            loss = tf.cast(y, tf.float32)
            opt = tf.train.GradientDescentOptimizer(0.0)
            gv = opt.compute_gradients(loss, [w])
            grads = [gr for gr, _ in gv]
            with tf.control_dependencies(grads + [y]):
                st = gen.npu_get_float_status_v2()
            with tf.control_dependencies([st]):
                cl = gen.npu_clear_float_status_v2()
            finite = tf.reduce_all(tf.equal(st, 0))
            mgr = lsm.ExponentialUpdateLossScaleManager(1024, 1000, decr_every_n_nan_or_inf=2,
                                                        decr_ratio=0.5)
            train = tf.cond(finite, lambda: opt.apply_gradients(gv), tf.no_op)
            step = tf.group(train, cl, mgr.update_loss_scale(finite))
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                rows = []
                for xv in (1.0, 100.0, 100.0, 1.0):
                    res = sess.run([y, st, finite, step], {x: xv})
                    rows.append([float(res[0]), int(res[1][0]), bool(res[2]),
                                 float(sess.run(mgr.get_loss_scale()))])
                out[mode] = rows
            out["reads_" + mode] = emu.count_status_reads(g)
with emu.op_set("v1"), emu.overflow_mode("saturation"):
    out["v1_has_v2"] = hasattr(gen, "npu_get_float_status_v2")
    with tf.Graph().as_default():
        buf = gen.npu_alloc_float_status()
        x = tf.placeholder(tf.float16, [])
        y = x * 1000.0
        with tf.control_dependencies([y]):
            local = gen.npu_get_float_status(buf)
            cleared = gen.npu_clear_float_status(local)
        finite = tf.reduce_all(tf.equal(buf, cleared))
        with tf.Session() as sess:
            out["v1_protocol"] = [bool(sess.run(finite, {x: v})) for v in (1.0, 100.0, 1.0)]
print("RESULT" + json.dumps(out))
"""


def test_v1_behaviour_ref_variables_subprocess():
    env = dict(os.environ)
    env.pop("INF_NAN_MODE_ENABLE", None)
    env.pop("NPU_SHIM_OVERFLOW_MODE", None)
    env.pop("NPU_SHIM_OP_SET", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    proc = warm_python.run([sys.executable, "-c", _V1_SCRIPT, SHIMS], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT"):])
    assert out["var_inf_nan"] == "RefVariable"
    # rows: [y, status word 0, finite, loss scale after the step]
    # INF/NaN mode: the register never reports the overflow (a library that
    # reads it there applies inf steps; tf_adapter uses is_finite instead).
    rows = out["inf_nan"]
    assert [r[1:] for r in rows] == [[0, True, 1024.0]] * 4
    assert rows[0][0] == 1000.0 and rows[1][0] == float("inf")
    assert not np.isfinite(rows[2][0]) and not np.isfinite(rows[3][0])  # inf step applied
    assert out["saturation"] == [[1000.0, 0, True, 1024.0], [F16_MAX, 1, False, 1024.0],
                                 [F16_MAX, 1, False, 512.0], [1000.0, 0, True, 512.0]]
    assert out["reads_inf_nan"] == 1 and out["reads_saturation"] == 1
    assert out["v1_has_v2"] is False
    assert out["v1_protocol"] == [True, False, True]


def test_hccl_allreduce_across_processes_through_files(npu, monkeypatch, tmp_path):
    """RANK_SIZE=2 with NPU_SHIM_HCCL_DIR: this process is rank 0 and rank 1's
    contribution is written by hand, as the other process would write it.
    (tests/test_distributed.py runs two real processes.)"""
    hccl = npu.hccl
    gen_ops = sys.modules["npu_bridge._gen_npu_ops"]
    monkeypatch.setenv("RANK_SIZE", "2")
    monkeypatch.setenv("NPU_SHIM_HCCL_DIR", str(tmp_path))
    monkeypatch.setenv("RANK_ID", "2")
    with tf.Graph().as_default():
        t = tf.constant([1.5, -2.0, 3.0], tf.float16)
        with pytest.raises(ValueError, match=r"RANK_ID must be in \[0, 2\), got '2'"):
            hccl.allreduce(t, "sum")
    monkeypatch.setenv("RANK_ID", "0")
    monkeypatch.setattr(gen_ops, "HCCL_TIMEOUT", 0.5)
    with tf.Graph().as_default():
        t = tf.constant([1.5, -2.0, 3.0], tf.float16)
        summed, largest = hccl.allreduce(t, "sum"), hccl.allreduce(t, "max")
        assert summed.shape.as_list() == [3] and summed.dtype == tf.float16
        other = np.array([0.25, 4.0, -8.0], np.float16)
        np.save(str(tmp_path / "hcom0.0.1.npy"), other)  # rank 1, first call
        np.save(str(tmp_path / "hcom1.0.1.npy"), other)
        with tf.Session() as sess:
            s, m = sess.run([summed, largest])
            np.testing.assert_array_equal(s, np.array([1.5, -2.0, 3.0], np.float16) + other)
            np.testing.assert_array_equal(m, [1.5, 4.0, 3.0])
            # Rank 1 never arrives for the second call: a timeout naming it.
            with pytest.raises(tf.errors.OpError, match=r"call 1\) on rank 0 waited .*\[1\]"):
                sess.run(summed)


def test_hccl_allgather_concatenates_the_ranks_in_order(npu, monkeypatch, tmp_path):
    """hccl_ops.allgather (tf_adapter hccl/hccl_ops.py; the shape function
    of HcomAllGather, tf_adapter/ops/hccl/hccl_ops.cc: dimension 0 times
    rank_size): the identity on one rank; on rank 0 of two, rank 1's rows
    (written by hand, as the other process would) after this rank's."""
    hccl = npu.hccl
    with tf.Graph().as_default():
        t = tf.constant([[1.0, 2.0]], tf.float32)
        one = hccl.allgather(t, 1)
        assert one.op.get_attr("_npu_shim_op_type") == b"HcomAllGather"
        assert one.op.get_attr("_npu_shim_rank_size") == 1
        with pytest.raises(ValueError, match="rank_size=2, but this job has 1 ranks"):
            hccl.allgather(t, 2)
        with tf.Session() as sess:
            np.testing.assert_array_equal(sess.run(one), [[1.0, 2.0]])
    monkeypatch.setenv("RANK_SIZE", "2")
    monkeypatch.setenv("RANK_ID", "0")
    monkeypatch.setenv("NPU_SHIM_HCCL_DIR", str(tmp_path))
    with tf.Graph().as_default():
        values = hccl.allgather(tf.constant([[1.0, 2.0], [3.0, 4.0]]), 2)
        indices = hccl.allgather(tf.constant([7, 9], tf.int64), 2)
        assert values.shape.as_list() == [4, 2] and indices.shape.as_list() == [4]
        np.save(str(tmp_path / "hcom0.0.1.npy"), np.array([[5.0, 6.0], [7.0, 8.0]], np.float32))
        np.save(str(tmp_path / "hcom1.0.1.npy"), np.array([1, 7], np.int64))
        with tf.Session() as sess:
            v, i = sess.run([values, indices])
        np.testing.assert_array_equal(v, [[1, 2], [3, 4], [5, 6], [7, 8]])
        np.testing.assert_array_equal(i, [7, 9, 1, 7])
