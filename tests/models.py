"""Tiny TF1 models and step set-ups shared by the tests."""

import collections

import numpy as np
import tensorflow.compat.v1 as tf

import npu_lossscale as nl

TwoGroup = collections.namedtuple(
    "TwoGroup", ["x", "poison_g", "g_loss", "d_loss", "g_vars", "d_vars", "feed"])


def two_group_gan(compute_dtype=tf.float32, batch=8, dim=4, seed=1):
    """A GAN-shaped model: each loss reads both networks' weights.

    ``poison_g`` multiplies only the generator's loss, so a test can make one
    group's gradients non-finite while the other's stay finite.
    """
    rng = np.random.RandomState(seed)
    x = tf.placeholder(tf.float32, [batch, dim], name="x")
    poison_g = tf.placeholder_with_default(tf.constant(1.0), [], name="poison_g")
    init = lambda shape: tf.constant_initializer(rng.normal(0, 0.5, shape).astype(np.float32))
    with tf.variable_scope("generator"):
        g_w = tf.get_variable("w", [dim, dim], initializer=init([dim, dim]))
        g_b = tf.get_variable("b", [dim], initializer=init([dim]))
    with tf.variable_scope("discriminator"):
        d_w = tf.get_variable("w", [dim, 1], initializer=init([dim, 1]))
        d_b = tf.get_variable("b", [1], initializer=init([1]))

    def cast(t):
        return tf.cast(t, compute_dtype)

    xc = cast(x)
    fake = tf.tanh(tf.matmul(xc, cast(g_w)) + cast(g_b))
    d_real = tf.matmul(xc, cast(d_w)) + cast(d_b)
    d_fake = tf.matmul(fake, cast(d_w)) + cast(d_b)
    d_loss = tf.reduce_mean(tf.nn.softplus(-d_real)) + tf.reduce_mean(tf.nn.softplus(d_fake))
    g_loss = tf.reduce_mean(tf.nn.softplus(-d_fake)) * cast(poison_g)
    feed_value = rng.normal(0, 1, [batch, dim]).astype(np.float32)
    return TwoGroup(x, poison_g, g_loss, d_loss, [g_w, g_b], [d_w, d_b], {x: feed_value})


def add_gan_groups(scaler, model, learning_rate=0.01, g_manager=None):
    """Registers the two groups of ``two_group_gan`` with a builder, as the
    tests usually do: group "d" (discriminator) then group "g" (generator),
    each with its own Adam, "g" with its own manager if given.

    Returns:
      The builder.
    """
    scaler.add(model.d_loss, tf.train.AdamOptimizer(learning_rate), var_list=model.d_vars,
               name="d")
    if g_manager is None:
        scaler.add(model.g_loss, tf.train.AdamOptimizer(learning_rate),
                   var_list=model.g_vars, name="g")
    else:
        scaler.add(model.g_loss, tf.train.AdamOptimizer(learning_rate),
                   var_list=model.g_vars, name="g", loss_scale_manager=g_manager)
    return scaler


def _printed(value):
    """A ``tf.print`` that follows ``value`` (a control dependency)."""
    with tf.control_dependencies([value]):
        return tf.print("updated")


def _constant_after(value):
    """A constant that carries ``value`` as a control input."""
    with tf.control_dependencies([value]):
        return tf.constant(1.0)


#: What scripts wrap a variable update in before handing it to a gate
#: (issue #24): each maps the update (what ``tf.assign_add`` returns: a ref
#: tensor under v1, a variable-like under resource variables) to the op or
#: tensor passed. ``tf.tuple`` of a ref tensor is a RefIdentity under v1.
UPDATE_WRAPPERS = {
    "tuple": lambda update: tf.tuple([update])[0],
    "check_numerics": lambda update: tf.debugging.check_numerics(update, "update"),
    "stop_gradient": tf.stop_gradient,
    "print": _printed,
    "constant": _constant_after,
    "print_of_checked_tuple": lambda update: _printed(
        tf.debugging.check_numerics(tf.tuple([update])[0], "update")),
    "group_of_stopped_identity": lambda update: tf.group(
        tf.identity(tf.stop_gradient(update))),
    "tuple_of_printed_constant": lambda update: tf.tuple(
        [_constant_after(_printed(update))])[0],
}


def build_gan_step(model, manager, backend="is_finite", g_opt=None, d_opt=None):
    """The builder's joint step over ``two_group_gan``'s groups
    "discriminator" (Adam 0.01) and "generator" (Adam 0.02), with a global
    step.

    Returns:
      (the ``TrainOps``, the global step).
    """
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(manager, backend=backend)
    scaler.add(model.d_loss, d_opt or tf.train.AdamOptimizer(0.01), var_list=model.d_vars,
               name="discriminator")
    scaler.add(model.g_loss, g_opt or tf.train.AdamOptimizer(0.02), var_list=model.g_vars,
               name="generator")
    return scaler.build(global_step=gs), gs


# -- a regression in two groups, with micro-batches (accumulation, clipping) --

DIM = 5
_RNG = np.random.RandomState(3)
BIG_X = _RNG.normal(0, 1, [64, DIM]).astype(np.float32)
BIG_Y = _RNG.normal(0, 1, [64, 1]).astype(np.float32)


def regression():
    """Two groups on one mean-squared loss: w (SGD/Adam) and b (SGD)."""
    x = tf.placeholder(tf.float32, [None, DIM])
    y = tf.placeholder(tf.float32, [None, 1])
    poison = tf.placeholder_with_default(1.0, [])
    w = tf.get_variable("w", initializer=np.linspace(-1, 1, DIM).reshape(DIM, 1).astype(np.float32))
    b = tf.get_variable("b", initializer=np.array([0.3], np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y)) * poison
    return x, y, poison, w, b, loss


