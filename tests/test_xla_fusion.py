"""backend="xla" (issue 34): the check, the unscale and a clip_norm group's
factor are compiled into one XLA cluster, on XLA's CPU backend here.

The reference is the is_finite backend's step on the same model: the
values it applies, bit for bit, and what it executes per step.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import backends
from models import two_group_gan

STEPS = 4
#: The fed poison that makes the generator's loss, and its gradients, inf.
INF = {"poison_g:0": np.float32(np.inf)}


def _step(backend):
    """The two-group float16 GAN, "g" clipped (so its clip factor fuses
    with its unscale); returns (model, train ops, variables)."""
    model = two_group_gan(compute_dtype=tf.float16, dim=6)
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(initial_scale=2 ** 10),
                                        backend=backend)
    scaler.add(model.d_loss, tf.train.AdamOptimizer(0.01), var_list=model.d_vars, name="d")
    scaler.add(model.g_loss, tf.train.AdamOptimizer(0.01), var_list=model.g_vars, name="g",
               clip_norm=0.5)
    train = scaler.build(global_step=tf.train.get_or_create_global_step())
    return model, train, tf.global_variables()


def _run(backend, metadata=None):
    """Runs STEPS steps, the third with an inf in "g"; returns the applied
    flags, every global variable's value after each step, and their names."""
    with tf.Graph().as_default():
        model, train, variables = _step(backend)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            applied, values = [], []
            for step in range(STEPS):
                feed = dict(model.feed, **(INF if step == 2 else {}))
                applied.append(sess.run([train.update_op, train.applied], feed)[1])
                values.append(sess.run(variables))
            if metadata is not None:
                sess.run(train.update_op, model.feed,
                         options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
                         run_metadata=metadata)
            names = [v.op.name for v in variables]
    return applied, values, names


def test_the_name_resolves_to_the_is_finite_check_with_a_scope():
    backend = backends.resolve_backend("xla")
    assert isinstance(backend, backends.IsFiniteBackend) and backend.name == "xla"
    assert not backend.reads_register
    with pytest.raises(ValueError, match=r"backend='xla2' is unknown; pass one of .*'xla'"):
        backends.resolve_backend("xla2")


def test_applied_values_equal_the_is_finite_steps():
    """Bit for bit in the unclipped group; within float32 rounding in the
    clipped one, whose global norm XLA sums in its own order."""
    reference = _run("is_finite")
    fused = _run("xla")
    assert reference[0] == fused[0] == [True, True, False, True]
    for step, (want, got) in enumerate(zip(reference[1], fused[1])):
        for name, a, b in zip(reference[2], want, got):
            if name.startswith("generator/"):
                np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7,
                                           err_msg="%s, step %d" % (name, step))
            else:
                np.testing.assert_array_equal(b, a, err_msg="%s, step %d" % (name, step))
    # The skipped step changed no weight, slot or step count (the scale and
    # the skip counters are the manager's and the builder's to change).
    for name, a, b in zip(fused[2], fused[1][1], fused[1][2]):
        if not name.startswith(("dynamic_loss_scale", "loss_scale")):
            np.testing.assert_array_equal(b, a, err_msg=name)


def test_check_and_unscale_are_one_cluster_and_nothing_else_is():
    with tf.Graph().as_default() as graph:
        _, train, _ = _step("xla")
        marked = [op for op in graph.get_operations() if "_XlaCompile" in op.node_def.attr]
    types = set(op.type for op in marked)
    assert {"IsFinite", "Mul"} <= types, types
    assert "Sqrt" in types  # "g"'s global norm, for its clip factor
    for op in marked:
        assert op.get_attr("_XlaCompile") and op.get_attr("_XlaScope") == marked[0].get_attr(
            "_XlaScope"), op.name
        # Not the backprop, the gate, the apply or the manager's update.
        assert not any(word in op.type for word in ("Apply", "Assign", "Switch", "If")), op
        assert "gradients" not in op.name.split("/")[0], op.name


def test_the_run_executes_the_cluster_instead_of_the_check_and_unscale_ops():
    executed = {}
    for backend in ("is_finite", "xla"):
        metadata = tf.RunMetadata()
        _run(backend, metadata)
        executed[backend] = [node.node_name for dev in metadata.step_stats.dev_stats
                             for node in dev.node_stats]
    fused = executed["xla"]
    assert any(name.endswith("xla_run") for name in fused), fused
    assert not [n for n in fused if "is_finite_check" in n or "unscaled_grads" in n], fused
    assert [n for n in executed["is_finite"] if "is_finite_check" in n]
    # Per step, the cluster replaces the check's and unscale's kernels; the
    # lazy-compilation plumbing (one merge per cluster output) stays on the
    # host, so the count of executed nodes drops less than the kernels do.
    kernels = [n for n in fused if "cluster" not in n and not n.startswith("_retval")]
    reference = [n for n in executed["is_finite"]]
    assert len(kernels) < len(reference) - 20, (len(kernels), len(reference))


def test_loss_scale_optimizer_compiles_its_check():
    """``apply_gradients`` is given its gradients: the check alone is
    compiled, and a non-finite step still skips."""
    with tf.Graph().as_default() as graph:
        model = two_group_gan(compute_dtype=tf.float16)
        opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.01),
                                    nl.FixedLossScaleManager(8.0), backend="xla")
        train = opt.minimize(model.g_loss, var_list=model.g_vars)
        marked = [op for op in graph.get_operations() if "_XlaCompile" in op.node_def.attr]
        assert "IsFinite" in set(op.type for op in marked)
        assert all("is_finite_check" in op.name for op in marked), [op.name for op in marked]
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            before = sess.run(model.g_vars)
            sess.run(train, dict(model.feed, **INF))
            for a, b in zip(before, sess.run(model.g_vars)):
                np.testing.assert_array_equal(b, a)
            sess.run(train, model.feed)
            assert any(not np.array_equal(a, b) for a, b in zip(before, sess.run(model.g_vars)))
