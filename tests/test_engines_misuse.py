"""Reduction engines misused the way users misuse them (issue 44): each gets
a clear error at build time, and a correct engine is still built.

What an engine's hooks return is checked where the step takes it
(``core/hooks.py``: ``replica_losses`` and ``reduce``), its ``mode`` when
the builder is given it, and, when the environment names several workers,
that its ``reduce`` puts a collective between what it is given and what it
returns (``distributed.check_reduced``). A builder never changes an engine
it is given (``allreduce_float16``). docs/errors.md lists what each gets.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import distributed


# -- a shared engine ---------------------------------------------------------------

class _RecordingHccl(object):
    """npu_bridge's ``hccl_ops``, recording the dtype of each allreduce (the
    identity: one rank's sum)."""

    def __init__(self):
        self.dtypes = []

    def allreduce(self, tensor, reduction):
        assert reduction == "sum"
        self.dtypes.append(tensor.dtype.base_dtype.name)
        return tf.identity(tensor)


def _float16_step(engine, allreduce_float16):
    w = tf.Variable(np.array([1.0, 2.0], np.float16), name="w16")
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), distributed=engine,
                                        allreduce_float16=allreduce_float16)
    scaler.add(tf.reduce_sum(w * tf.constant([3.0, 4.0], tf.float16)),
               tf.train.GradientDescentOptimizer(0.5), var_list=[w])
    return scaler.build()


def test_allreduce_float16_leaves_a_shared_engine_as_it_was(graph):
    """A second builder given the same engine reduced in float16 too."""
    hccl = _RecordingHccl()
    engine = distributed.HcclEngine(hccl, 1)
    _float16_step(engine, True)
    assert not engine.float16
    del hccl.dtypes[:]
    _float16_step(engine, False)
    # The flags' sum, then the float16 gradient widened to float32.
    assert hccl.dtypes == ["float32", "float32"]
