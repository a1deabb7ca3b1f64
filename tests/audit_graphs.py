"""Small training graphs for tests/test_audit.py: each hazard the audit
reports, in its real-world form, and the same model without it.

Every builder returns a ``Case``: a fresh ``tf.Graph`` and the fetches a user
runs together in one ``session.run``. Graph-building only; nothing is run.
"""

import collections
import os
import sys

import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import backends as _backends
from npu_lossscale.core import commit as _commit
import models

#: The backend that reads Ascend's float-status register: "npu" in the first
#: releases; "float_status" once "npu" follows the device's overflow mode.
REGISTER_BACKEND = "float_status" if "float_status" in _backends.BACKENDS else "npu"

Case = collections.namedtuple("Case", ["graph", "fetches", "info"])

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GAN_DIR = os.path.join(REPO, "examples", "gan")


def gan(compute_dtype=tf.float16):
    """The shared two-group GAN of tests/models.py plus a global step."""
    model = models.two_group_gan(compute_dtype)
    return model, tf.train.get_or_create_global_step()


# -- graphs built with the library: must audit clean --------------------------------

def builder_gan(backend="is_finite", accumulation_steps=1, skip_policy="all",
                per_group_managers=False, manager=None, saver=True, **build_kwargs):
    """The documented pattern: one MultiOptimizerLossScale for G and D
    (``build_kwargs``: more of ``build()``'s arguments)."""
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        scaler = nl.MultiOptimizerLossScale(manager or nl.DynamicLossScaleManager(),
                                            backend=backend, skip_policy=skip_policy)
        extra = {}
        if per_group_managers:
            extra = {"loss_scale_manager": nl.DynamicLossScaleManager()}
        scaler.add(model.d_loss, tf.train.AdamOptimizer(1e-3), var_list=model.d_vars,
                   name="discriminator", **extra)
        scaler.add(model.g_loss, tf.train.AdamOptimizer(1e-3), var_list=model.g_vars,
                   name="generator")
        train = scaler.build(global_step=step, accumulation_steps=accumulation_steps,
                             **build_kwargs)
        if saver:
            tf.train.Saver()
    fetches = [train.update_op, train.is_finite, train.loss_scale, model.d_loss,
               model.g_loss]
    return Case(graph, fetches, {"train": train})


def optimizer_wrapper(backend="is_finite"):
    """One LossScaleOptimizer, as a drop-in for NPULossScaleOptimizer."""
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        loss = model.d_loss + model.g_loss
        opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(1e-3),
                                    nl.DynamicLossScaleManager(), backend=backend)
        train_op = opt.minimize(loss, global_step=step)
        tf.train.Saver()
    return Case(graph, [train_op, loss], {})


# -- NLS001: two per-optimizer loss-scale wrappers in one run ------------------------

def per_optimizer_wrappers(backend=REGISTER_BACKEND, manager=None):
    """Huawei's FAQ case with this library's wrapper: one LossScaleOptimizer
    per network, both fetched in one session.run (two status reads after the
    graph's one clear; two scales and gates)."""
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        make = manager or nl.DynamicLossScaleManager
        d_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(1e-3), make(), backend=backend)
        g_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(1e-3), make(), backend=backend)
        d_train = d_opt.minimize(model.d_loss, var_list=model.d_vars, global_step=step)
        g_train = g_opt.minimize(model.g_loss, var_list=model.g_vars)
        tf.train.Saver()
    return Case(graph, [d_train, g_train, model.d_loss, model.g_loss],
                {"d_train": d_train, "g_train": g_train})


def serial_reads_with_a_clear_between():
    """The per-group reads of npu_lossscale 0.2's ``skip_policy="per_group"``:
    D's gradients, read, clear, then G's backprop after that clear, read. The
    clear comes before G's read but not before G's forward ops (which D's
    loss shares), so it can wipe G's forward overflow."""
    from npu_bridge.helper import helper  # pylint: disable=import-outside-toplevel
    gen = helper.get_gen_ops()
    graph = tf.Graph()
    with graph.as_default():
        model, _ = gan()
        d_grads = tf.gradients(model.d_loss, model.d_vars)
        with tf.control_dependencies(d_grads + [model.d_loss]):
            d_status = gen.npu_get_float_status_v2()
        with tf.control_dependencies([d_status]):
            cleared = gen.npu_clear_float_status_v2()
        with tf.control_dependencies([cleared]):
            g_loss = tf.identity(model.g_loss)
        g_grads = tf.gradients(g_loss, model.g_vars)
        with tf.control_dependencies(g_grads + [g_loss]):
            g_status = gen.npu_get_float_status_v2()
    return Case(graph, [d_status, g_status], {})


