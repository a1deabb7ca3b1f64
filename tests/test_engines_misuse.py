"""Reduction engines misused the way users misuse them (issue 44): each gets
a clear error at build time, and a correct engine is still built.

What an engine's hooks return is checked where the step takes it
(``core/hooks.py``: ``replica_losses`` and ``reduce``), its ``mode`` when
the builder is given it, and, when the environment names several workers,
that its ``reduce`` puts a collective between what it is given and what it
returns (``distributed.check_reduced``). A builder never changes an engine
it is given (``allreduce_float16``). docs/errors.md lists what each gets.
"""

import collections

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import distributed, seams
from models import fed_linear_model
from test_cluster_checks import _LAUNCH_VARIABLES


@pytest.fixture(autouse=True)
def one_worker(monkeypatch):
    """Each test starts from an environment that names one worker."""
    for name in _LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _collective(tensor, key):
    """``tensor`` summed by TF's CollectiveReduce over two members: a
    collective op of the graph, built, never run."""
    return tf.raw_ops.CollectiveReduce(input=tensor, group_size=2, group_key=1,
                                       instance_key=key, merge_op="Add", final_op="Id",
                                       subdiv_offsets=[0])


class _Engine(seams.ReductionEngine):
    """A "workers" engine whose ``reduce`` is ``self.edit`` (what the given
    dicts become); the default reduces nothing."""

    mode = "workers"

    def __init__(self, edit=None):
        self.edit = edit

    def reduce(self, flags, grads, allreduce_gradients):
        if self.edit is None:
            return flags, grads
        return self.edit(flags, grads)


def _reducing(flags, grads, reduce_grads=True):
    """What a correct engine returns: each flag and gradient through a
    collective."""
    flags = collections.OrderedDict(
        (name, _collective(flag, index + 1)) for index, (name, flag) in enumerate(flags.items()))
    if reduce_grads:
        grads = collections.OrderedDict(
            (name, [(_collective(grad, 100 + index) / 2.0, var)
                    for index, (grad, var) in enumerate(pairs)])
            for name, pairs in grads.items())
    return flags, grads


def _build(engine, **kwargs):
    gs, x, w, loss = fed_linear_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), distributed=engine,
                                        **kwargs)
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w], name="net")
    return scaler.build(global_step=gs), x, w


# -- mode -------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["worker", "Workers", None])
def test_a_misspelled_mode_is_refused(graph, mode):
    engine = _Engine()
    engine.mode = mode
    with pytest.raises(ValueError, match=r"distributed=<.*_Engine.*> has mode %r, which is "
                                         r"none of \('local', 'workers', 'chief'\)\. Set the "
                                         r"engine's mode to \"workers\"" % (mode,)):
        nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), distributed=engine)


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
