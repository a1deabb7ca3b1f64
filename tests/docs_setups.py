"""What the documentation's fragments take as given, and what they promise.

A block marked ``<!-- setup: NAME -->`` in README.md or docs/*.md is a
fragment of a script: it uses a model, feeds or a session made earlier in
that script. ``SETUPS[NAME].code`` makes them, the block runs as written, and
``SETUPS[NAME].after`` checks what the block's text says it does (the block's
output is ``block_output`` there). tests/test_docs.py runs them, each in a
fresh graph and folder (readme_blocks.run_blocks).
"""

import collections


class Setup(collections.namedtuple("Setup", ["code", "after", "shim"])):
    """One set-up.

    Attributes:
      code: Python run before the block, in the block's namespace.
      after: Python run after it, with asserts on what the block made.
      shim: whether it runs with the CPU emulation of npu_bridge
        (shims/) importable.
    """


# What every set-up starts from: a tiny GAN in float16 compute on float32
# master weights, with a batch that need not be fed, and a session that
# initialises the variables the block makes when it first runs.
_COMMON = '''
import os
import warnings

import numpy as np
import tensorflow.compat.v1 as tf
import npu_lossscale as nl

tf.disable_eager_execution()
tf.set_random_seed(0)
rng = np.random.RandomState(0)


class FirstRunInitialises(object):
    """A tf.Session whose first run initialises the global variables."""

    def __init__(self):
        self._session = tf.Session()
        self._fresh = True

    def run(self, fetches, feed_dict=None):
        if self._fresh:
            self._session.run(tf.global_variables_initializer())
            self._fresh = False
        return self._session.run(fetches, feed_dict)

    def close(self):
        self._session.close()


def two_networks(compute=tf.float16, loss_dtype=tf.float32):
    """A generator and a discriminator: (x, d_loss, g_loss, d_vars, g_vars)."""
    x = tf.placeholder_with_default(rng.randn(16, 8).astype(np.float32), [16, 8], name="x")
    z = tf.random.normal([16, 4], seed=1)
    with tf.variable_scope("generator"):
        g_w = tf.get_variable("w", [4, 8])
    with tf.variable_scope("discriminator"):
        d_w = tf.get_variable("w", [8, 1])
    fake = tf.tanh(tf.matmul(tf.cast(z, compute), tf.cast(g_w, compute)))
    real_logits = tf.cast(tf.matmul(tf.cast(x, compute), tf.cast(d_w, compute)), loss_dtype)
    fake_logits = tf.cast(tf.matmul(fake, tf.cast(d_w, compute)), loss_dtype)
    d_loss = tf.reduce_mean(tf.nn.softplus(-real_logits) + tf.nn.softplus(fake_logits))
    g_loss = tf.reduce_mean(tf.nn.softplus(-fake_logits))
    return x, d_loss, g_loss, [d_w], [g_w]
'''

# The two networks, the global step, two feeds and a session.
_GAN = _COMMON + '''
x, d_loss, g_loss, d_vars, g_vars = two_networks()
global_step = tf.train.get_or_create_global_step()
d_feed, g_feed = {x: rng.randn(16, 8)}, {x: rng.randn(16, 8)}
sess = FirstRunInitialises()
'''

# Ascend in saturation mode, on the shim: overflows are in the register only.
_SATURATION = '''
from npu_bridge.estimator.npu import npu_plugin
npu_plugin.set_device_sat_mode(0)
'''

# One group, fed by micro-batches.
_ONE_GROUP = _COMMON + '''
x = tf.placeholder(tf.float32, [8, 3])
w = tf.get_variable("w", [3, 1])
loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
gs = tf.train.get_or_create_global_step()
scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net")
batches = [rng.randn(8, 3) for _ in range(8)]


def feed(micro_batch):
    return {x: micro_batch}


sess = FirstRunInitialises()
'''

