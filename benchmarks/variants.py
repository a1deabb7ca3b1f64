"""The training steps compared by the benchmark, each built on a ``gan.GanModel``.

Every variant trains the same groups with one ``AdamOptimizer(1e-4)`` per
group and advances ``global_step`` once per applied step; every variant
computes all gradients of the step before any apply (the GAN step's
semantics: both networks' gradients are taken at the same weights).

* ``floor``: no loss scaling, no check. One ``tf.gradients`` per distinct loss
  (over the union of the groups' variables, gated per op as
  ``Optimizer.compute_gradients`` does), then every apply, then the step
  increment. The cheapest correct step: what any loss scaling is measured
  against.
* ``builder``: ``MultiOptimizerLossScale(DynamicLossScaleManager(),
  backend="is_finite")``, one ``add`` per group, ``build(global_step)``.
* ``builder_xla``: the same on ``backend="xla"``: the check, the unscale
  and any clip factor compiled into one XLA cluster (issue 34).
* ``builder_npu``: the same on ``backend="npu"`` with the CPU shim of
  npu_bridge (``shims/``). The shim instruments every float16 op it sees to
  emulate the float-status register, so this row measures the shim, not an
  Ascend device; it is reported apart and never compared with a target.
* ``peer_a``: TF's own loss scaling, one
  ``tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer`` with a
  ``tf.compat.v1.mixed_precision.DynamicLossScale`` per optimizer (its own
  scale, its own backprop, its own check and cond), ``compute_gradients`` of
  each, then (after all gradients) ``apply_gradients`` of each.
* ``peer_b``: the per-optimizer pattern of npu_bridge's
  ``NPULossScaleOptimizer`` written by hand, with the float-status read
  replaced by this package's is_finite check: per optimizer one
  ``DynamicLossScaleManager``, the loss scaled in its own dtype, its own
  backprop, the gradients multiplied by the reciprocal scale, one check, one
  ``cond`` around its apply and one manager update.
"""

from __future__ import absolute_import, division, print_function

import collections
import os
import sys

import tensorflow.compat.v1 as tf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIMS = os.path.join(REPO, "shims")
if REPO not in sys.path:
    sys.path.insert(1, REPO)

import npu_lossscale as nl  # noqa: E402
from npu_lossscale import backends as nl_backends  # noqa: E402

#: Initial loss scale of every scaled variant (TF's and Keras' default).
INITIAL_SCALE = 2.0 ** 15
#: Growth period of every dynamic scale (TF's default); longer than any run,
#: so the scale never moves during a benchmark.
GROWTH_STEPS = 2000
LEARNING_RATE = 1e-4

VARIANTS = ("floor", "builder", "builder_xla", "builder_npu", "peer_a", "peer_b")
#: Variants compared with the targets (the shim row is reported apart).
TARGET_VARIANTS = ("floor", "builder", "builder_xla", "peer_a", "peer_b")

Built = collections.namedtuple("Built", ["train_op", "global_step"])


def _adam():
    return tf.train.AdamOptimizer(LEARNING_RATE)


def _shared_gradients(groups, scale_loss=None):
    """One backprop per distinct loss: group name -> [(grad, var)]."""
    by_loss = collections.OrderedDict()
    for group in groups:
        by_loss.setdefault(id(group.loss), []).append(group)
    result = {}
    for members in by_loss.values():
        loss = members[0].loss
        if scale_loss is not None:
            loss = scale_loss(loss)
        variables = [v for g in members for v in g.var_list]
        grads = tf.gradients(loss, variables, gate_gradients=True)
        offset = 0
        for g in members:
            n = len(g.var_list)
            result[g.name] = list(zip(grads[offset:offset + n], g.var_list))
            offset += n
    return result


def _barrier(tensors, name="all_gradients"):
    """One op after every tensor. Ops that must follow them all take it as
    their single control input (N control inputs on each of N apply ops would
    make the graph quadratic in the variable count)."""
    return tf.group(*tensors, name=name)


def apply_after(model, grads, after):
    """One Adam apply per group once every tensor in ``after`` exists, then
    the step increment: the floor's tail, also used by ablation.py."""
    gs = tf.train.get_or_create_global_step()
    with tf.control_dependencies([_barrier(after)]):
        applies = [_adam().apply_gradients(grads[g.name], name="apply_" + g.name)
                   for g in model.groups]
    with tf.control_dependencies(applies):
        train = tf.assign_add(gs, 1).op
    return Built(train, gs)


def build_floor(model):
    grads = _shared_gradients(model.groups)
    return apply_after(model, grads, [g for gv in grads.values() for g, _ in gv])


