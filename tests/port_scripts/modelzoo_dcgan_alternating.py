"""ModelZoo's DCGAN (the carpedm20 DCGAN-tensorflow port to Ascend): its
loss-scaling code as its authors wrote it.

In ``DCGAN.train``, under ``tf.control_dependencies(UPDATE_OPS)``: each
optimizer is made, then its name is rebound to its wrapped ``minimize`` op,
one ``ExponentialUpdateLossScaleManager`` (made above the block: made inside,
its variables' initializers would wait for the block's batch-norm updates
and need the batch's feeds) shared by both wrappers; the loop
runs D once and G twice per iteration, each fetched with its summary. The
model and data are small stand-ins (a dense generator with batch norm, a
dense discriminator, random batches); the loss-scaling lines, the class, the
names and the loop are the authors'. An injected overflow poisons every run
of one iteration.

  PYTHONPATH=shims python tests/port_scripts/modelzoo_dcgan_alternating.py --steps 3
"""
import argparse
import os

import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *


def linear(x, units, name):
    with tf.variable_scope(name):
        w = tf.get_variable("w", [int(x.shape[-1]), units], tf.float32,
                            tf.random_normal_initializer(stddev=0.2))
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


class DCGAN(object):
    def __init__(self, sess, batch_size=16, z_dim=4, image_dim=8):
        self.sess = sess
        self.batch_size, self.z_dim, self.image_dim = batch_size, z_dim, image_dim
        self.build_model()

    def build_model(self):
        self.inputs = tf.placeholder(tf.float32, [self.batch_size, self.image_dim], name="real")
        self.z = tf.placeholder(tf.float32, [self.batch_size, self.z_dim], name="z")
        self.poison = tf.placeholder_with_default(1.0, [], name="poison")
        with tf.variable_scope("generator"):
            h = tf.nn.relu(batch_norm(linear(tf.cast(self.z, tf.float16), 8, "g_h0"), "g_bn0"))
            self.G = tf.tanh(linear(h, self.image_dim, "g_h1"))
        with tf.variable_scope("discriminator"):
            d_logits = tf.cast(linear(tf.cast(self.inputs, tf.float16), 1, "d_h0"), tf.float32)
        with tf.variable_scope("discriminator", reuse=True):
            d_logits_ = tf.cast(linear(self.G, 1, "d_h0"), tf.float32)
        self.d_loss = tf.reduce_mean(tf.nn.softplus(-d_logits) + tf.nn.softplus(d_logits_)
                                     ) * self.poison
        self.g_loss = tf.reduce_mean(tf.nn.softplus(-d_logits_)) * self.poison
        self.d_sum = tf.summary.scalar("d_loss", self.d_loss)
        self.g_sum = tf.summary.scalar("g_loss", self.g_loss)
        t_vars = tf.trainable_variables()
        self.d_vars = [var for var in t_vars if 'd_' in var.name]
        self.g_vars = [var for var in t_vars if 'g_' in var.name]
        self.saver = None

    def train(self, config):
        update_ops = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
        loss_scale_manager = ExponentialUpdateLossScaleManager(
            init_loss_scale=config.loss_scale, incr_every_n_steps=1000,
            decr_every_n_nan_or_inf=2, decr_ratio=0.5)
        with tf.control_dependencies(update_ops):
            d_optim = tf.train.AdamOptimizer(config.learning_rate, beta1=config.beta1)
            d_optim = NPULossScaleOptimizer(d_optim, loss_scale_manager).minimize(
                self.d_loss, var_list=self.d_vars)
            g_optim = tf.train.AdamOptimizer(config.learning_rate, beta1=config.beta1)
            g_optim = NPULossScaleOptimizer(g_optim, loss_scale_manager).minimize(
                self.g_loss, var_list=self.g_vars)
        self.saver = tf.train.Saver(max_to_keep=None)
        tf.global_variables_initializer().run()

        rng = np.random.RandomState(1)
        for epoch in range(1, config.steps + 1):
            batch_images = rng.randn(self.batch_size, self.image_dim)
            batch_z = rng.uniform(-1, 1, [self.batch_size, self.z_dim])
            feed = {self.inputs: batch_images, self.z: batch_z}
            if epoch == config.inject_overflow_at:
                feed[self.poison] = 1e30
            # Update D network
            _, summary_str = self.sess.run([d_optim, self.d_sum], feed_dict=feed)
            # Update G network
            _, summary_str = self.sess.run([g_optim, self.g_sum], feed_dict=feed)
            # Run g_optim twice to make sure that d_loss does not go to zero
            _, summary_str = self.sess.run([g_optim, self.g_sum], feed_dict=feed)
            if config.out:
                self.saver.save(self.sess, os.path.join(config.out, "model.ckpt"),
                                global_step=epoch)
        return self.sess.run([self.d_loss, self.g_loss], feed_dict=feed)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--learning-rate", type=float, default=0.0002)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--loss-scale", type=float, default=2.0 ** 10)
    parser.add_argument("--inject-overflow-at", type=int, default=None)
    parser.add_argument("--out", default="")
    config = parser.parse_args(argv)
    tf.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        tf.set_random_seed(1)
        with tf.Session(graph=graph, config=npu_config_proto()) as sess:
            d_value, g_value = DCGAN(sess).train(config)
    print("d_loss %.4f g_loss %.4f" % (d_value, g_value))
    return {"d_loss": float(d_value), "g_loss": float(g_value)}


if __name__ == "__main__":
    main()
