"""A float16 DCGAN on 16x16 handwritten digits, trained through npu_lossscale.

The generator and the discriminator each have their own Adam optimizer. Both
go into one ``MultiOptimizerLossScale``, which gives one update op: every
step is ONE ``session.run(fetch_dict)``, the loop shape of a GAN whose two
optimizers share a fetch dict, with one loss scale and one overflow decision
for both networks (a skipped step changes neither).

``--precision fp16`` computes in float16 with float32 master weights: the
variables are float32 and are cast to float16 in the forward pass; batch-norm
statistics, the discriminator's logits and the losses stay in float32.

Run (about 3 minutes on 2 CPU cores)::

  PYTHONPATH=. python examples/gan/dcgan.py --precision fp16 --out runs/dcgan

Outputs in --out: samples.png, curves.png (losses; the loss scale with each
skip's reason; the underflow measurement, every UNDERFLOW_EVERY steps),
metrics.json, history.json, checkpoints (model.ckpt-*) and TensorBoard
events. --resume continues from the latest checkpoint there (same global
step, loss scale and skipped count).

Data-parallel with Horovod, in the TF 2.15 venv (``make venv215``), where
float16 is much slower on CPU, hence few steps (each rank draws its own
batches; rank 0 alone writes the outputs; every rank prints a digest of its
variables at the end, equal on all ranks)::

  .venv-tf215/bin/horovodrun -np 2 -H localhost:2 --gloo --network-interfaces lo \
      .venv-tf215/bin/python examples/gan/dcgan.py --distributed horovod \
      --steps 20 --out runs/dcgan-dp

Read top-down: ``Graph`` builds the model and hands both losses to the
builder, ``train`` is the loop, ``main`` checks the flags and starts
TensorFlow. The networks are in networks.py, the data in digits.py, the score
in metrics.py, the flags in cli.py, TF/npu_bridge/Horovod set-up and
checkpoints in runtime.py, the figures and JSON files in outputs.py.
"""

from __future__ import absolute_import, division, print_function

import collections
import os
import sys
import time

import numpy as np

import cli
import digits
import metrics
import networks
import outputs
import runtime

PROG = "dcgan.py"
ADAM_BETA1 = 0.5  # the DCGAN paper's momentum
GRID = 8  # the TensorBoard sample grid is GRID x GRID images
# Steps between underflow measurements (TrainOps.underflow: a float32 copy of
# the forward pass and its backprop, about one more step's work): 100 points
# on curves.png over the default 2000 steps, about 5 % more time.
UNDERFLOW_EVERY = 20


class Graph(object):
    """The training graph: the model, ONE update op for both networks, summaries."""

    def __init__(self, tf, nl, args, workers=None):
        dtype = tf.float16 if args.precision == "fp16" else tf.float32
        impl = self.conv_impl = cli.conv_impl(args)
        # Each rank draws its own noise; its initial weights differ too until
        # the broadcast below replaces them with rank 0's.
        tf.set_random_seed(args.seed + (workers.rank if workers else 0))

        # 1. The model: the generator's fakes and the real digits go through
        #    the discriminator; both losses come out in float32.
        self.real = tf.placeholder(tf.float32, [None, 16, 16, 1], name="real")
        self.d_loss, self.g_loss = networks.dcgan_losses(tf, self.real, dtype, impl)
        self.global_step = tf.train.get_or_create_global_step()

        # 2. One builder for both optimizers: one loss scale, one overflow
        #    check, one update op. A skipped step changes neither network.
        #    The underflow measurement runs only on the steps that fetch it.
        self.manager = cli.make_manager(nl, args.loss_scale)
        scaler = nl.MultiOptimizerLossScale(self.manager, backend=args.backend,
                                            distributed=args.distributed)
        scaler.add(self.d_loss,
                   tf.train.AdamOptimizer(args.learning_rate, beta1=ADAM_BETA1),
                   var_list=tf.trainable_variables("discriminator"), name="discriminator")
        scaler.add(self.g_loss,
                   tf.train.AdamOptimizer(args.learning_rate, beta1=ADAM_BETA1),
                   var_list=tf.trainable_variables("generator"), name="generator")
        self.backend = scaler.backend
        # The underflow measurement compares float16 gradients with their
        # float32 view: an fp32 run has no float16 to measure.
        self.train = scaler.build(global_step=self.global_step,
                                  measure_underflow=args.precision == "fp16")
        # The names of TrainOps.diagnosis.skip_reason's codes, for curves.png.
        self.reasons = nl.diagnostics.REASONS

        # 3. What runs with the update: the skipped-step count and the moving
        #    average of the generator's weights (samples come from it).
        self.skipped, self.skipped_total = runtime.skipped_steps_counter(
            tf, self.train.is_finite)
        ema_update, ema_getter = networks.generator_average(tf, self.global_step,
                                                          self.train.update_op)
        self.step_op = tf.group(self.train.update_op, ema_update, self.skipped_total,
                                name="train_step")
        self.current_scale = tf.cast(self.manager.get_loss_scale(), tf.float32)

        # Samples (float32 images in [0, 1]), summaries and checkpoints.
        self.z_eval = tf.placeholder(tf.float32, [None, networks.Z_DIM], name="z_eval")
        grid_z = np.random.RandomState(args.seed + 1).randn(GRID * GRID, networks.Z_DIM)
        self.samples, grid = networks.averaged_samples(tf, ema_getter, self.z_eval, grid_z,
                                                     dtype, impl, GRID)
        self.summary = tf.summary.merge([
            tf.summary.scalar("loss/discriminator", self.d_loss),
            tf.summary.scalar("loss/generator", self.g_loss),
            tf.summary.scalar("loss_scale", self.train.loss_scale),
            tf.summary.scalar("skipped_steps", self.skipped_total),
            tf.summary.image("samples", grid, max_outputs=1),
        ] + (nl.underflow_summaries(self.train.underflow) if self.train.underflow else []))
        self.init = tf.global_variables_initializer()
        self.saver = tf.train.Saver(max_to_keep=3)
        # Every rank starts from rank 0's weights, Adam slots, loss scale and
        # counters (after its initialisation or rank 0's restore).
        self.broadcast = workers.broadcast_global_variables(0) if workers else None
        self.all_variables = tf.global_variables()


