"""By hand: one NPULossScaleOptimizer per tower, built in a loop (the tool
cannot tell the optimizers apart). The unported original."""
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *

tf.disable_eager_execution()
x = tf.placeholder(tf.float32, [4, 3])
losses, train_ops = {}, []
for name in ("tower_a", "tower_b"):
    with tf.variable_scope(name):
        w = tf.get_variable("w", [3, 1])
    losses[name] = tf.reduce_mean(tf.matmul(tf.cast(x, tf.float16), tf.cast(w, tf.float16)))
    optimizer = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-3),
                                      FixedLossScaleManager(loss_scale=1024))
    train_ops.append(optimizer.minimize(losses[name], var_list=[w]))

with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(train_ops, {x: [[1.0, 2.0, 3.0]] * 4})
