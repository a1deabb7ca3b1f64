"""In-graph towers (distributed/towers.py): ``add([loss_tower0, loss_tower1],
...)`` on two CPU devices.

Each tower's backprop runs on its device, the towers' gradients are
averaged, and one decision applies every group or none. References: an
unscaled float32 twin of the same model on the whole batch (TF's own
``tf.gradients``, optimizers and ``tf.clip_by_global_norm``), the placement
in the graph and in the run's step stats, and bit-for-bit snapshots.
"""

import collections

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import diagnostics
from conftest import LAST_SKIP, SKIPPED_STEPS, fresh_process, raises_with, snapshot_globals
from graph_walk import gated_ops, is_collective
from readme_blocks import run_example
from skip_faults import HUGE, poisoned_gradient

#: Two CPU devices, one per tower.
CONFIG = tf.ConfigProto(device_count={"CPU": 2})
DEVICES = ("/cpu:0", "/cpu:1")
BATCH, DIM = 8, 4
SCALE = 2.0 ** 10  # a power of two: scaling and unscaling are exact
LEARNING_RATE = 0.1
_RNG = np.random.RandomState(5)
#: The model's weights, by name, and its whole batch.
INIT = collections.OrderedDict([
    ("generator/w", _RNG.normal(0, 0.5, [DIM, DIM])),
    ("generator/b", _RNG.normal(0, 0.5, [DIM])),
    ("discriminator/w", _RNG.normal(0, 0.5, [DIM, 1])),
    ("discriminator/b", _RNG.normal(0, 0.5, [1])),
])
X = _RNG.normal(0, 1, [BATCH, DIM]).astype(np.float32)
GROUP_VARS = {"d": ["discriminator/w", "discriminator/b"],
              "g": ["generator/w", "generator/b"]}
#: Tolerances against the float32 twin: float32 towers differ only in the
#: order of the sums; float16 towers by a few roundings of 2**-11 (4.9e-4).
TOLERANCE = {tf.float32: dict(rtol=1e-5, atol=1e-7), tf.float16: dict(rtol=4e-3, atol=5e-4)}

Towers = collections.namedtuple("Towers", ["x", "factors", "losses", "variables"])


def _variables():
    """The model's float32 variables, by name (one set per graph)."""
    found = collections.OrderedDict()
    for name, value in INIT.items():
        scope, short = name.split("/")
        with tf.variable_scope(scope, reuse=tf.AUTO_REUSE):
            found[name] = tf.get_variable(short, initializer=value.astype(np.float32))
    return found


def _gan_losses(x, variables, dtype, factor=None):
    """A GAN's two losses on the batch ``x``, computed in ``dtype``, each
    reading both networks; ``factor`` multiplies the gradient of the
    discriminator's weight (``poisoned_gradient``). Float32 scalars."""
    def cast(name):
        return tf.cast(variables[name], dtype)

    d_w = cast("discriminator/w")
    if factor is not None:
        d_w = poisoned_gradient(d_w, factor)
    x = tf.cast(x, dtype)
    fake = tf.tanh(tf.matmul(x, cast("generator/w")) + cast("generator/b"))
    d_real = tf.matmul(x, d_w) + cast("discriminator/b")
    d_fake = tf.matmul(fake, d_w) + cast("discriminator/b")
    d_loss = tf.reduce_mean(tf.nn.softplus(-d_real)) + tf.reduce_mean(tf.nn.softplus(d_fake))
    g_loss = tf.reduce_mean(tf.nn.softplus(-d_fake))
    return tf.cast(d_loss, tf.float32), tf.cast(g_loss, tf.float32)


def tower_model(dtype=tf.float16, rows=BATCH):
    """The GAN in two towers, tower i on ``DEVICES[i]`` with the i-th half of
    the batch ``x`` (``rows`` rows); ``factors[i]`` poisons tower i's
    discriminator gradient (1.0 unless fed)."""
    x = tf.placeholder(tf.float32, [rows, DIM], name="x")
    with tf.device(DEVICES[0]):
        variables = _variables()
    share = rows // len(DEVICES)
    factors, losses = [], {"d": [], "g": []}
    for index, device in enumerate(DEVICES):
        with tf.device(device), tf.name_scope("tower%d" % index):
            factor = tf.placeholder_with_default(tf.constant(1.0), [], name="factor")
            d_loss, g_loss = _gan_losses(x[index * share:(index + 1) * share], variables,
                                         dtype, factor)
        factors.append(factor)
        losses["d"].append(d_loss)
        losses["g"].append(g_loss)
    return Towers(x, factors, losses, variables)