# What train() hands to report(): history.json's History, the last step's
# fetches, the samples to score, the final counters and the timing.
Run = collections.namedtuple(
    "Run", "history last samples global_step skipped final_scale progress")


def train(tf, args, graph, config, resume_from, train_images, workers=None):
    """Trains up to --steps; returns a Run, or None on Horovod ranks other than 0."""
    rank = workers.rank if workers else 0
    lead = rank == 0  # the one process that writes outputs and checkpoints
    with tf.Session(config=config) as sess:
        runtime.restore_or_initialize(tf, sess, graph.saver, graph.init,
                                      resume_from if lead else None)
        if graph.broadcast is not None:
            sess.run(graph.broadcast)
        start = runtime.first_step(sess, graph.global_step, graph.skipped, args.steps)
        history = (outputs.load_history(args.out, start) if resume_from and lead
                   else outputs.History())
        writer = (tf.summary.FileWriter(args.out, None if resume_from else sess.graph)
                  if lead else None)
        # A distinct stream per resume point and rank; RandomState takes < 2**32.
        rng = np.random.RandomState((args.seed + 7919 * start + 104729 * rank) % 2 ** 32)
        ckpt_path = os.path.join(args.out, runtime.CHECKPOINT_BASENAME)

        progress = outputs.Progress("dcgan %s" % args.precision, args.steps, initial=start,
                                    disable=not lead)
        result = {}
        for step in range(start, args.steps):
            batch = train_images[rng.randint(0, len(train_images), args.batch_size)]
            fetch_dict = {
                "d_loss": graph.d_loss,
                "g_loss": graph.g_loss,
                "step": graph.global_step,
                "is_finite": graph.train.is_finite,
                "skip_reason": graph.train.diagnosis.skip_reason,
                "loss_scale": graph.train.loss_scale,
                "skipped": graph.skipped_total,
                "train": graph.step_op,  # the ONE update op for both networks
            }
            if lead and ((step + 1) % args.log_every == 0 or step == start):
                fetch_dict["summary"] = graph.summary
            if lead and graph.train.underflow and (step % UNDERFLOW_EVERY == 0
                                                   or step + 1 == args.steps):
                fetch_dict["underflow"] = graph.train.underflow  # this step's gradients
            result = sess.run(fetch_dict, {graph.real: batch})
            progress.update(d_loss="%.3f" % result["d_loss"], g_loss="%.3f" % result["g_loss"],
                            scale="%g" % result["loss_scale"], skipped=int(result["skipped"]))
            history.add_step([step + 1, float(result["d_loss"]), float(result["g_loss"]),
                              float(result["loss_scale"]), int(bool(result["is_finite"])),
                              int(result["skip_reason"])])
            if "underflow" in result:
                history.add_underflow(step + 1, result["underflow"])
            if "summary" in result:
                writer.add_summary(result["summary"], step + 1)
            if lead and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
                graph.saver.save(sess, ckpt_path, global_step=step + 1)
                outputs.save_history(args.out, history)
        progress.close()

        if workers is not None:
            step_now, scale_now, values = sess.run(
                [graph.global_step, graph.current_scale, graph.all_variables])
            print("rank %d/%d: global step %d, loss scale %g, variables digest %s"
                  % (rank, workers.size, step_now, scale_now,
                     runtime.variables_digest(values)))
            sys.stdout.flush()
            if not lead:
                return None
        graph.saver.save(sess, ckpt_path, global_step=args.steps)
        outputs.save_history(args.out, history)
        writer.flush()
        writer.close()
        z = np.random.RandomState(args.seed + 2).randn(args.eval_samples, networks.Z_DIM)
        samples = np.clip(sess.run(graph.samples, {graph.z_eval: z})[..., 0], 0.0, 1.0)
        applied, skipped, final_scale = sess.run(
            [graph.global_step, graph.skipped, graph.current_scale])
    return Run(history, result, samples, applied, skipped, final_scale, progress)


