"""ListeningLossScaleManager against DynamicLossScaleManager (issue 26, item 5).

Two models, each from two starting scales (2**15, Keras' default, and 1, a
scale that has collapsed or was never set):

* the seed-000 net: seed 000's float16 conv3d net at small size, regressing
  a fixed teacher's output; its loss is multiplied by 1e-5 so that, as in
  the seed's 256x368x368 volume, every gradient element is below float16's
  smallest subnormal at scale 1. Plain gradient descent (its step is
  proportional to the gradient, so flushed gradients are lost steps); a
  float32 twin of the same net gives the reference loss. Once with the
  loss in float16, as in the seed (the backprop then starts from the scale
  in float16, which caps every scale below 2**16), once with it in float32,
  as docs/managers.md recommends;
* the demo GAN: ``examples/gan/dcgan.py`` (2000 steps, its defaults) with
  ``--loss-scale dynamic[:1]`` and ``listening[:1]``.

Per run: the steps to a healthy scale (the measured step from which on at
most 1 % of the gradient elements that float32 keeps non-zero underflow in
float16, flushed to zero or subnormal, at every measurement; for the seed
net also the step from which on at most 1 % are flushed; the seed net is
measured every step, the GAN every 20), the skipped steps, the final scale
and the final score (the seed net: its loss in float32 over the float32
twin's; the GAN: the inception-style score).

Run from the repository root (about 15 minutes on 2 cores; the GAN runs
dominate)::

  .venv/bin/python benchmarks/listening.py            # both models
  .venv/bin/python benchmarks/listening.py --no-gan   # the seed net only
  .venv/bin/python benchmarks/listening.py --gan-out runs/listening  # keep curves.png

Writes benchmarks/listening.json and benchmarks/listening.md.
"""

from __future__ import absolute_import, division, print_function

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow.compat.v1 as tf  # noqa: E402

import npu_lossscale as nl  # noqa: E402
from benchmarks import record  # noqa: E402

#: The seed net's loss factor: with it every float16 gradient element is
#: below 2**-24 at scale 1 (the seed's volume did that by its size).
TINY = 1e-5
#: Gradient descent's learning rate on the seed net (its gradients carry
#: TINY): the float32 twin's loss falls about 20x in STEPS steps.
LEARNING_RATE = 3e4
STEPS = 300
#: At most this share of what float32 keeps non-zero flushed: healthy.
HEALTHY = 0.01
STARTS = (2.0 ** 15, 1.0)
#: Keras' growth period, the library's default.
GROWTH_STEPS = 2000

SeedRun = collections.namedtuple(
    "SeedRun", ["loss_dtype", "manager", "start", "unflushed_step", "healthy_step",
                "skipped", "final_scale", "final_underflow", "loss", "relative_loss"])


def _seed_net(dtype, loss_dtype=None, seed=0):
    """The student's loss (in ``loss_dtype``, by default ``dtype``) and its
    float32 variables; it computes in ``dtype``."""
    rng = np.random.RandomState(seed)
    volume = tf.constant(rng.uniform(-1.0, 1.0, [1, 8, 8, 8, 1]), dtype)
    shapes = [[3, 3, 3, 1, 4], [3, 3, 3, 4, 4]]

    def net(kernels):
        x = tf.tanh(tf.nn.conv3d(volume, kernels[0], [1] * 5, "SAME"))
        return tf.nn.conv3d(x, kernels[1], [1] * 5, "SAME")

    target = net([tf.constant(rng.normal(0.0, 0.3, shape), dtype) for shape in shapes])
    with tf.variable_scope("student", reuse=tf.AUTO_REUSE):
        weights = [tf.get_variable("conv%d" % i, initializer=rng.normal(
            0.0, 0.3, shape).astype(np.float32)) for i, shape in enumerate(shapes)]
    output = net([tf.cast(w, dtype) for w in weights])
    loss_dtype = loss_dtype or dtype
    error = tf.cast(output, loss_dtype) - tf.cast(target, loss_dtype)
    loss = tf.reduce_mean(tf.square(error)) * tf.cast(TINY, loss_dtype)
    return loss, weights


def seed_run(make_manager, name, start, loss_dtype=tf.float16):
    """Trains the seed net in float16 (or float32 when ``make_manager`` is
    None) for STEPS steps."""
    with tf.Graph().as_default():
        dtype = tf.float32 if make_manager is None else tf.float16
        loss, weights = _seed_net(dtype, loss_dtype)
        loss32, _ = _seed_net(tf.float32)  # the same variables, in float32
        optimizer = tf.train.GradientDescentOptimizer(LEARNING_RATE)
        if make_manager is None:
            train_op = optimizer.minimize(loss, var_list=weights)
            fetches, underflow = [train_op], None
        else:
            scaler = nl.MultiOptimizerLossScale(make_manager(start), backend="is_finite")
            scaler.add(loss, optimizer, var_list=weights, name="net")
            train = scaler.build(measure_underflow=True)
            fetches = [train.update_op, train.is_finite, train.loss_scale]
            underflow = train.underflow["net"]
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            flushed, underflowed, skipped, scale, share = [], [], 0, None, None
            for _ in range(STEPS):
                if underflow is None:
                    sess.run(fetches)
                    continue
                _, finite, scale, measured = sess.run(fetches + [underflow])
                skipped += int(not finite)
                flushed.append(measured.flushed_share)
                underflowed.append(measured.flushed_share + measured.subnormal_share)
            final = float(sess.run(loss32))
            if underflow is not None:
                scale = float(sess.run(train.loss_scale))
                measured = sess.run(underflow)
                share = float(measured.flushed_share + measured.subnormal_share)
    return SeedRun(loss_dtype.name, name, start, healthy_from(flushed), healthy_from(underflowed),
                   skipped, scale, share, final, None)


