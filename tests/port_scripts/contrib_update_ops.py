"""A GAN with batch norm, TF 1.15 contrib's loss scaling on each optimizer,
both wrappers sharing one manager.

Both train ops are built under ``tf.control_dependencies(UPDATE_OPS)`` (the
TF1 idiom that also runs the moving statistics on skipped steps) and fetched
in one session.run with the losses. The unported original: it needs TF 1.15
(tf.contrib); its port runs on any TF.
"""
import argparse
import os

import numpy as np
import tensorflow.compat.v1 as tf


def dense(x, units, name):
    with tf.variable_scope(name):
        w = tf.get_variable("w", [int(x.shape[-1]), units], tf.float32,
                            tf.random_normal_initializer(stddev=0.3))
        return tf.matmul(x, tf.cast(w, tf.float16))


def batch_norm(x, name):
    """Batch norm in float32, its moving mean updated through UPDATE_OPS."""
    x = tf.cast(x, tf.float32)
    with tf.variable_scope(name):
        moving_mean = tf.get_variable("moving_mean", x.shape[-1:], trainable=False,
                                      initializer=tf.zeros_initializer())
    mean, variance = tf.nn.moments(x, [0])
    tf.add_to_collection(tf.GraphKeys.UPDATE_OPS,
                         tf.assign_sub(moving_mean, (moving_mean - mean) * 0.1))
    return tf.cast((x - mean) * tf.rsqrt(variance + 1e-3), tf.float16)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--inject-overflow-at", type=int, default=None)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    tf.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        tf.set_random_seed(1)
        x = tf.placeholder(tf.float32, [16, 8])
        z = tf.placeholder(tf.float32, [16, 4])
        poison = tf.placeholder_with_default(1.0, [])
        with tf.variable_scope("generator"):
            fake = tf.tanh(dense(tf.nn.relu(batch_norm(dense(tf.cast(z, tf.float16), 8, "fc1"),
                                                       "bn")), 8, "fc2"))
        with tf.variable_scope("discriminator"):
            real_logit = tf.cast(dense(tf.cast(x, tf.float16), 1, "fc"), tf.float32)
        with tf.variable_scope("discriminator", reuse=True):
            fake_logit = tf.cast(dense(fake, 1, "fc"), tf.float32)
        d_loss = tf.reduce_mean(tf.nn.softplus(-real_logit) + tf.nn.softplus(fake_logit))
        g_loss = tf.reduce_mean(tf.nn.softplus(-fake_logit)) * poison

        loss_scale_manager = tf.contrib.mixed_precision.ExponentialUpdateLossScaleManager(
            init_loss_scale=2 ** 12, incr_every_n_steps=500)
        d_optimizer = tf.contrib.mixed_precision.LossScaleOptimizer(
            tf.train.AdamOptimizer(1e-2), loss_scale_manager)
        g_optimizer = tf.contrib.mixed_precision.LossScaleOptimizer(
            tf.train.AdamOptimizer(1e-2), loss_scale_manager)
        with tf.control_dependencies(tf.get_collection(tf.GraphKeys.UPDATE_OPS)):
            d_step = d_optimizer.minimize(d_loss, var_list=tf.trainable_variables("discriminator"))
            g_step = g_optimizer.minimize(g_loss, var_list=tf.trainable_variables("generator"))
        saver = tf.train.Saver(max_to_keep=None)

    rng = np.random.RandomState(1)
    with tf.Session(graph=graph) as sess:
        sess.run(tf.variables_initializer(graph.get_collection("variables")))
        for step in range(1, args.steps + 1):
            feed = {x: rng.randn(16, 8), z: rng.randn(16, 4)}
            if step == args.inject_overflow_at:
                feed[poison] = 1e30
            _, _, d_value, g_value = sess.run([d_step, g_step, d_loss, g_loss], feed)
            if args.out:
                saver.save(sess, os.path.join(args.out, "model.ckpt"), global_step=step)
        print("d_loss %.4f g_loss %.4f" % (d_value, g_value))
    return {"d_loss": float(d_value), "g_loss": float(g_value)}


if __name__ == "__main__":
    main()
