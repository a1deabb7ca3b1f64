"""npu_bridge parity of ExponentialUpdateLossScaleManager (issue 13 item 4).

Facts from Huawei's tf_adapter,
tf_adapter/python/npu_bridge/estimator/npu/npu_loss_scale_manager.py
(Ascend/tensorflow and hicann/tensorflow):
* signature ``(init_loss_scale, incr_every_n_steps, decr_every_n_nan_or_inf=2,
  incr_ratio=2, decr_ratio=0.8)``;
* variables ``loss_scale`` (float32), ``good_steps`` and ``bad_steps`` (int32),
  created in the current name scope;
* growth only while ``less(loss_scale, 3.4e+38 / incr_ratio)``, back-off
  ``maximum(1., loss_scale * decr_ratio)``; no other cap.
The shim's copy (shims/npu_bridge/estimator/npu/npu_loss_scale_manager.py)
is the reference implementation the cross-check runs against.
"""

import inspect

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl


def test_signature_and_defaults_are_npu_bridges():
    # npu_loss_scale_manager.py: ExponentialUpdateLossScaleManager.__init__.
    params = list(inspect.signature(nl.ExponentialUpdateLossScaleManager).parameters.values())
    assert [p.name for p in params[:5]] == [
        "init_loss_scale", "incr_every_n_steps", "decr_every_n_nan_or_inf",
        "incr_ratio", "decr_ratio"]
    assert [p.default for p in params[:5]][2:] == [2, 2, 0.8]
    assert params[0].default is inspect.Parameter.empty
    assert params[1].default is inspect.Parameter.empty


def test_starts_at_2_to_the_32_and_grows_without_cap(graph):
    # npu_bridge's examples start at 2**32; npu_bridge has no cap besides
    # loss_scale < 3.4e38 / incr_ratio.
    manager = nl.ExponentialUpdateLossScaleManager(2 ** 32, 1)
    update = manager.update_loss_scale(tf.constant(True))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(update)
        assert sess.run(manager.get_loss_scale()) == 2.0 ** 33


def test_loss_scale_0_is_the_scale_of_a_single_manager(graph):
    # Huawei's docs and scripts fetch get_tensor_by_name("loss_scale:0").
    manager = nl.ExponentialUpdateLossScaleManager(1024, 1, decr_ratio=0.5)
    finite = tf.placeholder(tf.bool, [])
    update = manager.update_loss_scale(finite)
    scale = tf.get_default_graph().get_tensor_by_name("loss_scale:0")
    assert scale.dtype == tf.float32 and scale.shape.ndims == 0
    assert scale is manager.loss_scale
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run(scale) == 1024.0
        sess.run(update, {finite: True})
        assert sess.run(scale) == 2048.0
        sess.run(update, {finite: False})
        sess.run(update, {finite: False})  # decr_every_n_nan_or_inf=2
        assert sess.run(scale) == 1024.0
    # A second manager gets TF's uniquified name, as npu_bridge's would.
    second = nl.ExponentialUpdateLossScaleManager(8, 1)
    assert second.loss_scale.name == "loss_scale_1:0"


def test_growth_ceiling_is_npu_bridges_less_not_is_finite(graph):
    """With incr_ratio 16 npu_bridge grows while scale < 3.4e38 / 16 =
    2.125e37: 2**121 grows to 2**125. 2.126e37 * 16 = 3.4016e38 is finite
    (contrib would grow, to our 2**126 cap) but 2.126e37 >= 2.125e37:
    npu_bridge keeps it. Our deviation: growth stops at 2**126, where
    npu_bridge doubles 2**125 and 2**126 to 2**126 and 2**127."""
    cases = [(2.0 ** 121, 16, 2.0 ** 125), (2.126e37, 16, float(np.float32(2.126e37))),
             (2.0 ** 125, 2, 2.0 ** 126), (2.0 ** 126, 2, 2.0 ** 126)]
    updates, managers = [], []
    for init, ratio, _ in cases:
        manager = nl.ExponentialUpdateLossScaleManager(init, 1, incr_ratio=ratio)
        managers.append(manager)
        updates.append(manager.update_loss_scale(tf.constant(True)))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(updates)
        got = sess.run([m.get_loss_scale() for m in managers])
    assert [float(g) for g in got] == [expected for _, _, expected in cases]
    assert np.isfinite(np.float32(2.126e37) * np.float32(16))  # contrib would grow


def _shim_sequence(seed, size):
    rng = np.random.RandomState(seed)
    return rng.choice([True, False], size=size, p=[0.75, 0.25])


# 2**70 climbs to 2**121 on this walk: large scales, below our 2**126 cap
# (test_growth_ceiling_is_npu_bridges_less_not_is_finite covers the cap).
@pytest.mark.parametrize("init, ratio, decr", [(2.0 ** 32, 2, 0.8), (2.0 ** 70, 2, 0.5),
                                              (3.0, 3, 0.7)])
def test_bit_exact_against_the_shims_npu_bridge_manager(graph, npu_shim, init, ratio, decr):
    from npu_bridge.estimator.npu import npu_loss_scale_manager as npu
    theirs = npu.ExponentialUpdateLossScaleManager(
        init, incr_every_n_steps=2, decr_every_n_nan_or_inf=2, incr_ratio=ratio,
        decr_ratio=decr)
    ours = nl.ExponentialUpdateLossScaleManager(
        init, incr_every_n_steps=2, decr_every_n_nan_or_inf=2, incr_ratio=ratio,
        decr_ratio=decr)
    finite = tf.placeholder(tf.bool, [])
    step = [theirs.update_loss_scale(finite), ours.update_loss_scale(finite)]
    their_state = [tf.convert_to_tensor(theirs.get_loss_scale()),
                   theirs._num_good_steps, theirs._num_bad_steps]  # pylint: disable=protected-access
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i, value in enumerate(_shim_sequence(3, 150)):
            sess.run(step, {finite: bool(value)})
            a = [float(x) for x in sess.run(ours.state)[:3]]
            b = [float(x) for x in sess.run(their_state)]
            assert a == b, "step %d (%s): ours %r, npu_bridge %r" % (i, value, a, b)
