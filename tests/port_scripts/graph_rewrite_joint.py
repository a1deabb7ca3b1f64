"""A GAN whose two optimizers each go through
``tf.train.experimental.enable_mixed_precision_graph_rewrite`` (one dynamic
loss scale per optimizer), both train ops fetched in one run as a dict.
The unported original.
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


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--inject-overflow-at", type=int, default=None)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    tf.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        tf.set_random_seed(3)
        x = tf.placeholder(tf.float32, [16, 8])
        z = tf.placeholder(tf.float32, [16, 4])
        poison = tf.placeholder_with_default(1.0, [])
        with tf.variable_scope("generator"):
            fake = tf.tanh(dense(tf.cast(z, tf.float16), 8, "fc"))
        with tf.variable_scope("discriminator"):
            real_logit = tf.cast(dense(tf.cast(x, tf.float16), 1, "fc"), tf.float32)
        with tf.variable_scope("discriminator", reuse=True):
            fake_logit = tf.cast(dense(fake, 1, "fc"), tf.float32)
        d_loss = tf.reduce_mean(tf.nn.softplus(-real_logit) + tf.nn.softplus(fake_logit))
        g_loss = tf.reduce_mean(tf.nn.softplus(-fake_logit)) * poison
        global_step = tf.train.get_or_create_global_step()

        d_opt = tf.train.MomentumOptimizer(0.05, momentum=0.9)
        # mixed precision: the graph rewrite and a dynamic loss scale
        d_opt = tf.train.experimental.enable_mixed_precision_graph_rewrite(d_opt)
        g_opt = tf.train.AdamOptimizer(1e-2)
        g_opt = tf.train.experimental.enable_mixed_precision_graph_rewrite(g_opt)
        d_train = d_opt.minimize(d_loss, global_step, tf.trainable_variables("discriminator"))
        g_train = g_opt.minimize(g_loss, var_list=tf.trainable_variables("generator"))
        saver = tf.train.Saver(max_to_keep=None)

    rng = np.random.RandomState(3)
    with tf.Session(graph=graph) as sess:
        sess.run(tf.global_variables_initializer())
        for step in range(1, args.steps + 1):
            feed = {x: rng.randn(16, 8), z: rng.randn(16, 4)}
            if step == args.inject_overflow_at:
                feed[poison] = 1e30
            out = sess.run({"train": {"d": d_train, "g": g_train},
                            "losses": (d_loss, g_loss)}, feed)
            if args.out:
                saver.save(sess, os.path.join(args.out, "model.ckpt"), global_step=step)
    return {"d_loss": float(out["losses"][0]), "g_loss": float(out["losses"][1])}


if __name__ == "__main__":
    main()
