"""By hand: the two train ops are kept in a list before they are fetched, a
use the tool cannot map to the builder's ops (a tf.group of them would be:
the joint step). The unported original."""
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
d_train = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-3),
                                FixedLossScaleManager(1024)).minimize(d_loss, var_list=[d_w])
g_train = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-3),
                                FixedLossScaleManager(1024)).minimize(g_loss, var_list=[g_w])
train_op = [d_train, g_train]

with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(train_op, {x: [[1.0, 2.0, 3.0]] * 4})
