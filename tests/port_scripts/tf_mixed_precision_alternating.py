"""A GAN trained in alternating runs (D, then G), each optimizer wrapped in
TF's MixedPrecisionLossScaleOptimizer: D with a dynamic scale, G with a
fixed one. The unported original (TF 1.14/1.15's tf.train.experimental).
"""
import argparse
import os

import numpy as np
import tensorflow.compat.v1 as tf

BATCH = 16


def dense(x, units, name):
    with tf.variable_scope(name):
        w = tf.get_variable("w", [int(x.shape[-1]), units], tf.float32,
                            tf.random_normal_initializer(stddev=0.3))
        return tf.matmul(x, tf.cast(w, tf.float16))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--inject-overflow-at", type=int, default=None)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    tf.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        tf.set_random_seed(2)
        x = tf.placeholder(tf.float32, [BATCH, 8])
        z = tf.placeholder(tf.float32, [BATCH, 4])
        poison = tf.placeholder_with_default(1.0, [])
        with tf.variable_scope("generator"):
            fake = tf.tanh(dense(tf.cast(z, tf.float16), 8, "fc"))
        with tf.variable_scope("discriminator"):
            real_logit = tf.cast(dense(tf.cast(x, tf.float16), 1, "fc"), tf.float32)
        with tf.variable_scope("discriminator", reuse=True):
            fake_logit = tf.cast(dense(fake, 1, "fc"), tf.float32)
        d_loss = tf.reduce_mean(tf.nn.softplus(-real_logit) + tf.nn.softplus(fake_logit)) * poison
        g_loss = tf.reduce_mean(tf.nn.softplus(-fake_logit)) * poison

        d_opt = tf.train.experimental.MixedPrecisionLossScaleOptimizer(
            tf.train.AdamOptimizer(1e-2), "dynamic")
        g_opt = tf.train.experimental.MixedPrecisionLossScaleOptimizer(
            tf.train.AdamOptimizer(1e-2), loss_scale=128)
        d_op = d_opt.minimize(d_loss, var_list=tf.trainable_variables("discriminator"))
        g_op = g_opt.minimize(g_loss, var_list=tf.trainable_variables("generator"))
        saver = tf.train.Saver(max_to_keep=None)

    rng = np.random.RandomState(2)
    with tf.Session(graph=graph) as sess:
        sess.run(tf.global_variables_initializer())
        for step in range(1, args.steps + 1):
            feed = {x: rng.randn(BATCH, 8), z: rng.randn(BATCH, 4)}
            if step == args.inject_overflow_at:
                feed[poison] = 1e30
            d_value, _ = sess.run([d_loss, d_op], feed_dict=feed)
            g_value, _ = sess.run(fetches=[g_loss, g_op], feed_dict=feed)
            if args.out:
                saver.save(sess, os.path.join(args.out, "model.ckpt"), global_step=step)
    return {"d_loss": float(d_value), "g_loss": float(g_value)}


if __name__ == "__main__":
    main()