def micro_feeds(x, y, n=4):
    """``BIG_X``/``BIG_Y`` cut into ``n`` micro-batch feeds."""
    size = 64 // n
    return [{x: BIG_X[i * size:(i + 1) * size], y: BIG_Y[i * size:(i + 1) * size]}
            for i in range(n)]


def accumulating(make_opt, n=4, manager=None, clip_norm=None, global_step=True):
    """The builder over ``regression``'s groups "w" (``make_opt()``) and "b"
    (SGD 0.05) with ``accumulation_steps=n``.

    Returns:
      (the ``TrainOps``, (x, y, poison, w, b), the global step or None).
    """
    x, y, poison, w, b, loss = regression()
    scaler = nl.MultiOptimizerLossScale(manager or nl.FixedLossScaleManager(2.0 ** 10),
                                        backend="is_finite")
    scaler.add(loss, make_opt(), var_list=[w], name="w", clip_norm=clip_norm)
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.05), var_list=[b], name="b")
    gs = tf.train.get_or_create_global_step() if global_step else None
    train = scaler.build(global_step=gs, accumulation_steps=n)
    return train, (x, y, poison, w, b), gs


def big_batch_reference(make_opt, clip_norm=None):
    """One unscaled step of ``regression`` on the whole batch, in its own
    graph (TF's optimizers and ``tf.clip_by_global_norm``): the weights
    [w, b] after it."""
    with tf.Graph().as_default():
        x, y, _, w, b, loss = regression()
        gw, gb = tf.gradients(loss, [w, b])
        if clip_norm is not None:
            (gw,), _ = tf.clip_by_global_norm([gw], clip_norm)
        with tf.control_dependencies([gw, gb]):
            step = tf.group(make_opt().apply_gradients([(gw, w)]),
                            tf.train.GradientDescentOptimizer(0.05).apply_gradients([(gb, b)]))
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(step, {x: BIG_X, y: BIG_Y})
            return sess.run([w, b])


# -- update_ops: a batch-norm net and a counter update --

def bn_net(resource, collection_entries):
    """A linear layer and training-mode batch norm whose moving-average
    updates go to UPDATE_OPS as tf.layers puts them: under resource
    variables ``var.assign_sub`` returns a variable-like object (its ``op``
    the AssignSubVariableOp), under ref variables a tensor. Returns the
    loss, the poison placeholder, the moving statistics and the entries."""
    x = tf.constant(np.random.RandomState(0).normal(size=[8, 3]).astype(np.float32))
    poison = tf.placeholder_with_default(tf.constant(1.0), [], name="poison")
    w = tf.get_variable("w", [3, 3], initializer=tf.constant_initializer(0.3),
                        use_resource=resource)
    h = tf.matmul(x * poison, w)
    mean, variance = tf.nn.moments(h, [0])
    moving = []
    for name, value, init in (("moving_mean", mean, tf.zeros_initializer()),
                              ("moving_variance", variance, tf.ones_initializer())):
        var = tf.get_variable(name, [3], trainable=False, initializer=init,
                              use_resource=resource)
        tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, var.assign_sub((var - value) * 0.1))
        moving.append(var)
    loss = tf.reduce_mean(tf.square(tf.nn.batch_normalization(h, mean, variance, None, None,
                                                              1e-3) - 1.0))
    entries = collection_entries(tf.get_collection(tf.GraphKeys.UPDATE_OPS))
    return loss, poison, moving, entries


def counter_model():
    """A one-variable model whose loss a fed ``poison`` can make inf, and a
    counter update (``tf.assign_add``'s result). Returns (loss, w, poison,
    counter, update)."""
    w = tf.get_variable("w", [2], initializer=tf.ones_initializer())
    poison = tf.placeholder_with_default(tf.constant(1.0), [], name="poison")
    loss = tf.reduce_sum(w * w) * poison
    counter = tf.get_variable("counter", [], initializer=tf.zeros_initializer(),
                              trainable=False)
    return loss, w, poison, counter, tf.assign_add(counter, 1.0)


def sgd_group(scaler, loss, variables, name="net"):
    """Adds the group ``name``: ``loss`` over ``variables``, SGD 0.1."""
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=variables, name=name)


class ManagerReturning(object):
    """A custom manager (the bare protocol) whose scale is ``value``, which
    a test may change before a retry; its update does nothing."""

    def __init__(self, value):
        self.value = value

    def get_loss_scale(self):
        return self.value

    def update_loss_scale(self, finite_grads):
        return tf.no_op()


def two_nets():
    """Two one-variable nets: (x, y, x's loss, y's loss)."""
    x = tf.get_variable("x", [2], initializer=tf.ones_initializer())
    y = tf.get_variable("y", [2], initializer=tf.ones_initializer())
    return x, y, tf.reduce_sum(x * x), tf.reduce_sum(y * y)


def batch_norm(x, name, momentum=0.9):
    """Training-mode batch norm as tf.layers makes it: normalise with the
    batch's moments, and put the moving averages' updates in UPDATE_OPS."""
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
                moving, (moving - value) * (1.0 - momentum)).op)
        return tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-3)


def fed_linear_model():
    """The global step, a fed [2] input ``x``, a weight ``w`` = [1, 2] and the
    loss sum(w * x): the smallest model a cluster or SyncReplicas set-up
    needs. Returns ``(global_step, x, w, loss)``."""
    gs = tf.train.get_or_create_global_step()
    x = tf.placeholder(tf.float32, [2], name="x")
    w = tf.Variable([1.0, 2.0], name="w")
    return gs, x, w, tf.reduce_sum(w * x)
