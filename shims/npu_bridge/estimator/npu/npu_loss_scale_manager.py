"""Shim of ``npu_bridge.estimator.npu.npu_loss_scale_manager``.

The real classes subclass ``tf.contrib.mixed_precision``'s
FixedLossScaleManager / ExponentialUpdateLossScaleManager (both derive from
the abstract ``LossScaleManager``).  ``tf.contrib`` does not exist in TF 2.x,
so these shims subclass ``object`` and re-implement the same protocol:

* ``get_loss_scale()``: Fixed -> a float32 scalar constant tensor;
  Exponential -> the float32 scalar non-trainable ``tf.Variable`` itself
  (the real contrib class returns the variable object, not a read tensor;
  use ``tf.convert_to_tensor`` if a Tensor is needed).
* ``update_loss_scale(finite_grads)`` -> an Operation (graph mode).
* State of the exponential manager: non-trainable global variables named
  ``loss_scale`` (float32), ``good_steps`` (int32), ``bad_steps`` (int32),
  created with ``tf.compat.v1.Variable`` like the real ``variable_scope.variable``.

Update rule of ExponentialUpdateLossScaleManager (Huawei's override):
  finite:     if good_steps + 1 >= incr_every_n_steps:
                  loss_scale *= incr_ratio if loss_scale < 3.4e38 / incr_ratio
                  good_steps = bad_steps = 0
              else: good_steps += 1            (bad_steps kept)
  not finite: if bad_steps + 1 >= decr_every_n_nan_or_inf:
                  loss_scale = max(1, loss_scale * decr_ratio)
                  good_steps = bad_steps = 0
              else: bad_steps += 1; good_steps = 0
"""
from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf
from tensorflow.python.framework import ops as _ops

_MAX_SCALE = 3.4e+38


class FixedLossScaleManager(object):
    """Loss scale manager with a fixed loss scale (shim; base class is
    ``object`` instead of tf.contrib's LossScaleManager)."""

    def __init__(self, loss_scale, enable_overflow_check=True):
        if loss_scale < 1:
            raise ValueError("loss scale must be at least 1.")
        self._loss_scale = _ops.convert_to_tensor(loss_scale, dtype=tf.float32, name="loss_scale")
        self._enable_overflow_check = enable_overflow_check

    def get_loss_scale(self):
        return self._loss_scale

    def update_loss_scale(self, finite_grads):
        del finite_grads
        return tf.no_op()

    def get_enable_overflow_check(self):
        return self._enable_overflow_check


class ExponentialUpdateLossScaleManager(object):
    """Loss scale manager with exponential update (shim; base class is
    ``object`` instead of tf.contrib's LossScaleManager)."""

    def __init__(self,
                 init_loss_scale,
                 incr_every_n_steps,
                 decr_every_n_nan_or_inf=2,
                 incr_ratio=2,
                 decr_ratio=0.8):
        self._incr_every_n_steps = incr_every_n_steps
        self._decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
        self._incr_ratio = incr_ratio
        self._decr_ratio = decr_ratio
        self._loss_scale = tf.Variable(
            name="loss_scale",
            initial_value=_ops.convert_to_tensor(init_loss_scale, tf.float32),
            dtype=tf.float32,
            trainable=False)
        self._num_good_steps = tf.Variable(
            name="good_steps", initial_value=0, dtype=tf.int32, trainable=False)
        self._num_bad_steps = tf.Variable(
            name="bad_steps", initial_value=0, dtype=tf.int32, trainable=False)

    def get_loss_scale(self):
        return self._loss_scale

    def update_loss_scale(self, finite_grads):
        """Op updating loss scale and step counters from ``finite_grads``
        (bool scalar).  All three variables are read first, then written."""
        with tf.name_scope("update_loss_scale"):
            finite = _ops.convert_to_tensor(finite_grads, dtype=tf.bool)
            scale = tf.convert_to_tensor(self._loss_scale)
            good = tf.convert_to_tensor(self._num_good_steps)
            bad = tf.convert_to_tensor(self._num_bad_steps)
            zero = tf.zeros_like(good)

            incr = tf.logical_and(finite, good + 1 >= self._incr_every_n_steps)
            decr = tf.logical_and(tf.logical_not(finite),
                                  bad + 1 >= self._decr_every_n_nan_or_inf)
            grown = tf.where(scale < _MAX_SCALE / self._incr_ratio,
                             scale * self._incr_ratio, scale)
            shrunk = tf.maximum(tf.constant(1.0, tf.float32), scale * self._decr_ratio)
            new_scale = tf.where(incr, grown, tf.where(decr, shrunk, scale))
            new_good = tf.where(finite, tf.where(incr, zero, good + 1), zero)
            new_bad = tf.where(finite, tf.where(incr, zero, bad),
                               tf.where(decr, zero, bad + 1))
            with tf.control_dependencies([new_scale, new_good, new_bad]):
                return tf.group(
                    tf.assign(self._loss_scale, new_scale),
                    tf.assign(self._num_good_steps, new_good),
                    tf.assign(self._num_bad_steps, new_bad),
                    name="update")
