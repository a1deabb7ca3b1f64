"""Shim of ``npu_bridge.estimator.npu_ops``: the device's start and stop ops
and ``dropout``.

Mirrors tf_adapter/python/npu_bridge/estimator/npu_ops.py (hicann/tensorflow):

* ``NPUInit(name=None)`` / ``initialize_system(name=None)`` and
  ``NPUShutdown(name=None)`` / ``shutdown_system(name=None)``: ops to run once
  at the start and end of a session. On CPU there is no device to open: a
  ``NoOp`` named after the real op type, tagged with it
  (``_npu_shim_op_type``).
* ``dropout(x, keep_prob, noise_shape=None, seed=None, name=None)``: the real
  argument checks (a floating ``x``; a number ``keep_prob`` in (0, 1]; a float
  1.0 returns ``x`` itself) and the real semantics (each element kept with
  probability ``keep_prob`` and scaled by ``1 / keep_prob``; ``noise_shape``
  broadcast as in ``tf.nn.dropout``). The device's ``DropOutGenMask`` /
  ``DropOutDoMask`` pair becomes ``tf.nn.dropout``, so the random draws differ
  from the device's.

The other device kernels of the real module (LARS, LSTM cells, outfeed...)
are not emulated.
"""
from __future__ import absolute_import, division, print_function

import numbers

import tensorflow.compat.v1 as tf

from npu_bridge import _emulation


def _device_op(op_type, name):
    op = tf.no_op(name=name or op_type)
    _emulation.tag_op(op, op_type)
    return op


def NPUInit(name=None):  # pylint: disable=invalid-name
    """The op that opens the NPU system (a tagged NoOp on CPU)."""
    return _device_op("NPUInit", name)


def NPUShutdown(name=None):  # pylint: disable=invalid-name
    """The op that shuts the NPU system down (a tagged NoOp on CPU)."""
    return _device_op("NPUShutdown", name)


def initialize_system(name=None):
    """``NPUInit(name)``."""
    return NPUInit(name)


def shutdown_system(name=None):
    """``NPUShutdown(name)``."""
    return NPUShutdown(name)


def dropout(x, keep_prob, noise_shape=None, seed=None, name=None):
    """Keeps each element of ``x`` with probability ``keep_prob``, scaled by
    ``1 / keep_prob`` (see the module docstring)."""
    x = tf.convert_to_tensor(x, name="x")
    if not x.dtype.is_floating:
        raise ValueError("x must be a floating point tensor."
                         " Got a %s tensor instead." % x.dtype)
    if isinstance(keep_prob, numbers.Real) and not 0 < keep_prob <= 1.0:
        raise ValueError("keep_prob must be a float value or a scalar tensor in the "
                         "range (0, 1], got %g" % keep_prob)
    if isinstance(keep_prob, float) and keep_prob == 1.0:
        return x
    with tf.name_scope(name, "dropout", [x]):
        rate = 1.0 - tf.cast(keep_prob, x.dtype)
        return tf.nn.dropout(x, rate=rate, noise_shape=noise_shape, seed=seed)
