"""How to read many small gradients at once: the ways TF offers, measured.

  python benchmarks/small_tensor_reads.py [--tensors 1000] [--side 19]

The check of ``IsFiniteBackend`` must read every gradient. For thousands of
tiny tensors the per-op cost dominates, so it adds the small ones of one
shape with one ``AddN`` before a single ``Sum``. This script times the
alternatives on ``--tensors`` float32 tensors of shape (side, side), the way
``checkbench.py`` times a check (chained copies, (t(M) - t(1)) / (M - 1),
Grappler off), against the read floor (one ``Sum`` over one contiguous
buffer of the same bytes):

* ``add_n``: one ``AddN`` of all, then ``Sum`` (what the backend does);
* ``add_n_tree``: ``AddN`` of 64 at a time, then ``AddN`` of those, ``Sum``;
* ``stack``: one ``Pack``, then ``Sum``;
* ``concat``: one ``ConcatV2`` along axis 0, then ``Sum``;
* ``per_tensor``: a ``Sum`` per tensor and an ``AddN`` of the sums.

It prints one line per way: microseconds per read and the ratio to the floor.
"""

from __future__ import absolute_import, division, print_function

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

WAYS = {
    "floor": lambda ts: tf.reduce_sum(ts[0]),
    "add_n": lambda ts: tf.reduce_sum(tf.add_n(ts)),
    "add_n_tree": lambda ts: tf.reduce_sum(tf.add_n(
        [tf.add_n(ts[i:i + 64]) for i in range(0, len(ts), 64)])),
    "stack": lambda ts: tf.reduce_sum(tf.stack(ts)),
    "concat": lambda ts: tf.reduce_sum(tf.concat(ts, 0)),
    "per_tensor": lambda ts: tf.add_n([tf.reduce_sum(t) for t in ts]),
}


def _timer(way, count, side, copies):
    graph = tf.Graph()
    with graph.as_default():
        init = tf.random_normal_initializer(seed=0)
        if way == "floor":
            tensors = [tf.get_variable("buffer", [count * side * side], initializer=init)
                       .read_value()]
        else:
            tensors = [tf.get_variable("g%d" % i, [side, side], initializer=init).read_value()
                       for i in range(count)]
        previous, outs = None, []
        for _ in range(copies):
            with tf.control_dependencies([previous] if previous is not None else []):
                previous = WAYS[way](tensors)
            outs.append(previous)
        init_op = tf.global_variables_initializer()
    config = tf.ConfigProto(intra_op_parallelism_threads=2, inter_op_parallelism_threads=2)
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    sess = tf.Session(graph=graph, config=config)
    sess.run(init_op)
    return sess, sess.make_callable(outs[0]), sess.make_callable(outs[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--side", type=int, default=19)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--copies", type=int, default=20)
    args = parser.parse_args(argv)
    tf.disable_eager_execution()
    timers = dict((way, _timer(way, args.tensors, args.side, args.copies)) for way in WAYS)
    samples = dict((way, []) for way in WAYS)
    for _ in range(args.rounds):
        for way, (_, one, many) in timers.items():
            one()
            many()
            ones, manys = [], []
            for _ in range(15):
                start = time.perf_counter()
                one()
                ones.append(time.perf_counter() - start)
                start = time.perf_counter()
                many()
                manys.append(time.perf_counter() - start)
            samples[way].append((np.median(manys) - np.median(ones)) / (args.copies - 1))
    floor = np.median(samples["floor"])
    print("%d float32 tensors of %dx%d (%.2f MB); TF %s; load %s" % (
        args.tensors, args.side, args.side, args.tensors * args.side ** 2 * 4 / 1e6,
        tf.__version__, " ".join(open("/proc/loadavg").read().split()[:3])))
    for way in WAYS:
        value = np.median(samples[way])
        print("%-11s %8.1f us  %6.2fx the read floor" % (way, value * 1e6, value / floor))
    for sess, _, _ in timers.values():
        sess.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
