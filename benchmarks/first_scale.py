"""Start-up skips with and without a measured first scale (issue 31).

``build(measure_first_scale=True)`` sets each manager's first scale from the
first run's float32 view: the largest power of two under which every
gradient the float16 backprop holds stays below 65504 / 2 (margin 1). This
benchmark counts the skipped steps in the first RUNS runs, with and without
it, on:

* the demo GAN: ``examples/gan/dcgan.py``'s model and optimizers, fp16, with
  its default manager (``DynamicLossScaleManager(2**15)``, growth after 1000
  steps), batch and session configuration, one joint step per run;
* a two-group model started as ModelZoo scripts start: the benchmark's
  float16 MLP GAN (``benchmarks/gan.py``, medium size) under
  ``ExponentialUpdateLossScaleManager(2**32, 1000,
  decr_every_n_nan_or_inf=2, decr_ratio=0.5)``, once with one joint step per
  run and once alternating the two groups' ``per_group`` ops (D, then G: two
  runs a step), as the ModelZoo GAN scripts do.

The demo GAN is measured with margins 1 (the default) and 2, the MLP GAN
with margin 1.

The variants of a model (not measured, and measured with each margin) are
built in graphs of their own and run in turn, run by run, so that the load of
the shared machine falls on them alike. Reported per variant: the skipped
steps and the runs that skipped (a run whose update did not apply), the scale
after run 1 and after the last run, the median time of runs 2..RUNS (the
measurement runs in run 1) and the time of run 1, and the ratio of its median
to the unmeasured variant's.

Run from the repository root (about 3 minutes on 2 cores)::

  .venv/bin/python benchmarks/first_scale.py
  .venv/bin/python benchmarks/first_scale.py --runs 20 --out /tmp/fs  # a smoke run

Writes first_scale.json and first_scale.md to --out (default benchmarks/).
"""

from __future__ import absolute_import, division, print_function

