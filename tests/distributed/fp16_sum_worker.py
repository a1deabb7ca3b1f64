"""One rank of a two-rank Horovod run whose float16 gradients overflow
float16 only when summed (launched by horovodrun).

Each rank's gradient of ``w * x`` with ``x = 40000`` is 40000, finite in
float16; the sum of the two ranks, 80000, is not. The builder averages float16
gradients in float32, so both ranks apply the exact mean. Writes
``[w after one step, is_finite]`` to ``<out>/rank<R>.json``.

Usage: fp16_sum_worker.py OUT_DIR

Runs twice, each in a graph of its own: averaging in float32 (the default;
``<out>/float32/``), then with ``allreduce_float16=True``, in float16
pre-divided by the rank count (``<out>/float16/``). Each also writes, for 64
random float16 gradients per rank, the weights after one step of each
reduction (float32, then float16).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graph_mode import import_tensorflow, set_graph_mode  # noqa: E402

tf = import_tensorflow()
set_graph_mode()

import horovod.tensorflow as hvd  # noqa: E402

import npu_lossscale as nl  # noqa: E402


def run(out_dir, float16):
    """One run; writes ``<out_dir>/rank<R>.json``."""
    x = tf.placeholder(tf.float16, [])
    w = tf.Variable(tf.constant(0.0, tf.float16))   # float16 weights: float16 gradients
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite",
                                        distributed="horovod", allreduce_float16=float16)
    scaler.add(w * x, tf.train.GradientDescentOptimizer(1e-4), var_list=[w], name="w")
    train = scaler.build()
    # Random float16 gradients, different on each rank, in both reductions.
    rng = np.random.RandomState(hvd.rank())
    data = rng.uniform(-3e4, 3e4, size=[64]).astype(np.float16)
    both = []
    for index, half in enumerate((False, True)):
        manager = nl.FixedLossScaleManager(1.0)
        one = nl.MultiOptimizerLossScale(manager, backend="is_finite", distributed="horovod",
                                         allreduce_float16=half)
        u = tf.Variable(tf.zeros([64], tf.float16), name="u%d" % index)
        one.add(tf.reduce_sum(u * tf.constant(data)), tf.train.GradientDescentOptimizer(1.0),
                var_list=[u], name="u")
        both.append((one.build().update_op, u))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        finite = sess.run([train.update_op, train.is_finite], {x: 40000.0})[1]
        sess.run([op for op, _ in both])
        result = [float(sess.run(w)), bool(finite)] + [
            sess.run(u).astype(np.float32).tolist() for _, u in both]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "rank%d.json" % hvd.rank()), "w") as handle:
        json.dump(result, handle)


def main(out_dir):
    hvd.init()
    for float16 in (False, True):
        with tf.Graph().as_default():
            run(os.path.join(out_dir, "float16" if float16 else "float32"), float16)


if __name__ == "__main__":
    main(sys.argv[1])
