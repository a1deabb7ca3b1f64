"""Check efficiency: the overflow check alone against one read of its bytes.

Definitions (all times are for gradients already in memory, float32):

* ``check``: one call of ``IsFiniteBackend().overflow_flag`` (as it is in
  npu_lossscale/backends.py when the benchmark runs) over tensors with the
  shapes of a model's gradients.
* ``read floor``: one ``reduce_sum`` over a single contiguous float32 buffer
  holding the same number of elements. Any check must read every byte (any
  element may be the inf), and one pass in one kernel over contiguous memory
  is the cheapest read TF can do: no per-tensor op, no extra write. It is the
  physical floor of any check, so ``efficiency = check / read floor`` is 1.0
  for a check that costs nothing but the read.
* references, measured the same way: ``per-tensor sum`` (one ``reduce_sum``
  per tensor, ``add_n``, ``is_finite``: the check before this benchmark) and
  ``stacked all-finite`` (TF's ``_is_all_finite``: ``reduce_all(is_finite)``
  per tensor, ``stack``, ``reduce_all``: what peer A runs).

How one check is timed: the graph reads the tensors from variables once and
chains copies of the check (copy i+1 has a control input on copy i's flag).
Running it fetching copy M and fetching copy 1 differ by exactly ``M - 1``
checks, so ``one check = (t(M) - t(1)) / (M - 1)``: the reads, the session
call and the fetch cancel out. M is calibrated per check so that the M - 1
chained checks take about 3 ms (at most 65 copies), well above the noise of
one session call. Grappler is off in these sessions
only, as it would merge the identical copies; the check graph has no constant
to fold, so the measured graph is the one a training step runs.
"""

from __future__ import absolute_import, division, print_function

import numpy as np
import tensorflow.compat.v1 as tf

import harness
from variants import nl_backends

#: The chain holds at most this many copies of a check, and at most about
#: MAX_CHAIN_TENSORS tensor reads in all (graph size).
MAX_COPIES = 65
MAX_CHAIN_TENSORS = 8000
#: The fetched copy is chosen so that the chained checks take about this long.
TARGET_CHAIN_SECONDS = 0.003

CHECKS = ("check", "per_tensor_sum", "stacked_all_finite", "read_floor")


def _per_tensor_sum(tensors):
    sums = [tf.reduce_sum(t) for t in tensors]
    total = sums[0] if len(sums) == 1 else tf.add_n(sums)
    return 1.0 - tf.cast(tf.is_finite(total), tf.float32)


def _stacked_all_finite(tensors):
    flags = [tf.reduce_all(tf.is_finite(t)) for t in tensors]
    return 1.0 - tf.cast(tf.reduce_all(tf.stack(flags)), tf.float32)


def _check(tensors):
    return nl_backends.IsFiniteBackend().overflow_flag(tensors)


def _read_floor(tensors):
    return tf.reduce_sum(tensors[0])


_FUNCTIONS = {"check": _check, "per_tensor_sum": _per_tensor_sum,
              "stacked_all_finite": _stacked_all_finite, "read_floor": _read_floor}


def _config():
    config = harness.session_config()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config


class CheckTimer(object):
    """One (layout, check kind): a graph with M chained checks, two callables."""

    def __init__(self, layout, kind, shapes, seed=0):
        self.layout = layout
        self.kind = kind
        self.graph = tf.Graph()
        with self.graph.as_default():
            init = tf.random_normal_initializer(seed=seed)
            if kind == "read_floor":
                total = int(sum(np.prod(s) for s in shapes))
                tensors = [tf.get_variable("buffer", [total], tf.float32, init).read_value()]
            else:
                tensors = [tf.get_variable("g%d" % i, list(s), tf.float32, init).read_value()
                           for i, s in enumerate(shapes)]
            copies = max(3, min(MAX_COPIES, MAX_CHAIN_TENSORS // max(1, len(tensors))))
            if kind == "read_floor":
                copies = MAX_COPIES
            flags, previous = [], None
            for _ in range(copies):
                with tf.control_dependencies([previous] if previous is not None else []):
                    previous = _FUNCTIONS[kind](tensors)
                flags.append(previous)
            init_op = tf.global_variables_initializer()
        self.sess = tf.Session(graph=self.graph, config=_config())
        self.sess.run(init_op)
        self.flags = flags
        self.one = self.sess.make_callable(flags[0])
        self.copies = len(flags)
        self.many = self.sess.make_callable(flags[-1])
        self.value = float(self.sess.run(flags[-1]))
        self.samples = []  # per round: one-check time estimate, seconds

    def calibrate(self):
        """Picks M: the fewest copies whose chain takes TARGET_CHAIN_SECONDS."""
        import time  # pylint: disable=import-outside-toplevel
        times = {}
        for index in (0, len(self.flags) - 1):
            call = self.sess.make_callable(self.flags[index])
            call()
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                call()
                samples.append(time.perf_counter() - start)
            times[index] = np.median(samples)
        per_check = max((times[len(self.flags) - 1] - times[0]) / (len(self.flags) - 1), 1e-7)
        copies = int(min(len(self.flags), max(3, np.ceil(TARGET_CHAIN_SECONDS / per_check) + 1)))
        self.copies = copies
        self.many = self.sess.make_callable(self.flags[copies - 1])

    def warm_up(self, steps):
        self.calibrate()
        for _ in range(steps):
            self.one()
            self.many()

    def run_round(self, steps):
        import time  # pylint: disable=import-outside-toplevel
        clock = time.perf_counter
        ones, manys = [], []
        for _ in range(steps):
            start = clock()
            self.one()
            ones.append(clock() - start)
            start = clock()
            self.many()
            manys.append(clock() - start)
        self.samples.append((np.median(manys) - np.median(ones)) / (self.copies - 1))

    def close(self):
        self.sess.close()
