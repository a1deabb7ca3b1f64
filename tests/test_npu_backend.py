"""The npu backend on the CPU shim: one status read per step, saturation mode,
serialised per-group reads, and npu_bridge's own managers."""

import sys
import warnings

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import backends
from conftest import SKIPPED_STEPS, op_ancestors, ops_not_after, snapshot_globals
from models import add_gan_groups, two_group_gan


def _emulation():
    from npu_bridge import _emulation  # the shim's test-only controls
    return _emulation


def _n_group_model(n):
    """n groups on one float16 graph: each loss reads every group's weight."""
    x = tf.placeholder(tf.float32, [4, 3])
    weights = [tf.get_variable("w%d" % i, [3, 3], initializer=tf.ones_initializer())
               for i in range(n)]
    h = tf.cast(x, tf.float16)
    for w in weights:
        h = tf.tanh(tf.matmul(h, tf.cast(w, tf.float16)))
    losses = [tf.reduce_mean(h * float(i + 1)) for i in range(n)]
    return x, weights, losses


@pytest.mark.parametrize("op_set", ["v1", "v2"])
@pytest.mark.parametrize("groups", [1, 2, 5])
def test_exactly_one_status_read_after_the_one_clear(graph, npu_shim, saturation_mode, op_set,
                                                     groups):
    """One read per step, and one clear per graph that runs before every op
    the read follows (reads never clear: npu_bridge's read-then-clear,
    tf_adapter npu_bridge/estimator/npu/npu_loss_scale_optimizer.py, is what
    races when two steps share a run)."""
    emulation = _emulation()
    emulation.set_op_set(op_set)
    x, weights, losses = _n_group_model(groups)
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="npu")
    for i, (w, loss) in enumerate(zip(weights, losses)):
        scaler.add(loss, tf.train.AdamOptimizer(0.01), var_list=[w], name="g%d" % i)
    train = scaler.build(global_step=tf.train.get_or_create_global_step())
    assert scaler.backend == "npu"
    assert emulation.count_status_reads(graph) == 1
    assert emulation.count_status_clears(graph) == 1
    step_ops = op_ancestors(train.update_op)
    assert train.clear_status in step_ops
    [read] = [op for op in step_ops if emulation.shim_op_type(op) in emulation.READ_OP_TYPES]
    assert ops_not_after(read, train.clear_status) == []
    v2_reads = emulation.count_ops(graph, "NpuGetFloatStatusV2")
    assert v2_reads == (1 if op_set == "v2" else 0)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(2):
            assert sess.run([train.update_op, train.is_finite], {x: np.ones([4, 3])})[1]


def _saturating_model():
    """x * w overflows float16 (1000 * 100 > 65504) in the forward pass."""
    x = tf.placeholder(tf.float32, [2, 2])
    w = tf.get_variable("w", initializer=np.full([2, 2], 100.0, np.float32))
    h = tf.matmul(tf.cast(x, tf.float16), tf.cast(w, tf.float16))
    loss = tf.reduce_mean(tf.cast(h, tf.float32)) * 1e-4
    return x, w, h, loss


@pytest.mark.parametrize("op_set", ["v1", "v2"])
def test_saturation_overflow_is_caught_by_npu_and_missed_by_is_finite(graph, npu_shim, op_set):
    """The reason the npu backend exists, on one graph."""
    emulation = _emulation()
    emulation.set_op_set(op_set)
    emulation.set_overflow_mode("saturation")
    from npu_bridge.helper import helper
    x, w, h, loss = _saturating_model()
    grads = tf.gradients(loss, [w])
    is_finite_flag = backends.IsFiniteBackend().overflow_flag(grads)
    npu_flag = backends.NpuFloatStatusBackend(helper.get_gen_ops()).overflow_flag(
        grads, after=[loss])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        feed = {x: np.full([2, 2], 10.0)}  # 10 * 100 * 2 = 2000: no overflow
        assert sess.run([is_finite_flag, npu_flag], feed) == [0.0, 0.0]
        feed = {x: np.full([2, 2], 1000.0)}
        values, grad_values, flags = sess.run([h, grads, [is_finite_flag, npu_flag]], feed)
    assert np.all(values == 65504.0)  # saturated, finite
    assert np.all(np.isfinite(grad_values[0]))
    assert flags == [0.0, 1.0]  # is_finite sees nothing; the register does


