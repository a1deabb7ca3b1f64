"""By hand: the discriminator's gradients are clipped between
compute_gradients and apply_gradients (a port needs add(...,
transform_grads_fn=...)). The unported original."""
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *

tf.disable_eager_execution()
x = tf.placeholder(tf.float32, [4, 3])
with tf.variable_scope("discriminator"):
    d_w = tf.get_variable("w", [3, 1])
with tf.variable_scope("generator"):
    g_w = tf.get_variable("w", [3, 1])
d_loss = tf.reduce_mean(tf.matmul(tf.cast(x, tf.float16), tf.cast(d_w, tf.float16)))
g_loss = tf.reduce_mean(tf.matmul(tf.cast(x, tf.float16), tf.cast(g_w, tf.float16)))
d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-3), FixedLossScaleManager(1024))
g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-3), FixedLossScaleManager(1024))
d_grads = d_opt.compute_gradients(d_loss, var_list=[d_w])
d_grads = [(tf.clip_by_value(g, -0.01, 0.01), v) for g, v in d_grads]  # WGAN-style clip
d_train = d_opt.apply_gradients(d_grads)
g_train = g_opt.minimize(g_loss, var_list=[g_w])

with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    sess.run([d_train, g_train], {x: [[1.0, 2.0, 3.0]] * 4})
