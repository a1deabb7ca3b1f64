"""Pix2Pix's loss-scaling code as ModelZoo's Ascend port writes it.

Each network trains in its own ``tf.name_scope``: its variables listed by
name, its Adam optimizer, ``loss_scale_manager = ...`` bound again for each
network (two managers, two scales, under one name), the wrapper (under an
``if`` on ``RANK_SIZE``: ``npu_tf_optimizer`` around it on several
devices), its ``minimize``; one ``tf.group`` of both train ops and the step counter is
fetched with the losses each step. The model and data are small stand-ins
(a dense generator with batch norm, a dense discriminator, random pairs,
an L1 term); the loss-scaling lines, names and scopes are the authors'.
The original's ``compute_gradients``/``apply_gradients`` and its
``tf.control_dependencies([discrim_train])`` around the generator's
training are left out here: pix2pix_authors.py holds them.

  PYTHONPATH=shims python tests/port_scripts/pix2pix_name_scopes.py --steps 3
"""
import argparse
import os

import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *

EPS = 1e-12


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
    parser.add_argument("--lr", type=float, default=0.0002)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--inject-overflow-at", type=int, default=None)
    parser.add_argument("--out", default="")
    a = parser.parse_args(argv)
    tf.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        tf.set_random_seed(1)
        inputs = tf.placeholder(tf.float32, [16, 8])
        targets = tf.placeholder(tf.float32, [16, 8])
        poison = tf.placeholder_with_default(1.0, [])
        with tf.variable_scope("generator"):
            outputs = tf.tanh(tf.cast(dense(tf.nn.relu(batch_norm(dense(
                tf.cast(inputs, tf.float16), 8, "encoder"), "bn")), 8, "decoder"), tf.float32))
        with tf.name_scope("real_discriminator"):
            with tf.variable_scope("discriminator"):
                predict_real = tf.sigmoid(tf.cast(dense(tf.cast(
                    tf.concat([inputs, targets], 1), tf.float16), 1, "layer"), tf.float32))
        with tf.name_scope("fake_discriminator"):
            with tf.variable_scope("discriminator", reuse=True):
                predict_fake = tf.sigmoid(tf.cast(dense(tf.cast(
                    tf.concat([inputs, outputs], 1), tf.float16), 1, "layer"), tf.float32))
        with tf.name_scope("discriminator_loss"):
            discrim_loss = tf.reduce_mean(
                -(tf.log(predict_real + EPS) + tf.log(1 - predict_fake + EPS))) * poison
        with tf.name_scope("generator_loss"):
            gen_loss_GAN = tf.reduce_mean(-tf.log(predict_fake + EPS))
            gen_loss_L1 = tf.reduce_mean(tf.abs(targets - outputs))
            gen_loss = (gen_loss_GAN * 1.0 + gen_loss_L1 * 100.0) * poison
        update_ops = tf.get_collection(tf.GraphKeys.UPDATE_OPS)

        with tf.name_scope("discriminator_train"):
            discrim_tvars = [var for var in tf.trainable_variables()
                             if var.name.startswith("discriminator")]
            discrim_optim = tf.train.AdamOptimizer(a.lr, a.beta1)
            loss_scale_manager = ExponentialUpdateLossScaleManager(
                init_loss_scale=2 ** 10, incr_every_n_steps=1000, decr_every_n_nan_or_inf=2,
                decr_ratio=0.5)
            if int(os.getenv("RANK_SIZE", "1")) > 1:
                discrim_optim = npu_tf_optimizer(NPULossScaleOptimizer(
                    discrim_optim, loss_scale_manager, is_distributed=True))
            else:
                discrim_optim = NPULossScaleOptimizer(discrim_optim, loss_scale_manager)
            discrim_train = discrim_optim.minimize(discrim_loss, var_list=discrim_tvars)

        with tf.name_scope("generator_train"):
            gen_tvars = [var for var in tf.trainable_variables()
                         if var.name.startswith("generator")]
            gen_optim = tf.train.AdamOptimizer(a.lr, a.beta1)
            loss_scale_manager = ExponentialUpdateLossScaleManager(
                init_loss_scale=2 ** 10, incr_every_n_steps=1000, decr_every_n_nan_or_inf=2,
                decr_ratio=0.5)
            if int(os.getenv("RANK_SIZE", "1")) > 1:
                gen_optim = npu_tf_optimizer(NPULossScaleOptimizer(
                    gen_optim, loss_scale_manager, is_distributed=True))
            else:
                gen_optim = NPULossScaleOptimizer(gen_optim, loss_scale_manager)
            with tf.control_dependencies(update_ops):
                gen_train = gen_optim.minimize(gen_loss, var_list=gen_tvars)

        global_step = tf.train.get_or_create_global_step()
        incr_global_step = tf.assign(global_step, global_step + 1)
        train = tf.group(discrim_train, gen_train, incr_global_step)
        saver = tf.train.Saver(max_to_keep=None)

    rng = np.random.RandomState(1)
    with tf.Session(graph=graph, config=npu_config_proto()) as sess:
        sess.run(tf.global_variables_initializer())
        for step in range(1, a.steps + 1):
            feed = {inputs: rng.randn(16, 8), targets: np.tanh(rng.randn(16, 8))}
            if step == a.inject_overflow_at:
                feed[poison] = 1e30
            results = sess.run({"train": train, "discrim_loss": discrim_loss,
                                "gen_loss": gen_loss}, feed)
            if a.out:
                saver.save(sess, os.path.join(a.out, "model.ckpt"), global_step=step)
        print("discrim_loss %.4f gen_loss %.4f" % (results["discrim_loss"], results["gen_loss"]))
    return {"d_loss": float(results["discrim_loss"]), "g_loss": float(results["gen_loss"])}


if __name__ == "__main__":
    main()