def test_saturation_overflow_skips_the_step_only_with_npu(npu_shim):
    def train_once(backend):
        with tf.Graph().as_default():
            _emulation().set_overflow_mode("saturation")
            x, w, h, loss = _saturating_model()
            scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend=backend)
            scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w], name="net")
            train = scaler.build()
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                finite = sess.run([train.is_finite, train.update_op],
                                  {x: np.full([2, 2], 1000.0)})[0]
                return finite, sess.run(w)
    finite_npu, w_npu = train_once("npu")
    finite_isf, w_isf = train_once("is_finite")
    assert not finite_npu and np.all(w_npu == 100.0)  # skipped: weights untouched
    assert finite_isf and not np.all(w_isf == 100.0)  # applied a saturated step


def _build_is_finite(path):
    """A one-variable step with backend="is_finite" on ``path``."""
    w = tf.get_variable("w", [2], initializer=tf.ones_initializer())
    loss = tf.reduce_sum(tf.cast(tf.cast(w, tf.float16) * 3.0, tf.float32))
    manager = nl.FixedLossScaleManager(8.0)
    if path == "builder":
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net")
        return scaler.build
    if path == "optimizer":
        opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(0.1), manager,
                                    backend="is_finite")
        return lambda: opt.minimize(loss, var_list=[w])
    return lambda: nl.all_finite(tf.gradients(loss, [w]), backend="is_finite")


def _saturation_warnings(caught):
    return [str(w.message) for w in caught
            if issubclass(w.category, UserWarning) and "saturation mode" in str(w.message)]


@pytest.mark.parametrize("path", ["builder", "optimizer", "all_finite"])
def test_is_finite_in_saturation_mode_warns_at_build_naming_auto(graph, saturation_mode, path):
    """tf_adapter's npu_plugin.py: is_inf_nan_enabled() False means the device
    saturates (+-65504), which is_finite cannot see (the test above: the
    saturated step is applied). Asked for explicitly, is_finite is kept,
    with one warning at build time naming backend='auto'; the constructor
    only checks the name."""
    with warnings.catch_warnings(record=True) as made:
        warnings.simplefilter("always")
        build = _build_is_finite(path)
    assert _saturation_warnings(made) == []
    with warnings.catch_warnings(record=True) as built:
        warnings.simplefilter("always")
        build()
    [message] = _saturation_warnings(built)
    for fragment in ["backend='is_finite'", "65504", "backend='auto'",
                     "set_device_sat_mode(1)"]:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("path", ["builder", "optimizer", "all_finite"])
@pytest.mark.parametrize("shim", ["inf_nan", "absent"])
def test_is_finite_without_saturation_does_not_warn(path, shim, request):
    """INF/NaN mode (the Atlas A2/A3 default) overflows to inf, which
    is_finite sees; without npu_bridge there is no register at all."""
    if shim == "inf_nan":
        request.getfixturevalue("npu_shim")
    with tf.Graph().as_default():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _build_is_finite(path)()
    assert _saturation_warnings(caught) == []


@pytest.mark.parametrize("op_set", ["v1", "v2"])
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_npu_backend_skip_is_atomic_in_inf_nan_mode(graph, npu_shim, op_set, bad):
    """In INF/NaN mode the npu backend checks the gradients, never the register.

    As npu_bridge's NPULossScaleOptimizer.apply_gradients does when
    ``npu_plugin.is_inf_nan_enabled()`` (tf_adapter
    ``npu_bridge/estimator/npu/npu_loss_scale_optimizer.py``).
    """
    from npu_bridge.estimator.npu import npu_plugin
    _emulation().set_op_set(op_set)
    npu_plugin.set_device_sat_mode(1)
    model = two_group_gan(compute_dtype=tf.float16)
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 8)
    scaler = nl.MultiOptimizerLossScale(manager, backend="npu")
    assert scaler.backend == "is_finite"
    add_gan_groups(scaler, model)
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.is_finite], model.feed)[1]
        before = snapshot_globals(sess)
        feed = dict(model.feed)
        feed[model.poison_g] = bad
        assert not sess.run([train.update_op, train.is_finite], feed)[1]
        after = snapshot_globals(sess)
        # The next clean step applies.
        assert sess.run([train.update_op, train.is_finite], model.feed)[1]
        assert sess.run(gs) == 2
    assert _emulation().count_status_reads(graph) == 0
    state = {v.op.name for v in manager.variables} | {SKIPPED_STEPS}
    for name in before:
        if name not in state:
            assert np.array_equal(before[name], after[name]), name


