"""One rank of a two-rank Horovod run whose float16 gradients overflow
float16 only when summed (launched by horovodrun).

Each rank's gradient of ``w * x`` with ``x = 40000`` is 40000, finite in
float16; the sum of the two ranks, 80000, is not. The builder averages float16
gradients in float32, so both ranks apply the exact mean. Writes
``[w after one step, is_finite]`` to ``<out>/rank<R>.json``.

Usage: fp16_sum_worker.py OUT_DIR
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow.compat.v1 as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graph_mode import set_graph_mode  # noqa: E402

set_graph_mode()

import horovod.tensorflow as hvd  # noqa: E402

import npu_lossscale as nl  # noqa: E402


def main(out_dir):
    hvd.init()
    x = tf.placeholder(tf.float16, [])
    w = tf.Variable(tf.constant(0.0, tf.float16))   # float16 weights: float16 gradients
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite",
                                        distributed="horovod")
    scaler.add(w * x, tf.train.GradientDescentOptimizer(1e-4), var_list=[w], name="w")
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        finite = sess.run([train.update_op, train.is_finite], {x: 40000.0})[1]
        result = [float(sess.run(w)), bool(finite)]
    with open(os.path.join(out_dir, "rank%d.json" % hvd.rank()), "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1])
