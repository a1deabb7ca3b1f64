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


# -- an engine that reduces nothing, under a launcher ---------------------------

@pytest.mark.parametrize("edit", [
    None,
    lambda flags, grads: (collections.OrderedDict(
        (name, flag + tf.placeholder_with_default(0.0, [])) for name, flag in flags.items()),
        grads)],
    ids=["as_given", "local_arithmetic"])
def test_a_workers_engine_that_reduces_no_flag_is_refused_under_a_launcher(
        graph, monkeypatch, edit):
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    with pytest.raises(ValueError, match=r"distributed=_Engine: this process is one of 2 "
                                         r"workers \(HOROVOD_SIZE\).*returned flag 'shared' with "
                                         r"no collective op between.*distributed=False"):
        _build(_Engine(edit))


def test_a_workers_engine_that_averages_no_gradient_is_refused_under_a_launcher(
        graph, monkeypatch):
    monkeypatch.setenv("RANK_SIZE", "2")
    engine = _Engine(lambda flags, grads: _reducing(flags, grads, reduce_grads=False))
    with pytest.raises(ValueError, match=r"2 workers \(RANK_SIZE/CM_WORKER_SIZE\).*returned "
                                         r"group 'net''s gradient of 'w' with no collective"):
        _build(engine)
    with tf.Graph().as_default():
        # Told that the optimizers average the gradients, it only sums the flags.
        _build(engine, allreduce_gradients=False)


def test_a_workers_engine_with_collectives_is_built_under_a_launcher(graph, monkeypatch):
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    train, _, _ = _build(_Engine(_reducing))
    assert train.update_op is not None


def test_a_workers_engine_that_reduces_nothing_runs_on_one_worker(graph):
    """Without a launcher (one process: a test's simulated peer) nothing is
    asked of the engine: the step applies this worker's gradient."""
    train, x, w = _build(_Engine())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, {x: [0.25, 0.5]})
        assert sess.run(w).tolist() == [0.75, 1.5]


# -- what reduce returns ----------------------------------------------------------

def _float16_pairs(flags, grads):
    return flags, collections.OrderedDict(
        (name, [(tf.cast(grad, tf.float16), var) for grad, var in pairs])
        for name, pairs in grads.items())


@pytest.mark.parametrize("edit,error,pattern", [
    (lambda flags, grads: None, TypeError,
     r"_Engine.reduce returned None; return \(flags, grads\): an ordered dict with the "
     r"flags' names \['shared'\] and one with the groups' names \['net'\]"),
    (lambda flags, grads: (flags,), TypeError, r"_Engine.reduce returned \(Ordered"),
    (lambda flags, grads: (grads, flags), TypeError, r"return \(flags, grads\)"),
    (lambda flags, grads: ({}, grads), TypeError, r"return \(flags, grads\)"),
    (lambda flags, grads: (collections.OrderedDict(
        (name, tf.cast(flag, tf.float16)) for name, flag in flags.items()), grads),
     TypeError, r"_Engine.reduce returned <tf.Tensor .*float16.*> for flag 'shared'; return a "
                r"float32 scalar tensor"),
    (lambda flags, grads: (collections.OrderedDict(
        (name, tf.stack([flag, flag])) for name, flag in flags.items()), grads),
     TypeError, r"for flag 'shared'; return a float32 scalar tensor"),
    (lambda flags, grads: (flags, collections.OrderedDict(
        (name, pairs[0]) for name, pairs in grads.items())), TypeError,
     r"group 'net': _Engine.reduce returned \(<tf.Tensor.*not a list of \(gradient, "
     r"variable\) pairs.*Return the reduced pairs, e\.g\. \[\(hvd.allreduce\(g\), v\)"),
    (lambda flags, grads: (flags, collections.OrderedDict(
        (name, []) for name in grads)), ValueError,
     r"group 'net': _Engine.reduce returned pairs for \[\], given \['w'\]"),
    (_float16_pairs, TypeError,
     r"group 'net': _Engine.reduce returned a float16 gradient for w, a float32 variable\. "
     r"Cast it back"),
    (lambda flags, grads: (flags, collections.OrderedDict(
        (name, [(tf.reshape(grad, [2, 1]), var) for grad, var in pairs])
        for name, pairs in grads.items())), ValueError,
     r"_Engine.reduce returned a gradient of shape \(2, 1\) for w, of shape \(2,\)")],
    ids=["none", "one_dict", "swapped", "flag_missing", "float16_flag", "vector_flag",
         "not_pairs", "variable_left_out", "float16_gradient", "shape"])
