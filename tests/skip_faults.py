"""The faults of tests/test_diagnostics.py: a two-group float16 model with
switches that poison a loss, a variable's gradient, or a forward branch
that no loss value or gradient keeps; a fault schedule; and what the
skip record must say of each fault.
"""

import collections

import numpy as np
import tensorflow.compat.v1 as tf

import npu_lossscale as nl

Model = collections.namedtuple(
    "Model", ["x", "outside", "loss_poison", "grad_factor", "losses", "var_lists", "feed"])

GROUPS = ("a", "b")


def poisoned_gradient(tensor, factor):
    """``tensor`` in the forward pass; in the backward pass its gradient is
    multiplied by ``factor`` (float32) and cast back to its dtype, so an inf
    (or a huge factor) overflows float16 right there."""
    @tf.custom_gradient
    def identity(value):
        def grad(upstream):
            return tf.cast(tf.cast(upstream, tf.float32) * factor, upstream.dtype)
        return tf.identity(value), grad
    return identity(tensor)


def build_model(batch=4, dim=3):
    """Two groups, "a" and "b", each a float16 tanh layer over float32
    weights ``<group>/w`` and ``<group>/b``, each weight cast once.

    Fault switches (placeholders with defaults, so a clean run feeds none):
    ``loss_poison[g]`` multiplies group g's float32 loss; ``grad_factor[v]``
    multiplies variable v's gradient (``poisoned_gradient``); ``outside``
    multiplies a forward float16 branch that is clipped to [0, 1] before it
    joins the losses, so its overflow reaches no loss value and no gradient.
    """
    rng = np.random.RandomState(7)
    x = tf.placeholder(tf.float32, [batch, dim], name="x")
    x16 = tf.cast(x, tf.float16)
    outside = tf.placeholder_with_default(tf.constant(1.0), [], name="outside")
    spike = tf.minimum(tf.abs(x16) * tf.cast(outside, tf.float16), tf.constant(1.0, tf.float16))
    losses, var_lists, loss_poison, grad_factor = {}, {}, {}, {}
    for group in GROUPS:
        with tf.variable_scope(group):
            w = tf.get_variable("w", initializer=rng.normal(0, 0.5, [dim, dim]).astype(np.float32))
            b = tf.get_variable("b", initializer=rng.normal(0, 0.5, [dim]).astype(np.float32))
        for var in (w, b):
            grad_factor[var.op.name] = tf.placeholder_with_default(
                tf.constant(1.0), [], name="factor_" + var.op.name.replace("/", "_"))
        hidden = tf.tanh(
            tf.matmul(x16, poisoned_gradient(tf.cast(w, tf.float16), grad_factor[w.op.name]))
            + poisoned_gradient(tf.cast(b, tf.float16), grad_factor[b.op.name]))
        loss_poison[group] = tf.placeholder_with_default(tf.constant(1.0), [],
                                                         name="poison_" + group)
        out = tf.reduce_mean(tf.square(hidden)) + tf.reduce_mean(spike) * 0.01
        losses[group] = tf.cast(out, tf.float32) * loss_poison[group]
        var_lists[group] = [w, b]
    feed = {x: rng.normal(0, 1, [batch, dim]).astype(np.float32)}
    return Model(x, outside, loss_poison, grad_factor, losses, var_lists, feed)


def build_shared_model(batch=4, dim=3):
    """A GAN's shape: group "d"'s weight ``d/w`` is applied to the real
    batch and to group "g"'s fakes, each use casting it to float16, so its
    gradient is the sum of two uses' gradients (tf.gradients' ``AddN``).

    ``grad_factor["d/w"]`` multiplies the gradient of the fake use only
    (``poisoned_gradient``); ``loss_poison`` and ``outside`` are fed nothing
    here (they are constants).
    """
    rng = np.random.RandomState(11)
    x = tf.placeholder(tf.float32, [batch, dim], name="x")
    x16 = tf.cast(x, tf.float16)
    with tf.variable_scope("g"):
        g_w = tf.get_variable("w", initializer=rng.normal(0, 0.5, [dim, dim]).astype(np.float32))
    with tf.variable_scope("d"):
        d_w = tf.get_variable("w", initializer=rng.normal(0, 0.5, [dim, 1]).astype(np.float32))
    factor = tf.placeholder_with_default(tf.constant(1.0), [], name="factor_d_w_fake")
    fake = tf.tanh(tf.matmul(x16, tf.cast(g_w, tf.float16)))
    real_logit = tf.matmul(x16, tf.cast(d_w, tf.float16))
    fake_logit = tf.matmul(fake, poisoned_gradient(tf.cast(d_w, tf.float16), factor))
    d_loss = tf.reduce_mean(tf.square(real_logit)) + tf.reduce_mean(tf.square(fake_logit + 1.0))
    g_loss = tf.reduce_mean(tf.square(fake_logit - 1.0))
    losses = {"d": tf.cast(d_loss, tf.float32), "g": tf.cast(g_loss, tf.float32)}
    feed = {x: rng.normal(0, 1, [batch, dim]).astype(np.float32)}
    return Model(x, tf.constant(1.0), {}, {"d/w": factor}, losses,
                 {"d": [d_w], "g": [g_w]}, feed)


