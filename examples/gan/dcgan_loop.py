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
watches the collapse in Estimator mode. On CPU, ``--npu-shim`` emulates
npu_bridge and its loop::

  .venv/bin/python examples/gan/dcgan_loop.py --npu-shim --iterations_per_loop 10
  .venv-tf215/bin/python examples/gan/dcgan_loop.py --npu-shim --mode estimator

Outputs in --out: metrics.json (the global step, the skips with their steps
and reasons, the loss scale, a digest of every variable) and, in Estimator
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
    cli._add_learning_rate(parser, 5e-4, "both networks")  # pylint: disable=protected-access
    args = parser.parse_args(argv)
    cli._check_learning_rate(parser, args)  # pylint: disable=protected-access
    if args.steps % args.iterations_per_loop:
        parser.error("--steps %d is not a multiple of --iterations_per_loop %d"
                     % (args.steps, args.iterations_per_loop))
    return args


def dataset(tf, images, args):
    """The batches, shuffled by --seed, one per device iteration."""
    data = tf.data.Dataset.from_tensor_slices(images.astype(np.float32))
    return data.shuffle(len(images), seed=args.seed).repeat().batch(
        args.batch_size, drop_remainder=True)


def build_step(tf, nl, args, real):
    """Both networks' losses on ``real`` and ONE update op for them.

    Returns:
      (TrainOps, d_loss, g_loss).
    """
    dtype = tf.float16 if args.precision == "fp16" else tf.float32
    d_loss, g_loss = networks.dcgan_losses(tf, real, dtype, cli.conv_impl(args))
    scaler = nl.MultiOptimizerLossScale(cli.make_manager(nl, args.loss_scale),
                                        backend=args.backend)
    scaler.add(d_loss, tf.train.AdamOptimizer(args.learning_rate, beta1=ADAM_BETA1),
               var_list=tf.trainable_variables("discriminator"), name="discriminator")
    scaler.add(g_loss, tf.train.AdamOptimizer(args.learning_rate, beta1=ADAM_BETA1),
               var_list=tf.trainable_variables("generator"), name="generator")
    # A device loop counts iterations_per_loop steps per run, skipped or not.
    train = scaler.build(global_step=tf.train.get_or_create_global_step(),
                         count_skipped_steps=True)
    return train, d_loss, g_loss


def train_sessrun(tf, nl, args, images, config):
    """sess.run mode: returns the metrics of the trained session."""
    from npu_bridge.estimator.npu import util
    tf.set_random_seed(args.seed)
    iterator = tf.data.make_initializable_iterator(dataset(tf, images, args))
    train, d_loss, g_loss = build_step(tf, nl, args, iterator.get_next())
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
        for _ in range(runs):
            _, reason, losses = sess.run([loop, train.diagnosis.skip_reason,
                                          (d_loss, g_loss)])
            monitor.observe(reason, sess)  # reads every iteration's skips
            progress.update(d_loss="%.3f" % losses[0], g_loss="%.3f" % losses[1])
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
        return NPUEstimatorSpec(mode, loss=d_loss, train_op=train.update_op,
                                training_hooks=hooks)

    run_config = NPURunConfig(iterations_per_loop=args.iterations_per_loop,
                              model_dir=args.out, tf_random_seed=args.seed,
                              save_checkpoints_steps=args.steps, session_config=config)
    estimator = NPUEstimator(model_fn=model_fn, config=run_config)
    estimator.train(lambda: dataset(tf, images, args), max_steps=args.steps)
    return found


def metrics_of(tf, sess, nl, train):
    """What metrics.json holds of a trained session: the global step, the
    skips (each with its global step and reason), the loss scale and a
    digest of every global variable."""
    skips = nl.diagnostics.read_recent_skips(sess, train)
    step, scale, skipped, values = sess.run([tf.train.get_global_step(), train.loss_scale,
                                             train.skipped_steps, tf.global_variables()])
    return {
        "global_step": int(step),
        "skipped_steps": int(skipped),
        "loss_scale": float(scale),
        "skips": [[skip.global_step, skip.reason] for skip in skips],
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
                      precision=args.precision, steps=args.steps)
        outputs.write_json(os.path.join(args.out, "metrics.json"), result)
        print("dcgan_loop %s, %d iterations per run: %d steps (%d skipped), loss scale %g"
              % (args.mode, args.iterations_per_loop, result["global_step"],
                 result["skipped_steps"], result["loss_scale"]))
        return 0


if __name__ == "__main__":
    sys.exit(main())
