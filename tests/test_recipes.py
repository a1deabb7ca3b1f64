"""The porting recipes of docs/porting.md, as real scripts use them (issue 24).

* a WGAN-GP critic loop (the gradient penalty is a loss holding
  ``tf.gradients``, so its backprop is a second-order gradient; n_critic
  discriminator runs per generator run) through ``per_group_ops``, against an
  unscaled float32 twin with the same weights and data, and with an overflow
  injected into one critic run;
* which ``TrainOps`` tensors a per-group run may fetch;
* the ``UPDATE_OPS`` recipe that catches every call of a network;
* the float16 recipe block of docs/porting.md, executed as written.

Runs under both graph modes (NPU_LOSSSCALE_GRAPH_MODE=v1 / v2).
"""

import collections
import os
import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import REPO, SKIPPED_STEPS, snapshot_globals
from readme_blocks import block

# -- WGAN-GP --------------------------------------------------------------------

BATCH, DIM, Z_DIM, HIDDEN = 8, 4, 3, 6
N_CRITIC, ITERATIONS = 3, 3
LAMBDA = 10.0
#: Multiplies the gradient penalty in the poisoned critic run: the scaled
#: loss (penalty * 1e38 * scale) is inf in float32 and float16 alike.
POISON = 1e38

WganGp = collections.namedtuple(
    "WganGp", ["real", "z", "eps", "poison", "d_loss", "g_loss", "penalty", "d_vars",
               "g_vars"])


def _initial_values():
    rng = np.random.RandomState(7)
    shapes = collections.OrderedDict([
        ("generator/w1", [Z_DIM, HIDDEN]), ("generator/b1", [HIDDEN]),
        ("generator/w2", [HIDDEN, DIM]),
        ("critic/w1", [DIM, HIDDEN]), ("critic/b1", [HIDDEN]), ("critic/w2", [HIDDEN, 1])])
    return collections.OrderedDict((name, rng.normal(0, 0.5, shape).astype(np.float32))
                                   for name, shape in shapes.items())


def wgan_gp(compute_dtype):
    """A WGAN-GP in the default graph: float32 variables (the same initial
    values every time), cast to ``compute_dtype`` where used.

    The critic's loss holds the gradient penalty of Gulrajani et al.:
    ``LAMBDA * mean((|| d critic(x_hat) / d x_hat || - 1)^2)`` at random
    interpolates ``x_hat`` of real and fake samples, computed with
    ``tf.gradients`` inside the loss.
    """
    values = _initial_values()
    variables = collections.OrderedDict(
        (name, tf.get_variable(name, initializer=tf.constant(value)))
        for name, value in values.items())
    real = tf.placeholder(tf.float32, [BATCH, DIM], name="real")
    z = tf.placeholder(tf.float32, [BATCH, Z_DIM], name="z")
    eps = tf.placeholder(tf.float32, [BATCH, 1], name="eps")
    poison = tf.placeholder_with_default(tf.constant(1.0), [], name="poison")

    def use(name):  # the float32 master weight, cast at use
        return tf.cast(variables[name], compute_dtype)

    def generator(noise):
        h = tf.tanh(tf.matmul(tf.cast(noise, compute_dtype), use("generator/w1"))
                    + use("generator/b1"))
        return tf.matmul(h, use("generator/w2"))

    def critic(x):
        h = tf.tanh(tf.matmul(x, use("critic/w1")) + use("critic/b1"))
        return tf.cast(tf.matmul(h, use("critic/w2")), tf.float32)  # float32 scores

    fake = generator(z)
    real_c = tf.cast(real, compute_dtype)
    eps_c = tf.cast(eps, compute_dtype)
    x_hat = eps_c * real_c + (1 - eps_c) * fake
    slopes_in = tf.gradients(critic(x_hat), x_hat)[0]
    slopes = tf.sqrt(tf.reduce_sum(tf.square(tf.cast(slopes_in, tf.float32)), axis=1))
    penalty = tf.reduce_mean(tf.square(slopes - 1.0))
    d_fake = critic(fake)
    d_loss = (tf.reduce_mean(d_fake) - tf.reduce_mean(critic(real_c))
              + LAMBDA * penalty * poison)
    g_loss = -tf.reduce_mean(d_fake)
    names = list(variables)
    return WganGp(real, z, eps, poison, d_loss, g_loss, penalty,
                  [variables[n] for n in names if n.startswith("critic/")],
                  [variables[n] for n in names if n.startswith("generator/")])


def _feeds():
    """The data of every run: (group, real, z, eps), N_CRITIC critic runs
    and one generator run per iteration."""
    rng = np.random.RandomState(3)
    runs = []
    for _ in range(ITERATIONS):
        for group in ["d"] * N_CRITIC + ["g"]:
            runs.append((group, rng.normal(0, 1, [BATCH, DIM]).astype(np.float32),
                         rng.uniform(-1, 1, [BATCH, Z_DIM]).astype(np.float32),
                         rng.uniform(0, 1, [BATCH, 1]).astype(np.float32)))
    return runs