def clear_after_the_forward_pass():
    """A clear ordered after the loss and before the backprop and the read:
    ordered with the read, but it wipes the forward pass's overflows."""
    from npu_bridge.helper import helper  # pylint: disable=import-outside-toplevel
    gen = helper.get_gen_ops()
    graph = tf.Graph()
    with graph.as_default():
        model, _ = gan()
        with tf.control_dependencies([model.d_loss]):
            cleared = gen.npu_clear_float_status_v2()
        with tf.control_dependencies([cleared]):
            d_loss = tf.identity(model.d_loss)
        grads = tf.gradients(d_loss, model.d_vars)
        with tf.control_dependencies(grads + [cleared]):
            status = gen.npu_get_float_status_v2()
    return Case(graph, [status] + grads, {})


def builder_with_loop_and_cond(backend=REGISTER_BACKEND):
    """The builder on a forward pass through a while loop and a cond (bodies
    of functional While/If under control flow v2, v1 frames otherwise)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.placeholder(tf.float32, [2, 2], name="x")
        w = tf.get_variable("w", [2, 2], initializer=tf.ones_initializer())
        _, h = tf.while_loop(
            lambda i, h: i < 2,
            lambda i, h: (i + 1, tf.tanh(tf.matmul(h, tf.cast(w, tf.float16)))),
            [tf.constant(0), tf.cast(x, tf.float16)])
        h = tf.cond(tf.reduce_sum(x) > 0, lambda: h * 2, lambda: h)
        loss = tf.reduce_sum(tf.cast(h, tf.float32))
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend=backend)
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.01), var_list=[w])
        train = scaler.build()
        tf.train.Saver()
    return Case(graph, [train.update_op], {})


def npu_loss_scale_optimizer_gan(per_optimizer=True):
    """The seed's GAN on Ascend: npu_bridge's NPULossScaleOptimizer (the
    shim's faithful copy; saturation mode, so it reads the register) per
    network, both fetched in one session.run. With ``per_optimizer=False``,
    the same model ported to one MultiOptimizerLossScale."""
    # pylint: disable=import-outside-toplevel
    from npu_bridge.estimator.npu.npu_loss_scale_manager import \
        ExponentialUpdateLossScaleManager
    from npu_bridge.estimator.npu.npu_loss_scale_optimizer import NPULossScaleOptimizer
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        if per_optimizer:
            ops = []
            for loss, variables, gs in ((model.d_loss, model.d_vars, step),
                                        (model.g_loss, model.g_vars, None)):
                manager = ExponentialUpdateLossScaleManager(2 ** 15, 1000)
                opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(2e-4), manager)
                ops.append(opt.minimize(loss, var_list=variables, global_step=gs))
        else:
            scaler = nl.MultiOptimizerLossScale(
                ExponentialUpdateLossScaleManager(2 ** 15, 1000), backend=REGISTER_BACKEND)
            scaler.add(model.d_loss, tf.train.AdamOptimizer(2e-4), var_list=model.d_vars,
                       name="discriminator")
            scaler.add(model.g_loss, tf.train.AdamOptimizer(2e-4), var_list=model.g_vars,
                       name="generator")
            ops = [scaler.build(global_step=step).update_op]
        tf.train.Saver()
    return Case(graph, ops + [model.d_loss, model.g_loss], {})


# -- NLS002 / NLS010 / NLS003: the DCGAN port bug and its relatives --------------

def dcgan_port_bug():
    """The G "optimizer" minimises D's loss over D's variables: the
    generator never trains and D is updated twice per step."""
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan(tf.float32)
        d_train = tf.train.AdamOptimizer(1e-3).minimize(
            model.d_loss, var_list=model.d_vars, global_step=step)
        g_train = tf.train.AdamOptimizer(1e-3).minimize(
            model.d_loss, var_list=model.d_vars)
    return Case(graph, [d_train, g_train], {})


def plain_gan():
    """The same GAN trained correctly with two plain optimizers."""
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan(tf.float32)
        d_train = tf.train.AdamOptimizer(1e-3).minimize(
            model.d_loss, var_list=model.d_vars, global_step=step)
        g_train = tf.train.AdamOptimizer(1e-3).minimize(
            model.g_loss, var_list=model.g_vars)
    return Case(graph, [d_train, g_train], {})


def swapped_gradients():
    """Gradients of the encoder's loss applied to the discriminator's
    variables of the same shapes (a mis-zipped apply_gradients)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.placeholder(tf.float32, [8, 4], name="x")
        with tf.variable_scope("encoder"):
            e_w = tf.get_variable("w", [4, 4])
        with tf.variable_scope("discriminator"):
            d_w = tf.get_variable("w", [4, 4])
        e_loss = tf.reduce_mean(tf.square(tf.matmul(x, e_w) - x), name="e_loss")
        d_loss = tf.reduce_mean(tf.nn.softplus(tf.matmul(x, d_w)), name="d_loss")
        e_opt, d_opt = tf.train.AdamOptimizer(1e-3), tf.train.AdamOptimizer(1e-3)
        e_grads = [g for g, _ in e_opt.compute_gradients(e_loss, var_list=[e_w])]
        d_grads = [g for g, _ in d_opt.compute_gradients(d_loss, var_list=[d_w])]
        e_train = e_opt.apply_gradients(zip(e_grads, [e_w]))
        d_train = d_opt.apply_gradients(zip(e_grads, [d_w]))  # the bug: e_grads
        d_fixed = d_opt.apply_gradients(zip(d_grads, [d_w]), name="fixed")
    return Case(graph, [e_train, d_train], {"fixed": [e_train, d_fixed]})


def builder_plus_minimize():
    """A builder over both networks plus a leftover plain minimize of D:
    D's variables and global_step are updated twice."""
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")
        scaler.add(model.d_loss, tf.train.AdamOptimizer(1e-3), var_list=model.d_vars, name="d")
        scaler.add(model.g_loss, tf.train.AdamOptimizer(1e-3), var_list=model.g_vars, name="g")
        train = scaler.build(global_step=step)
        leftover = tf.train.GradientDescentOptimizer(0.1).minimize(
            model.d_loss, var_list=model.d_vars, global_step=step)
    return Case(graph, [train.update_op, leftover], {"train": train})


# -- NLS004: collectives inside conds ------------------------------------------

def hccl_allreduce_in_cond(inside=True):
    """npu_bridge's allreduce of the gradients inside the apply cond (needs
    the shim on sys.path), or before it."""
    from npu_bridge.hccl import hccl_ops  # pylint: disable=import-outside-toplevel
    return _allreduce_case(lambda t: hccl_ops.allreduce(t, "sum"), inside)


def horovod_allreduce_in_cond(inside=True):
    """hvd.allreduce of the gradients inside tf.cond, or before it."""
    import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    hvd.init()
    return _allreduce_case(hvd.allreduce, inside)


def _allreduce_case(allreduce, inside):
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan(tf.float32)
        opt = tf.train.AdamOptimizer(1e-3)
        pairs = opt.compute_gradients(model.d_loss, var_list=model.d_vars)
        finite = tf.reduce_all([tf.reduce_all(tf.is_finite(g)) for g, _ in pairs])
        if not inside:
            pairs = [(allreduce(g), v) for g, v in pairs]

        def apply():
            reduced = [(allreduce(g), v) for g, v in pairs] if inside else pairs
            with tf.control_dependencies([opt.apply_gradients(reduced, global_step=step)]):
                return tf.constant(True)
        train = tf.cond(finite, apply, lambda: tf.constant(False))
    return Case(graph, [train], {})


# -- NLS005: batch norm statistics beside the gate ---------------------------------

def _batch_norm(x, scope, real_layer=True):
    """Batch norm in training mode.

    Returns:
      (y, update): with ``real_layer``, ``tf.layers.batch_normalization(
      training=True)`` where it exists (TF <= 2.15), which puts its moving-
      average updates in UPDATE_OPS, and ``update`` None. Otherwise the same
      normalisation by hand, with ``update``, a function that builds the
      moving-average updates (into UPDATE_OPS) where it is called.
    """
    if real_layer:
        try:
            return tf.layers.batch_normalization(x, training=True, name=scope), None
        except (AttributeError, ImportError, ValueError):
            pass
    with tf.variable_scope(scope):
        channels = int(x.shape[-1])
        moving_mean = tf.get_variable("moving_mean", [channels], trainable=False,
                                      initializer=tf.zeros_initializer())
        moving_variance = tf.get_variable("moving_variance", [channels], trainable=False,
                                          initializer=tf.ones_initializer())
    x32 = tf.cast(x, tf.float32)
    mean, variance = tf.nn.moments(x32, axes=[0])

    def update():
        with tf.name_scope(scope + "/"):
            ops = [tf.assign_sub(moving, (moving - value) * 0.01, name="AssignMovingAvg").op
                   for moving, value in ((moving_mean, mean), (moving_variance, variance))]
        for op in ops:
            tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, op)
        return ops

    y = tf.cast((x32 - mean) * tf.rsqrt(variance + 1e-5), x.dtype)
    if real_layer:
        update()
        return y, None
    return y, update