def _per_group_policy_step(d_scale, g_scale):
    model = two_group_gan(compute_dtype=tf.float16)
    d_manager = nl.DynamicLossScaleManager(d_scale)
    g_manager = nl.DynamicLossScaleManager(g_scale)
    scaler = nl.MultiOptimizerLossScale(d_manager, backend="npu", skip_policy="per_group")
    add_gan_groups(scaler, model, g_manager=g_manager)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        before = sess.run(model.d_vars + model.g_vars)
        groups = sess.run([_finite(train), train.update_op], model.feed)[0]
        after = sess.run(model.d_vars + model.g_vars)
        scales = sess.run([d_manager.get_loss_scale(), g_manager.get_loss_scale()])
    changed = [not np.array_equal(a, b) for a, b in zip(before, after)]
    return train, groups, changed, scales


def test_per_group_policy_serialises_reads_and_skips_only_the_broken_group(graph, npu_shim,
                                                                           saturation_mode):
    """g's own scale (2**20) overflows float16 in g's backward pass only:
    d, read first, applies; g skips."""
    emulation = _emulation()
    train, groups, changed, scales = _per_group_policy_step(2.0 ** 8, 2.0 ** 20)
    assert emulation.count_status_reads(graph) == 2
    assert emulation.count_status_clears(graph) == 1  # clear_status, run first
    reads = [op for op in op_ancestors(train.update_op)
             if emulation.shim_op_type(op) in emulation.READ_OP_TYPES]
    assert [ops_not_after(read, train.clear_status) for read in reads] == [[], []]
    assert groups == {"d": True, "g": False}
    assert changed == [True, True, False, False]  # d's w, b; g's w, b
    assert scales == [2.0 ** 8, 2.0 ** 19]  # each manager on its own group


def test_per_group_policy_on_the_register_skips_later_groups_after_an_earlier_overflow(
        graph, npu_shim, saturation_mode):
    """The register is never cleared between the reads, so g's read (after
    d's) also sees d's overflow: both skip, neither misses it (docs/features.md,
    skip policy)."""
    _, groups, changed, scales = _per_group_policy_step(2.0 ** 20, 2.0 ** 8)
    assert groups == {"d": False, "g": False}
    assert changed == [False] * 4
    assert scales == [2.0 ** 19, 2.0 ** 7]


def test_per_group_policy_with_a_shared_loss_cannot_be_honoured(graph, npu_shim, saturation_mode):
    model = two_group_gan(compute_dtype=tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="npu",
                                        skip_policy="per_group")
    scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars[:1], name="a")
    scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars[1:], name="b",
               loss_scale_manager=nl.DynamicLossScaleManager())
    with pytest.raises(ValueError, match="share one loss.*skip_policy='all'"):
        scaler.build()


def test_single_read_gives_every_manager_the_shared_result(graph, npu_shim, saturation_mode):
    model = two_group_gan(compute_dtype=tf.float16)
    d_manager = nl.DynamicLossScaleManager(2.0 ** 8)
    g_manager = nl.DynamicLossScaleManager(2.0 ** 12)
    scaler = nl.MultiOptimizerLossScale(d_manager, backend="npu")
    add_gan_groups(scaler, model, g_manager=g_manager)
    train = scaler.build()
    assert _emulation().count_status_reads(graph) == 1
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        feed = dict(model.feed)
        feed[model.poison_g] = np.inf
        sess.run(train.update_op, feed)
        # Both halve: the one read cannot say which group overflowed.
        assert sess.run([d_manager.get_loss_scale(), g_manager.get_loss_scale()]) == [2.0 ** 7, 2.0 ** 11]


def test_npu_bridge_managers_are_accepted(graph, npu_shim, saturation_mode):
    from npu_bridge.estimator.npu import npu_loss_scale_manager as npu_managers
    model = two_group_gan(compute_dtype=tf.float16)
    manager = npu_managers.ExponentialUpdateLossScaleManager(
        init_loss_scale=2 ** 10, incr_every_n_steps=1000, decr_every_n_nan_or_inf=1,
        decr_ratio=0.5)
    scaler = nl.MultiOptimizerLossScale(manager)  # auto picks npu with the shim
    assert scaler.backend == "npu"
    add_gan_groups(scaler, model)
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        feed = dict(model.feed)
        feed[model.poison_g] = np.inf
        used = sess.run([train.loss_scale, train.update_op], feed)[0]
        assert used == 2.0 ** 10
        assert sess.run(gs) == 0
        assert sess.run(manager.get_loss_scale()) == 2.0 ** 9
    with tf.Graph().as_default():
        fixed = npu_managers.FixedLossScaleManager(loss_scale=1, enable_overflow_check=False)
        model = two_group_gan()
        scaler = nl.MultiOptimizerLossScale(fixed, backend="npu")
        scaler.add(model.d_loss, tf.train.AdamOptimizer(0.01), var_list=model.d_vars)
        scaler.build()
        assert _emulation().count_status_reads(tf.get_default_graph()) == 0  # check disabled


