"""The porting example (examples/porting/dcgan_alternating.py) and seed 003
with the builder.

The example runs in this process (its ``main(argv)``), in the test process's
graph mode, with a checkpoint after every iteration. An overflow is injected
into the generator's loss in the last iteration. References, both
independent of the library's own bookkeeping:

* the checkpoint of the iteration before the poisoned one (a skipped run must
  leave its network exactly there: weights, Adam slots and beta powers,
  batch-norm moving statistics, global_step);
* an unpoisoned twin: the same script, seed and feeds, without the injection
  (a run that applied in the poisoned script must match it bit for bit).
"""

import importlib.util
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
import seed003
from conftest import REPO

EXAMPLE = os.path.join(REPO, "examples", "porting", "dcgan_alternating.py")
POISONED = 3  # the last iteration; checkpoints model.ckpt-2 (before) and -3 (after)
SKIPPED = "loss_scale/skipped_steps"


def _example():
    spec = importlib.util.spec_from_file_location("porting_dcgan_alternating", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, name, style, backend, inject):
    """Runs the example; returns its checkpoints by iteration, as dicts."""
    out = str(tmp_path / name)
    argv = ["--style", style, "--backend", backend, "--steps", str(POISONED),
            "--batch-size", "16", "--log-every", "1", "--save-every", "1", "--out", out]
    if inject:
        argv += ["--inject-overflow-at", str(POISONED)]
    result = _example().main(argv)
    assert result["iteration"] == POISONED
    checkpoints = {}
    for iteration in (POISONED - 1, POISONED):
        reader = tf.train.load_checkpoint(os.path.join(out, "model.ckpt-%d" % iteration))
        checkpoints[iteration] = dict((n, reader.get_tensor(n))
                                      for n in reader.get_variable_to_shape_map())
    return checkpoints


def _runs(tmp_path, style, backend):
    poisoned = _run(tmp_path, "poisoned", style, backend, inject=True)
    twin = _run(tmp_path, "twin", style, backend, inject=False)
    before, after, ref = poisoned[POISONED - 1], poisoned[POISONED], twin[POISONED]
    # Identical up to the poisoned run: the twin is a valid reference.
    assert sorted(before) == sorted(twin[POISONED - 1])
    for name in before:
        assert np.array_equal(before[name], twin[POISONED - 1][name]), name
    for name, value in after.items():
        assert np.all(np.isfinite(value)), name
    return before, after, ref


def _network(state, prefix):
    return sorted(n for n in state if n.startswith(prefix + "/"))


def _skipped(name, before, after, ref):
    """``name`` did not move in the poisoned run, but would have."""
    assert np.array_equal(after[name], before[name]), name + " moved on the skipped run"
    assert not np.array_equal(ref[name], before[name]), name + " does not move at all"


def _applied(name, before, after, ref):
    """``name`` moved in the poisoned run exactly as in the twin."""
    assert np.array_equal(after[name], ref[name]), name + " differs from the twin"
    assert not np.array_equal(after[name], before[name]), name + " did not move"


def _beta_powers(before, after, ref):
    """Adam's beta powers (beta1_power, beta1_power_1, ...: one per optimizer,
    unnamed by network; under v1 behaviour npu_bridge's tf.cond puts them in
    cond/, cond_2/): how many were applied and how many skipped."""
    counts = {"applied": 0, "skipped": 0}
    for name in sorted(n for n in after if n.split("/")[-1].startswith(("beta1_power",
                                                                        "beta2_power"))):
        if np.array_equal(after[name], ref[name]) and not np.array_equal(after[name],
                                                                          before[name]):
            counts["applied"] += 1
        elif np.array_equal(after[name], before[name]) and not np.array_equal(ref[name],
                                                                               before[name]):
            counts["skipped"] += 1
        else:
            raise AssertionError("%s neither applied nor skipped" % name)
    return counts


def _generator_skipped_but_its_moving_statistics(before, after, ref):
    """The poisoned generator run skipped every weight and slot of the
    generator but moved its batch-norm moving statistics (the ungated TF1
    idiom); the discriminator's run applied; one Adam beta-power pair moved."""
    for name in _network(after, "generator"):
        if "moving_" in name:
            _applied(name, before, after, ref)
        else:
            _skipped(name, before, after, ref)
    for name in _network(after, "discriminator"):
        _applied(name, before, after, ref)
    assert _beta_powers(before, after, ref) == {"applied": 2, "skipped": 2}


