"""Porting an alternating TF1 DCGAN loop to npu_lossscale: one script, four styles.

The training loop is the common TF1 GAN loop: each iteration runs the
discriminator's step, then the generator's step, in two ``session.run`` calls
with different noise; batch norm in the generator puts its moving-statistics
updates in ``tf.GraphKeys.UPDATE_OPS``; a schedule logs and checkpoints
(``tf.train.Saver``) every N iterations; TensorBoard summaries. It is shrunk to
run on a CPU in seconds: MLPs on scikit-learn's 8x8 digits, float16 compute
with float32 master weights.

``--style`` picks how the loss scaling is done, so they can be diffed:

* ``npu_bridge``: the original Ascend script, one ``NPULossScaleOptimizer``
  per network and ``minimize`` (needs npu_bridge: on a CPU, the emulation in
  ``shims/``, used automatically with ``--backend npu``);
* ``lso_shared``: the drop-in port, npu_lossscale's ``LossScaleOptimizer`` in
  place of each ``NPULossScaleOptimizer``, both sharing ONE manager (as
  Huawei's GAN samples share one): each run moves the shared scale once; a
  run that fetched both step ops would fail before the second one writes;
* ``builder_alternating``: the port, one ``MultiOptimizerLossScale`` with
  ``build(per_group_ops=True, update_ops={...})``, running
  ``train.per_group["d"]`` then ``train.per_group["g"]``;
* ``builder_joint``: the port to one run per iteration, ``train.update_op``
  (both networks apply, or neither).

``--inject-overflow-at N`` poisons the generator's loss in iteration N (the
generator's run, or the joint run): that run must be skipped as a whole.

  python examples/porting/dcgan_alternating.py --style builder_alternating --steps 300
  python examples/porting/dcgan_alternating.py --style npu_bridge --backend npu \\
      --overflow-mode saturation --inject-overflow-at 5 --steps 10

It prints ``RESULT {json}`` at the end; ``main(argv)`` returns the same dict.
"""

import argparse
import json
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

import npu_lossscale as nl

SHIMS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "shims")
STYLES = ("npu_bridge", "lso_shared", "builder_alternating", "builder_joint")
Z_DIM, HIDDEN, IMAGE = 16, 64, 64
POISON = 1e30  # times the generator's loss: its float16 gradients overflow
SEED_MAX = 2 ** 32 - 1  # numpy's RandomState takes seeds in [0, 2**32 - 1]
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the loss scale is a float32 variable


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--style", choices=STYLES, default="builder_alternating")
    parser.add_argument("--backend", choices=("is_finite", "npu"), default="is_finite",
                        help="npu: npu_bridge (the CPU shim when the real one is missing)")
    parser.add_argument("--overflow-mode", choices=("saturation", "inf_nan"),
                        default="saturation", help="the Ascend overflow mode (--backend npu)")
    parser.add_argument("--inject-overflow-at", type=int, default=None, metavar="ITERATION",
                        help="poison the generator's loss in this iteration (1-based)")
    parser.add_argument("--steps", type=int, default=300, help="iterations (D run + G run)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--loss-scale", type=float, default=2.0 ** 10,
                        help="initial loss scale")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("runs", "porting"))
    args = parser.parse_args(argv)
    if args.style == "npu_bridge" and args.backend != "npu":
        parser.error("--style npu_bridge needs --backend npu (NPULossScaleOptimizer "
                     "is npu_bridge's)")
    for flag, low, high in (("--steps", 1, None), ("--batch-size", 1, None),
                            ("--log-every", 1, None), ("--save-every", 1, None),
                            ("--seed", 0, SEED_MAX), ("--loss-scale", 1.0, FLOAT32_MAX),
                            ("--inject-overflow-at", 1, args.steps)):
        check_range(parser, args, flag, low, high)
    return args