def healthy_from(shares):
    """The first step from which on every share is at most HEALTHY, or None."""
    step = None
    for index, share in enumerate(shares):
        if share > HEALTHY:
            step = None
        elif step is None:
            step = index
    return step


def seed_runs():
    """The float32 twin, then each manager from each start."""
    reference = seed_run(None, "float32", None, tf.float32)
    managers = (
        ("dynamic", lambda start: nl.DynamicLossScaleManager(
            initial_scale=start, growth_steps=GROWTH_STEPS)),
        ("listening", lambda start: nl.ListeningLossScaleManager(
            initial_scale=start, growth_steps=GROWTH_STEPS)),
    )
    runs = []
    for loss_dtype in (tf.float16, tf.float32):
        for start in STARTS:
            for name, make in managers:
                run = seed_run(make, name, start, loss_dtype)
                runs.append(run._replace(relative_loss=run.loss / reference.loss))
    return reference, runs


def gan_runs(out):
    """dcgan.py's defaults under each manager and start; its metrics.json."""
    runs = []
    for start in STARTS:
        for name in ("dynamic", "listening"):
            spec = name if start == 2.0 ** 15 else "%s:%g" % (name, start)
            run_out = os.path.join(out, spec.replace(":", "_"))
            began = time.time()
            subprocess.check_call([sys.executable, os.path.join(REPO, "examples", "gan",
                                                                "dcgan.py"),
                                   "--loss-scale", spec, "--out", run_out])
            with open(os.path.join(run_out, "metrics.json")) as handle:
                metrics = json.load(handle)
            metrics["wall_seconds"] = round(time.time() - began, 1)
            metrics["start"] = start
            metrics["manager"] = name
            runs.append(metrics)
    return runs


def _markdown(result):
    lines = ["Measured %s on %s (%s), TF %s, load average %s at the start, %s at the end." % (
        result["date"], result["machine"], result["cpus"], result["tensorflow"],
        result["load_average"], result.get("load_average_end", "?")), ""]
    lines += ["Seed-000 net (float16 conv3d, %d steps of gradient descent; float32 twin "
              "loss %.4g). Steps to at most 1 %% flushed, and to at most 1 %% underflowed "
              "(flushed or subnormal), of the elements float32 keeps non-zero:"
              % (STEPS, result["seed"]["float32_loss"]), "",
              "| loss | start | manager | steps to <= 1 % flushed | steps to <= 1 % "
              "underflowed | underflowed at the end | skipped | final scale "
              "| final loss / float32's |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in result["seed"]["runs"]:
        lines.append("| %s | %s | %s | %s | %s | %.1f %% | %d | %g | %.3f |" % (
            run["loss_dtype"], record.power_of_two(run["start"]), run["manager"],
            _never(run["unflushed_step"]), _never(run["healthy_step"]),
            100.0 * run["final_underflow"], run["skipped"], run["final_scale"],
            run["relative_loss"]))
    if result.get("gan"):
        lines += ["", "Demo GAN (`examples/gan/dcgan.py`, 2000 steps, measured every 20 "
                  "steps; steps to at most 1 % underflowed in both groups from then on):", "",
                  "| start | manager | steps to <= 1 % underflowed | skipped | final scale "
                  "| inception score | s/step |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for run in result["gan"]:
            lines.append("| %s | %s | %s | %d | %g | %.2f | %.3f |" % (
                record.power_of_two(run["start"]), run["manager"], _never(run["healthy_from_step"]),
                run["skipped_steps"], run["final_loss_scale"], run["inception_score"],
                run["seconds_per_step"]))
    return "\n".join(lines) + "\n"


def _never(step):
    return "never" if step is None else str(step)



def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-gan", action="store_true", help="the seed net only")
    parser.add_argument("--out", default=HERE, help="where listening.json/.md go")
    parser.add_argument("--gan-out", default=None,
                        help="keep the GAN runs' outputs (curves.png, metrics.json, ...) "
                             "here, one folder per run (default: a temporary folder)")
    args = parser.parse_args(argv)
    tf.disable_eager_execution()
    tf.logging.set_verbosity(tf.logging.ERROR)
    result = record.machine(tf.__version__)
    reference, runs = seed_runs()
    result["seed"] = {"float32_loss": reference.loss,
                      "runs": [run._asdict() for run in runs]}
    if not args.no_gan:
        if args.gan_out:
            result["gan"] = gan_runs(args.gan_out)
        else:
            with tempfile.TemporaryDirectory() as out:
                result["gan"] = gan_runs(out)
    record.write(result, args.out, "listening", _markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
