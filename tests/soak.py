"""Soak test: a float16 two-optimizer GAN under seeded random overflow injection.

    python tools/soak.py --steps 100000          # make soak
    python tests/soak.py --steps 3000 --seed 7   # what tests/test_soak.py runs

A two-optimizer GAN (float32 master weights, float16 compute, float16 losses)
is trained through one ``MultiOptimizerLossScale`` update op. With probability
``p`` per step an overflow is injected (inf, -inf, nan, or 1e6, which is finite
in float32 but overflows the float16 forward pass) into one of: the real batch,
the latent batch, the discriminator's loss or the generator's loss. Bursts of
``burst_len`` consecutive injected overflows are added at fixed steps, each
followed by a quiet recovery window. Every injected step is recorded.

The run checks, and reports as violations:

* ``is_finite`` is False on every injected step (no false negative), and on
  a non-injected step only for a *genuine* float16 overflow, accounted for as
  described below (no false positive);
* the loss scale used at every step equals an independent Python replay of
  the manager's rule (hence stays in [min_loss_scale, max_loss_scale]);
* every global variable (weights, Adam slots and beta powers, manager state)
  is finite, every ``check_every`` steps and at the end;
* ``global_step`` equals the number of applied steps (checked with the
  weights, and at the end), and ``applied`` equals ``is_finite`` each step;
* each skipped step has a reason (``TrainOps.diagnosis.skip_reason``) and every
  applied step none: a poisoned loss is "loss_not_finite" and names its
  group, a predicted scale overflow "gradients_overflowed", a poisoned batch
  one of the two;
* the collapse policy (``CollapseMonitor``, after ``floor_warning_after``
  consecutive skips) fires once in each burst and never elsewhere: no false
  alarm;
* after each burst the scale sits at its floor, no variable but the manager's
  moved during the burst, the manager's streak counter holds the number of
  consecutive overflows and its floor warning (``check_floor``) fired; during recovery every
  step applies, the scale after k finite steps is exactly
  ``min_loss_scale * multiplier ** (k // growth_steps)``, and every trainable
  variable has moved by the window's end.

Genuine overflows. A float16 model whose dynamic scale is allowed to grow
does overflow by itself, and the builder must skip those steps too. Two
kinds are accounted for, step by step:

* scale overflows, predicted: the losses are float16, so the backward pass
  starts by casting the float32 loss scale to float16 (the gradient of
  ``cast(loss)``). A scale of 2**16 does not fit float16 (max 65504;
  anything from 65520 rounds to inf), so every step run at such a scale
  overflows whatever the data. This is why a float16 model's scale
  oscillates between 2**15 and 2**16 (one skipped step per ``growth_steps``
  + 1 at steady state). The run predicts these from the scale alone and
  requires ``is_finite`` False on each.
* gradient overflows, verified: below 2**16 a step can still overflow if
  some scaled float16 gradient exceeds 65504 (gradients near 2 at a scale of
  2**15). The model is small and bounded (tanh layers, inputs in [-1, 1]) so
  this is rare (none in 100,000 steps at seed 0), but it is legitimate. Any
  non-injected overflow below 2**16 is therefore re-examined right after its
  (skipped) step, on the unchanged weights and the same batch: the
  gradients the builder would have applied, fetched at the step's scale,
  must hold an inf or nan when checked in numpy (independently of the
  backend's flag), and must all be finite at half that scale. Only then is
  it counted as genuine; otherwise it is a false positive.

At the end the verification itself is probed on the final weights and a
clean batch: at a fed scale of 2**16 the gradients must be non-finite and at
2**15 finite.

Exit status (command line): 0 when there is no violation, 1 otherwise.
"""

from __future__ import absolute_import, division, print_function

import argparse
import collections
import os
import sys
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (REPO, HERE):  # the library, and tests/graph_mode.py
    if _path not in sys.path:
        sys.path.insert(0, _path)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow.compat.v1 as tf  # noqa: E402

import npu_lossscale as nl  # noqa: E402
from npu_lossscale.core import gradients as _gradients  # noqa: E402

#: The builder's count of skipped steps (TrainOps.skipped_steps reads it).
SKIPPED_STEPS = "loss_scale/skipped_steps"
#: The builder's last-skip record (TrainOps.diagnosis.last_skip reads it).
LAST_SKIP = "loss_scale/last_skip"
from graph_mode import set_graph_mode  # noqa: E402

FLOAT16_MAX = float(np.finfo(np.float16).max)

