"""Where the builder's step overhead goes: a ladder from the floor to the builder.

  python benchmarks/ablation.py [--model medium] [--rounds 300] [--steps 10] [--out DIR]

`make bench` runs it at the end of run.py, in the same process.

Each rung adds one piece of the builder to the floor step of ``variants.py``
(same model, same Adam per group, all gradients before any apply):

1. ``floor``: no loss scaling.
2. ``+scale``: the loss multiplied (in float32) by a scale read from a
   variable at run time, as every dynamic loss scaling must; the scaled
   gradients are applied as they are (the scale, 2**15, does not overflow
   this model, and the timing does not depend on the values).
3. ``+unscale``: the gradients multiplied by the reciprocal scale (packed as
   the builder packs them) before the applies.
4. ``+check``: the overflow flag of the builder's backend
   (``IsFiniteBackend``), stored in a variable so that Grappler keeps it; the
   applies wait for it but do not depend on its value.
5. ``+gate``: ``MultiOptimizerLossScale`` with a ``FixedLossScaleManager``:
   the applies and the step increment behind the gate on the flag (the
   rungs above, plus the decision; no scale update).
6. ``builder``: the full builder with ``DynamicLossScaleManager`` (the
   manager's update added).

Beside the ladder, ``builder, gate='cond'`` is the full builder with the
``tf.cond`` gate (a functional ``If`` under control flow v2) that Ascend needs
where it rejects raw Switch/Merge; its ``added`` is against ``builder``.

The rungs are timed as ``run.py`` times its variants (own graph and session
each, round-robin, per-round paired ratios to the floor). The difference
between neighbouring rungs is that piece's cost; executed ops are counted
from one FULL_TRACE step. Writes ``ablation.json`` and ``ablation.md``.
"""

from __future__ import absolute_import, division, print_function

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # as run.py (see ONEDNN_NOTE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gan  # noqa: E402
import harness  # noqa: E402
import variants  # noqa: E402
from variants import nl, nl_backends  # noqa: E402
from npu_lossscale.core import gradients as nl_gradients  # noqa: E402  (the builder's own packing)


def _ungated_step(model, unscale=False, check=False):
    """The floor with the loss scaled by a runtime scale (a variable read),
    plus the unscale and/or the check if asked; never gated."""
    scale = tf.Variable(variants.INITIAL_SCALE, trainable=False, name="scale")
    scale_read = scale.read_value()
    grads = variants._shared_gradients(  # pylint: disable=protected-access
        model.groups, lambda loss: nl_gradients.scale_loss(loss, scale_read))
    all_grads = [g for gv in grads.values() for g, _ in gv]
    packing = nl_gradients.Packing([all_grads])
    after = list(all_grads)
    if check:
        flag = nl_backends.IsFiniteBackend().overflow_flag(packing.to_check(all_grads))
        # Stored, so that Grappler cannot prune a check nothing reads.
        sink = tf.Variable(0.0, trainable=False, name="flag_sink")
        after.append(tf.assign(sink, flag).op)
    if unscale:
        inv = nl_gradients.Scale(scale_read, tf.reciprocal(scale_read), False)
        grads = dict((name, packing.unscale(pairs, inv)) for name, pairs in grads.items())
    return variants.apply_after(model, grads, after)


def _builder_fixed(model):
    return variants.build_builder(
        model, manager=nl.FixedLossScaleManager(variants.INITIAL_SCALE))


RUNGS = [
    ("floor", variants.build_floor),
    ("+scale", lambda m: _ungated_step(m)),
    ("+unscale", lambda m: _ungated_step(m, unscale=True)),
    ("+check", lambda m: _ungated_step(m, unscale=True, check=True)),
    ("+gate", _builder_fixed),
    ("builder", variants.build_builder),
    # Not a rung: the same builder with the tf.cond gate Ascend needs where it
    # rejects raw Switch/Merge (a functional If under control flow v2).
    ("builder, gate='cond'", lambda m: variants.build_builder(m, gate="cond")),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="medium", choices=list(gan.SIZES))
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=HERE)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tf.disable_eager_execution()
    random.seed(0)
    spec = gan.SIZES[args.model]
    timed, ops = {}, {}
    for name, build in RUNGS:
        graph, built, _ = harness.build_graph(spec, build, 0)
        timed[name] = harness.Timed(name, graph, built.train_op)
        timed[name].warm_up(5)
        ops[name], _ = harness.traced_op_count(timed[name].sess, built.train_op)
    start = time.time()
    load_start = " ".join(open("/proc/loadavg").read().split()[:3])
    for _ in range(args.rounds):
        order = list(timed)
        random.shuffle(order)
        for name in order:
            timed[name].run_round(args.steps)
    medians = dict((name, t.round_medians()) for name, t in timed.items())
    rows = []
    previous = None
    for name, _ in RUNGS:
        ratio = medians[name] / medians["floor"]
        step_ms = float(np.median(medians[name]) * 1e3)
        ratio_med, ratio_iqr = harness.median_iqr(ratio)
        added = None if previous is None else harness.median_iqr(
            (medians[name] - medians[previous]) * 1e6)
        rows.append({"rung": name, "ms": step_ms, "x_floor": ratio_med, "x_floor_iqr": ratio_iqr,
                     "added_us": None if added is None else added[0],
                     "added_us_iqr": None if added is None else added[1],
                     "executed_ops": ops[name],
                     "added_ops": None if previous is None else ops[name] - ops[previous]})
        previous = name
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "tensorflow": tf.__version__,
            "model": args.model, "rounds": args.rounds, "steps": args.steps,
            "load_avg_start": load_start,
            "load_avg_end": " ".join(open("/proc/loadavg").read().split()[:3]),
            "runtime_s": round(time.time() - start, 1)}
    with open(os.path.join(args.out, "ablation.json"), "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=2)
    lines = ["# Where the builder's overhead goes (%s GAN)" % args.model, "",
             "%(date)s; TensorFlow %(tensorflow)s; %(rounds)d rounds x %(steps)d steps; "
             "load %(load_avg_start)s at start, %(load_avg_end)s at end." % meta, "",
             "Each rung adds one piece to the one above (see ablation.py). `added` is the "
             "median over rounds of the per-round difference to the rung above (IQR).", "",
             "| rung | ms/step | x floor (IQR) | added us (IQR) | executed ops | added ops |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append("| %s | %.2f | %.3f (%.3f) | %s | %d | %s |" % (
            row["rung"], row["ms"], row["x_floor"], row["x_floor_iqr"],
            "" if row["added_us"] is None else "%.0f (%.0f)" % (row["added_us"],
                                                                 row["added_us_iqr"]),
            row["executed_ops"], "" if row["added_ops"] is None else "%+d" % row["added_ops"]))
    with open(os.path.join(args.out, "ablation.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    for t in timed.values():
        t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