# -- the one clear: ordered before everything a read follows --------------------------

def _ordered_step(loss, var_list, learning_rate):
    """A one-group step on the register whose one read follows the clear
    in everything it depends on (as built)."""
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="npu")
    scaler.add(loss, tf.train.GradientDescentOptimizer(learning_rate), var_list=var_list)
    train = scaler.build()
    [read] = [op for op in op_ancestors(train.update_op)
              if _emulation().shim_op_type(op) in _emulation().READ_OP_TYPES]
    assert ops_not_after(read, train.clear_status) == []
    return train


def test_ops_not_after_sees_an_unordered_read(graph, npu_shim, saturation_mode):
    """The check the tests rely on is not vacuous: a read built without
    ``order_after_clear`` has forward ops the clear need not precede (as
    npu_bridge's reads do, tf_adapter
    npu_bridge/estimator/npu/npu_loss_scale_optimizer.py); ordering empties
    the list."""
    from npu_bridge.helper import helper
    x, weights, losses = _n_group_model(1)
    grads = tf.gradients(losses[0], weights)
    backend = backends.NpuFloatStatusBackend(helper.get_gen_ops())
    clear = backend.clear_status()
    with tf.control_dependencies(grads):
        read = helper.get_gen_ops().npu_get_float_status_v2()
    unordered = ops_not_after(read.op, clear)
    assert any(name.startswith("MatMul") for name in unordered), unordered
    backends.order_after_clear(clear, grads)
    assert ops_not_after(read.op, clear) == []


@pytest.mark.parametrize("op_set", ["v1", "v2"])
def test_the_clear_precedes_loops_conds_and_fed_defaults(graph, npu_shim, saturation_mode,
                                                          op_set):
    """Forward passes through a while loop and a cond (v1 Enter/Switch under
    NPU_LOSSSCALE_GRAPH_MODE=v1, functional While/If otherwise) and a fed
    placeholder_with_default: the clear precedes all of it, and the step
    still runs, applies and skips."""
    _emulation().set_op_set(op_set)
    x = tf.placeholder(tf.float32, [4, 3])
    gain = tf.placeholder_with_default(tf.constant(1.0), [])
    w = tf.get_variable("w", [3, 3], initializer=tf.constant_initializer(0.5))
    h = tf.cast(x, tf.float16) * tf.cast(gain, tf.float16)
    _, h = tf.while_loop(lambda i, h: i < 3,
                         lambda i, h: (i + 1, tf.tanh(tf.matmul(h, tf.cast(w, tf.float16)))),
                         [tf.constant(0), h])
    h = tf.cond(tf.reduce_sum(x) > 0, lambda: h * 2.0, lambda: h)
    loss = tf.reduce_mean(tf.cast(h, tf.float32) * tf.cast(gain, tf.float32))
    train = _ordered_step(loss, [w], 0.1)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        start = sess.run(w)
        assert sess.run([train.update_op, train.is_finite], {x: np.ones([4, 3])})[1]
        moved = sess.run(w)
        assert not np.array_equal(start, moved)
        # 1e6 * x overflows float16 in the first multiply: saturated, skipped.
        assert not sess.run([train.update_op, train.is_finite],
                            {x: np.ones([4, 3]), gain: 1e6})[1]
        assert np.array_equal(sess.run(w), moved)


class _UpdateFails(nl.FixedLossScaleManager):
    """A manager whose update fails once the step's check exists."""

    fail = True

    def update_loss_scale(self, finite):
        if self.fail:
            raise RuntimeError("update failed")
        return super(_UpdateFails, self).update_loss_scale(finite)


