"""Shim of ``npu_bridge.estimator.npu.npu_hook`` (variable broadcast only).

Mirrors ``broadcast_global_variables`` and ``NPUBroadcastGlobalVariablesHook``
of tf_adapter/python/npu_bridge/estimator/npu/npu_hook.py (hicann/tensorflow):

* ``broadcast_global_variables(root_rank)``: despite its name, for every
  *trainable* variable ``hccl_ops.broadcast([var], root_rank)`` and
  ``assign(var, outputs[0])``; returns ``group`` of the broadcast ops and
  the assigns.
* ``NPUBroadcastGlobalVariablesHook(root_rank=None, index=None)``: reads the
  rank count once (``util.get_ranksize()``, 1 if not a number); with more
  than one rank it builds the broadcast in ``begin()`` and runs it in
  ``after_create_session``; with one rank it does nothing.

* ``SetIterationsVarHook(iterations_per_loop)``: makes the loop variables
  in ``begin()`` (``util.create_or_get_var``) and loads
  ``iterations_per_loop - 1``, 0, 0, 1 into them in
  ``after_create_session``; there the shim also attaches its emulation of the
  device loop to the session (``npu_bridge._device_loop``).
* ``NPUCheckpointSaverHook``: ``tf.train.CheckpointSaverHook`` that logs the
  global step after each run, as the real one does.

The other hooks of the real module (outfeed, output tensors, profiling...)
need the device and are not emulated.
"""
from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf
from tensorflow.python.training import session_run_hook

from npu_bridge.estimator.npu import util as util_lib
from npu_bridge.hccl import hccl_ops


def broadcast_global_variables(root_rank):
    """Broadcast every trainable variable from ``root_rank``; an op."""
    ops = []
    for var in tf.trainable_variables():
        outputs = hccl_ops.broadcast(tensor=[var], root_rank=root_rank)
        if outputs is not None:
            ops.append(outputs[0].op)
            ops.append(tf.assign(var, outputs[0]))
    return tf.group(ops)


class NPUBroadcastGlobalVariablesHook(session_run_hook.SessionRunHook):
    """Broadcasts the initial variables from root_rank when the session is
    created (only with more than one rank)."""

    def __init__(self, root_rank=None, index=None):
        self._root_rank = root_rank
        self._index = index
        self._bcast_op = None
        rank_size = util_lib.get_ranksize()
        self._rank_size = int(rank_size) if rank_size.isdigit() else 1

    def begin(self):
        stale = not self._bcast_op or self._bcast_op.graph != tf.get_default_graph()
        if stale and self._rank_size > 1:
            self._bcast_op = broadcast_global_variables(self._root_rank)

    def after_create_session(self, session, coord):
        if self._rank_size > 1:
            tf.logging.info("NPUBroadcastGlobalVariablesHook run...")
            session.run(self._bcast_op)


class SetIterationsVarHook(session_run_hook.SessionRunHook):
    """Loads ``iterations_per_loop`` into the loop variables when the session
    is made (NPUEstimator adds it when ``iterations_per_loop`` > 1)."""

    def __init__(self, iterations_per_loop=None):
        self._iterations_per_loop = iterations_per_loop
        self._variables = None

    def begin(self):
        self._variables = util_lib._loop_vars()  # pylint: disable=protected-access

    def after_create_session(self, session, coord):
        util_lib._load(self._variables, session,  # pylint: disable=protected-access
                       self._iterations_per_loop)
        tf.logging.info("load iterations_per_loop value -----------")


class NPUCheckpointSaverHook(tf.train.CheckpointSaverHook):
    """``tf.train.CheckpointSaverHook`` that logs the global step after each run."""

    def after_run(self, run_context, run_values):
        global_step = run_context.session.run(self._global_step_tensor)
        tf.logging.info("global_step..." + str(global_step))
        super(NPUCheckpointSaverHook, self).after_run(run_context, run_values)