def _adam():
    return tf.train.AdamOptimizer(1e-3, beta1=0.5, beta2=0.9)  # WGAN-GP's settings


def _weights(sess, model):
    return dict((v.op.name, sess.run(v)) for v in model.d_vars + model.g_vars)


def _run_twin():
    """The unscaled float32 reference: two plain Adams, one run per group.

    Returns:
      (final weights by name, the penalty of each run, the critic's
      gradients before each critic run).
    """
    with tf.Graph().as_default():
        model = wgan_gp(tf.float32)
        d_grads = tf.gradients(model.d_loss, model.d_vars)
        ops = {"d": _adam().apply_gradients(zip(d_grads, model.d_vars)),
               "g": _adam().minimize(model.g_loss, var_list=model.g_vars)}
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            penalties, grads = [], []
            for group, real, z, eps in _feeds():
                feed = {model.real: real, model.z: z, model.eps: eps}
                if group == "d":
                    grads.append(sess.run(d_grads, feed))
                penalties.append(sess.run([ops[group], model.penalty], feed)[1])
            return _weights(sess, model), penalties, grads


def _run_scaled(compute_dtype, poison_before=None):
    """The builder with ``per_group_ops``: the same runs; with
    ``poison_before=i`` an extra, poisoned critic run is made before run
    ``i``, and the state around it is returned too."""
    with tf.Graph().as_default():
        model = wgan_gp(compute_dtype)
        step = tf.train.get_or_create_global_step()
        scaler = nl.MultiOptimizerLossScale(
            nl.DynamicLossScaleManager(initial_scale=2 ** 12, growth_steps=4),
            backend="is_finite")
        scaler.add(model.d_loss, _adam(), var_list=model.d_vars, name="d")
        scaler.add(model.g_loss, _adam(), var_list=model.g_vars, name="g")
        train = scaler.build(global_step=step, per_group_ops=True)
        # The critic's unscaled gradients as the step computes them (scaled
        # backprop, then unscaled): fetched alone, they run no step.
        d_grads = [g for g, _ in train.grads_and_vars["d"]]
        around = None
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            scales, grads = [], []
            for index, (group, real, z, eps) in enumerate(_feeds()):
                feed = {model.real: real, model.z: z, model.eps: eps}
                if index == poison_before:
                    before = snapshot_globals(sess)
                    poisoned = dict(feed)
                    poisoned[model.poison] = POISON
                    sess.run(train.per_group["d"], poisoned)
                    around = (before, snapshot_globals(sess))
                scales.append(sess.run(train.loss_scale))
                if group == "d":
                    grads.append(sess.run(d_grads, feed))
                sess.run(train.per_group[group], feed)
            return Scaled(_weights(sess, model), around, scales, grads, sess.run(step))


Scaled = collections.namedtuple("Scaled", ["weights", "around", "scales", "grads", "step"])


#: Largest |difference| to the unscaled float32 twin: (of the weights after
#: the 12 runs, Adam with lr 1e-3, every weight moving by 3e-3 or more; of
#: each critic gradient before each critic run, relative to its largest
#: element). float32 compute: power-of-two scales are exact and the
#: backprop (the penalty's second-order part too) is linear in the seed,
#: so the runs match but for TF's CPU kernels, which are not bit-for-bit
#: repeatable (measured on TF 2.21 over 15 repeats: 13 bit for bit in the
#: weights and within 9e-8 in the gradients, 2 off by 3e-5 and 5e-5).
#: float16 compute: float16's rounding of the forward pass and of the
#: penalty's gradient (measured: weights 1.6e-5, gradients 4.8e-3). A
#: gradient left scaled would be off by a factor of 4096 or more; Adam
#: divides by the gradient's own size, so the weights alone would hide a
#: uniform error: the gradients are the sharp check.
TOLERANCE = {tf.float32: (1e-4, 2e-4), tf.float16: (1e-4, 2e-2)}


