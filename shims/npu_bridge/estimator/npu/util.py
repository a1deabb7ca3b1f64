"""Shim of ``npu_bridge.estimator.npu.util``: the rank count, the argument
checks and the loop variables of ``iterations_per_loop``.

Mirrors tf_adapter/python/npu_bridge/estimator/npu/util.py (hicann/tensorflow):

* ``get_ranksize()``, which NPUDistributedOptimizer,
  npu_distributed_optimizer_wrapper, npu_allreduce, the broadcast hooks and
  NPUBasics use to count the ranks;
* ``check_positive_integer`` / ``check_nonnegative_integer`` /
  ``check_not_none``, with the real messages;
* ``create_or_get_var(name)``: the int64 resource variable
  ``npu_runconfig/<name>`` (zeros, not trainable, in the collection
  ``npu_runconfig_<name>`` and LOCAL_VARIABLES, colocated with the global
  step when there is one);
* ``set_iteration_per_loop(sess, train_op, iterations_per_loop=1)`` and
  ``IterationPerLoop``: load ``iterations_per_loop - 1`` into
  ``npu_runconfig/iterations_per_loop`` (and 0, 0, 1 into ``loop_cond``,
  ``zero``, ``one``) and return ``tf.group(train_op, name="IterationOp")``;
  ``train_op`` itself when the count is 1. On the device the graph engine
  then loops the subgraph of ``IterationOp``; the shim attaches its CPU
  emulation of that loop to ``sess`` here (``npu_bridge._device_loop``).

The rest of the real module (weight-update sharding bookkeeping, graph
execution options, profiling and path checks) is not emulated.
"""
from __future__ import absolute_import, division, print_function

import os

import tensorflow.compat.v1 as tf

from npu_bridge import _device_loop

_NPU_RUNCONFIG = "npu_runconfig"
_ITERATIONS_PER_LOOP_VAR = "iterations_per_loop"
_LOOP_COND_VAR = "loop_cond"
_CONST_ZERO = "zero"
_CONST_ONE = "one"


def check_not_none(value, name):
    """Raises ValueError when ``value`` is None (the real message)."""
    if value is None:
        raise ValueError("{} must not be None".format(name))


def check_positive_integer(value, name):
    """Raises TypeError for a non-int, ValueError for an int <= 0."""
    if not isinstance(value, int):
        raise TypeError("{} must be int, got {}".format(name, type(value)))
    if value <= 0:
        raise ValueError("{} must be positive, got {}".format(name, value))


def check_nonnegative_integer(value, name):
    """Raises TypeError for a non-int, ValueError for an int < 0."""
    if not isinstance(value, int):
        raise TypeError("{} must be int, got {}".format(name, type(value)))
    if value < 0:
        raise ValueError("{} must be nonnegative, got {}".format(name, value))


def get_ranksize():
    """The rank count as tf_adapter reads it: ``RANK_SIZE`` if set, else
    ``CM_WORKER_SIZE``, else ``'1'``.  Setting both is an error.

    Returns the value as the *string* it was set to (like the real function;
    callers do ``int(...)``).  Raises ValueError when both variables are set
    (the real message names "CM_WORK_SIZE"; so does this one).
    """
    if os.getenv("CM_WORKER_SIZE") is not None and os.getenv("RANK_SIZE") is not None:
        raise ValueError("RANK_SIZE and CM_WORK_SIZE cannot be configured at the same time")
    if os.getenv("RANK_SIZE") is not None:
        return os.getenv("RANK_SIZE")
    return os.getenv("CM_WORKER_SIZE", "1")


def create_or_get_var(var_name):
    """The loop variable ``npu_runconfig/<var_name>`` of the default graph,
    made on first use (see the module docstring)."""
    graph = tf.get_default_graph()
    collection_name = "{}_{}".format(_NPU_RUNCONFIG, var_name)
    existing = graph.get_collection(collection_name)
    if len(existing) == 1:
        return existing[0]
    if len(existing) > 1:
        raise RuntimeError("Multiple var in collection.")
    global_step = tf.train.get_global_step()
    with tf.colocate_with(global_step, ignore_existing=global_step is None):
        with tf.variable_scope(_NPU_RUNCONFIG, reuse=tf.AUTO_REUSE):
            return tf.get_variable(
                var_name, initializer=tf.zeros_initializer(), shape=[], dtype=tf.int64,
                trainable=False, collections=[collection_name, tf.GraphKeys.LOCAL_VARIABLES],
                use_resource=True)


def _loop_vars():
    return [create_or_get_var(name) for name in
            (_ITERATIONS_PER_LOOP_VAR, _LOOP_COND_VAR, _CONST_ZERO, _CONST_ONE)]


def _load(variables, sess, iterations_per_loop):
    for variable, value in zip(variables, (iterations_per_loop - 1, 0, 0, 1)):
        variable.load(value, session=sess)
    _device_loop.attach(sess, iterations_per_loop)


def _check_train_op(train_op):
    if not isinstance(train_op, tf.Operation):
        raise ValueError("The incoming 'train_op' type is '%s', and the need type is "
                         "'Operation'" % (train_op.dtype.name,))


def set_iteration_per_loop(sess, train_op, iterations_per_loop=1):
    """``tf.group(train_op, name="IterationOp")``, looped ``iterations_per_loop``
    times per ``sess.run`` (``train_op`` itself for 1).

    Args:
      sess: the session, already made.
      train_op: the step, a ``tf.Operation``.
      iterations_per_loop: the steps run on the device per ``sess.run``.

    Returns:
      The ``IterationOp``, or ``train_op`` when ``iterations_per_loop`` is 1.

    Raises:
      ValueError: for a ``train_op`` that is not an Operation (the real
        message), or an ``iterations_per_loop`` <= 0.
      TypeError: for a non-int ``iterations_per_loop``.
    """
    _check_train_op(train_op)
    check_positive_integer(iterations_per_loop, "iterations_per_loop")
    if iterations_per_loop == 1:
        return train_op
    _load(_loop_vars(), sess, iterations_per_loop)
    return tf.group(train_op, name=_device_loop.ITERATION_OP_NAME)


class IterationPerLoop(object):
    """The two-call form of ``set_iteration_per_loop``: make the
    ``IterationOp`` before the session, load the count after."""

    def __init__(self):
        self._variables = None

    def create_iteration_per_loop_var(self, train_op):
        """Makes the loop variables; returns ``tf.group(train_op, name="IterationOp")``."""
        _check_train_op(train_op)
        self._variables = _loop_vars()
        return tf.group(train_op, name=_device_loop.ITERATION_OP_NAME)

    def load_iteration_per_loop_var(self, sess, iterations_per_loop=1):
        """Loads ``iterations_per_loop`` into the variables for ``sess``."""
        check_positive_integer(iterations_per_loop, "iterations_per_loop")
        _load(self._variables, sess, iterations_per_loop)