def _normalised_classifier(compute_dtype, normalise):
    """A classifier with a normalised hidden layer, trained by the builder in
    the default graph: ``normalise`` maps the hidden layer (in
    ``compute_dtype``) to its normalised value. Returns ``(train, loss)``."""
    x = tf.placeholder(tf.float32, [16, 8], name="x")
    y = tf.placeholder(tf.float32, [16, 1], name="y")
    w1 = tf.get_variable("w1", [8, 8])
    w2 = tf.get_variable("w2", [8, 1])
    step = tf.train.get_or_create_global_step()
    h = normalise(tf.matmul(tf.cast(x, compute_dtype), tf.cast(w1, compute_dtype)))
    logits = tf.cast(tf.matmul(tf.nn.relu(h), tf.cast(w2, compute_dtype)), tf.float32)
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")
    scaler.add(loss, tf.train.AdamOptimizer(1e-3), var_list=tf.trainable_variables(),
               name="net")
    return scaler.build(global_step=step), loss


def batch_norm_beside_gate(gated=False, compute_dtype=tf.float16):
    """A float16 classifier with batch norm trained by the builder; the
    UPDATE_OPS run in the same session.run as the gated update, or (with
    ``gated``) are built inside a cond on the step's decision."""
    graph = tf.Graph()
    with graph.as_default():
        layer = {}

        def normalise(h):
            h, layer["update"] = _batch_norm(h, "bn", real_layer=not gated)
            return h

        train, loss = _normalised_classifier(compute_dtype, normalise)
        fetches = [train.update_op, loss]
        if gated:
            # The fix without build(update_ops=...): statistics updated only
            # on applied steps, inside a cond on the same decision.
            def update_statistics():
                with tf.control_dependencies(layer["update"]()):
                    return tf.constant(True)
            fetches.append(tf.cond(train.is_finite, update_statistics,
                                   lambda: tf.constant(False)))
        else:
            fetches.extend(tf.get_collection(tf.GraphKeys.UPDATE_OPS))
    return Case(graph, fetches, {})


