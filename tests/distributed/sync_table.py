"""Issue 27's table, run: loss-scale wrappers and SyncReplicasOptimizer in one
process, with the real token queue and accumulators, an inf at step 2.

Each scenario builds its own graph and trains it with ``MonitoredTrainingSession``
and the SyncReplicasOptimizer's hook (this process is the chief and the only
worker: ``replicas_to_aggregate=1``, no initial tokens, so each run returns
once the chief has applied, or skipped, that run's gradients). A run that does
not return within ``--hang-ms`` counts as a hang: its blocked queue-runner
thread is left behind, and the process ends with ``os._exit`` once every
scenario has run. One JSON line per scenario goes to OUT:

  {"scenario": ..., "outcome": "ran" | "hung" | "error", "records": [...],
   "hung_at": step, "error": message}

Each record holds, after a step: the global step, the loss scale, the weights
and (for the builder) ``skipped_steps``.

With ``--saturation`` the npu shim runs in saturation mode
(NPU_SHIM_OVERFLOW_MODE=saturation must be set) and the model computes in
float16: the poisoned step's 1e5 saturates to 65504, a finite value that only
the float-status register sees.

Usage: sync_table.py OUT SCENARIO [SCENARIO ...] [--hang-ms N] [--saturation]
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

from graph_mode import set_graph_mode  # noqa: E402

set_graph_mode()

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402
from tensorflow.python.training.experimental import loss_scale as tf_loss_scale  # noqa: E402

import npu_lossscale as nl  # noqa: E402

STEPS, POISON_STEP = 6, 2
#: The global step "builder_requested" asks to skip (the fifth run's).
REQUESTED_STEP = 4
W0, X = [1.0, 2.0], [0.25, 0.5]
LEARNING_RATE = 1.0


class CountingWrapper(tf.train.Optimizer):
    """TF's MixedPrecisionLossScaleOptimizer, with global_step advanced on
    every step (applied or skipped) after it: the issue's working row."""

    def __init__(self, mixed):
        super(CountingWrapper, self).__init__(False, "Counting")
        self._mixed = mixed

    def compute_gradients(self, *args, **kwargs):
        return self._mixed.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        applied = self._mixed.apply_gradients(grads_and_vars, name=name)
        with tf.control_dependencies([applied]):
            return tf.assign_add(global_step, 1).op


def _sgd():
    return tf.train.GradientDescentOptimizer(LEARNING_RATE)


def _manager():
    return nl.DynamicLossScaleManager(initial_scale=1024, growth_steps=1000)


def _tf_mixed():
    scale = tf_loss_scale.DynamicLossScale(initial_loss_scale=1024, increment_period=1000)
    return tf.train.experimental.MixedPrecisionLossScaleOptimizer(_sgd(), scale), scale


def build(scenario, loss, w, gs):
    """Returns (sync optimizer, train op, scale tensor, the builder's reads of
    its counters or None)."""
    if scenario in ("builder", "builder_requested"):
        manager = _manager()
        sync = nl.SyncReplicasOptimizer(_sgd(), replicas_to_aggregate=1)
        scaler = nl.MultiOptimizerLossScale(manager)
        scaler.add(loss, sync, var_list=[w], name="model")
        requested = [REQUESTED_STEP] if scenario == "builder_requested" else None
        train = scaler.build(global_step=gs, count_skipped_steps=True,
                             skip_global_steps=requested)
        return sync, train.update_op, manager.get_loss_scale(), {
            "skipped_steps": train.skipped_steps,
            "last_skip": train.diagnosis.last_skip.number,
            "last_reason": train.diagnosis.last_skip.reason}
    if scenario == "ours_outside":
        manager = _manager()
        sync = nl.SyncReplicasOptimizer(_sgd(), replicas_to_aggregate=1)
        opt = nl.LossScaleOptimizer(sync, manager, count_skipped_steps=True)
        return sync, opt.minimize(loss, global_step=gs), manager.get_loss_scale(), None
    if scenario in ("ours_inside", "ours_inside_is_finite"):
        manager = _manager()
        backend = "is_finite" if scenario == "ours_inside_is_finite" else "auto"
        sync = tf.train.SyncReplicasOptimizer(
            nl.LossScaleOptimizer(_sgd(), manager, count_skipped_steps=True, backend=backend),
            replicas_to_aggregate=1)
        return sync, sync.minimize(loss, global_step=gs), manager.get_loss_scale(), None
    if scenario in ("tf_mixed_precision", "tf_mixed_precision_counting"):
        mixed, scale = _tf_mixed()
        inner = mixed if scenario == "tf_mixed_precision" else CountingWrapper(mixed)
        sync = tf.train.SyncReplicasOptimizer(inner, replicas_to_aggregate=1)
        return sync, sync.minimize(loss, global_step=gs), scale(), None
    raise SystemExit("unknown scenario %r" % scenario)


def run(scenario, hang_ms, saturation=False):
    result = {"scenario": scenario, "records": []}
    with tf.Graph().as_default():
        gs = tf.train.get_or_create_global_step()
        x = tf.placeholder(tf.float32, [2], name="x")
        w = tf.Variable(W0, name="w")
        if saturation:
            loss = tf.reduce_sum(tf.cast(w, tf.float16) * tf.cast(x, tf.float16))
        else:
            loss = tf.reduce_sum(w * x)
        try:
            sync, train, scale, skipped = build(scenario, loss, w, gs)
        except (ValueError, TypeError) as error:
            result.update(outcome="error", error="%s: %s" % (type(error).__name__, error))
            return result
        reads = {"global_step": gs, "scale": scale, "w": w}
        if skipped is not None:
            reads.update(skipped)
        hook = sync.make_session_run_hook(is_chief=True, num_tokens=0)
        session = tf.train.MonitoredTrainingSession(is_chief=True, hooks=[hook],
                                                    stop_grace_period_secs=1)
        options = tf.RunOptions(timeout_in_ms=hang_ms)
        for step in range(STEPS):
            poison = 1e5 if saturation else np.inf
            feed = {x: [poison, X[1]] if step == POISON_STEP else X}
            try:
                session.run(train, feed, options=options)
            except tf.errors.DeadlineExceededError:
                result.update(outcome="hung", hung_at=step)
                return result  # the chief's thread stays blocked; os._exit ends it
            values = session.run(reads)
            result["records"].append(dict(
                (key, np.asarray(value).tolist()) for key, value in values.items()))
        session.close()
    result["outcome"] = "ran"
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--hang-ms", type=int, default=10000)
    parser.add_argument("--saturation", action="store_true")
    args = parser.parse_args()
    if args.saturation:
        sys.path.insert(0, os.path.join(HERE, "..", "..", "shims"))
        import npu_bridge  # noqa: F401  (installs the emulation)
    with open(args.out, "w") as out:
        for scenario in args.scenarios:
            out.write(json.dumps(run(scenario, args.hang_ms, args.saturation)) + "\n")
            out.flush()
    sys.stdout.flush()
    os._exit(0)  # a hung scenario's queue-runner thread would block a normal exit


if __name__ == "__main__":
    main()
