"""An alternating DCGAN loop for Ascend, one NPULossScaleOptimizer per network.

The unported original of examples/porting/dcgan_alternating.py's
``--style npu_bridge``, written as one standalone script the way ModelZoo
scripts are: ``from npu_bridge.npu_init import *``, one manager and one
loss-scale optimizer per network, the discriminator's run then the
generator's, batch norm's updates under ``tf.control_dependencies``, a Saver
and a schedule keyed on the loop's own iteration count. Same model, data,
seed and feeds as the example, so that its port trains as the hand-ported
``--style builder_alternating`` does (tests/test_port.py).

  PYTHONPATH=shims python tests/port_scripts/dcgan_npu_bridge.py --steps 3
"""
import argparse
import json
import os

import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *

Z_DIM, HIDDEN, IMAGE = 16, 64, 64
POISON = 1e30  # times the generator's loss: its float16 gradients overflow


def digits(seed):
    """scikit-learn's 8x8 digits in [-1, 1], float32, shuffled."""
    from sklearn.datasets import load_digits
    images = load_digits().data.astype(np.float32) / 8.0 - 1.0
    return images[np.random.RandomState(seed).permutation(len(images))]


def dense(x, units, name):
    with tf.variable_scope(name):
        w = tf.get_variable("w", [int(x.shape[-1]), units], tf.float32,
                            tf.random_normal_initializer(stddev=0.1))
        b = tf.get_variable("b", [units], tf.float32, tf.zeros_initializer())
        return tf.matmul(x, tf.cast(w, tf.float16)) + tf.cast(b, tf.float16)


def batch_norm(x, name, momentum=0.9):
    x = tf.cast(x, tf.float32)
    with tf.variable_scope(name):
        gamma = tf.get_variable("gamma", x.shape[-1:], initializer=tf.ones_initializer())
        beta = tf.get_variable("beta", x.shape[-1:], initializer=tf.zeros_initializer())
        moving_mean = tf.get_variable("moving_mean", x.shape[-1:], trainable=False,
                                      initializer=tf.zeros_initializer())
        moving_var = tf.get_variable("moving_variance", x.shape[-1:], trainable=False,
                                     initializer=tf.ones_initializer())
        mean, variance = tf.nn.moments(x, [0])
        for moving, value in ((moving_mean, mean), (moving_var, variance)):
            tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, tf.assign_sub(
                moving, (moving - value) * (1.0 - momentum)))
        return tf.cast(tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-3),
                       tf.float16)


def generator(z):
    with tf.variable_scope("generator"):
        h = tf.nn.relu(batch_norm(dense(tf.cast(z, tf.float16), HIDDEN, "fc1"), "bn1"))
        return tf.tanh(dense(h, IMAGE, "fc2"))


def discriminator(x, reuse):
    with tf.variable_scope("discriminator", reuse=reuse):
        h = tf.nn.leaky_relu(dense(tf.cast(x, tf.float16), HIDDEN, "fc1"), 0.2)
        return tf.cast(dense(h, 1, "fc2"), tf.float32)


def build_model(batch_size):
    real = tf.placeholder(tf.float32, [batch_size, IMAGE], name="real")
    z = tf.placeholder(tf.float32, [batch_size, Z_DIM], name="z")
    poison = tf.placeholder_with_default(tf.constant(1.0), [], name="poison")
    fake = generator(z)
    d_real, d_fake = discriminator(real, reuse=False), discriminator(fake, reuse=True)
    xent = tf.nn.sigmoid_cross_entropy_with_logits
    d_loss = (tf.reduce_mean(xent(labels=tf.ones_like(d_real), logits=d_real))
              + tf.reduce_mean(xent(labels=tf.zeros_like(d_fake), logits=d_fake)))
    g_loss = tf.reduce_mean(xent(labels=tf.ones_like(d_fake), logits=d_fake)) * poison
    return real, z, poison, d_loss, g_loss


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--loss-scale", type=float, default=2.0 ** 10)
    parser.add_argument("--inject-overflow-at", type=int, default=None)
    parser.add_argument("--overflow-mode", choices=("saturation", "inf_nan"), default="inf_nan")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("runs", "dcgan"))
    args = parser.parse_args(argv)
    if tf.executing_eagerly():
        tf.disable_eager_execution()
    npu_plugin.set_device_sat_mode(0 if args.overflow_mode == "saturation" else 1)
    os.makedirs(args.out, exist_ok=True)
    data = digits(args.seed)
    rng = np.random.RandomState(args.seed)

    graph = tf.Graph()
    with graph.as_default():
        tf.set_random_seed(args.seed)
        real, z, poison, d_loss, g_loss = build_model(args.batch_size)
        d_vars = tf.trainable_variables("discriminator")
        g_vars = tf.trainable_variables("generator")
        g_updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS, r"generator(_\d+)?/")
        global_step = tf.train.get_or_create_global_step()

        d_manager = ExponentialUpdateLossScaleManager(
            init_loss_scale=args.loss_scale, incr_every_n_steps=1000,
            decr_every_n_nan_or_inf=2, decr_ratio=0.5)
        g_manager = ExponentialUpdateLossScaleManager(
            init_loss_scale=args.loss_scale, incr_every_n_steps=1000,
            decr_every_n_nan_or_inf=2, decr_ratio=0.5)
        d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-3, beta1=0.5), d_manager)
        g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-3, beta1=0.5), g_manager)
        d_train = d_opt.minimize(d_loss, global_step=global_step, var_list=d_vars)
        with tf.control_dependencies(g_updates):  # batch norm's moving statistics
            g_train = g_opt.minimize(g_loss, var_list=g_vars)
        scales = {"d_scale": d_manager.get_loss_scale(), "g_scale": g_manager.get_loss_scale()}
        saver = tf.train.Saver(max_to_keep=5)
        init = tf.global_variables_initializer()

    prefix = os.path.join(args.out, "model.ckpt")
    with tf.Session(graph=graph, config=npu_config_proto()) as sess:
        sess.run(init)
        for iteration in range(1, args.steps + 1):
            batch = data[rng.randint(0, len(data), args.batch_size)]
            d_feed = {real: batch, z: rng.uniform(-1, 1, [args.batch_size, Z_DIM])}
            g_feed = {real: batch, z: rng.uniform(-1, 1, [args.batch_size, Z_DIM])}
            if iteration == args.inject_overflow_at:
                g_feed[poison] = POISON
            _, d_value = sess.run([d_train, d_loss], d_feed)
            _, g_value = sess.run([g_train, g_loss], g_feed)
            saver.save(sess, prefix, global_step=iteration)
        values = sess.run(dict(scales, global_step=global_step))
        result = dict((k, float(v)) for k, v in values.items())
        result.update(iteration=args.steps, d_loss=float(d_value), g_loss=float(g_value))
    print("RESULT " + json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