def batch_norm_around_step(step="builder", fixed=False):
    """The TF1 idiom ``with tf.control_dependencies(tf.get_collection(
    tf.GraphKeys.UPDATE_OPS)):`` around the step (``step``: the builder's
    ``build()``, or ``LossScaleOptimizer.minimize``), on a float16 classifier
    with batch norm: the moving-statistics updates become control inputs of
    the step's own ops, so every run runs them, skipped or not. ``fixed``:
    no control_dependencies, the ops passed to ``build(update_ops=...)``."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.placeholder(tf.float32, [16, 8], name="x")
        y = tf.placeholder(tf.float32, [16, 1], name="y")
        w1 = tf.get_variable("w1", [8, 8])
        w2 = tf.get_variable("w2", [8, 1])
        global_step = tf.train.get_or_create_global_step()
        h, _ = _batch_norm(tf.matmul(tf.cast(x, tf.float16), tf.cast(w1, tf.float16)), "bn")
        logits = tf.cast(tf.matmul(tf.nn.relu(h), tf.cast(w2, tf.float16)), tf.float32)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))
        statistics = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
        assert statistics
        if fixed:
            scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(),
                                                backend="is_finite")
            scaler.add(loss, tf.train.AdamOptimizer(1e-3), var_list=[w1, w2], name="net")
            train = scaler.build(global_step=global_step, update_ops=statistics).update_op
        else:
            with tf.control_dependencies(statistics):
                if step == "builder":
                    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(),
                                                        backend="is_finite")
                    scaler.add(loss, tf.train.AdamOptimizer(1e-3), var_list=[w1, w2],
                               name="net")
                    train = scaler.build(global_step=global_step).update_op
                else:
                    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(1e-3),
                                                nl.DynamicLossScaleManager(),
                                                backend="is_finite")
                    train = opt.minimize(loss, global_step=global_step)
        tf.train.Saver()
    return Case(graph, [train, loss], {})


def batch_norm_in_place(compute_dtype=tf.float16):
    """contrib's ``batch_norm(..., updates_collections=None)`` in training
    mode: the moving averages are updated in place, inside the forward pass
    (tensorflow/contrib/layers/python/layers/layers.py, r1.15, batch_norm's
    ``_force_updates``: ``assign_moving_average`` of the moving mean and
    variance, and the batch moments returned under a control dependency on
    both), so nothing is in UPDATE_OPS and every run of the loss runs them.
    contrib is gone from TF 2, so the layer is written out here with the same
    ops."""
    from tensorflow.python.training import moving_averages  # pylint: disable=import-outside-toplevel

    def normalise(h):
        with tf.variable_scope("BatchNorm"):
            moving_mean = tf.get_variable("moving_mean", [8], trainable=False,
                                          initializer=tf.zeros_initializer())
            moving_variance = tf.get_variable("moving_variance", [8], trainable=False,
                                              initializer=tf.ones_initializer())
            h32 = tf.cast(h, tf.float32)
            mean, variance = tf.nn.moments(h32, [0])
            # contrib's defaults: zero_debias_moving_mean=False, decay=0.999.
            update_mean = moving_averages.assign_moving_average(
                moving_mean, mean, 0.999, zero_debias=False)
            update_variance = moving_averages.assign_moving_average(
                moving_variance, variance, 0.999, zero_debias=False)
            with tf.control_dependencies([update_mean, update_variance]):
                mean, variance = tf.identity(mean), tf.identity(variance)
            return tf.cast(tf.nn.batch_normalization(h32, mean, variance, None, None, 1e-3),
                           compute_dtype)

    graph = tf.Graph()
    with graph.as_default():
        train, loss = _normalised_classifier(compute_dtype, normalise)
        tf.train.Saver()
        assert not tf.get_collection(tf.GraphKeys.UPDATE_OPS)
    return Case(graph, [train.update_op, loss], {})


def wrapped_update(wrap, fixed=False):
    """A float16 classifier trained by the builder, and a counter update that
    a script wraps (``models.UPDATE_WRAPPERS[wrap]``) and hands to a gate.

    With ``fixed`` the wrapper goes to ``build(update_ops=...)``, which gates
    the update behind it. Otherwise the gate holds the wrapper alone, as the
    builder did before issue #24 for any wrapper but an identity or a group:
    the builder's pivot gate (``commit.gate``) given the wrapper's op, on the
    step's decision, its result fetched with ``update_op``.
    """
    graph = tf.Graph()
    with graph.as_default():
        counter = tf.get_variable("counter", [], initializer=tf.zeros_initializer(),
                                  trainable=False)
        entry = models.UPDATE_WRAPPERS[wrap](tf.assign_add(counter, 1.0))
        x = tf.placeholder(tf.float32, [16, 8], name="x")
        y = tf.placeholder(tf.float32, [16, 1], name="y")
        w = tf.get_variable("w", [8, 1])
        logits = tf.cast(tf.matmul(tf.cast(x, tf.float16), tf.cast(w, tf.float16)), tf.float32)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite",
                                            gate="pivot")
        scaler.add(loss, tf.train.AdamOptimizer(1e-3), var_list=[w], name="net")
        train = scaler.build(global_step=tf.train.get_or_create_global_step(),
                             update_ops=[entry] if fixed else None)
        fetches = [train.update_op, loss]
        if not fixed:
            with tf.name_scope("loss_scale/"):
                fetches.append(_commit.gate("pivot", train.is_finite, lambda scope: [],
                                            "update_ops_if_finite",
                                            existing=[getattr(entry, "op", entry)]))
        tf.train.Saver()
    return Case(graph, fetches, {})


def weight_average_beside_gate():
    """The DCGAN example's pattern: an EMA of the weights and a skipped-step
    counter updated after the gated update, outside the gate (harmless)."""
    graph = tf.Graph()
    with graph.as_default():
        case = builder_gan(saver=False)  # one Saver, made last (below)
    graph = case.graph
    with graph.as_default():
        train = case.info["train"]
        weights = tf.trainable_variables("generator")
        with tf.control_dependencies([train.update_op]):
            averages = []
            for var in weights:
                avg = tf.get_variable("ema/" + var.op.name, var.shape, trainable=False,
                                      initializer=tf.zeros_initializer())
                averages.append(tf.assign(avg, 0.99 * avg + 0.01 * var))
        counter = tf.get_variable("skipped_steps", [], tf.int64, trainable=False,
                                  initializer=tf.zeros_initializer())
        skipped = tf.assign_add(counter, tf.cast(tf.logical_not(train.is_finite), tf.int64))
        step_op = tf.group(train.update_op, skipped, *averages)
        tf.train.Saver()
    return Case(graph, [step_op], {})


# -- NLS006: a Saver without the scale -------------------------------------------

def saver_without_scale(explicit=True):
    """A Saver with an explicit var_list of the model's variables only."""
    case = builder_gan(saver=False)
    with case.graph.as_default():
        if explicit:
            tf.train.Saver(var_list=tf.trainable_variables()
                           + [tf.train.get_global_step()])
        else:
            tf.train.Saver()
    return case