def report(args, graph, run, score_images, score_labels, resume_from, start_time,
           workers=None):
    """Scores the samples; writes samples.png, curves.png, metrics.json; prints."""
    ref = metrics.reference(score_images, score_labels, seed=args.seed)
    score, coverage = ref.classifier.score(run.samples)
    outputs.save_samples_png(os.path.join(args.out, "samples.png"), run.samples)
    outputs.save_curves_png(os.path.join(args.out, "curves.png"), run.history,
                            "DCGAN %s, backend %s, loss scale %s" % (
                                args.precision, graph.backend,
                                cli.describe_loss_scale(args.loss_scale)),
                            graph.reasons)
    per_step = run.progress.seconds_per_step()
    result = {
        "steps": args.steps,
        "steps_this_run": run.progress.steps,
        "global_step": int(run.global_step),
        "skipped_steps": int(run.skipped),
        "final_loss_scale": float(run.final_scale),
        "inception_score": round(score, 4),
        "class_coverage": coverage,
        "real_inception_score": round(ref.real_score, 4),
        "scorer_heldout_accuracy": round(ref.real_accuracy, 4),
        "eval_samples": args.eval_samples,
        "seconds_per_step": round(per_step, 5),
        "train_seconds": round(run.progress.train_seconds(), 2),
        "total_seconds": round(time.time() - start_time, 2),
        "precision": args.precision,
        "backend": graph.backend,
        "device": args.device,
        "conv": graph.conv_impl,
        "loss_scale_manager": cli.describe_loss_scale(args.loss_scale),
        "skips_by_reason": outputs.skips_by_reason(run.history, graph.reasons),
        "underflow": outputs.last_underflow(run.history),
        "healthy_from_step": outputs.healthy_from_step(run.history),
        "batch_size": args.batch_size,
        "ranks": workers.size if workers else 1,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "resumed": bool(resume_from),
        "final_d_loss": float(run.last["d_loss"]),
        "final_g_loss": float(run.last["g_loss"]),
    }
    outputs.write_json(os.path.join(args.out, "metrics.json"), result)
    print("dcgan %s: %d steps (%d skipped), loss scale %g, inception score %.2f "
          "(real digits %.2f), %d/10 classes, %.3f s/step"
          % (args.precision, args.steps, result["skipped_steps"], result["final_loss_scale"],
             score, ref.real_score, coverage, per_step))
    print("outputs in %s: samples.png curves.png metrics.json, checkpoints %s-*, "
          "TensorBoard: tensorboard --logdir %s"
          % (os.path.abspath(args.out), runtime.CHECKPOINT_BASENAME, args.out))
    return 0


def load_data(path):
    """(train images (N,16,16,1) in [-1,1], scorer images, scorer labels)."""
    images, labels = digits.load_digits() if path is None else digits.load_npz(path)
    if labels is None:  # no y_train: score against the bundled digits
        score_images, score_labels = digits.load_digits()
    else:
        score_images, score_labels = images, labels
    return images[..., None] * 2.0 - 1.0, score_images, score_labels


def main(argv=None):
    start_time = time.time()
    args = cli.parse_dcgan_args(PROG, __doc__, argv)
    with cli.one_line_errors(PROG):
        runtime.check_npu_bridge(args)
        runtime.check_horovod(args)
        resume_from = runtime.check_resume(args)
        train_images, score_images, score_labels = load_data(args.data)
        if args.distributed is None:
            runtime.check_out_dir(args.out)
        tf = runtime.start_tensorflow(args)  # only now: a bad flag costs no TF start-up
        workers = runtime.start_workers(args)
        if workers is not None and workers.rank == 0:
            runtime.check_out_dir(args.out)  # only rank 0 writes
        import npu_lossscale as nl
        graph = Graph(tf, nl, args, workers)
        config = runtime.session_config(tf, args, workers)
        run = train(tf, args, graph, config, resume_from, train_images, workers)
        if run is None:  # a Horovod rank other than 0: rank 0 reports
            return 0
        return report(args, graph, run, score_images, score_labels, resume_from,
                      start_time, workers)


if __name__ == "__main__":
    sys.exit(main())