def test_a_failed_build_takes_the_clear_off_the_forward_ops(graph, npu_shim, saturation_mode):
    model = two_group_gan(compute_dtype=tf.float16)
    manager = _UpdateFails(8.0)
    scaler = nl.MultiOptimizerLossScale(manager, backend="npu")
    add_gan_groups(scaler, model)
    with pytest.raises(RuntimeError, match="update failed"):
        scaler.build()
    clear = graph.get_operation_by_name("loss_scale/clear_status")
    assert [op.name for op in graph.get_operations() if clear in op.control_inputs] == []
    manager.fail = False
    train = scaler.build()
    assert train.clear_status is clear
    assert [op for op in graph.get_operations() if clear in op.control_inputs]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.is_finite], model.feed)[1]


def test_the_register_record_dies_with_its_graph(npu_shim, saturation_mode):
    """An Estimator builds a graph per train/eval cycle: the record of the
    readers and the clear must not keep old graphs alive."""
    import gc
    import weakref
    refs = []
    for _ in range(3):
        graph = tf.Graph()
        with graph.as_default():
            x, weights, losses = _n_group_model(1)
            scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="npu")
            scaler.add(losses[0], tf.train.GradientDescentOptimizer(0.1), var_list=weights)
            scaler.build()
        refs.append(weakref.ref(graph))
        del graph, x, weights, losses, scaler
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]


def test_a_float_status_step_inside_a_function_or_loop_body_is_refused(graph, npu_shim,
                                                                       saturation_mode):
    """The clear must come before every op a read follows, which needs the
    read at the top level: inside a tf.cond branch (a function graph under
    control flow v2, a v1 cond context otherwise) every reader says so at
    build time, before making an op."""
    x, weights, losses = _n_group_model(1)
    grads = tf.gradients(losses[0], weights)
    pred = tf.placeholder_with_default(True, [])

    def inside(build):
        captured = {}

        def branch():
            before = len(tf.get_default_graph().get_operations())
            with pytest.raises(ValueError, match="top level of the graph.*tf.cond, tf.while_loop and tf.function"):
                build()
            captured["made"] = len(tf.get_default_graph().get_operations()) - before
            return tf.constant(True)

        tf.cond(pred, branch, lambda: tf.constant(True))
        assert captured["made"] == 0

    inside(lambda: nl.all_finite(grads, backend="npu"))
    opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(0.1),
                                nl.FixedLossScaleManager(8.0), backend="npu")
    inside(lambda: opt.apply_gradients(zip(grads, weights)))
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="npu")
    scaler.add(losses[0], tf.train.GradientDescentOptimizer(0.1), var_list=weights)
    inside(scaler.build)
    # The same at the top level builds and runs.
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.is_finite], {x: np.ones([4, 3])})[1]


@pytest.mark.parametrize("op_set", ["v1", "v2"])
def test_grappler_cannot_move_a_cast_of_a_reshaped_input_before_the_clear(
        graph, npu_shim, saturation_mode, op_set):
    """Grappler's arithmetic optimizer moves a cast above a chain of
    value-preserving ops (tensorflow core/grappler/op_types.cc,
    IsValuePreserving): Reshape then Transpose of a placeholder, and a ref
    variable's read under v1 behaviour. As run (partition graphs, after
    grappler), the clear still precedes every op the read follows."""
    from conftest import partition_nodes_not_after
    _emulation().set_op_set(op_set)
    x = tf.placeholder(tf.float32, [4])
    w = tf.get_variable("w", [2, 2], initializer=tf.constant_initializer(0.5))
    xc = tf.cast(tf.transpose(tf.reshape(x, [2, 2])), tf.float16)
    wc = tf.cast(tf.reshape(w, [2, 2]), tf.float16)
    loss = tf.reduce_sum(tf.cast(tf.matmul(xc, wc), tf.float32))
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="npu")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.01), var_list=[w])
    train = scaler.build()
    clears = [op.name for op in graph.get_operations()
              if _emulation().shim_op_type(op) in _emulation().CLEAR_OP_TYPES]
    reads = set(op.name for op in graph.get_operations()
                if _emulation().shim_op_type(op) in _emulation().READ_OP_TYPES)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        metadata = tf.RunMetadata()
        sess.run(train.update_op, {x: np.ones([4])},
                 options=tf.RunOptions(output_partition_graphs=True), run_metadata=metadata)
    # The register write itself (the v1 stand-in's output Identity is
    # pruned by grappler; its write is named under it).
    write = clears[0] if op_set == "v2" else clears[0] + "/register_clear"
    def is_read(name):  # the read, or the v1 stand-in's nodes under its name
        return any(name == read or name.startswith(read + "/") for read in reads)

    assert partition_nodes_not_after(metadata, write, is_read) == []