# One group in float32 on a fixed batch, before its add(): a least-squares
# fit whose loss stays positive.
_NET = _COMMON + '''
x_value = rng.randn(8, 3).astype(np.float32)
y_value = rng.randn(8, 1).astype(np.float32)
w_value = np.array([[0.5], [-0.5], [1.0]], np.float32)
bad_batch = 100 * x_value
x = tf.placeholder_with_default(x_value, [8, 3], name="x")
y = tf.placeholder_with_default(y_value, [8, 1], name="y")
w = tf.get_variable("w", initializer=w_value)
loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
gs = tf.train.get_or_create_global_step()
manager = nl.DynamicLossScaleManager()
scaler = nl.MultiOptimizerLossScale(manager)
sess = FirstRunInitialises()
'''

# The same, added as the group "net" (SGD 0.1).
_NET_ADDED = _NET + '''
scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net")
'''

# What a skip condition of the builder's leaves: the scale where it started,
# no overflow counted.
_SCALE_HELD = '''
assert sess.run(manager.state).tolist()[::2] == [2.0 ** 15, 0.0]
'''

SETUPS = {
    # README, Quick start: the seed's loop before the port (no loss scaling).
    "seed_loop": Setup(_COMMON + '''
x, d_loss, e_loss, D_var, E_var = two_networks()
global_step = tf.train.get_or_create_global_step()
e_optimizer, d_optimizer = tf.train.AdamOptimizer(2e-4), tf.train.AdamOptimizer(2e-4)
sess = FirstRunInitialises()
''', '''
assert sorted(result) == ["d_loss", "d_opt", "e_loss", "e_opt"]
assert sess.run(global_step) == 1
''', shim=False),

    # porting.md, "Before": npu_bridge's optimizers (the shim stands in).
    "npu_bridge_gan": Setup(_GAN, '''
assert sess.run(global_step) in (0, 1)   # D's run applied, or skipped at 2**32
names = set(v.op.name for v in tf.global_variables())
assert {"loss_scale", "loss_scale_1"} <= names  # the managers' state, which the Saver saves
''', shim=True),

    # porting.md, the drop-in way: one shared manager, one step op per run.
    "gan": Setup(_GAN, '''
assert sess.run(global_step) in (0, 1)
try:
    sess.run([d_train, g_train], d_feed)
except tf.errors.InvalidArgumentError as error:
    message = str(error)
    assert "two step ops that both" in message and "Fetch one of them" in message, message
    assert "update loss-scale manager ExponentialUpdateLossScaleManager" in message, message
else:
    raise AssertionError("a run of both step ops was not refused")
''', shim=False),

    # porting.md, UPDATE_OPS: pix2pix's discriminator, called twice.
    "discriminator_called_twice": Setup(_COMMON + '''
def batch_norm_updates(h):
    moving_mean = tf.get_variable("moving_mean", h.shape[-1:], trainable=False,
                                  initializer=tf.zeros_initializer())
    mean = tf.reduce_mean(h, 0)
    tf.add_to_collection(tf.GraphKeys.UPDATE_OPS,
                         tf.assign_sub(moving_mean, 0.1 * (moving_mean - mean)))
    return h - mean


def dense(h, units):
    return tf.matmul(h, tf.get_variable("w", [int(h.shape[-1]), units]))


def generator(inputs):
    with tf.variable_scope("generator"):
        return batch_norm_updates(dense(inputs, 4))


def discriminator(inputs, targets, reuse=False):
    with tf.variable_scope("discriminator", reuse=reuse):
        return batch_norm_updates(dense(tf.concat([inputs, targets], 1), 4))


inputs, targets = tf.zeros([2, 4]), tf.ones([2, 4])
outputs = generator(inputs)
''', '''
assert start == 1   # the generator's update came before
assert [op.name.split("/")[0] for op in d_updates] == ["discriminator", "discriminator_1"]
assert d_updates == tf.get_collection(tf.GraphKeys.UPDATE_OPS, r"discriminator(_\\d+)?/")
assert tf.get_collection(tf.GraphKeys.UPDATE_OPS, "discriminator/") == d_updates[:1]
''', shim=False),

    # porting.md, "Did a run skip?": per-group ops; this D run overflows.
    "per_group_steps": Setup(_GAN + '''
d_feed = {x: np.full([16, 8], np.inf)}
scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())
scaler.add(d_loss, tf.train.AdamOptimizer(2e-4), var_list=d_vars, name="d")
scaler.add(g_loss, tf.train.AdamOptimizer(2e-4), var_list=g_vars, name="g")
train = scaler.build(global_step=global_step, per_group_ops=True)
d_train, g_train = train.per_group["d"], train.per_group["g"]
''', '''
assert d_skipped and not g_skipped
assert sess.run(train.skipped_steps) == 1 and sess.run(global_step) == 1
''', shim=False),

    # diagnosis.md, the floor warning: a scale at its floor, every step overflowing.
    "scale_at_its_floor": Setup(_COMMON + '''
manager = nl.DynamicLossScaleManager(initial_scale=1.0, floor_warning_after=3)
x = tf.placeholder(tf.float32, [2])
w = tf.get_variable("w", [2])
scaler = nl.MultiOptimizerLossScale(manager)
scaler.add(tf.reduce_sum(w * x), tf.train.GradientDescentOptimizer(0.1), var_list=[w])
train = scaler.build()
sess = tf.Session()
sess.run(tf.global_variables_initializer())
for _ in range(3):
    sess.run(train.update_op, {x: [np.inf, 1.0]})
caught = warnings.catch_warnings(record=True)
warned = caught.__enter__()
warnings.simplefilter("always")
''', '''
caught.__exit__(None, None, None)
assert len([w for w in warned if issubclass(w.category, RuntimeWarning)]) == 1
assert isinstance(hooks[0], tf.train.SessionRunHook)
''', shim=False),

    # managers.md, checkpoints from older layouts: npu_bridge's, and this
    # version's at a later step.
    "older_checkpoints": Setup(_COMMON + '''
for folder in ("old", "new", "npu"):
    os.makedirs(folder)


def save(build, path):
    with tf.Graph().as_default():
        build()
        with tf.Session() as session:
            session.run(tf.global_variables_initializer())
            tf.train.Saver().save(session, path)


def npu_bridge_layout():   # its manager's variables: float32 and int32 scalars
    tf.Variable(2.0 ** 32, trainable=False, name="loss_scale")
    tf.Variable(5, trainable=False, name="good_steps")
    tf.Variable(1, trainable=False, name="bad_steps")
    tf.Variable([1.5, -2.0], name="w")


def this_version():
    nl.ExponentialUpdateLossScaleManager(2.0 ** 15, 1000)
    tf.Variable([0.5, 0.5], name="w")


save(npu_bridge_layout, "old/model.ckpt-1000")
save(this_version, "new/model.ckpt-2000")
manager = nl.ExponentialUpdateLossScaleManager(2.0 ** 15, 1000)
w = tf.Variable([0.0, 0.0], name="w")
saver = tf.train.Saver()
sess = tf.Session()
''', '''
assert sess.run(manager.state).tolist() == [2.0 ** 32, 5.0, 1.0, 0.0]
assert sess.run(w).tolist() == [1.5, -2.0]
names = dict(tf.train.list_variables("npu/model.ckpt-2000"))
assert {"loss_scale", "good_steps", "bad_steps", "w"} == set(names)
''', shim=False),

    # features.md, gradient accumulation: the builder before build().
    "one_group": Setup(_ONE_GROUP, '''
assert sess.run(gs) == 2 and applied and end   # two windows of 4
''', shim=False),

    # features.md, gradient accumulation: the step built with a window of 4.
    "one_group_accumulating": Setup(_ONE_GROUP + '''
train = scaler.build(global_step=gs, accumulation_steps=4)
''', '''
assert sess.run(gs) == 2
''', shim=False),

    # features.md, transform_grads_fn: each gradient clipped to norm 0.5 by
    # the fn, against numpy's least-squares gradient.
    "net_to_add": Setup(_NET, '''
grad = 2.0 / 8 * x_value.T.dot(x_value.dot(w_value) - y_value)
clipped = grad * min(1.0, 0.5 / np.linalg.norm(grad))
assert np.linalg.norm(grad) > 0.5
np.testing.assert_allclose(sess.run(w), w_value - 0.1 * clipped, rtol=1e-5)
assert sess.run(gs) == 1
''', shim=False),

    # features.md, skip_global_steps: global steps 3 to 5 skipped.
    "net_skipping_steps": Setup(_NET_ADDED, '''
assert sess.run([gs, train.skipped_steps]) == [8, 3]
skip = nl.diagnostics.decode(sess.run(train.diagnosis.last_skip))
assert (skip.reason, skip.global_step, skip.number) == ("requested", 5, 3)
assert sess.run(manager.state)[1] == 5  # the applied steps alone counted
''' + _SCALE_HELD, shim=False),

    # features.md, skip_loss_spikes: the bad batch after the warm-up skipped.
    "net_skipping_spikes": Setup(_NET_ADDED, '''
assert sess.run([gs, train.skipped_steps]) == [129, 1]
skip = nl.diagnostics.decode(sess.run(train.diagnosis.last_skip))
assert (skip.reason, skip.global_step) == ("loss_spike", 120)
assert sess.run(manager.state)[1] == 129
''' + _SCALE_HELD, shim=False),

    # features.md, bfloat16: losses in bfloat16.
    "bfloat16_gan": Setup(_COMMON + '''
x, d_loss, g_loss, d_vars, g_vars = two_networks(tf.bfloat16, tf.bfloat16)
global_step = tf.train.get_or_create_global_step()
d_opt, g_opt = tf.train.AdamOptimizer(2e-4), tf.train.AdamOptimizer(2e-4)
''', '''
assert d_loss.dtype == tf.bfloat16
with tf.Session() as session:
    session.run(tf.global_variables_initializer())
    session.run(train.update_op)
    assert session.run(global_step) == 1
    session.run(train.update_op, {x: np.full([16, 8], np.nan)})
    assert session.run([global_step, train.skipped_steps]) == [1, 1]
''', shim=False),

    # audit.md: two npu_bridge optimizers fetched together, on the register.
    "npu_bridge_train_ops": Setup(_GAN + _SATURATION + '''
from npu_bridge.estimator.npu.npu_loss_scale_manager import ExponentialUpdateLossScaleManager
from npu_bridge.estimator.npu.npu_loss_scale_optimizer import NPULossScaleOptimizer

d_train_op = NPULossScaleOptimizer(tf.train.AdamOptimizer(2e-4), ExponentialUpdateLossScaleManager(
    2 ** 15, 1000)).minimize(d_loss, var_list=d_vars, global_step=global_step)
g_train_op = NPULossScaleOptimizer(tf.train.AdamOptimizer(2e-4), ExponentialUpdateLossScaleManager(
    2 ** 15, 1000)).minimize(g_loss, var_list=g_vars)
''', '''
assert "NLS001-status-race error" in block_output, block_output
''', shim=True),

    # audit.md, worked example: the seed's GAN on Ascend in saturation mode.
    "npu_gan_saturation": Setup(_GAN + _SATURATION, '''
assert (d_train.name, g_train.name) == ("group_deps", "group_deps_1")
assert os.path.getsize("gan.meta") > 0
''', shim=True),

    # audit.md, worked example, ported: npu_bridge's manager kept.
    "npu_gan_ported": Setup(_GAN + _SATURATION + '''
from npu_bridge.estimator.npu.npu_loss_scale_manager import ExponentialUpdateLossScaleManager
''', '''
assert train.update_op.name == "loss_scale/update"
assert tf.get_default_graph().get_operation_by_name("loss_scale").type != "NoOp"
''', shim=True),
}
