"""One rank of a two-rank data-parallel launch (horovodrun, or one process per
HCCL rank).

Each rank trains the same two-group float16 model on different data through
``MultiOptimizerLossScale(distributed=...)``. Rank 1 injects an overflow at
step 2 (0-based). A launch makes one or more runs (RUNS), each in a graph and
session of its own: every step's decision, scale and global step, and the
final weights, go to ``<out>/<run>/rank<R>.json``; ``<out>/rank<R>.progress``
gets a line per finished step so a hung launch can say which rank stalled.
Under accumulation the first micro-batches of a window run ``accumulate_op``
and the last ``update_op``; each record counts the collectives that run
executed. Several runs share one launch because starting the ranks (TF's
import in each) costs more than a run.

Usage: dp_worker.py OUT_DIR [--engine horovod|hccl] [RUN ...]   (default: plain)

``--engine hccl`` runs on the npu shim's multi-process HcomAllReduce instead
(started once per rank with RANK_ID, RANK_SIZE and NPU_SHIM_HCCL_DIR, no
Horovod needed).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graph_mode import import_tensorflow  # noqa: E402

tf = import_tensorflow()

import npu_lossscale as nl  # noqa: E402
from models import add_gan_groups, two_group_gan  # noqa: E402

INJECT_RANK, INJECT_STEP = 1, 2
#: The runs a launch can make: whether gradients are all-reduced, the
#: accumulation window, the steps.
RUNS = {
    "plain": dict(allreduce=True, accumulate=1, steps=4),
    "no_allreduce": dict(allreduce=False, accumulate=1, steps=4),
    "accumulate": dict(allreduce=True, accumulate=2, steps=6),
}
SHIMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shims")


class Horovod(object):
    """Rank, broadcast and collective op types of a horovodrun worker."""

    name = "horovod"
    backend = "is_finite"
    poison = np.inf

    def __init__(self):
        import horovod.tensorflow as hvd
        hvd.init()
        self._hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()

    def broadcast(self):
        return self._hvd.broadcast_global_variables(0)

    @staticmethod
    def is_collective(op):
        return op.type.startswith("Horovod")


class Hccl(object):
    """An HCCL worker on the npu shim (RANK_ID, RANK_SIZE, NPU_SHIM_HCCL_DIR).

    The shim runs in saturation mode (NPU_SHIM_OVERFLOW_MODE=saturation): the injected
    overflow saturates to a finite 65504, so only this rank's float-status
    register sees it, and the other rank learns of it through the summed flag.
    """

    name = "hccl"
    backend = "npu"
    poison = 1e5  # float16 max is 65504

    def __init__(self):
        sys.path.insert(0, SHIMS)
        import npu_bridge  # noqa: F401  (installs the emulation)
        self.rank, self.size = int(os.environ["RANK_ID"]), int(os.environ["RANK_SIZE"])

    @staticmethod
    def broadcast():
        return None  # same seed on every rank: the initial weights are equal

    @staticmethod
    def is_collective(op):
        return op.name.rsplit("/", 1)[-1].startswith("HcomAllReduce")


def train(engine, name, allreduce, accumulate, steps, out, progress):
    """One run in a graph of its own; writes ``<out>/<name>/rank<R>.json``."""
    rank = engine.rank
    with tf.Graph().as_default() as graph:
        model = two_group_gan(compute_dtype=tf.float16, seed=1)  # same init on every rank
        manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 10, growth_steps=100)
        scaler = nl.MultiOptimizerLossScale(manager, backend=engine.backend,
                                            distributed=engine.name,
                                            allreduce_gradients=allreduce)
        add_gan_groups(scaler, model)
        gs = tf.train.get_or_create_global_step()
        train_ops = scaler.build(global_step=gs, accumulation_steps=accumulate)
        broadcast = engine.broadcast()
        collectives = set(op.name for op in graph.get_operations() if engine.is_collective(op))
        trace = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)

        data = np.random.RandomState(100 + rank)  # different data per rank
        records = []
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            if broadcast is not None:
                sess.run(broadcast)
            for step in range(steps):
                feed = {model.x: data.normal(0, 1, [8, 4]).astype(np.float32)}
                if rank == INJECT_RANK and step == INJECT_STEP:
                    feed[model.poison_g] = engine.poison
                meta = tf.RunMetadata()
                if step % accumulate == accumulate - 1:  # closes a window
                    fetches = {"update": train_ops.update_op, "finite": train_ops.is_finite,
                               "scale_used": train_ops.loss_scale,
                               "applied": train_ops.applied}
                else:  # local accumulation: no collective may run
                    fetches = {"update": train_ops.accumulate_op,
                               "scale_used": train_ops.loss_scale}
                result = sess.run(fetches, feed, options=trace, run_metadata=meta)
                executed = set(node.node_name for dev in meta.step_stats.dev_stats
                               for node in dev.node_stats)
                scale_now, step_now = sess.run([manager.get_loss_scale(), gs])
                records.append({"step": step, "finite": bool(result.get("finite", True)),
                                "applied": bool(result.get("applied", False)),
                                "scale_used": float(result["scale_used"]),
                                "scale_after": float(scale_now),
                                "global_step": int(step_now),
                                "collectives": len(executed & collectives)})
                progress.write("%s step %d\n" % (name, step))
                progress.flush()
            weights = {v.op.name: sess.run(v).tolist() for v in model.d_vars + model.g_vars}
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "rank%d.json" % rank), "w") as handle:
        json.dump({"rank": rank, "size": engine.size, "records": records,
                   "weights": weights}, handle)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("runs", nargs="*", choices=sorted(RUNS), default=["plain"])
    parser.add_argument("--engine", choices=("horovod", "hccl"), default="horovod")
    args = parser.parse_intermixed_args()

    tf.disable_eager_execution()
    engine = (Horovod if args.engine == "horovod" else Hccl)()
    with open(os.path.join(args.out, "rank%d.progress" % engine.rank), "w") as progress:
        for name in args.runs:
            train(engine, name, out=args.out, progress=progress, **RUNS[name])


if __name__ == "__main__":
    main()