@pytest.mark.parametrize("nested", [False, True])
def test_a_placeholder_with_default_inside_a_v1_loop_body_runs(graph, npu_shim, saturation_mode,
                                                               nested):
    """Ops inside a v1 while loop's frame get no edge from the clear (an
    edge from outside into the frame is invalid), nor do the Enter ops of a
    loop nested in another; the outermost loop's Enter ops do, and every op
    of the loops follows them."""
    x = tf.placeholder(tf.float32, [2, 2])
    w = tf.get_variable("w", [2, 2], initializer=tf.constant_initializer(0.5))

    def body(i, h):
        gain = tf.placeholder_with_default(tf.constant(1.0, tf.float16), [])
        h = tf.matmul(h, tf.cast(w, tf.float16))
        if nested:  # the inner loop reads the outer body's placeholder
            _, h = tf.while_loop(lambda j, g: j < 2, lambda j, g: (j + 1, g * gain),
                                 [tf.constant(0), h])
            return i + 1, h
        return i + 1, h * gain

    _, h = tf.while_loop(lambda i, h: i < 2, body, [tf.constant(0), tf.cast(x, tf.float16)])
    loss = tf.reduce_sum(tf.cast(h, tf.float32))
    train = _ordered_step(loss, [w], 0.01)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.is_finite], {x: np.ones([2, 2])})[1]
        assert not sess.run([train.update_op, train.is_finite],
                            {x: np.full([2, 2], 3e4)})[1]


def test_long_value_preserving_chains_are_walked_without_recursion(graph, npu_shim,
                                                                saturation_mode):
    """A chain of identities deeper than the recursion limit (a recursive
    walk would fail) and 20 Prints that read their input twice (a million
    visits without a memo) order and build, without recursion. The limit is
    lowered to 300 while the step builds, so a 600-op chain is enough."""
    x = tf.placeholder(tf.float32, [2, 2])
    t = x
    for _ in range(600):
        t = tf.identity(t)
    for _ in range(20):
        t = tf.Print(t, [t])
    w = tf.get_variable("w", [2, 2], initializer=tf.constant_initializer(0.5))
    loss = tf.reduce_sum(tf.cast(tf.matmul(tf.cast(t, tf.float16), tf.cast(w, tf.float16)),
                                 tf.float32))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(300)
    try:
        train = _ordered_step(loss, [w], 0.01)
    finally:
        sys.setrecursionlimit(limit)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.is_finite], {x: np.ones([2, 2])})[1]


def test_a_data_pipelines_get_next_takes_no_edge_from_the_clear(graph, saturation_mode):
    """tf.data input on the register. The get-next op is a graph input (with
    Ascend's data offload tf_adapter moves it onto the device as AdpGetNext,
    optimizers/om_partition_subgraphs_pass.cc, feeding the loop from its own
    queue; an edge from the clear would tie prefetching to the step): it
    gets no edge, its consumers do. The audit finds no race, and an
    overflow in the batch still skips the step."""
    data = np.random.RandomState(0).normal(size=[32, 4]).astype(np.float16)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(8).repeat()
    batch = tf.data.make_one_shot_iterator(dataset).get_next()
    poison = tf.placeholder_with_default(tf.constant(1.0, tf.float16), [], name="poison")
    w = tf.get_variable("w", [4, 1], initializer=tf.constant_initializer(0.1))
    loss = tf.reduce_mean(tf.square(tf.cast(
        tf.matmul(batch * poison, tf.cast(w, tf.float16)), tf.float32)))
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="npu")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net")
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs)
    [get_next] = [op for op in graph.get_operations() if op.type == "IteratorGetNext"]
    assert train.clear_status not in get_next.control_inputs
    consumers = [op for out in get_next.outputs for op in out.consumers()]
    assert consumers and all(train.clear_status in op.control_inputs for op in consumers)
    assert [f.code for f in nl.audit(graph, fetches=[train.update_op])
            if f.severity == "error"] == []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        trained = sess.run(w)
        assert sess.run(gs) == 1 and not np.array_equal(trained, np.full([4, 1], 0.1))
        assert not sess.run([train.update_op, train.is_finite], {poison: np.inf})[1]
        assert sess.run(gs) == 1 and np.array_equal(sess.run(w), trained)


def _finite(train):
    """Each group's decision of the run, by group name."""
    return dict((name, group.is_finite) for name, group in train.groups.items())
