"""A CycleGAN in the style of a GitHub one (yiebo/cycle-gan): contrib's
loss scaling on each optimizer, an R1 penalty, MonitoredTrainingSession.

The generators G (X to Y) and F (Y to X) share one Adam optimizer, the
discriminators D_X and D_Y another; each optimizer is wrapped in
``tf.contrib.mixed_precision.LossScaleOptimizer`` with its own
``ExponentialUpdateLossScaleManager``, in its own ``tf.name_scope``. The
discriminators' loss has an R1 gradient penalty on the real images; the
generators' minimize advances ``global_step``; one ``tf.group`` of both
train ops runs under ``tf.train.MonitoredTrainingSession`` until its stop
hook. The networks and data are small stand-ins (dense layers, random
images, one batch norm in G); the loss-scaling lines, the group and the
session are the script's. The unported original needs TF 1.15
(tf.contrib); its port runs on any TF.
"""
import argparse
import os

import numpy as np
import tensorflow.compat.v1 as tf


def dense(x, units, name):
    with tf.variable_scope(name, reuse=tf.AUTO_REUSE):
        w = tf.get_variable("w", [int(x.shape[-1]), units], tf.float32,
                            tf.random_normal_initializer(stddev=0.3))
        return tf.matmul(x, tf.cast(w, tf.float16))


def batch_norm(x, name):
    """Batch norm in float32, its moving mean updated through UPDATE_OPS."""
    x = tf.cast(x, tf.float32)
    with tf.variable_scope(name, reuse=tf.AUTO_REUSE):
        moving_mean = tf.get_variable("moving_mean", x.shape[-1:], trainable=False,
                                      initializer=tf.zeros_initializer())
    mean, variance = tf.nn.moments(x, [0])
    tf.add_to_collection(tf.GraphKeys.UPDATE_OPS,
                         tf.assign_sub(moving_mean, (moving_mean - mean) * 0.1))
    return tf.cast((x - mean) * tf.rsqrt(variance + 1e-3), tf.float16)


def generator(x, name):
    with tf.variable_scope(name, reuse=tf.AUTO_REUSE):
        h = tf.nn.relu(batch_norm(dense(tf.cast(x, tf.float16), 8, "h0"), "bn0"))
        return tf.tanh(tf.cast(dense(h, 8, "h1"), tf.float32))


def discriminator(x, name):
    with tf.variable_scope(name, reuse=tf.AUTO_REUSE):
        return tf.cast(dense(tf.cast(x, tf.float16), 1, "h0"), tf.float32)


class SaveEveryRun(tf.train.SessionRunHook):
    """The test's checkpoint after each run (the script's own saving is
    MonitoredTrainingSession's checkpoint hook)."""

    def __init__(self, out):
        self._out, self._run, self._saver = out, 0, None

    def begin(self):
        self._saver = tf.train.Saver(max_to_keep=None)

    def after_run(self, run_context, run_values):
        self._run += 1
        if self._out:
            self._saver.save(run_context.session, os.path.join(self._out, "model.ckpt"),
                             global_step=self._run)


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
        real_x = tf.placeholder(tf.float32, [16, 8])
        real_y = tf.placeholder(tf.float32, [16, 8])
        poison = tf.placeholder_with_default(1.0, [])
        fake_y, fake_x = generator(real_x, "G"), generator(real_y, "F")
        cycle = tf.reduce_mean(tf.abs(generator(fake_y, "F") - real_x)) + tf.reduce_mean(
            tf.abs(generator(fake_x, "G") - real_y))
        d_real_x, d_fake_x = discriminator(real_x, "D_X"), discriminator(fake_x, "D_X")
        d_real_y, d_fake_y = discriminator(real_y, "D_Y"), discriminator(fake_y, "D_Y")
        g_loss = (tf.reduce_mean(tf.nn.softplus(-d_fake_x) + tf.nn.softplus(-d_fake_y))
                  + 10.0 * cycle) * poison
        r1 = tf.add_n([tf.reduce_mean(tf.reduce_sum(tf.square(tf.gradients(d, x)[0]), 1))
                       for d, x in ((d_real_x, real_x), (d_real_y, real_y))])
        d_loss = (tf.reduce_mean(tf.nn.softplus(-d_real_x) + tf.nn.softplus(d_fake_x)
                                 + tf.nn.softplus(-d_real_y) + tf.nn.softplus(d_fake_y))
                  + 5.0 * r1) * poison
        g_vars = tf.trainable_variables("G") + tf.trainable_variables("F")
        d_vars = tf.trainable_variables("D_X") + tf.trainable_variables("D_Y")
        global_step = tf.train.get_or_create_global_step()

        with tf.name_scope("optimizers"):
            g_manager = tf.contrib.mixed_precision.ExponentialUpdateLossScaleManager(
                init_loss_scale=2 ** 10, incr_every_n_steps=500)
            d_manager = tf.contrib.mixed_precision.ExponentialUpdateLossScaleManager(
                init_loss_scale=2 ** 10, incr_every_n_steps=500)
            g_optimizer = tf.contrib.mixed_precision.LossScaleOptimizer(
                tf.train.AdamOptimizer(2e-3, beta1=0.5), g_manager)
            d_optimizer = tf.contrib.mixed_precision.LossScaleOptimizer(
                tf.train.AdamOptimizer(2e-3, beta1=0.5), d_manager)
            with tf.control_dependencies(tf.get_collection(tf.GraphKeys.UPDATE_OPS)):
                g_train = g_optimizer.minimize(g_loss, global_step=global_step, var_list=g_vars)
            d_train = d_optimizer.minimize(d_loss, var_list=d_vars)
        train_op = tf.group(g_train, d_train)

    rng = np.random.RandomState(1)
    hooks = [tf.train.StopAtStepHook(last_step=10 ** 6), SaveEveryRun(args.out)]
    step, values = 0, None
    with graph.as_default(), tf.train.MonitoredTrainingSession(hooks=hooks) as sess:
        while not sess.should_stop() and step < args.steps:
            step += 1
            feed = {real_x: rng.randn(16, 8), real_y: np.tanh(rng.randn(16, 8))}
            if step == args.inject_overflow_at:
                feed[poison] = 1e30
            _, values = sess.run([train_op, (d_loss, g_loss)], feed)
    print("d_loss %.4f g_loss %.4f" % values)
    return {"d_loss": float(values[0]), "g_loss": float(values[1])}


if __name__ == "__main__":
    main()
