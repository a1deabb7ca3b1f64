"""By hand: one NPULossScaleOptimizer minimized for two losses (ModelZoo
BicycleGAN's pattern: its Adam beta powers advance once per minimize). The
unported original."""
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *

tf.disable_eager_execution()
x = tf.placeholder(tf.float32, [4, 3])
with tf.variable_scope("encoder"):
    e_w = tf.get_variable("w", [3, 1])
with tf.variable_scope("generator"):
    g_w = tf.get_variable("w", [3, 1])
e_loss = tf.reduce_mean(tf.matmul(tf.cast(x, tf.float16), tf.cast(e_w, tf.float16)))
g_loss = tf.reduce_mean(tf.matmul(tf.cast(x, tf.float16), tf.cast(g_w, tf.float16)))
manager = ExponentialUpdateLossScaleManager(init_loss_scale=2 ** 16, incr_every_n_steps=1000)
optimizer = NPULossScaleOptimizer(tf.train.AdamOptimizer(2e-4, beta1=0.5), manager)
e_train = optimizer.minimize(e_loss, var_list=[e_w])
g_train = optimizer.minimize(g_loss, var_list=[g_w])

with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(e_train, {x: [[1.0, 2.0, 3.0]] * 4})
    sess.run(g_train, {x: [[1.0, 2.0, 3.0]] * 4})