BACKENDS = ["is_finite", pytest.param("npu", id="npu-saturation")]


@pytest.fixture
def backend_setup(request):
    """For "npu": shims/ on sys.path (the example then imports the shim and
    sets saturation mode itself through npu_plugin.set_device_sat_mode)."""
    if request.param == "npu":
        request.getfixturevalue("npu_shim")
    return request.param


@pytest.mark.parametrize("backend_setup", BACKENDS, indirect=True)
def test_alternating_port_skips_only_the_generator_run(tmp_path, backend_setup):
    before, after, ref = _runs(tmp_path, "builder_alternating", backend_setup)
    generator = _network(after, "generator")
    assert "generator/bn1/moving_mean" in generator and "generator/fc1/w/Adam" in generator
    for name in generator:  # weights, slots, moving statistics: all as before
        _skipped(name, before, after, ref)
    for name in _network(after, "discriminator"):  # D's run of that iteration applied
        _applied(name, before, after, ref)
    assert _beta_powers(before, after, ref) == {"applied": 2, "skipped": 2}
    # global_step: +1 for D's applied run, nothing for G's skipped one.
    assert after["global_step"] == before["global_step"] + 1
    assert ref["global_step"] == before["global_step"] + 2
    assert after[SKIPPED] == before[SKIPPED] + 1 == 1 and ref[SKIPPED] == 0


@pytest.mark.parametrize("backend_setup", BACKENDS, indirect=True)
def test_joint_port_skips_both_networks(tmp_path, backend_setup):
    before, after, ref = _runs(tmp_path, "builder_joint", backend_setup)
    for name in _network(after, "generator") + _network(after, "discriminator"):
        _skipped(name, before, after, ref)
    assert _beta_powers(before, after, ref) == {"applied": 0, "skipped": 4}
    assert after["global_step"] == before["global_step"]
    assert ref["global_step"] == before["global_step"] + 1
    assert after[SKIPPED] == before[SKIPPED] + 1 == 1 and ref[SKIPPED] == 0


@pytest.mark.parametrize("backend_setup", BACKENDS, indirect=True)
def test_shared_manager_port_skips_g_and_moves_the_shared_scale_once_per_run(
        tmp_path, backend_setup):
    """The drop-in port: two LossScaleOptimizers on one manager, D and G in
    separate runs (Huawei's GAN samples). G's poisoned run is skipped (its
    weights and slots as before), D's run of that iteration applied, and the
    one scale moved once per run: D's finite run counted a good step, G's
    overflow a bad one (decr_every_n_nan_or_inf=2: no back-off yet). Batch
    norm is still the TF1 idiom here, ungated, as in the original."""
    before, after, ref = _runs(tmp_path, "lso_shared", backend_setup)
    _generator_skipped_but_its_moving_statistics(before, after, ref)
    assert after["global_step"] == before["global_step"] + 1 == ref["global_step"]
    # The manager's [scale, good_steps, bad_steps, streak], moved by two
    # updates in the poisoned iteration: D's finite run (good + 1), then G's
    # overflow (good reset, bad + 1); one overflow does not back off yet.
    scale, good, bad, _ = after["exponential_loss_scale/state"]
    assert scale == before["exponential_loss_scale/state"][0]
    assert (good, bad) == (0.0, before["exponential_loss_scale/state"][2] + 1.0)


def test_shared_manager_port_refuses_a_joint_fetch(graph):
    """What a joint fetch of the two step ops does: the run fails, naming the
    manager and both ops, before the second one writes."""
    module = _example()
    args = module.parse_args(["--style", "lso_shared"])
    real, z, poison, d_loss, g_loss = module.build_model(8)
    d_train, g_train, scales = module.shared_manager_train_ops(
        args, d_loss, g_loss, tf.trainable_variables("discriminator"),
        tf.trainable_variables("generator"), [], tf.train.get_or_create_global_step())
    rng = np.random.RandomState(0)
    feed = {real: rng.uniform(0, 1, [8, module.IMAGE]), z: rng.uniform(-1, 1, [8, module.Z_DIM])}
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(d_train, feed)
        sess.run(g_train, feed)
        with pytest.raises(tf.errors.InvalidArgumentError) as raised:
            sess.run([d_train, g_train], feed)
    message = raised.value.message
    assert "ExponentialUpdateLossScaleManager" in message and "Fetch one of them" in message