Model = collections.namedtuple(
    "Model", ["real", "z", "poison_d", "poison_g", "d_loss", "g_loss",
              "d_vars", "g_vars"])

SoakConfig = collections.namedtuple(
    "SoakConfig", ["steps", "seed", "p", "bursts", "burst_len", "recovery",
                   "check_every", "initial_scale", "growth_steps", "multiplier",
                   "min_loss_scale", "max_loss_scale", "floor_warning_after",
                   "batch"])

# Injection targets and values. Code 0 means no injection.
TARGETS = ("real", "z", "d_loss", "g_loss")
VALUES = (np.inf, -np.inf, np.nan, 1e6)


def default_config(steps, seed=0, **overrides):
    """The soak configuration for ``steps`` steps.

    Bursts start at step 1000 and then every 20,000 steps, as long as the
    burst and its recovery window fit in the run.
    """
    config = dict(steps=steps, seed=seed, p=0.02, bursts=None, burst_len=50,
                  recovery=160, check_every=250, initial_scale=2.0 ** 15,
                  growth_steps=20, multiplier=2.0, min_loss_scale=4.0,
                  max_loss_scale=2.0 ** 24, floor_warning_after=20, batch=32)
    config.update(overrides)
    if config["bursts"] is None:
        span = config["burst_len"] + config["recovery"]
        config["bursts"] = tuple(range(1000, steps - span + 1, 20000))
    return SoakConfig(**config)


def build_model(batch, seed, data_dim=2, z_dim=4, hidden=16):
    """A small GAN: float32 variables, float16 compute and losses.

    ``poison_d`` / ``poison_g`` multiply the discriminator's / generator's
    loss (1.0 by default); the batches ``real`` and ``z`` are fed each step.
    """
    rng = np.random.RandomState(seed)

    def variable(name, shape, std):
        value = rng.normal(0.0, std, shape).astype(np.float32)
        return tf.get_variable(name, initializer=value)

    def f16(t):
        return tf.cast(t, tf.float16)

    real = tf.placeholder(tf.float32, [batch, data_dim], name="real")
    z = tf.placeholder(tf.float32, [batch, z_dim], name="z")
    poison_d = tf.placeholder_with_default(tf.constant(1.0), [], name="poison_d")
    poison_g = tf.placeholder_with_default(tf.constant(1.0), [], name="poison_g")
    with tf.variable_scope("generator"):
        g_w1 = variable("w1", [z_dim, hidden], 0.5)
        g_b1 = variable("b1", [hidden], 0.1)
        g_w2 = variable("w2", [hidden, data_dim], 0.3)
        g_b2 = variable("b2", [data_dim], 0.1)
    with tf.variable_scope("discriminator"):
        d_w1 = variable("w1", [data_dim, hidden], 0.5)
        d_b1 = variable("b1", [hidden], 0.1)
        d_w2 = variable("w2", [hidden, 1], 0.3)
        d_b2 = variable("b2", [1], 0.1)

    def generator(noise):
        h = tf.tanh(tf.matmul(noise, f16(g_w1)) + f16(g_b1))
        return tf.tanh(tf.matmul(h, f16(g_w2)) + f16(g_b2))

    def discriminator(x):
        h = tf.tanh(tf.matmul(x, f16(d_w1)) + f16(d_b1))
        return tf.matmul(h, f16(d_w2)) + f16(d_b2)

    fake = generator(f16(z))
    d_real = discriminator(f16(real))
    d_fake = discriminator(fake)
    d_loss = (tf.reduce_mean(tf.nn.softplus(-d_real))
              + tf.reduce_mean(tf.nn.softplus(d_fake))) * f16(poison_d)
    g_loss = tf.reduce_mean(tf.nn.softplus(-d_fake)) * f16(poison_g)
    return Model(real, z, poison_d, poison_g, d_loss, g_loss,
                 [d_w1, d_b1, d_w2, d_b2], [g_w1, g_b1, g_w2, g_b2])


def injection_plan(config):
    """Per-step injection codes (0 = none), and the set of burst steps.

    A code c > 0 means target ``TARGETS[(c - 1) // len(VALUES)]`` and value
    ``VALUES[(c - 1) % len(VALUES)]``. Random injections are seeded by
    ``config.seed``; bursts are fixed; no random injection falls in a
    recovery window.
    """
    rng = np.random.RandomState(config.seed)
    n_codes = len(TARGETS) * len(VALUES)
    codes = np.where(rng.rand(config.steps) < config.p,
                     rng.randint(1, n_codes + 1, config.steps), 0)
    in_burst = np.zeros(config.steps, bool)
    for start in config.bursts:
        end = start + config.burst_len
        codes[start:end] = rng.randint(1, n_codes + 1, config.burst_len)
        in_burst[start:end] = True
        codes[end:end + config.recovery] = 0
    return codes, in_burst


