"""A one-network float16 classifier with npu_bridge's loss scaling: one
NPULossScaleOptimizer, batch norm under tf.control_dependencies, a global
step. The unported original.
"""
import argparse
import os

import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--inject-overflow-at", type=int, default=None)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    tf.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        tf.set_random_seed(5)
        x = tf.placeholder(tf.float32, [16, 8])
        y = tf.placeholder(tf.float32, [16, 1])
        poison = tf.placeholder_with_default(1.0, [])
        w1 = tf.get_variable("w1", [8, 8], initializer=tf.random_normal_initializer(stddev=0.3))
        w2 = tf.get_variable("w2", [8, 1], initializer=tf.random_normal_initializer(stddev=0.3))
        moving_mean = tf.get_variable("moving_mean", [8], trainable=False,
                                      initializer=tf.zeros_initializer())
        h = tf.matmul(tf.cast(x, tf.float16), tf.cast(w1, tf.float16))
        mean = tf.reduce_mean(tf.cast(h, tf.float32), 0)
        tf.add_to_collection(tf.GraphKeys.UPDATE_OPS,
                             tf.assign_sub(moving_mean, (moving_mean - mean) * 0.1))
        logit = tf.cast(tf.matmul(tf.nn.relu(h), tf.cast(w2, tf.float16)), tf.float32)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y,
                                                                      logits=logit)) * poison
        global_step = tf.train.get_or_create_global_step()
        manager = ExponentialUpdateLossScaleManager(init_loss_scale=2 ** 16,
                                                    incr_every_n_steps=1000,
                                                    decr_every_n_nan_or_inf=1)
        optimizer = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-2), manager)
        with tf.control_dependencies(tf.get_collection(tf.GraphKeys.UPDATE_OPS)):
            train_op = optimizer.minimize(loss, global_step=global_step)
        saver = tf.train.Saver(max_to_keep=None)

    rng = np.random.RandomState(5)
    with tf.Session(graph=graph, config=npu_config_proto()) as sess:
        sess.run(tf.global_variables_initializer())
        for step in range(1, args.steps + 1):
            batch = rng.randn(16, 8)
            feed = {x: batch, y: (batch[:, :1] > 0).astype(np.float32)}
            if step == args.inject_overflow_at:
                feed[poison] = 1e30
            _, value = sess.run([train_op, loss], feed)
            if args.out:
                saver.save(sess, os.path.join(args.out, "model.ckpt"), global_step=step)
    return {"loss": float(value)}


if __name__ == "__main__":
    main()