def check_range(parser, args, flag, low, high=None):
    """Exits with an argparse error (status 2) naming ``flag``, its value and
    the valid range, unless ``low <= value <= high`` (no upper bound when
    ``high`` is None; an unset optional flag, None, passes).

    Args:
      parser: the ``argparse.ArgumentParser`` that parsed ``args``.
      args: the parsed namespace.
      flag: the option, e.g. "--steps" (its attribute is read from ``args``).
      low: the smallest valid value.
      high: the largest valid value, or None.
    """
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if value is None:
        return
    if value >= low and (high is None or value <= high):  # False for NaN too
        return
    valid = ("an integer >= %d" % low if isinstance(low, int) else "a number >= %g" % low
             ) if high is None else "in [%s, %s]" % (low, high)
    if flag == "--inject-overflow-at":
        valid += " (an iteration of this run: 1 to --steps)"
    parser.error("argument %s: must be %s, got %r" % (flag, valid, value))


# -- the model: nothing here changes when porting -------------------------------

def digits(seed):
    """scikit-learn's 8x8 digits in [-1, 1], float32, shuffled."""
    from sklearn.datasets import load_digits
    images = load_digits().data.astype(np.float32) / 8.0 - 1.0
    return images[np.random.RandomState(seed).permutation(len(images))]


def dense(x, units, name):
    """float32 master weights, float16 compute."""
    with tf.variable_scope(name):
        w = tf.get_variable("w", [int(x.shape[-1]), units], tf.float32,
                            tf.random_normal_initializer(stddev=0.1))
        b = tf.get_variable("b", [units], tf.float32, tf.zeros_initializer())
        return tf.matmul(x, tf.cast(w, tf.float16)) + tf.cast(b, tf.float16)


def batch_norm(x, name, momentum=0.9):
    """Training-mode batch norm, as tf.layers.batch_normalization(training=True)
    builds it: batch moments, and the moving averages' updates in UPDATE_OPS.
    Computed in float32 (the usual mixed-precision practice)."""
    x = tf.cast(x, tf.float32)
    with tf.variable_scope(name):
        gamma = tf.get_variable("gamma", x.shape[-1:], initializer=tf.ones_initializer())
        beta = tf.get_variable("beta", x.shape[-1:], initializer=tf.zeros_initializer())
        moving_mean = tf.get_variable("moving_mean", x.shape[-1:], trainable=False,
                                      initializer=tf.zeros_initializer())
        moving_var = tf.get_variable("moving_variance", x.shape[-1:], trainable=False,
                                     initializer=tf.ones_initializer())
        mean, variance = tf.nn.moments(x, [0])
        for moving, value in ((moving_mean, mean), (moving_var, variance)):
            tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, tf.assign_sub(
                moving, (moving - value) * (1.0 - momentum)))
        return tf.cast(tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-3),
                       tf.float16)


def generator(z):
    with tf.variable_scope("generator"):
        h = tf.nn.relu(batch_norm(dense(tf.cast(z, tf.float16), HIDDEN, "fc1"), "bn1"))
        return tf.tanh(dense(h, IMAGE, "fc2"))


def discriminator(x, reuse):
    with tf.variable_scope("discriminator", reuse=reuse):
        h = tf.nn.leaky_relu(dense(tf.cast(x, tf.float16), HIDDEN, "fc1"), 0.2)
        return tf.cast(dense(h, 1, "fc2"), tf.float32)  # logits -> float32 before the loss


def build_model(batch_size):
    real = tf.placeholder(tf.float32, [batch_size, IMAGE], name="real")
    z = tf.placeholder(tf.float32, [batch_size, Z_DIM], name="z")
    poison = tf.placeholder_with_default(tf.constant(1.0), [], name="poison")
    fake = generator(z)
    d_real, d_fake = discriminator(real, reuse=False), discriminator(fake, reuse=True)
    xent = tf.nn.sigmoid_cross_entropy_with_logits
    d_loss = (tf.reduce_mean(xent(labels=tf.ones_like(d_real), logits=d_real))
              + tf.reduce_mean(xent(labels=tf.zeros_like(d_fake), logits=d_fake)))
    g_loss = tf.reduce_mean(xent(labels=tf.ones_like(d_fake), logits=d_fake)) * poison
    return real, z, poison, d_loss, g_loss


# -- the loss scaling: what a port changes ------------------------------------------