def add_towers(scaler, model, make_optimizer=lambda: tf.train.GradientDescentOptimizer(
        LEARNING_RATE), **d_options):
    """Registers the towers' groups "d" (with ``d_options``) and "g"."""
    for name in ("d", "g"):
        scaler.add(model.losses[name], make_optimizer(),
                   var_list=[model.variables[v] for v in GROUP_VARS[name]], name=name,
                   **(d_options if name == "d" else {}))
    return scaler


def _scaler(manager=None, **kwargs):
    return nl.MultiOptimizerLossScale(manager or nl.DynamicLossScaleManager(initial_scale=SCALE),
                                      backend="is_finite", **kwargs)


Reference = collections.namedtuple("Reference", ["grads", "after"])


def reference(batch=X, make_optimizer=None, clip_norm=None, groups=("d", "g")):
    """The float32 twin on the whole ``batch``, unscaled, in its own graph:
    each group's gradients (by group, in ``GROUP_VARS`` order) and every
    weight after one step of ``make_optimizer()`` per group in ``groups``
    (SGD by default), clipped by ``clip_norm`` for "d"."""
    make_optimizer = make_optimizer or (lambda: tf.train.GradientDescentOptimizer(LEARNING_RATE))
    with tf.Graph().as_default():
        variables = _variables()
        d_loss, g_loss = _gan_losses(tf.constant(batch), variables, tf.float32)
        grads = {}
        for name, loss in (("d", d_loss), ("g", g_loss)):
            grads[name] = tf.gradients(loss, [variables[v] for v in GROUP_VARS[name]])
        if clip_norm is not None:
            grads["d"], _ = tf.clip_by_global_norm(grads["d"], clip_norm)
        with tf.control_dependencies([g for name in grads for g in grads[name]]):
            step = tf.group(*[make_optimizer().apply_gradients(
                zip(grads[name], [variables[v] for v in GROUP_VARS[name]])) for name in groups])
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            values = sess.run(grads)
            sess.run(step)
            return Reference(values, dict(zip(variables, sess.run(list(variables.values())))))


def _weights(sess, model):
    return dict(zip(model.variables, sess.run(list(model.variables.values()))))


def _assert_close(got, want, dtype):
    for name in want:
        np.testing.assert_allclose(got[name], want[name], err_msg=name, **TOLERANCE[dtype])


def _fetched_grads(values):
    return {name: [grad for grad, _ in pairs] for name, pairs in values.items()}


# -- placement --

class _OwnGradients(tf.train.GradientDescentOptimizer):
    """An optimizer with its own ``compute_gradients`` (as Horovod's and
    NPU's wrappers have), which the step calls instead of tf.gradients."""

    def compute_gradients(self, loss, var_list=None, **kwargs):
        return super(_OwnGradients, self).compute_gradients(loss, var_list=var_list, **kwargs)


def _tower_gradient_ops(graph, index):
    return [op for op in graph.get_operations()
            if "/gradients/tower%d/" % index in op.name and op.type != "NoOp"]


@pytest.mark.parametrize("optimizer", [tf.train.GradientDescentOptimizer, _OwnGradients])
def test_each_towers_backprop_is_built_and_run_on_its_device(graph, optimizer):
    """Every gradient op of tower i is placed on tower i's device, in the
    graph and in the run's step stats: also for an optimizer whose own
    compute_gradients the step cannot ask to colocate."""
    model = tower_model()
    train = add_towers(_scaler(), model, lambda: optimizer(LEARNING_RATE)).build()
    for index, device in enumerate(DEVICES):
        ops = _tower_gradient_ops(graph, index)
        assert len(ops) > 20, [op.name for op in ops]
        assert [op.name for op in ops if not op.device.lower().endswith(device[-5:])] == []
    metadata = tf.RunMetadata()
    with tf.Session(config=CONFIG) as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, {model.x: X},
                 options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
                 run_metadata=metadata)
    ran = collections.defaultdict(set)  # tower index -> the devices its gradients ran on
    for stats in metadata.step_stats.dev_stats:
        for node in stats.node_stats:
            for index in range(len(DEVICES)):
                if "/gradients/tower%d/" % index in node.node_name:
                    ran[index].add(stats.device.lower().rsplit("/", 1)[-1])
    assert dict(ran) == {0: {"device:cpu:0"}, 1: {"device:cpu:1"}}


