"""The benchmark's model family: a float16 MLP GAN with float32 master weights.

A model is set by four numbers (``ModelSpec``):

* ``width``: every hidden layer is ``width`` units, and so are the noise and
  the "image" (so the generator maps R^width -> R^width);
* ``layers``: dense layers in total, split between the generator
  (``layers // 2``) and the discriminator (the rest, the last one mapping
  to one logit). Each dense layer owns two variables (kernel and bias), so the
  model has ``2 * layers`` trainable tensors;
* ``groups``: how many optimizers share the variables. 1 = one Adam over every
  variable minimising ``d_loss + g_loss``; an even count k = the generator's
  variables cut in k/2 contiguous chunks (one Adam each, on ``g_loss``) and the
  discriminator's likewise (on ``d_loss``). k = 2 is the classic GAN step;
* ``batch``.

The variables are float32 (master weights); every layer casts its kernel and
bias to float16 and computes in float16, so the losses and the backprop are
float16 and each variable's gradient is a float32 ``Cast`` of a float16
gradient, the usual mixed-precision graph. Hidden units are ``tanh``, which
keeps activations bounded at any depth (no float16 overflow in the forward
pass, so every benchmarked step is a finite, applied step). The inputs (noise
and a fixed "real" batch) live in non-trainable variables: no feeds.
"""

from __future__ import absolute_import, division, print_function

import collections
import math

import tensorflow.compat.v1 as tf

ModelSpec = collections.namedtuple("ModelSpec", ["width", "layers", "groups", "batch"])

Group = collections.namedtuple("Group", ["name", "loss", "var_list"])

GanModel = collections.namedtuple(
    "GanModel", ["spec", "g_vars", "d_vars", "g_loss", "d_loss", "groups"])

#: Named sizes, all with 2 groups and batch 64: three widths at 8 dense layers
#: (16 tensors), and "deep", the medium width at 16 dense layers (32 tensors,
#: 0.99M parameters), the 16-layer float16 model of issue 25's overhead target.
SIZES = collections.OrderedDict([
    ("small", ModelSpec(width=64, layers=8, groups=2, batch=64)),
    ("medium", ModelSpec(width=256, layers=8, groups=2, batch=64)),
    ("large", ModelSpec(width=768, layers=8, groups=2, batch=64)),
    ("deep", ModelSpec(width=256, layers=16, groups=2, batch=64)),
])


def params(spec):
    """Trainable parameters of a spec (kernels + biases)."""
    return (spec.layers - 1) * (spec.width * spec.width + spec.width) + spec.width + 1


def variable_shapes(spec):
    """The shapes of the trainable variables (generator first), as ``build``
    makes them, without building anything."""
    g_layers = spec.layers // 2
    d_layers = spec.layers - g_layers
    shapes = []
    for _ in range(g_layers):
        shapes += [(spec.width, spec.width), (spec.width,)]
    for i in range(d_layers):
        out = 1 if i == d_layers - 1 else spec.width
        shapes += [(spec.width, out), (out,)]
    return shapes


def spec_for_tensors(tensors, budget=None, groups=2, batch=64):
    """A spec with ``tensors`` trainable tensors at about ``budget`` parameters.

    The width shrinks as the depth grows (width = sqrt(budget / layers),
    rounded to a multiple of 8, at least 16), so the variable-count sweep
    changes how the bytes are cut into tensors, not how many bytes there are.
    The default budget is the medium model's.
    """
    if tensors % 2 or tensors < 4:
        raise ValueError("tensors must be an even number >= 4, got %r" % (tensors,))
    if budget is None:
        budget = params(SIZES["medium"])
    layers = tensors // 2
    width = max(16, int(round(math.sqrt(float(budget) / layers) / 8.0)) * 8)
    return ModelSpec(width=width, layers=layers, groups=groups, batch=batch)


def _chunks(items, count):
    """``items`` cut in ``count`` contiguous, near-equal, non-empty chunks."""
    count = max(1, min(count, len(items)))
    size, extra = divmod(len(items), count)
    result, start = [], 0
    for i in range(count):
        stop = start + size + (1 if i < extra else 0)
        result.append(items[start:stop])
        start = stop
    return result


def build(spec, seed=0):
    """Builds the model in the default graph; returns a ``GanModel``."""
    if spec.groups != 1 and spec.groups % 2:
        raise ValueError("groups must be 1 or even, got %r" % (spec.groups,))
    width, batch = spec.width, spec.batch
    g_layers = spec.layers // 2
    d_layers = spec.layers - g_layers
    f16 = tf.float16

    def dense_vars(scope, index, fan_in, fan_out, tag):
        with tf.variable_scope("%s/l%d" % (scope, index)):
            kernel = tf.get_variable(
                "w", [fan_in, fan_out], tf.float32,
                tf.random_normal_initializer(stddev=1.0 / math.sqrt(fan_in),
                                             seed=seed * 7919 + tag))
            bias = tf.get_variable("b", [fan_out], tf.float32, tf.zeros_initializer())
        return kernel, bias

    g_params = [dense_vars("generator", i, width, width, i) for i in range(g_layers)]
    d_params = [dense_vars("discriminator", i, width, 1 if i == d_layers - 1 else width,
                           1000 + i) for i in range(d_layers)]

    with tf.variable_scope("inputs"):
        z = tf.get_variable("z", [batch, width], tf.float32,
                            tf.random_normal_initializer(seed=seed * 7919 + 5000),
                            trainable=False)
        real = tf.get_variable("real", [batch, width], tf.float32,
                               tf.random_uniform_initializer(-1.0, 1.0,
                                                             seed=seed * 7919 + 5001),
                               trainable=False)

    # One float16 copy of each weight, shared by every use (as Keras'
    # mixed_float16 policy builds it).
    g_cast = [(tf.cast(w, f16), tf.cast(b, f16)) for w, b in g_params]
    d_cast = [(tf.cast(w, f16), tf.cast(b, f16)) for w, b in d_params]

    h = tf.cast(z, f16)
    for i, (w, b) in enumerate(g_cast):
        h = tf.tanh(tf.matmul(h, w) + b)
    fake = h

    def discriminator(x):
        for i, (w, b) in enumerate(d_cast):
            x = tf.matmul(x, w) + b
            if i < len(d_cast) - 1:
                x = tf.tanh(x)
        return x

    d_real = discriminator(tf.cast(real, f16))
    d_fake = discriminator(fake)
    d_loss = tf.reduce_mean(tf.nn.softplus(-d_real)) + tf.reduce_mean(tf.nn.softplus(d_fake))
    g_loss = tf.reduce_mean(tf.nn.softplus(-d_fake))

    g_vars = [v for pair in g_params for v in pair]
    d_vars = [v for pair in d_params for v in pair]
    if spec.groups == 1:
        groups = [Group("all", d_loss + g_loss, g_vars + d_vars)]
    else:
        half = spec.groups // 2
        groups = ([Group("discriminator_%d" % i, d_loss, c)
                   for i, c in enumerate(_chunks(d_vars, half))]
                  + [Group("generator_%d" % i, g_loss, c)
                     for i, c in enumerate(_chunks(g_vars, half))])
    return GanModel(spec, g_vars, d_vars, g_loss, d_loss, groups)
