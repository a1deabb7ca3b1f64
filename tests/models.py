"""Tiny TF1 models shared by the tests."""

import collections

import numpy as np
import tensorflow.compat.v1 as tf

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
