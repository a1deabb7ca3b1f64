"""The float16 DCGAN of dcgan.py on a device loop, as ModelZoo's Ascend scripts train it.

On Ascend the device runs ``--iterations_per_loop`` steps per ``session.run``
and the host sees the last one. Two ways to ask for it, both tf_adapter's:

* ``--mode sessrun``: ``util.set_iteration_per_loop(sess, train_op, N)`` and
  the session config's ``NpuOptimizer`` ``iterations_per_loop``;
* ``--mode estimator``: ``NPUEstimator`` with
  ``NPURunConfig(iterations_per_loop=N)`` (tf.estimator: TF 2.15 or 1.15).

The data comes from a tf.data pipeline (a loop cannot be fed per step). Both
networks go into one ``MultiOptimizerLossScale`` with
``build(count_skipped_steps=True)``, so the global step moves N per run as
NPURunConfig promises, and the step's skip record keeps every iteration's
skip for the host (``diagnostics.read_recent_skips``); ``LossScaleHook``
watches the collapse in Estimator mode.

By default each iteration is one joint step of both networks. With
``--sequence d,g`` (or ``d,d,g``...) it is the alternating loop's sub-steps in
one op (``build(sequence=...)``): the discriminator's step, then the
generator's on the discriminator's new weights, each with its own check, skip
and scale update; in sess.run mode each sub-step reads a batch of its own.
On CPU, ``--npu-shim`` emulates npu_bridge and its loop::

  .venv/bin/python examples/gan/dcgan_loop.py --npu-shim --iterations_per_loop 10
  .venv/bin/python examples/gan/dcgan_loop.py --npu-shim --sequence d,g
  .venv-tf215/bin/python examples/gan/dcgan_loop.py --npu-shim --mode estimator

Outputs in --out: metrics.json (the global step, the skips with their steps,
sub-steps and reasons, the loss scale, a digest of every variable) and, in Estimator
mode, the Estimator's checkpoints.
"""

from __future__ import absolute_import, division, print_function

import importlib.util
import os
import sys

import numpy as np

import cli
import networks
import outputs
import runtime
from dcgan import ADAM_BETA1, load_data

PROG = "dcgan_loop.py"
MODES = ("sessrun", "estimator")
#: --sequence's letters: the builder's group names.
SUB_STEPS = {"d": "discriminator", "g": "generator"}


def parse_args(argv):
    """The flags, checked (no TensorFlow needed)."""
    parser = cli.OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    cli.add_common_flags(parser, steps=200, batch_size=32, log_every=100,
                         out=os.path.join("runs", "dcgan_loop"))
    parser.add_argument("--iterations_per_loop", "--iterations-per-loop",
                        type=cli.positive_int, default=10,
                        help="steps the device runs per session.run; --steps must be a "
                             "multiple of it (default: %(default)s)")
    parser.add_argument("--mode", choices=MODES, default="sessrun",
                        help="sessrun: util.set_iteration_per_loop; estimator: "
                             "NPUEstimator with NPURunConfig (default: %(default)s)")
    parser.add_argument("--sequence", type=sub_steps, default=None, metavar="d,g",
                        help="run each iteration as sub-steps in one op, in this order "
                             "(d: the discriminator, g: the generator; repeats allowed) "
                             "(default: one joint step)")
    cli._add_learning_rate(parser, 5e-4, "both networks")  # pylint: disable=protected-access
    args = parser.parse_args(argv)
    cli._check_learning_rate(parser, args)  # pylint: disable=protected-access
    if args.steps % args.iterations_per_loop:
        parser.error("--steps %d is not a multiple of --iterations_per_loop %d"
                     % (args.steps, args.iterations_per_loop))
    return args


def sub_steps(text):
    """--sequence's value: a list of group names."""
    letters = [letter.strip() for letter in text.split(",")]
    if not all(letter in SUB_STEPS for letter in letters) or not set(letters) == set(SUB_STEPS):
        raise cli.argparse.ArgumentTypeError(
            "expected the letters d and g separated by commas, each at least once (e.g. "
            "d,g or d,d,g), got %r" % (text,))
    return [SUB_STEPS[letter] for letter in letters]


def dataset(tf, images, args):
    """The batches, shuffled by --seed, one per device iteration."""
    data = tf.data.Dataset.from_tensor_slices(images.astype(np.float32))
    return data.shuffle(len(images), seed=args.seed).repeat().batch(
        args.batch_size, drop_remainder=True)


def build_step(tf, nl, args, real):
    """Both networks' losses on ``real`` (a tensor, or a function that
    returns the next batch) and ONE update op for them.

    Returns:
      (TrainOps, d_loss, g_loss); with --sequence the losses are None (each
      sub-step has its own).
    """
    dtype = tf.float16 if args.precision == "fp16" else tf.float32
    next_batch = real if callable(real) else lambda: real

    def losses():
        # The networks reuse their variables (AUTO_REUSE): each sub-step of
        # --sequence builds them again on the weights the last one wrote.
        return networks.dcgan_losses(tf, next_batch(), dtype, cli.conv_impl(args))

    # The first build makes the variables; with --sequence it is left unrun.
    d_loss, g_loss = d_group, g_group = losses()
    if args.sequence:
        d_loss = g_loss = None
        d_group, g_group = (lambda: losses()[0]), (lambda: losses()[1])
    scaler = nl.MultiOptimizerLossScale(cli.make_manager(nl, args.loss_scale),
                                        backend=args.backend)
    scaler.add(d_group, tf.train.AdamOptimizer(args.learning_rate, beta1=ADAM_BETA1),
               var_list=tf.trainable_variables("discriminator"), name="discriminator")
    scaler.add(g_group, tf.train.AdamOptimizer(args.learning_rate, beta1=ADAM_BETA1),
               var_list=tf.trainable_variables("generator"), name="generator")
    # A device loop counts iterations_per_loop steps per run, skipped or not.
    train = scaler.build(global_step=tf.train.get_or_create_global_step(),
                         count_skipped_steps=True, sequence=args.sequence)
    return train, d_loss, g_loss