import argparse
import collections
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GAN_EXAMPLE = os.path.join(REPO, "examples", "gan")
sys.path.insert(0, REPO)
sys.path.insert(1, GAN_EXAMPLE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow.compat.v1 as tf  # noqa: E402

import npu_lossscale as nl  # noqa: E402
from benchmarks import gan as mlp_gan  # noqa: E402
from benchmarks import record  # noqa: E402

RUNS = 200
#: How ModelZoo's Ascend GAN scripts start (tests/data/modelzoo_dcgan.py).
MODELZOO_MANAGER = dict(init_loss_scale=2 ** 32, incr_every_n_steps=1000,
                        decr_every_n_nan_or_inf=2, decr_ratio=0.5)
MLP_SIZE = "medium"
MLP_LEARNING_RATE = 2e-4  # ModelZoo's DCGAN Adam rate, beta1 0.5
MLP_BETA1 = 0.5
#: The variants: not measured (None), and measured with these margins (1
#: is build()'s default).
DEMO_MARGINS = (None, 1, 2)
MLP_MARGINS = (None, 1)

Result = collections.namedtuple(
    "Result", ["model", "loop", "margin", "runs", "skipped", "skipped_runs", "scale_after_run_1",
               "scale_at_end", "median_seconds", "first_seconds"])

#: One variant's step: ``run(index)`` gives the op and the feed of run
#: ``index``; ``skipped`` counts the skipped steps (read before the run's
#: own count) and ``manager`` holds the scale.
Variant = collections.namedtuple("Variant", ["run", "skipped", "manager"])


def demo_gan(margin, args, images):
    """dcgan.py's model, manager, optimizers and batches (its Graph without
    the samples, summaries and moving average, which a skip leaves alone)."""
    import cli
    import dcgan
    import networks
    real = tf.placeholder(tf.float32, [None, 16, 16, 1], name="real")
    d_loss, g_loss = networks.dcgan_losses(tf, real, tf.float16, cli.conv_impl(args))
    manager = cli.make_manager(nl, args.loss_scale)
    scaler = nl.MultiOptimizerLossScale(manager, backend=args.backend)
    scaler.add(d_loss, tf.train.AdamOptimizer(args.learning_rate, beta1=dcgan.ADAM_BETA1),
               var_list=tf.trainable_variables("discriminator"), name="discriminator")
    scaler.add(g_loss, tf.train.AdamOptimizer(args.learning_rate, beta1=dcgan.ADAM_BETA1),
               var_list=tf.trainable_variables("generator"), name="generator")
    train = scaler.build(global_step=tf.train.get_or_create_global_step(),
                         **_first_scale(margin))
    rng = np.random.RandomState(args.seed)
    batches = [images[rng.randint(0, len(images), args.batch_size)] for _ in range(args.runs)]
    return Variant(lambda index: (train.update_op, {real: batches[index]}),
                   train.skipped_steps, manager)


def _first_scale(margin):
    """build()'s arguments: no measurement for None, else with ``margin``."""
    if margin is None:
        return {}
    return dict(measure_first_scale=True, first_scale_margin=margin)


def modelzoo_mlp(margin, alternating):
    """The float16 MLP GAN under ModelZoo's start: one joint step per run,
    or the groups' per_group ops in turn, one per run."""
    model = mlp_gan.build(mlp_gan.SIZES[MLP_SIZE])
    manager = nl.ExponentialUpdateLossScaleManager(**MODELZOO_MANAGER)
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    for group in model.groups:
        scaler.add(group.loss, tf.train.AdamOptimizer(MLP_LEARNING_RATE, beta1=MLP_BETA1),
                   var_list=group.var_list, name=group.name)
    train = scaler.build(global_step=tf.train.get_or_create_global_step(),
                         per_group_ops=alternating, **_first_scale(margin))
    order = [group.name for group in model.groups]
    if alternating:
        return Variant(lambda index: (train.per_group[order[index % len(order)]], None),
                       train.skipped_steps, manager)
    return Variant(lambda index: (train.update_op, None), train.skipped_steps, manager)


class _Session(object):
    """A variant built in a graph of its own, with its session."""

    def __init__(self, build, margin, config):
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.set_random_seed(0)
            self.variant = build(margin)
            init = tf.global_variables_initializer()
        self.session = tf.Session(graph=self.graph, config=config)
        self.session.run(init)
        self.counts = []  # the skip count before each run
        self.scale_after_run_1 = None

    def run(self, index):
        """Run ``index``; its seconds."""
        op, feed = self.variant.run(index)
        began = time.time()
        self.counts.append(self.session.run([op, self.variant.skipped], feed)[1])
        seconds = time.time() - began
        if index == 0:
            self.scale_after_run_1 = float(self.session.run(self.variant.manager.loss_scale))
        return seconds

    def finish(self):
        """(the runs that skipped, the manager's scale) now."""
        skipped, scale = self.session.run([self.variant.skipped,
                                           self.variant.manager.loss_scale])
        counts = self.counts + [skipped]
        return ([index + 1 for index in range(len(self.counts))
                 if counts[index + 1] > counts[index]], float(scale))


def run_variants(model, loop, build, margins, config, runs):
    """One variant per margin (None: not measured), run by run in turn."""
    sessions = [_Session(build, margin, config) for margin in margins]
    try:
        times = [[] for _ in sessions]
        for index in range(runs):
            for slot, session in enumerate(sessions):
                times[slot].append(session.run(index))
        ends = [session.finish() for session in sessions]
    finally:
        for session in sessions:
            session.session.close()
    return [Result(model, loop, margin, runs, len(ends[slot][0]), ends[slot][0],
                   sessions[slot].scale_after_run_1, ends[slot][1],
                   float(np.median(times[slot][1:])), times[slot][0])
            for slot, margin in enumerate(margins)]


def _markdown(result):
    lines = ["Measured %s on %s (%s), TF %s; the 1-minute load average was %s at the start "
             "and %s at the end (other agents share the cores: the variants of a model run "
             "in turn, run by run, so the load falls on them alike)." % (
                 result["date"], result["machine"], result["cpus"], result["tensorflow"],
                 result["load_average"], result["load_average_end"]), "",
             "| model | loop | first scale | skipped in %d runs (which) | scale after run 1 "
             "| scale after run %d | s/run (median, runs 2-%d) | run 1 (s) | time ratio |" % (
                 result["runs"], result["runs"], result["runs"]),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = result["results"]
    for row in rows:
        base = [r for r in rows if (r["model"], r["loop"], r["margin"])
                == (row["model"], row["loop"], None)][0]
        runs = ", ".join(str(run) for run in row["skipped_runs"][:3])
        if len(row["skipped_runs"]) > 3:
            runs += ", ..., %d" % row["skipped_runs"][-1]
        lines.append("| %s | %s | %s | %d%s | %s | %s | %.4f | %.3f | %.3f |" % (
            row["model"], row["loop"],
            "as started" if row["margin"] is None else "measured, margin %d" % row["margin"],
            row["skipped"], " (%s)" % runs if runs else "",
            record.power_of_two(row["scale_after_run_1"]), record.power_of_two(row["scale_at_end"]),
            row["median_seconds"], row["first_seconds"],
            row["median_seconds"] / base["median_seconds"]))
    lines += ["", "A run skipped when its update did not apply (runs counted from 1; "
              "alternating: one group's per_group op per run, D then G). The time ratio is "
              "the median s/run over the model's unmeasured variant; run 1 holds the "
              "session's first-run set-up and, when measured, the measurement."]
    return "\n".join(lines) + "\n"



def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=RUNS, help="runs per variant")
    parser.add_argument("--out", default=HERE, help="where first_scale.json/.md go")
    args = parser.parse_args(argv)
    tf.disable_eager_execution()
    tf.logging.set_verbosity(tf.logging.ERROR)
    import cli
    import dcgan
    import runtime
    gan_args = cli.parse_dcgan_args(dcgan.PROG, dcgan.__doc__, [])
    gan_args.runs = args.runs
    images = dcgan.load_data(None)[0]
    config = runtime.session_config(tf, gan_args)
    result = record.machine(tf.__version__)
    result.update(runs=args.runs, modelzoo_manager=MODELZOO_MANAGER, mlp_size=MLP_SIZE,
                  demo_manager=cli.describe_loss_scale(gan_args.loss_scale))
    began = time.time()
    rows = run_variants("demo GAN (dcgan.py, fp16)", "joint",
                        lambda margin: demo_gan(margin, gan_args, images), DEMO_MARGINS,
                        config, args.runs)
    for loop in ("joint", "alternating"):
        rows += run_variants(
            "MLP GAN at 2**32 (ModelZoo start)", loop,
            lambda margin, loop=loop: modelzoo_mlp(margin, loop == "alternating"),
            MLP_MARGINS, config, args.runs)
    result["results"] = [row._asdict() for row in rows]
    result["wall_seconds"] = round(time.time() - began, 1)
    record.write(result, args.out, "first_scale", _markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