def build_step(model, backend, build_args=None, **kwargs):
    """The builder's step over both groups (a fixed scale of 1024), with
    ``kwargs`` for the builder and ``build_args`` for ``build``."""
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1024.0), backend=backend,
                                        **kwargs)
    for group in sorted(model.losses):
        scaler.add(model.losses[group], tf.train.GradientDescentOptimizer(0.01),
                   var_list=model.var_lists[group], name=group)
    return scaler.build(global_step=tf.train.get_or_create_global_step(),
                        **(build_args or {}))


Fault = collections.namedtuple("Fault", ["kind", "groups", "variables"])

#: The fault kinds, and the feed value each uses.
NAN_LOSS, INF_GRADIENT, HUGE_GRADIENT, OUTSIDE = "nan_loss", "inf_gradient", "huge_gradient", \
    "outside"
#: 1e30 is finite in float32 and far beyond float16: the gradient's cast to
#: float16 overflows, giving inf (INF/NaN mode) or +-65504 (saturation).
HUGE = 1e30


def schedule(count, seed):
    """``count`` faults drawn from every kind: one or two variables of one
    group, or one variable in each group, for the gradient faults."""
    rng = np.random.RandomState(seed)
    faults = []
    for index in range(count):
        kind = (NAN_LOSS, INF_GRADIENT, HUGE_GRADIENT, OUTSIDE)[index % 4]
        if kind == NAN_LOSS:
            faults.append(Fault(kind, (GROUPS[rng.randint(2)],), ()))
            continue
        if kind == OUTSIDE:
            faults.append(Fault(kind, (), ()))
            continue
        shape = rng.randint(3)
        if shape == 2:  # one variable in each group
            variables = tuple("%s/%s" % (g, "wb"[rng.randint(2)]) for g in GROUPS)
        else:
            group = GROUPS[rng.randint(2)]
            variables = ("%s/w" % group, "%s/b" % group)[:shape + 1] if rng.randint(2) \
                else ("%s/b" % group,)
        faults.append(Fault(kind, tuple(sorted(set(v.split("/")[0] for v in variables))),
                            variables))
    return faults


def fault_feed(model, fault):
    feed = dict(model.feed)
    if fault.kind == NAN_LOSS:
        feed[model.loss_poison[fault.groups[0]]] = np.nan
    elif fault.kind == OUTSIDE:
        feed[model.outside] = 1e5
    else:
        value = np.inf if fault.kind == INF_GRADIENT else HUGE
        for name in fault.variables:
            feed[model.grad_factor[name]] = value
    return feed


def expected(fault, model, saturation):
    """(reason, groups, variables) the record must show for ``fault``."""
    if fault.kind == NAN_LOSS:
        group = fault.groups[0]
        # Saturation flushes the NaN gradients to 0: no variable is named.
        names = () if saturation else tuple(v.op.name for v in model.var_lists[group])
        return "loss_not_finite", fault.groups, names
    if fault.kind == OUTSIDE:
        # Only the register sees it; clipped away, it harms nothing checked.
        return ("register_outside_gradients" if saturation else "applied"), (), ()
    # In the record's order: groups in add() order, then each var_list's.
    order = [v.op.name for group in GROUPS for v in model.var_lists[group]]
    return "gradients_overflowed", fault.groups, tuple(
        name for name in order if name in fault.variables)
