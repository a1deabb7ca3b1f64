"""A two-network model trained with plain ``minimize`` ops and no loss
scaling, both fetched in one run. The unported original: float16 compute
with no scale, so small gradients underflow and an overflow writes inf.
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
        tf.set_random_seed(4)
        x = tf.placeholder(tf.float32, [16, 8])
        y = tf.placeholder(tf.float32, [16, 1])
        poison = tf.placeholder_with_default(1.0, [])
        with tf.variable_scope("embedding"):
            h = tf.nn.relu(dense(tf.cast(x, tf.float16), 8, "fc"))
        with tf.variable_scope("head"):
            logit = tf.cast(dense(h, 1, "fc"), tf.float32)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y,
                                                                      logits=logit)) * poison
        global_step = tf.train.get_or_create_global_step()
        embedding_train = tf.train.AdagradOptimizer(0.1).minimize(
            loss, var_list=tf.trainable_variables("embedding"))
        head_train = tf.train.AdamOptimizer(1e-2).minimize(
            loss, global_step=global_step, var_list=tf.trainable_variables("head"))
        saver = tf.train.Saver(max_to_keep=None)

    rng = np.random.RandomState(4)
    with tf.Session(graph=graph) as sess:
        sess.run(tf.global_variables_initializer())
        for step in range(1, args.steps + 1):
            batch = rng.randn(16, 8)
            feed = {x: batch, y: (batch[:, :1] > 0).astype(np.float32)}
            if step == args.inject_overflow_at:
                feed[poison] = 1e30
            _, _, value = sess.run([embedding_train, head_train, loss], feed)
            if args.out:
                saver.save(sess, os.path.join(args.out, "model.ckpt"), global_step=step)
    return {"loss": float(value)}


if __name__ == "__main__":
    main()