@pytest.mark.parametrize("compute_dtype", [tf.float32, tf.float16], ids=["fp32", "fp16"])
def test_wgan_gp_critic_loop_matches_the_unscaled_twin(compute_dtype):
    """n_critic critic runs per generator run through per_group ops, the
    scale far from 1 (2**12, growing every 4 finite runs): the weights
    follow the unscaled float32 twin, and the scale did move, so the
    gradient penalty's tf.gradients was scaled and unscaled with it."""
    twin, penalties, twin_grads = _run_twin()
    assert min(penalties) > 1e-2  # the penalty is live, not a zero term
    ours = _run_scaled(compute_dtype)
    assert ours.step == N_CRITIC * ITERATIONS + ITERATIONS  # every run applied
    assert ours.scales[0] == 2 ** 12 and ours.scales[-1] == 2 ** 14  # grew twice
    weights_tol, grads_tol = TOLERANCE[compute_dtype]
    _assert_weights_match(ours.weights, twin, weights_tol)
    assert len(ours.grads) == len(twin_grads) == N_CRITIC * ITERATIONS
    for run, (mine, theirs) in enumerate(zip(ours.grads, twin_grads)):
        for got, want in zip(mine, theirs):
            # Not off by the scale (4096 to 16384): unscaled, penalty included.
            np.testing.assert_allclose(got, want, rtol=0,
                                       atol=grads_tol * np.abs(want).max(),
                                       err_msg="critic run %d" % run)


def _assert_weights_match(ours, twin, tolerance):
    for name, value in twin.items():
        np.testing.assert_allclose(ours[name], value, rtol=0, atol=tolerance, err_msg=name)
        moved = np.abs(value - _initial_values()[name]).max()
        assert moved > 10 * tolerance, name  # the tolerance is far below a step


@pytest.mark.parametrize("compute_dtype", [tf.float32, tf.float16], ids=["fp32", "fp16"])
def test_wgan_gp_overflow_in_the_penalty_is_skipped_atomically(compute_dtype):
    """An extra critic run whose gradient penalty overflows: nothing but the
    loss scale and the skip counter moves (no weight of either network, no
    Adam slot or beta power, not global_step), the scale halves, and the
    rest of the loop still follows the twin, which never made that run."""
    poison_before = N_CRITIC + 1  # the second iteration's second critic run
    twin = _run_twin()[0]
    ours = _run_scaled(compute_dtype, poison_before)
    before, after = ours.around
    moved = sorted(name for name in before
                   if not np.array_equal(before[name], after[name]))
    assert moved == ["dynamic_loss_scale/state", SKIPPED_STEPS]
    assert after[SKIPPED_STEPS] == before[SKIPPED_STEPS] + 1
    assert after["dynamic_loss_scale/state"][0] == before["dynamic_loss_scale/state"][0] / 2
    assert ours.scales[poison_before] == after["dynamic_loss_scale/state"][0]  # used next
    assert ours.step == N_CRITIC * ITERATIONS + ITERATIONS  # the skip did not count
    _assert_weights_match(ours.weights, twin, TOLERANCE[compute_dtype][0])


# -- what a per-group run may fetch ---------------------------------------------------

def _per_group_gan():
    from models import add_gan_groups, two_group_gan  # pylint: disable=import-outside-toplevel
    model = two_group_gan(tf.float16)
    step = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(
        nl.DynamicLossScaleManager(initial_scale=1024, growth_steps=1), backend="is_finite")
    add_gan_groups(scaler, model)
    return model, step, scaler.build(global_step=step, per_group_ops=True)


def test_what_a_per_group_run_may_fetch():
    """docs/features.md, TrainOps: every field may go with a per-group op
    (the run applies that group once, the joint step nothing); fetched
    alone, none changes anything (issue 32: fetching a field never
    trains)."""
    with tf.Graph().as_default():
        model, step, train = _per_group_gan()
        reads = {"skipped_steps": train.skipped_steps, "loss_scale": train.loss_scale,
                 "loss_scales": train.groups["d"].loss_scale, "window_end": train.window_end,
                 "clear_status": train.clear_status,
                 "grads_and_vars": [g for g, _ in train.grads_and_vars["d"]]}
        reads.update({"is_finite": train.is_finite, "applied": train.applied,
                      "group_is_finite": train.groups["d"].is_finite,
                      "skip_reason": train.diagnosis.skip_reason})
        init = tf.global_variables_initializer()
        g_names = [v.op.name for v in model.g_vars]
        with tf.Session() as sess:
            for name, fetch in sorted(reads.items()):
                sess.run(init)
                start = snapshot_globals(sess)
                sess.run(fetch, model.feed)  # alone: no step
                _assert_same(start, snapshot_globals(sess), name)
                value = sess.run([train.per_group["d"], fetch], model.feed)[1]
                after = snapshot_globals(sess)
                assert sess.run(step) == 1, name  # d applied once
                assert after["dynamic_loss_scale/state"][0] == 2048, name  # updated once
                _assert_same(dict((k, start[k]) for k in g_names),
                             dict((k, after[k]) for k in g_names), name)
                if name == "skipped_steps":
                    assert value == 0  # the count before the run
                if name in ("loss_scale", "loss_scales"):
                    assert value in (1024, 2048)  # before or after the run's update


def _assert_same(before, after, what):
    assert sorted(before) == sorted(after)
    for key in before:
        np.testing.assert_array_equal(before[key], after[key], err_msg="%s: %s" % (what, key))