# -- the numbers --

@pytest.mark.parametrize("dtype", [tf.float32, tf.float16], ids=["float32", "float16"])
def test_applied_gradients_equal_one_model_on_the_whole_batch(graph, dtype):
    """Each tower computes on half the batch; the applied (unscaled, averaged)
    gradients and the weights after one SGD step equal the float32 twin's
    on the whole batch, for both groups."""
    model = tower_model(dtype)
    train = add_towers(_scaler(), model).build(global_step=tf.train.get_or_create_global_step())
    want = reference()
    with tf.Session(config=CONFIG) as sess:
        sess.run(tf.global_variables_initializer())
        _, grads, applied = sess.run([train.update_op, train.grads_and_vars, train.applied],
                                     {model.x: X})
        after = _weights(sess, model)
    assert applied
    got = _fetched_grads(grads)
    for name in ("d", "g"):
        for index, var in enumerate(GROUP_VARS[name]):
            np.testing.assert_allclose(got[name][index], want.grads[name][index], err_msg=var,
                                       **TOLERANCE[dtype])
    _assert_close(after, want.after, dtype)


def test_a_variable_one_tower_alone_reads_gets_the_mean_losss_gradient(graph):
    """A weight that only tower 1's loss reads gets half of tower 1's
    gradient (tower 0 counts as zero), as the towers' mean loss does; the
    other weights keep theirs."""
    x = tf.placeholder(tf.float32, [BATCH, DIM])
    w = tf.get_variable("w", initializer=INIT["generator/w"].astype(np.float32))
    gain = tf.get_variable("gain", initializer=np.full([DIM], 1.5, np.float32))
    losses = []
    for index, device in enumerate(DEVICES):
        with tf.device(device):
            h = tf.matmul(tf.cast(x[index * 4:(index + 1) * 4], tf.float16), tf.cast(w, tf.float16))
            if index == 1:
                h = h * tf.cast(gain, tf.float16)
            losses.append(tf.cast(tf.reduce_mean(tf.square(h)), tf.float32))
    want = tf.gradients(tf.add_n(losses) / 2.0, [w, gain])
    scaler = _scaler()
    scaler.add(losses, tf.train.GradientDescentOptimizer(0.1), var_list=[w, gain], name="net")
    train = scaler.build()
    assert [var.op.name for _, var in train.grads_and_vars["net"]] == ["w", "gain"]
    with tf.Session(config=CONFIG) as sess:
        sess.run(tf.global_variables_initializer())
        grads, want = sess.run([train.grads_and_vars["net"], want], {x: X})
    for (got, _), expected in zip(grads, want):
        np.testing.assert_allclose(got, expected, **TOLERANCE[tf.float16])


def test_sparse_tower_gradients_are_averaged(graph):
    """An embedding read with tf.gather in each tower gives IndexedSlices;
    their mean over the towers equals the whole batch's gradient. (A
    resource gather's gradient is colocated with the gather, which TF
    colocates with the variable: soft placement resolves it, as without
    the builder.)"""
    table = np.linspace(-1.0, 1.0, 24).reshape(6, 4).astype(np.float32)
    ids = np.array([0, 2, 2, 5, 1, 2, 4, 4])

    def loss_of(embedding, rows):
        picked = tf.gather(embedding, rows)
        return tf.cast(tf.reduce_mean(tf.square(tf.cast(picked, tf.float16) - 0.5)), tf.float32)

    embedding = tf.get_variable("embedding", initializer=table, use_resource=True)
    losses = []
    for index, device in enumerate(DEVICES):
        with tf.device(device):
            losses.append(loss_of(embedding, ids[index * 4:(index + 1) * 4]))
    scaler = _scaler()
    scaler.add(losses, tf.train.GradientDescentOptimizer(1.0), var_list=[embedding], name="emb")
    train = scaler.build()
    with tf.Graph().as_default():
        twin = tf.get_variable("embedding", initializer=table, use_resource=True)
        whole = tf.convert_to_tensor(tf.gradients(loss_of(twin, ids), [twin])[0])
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            want = table - sess.run(whole)
    assert isinstance(train.grads_and_vars["emb"][0][0], tf.IndexedSlices)
    config = tf.ConfigProto(device_count={"CPU": 2}, allow_soft_placement=True)
    with tf.Session(config=config) as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        np.testing.assert_allclose(sess.run(embedding), want, **TOLERANCE[tf.float16])