CENTERS = np.array([[0.5, 0.5], [-0.5, 0.5], [0.5, -0.5], [-0.5, -0.5]], np.float32)


def sample_batches(rng, batch):
    """One clean (real, z) pair: a mixture of four tight Gaussians, and
    uniform noise in [-1, 1]."""
    real = CENTERS[rng.randint(0, 4, batch)] + rng.normal(0.0, 0.05, [batch, 2])
    z = rng.uniform(-1.0, 1.0, [batch, 4])
    return real.astype(np.float32), z.astype(np.float32)


def poisoned_feed(model, code, real, z):
    """The feed of one step: clean batches, or one value poisoned by ``code``."""
    feed = [real, z, 1.0, 1.0]
    if code:
        target = TARGETS[(code - 1) // len(VALUES)]
        value = VALUES[(code - 1) % len(VALUES)]
        if target == "real":
            real = real.copy()
            real[0, 1] = value
            feed[0] = real
        elif target == "z":
            z = z.copy()
            z[3, 2] = value
            feed[1] = z
        elif target == "d_loss":
            feed[2] = value
        else:
            feed[3] = value
    return feed


class ReferenceManager(object):
    """DynamicLossScaleManager's rule replayed in numpy float32."""

    def __init__(self, config):
        self.config = config
        self.scale = np.float32(config.initial_scale)
        self.good = 0

    def update(self, finite):
        c = self.config
        if finite:
            if self.good + 1 >= c.growth_steps:
                grown = np.float32(self.scale * np.float32(c.multiplier))
                if np.isfinite(grown):
                    self.scale = np.float32(min(grown, np.float32(c.max_loss_scale)))
                self.good = 0
            else:
                self.good += 1
        else:
            self.scale = np.float32(max(np.float32(self.scale / np.float32(c.multiplier)),
                                        np.float32(c.min_loss_scale)))
            self.good = 0


def overflows_float16(scale):
    """Whether the float32 scale itself rounds to inf in float16."""
    with np.errstate(over="ignore"):
        return bool(np.isinf(np.float16(np.float32(scale))))


SoakReport = collections.namedtuple(
    "SoakReport", ["config", "violations", "injected", "finite", "applied", "scale",
                   "scale_overflow", "grad_overflow", "global_step", "final_scale",
                   "bursts", "probe", "weight_checks", "seconds", "reason", "alarms"])


def run_soak(config, log=None):
    """Builds the model in a fresh graph and runs the soak.

    Args:
      config: a ``SoakConfig`` (see ``default_config``).
      log: callable taking a string for progress lines, or None.

    Returns:
      A ``SoakReport``: per-step arrays ``injected``, ``finite``, ``applied``,
      ``scale`` (the scale each step used), ``scale_overflow`` (non-injected
      steps predicted to overflow because the scale does not fit float16) and
      ``grad_overflow`` (non-injected overflows below that, each verified as
      genuine), the final global step and scale,
      per-burst observations, the end probe, the number of periodic weight
      checks, ``reason`` (each step's skip reason code), ``alarms`` (the
      steps at which the collapse policy fired), and ``violations``
      (strings; empty when all checks pass).
    """
    log = log or (lambda message: None)
    started = time.time()
    violations = []

    def violate(message):
        if len(violations) < 200:
            violations.append(message)

    graph = tf.Graph()
    with graph.as_default():
        model = build_model(config.batch, config.seed + 1)
        manager = nl.DynamicLossScaleManager(
            initial_scale=config.initial_scale, growth_steps=config.growth_steps,
            multiplier=config.multiplier, min_loss_scale=config.min_loss_scale,
            max_loss_scale=config.max_loss_scale,
            floor_warning_after=config.floor_warning_after)
        gs = tf.train.get_or_create_global_step()
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(model.d_loss, tf.train.AdamOptimizer(1e-3, beta1=0.5),
                   var_list=model.d_vars, name="discriminator")
        scaler.add(model.g_loss, tf.train.AdamOptimizer(1e-3, beta1=0.5),
                   var_list=model.g_vars, name="generator")
        train = scaler.build(global_step=gs)
        # The step's scale cannot be fed (gradients.scale_snapshot): the probe
        # rebuilds the step's gradients, scaled and unscaled by the library's
        # own functions, at a placeholder scale.
        probe_scale = tf.placeholder(tf.float32, [], name="probe_scale")
        at_probe_scale = _gradients.Scale(probe_scale, tf.reciprocal(probe_scale), False)
        all_grads = []
        for loss, var_list in ((model.d_loss, model.d_vars), (model.g_loss, model.g_vars)):
            grads = tf.gradients(_gradients.scale_loss(loss, probe_scale), var_list)
            all_grads += [g for g, _ in _gradients.unscale(list(zip(grads, var_list)),
                                                                at_probe_scale)]
        state = tf.global_variables()
        trainable = model.d_vars + model.g_vars
        # The manager's state: one float32 vector [scale, good, bad, streak].
        state_name = manager.state.op.name
        # Library state that moves on a skipped step by design: the manager's,
        # and the builder's count of skipped steps.
        manager_names = {v.op.name for v in manager.variables} | {SKIPPED_STEPS, LAST_SKIP}
        init = tf.global_variables_initializer()
        graph.finalize()

        session_config = tf.ConfigProto(intra_op_parallelism_threads=1,
                                        inter_op_parallelism_threads=1)
        with tf.Session(graph=graph, config=session_config) as sess:
            sess.run(init)
            feeds = [model.real, model.z, model.poison_d, model.poison_g]
            # Per step: only the op and three scalars; weights are read every
            # check_every steps.
            step_fn = sess.make_callable(
                [train.update_op, train.is_finite, train.loss_scale, train.applied,
                 train.diagnosis.skip_reason, train.diagnosis.groups_overflowed], feed_list=feeds)
            monitor = nl.CollapseMonitor(train, collapse_after=config.floor_warning_after,
                                         on_collapse="stop")

            def gradients_finite(feed_values, fed_scale):
                """Whether the gradients to apply are all finite at a fed scale
                (no update runs: a pure re-evaluation of the step)."""
                feed = dict(zip(feeds, feed_values))
                feed[probe_scale] = fed_scale
                return all(np.all(np.isfinite(g)) for g in sess.run(all_grads, feed))

            def snapshot():
                return dict(zip([v.op.name for v in state], sess.run(state)))

            weight_checks = [0]

            def check_state(step):
                values = snapshot()
                weight_checks[0] += 1
                for name, value in values.items():
                    value = np.asarray(value)
                    if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
                        violate("step %d: %s is not finite" % (step, name))
                if values["global_step"] != applied_count:
                    violate("step %d: global_step %d != %d applied steps"
                            % (step, values["global_step"], applied_count))
                scale_now = values[state_name][0]
                if not config.min_loss_scale <= scale_now <= config.max_loss_scale:
                    violate("step %d: manager scale %r out of bounds" % (step, scale_now))
                return values

            codes, in_burst = injection_plan(config)
            data_rng = np.random.RandomState(config.seed + 2)
            reference = ReferenceManager(config)
            injected = codes > 0
            finite = np.zeros(config.steps, bool)
            applied = np.zeros(config.steps, bool)
            scale = np.zeros(config.steps, np.float32)
            scale_overflow = np.zeros(config.steps, bool)
            grad_overflow = np.zeros(config.steps, bool)
            reason = np.zeros(config.steps, np.int32)
            alarms = []
            applied_count = 0
            bursts = []
            burst_starts = {b: i for i, b in enumerate(config.bursts)}
            burst_ends = {b + config.burst_len: i for i, b in enumerate(config.bursts)}
            recovery_ends = {b + config.burst_len + config.recovery: i
                             for i, b in enumerate(config.bursts)}
            current = None

            for step in range(config.steps + 1):
                # Hooks that run between steps (before step `step` runs).
                if step in burst_starts:
                    current = {"start": step, "before": snapshot()}
                    bursts.append(current)
                if step in burst_ends:
                    values = snapshot()
                    current["after_burst"] = values
                    current["scale_after_burst"] = float(values[state_name][0])
                    current["streak"] = int(values[state_name][3])
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        current["warned"] = manager.check_floor(sess)
                    run = 0
                    while run < step and not finite[step - 1 - run]:
                        run += 1
                    current["expected_streak"] = run  # consecutive overflows
                    for name, value in current["before"].items():
                        if name not in manager_names and not np.array_equal(
                                value, values[name], equal_nan=True):
                            violate("burst at %d: %s changed during the burst"
                                    % (current["start"], name))
                    if current["scale_after_burst"] != config.min_loss_scale:
                        violate("burst at %d: scale %r after the burst, floor is %r" % (
                            current["start"], current["scale_after_burst"],
                            config.min_loss_scale))
                    if current["streak"] != current["expected_streak"]:
                        violate("burst at %d: floor streak %d, expected %d" % (
                            current["start"], current["streak"],
                            current["expected_streak"]))
                    if (current["expected_streak"] >= config.floor_warning_after
                            and not current["warned"]):
                        violate("burst at %d: the floor warning did not fire"
                                % current["start"])
                if step in recovery_ends:
                    values = check_state(step)
                    start = current["start"] + config.burst_len
                    window = range(start, step)
                    expected = [min(config.min_loss_scale
                                    * config.multiplier ** (k // config.growth_steps),
                                    config.max_loss_scale)
                                for k in range(config.recovery)]
                    current["recovery_scales"] = [float(scale[s]) for s in window]
                    current["expected_recovery_scales"] = expected
                    current["recovery_applied"] = int(applied[start:step].sum())
                    current["moved"] = [v.op.name for v in trainable if not np.array_equal(
                        current["after_burst"][v.op.name], values[v.op.name])]
                    current["global_step_gain"] = int(
                        values["global_step"] - current["after_burst"]["global_step"])
                    if current["recovery_scales"] != expected:
                        violate("burst at %d: recovery scales %r, expected %r" % (
                            current["start"], current["recovery_scales"], expected))
                    if current["recovery_applied"] != config.recovery:
                        violate("burst at %d: %d of %d recovery steps applied" % (
                            current["start"], current["recovery_applied"],
                            config.recovery))
                    if current["global_step_gain"] != config.recovery:
                        violate("burst at %d: global_step gained %d in recovery"
                                % (current["start"], current["global_step_gain"]))
                    if len(current["moved"]) != len(trainable):
                        violate("burst at %d: only %r moved during recovery"
                                % (current["start"], current["moved"]))
                    del current["before"], current["after_burst"]
                if step == config.steps:
                    break
                if step and step % config.check_every == 0 and step not in recovery_ends:
                    check_state(step)

                real, z = sample_batches(data_rng, config.batch)
                feed_values = poisoned_feed(model, codes[step], real, z)
                _, ok, used, did, why, groups = step_fn(*feed_values)
                finite[step], applied[step], scale[step], reason[step] = ok, did, used, why
                if monitor.observe(why, sess) is not None and monitor.skips == \
                        config.floor_warning_after:
                    alarms.append(step)
                applied_count += int(did)
                scale_overflow[step] = not injected[step] and overflows_float16(used)
                if not (ok or injected[step] or scale_overflow[step]):
                    # Below 2**16: genuine only if the step's own gradients
                    # overflow at its scale, and not at half of it.
                    grad_overflow[step] = (
                        not gradients_finite(feed_values, used)
                        and gradients_finite(feed_values, used / config.multiplier))
                    log("step %d: non-injected overflow at scale %g, genuine: %s"
                        % (step, used, grad_overflow[step]))

                if used != reference.scale:
                    violate("step %d: scale %r used, the rule gives %r"
                            % (step, used, reference.scale))
                if not config.min_loss_scale <= used <= config.max_loss_scale:
                    violate("step %d: scale %r out of bounds" % (step, used))
                expected_ok = not (injected[step] or scale_overflow[step]
                                   or grad_overflow[step])
                if ok != expected_ok:
                    violate("step %d: is_finite=%s, expected %s (injected=%s, scale=%r)"
                            % (step, ok, expected_ok, bool(injected[step]), used))
                if did != ok:
                    violate("step %d: applied=%s but is_finite=%s" % (step, did, ok))
                problem = _reason_problem(codes[step], scale_overflow[step] or grad_overflow[step],
                                          ok, why, groups)
                if problem:
                    violate("step %d: %s" % (step, problem))
                reference.update(ok)
                if step and step % 10000 == 0:
                    log("step %d: %d applied, %d injected, %d+%d genuine, scale %g" % (
                        step, applied_count, injected[:step].sum(),
                        scale_overflow[:step].sum(), grad_overflow[:step].sum(), used))

            final = check_state(config.steps)
            final_scale = float(final[state_name][0])
            if final_scale != reference.scale:
                violate("final scale %r, the rule gives %r" % (final_scale, reference.scale))
            global_step = int(final["global_step"])
            if int(final[SKIPPED_STEPS]) != config.steps - int(np.sum(finite)):
                violate("skipped_steps %d, but %d steps were skipped" % (
                    int(final[SKIPPED_STEPS]), config.steps - int(np.sum(finite))))

            # The collapse policy: once in each burst (long enough), nowhere else.
            collapsing = [start for start in config.bursts
                          if config.burst_len >= config.floor_warning_after]
            alarmed = sorted(start for start in config.bursts for at in alarms
                             if start <= at < start + config.burst_len)
            if alarmed != collapsing or len(alarms) != len(collapsing):
                violate("collapse alarms at steps %r, expected one in each burst at %r"
                        % (alarms, collapsing))

            # The verification, probed on the final weights and a clean batch
            # drawn like the training data.
            clean = poisoned_feed(model, 0, *sample_batches(data_rng, config.batch))
            probe = dict((fed, gradients_finite(clean, fed)) for fed in (2.0 ** 15, 2.0 ** 16))
            if probe != {2.0 ** 15: True, 2.0 ** 16: False}:
                violate("probe: gradients finite by fed scale %r, expected at 2**15 "
                        "only" % (probe,))

    return SoakReport(config, violations, injected, finite, applied, scale,
                      scale_overflow, grad_overflow, global_step, final_scale, bursts,
                      probe, weight_checks[0], time.time() - started, reason, alarms)


#: The groups of the soak's builder, by the loss a target poisons.
_GROUP_OF_TARGET = {"d_loss": "discriminator", "g_loss": "generator"}


def _reason_problem(code, genuine, finite, reason, groups):
    """What is wrong with a step's skip reason, or None.

    Args:
      code: the step's injection code (0: none).
      genuine: whether it is a genuine (not injected) float16 overflow.
      finite: its ``is_finite``.
      reason: its ``skip_reason``.
      groups: its ``groups_overflowed``.
    """
    name = nl.diagnostics.REASONS[reason]
    if finite:
        return None if name == "applied" else "applied, but skip_reason is %s" % name
    if not code:
        allowed = ("gradients_overflowed",) if genuine else ()
        target = None
    else:
        target = TARGETS[(code - 1) // len(VALUES)]
        allowed = (("loss_not_finite",) if target in _GROUP_OF_TARGET
                   else ("loss_not_finite", "gradients_overflowed"))
    if name not in allowed:
        return "skip_reason %s, expected one of %r (injected into %s)" % (
            name, allowed, target)
    if target in _GROUP_OF_TARGET and not groups[_GROUP_OF_TARGET[target]]:
        return "the poisoned %s is not among the groups that overflowed %r" % (target, groups)
    return None


def summary(report):
    """A few human-readable lines about a report."""
    c = report.config
    lines = [
        "soak: %d steps in %.1f s (seed %d, p=%g, %d burst(s) of %d)" % (
            c.steps, report.seconds, c.seed, c.p, len(c.bursts), c.burst_len),
        "  injected overflows:   %d (all caught: %s)" % (
            report.injected.sum(), not report.finite[report.injected].any()),
        "  genuine fp16 overflows: %d at scale 2**16, %d verified in the gradients" % (
            report.scale_overflow.sum(), report.grad_overflow.sum()),
        "  skipped / applied:    %d / %d, global_step %d" % (
            (~report.applied).sum(), report.applied.sum(), report.global_step),
        "  scale range:          [%g, %g], final %g" % (
            report.scale.min(), report.scale.max(), report.final_scale),
        "  weight checks:        %d" % report.weight_checks,
        "  skips by reason:      %s" % ", ".join(
            "%s %d" % (name, np.sum(report.reason == code))
            for code, name in enumerate(nl.diagnostics.REASONS) if code),
        "  collapse alarms:      %d, at steps %s (bursts at %s)" % (
            len(report.alarms), report.alarms, list(c.bursts)),
        "  violations:           %d" % len(report.violations),
    ]
    lines.extend("    " + v for v in report.violations[:50])
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--p", type=float, default=0.02,
                        help="probability of an injected overflow per step")
    args = parser.parse_args(argv)
    set_graph_mode()
    config = default_config(args.steps, seed=args.seed, p=args.p)
    report = run_soak(config, log=lambda line: print(line, flush=True))
    print(summary(report), flush=True)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