def saver_before_build(manager_first=False):
    """The usual TF1 order gone wrong: the model, then ``tf.train.Saver()``,
    then the loss scaling (the manager, or with ``manager_first`` only
    ``build()``). The Saver's default var_list is fixed when it is made."""
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        manager = nl.DynamicLossScaleManager() if manager_first else None
        tf.train.Saver()
        scaler = nl.MultiOptimizerLossScale(manager or nl.DynamicLossScaleManager(),
                                            backend="is_finite")
        scaler.add(model.d_loss, tf.train.AdamOptimizer(1e-3), var_list=model.d_vars,
                   name="discriminator")
        scaler.add(model.g_loss, tf.train.AdamOptimizer(1e-3), var_list=model.g_vars,
                   name="generator")
        train = scaler.build(global_step=step)
    return Case(graph, [train.update_op, model.d_loss, model.g_loss], {"train": train})


# -- NLS007: float16 weights ----------------------------------------------------

def float16_weights(master=False):
    """A float16 model whose variables are float16 (or float32 masters)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.placeholder(tf.float16, [8, 4], name="x")
        dtype = tf.float32 if master else tf.float16
        w = tf.get_variable("w", [4, 1], dtype=dtype)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, tf.cast(w, tf.float16))))
        opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(1e-3),
                                    nl.DynamicLossScaleManager(), backend="is_finite")
        train = opt.minimize(tf.cast(loss, tf.float32))
    return Case(graph, [train], {})


# -- NLS009: accumulation outside the window's gate ------------------------------

def hand_accumulation(gate_on_window=False, steps=4):
    """Gradient accumulation written by hand around one loss-scale check.

    Every run adds this micro-batch's unscaled gradients to float32
    accumulators (unchecked); every ``steps`` runs the sums are applied inside
    a cond on "window end and this run finite": an overflow in an earlier
    micro-batch slips through. With ``gate_on_window`` the cond checks the
    accumulated sums themselves instead.
    """
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        manager = nl.DynamicLossScaleManager()
        scale = manager.get_loss_scale()
        variables = model.d_vars + model.g_vars
        opt = tf.train.AdamOptimizer(1e-3)
        loss = model.d_loss + model.g_loss
        grads = tf.gradients(tf.cast(loss, tf.float32) * scale, variables)
        grads = [tf.cast(g, tf.float32) / scale for g in grads]
        counter = tf.Variable(0, trainable=False, name="micro_step")
        sums = [tf.Variable(tf.zeros(v.shape), trainable=False, name="acc_%d" % i)
                for i, v in enumerate(variables)]
        adds = [tf.assign_add(s, g) for s, g in zip(sums, grads)]
        with tf.control_dependencies(adds):
            count = tf.assign_add(counter, 1)
            reads = [s.read_value() for s in sums]
        if gate_on_window:
            finite = tf.reduce_all([tf.reduce_all(tf.is_finite(r)) for r in reads])
        else:
            finite = tf.reduce_all([tf.reduce_all(tf.is_finite(g)) for g in grads])
        window_end = tf.equal(count % steps, 0)

        def apply():
            with tf.control_dependencies([opt.apply_gradients(
                    [(r / steps, v) for r, v in zip(reads, variables)], global_step=step)]):
                return tf.group(*[tf.assign(s, tf.zeros_like(s)) for s in sums])
        train = tf.cond(tf.logical_and(window_end, finite), apply, tf.no_op)
        update = manager.update_loss_scale(finite)
        tf.train.Saver()
    return Case(graph, [train, update], {})


# -- NLS011: one manager updated twice per run ---------------------------------------

def shared_manager_npu_optimizers(one_optimizer=False):
    """One npu_bridge ExponentialUpdateLossScaleManager behind two
    NPULossScaleOptimizers (or, with ``one_optimizer``, one
    NPULossScaleOptimizer used for both minimize calls), both train ops
    fetched in one session.run: each minimize groups its own
    ``update_loss_scale`` (the shim's copy of tf_adapter
    npu_bridge/estimator/npu/npu_loss_scale_optimizer.py, which refuses
    neither), so the manager's state is updated twice per run. Needs the
    shim (or npu_bridge) on sys.path."""
    # pylint: disable=import-outside-toplevel
    from npu_bridge.estimator.npu.npu_loss_scale_manager import \
        ExponentialUpdateLossScaleManager
    from npu_bridge.estimator.npu.npu_loss_scale_optimizer import NPULossScaleOptimizer
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        manager = ExponentialUpdateLossScaleManager(2 ** 15, 1000)
        shared = NPULossScaleOptimizer(tf.train.AdamOptimizer(1e-3), manager)
        d_opt = shared
        g_opt = shared if one_optimizer else NPULossScaleOptimizer(
            tf.train.AdamOptimizer(1e-3), manager)
        d_train = d_opt.minimize(model.d_loss, var_list=model.d_vars, global_step=step)
        g_train = g_opt.minimize(model.g_loss, var_list=model.g_vars)
        tf.train.Saver()
    return Case(graph, [d_train, g_train, model.d_loss, model.g_loss],
                {"d_train": d_train, "g_train": g_train})


def shared_manager_steps(kind):
    """One ``DynamicLossScaleManager`` updated by two step ops of this
    library, the ModelZoo alternating-GAN pattern: two LossScaleOptimizers
    sharing it (``kind="optimizers"``), one LossScaleOptimizer minimizing
    twice (``"minimize_twice"``), or two builders sharing it
    (``"builders"``). Each run of one step op updates it once; a run of both
    is refused at run time (``npu_lossscale.core.claims``). Fetches: both step
    ops; ``info["steps"]`` lists them."""
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        manager = nl.DynamicLossScaleManager()
        pairs = ((model.d_loss, model.d_vars, "d", step), (model.g_loss, model.g_vars, "g", None))
        steps = []
        if kind == "builders":
            for loss, variables, name, global_step in pairs:
                scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
                scaler.add(loss, tf.train.AdamOptimizer(1e-3), var_list=variables, name=name)
                steps.append(scaler.build(global_step=global_step).update_op)
        else:
            first = nl.LossScaleOptimizer(tf.train.AdamOptimizer(1e-3), manager,
                                          backend="is_finite")
            second = first if kind == "minimize_twice" else nl.LossScaleOptimizer(
                tf.train.AdamOptimizer(1e-3), manager, backend="is_finite")
            for opt, (loss, variables, _, global_step) in zip((first, second), pairs):
                steps.append(opt.minimize(loss, var_list=variables, global_step=global_step))
        tf.train.Saver()
    return Case(graph, list(steps), {"steps": steps})


def listening_builders(shared=False):
    """The GAN trained through a ``ListeningLossScaleManager``, whose one
    update writes ``dynamic_loss_scale/state`` twice in sequence (the
    dynamic rule, then the measurement's correction): one builder, or with
    ``shared`` two builders (D's, G's) sharing the manager. Fetches: the
    step ops, one per builder."""
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        manager = nl.ListeningLossScaleManager()
        groups = [(model.d_loss, model.d_vars, "d"), (model.g_loss, model.g_vars, "g")]
        builders = [groups[:1], groups[1:]] if shared else [groups]
        steps = []
        for index, members in enumerate(builders):
            scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
            for loss, variables, name in members:
                scaler.add(loss, tf.train.AdamOptimizer(1e-3), var_list=variables, name=name)
            steps.append(scaler.build(global_step=step if index == 0 else None).update_op)
        tf.train.Saver()
    return Case(graph, steps, {})


def shared_optimizer(kind, separate=False):
    """One ``AdamOptimizer`` object for D and G across two steps: two
    builders (``kind="builders"``), a builder and a plain ``minimize``
    (``"builder_and_minimize"``), one ``LossScaleOptimizer`` minimizing
    twice (``"minimize_twice"``), or plain TF's two ``minimize`` calls
    (``"plain"``). Its ``beta1_power`` and ``beta2_power`` advance on each
    step. ``separate``: an optimizer per step instead. Fetches: both steps."""
    graph = tf.Graph()
    with graph.as_default():
        model, global_step = gan()
        shared = tf.train.AdamOptimizer(1e-3)

        def adam():
            return tf.train.AdamOptimizer(1e-3) if separate else shared
        steps = []
        for index, (loss, variables, name) in enumerate(
                ((model.d_loss, model.d_vars, "d"), (model.g_loss, model.g_vars, "g"))):
            step = global_step if index == 0 else None
            if kind == "builders" or kind == "builder_and_minimize" and index == 0:
                scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(),
                                                    backend="is_finite")
                scaler.add(loss, adam(), var_list=variables, name=name)
                steps.append(scaler.build(global_step=step).update_op)
            elif kind == "minimize_twice":
                if index == 0:
                    wrapper = nl.LossScaleOptimizer(adam(), nl.DynamicLossScaleManager(),
                                                    backend="is_finite")
                elif separate:
                    wrapper = nl.LossScaleOptimizer(adam(), nl.DynamicLossScaleManager(),
                                                    backend="is_finite")
                steps.append(wrapper.minimize(loss, var_list=variables, global_step=step))
            else:
                steps.append(adam().minimize(loss, var_list=variables, global_step=step))
        tf.train.Saver()
    return Case(graph, steps, {})


def builder_per_group_ops(skip_policy="all"):
    """The builder with ``per_group_ops=True``: ``update_op`` and
    ``per_group["d"]``/``["g"]`` each update the one manager."""
    graph = tf.Graph()
    with graph.as_default():
        model, step = gan()
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(),
                                            backend="is_finite", skip_policy=skip_policy)
        scaler.add(model.d_loss, tf.train.AdamOptimizer(1e-3), var_list=model.d_vars,
                   name="d")
        scaler.add(model.g_loss, tf.train.AdamOptimizer(1e-3), var_list=model.g_vars,
                   name="g")
        train = scaler.build(global_step=step, per_group_ops=True)
        tf.train.Saver()
    return Case(graph, [train.update_op, train.per_group["d"]], {"train": train})


def moving_statistics_layer(x, name, momentum=0.9):
    """Training-mode batch norm as ``tf.layers.batch_normalization`` builds
    it, in float32: the moving averages' updates go into UPDATE_OPS as the
    ``assign_sub`` results themselves (a variable-like under resource
    variables), named under the calling name scope, so a second call of a
    network with ``reuse=True`` puts them under ``<network>_1/``."""
    x32 = tf.cast(x, tf.float32)
    with tf.variable_scope(name):
        channels = int(x.shape[-1])
        gamma = tf.get_variable("gamma", [channels], initializer=tf.ones_initializer())
        beta = tf.get_variable("beta", [channels], initializer=tf.zeros_initializer())
        mean, variance = tf.nn.moments(x32, [0])
        for stat, value, start in (("moving_mean", mean, tf.zeros_initializer()),
                                   ("moving_variance", variance, tf.ones_initializer())):
            moving = tf.get_variable(stat, [channels], trainable=False, initializer=start)
            tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, tf.assign_sub(
                moving, (moving - value) * (1.0 - momentum), name="AssignMovingAvg"))
    return tf.cast(tf.nn.batch_normalization(x32, mean, variance, beta, gamma, 1e-3),
                   x.dtype)


def pix2pix_like_gan():
    """A pix2pix-shaped float16 GAN: batch norm in both networks, the
    discriminator called twice (``discriminator/`` on real pairs,
    ``discriminator_1/`` on fake ones, each call with its own UPDATE_OPS).

    Returns:
      (x, z, d_loss, g_loss, global_step), in the default graph.
    """
    x = tf.placeholder(tf.float32, [8, 4], name="x")
    z = tf.placeholder(tf.float32, [8, 4], name="z")

    def dense(h, units, name):
        w = tf.get_variable(name + "_w", [int(h.shape[-1]), units])
        return tf.matmul(h, tf.cast(w, tf.float16))

    def generator(noise):
        with tf.variable_scope("generator"):
            h = tf.nn.relu(moving_statistics_layer(dense(tf.cast(noise, tf.float16), 8,
                                                          "fc1"), "bn1"))
            return tf.tanh(dense(h, 4, "fc2"))

    def discriminator(images, reuse):
        with tf.variable_scope("discriminator", reuse=reuse):
            h = tf.nn.leaky_relu(moving_statistics_layer(
                dense(tf.cast(images, tf.float16), 8, "fc1"), "bn1"), 0.2)
            return tf.cast(dense(h, 1, "fc2"), tf.float32)

    fake = generator(z)
    d_real, d_fake = discriminator(x, reuse=False), discriminator(fake, reuse=True)
    d_loss = tf.reduce_mean(tf.nn.softplus(-d_real)) + tf.reduce_mean(tf.nn.softplus(d_fake))
    g_loss = tf.reduce_mean(tf.nn.softplus(-d_fake))
    return x, z, d_loss, g_loss, tf.train.get_or_create_global_step()


def per_group_port(authors_saver=True):
    """The pix2pix port of issue 24, correct: one builder, ``per_group_ops``
    for the alternating loop, every call's UPDATE_OPS given to its group
    (docs/porting.md's recipe), and a Saver made after ``build()``. With
    ``authors_saver`` the script's own ``tf.train.Saver()``, made before the
    loss scaling and no longer used, is still in the graph (scope ``save``;
    the port's is ``save_1``)."""
    graph = tf.Graph()
    with graph.as_default():
        _, _, d_loss, g_loss, step = pix2pix_like_gan()
        if authors_saver:
            tf.train.Saver()
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(),
                                            backend="is_finite")
        scaler.add(d_loss, tf.train.AdamOptimizer(1e-3),
                   var_list=tf.trainable_variables("discriminator/"), name="d")
        scaler.add(g_loss, tf.train.AdamOptimizer(1e-3),
                   var_list=tf.trainable_variables("generator/"), name="g")
        train = scaler.build(global_step=step, per_group_ops=True, update_ops={
            "d": tf.get_collection(tf.GraphKeys.UPDATE_OPS, r"discriminator(_\d+)?/"),
            "g": tf.get_collection(tf.GraphKeys.UPDATE_OPS, r"generator(_\d+)?/")})
        saver = tf.train.Saver()
    return Case(graph, [train.per_group["d"], d_loss],
                {"train": train, "g_fetches": [train.per_group["g"], g_loss],
                 "saver": saver})


# -- the repository's own models ----------------------------------------------------

def example_graph(script, argv):
    """The training graph of ``examples/gan/<script>.py`` built with ``argv``.

    Returns:
      (graph, the example's Graph object).
    """
    if GAN_DIR not in sys.path:
        sys.path.insert(0, GAN_DIR)
    module = __import__(script)
    import cli  # examples/gan/cli.py: both scripts' flags
    parse = getattr(cli, "parse_%s_args" % script)
    args = parse(module.PROG, module.__doc__, argv)
    graph = tf.Graph()
    with graph.as_default():
        built = module.Graph(tf, nl, args)
    return graph, built


def ascend_meta_graph(meta):
    """A copy of ``meta`` with every shim-emulated node turned into its real
    adapter op type (``NpuGetFloatStatusV2``, ``HcomAllReduce``...), as the
    graph of an Ascend host reads: TF cannot import it without npu_bridge."""
    copy = tf.MetaGraphDef()
    copy.CopyFrom(meta)
    nodes = list(copy.graph_def.node)
    for function in copy.graph_def.library.function:
        nodes.extend(function.node_def)
    for node in nodes:
        if "_npu_shim_op_type" in node.attr:
            node.op = node.attr["_npu_shim_op_type"].s.decode("utf-8")
            del node.attr["_npu_shim_op_type"]
    return copy