# -- one decision --

def test_an_overflow_in_one_tower_skips_the_step_for_both(graph):
    """A float16 overflow in tower 1's discriminator gradient only: no weight,
    Adam slot or global step changes, bit for bit; skip_reason,
    groups_overflowed and last_skip name group "d" and its weight; the next
    clean step applies."""
    model = tower_model()
    global_step = tf.train.get_or_create_global_step()
    manager = nl.DynamicLossScaleManager(initial_scale=SCALE)
    train = add_towers(_scaler(manager), model, lambda: tf.train.AdamOptimizer(0.01)).build(
        global_step=global_step)
    fetches = [train.update_op, train.is_finite, train.diagnosis.skip_reason, train.diagnosis.groups_overflowed]
    ours = [SKIPPED_STEPS, LAST_SKIP] + [v.op.name for v in manager.variables]
    with tf.Session(config=CONFIG) as sess:
        sess.run(tf.global_variables_initializer())
        before = snapshot_globals(sess, exclude=ours)
        _, finite, reason, overflowed = sess.run(fetches, {model.x: X, model.factors[1]: HUGE})
        after = snapshot_globals(sess, exclude=ours)
        assert (finite, reason, overflowed) == (False, diagnostics.GRADIENTS_OVERFLOWED,
                                                {"d": True, "g": False})
        assert sorted(before) == sorted(after) and len(before) >= 13  # 4 weights, 8 slots, step
        for name in before:
            assert before[name].tobytes() == after[name].tobytes(), name
        assert diagnostics.read_last_skip(sess, train) == diagnostics.Skip(
            1, 0, "gradients_overflowed", ("d",), ("discriminator/w",))
        assert sess.run(train.loss_scale) == SCALE / 2
        _, finite, reason = sess.run(fetches[:3], {model.x: X})
        assert (finite, reason, sess.run(global_step)) == (True, diagnostics.APPLIED, 1)


@pytest.mark.parametrize("gate", ["pivot", "cond"])
def test_no_collective_and_nothing_but_the_gate_inside_a_cond(graph, gate):
    """The towers' backprops, their means and the mean losses sit at the top
    level of the graph: outside the gate, outside every cond context and
    every function body; and the graph holds no collective op."""
    model = tower_model()
    add_towers(_scaler(gate=gate), model).build()
    towers = [op for op in graph.get_operations()
              if "/gradients/tower" in op.name or "tower_mean" in op.name
              or "tower_loss" in op.name]
    assert len(towers) > 50 and any("tower_mean" in op.name for op in towers)
    inside = gated_ops(graph)
    assert [op.name for op in towers if op in inside] == []
    assert [op.name for op in towers
            if op._get_control_flow_context() is not None] == []  # pylint: disable=protected-access
    library = graph.as_graph_def().library.function
    assert [node.name for function in library for node in function.node_def
            if "gradients" in node.name or "tower" in node.name] == []
    assert [op.name for op in graph.get_operations() if is_collective(op.type, op.name)] == []
    assert [node.name for function in library for node in function.node_def
            if is_collective(node.op, node.name)] == []


# -- with the builder's options --

def test_per_group_ops_apply_the_towers_mean_of_their_group(graph):
    """per_group["d"] applies d's tower mean and leaves g alone; an overflow
    in tower 1 skips it whole; per_group["g"] then applies g's."""
    model = tower_model()
    train = add_towers(_scaler(), model).build(per_group_ops=True)
    want_d = reference(groups=("d",)).after
    with tf.Session(config=CONFIG) as sess:
        sess.run(tf.global_variables_initializer())
        start = _weights(sess, model)
        sess.run(train.per_group["d"], {model.x: X, model.factors[1]: HUGE})
        assert all(np.array_equal(v, start[k]) for k, v in _weights(sess, model).items())
        sess.run(train.per_group["d"], {model.x: X})
        after_d = _weights(sess, model)
        _assert_close(after_d, want_d, tf.float16)
        for name in GROUP_VARS["g"]:
            assert np.array_equal(after_d[name], start[name])
        sess.run(train.per_group["g"], {model.x: X})
        after_g = _weights(sess, model)
    for name in GROUP_VARS["d"]:
        assert np.array_equal(after_g[name], after_d[name])
    assert not any(np.array_equal(after_g[name], start[name]) for name in GROUP_VARS["g"])


