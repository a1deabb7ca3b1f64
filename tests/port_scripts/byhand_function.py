"""By hand: the loss-scale optimizers come out of a helper called once per
network (the README's ``lso()``), which the tool does not follow. The
unported original."""
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *


def lso():
    return NPULossScaleOptimizer(tf.train.AdamOptimizer(2e-4, beta1=0.5),
                                 ExponentialUpdateLossScaleManager(
                                     init_loss_scale=2 ** 32, incr_every_n_steps=1000,
                                     decr_every_n_nan_or_inf=2, decr_ratio=0.5))


def main():
    tf.disable_eager_execution()
    x = tf.placeholder(tf.float32, [4, 3])
    with tf.variable_scope("discriminator"):
        d_w = tf.get_variable("w", [3, 1])
    with tf.variable_scope("generator"):
        g_w = tf.get_variable("w", [3, 1])
    d_loss = tf.reduce_mean(tf.matmul(tf.cast(x, tf.float16), tf.cast(d_w, tf.float16)))
    g_loss = tf.reduce_mean(tf.matmul(tf.cast(x, tf.float16), tf.cast(g_w, tf.float16)))
    d_train = lso().minimize(d_loss, var_list=[d_w])
    g_train = lso().minimize(g_loss, var_list=[g_w])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(d_train, {x: [[1.0, 2.0, 3.0]] * 4})
        sess.run(g_train, {x: [[1.0, 2.0, 3.0]] * 4})


if __name__ == "__main__":
    main()