def use_npu(overflow_mode):
    """Makes npu_bridge importable (the real adapter, else shims/) and sets the
    device overflow mode, before the graph is built."""
    try:
        import npu_bridge  # noqa: F401  pylint: disable=unused-import
    except ImportError:
        sys.path.insert(0, SHIMS)
    from npu_bridge.estimator.npu import npu_plugin
    npu_plugin.set_device_sat_mode(0 if overflow_mode == "saturation" else 1)


def manager_args(args):
    # ModelZoo scripts often start at 2**32; a small start keeps a short run
    # free of the initial overflow-and-halve phase.
    return dict(init_loss_scale=args.loss_scale, incr_every_n_steps=1000,
                decr_every_n_nan_or_inf=2, decr_ratio=0.5)


def adam():
    return tf.train.AdamOptimizer(1e-3, beta1=0.5)


def original_train_ops(args, d_loss, g_loss, d_vars, g_vars, g_updates, global_step):
    """BEFORE: one NPULossScaleOptimizer per network (a ModelZoo script does
    ``from npu_bridge.npu_init import *``)."""
    from npu_bridge.npu_init import ExponentialUpdateLossScaleManager, NPULossScaleOptimizer
    d_manager = ExponentialUpdateLossScaleManager(**manager_args(args))
    g_manager = ExponentialUpdateLossScaleManager(**manager_args(args))
    d_opt = NPULossScaleOptimizer(adam(), d_manager)
    g_opt = NPULossScaleOptimizer(adam(), g_manager)
    d_train = d_opt.minimize(d_loss, global_step=global_step, var_list=d_vars)
    with tf.control_dependencies(g_updates):  # the TF1 idiom: runs on skipped steps too
        g_train = g_opt.minimize(g_loss, var_list=g_vars)
    scales = {"d_scale": d_manager.get_loss_scale(), "g_scale": g_manager.get_loss_scale()}
    return d_train, g_train, scales


def shared_manager_train_ops(args, d_loss, g_loss, d_vars, g_vars, g_updates, global_step):
    """AFTER, the drop-in: npu_lossscale's LossScaleOptimizer per network, on
    one manager shared by both. Fetched one per session.run, each run moves
    the shared scale once; sess.run([d_train, g_train]) would fail with an
    InvalidArgumentError naming the manager and both step ops."""
    manager = nl.ExponentialUpdateLossScaleManager(**manager_args(args))
    d_opt = nl.LossScaleOptimizer(adam(), manager, backend=args.backend)
    g_opt = nl.LossScaleOptimizer(adam(), manager, backend=args.backend)
    d_train = d_opt.minimize(d_loss, global_step=global_step, var_list=d_vars)
    # Still the TF1 idiom: a LossScaleOptimizer cannot gate these, so they
    # run on skipped steps as in the original; the builder styles gate them.
    with tf.control_dependencies(g_updates):
        g_train = g_opt.minimize(g_loss, var_list=g_vars)
    return d_train, g_train, {"scale": manager.get_loss_scale()}


def ported_train_ops(args, d_loss, g_loss, d_vars, g_vars, g_updates, global_step):
    """AFTER: one MultiOptimizerLossScale for both networks."""
    scaler = nl.MultiOptimizerLossScale(nl.ExponentialUpdateLossScaleManager(**manager_args(args)),
                                        backend=args.backend)
    scaler.add(d_loss, adam(), var_list=d_vars, name="d")
    scaler.add(g_loss, adam(), var_list=g_vars, name="g")
    if args.style == "builder_alternating":
        # One op per network, each checked and applied alone; the generator's
        # batch-norm updates run with its run, only when it applies.
        # global_step advances on each applied group run (twice per iteration).
        return scaler.build(global_step=global_step, per_group_ops=True,
                            update_ops={"g": g_updates})
    # One op for both: applies both networks or neither; global_step advances
    # once per applied iteration.
    return scaler.build(global_step=global_step, update_ops=g_updates)


