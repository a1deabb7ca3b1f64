"""An encoder GAN for Ascend: three networks, each with its own
NPULossScaleOptimizer, all three trained in ONE session.run (seed 003's
pattern: on the float-status register the wrappers clear each other's
overflow). The unported original, in the style of ModelZoo scripts.

  PYTHONPATH=shims python tests/port_scripts/npu_three_joint.py --steps 3
"""
import argparse
import json
import os

import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *


def dense(x, units, name):
    """float32 master weights, float16 compute."""
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
        tf.set_random_seed(0)
        x = tf.placeholder(tf.float32, [16, 8], name="x")
        z = tf.placeholder(tf.float32, [16, 4], name="z")
        poison = tf.placeholder_with_default(1.0, [], name="poison")
        with tf.variable_scope("encoder"):
            code = tf.tanh(dense(tf.cast(x, tf.float16), 4, "fc"))
        with tf.variable_scope("generator"):
            fake = tf.tanh(dense(tf.cast(z, tf.float16), 8, "fc"))
        with tf.variable_scope("discriminator"):
            real_logit = tf.cast(dense(tf.cast(x, tf.float16), 1, "fc"), tf.float32)
        with tf.variable_scope("discriminator", reuse=True):
            fake_logit = tf.cast(dense(fake, 1, "fc"), tf.float32)
        e_loss = tf.reduce_mean(tf.square(tf.cast(code, tf.float32) - z)) * poison
        g_loss = tf.reduce_mean(tf.nn.softplus(-fake_logit)) * poison
        d_loss = tf.reduce_mean(tf.nn.softplus(-real_logit) + tf.nn.softplus(fake_logit))
        e_vars = tf.trainable_variables("encoder")
        g_vars = tf.trainable_variables("generator")
        d_vars = tf.trainable_variables("discriminator")
        global_step = tf.train.get_or_create_global_step()

        # One loss-scale optimizer per network.
        e_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-2),
                                      FixedLossScaleManager(loss_scale=2 ** 8))
        g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-2),
                                      ExponentialUpdateLossScaleManager(init_loss_scale=2 ** 10,
                                                                        incr_every_n_steps=100))
        d_opt = NPULossScaleOptimizer(tf.train.GradientDescentOptimizer(0.1),
                                      ExponentialUpdateLossScaleManager(init_loss_scale=2 ** 10,
                                                                        incr_every_n_steps=100))
        e_train = e_opt.minimize(e_loss, var_list=e_vars)
        g_train = g_opt.minimize(g_loss, var_list=g_vars, global_step=global_step)
        d_train = d_opt.minimize(d_loss, var_list=d_vars)
        saver = tf.train.Saver(max_to_keep=None)
        init = tf.global_variables_initializer()

    rng = np.random.RandomState(0)
    with tf.Session(graph=graph, config=npu_config_proto()) as sess:
        sess.run(init)
        for step in range(1, args.steps + 1):
            feed = {x: rng.randn(16, 8), z: rng.uniform(-1, 1, [16, 4])}
            if step == args.inject_overflow_at:
                feed[poison] = 1e30
            result = sess.run({"e": e_train, "g": g_train, "d": d_train, "e_loss": e_loss,
                               "g_loss": g_loss, "d_loss": d_loss}, feed)
            if args.out:
                saver.save(sess, os.path.join(args.out, "model.ckpt"), global_step=step)
        result = dict((k, float(v)) for k, v in result.items() if v is not None)
        result["global_step"] = int(sess.run(global_step))
    print("RESULT " + json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