def train_sessrun(tf, nl, args, images, config):
    """sess.run mode: returns the metrics of the trained session."""
    from npu_bridge.estimator.npu import util
    tf.set_random_seed(args.seed)
    iterator = tf.data.make_initializable_iterator(dataset(tf, images, args))
    train, d_loss, g_loss = build_step(tf, nl, args, iterator.get_next)
    custom = [item for item in config.graph_options.rewrite_options.custom_optimizers
              if item.name == "NpuOptimizer"][0]
    custom.parameter_map["iterations_per_loop"].i = args.iterations_per_loop
    monitor = nl.CollapseMonitor(train, on_collapse="warn")
    with tf.Session(config=config) as sess:
        sess.run([tf.global_variables_initializer(), tf.local_variables_initializer(),
                  iterator.initializer])
        loop = util.set_iteration_per_loop(sess, train.update_op, args.iterations_per_loop)
        runs = args.steps // args.iterations_per_loop
        progress = outputs.Progress("dcgan_loop, runs of %d steps" % args.iterations_per_loop,
                                    runs)
        shown = {} if args.sequence else {"d_loss": d_loss, "g_loss": g_loss}
        for _ in range(runs):
            _, reason, losses = sess.run([loop, train.diagnosis.skip_reason, shown])
            monitor.observe(reason, sess)  # reads every iteration's skips
            progress.update(**dict((key, "%.3f" % value) for key, value in losses.items()))
        progress.close()
        return metrics_of(tf, sess, nl, train)


def train_estimator(tf, nl, args, images, config):
    """NPUEstimator mode: returns the metrics of the Estimator's session, read
    when it ends."""
    from npu_bridge.npu_init import NPUEstimator, NPUEstimatorSpec, NPURunConfig
    found = {}

    class MetricsHook(tf.train.SessionRunHook):
        def __init__(self, train):
            self._train = train

        def end(self, session):
            found.update(metrics_of(tf, session, nl, self._train))

    def model_fn(features, labels, mode):
        train, d_loss, _ = build_step(tf, nl, args, features)
        hooks = [nl.LossScaleHook(train, on_collapse="warn"), MetricsHook(train)]
        # The Estimator logs a loss; a sequence's is its sub-steps'.
        loss = d_loss if d_loss is not None else tf.cast(train.loss_scale, tf.float32)
        return NPUEstimatorSpec(mode, loss=loss, train_op=train.update_op,
                                training_hooks=hooks)

    run_config = NPURunConfig(iterations_per_loop=args.iterations_per_loop,
                              model_dir=args.out, tf_random_seed=args.seed,
                              save_checkpoints_steps=args.steps, session_config=config)
    estimator = NPUEstimator(model_fn=model_fn, config=run_config)
    estimator.train(lambda: dataset(tf, images, args), max_steps=args.steps)
    return found


def metrics_of(tf, sess, nl, train):
    """What metrics.json holds of a trained session: the global step, the
    skips (each with its global step, sub-step and reason), the loss scale
    and a digest of every global variable."""
    skips = nl.diagnostics.read_recent_skips(sess, train)
    step, scale, skipped, values = sess.run([tf.train.get_global_step(), train.loss_scale,
                                             train.skipped_steps, tf.global_variables()])
    return {
        "global_step": int(step),
        "skipped_steps": int(skipped),
        "loss_scale": float(scale),
        "skips": [[skip.global_step, skip.substep, skip.reason] for skip in skips],
        "variables_digest": runtime.variables_digest(values),
    }


def main(argv=None):
    args = parse_args(argv)
    with cli.one_line_errors(PROG):
        runtime.check_npu_bridge(args)
        if importlib.util.find_spec("npu_bridge") is None:
            raise cli.UsageError("a device loop needs npu_bridge (CANN's tf_adapter); add "
                                 "--npu-shim to emulate it on CPU")
        runtime.check_out_dir(args.out)
        images = load_data(args.data)[0]
        args.npu_shim = True  # npu_bridge is needed: load it with TF
        tf = runtime.start_tensorflow(args)
        if args.mode == "estimator" and getattr(tf, "estimator", None) is None:
            raise cli.UsageError("--mode estimator needs tf.estimator (TF 2.15 or 1.15; "
                                 "make venv215)")
        import npu_lossscale as nl
        config = runtime.session_config(tf, args)
        if not any(item.name == "NpuOptimizer"
                   for item in config.graph_options.rewrite_options.custom_optimizers):
            config.graph_options.rewrite_options.custom_optimizers.add().name = "NpuOptimizer"
        trained = train_estimator if args.mode == "estimator" else train_sessrun
        result = trained(tf, nl, args, images, config)
        result.update(mode=args.mode, iterations_per_loop=args.iterations_per_loop,
                      precision=args.precision, steps=args.steps,
                      sequence=args.sequence or ["joint"])
        outputs.write_json(os.path.join(args.out, "metrics.json"), result)
        print("dcgan_loop %s, %d iterations per run: %d steps (%d skipped), loss scale %g"
              % (args.mode, args.iterations_per_loop, result["global_step"],
                 result["skipped_steps"], result["loss_scale"]))
        return 0


if __name__ == "__main__":
    sys.exit(main())