def main(argv=None):
    args = parse_args(argv)
    if tf.executing_eagerly():
        tf.disable_eager_execution()
    if args.backend == "npu":
        use_npu(args.overflow_mode)
    os.makedirs(args.out, exist_ok=True)
    data = digits(args.seed)
    rng = np.random.RandomState(args.seed)

    graph = tf.Graph()
    with graph.as_default():
        tf.set_random_seed(args.seed)
        real, z, poison, d_loss, g_loss = build_model(args.batch_size)
        d_vars = tf.trainable_variables("discriminator")
        g_vars = tf.trainable_variables("generator")
        # Every call of the generator (generator/, generator_1/... if it were
        # called again), and no other network's: docs/porting.md, "UPDATE_OPS".
        g_updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS, r"generator(_\d+)?/")
        global_step = tf.train.get_or_create_global_step()
        tf.summary.scalar("d_loss", d_loss, collections=["d"])
        tf.summary.scalar("g_loss", g_loss, collections=["g"])

        train, step_summaries = None, []
        if args.style == "npu_bridge":
            d_train, g_train, scales = original_train_ops(
                args, d_loss, g_loss, d_vars, g_vars, g_updates, global_step)
        elif args.style == "lso_shared":
            d_train, g_train, scales = shared_manager_train_ops(
                args, d_loss, g_loss, d_vars, g_vars, g_updates, global_step)
        else:
            train = ported_train_ops(args, d_loss, g_loss, d_vars, g_vars, g_updates,
                                     global_step)
            scales = {"scale": train.loss_scale, "skipped_steps": train.skipped_steps}
            if args.style == "builder_alternating":
                d_train, g_train = train.per_group["d"], train.per_group["g"]
            else:
                # scale and skipped_total read state only; step_applied is
                # the joint step's own, so it goes with update_op only.
                step_summaries = nl.summaries(train, step_applied=True)
        # Reads only (no float16 op), run alone at logging time: safe in any run.
        scale_summary = tf.summary.merge([tf.summary.scalar(k, tf.cast(v, tf.float32))
                                          for k, v in sorted(scales.items())])
        d_summary = tf.summary.merge(tf.get_collection("d"))
        g_summary = tf.summary.merge(tf.get_collection("g") + step_summaries)
        saver = tf.train.Saver(max_to_keep=5)
        init = tf.global_variables_initializer()

    writer = tf.summary.FileWriter(args.out, graph)
    prefix = os.path.join(args.out, "model.ckpt")
    log = []
    with tf.Session(graph=graph) as sess:
        sess.run(init)
        # Schedules are keyed on the loop's own iteration count, not on
        # global_step: with the builder, global_step does not move on a
        # skipped run (count_skipped_steps=False), so `global_step % N == 0`
        # would fire twice or never; and per_group ops advance it once per
        # applied group run.
        for iteration in range(1, args.steps + 1):
            batch = data[rng.randint(0, len(data), args.batch_size)]
            d_feed = {real: batch, z: rng.uniform(-1, 1, [args.batch_size, Z_DIM])}
            g_feed = {real: batch, z: rng.uniform(-1, 1, [args.batch_size, Z_DIM])}
            if iteration == args.inject_overflow_at:
                g_feed[poison] = POISON
            if args.style == "builder_joint":
                # One run: both losses on the D noise, both networks or neither.
                d_feed.update((k, v) for k, v in g_feed.items() if k is poison)
                _, d_value, g_value, d_sum, g_sum = sess.run(
                    [train.update_op, d_loss, g_loss, d_summary, g_summary], d_feed)
            else:
                _, d_value, d_sum = sess.run([d_train, d_loss, d_summary], d_feed)
                _, g_value, g_sum = sess.run([g_train, g_loss, g_summary], g_feed)
            if iteration % args.log_every == 0 or iteration == args.steps:
                values = sess.run(dict(scales, global_step=global_step))
                values = dict((k, float(v)) for k, v in values.items())
                values.update(iteration=iteration, d_loss=float(d_value), g_loss=float(g_value))
                log.append(values)
                print(" ".join("%s=%g" % kv for kv in sorted(values.items())))
                for summary in (d_sum, g_sum, sess.run(scale_summary)):
                    writer.add_summary(summary, iteration)
            if iteration % args.save_every == 0 or iteration == args.steps:
                saver.save(sess, prefix, global_step=iteration)  # keyed on iterations too
        result = dict(log[-1], style=args.style, backend=args.backend,
                      checkpoint_prefix=prefix, inject_overflow_at=args.inject_overflow_at)
    writer.close()
    print("RESULT " + json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