# -- the UPDATE_OPS recipe: every call of a network ------------------------------------

def test_update_ops_recipe_takes_every_call_of_the_network():
    """A discriminator called twice (reuse=True) puts its second call's
    batch-norm updates under ``discriminator_1/``: the docs' regex takes
    both calls' updates and no other network's, as the slice of the
    collection around the calls does; ``"discriminator/"`` drops the second
    call's. The builder gates them: a skipped critic run leaves the moving
    statistics alone, an applied one moves them."""
    import audit_graphs as ag  # pylint: disable=import-outside-toplevel
    porting = open(os.path.join(REPO, "docs", "porting.md")).read()
    assert 'r"discriminator(_\\d+)?/"' in porting
    assert "tf.get_collection(tf.GraphKeys.UPDATE_OPS)[start:]" in porting

    def discriminator(x, reuse):
        with tf.variable_scope("discriminator", reuse=reuse):
            w = tf.get_variable("w", [4, 4])
            h = ag.moving_statistics_layer(tf.matmul(tf.cast(x, tf.float16),
                                                     tf.cast(w, tf.float16)), "bn1")
            return tf.cast(tf.reduce_sum(h, axis=1), tf.float32)

    with tf.Graph().as_default():
        real = tf.placeholder(tf.float32, [8, 4])
        poison = tf.placeholder_with_default(tf.constant(1.0), [])
        with tf.variable_scope("generator"):
            g_w = tf.get_variable("w", [4, 4])
        fake = ag.moving_statistics_layer(tf.matmul(real, g_w) + 1.0, "generator/bn")
        start = len(tf.get_collection(tf.GraphKeys.UPDATE_OPS))
        d_real = discriminator(real, reuse=False)
        d_fake = discriminator(fake, reuse=True)
        by_slice = tf.get_collection(tf.GraphKeys.UPDATE_OPS)[start:]
        by_regex = tf.get_collection(tf.GraphKeys.UPDATE_OPS, r"discriminator(_\d+)?/")
        by_slash = tf.get_collection(tf.GraphKeys.UPDATE_OPS, "discriminator/")
        assert len(by_slice) == 4 and by_regex == by_slice  # two per call
        assert len(by_slash) == 2  # the first call's only
        assert all("discriminator_1/" in u.name for u in by_regex if u not in by_slash)

        d_loss = (tf.reduce_mean(tf.nn.softplus(-d_real)) + tf.reduce_mean(
            tf.nn.softplus(d_fake))) * poison
        g_loss = tf.reduce_mean(tf.nn.softplus(-d_fake))
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")
        scaler.add(d_loss, tf.train.AdamOptimizer(1e-3),
                   var_list=tf.trainable_variables("discriminator/"), name="d")
        scaler.add(g_loss, tf.train.AdamOptimizer(1e-3), var_list=[g_w], name="g")
        train = scaler.build(per_group_ops=True, update_ops={"d": by_regex})
        moving = [v for v in tf.global_variables() if v.op.name.startswith("discriminator/")
                  and "moving" in v.op.name]
        assert len(moving) == 2
        feed = {real: np.random.RandomState(0).normal(size=[8, 4])}
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            before = sess.run(moving)
            poisoned = dict(feed)
            poisoned[poison] = np.inf
            sess.run(train.per_group["d"], poisoned)  # skipped
            for old, new in zip(before, sess.run(moving)):
                np.testing.assert_array_equal(old, new)
            sess.run(train.per_group["d"], feed)  # applied
            assert all(not np.array_equal(old, new)
                       for old, new in zip(before, sess.run(moving)))


# -- the docs' float16 recipe --------------------------------------------------------

def test_float16_recipe_runs_as_written(capsys):
    """The "From float32 to float16 compute" block of docs/porting.md,
    executed in a fresh graph: it trains (the loss falls to under half),
    every MatMul runs in float16, every variable and the loss are float32."""
    code = block("recipe: float16")
    assert code, "the docs lost their float16 recipe block"
    namespace = {"__name__": "recipe"}
    graph = tf.Graph()
    with graph.as_default():
        exec(compile(code, "docs float16 recipe", "exec"),  # pylint: disable=exec-used
             namespace)
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    forward = [op for op in matmuls if "gradients" not in op.name]
    assert len(forward) == 2 and all(op.get_attr("T") == tf.float16 for op in matmuls)
    variables = graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES)
    floating = [v for v in variables if v.dtype.base_dtype.is_floating]
    assert floating and all(v.dtype.base_dtype == tf.float32 for v in floating)
    assert namespace["loss"].dtype == tf.float32
    assert namespace["logits"].dtype == tf.float32
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)",
                                       capsys.readouterr().out).groups())
    assert first > 0.5 and last < first / 2