def test_what_reduce_returns_is_checked_where_the_step_takes_it(graph, edit, error, pattern):
    """Each was a raw KeyError, TypeError, IndexError or TF shape error; the
    float16 gradient of a float32 variable killed the process (SIGABRT) at
    the first run."""
    with pytest.raises(error, match=pattern):
        _build(_Engine(edit))


def _interacting(engine, interaction):
    """One group over ``fed_linear_model`` with ``engine``, built with one of
    the step's other capabilities: accumulation, towers, per-group ops or a
    clip."""
    gs, x, w, loss = fed_linear_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), distributed=engine)
    losses = [loss, 2.0 * loss] if interaction == "towers" else loss
    scaler.add(losses, tf.train.GradientDescentOptimizer(1.0), var_list=[w], name="net",
               clip_norm=1.0 if interaction == "clip_norm" else None)
    v = tf.Variable([3.0], name="v")
    scaler.add(tf.reduce_sum(v * x[:1]), tf.train.GradientDescentOptimizer(1.0), var_list=[v],
               name="other")
    return scaler.build(global_step=gs,
                        accumulation_steps=2 if interaction == "accumulation" else 1,
                        per_group_ops=interaction == "per_group_ops")


INTERACTIONS = ["accumulation", "towers", "per_group_ops", "clip_norm"]


@pytest.mark.parametrize("interaction", INTERACTIONS)
def test_a_reduce_misuse_is_refused_with_each_capability(graph, interaction):
    """A float16 gradient for a float32 variable from reduce, with
    accumulation (reduced once per window, by update_op), towers (the
    engine the towers wrap), per-group ops (reduce once per step op) and a
    clip (applied after the reduction)."""
    with pytest.raises(TypeError, match=r"group 'net': _Engine\.reduce returned a float16 "
                                        r"gradient for w, a float32 variable"):
        _interacting(_Engine(_float16_pairs), interaction)


@pytest.mark.parametrize("interaction", INTERACTIONS)
def test_an_engine_that_reduces_nothing_is_refused_with_each_capability(
        graph, monkeypatch, interaction):
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    with pytest.raises(ValueError, match=r"distributed=_Engine: this process is one of 2 "
                                         r"workers \(HOROVOD_SIZE\).*no collective op"):
        _interacting(_Engine(), interaction)


@pytest.mark.parametrize("interaction", INTERACTIONS)
def test_an_engine_with_collectives_is_built_with_each_capability(
        graph, monkeypatch, interaction):
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    train = _interacting(_Engine(_reducing), interaction)
    assert train.update_op is not None


# -- what replica_losses returns ----------------------------------------------------

class _Replicas(seams.ReductionEngine):
    """One worker whose ``replica_losses`` is ``self.losses(group)``."""

    def __init__(self, losses):
        self.losses = losses

    def replica_losses(self, group):
        return self.losses(group)


def test_a_non_scalar_replica_loss_is_refused_before_any_op(graph):
    """``tf.stack([loss, loss])`` trained on twice the gradient."""
    engine = _Replicas(lambda group: (tf.stack([group.loss, group.loss]),))
    gs, x, w, loss = fed_linear_model()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), distributed=engine)
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w], name="net")
    with pytest.raises(ValueError, match=r"_Replicas.replica_losses\(group 'net'\) returned "
                                         r"<tf.Tensor 'stack.*shape=\(2,\).*not a scalar: its "
                                         r"gradient would be its sum's"):
        scaler.build(global_step=gs)


@pytest.mark.parametrize("losses", [
    lambda group: group.loss, lambda group: [], lambda group: ["loss"],
    lambda group: (tf.constant(1),)], ids=["bare_tensor", "empty", "string", "int"])
def test_a_replica_losses_of_the_wrong_type_is_refused(graph, losses):
    with pytest.raises(TypeError, match=r"_Replicas.replica_losses\(group 'net'\) returned "
                                        r".*; return a non-empty tuple of float scalar loss "
                                        r"tensors"):
        _build(_Replicas(losses))


def test_a_replica_losses_of_two_scalars_averages_them(graph):
    """The control: two scalar replicas of the loss are each differentiated,
    and their default combination (the first) is applied."""
    engine = _Replicas(lambda group: (group.loss, 2.0 * group.loss))
    train, x, w = _build(engine)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, {x: [0.25, 0.5]})
        assert sess.run(w).tolist() == [0.75, 1.5]


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