def test_original_npu_bridge_script_skips_g_but_moves_its_batch_norm(tmp_path, npu_shim):
    """The unported script on the shim (saturation): alternating runs decide
    right (FAQ), but the TF1 idiom `control_dependencies(UPDATE_OPS)` runs the
    moving statistics on the skipped run too: the trap build(update_ops=) fixes."""
    before, after, ref = _runs(tmp_path, "npu_bridge", "npu")
    _generator_skipped_but_its_moving_statistics(before, after, ref)
    # global_step is D's minimize's: it moved with D's applied run.
    assert after["global_step"] == before["global_step"] + 1 == ref["global_step"]


# -- seed 003 with the builder ----------------------------------------------------------

def test_seed003_builder_decides_right_where_two_npu_lso_in_one_run_do_not(npu_shim):
    # tf_adapter npu_bridge/estimator/npu/npu_loss_scale_optimizer.py (emulated
    # by shims/npu_bridge/estimator/npu/npu_loss_scale_optimizer.py): in
    # saturation mode each NPULossScaleOptimizer reads the one device
    # float-status register after its gradients and clears it. Two of them in
    # one session.run: the first read takes the overflow away from the second.
    from npu_bridge.estimator.npu import npu_plugin
    from npu_bridge.estimator.npu.npu_loss_scale_manager import FixedLossScaleManager
    from npu_bridge.estimator.npu.npu_loss_scale_optimizer import NPULossScaleOptimizer
    npu_plugin.set_device_sat_mode(0)  # saturation (Atlas training series)

    def sgd():
        return tf.train.GradientDescentOptimizer(0.1)

    # npu_bridge: G's step sequenced after D's in one run. D skips, G applies a
    # step computed from saturated values: the wrong decision.
    with tf.Graph().as_default():
        m = seed003.model()
        d_train = NPULossScaleOptimizer(sgd(), FixedLossScaleManager(1)).minimize(
            m.d_loss, var_list=[m.wd])
        with tf.control_dependencies([d_train]):
            g_train = NPULossScaleOptimizer(sgd(), FixedLossScaleManager(1)).minimize(
                m.g_loss, var_list=[m.wg])
        with tf.Session() as sess:
            assert seed003.applied(sess, m, [[d_train, g_train]]) == (False, True)

    def builder(m):
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1), backend="npu")
        scaler.add(m.d_loss, sgd(), var_list=[m.wd], name="d")
        scaler.add(m.g_loss, sgd(), var_list=[m.wg], name="g")
        assert scaler.backend == "npu"
        return scaler.build(per_group_ops=True)

    # The builder on the same model: one read after every gradient of both
    # groups, one decision: skip both. Per-group ops in separate runs (the
    # alternating loop): each run reads its own overflow: skip both too.
    with tf.Graph().as_default():
        m = seed003.model()
        train = builder(m)
        with tf.Session() as sess:
            assert seed003.applied(sess, m, [[train.update_op]]) == (False, False)
            assert seed003.applied(sess, m, [[train.per_group["d"]],
                                             [train.per_group["g"]]]) == (False, False)
            # The misuse that broke npu_bridge's pair above, with the per-group
            # ops: both in one run, with update_op too. It fails the run
            # (each would apply its group again), and nothing applies: every
            # read follows the one clear and reports the overflow.
            sess.run(tf.global_variables_initializer())
            start = sess.run([m.wd, m.wg])
            for _ in range(5):
                with pytest.raises(tf.errors.InvalidArgumentError, match="Fetch one of them per session.run"):
                    sess.run([train.per_group["d"], train.per_group["g"], train.update_op],
                             m.feed)
                assert all((a == b).all() for a, b in zip(sess.run([m.wd, m.wg]), start))
            clean = dict(m.feed)
            clean[m.inject] = 1.0  # no overflow: both apply, either way
            assert seed003.applied(sess, m, [[train.update_op]], clean) == (True, True)
            assert seed003.applied(sess, m, [[train.per_group["d"]], [train.per_group["g"]]],
                                   clean) == (True, True)