def test_accumulation_averages_micro_batches_and_towers(graph):
    """Two micro-batches of 4 rows, each cut in two towers of 2: the window
    applies once, the mean over all four quarters, which is the whole
    batch's gradient; the first run applies nothing."""
    model = tower_model(rows=BATCH // 2)
    train = add_towers(_scaler(), model).build(accumulation_steps=2)
    want = reference()
    with tf.Session(config=CONFIG) as sess:
        sess.run(tf.global_variables_initializer())
        start = _weights(sess, model)
        assert not sess.run([train.update_op, train.applied], {model.x: X[:4]})[1]
        assert all(np.array_equal(v, start[k]) for k, v in _weights(sess, model).items())
        assert sess.run([train.update_op, train.applied], {model.x: X[4:]})[1]
        _assert_close(_weights(sess, model), want.after, tf.float16)


def test_clip_norm_clips_the_towers_mean(graph):
    """clip_norm clips d's averaged gradient by its global norm, as
    tf.clip_by_global_norm clips the whole batch's."""
    model = tower_model()
    clip = 0.05
    want = reference(clip_norm=clip)
    assert np.sqrt(sum(np.sum(np.square(g)) for g in reference().grads["d"])) > 2 * clip
    train = add_towers(_scaler(), model, clip_norm=clip).build()
    with tf.Session(config=CONFIG) as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, {model.x: X})
        _assert_close(_weights(sess, model), want.after, tf.float16)


@fresh_process
def test_the_docs_example_prints_what_the_docs_show(tmp_path):
    """docs/features.md's example, run as written."""
    stdout, shown = run_example("towers-example", tmp_path)
    assert shown and stdout == shown


# -- refusals --

def _two_losses():
    x = tf.placeholder(tf.float32, [BATCH, DIM])
    w = tf.get_variable("w", [DIM, 1])
    return [tf.reduce_mean(tf.matmul(x[i * 4:(i + 1) * 4], w)) for i in range(2)], w


@pytest.mark.parametrize("what, error, fragments", [
    ("empty", ValueError, ["empty list", "[]", "one loss per tower"]),
    ("twice", ValueError, ["listed twice", "once"]),
    ("dtypes", ValueError, ["dtypes", "float16", "float32", "alike"]),
    ("not a tensor", TypeError, ["3.0"]),
])
def test_bad_tower_lists_are_refused_by_add(graph, what, error, fragments):
    (loss0, loss1), w = _two_losses()
    losses = {"empty": [], "twice": [loss0, loss0],
              "dtypes": [loss0, tf.cast(loss1, tf.float16)], "not a tensor": [loss0, 3.0]}[what]
    scaler = _scaler()
    before = len(graph.get_operations())
    with raises_with(error, *fragments):
        scaler.add(losses, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net")
    assert len(graph.get_operations()) == before


@pytest.mark.parametrize("where", ["towers", "beside"])
def test_towers_with_a_sync_replicas_group_are_refused(graph, where):
    """A SyncReplicasOptimizer's chief aggregates one loss's pushes per
    group: tower losses on its group, or beside it, are refused."""
    (loss0, loss1), w = _two_losses()
    v = tf.get_variable("v", [DIM, 1])
    sync = nl.SyncReplicasOptimizer(tf.train.GradientDescentOptimizer(0.1), 2, 2)
    scaler = _scaler()
    if where == "towers":
        scaler.add([loss0, loss1], sync, var_list=[w], name="net")
    else:
        scaler.add([loss0, loss1], tf.train.GradientDescentOptimizer(0.1), var_list=[w],
                   name="net")
        scaler.add(tf.reduce_sum(v), sync, var_list=[v], name="other")
    with raises_with(ValueError, "tower losses", "SyncReplicasOptimizer", "one loss per group"):
        scaler.build(global_step=tf.train.get_or_create_global_step(), count_skipped_steps=True)


def test_a_refused_build_with_towers_makes_no_op(graph):
    (loss0, loss1), w = _two_losses()
    scaler = _scaler()
    scaler.add([loss0, loss1], tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net")
    before = len(graph.get_operations())
    with raises_with(TypeError, "count_skipped_steps"):
        scaler.build(count_skipped_steps=1)
    with raises_with(ValueError, "accumulation_steps"):
        scaler.build(accumulation_steps=0)
    with raises_with(ValueError, "first_scale_margin"):
        scaler.build(measure_first_scale=True, first_scale_margin=-1)
    assert len(graph.get_operations()) == before