def build_builder(model, backend="is_finite", manager=None, gate="auto"):
    gs = tf.train.get_or_create_global_step()
    if manager is None:
        manager = nl.DynamicLossScaleManager(initial_scale=INITIAL_SCALE,
                                             growth_steps=GROWTH_STEPS)
    scaler = nl.MultiOptimizerLossScale(manager, backend=backend, gate=gate)
    for g in model.groups:
        scaler.add(g.loss, _adam(), var_list=g.var_list, name=g.name)
    train = scaler.build(global_step=gs)
    return Built(train.update_op, gs)


def shim_status():
    """(usable, reason): whether ``backend="npu"`` works with shims/ first."""
    if not os.path.isdir(os.path.join(SHIMS, "npu_bridge")):
        return False, "shims/npu_bridge is missing"
    if sys.path[0] != SHIMS:
        sys.path.insert(0, SHIMS)
    try:
        import npu_bridge  # noqa: F401  pylint: disable=import-outside-toplevel
        from npu_bridge import _emulation  # pylint: disable=import-outside-toplevel
        _emulation.uninstall()  # instrument only the graphs built for the npu row
        try:
            from npu_bridge.helper import helper  # pylint: disable=import-outside-toplevel
            helper.get_gen_ops()
        except ImportError:
            return False, "npu_bridge imports but its gen ops do not"
    except Exception as error:  # pylint: disable=broad-except
        return False, "importing the shim failed: %s: %s" % (type(error).__name__, error)
    return True, ""


def build_builder_npu(model):
    """The register path: saturation mode (npu_plugin.set_device_sat_mode(0)),
    where the npu backend reads the float-status register."""
    from npu_bridge import _emulation  # pylint: disable=import-outside-toplevel
    from npu_bridge.estimator.npu import npu_plugin  # pylint: disable=import-outside-toplevel
    _emulation.install()
    npu_plugin.set_device_sat_mode(0)
    try:
        return build_builder(model, backend="npu")
    finally:
        _emulation.uninstall()


def build_peer_a(model):
    gs = tf.train.get_or_create_global_step()
    wrappers, grads = [], []
    for g in model.groups:
        scale = tf.mixed_precision.DynamicLossScale(
            initial_loss_scale=INITIAL_SCALE, increment_period=GROWTH_STEPS,
            multiplier=2.0)
        opt = tf.mixed_precision.MixedPrecisionLossScaleOptimizer(_adam(), scale)
        wrappers.append(opt)
        with tf.name_scope(g.name):
            grads.append(opt.compute_gradients(g.loss, var_list=g.var_list))
    all_grads = [gr for gv in grads for gr, _ in gv if gr is not None]
    with tf.control_dependencies([_barrier(all_grads)]):
        applies = [opt.apply_gradients(gv, global_step=gs if i == 0 else None,
                                       name="apply_" + g.name)
                   for i, (opt, gv, g) in enumerate(zip(wrappers, grads, model.groups))]
    return Built(tf.group(*applies), gs)


def build_peer_b(model):
    gs = tf.train.get_or_create_global_step()
    backend = nl_backends.IsFiniteBackend()
    per_group = []
    for g in model.groups:
        with tf.name_scope(g.name):
            manager = nl.DynamicLossScaleManager(initial_scale=INITIAL_SCALE,
                                                 growth_steps=GROWTH_STEPS)
            opt = _adam()
            scale = manager.get_loss_scale()
            scaled_loss = g.loss * tf.cast(scale, g.loss.dtype.base_dtype)
            gv = [(gr, v) for gr, v in opt.compute_gradients(scaled_loss, var_list=g.var_list)
                  if gr is not None]
            grads = [gr for gr, _ in gv]
            finite = tf.equal(backend.overflow_flag(grads), 0.0)
            inv = tf.reciprocal(scale)
            unscaled = [(gr * tf.cast(inv, gr.dtype.base_dtype), v) for gr, v in gv]
            per_group.append((g, manager, opt, unscaled, finite, grads))
    all_grads = [gr for item in per_group for gr in item[5]]
    ops = []
    with tf.control_dependencies([_barrier(all_grads)]):
        for i, (g, manager, opt, unscaled, finite, _) in enumerate(per_group):
            def apply_fn(opt=opt, unscaled=unscaled, step=(gs if i == 0 else None),
                         name="apply_" + g.name):
                with tf.name_scope(None):
                    return tf.group(opt.apply_gradients(unscaled, global_step=step, name=name))
            applied = tf.cond(finite, apply_fn, tf.no_op, name="cond_" + g.name)
            ops.append(tf.group(applied, manager.update_loss_scale(finite)))
    return Built(tf.group(*ops), gs)


BUILDERS = {
    "floor": build_floor,
    "builder": build_builder,
    "builder_xla": lambda model: build_builder(model, backend="xla"),
    "builder_npu": build_builder_npu,
    "peer_a": build_peer_a,
    "peer_b": build_peer_b,
}
