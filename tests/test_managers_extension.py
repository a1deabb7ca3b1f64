"""A manager defined here, outside the library, plugs into every entry point.

``Halving`` is written against the protocol alone (``nl.LossScaleManager``):
it halves its scale on each overflowing step, floored at 1, never grows, and
counts the overflow streak. The library is not edited to know of it. The
numbers are worked by hand: the loss ``sum(w * x)`` has the gradient ``x``,
plain SGD with rate 0.5 moves ``w`` by ``-0.5 * x``, and an ``inf`` in ``x``
makes the step overflow (skipped: ``w`` and the global step stay).
"""

import warnings

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from readme_blocks import block

LR = 0.5
W0 = [1.0, 2.0]
FINITE = [2.0, -4.0]  # w moves to [0, 4]
OVERFLOW = [np.inf, 1.0]


class Halving(nl.LossScaleManager):
    """Halves the scale on an overflowing step (floor 1); never grows."""

    # The scale starts at `start` (checked <= 2**126) and only halves to
    # >= 1: it stays in SCALE_RANGE, so the step needs no run-time check.
    keeps_scale_in_range = True

    def __init__(self, start=8.0, floor_warning_after=2):
        if not 1.0 <= start <= 2.0 ** 126:
            raise ValueError("start must be in [1, 2**126], got %r. Pass e.g. 8." % (start,))
        self._scale = tf.Variable(float(start), trainable=False, name="halving_scale")
        self._streak = tf.Variable(0.0, trainable=False, name="halving_streak")
        # The floor warning's public properties: tensors made once, read
        # whenever fetched, and two numbers.
        self.loss_scale = self._scale.read_value()
        self.overflow_streak = self._streak.read_value()
        self.min_loss_scale = 1.0
        self.floor_warning_after = floor_warning_after

    def get_loss_scale(self):
        return self._scale.read_value()

    def update_loss_scale(self, finite_grads):
        scale, streak = self._scale.read_value(), self._streak.read_value()
        new_scale = tf.where(finite_grads, scale, tf.maximum(scale * 0.5, 1.0))
        new_streak = tf.where(finite_grads, 0.0, streak + 1.0)
        with tf.control_dependencies([new_scale, new_streak]):  # read, then write
            return tf.group(tf.assign(self._scale, new_scale),
                            tf.assign(self._streak, new_streak))


class HalvingSubclass(Halving):
    """Inherits the declaration without setting it: gets the check."""


def _model():
    x = tf.placeholder(tf.float32, [2], name="x")
    w = tf.Variable(W0, name="w")
    return x, w, tf.reduce_sum(w * x)


def _step(path, manager):
    """(x, w, update op) of one group trained through ``path``."""
    x, w, loss = _model()
    global_step = tf.train.get_or_create_global_step()
    optimizer = tf.train.GradientDescentOptimizer(LR)
    if path == "builder":
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(loss, optimizer, var_list=[w], name="g")
        return x, w, scaler.build(global_step=global_step).update_op
    wrapped = nl.LossScaleOptimizer(optimizer, manager, backend="is_finite")
    return x, w, wrapped.minimize(loss, global_step=global_step, var_list=[w])


def _check_ops(graph):
    return [op.name for op in graph.get_operations()
            if op.type == "Assert" and op.name.endswith("check_scale")]


PATHS = ["builder", "optimizer"]


@pytest.mark.parametrize("path", PATHS)
def test_a_user_manager_drives_the_step(graph, path):
    """finite, overflow, overflow, finite: w moves on the finite steps only,
    the scale halves on each overflow, the global step counts applied steps."""
    manager = Halving(start=8.0)
    x, w, update = _step(path, manager)
    walk = [  # (x, w after, scale after, streak after, global step after)
        (FINITE, [0.0, 4.0], 8.0, 0.0, 1),
        (OVERFLOW, [0.0, 4.0], 4.0, 1.0, 1),
        (OVERFLOW, [0.0, 4.0], 2.0, 2.0, 1),
        (FINITE, [-1.0, 6.0], 2.0, 0.0, 2),
    ]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i, (fed, w_after, scale, streak, step) in enumerate(walk):
            sess.run(update, {x: fed})
            got = sess.run([w, manager.loss_scale, manager.overflow_streak,
                            tf.train.get_global_step()])
            assert [got[0].tolist()] + [float(v) for v in got[1:3]] + [int(got[3])] == [
                w_after, scale, streak, step], "step %d: %r" % (i, got)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("make, checked", [(Halving, False), (HalvingSubclass, True)])
def test_the_declaration_decides_the_run_time_check(path, make, checked):
    """Halving declares keeps_scale_in_range: no Assert, and its scale tensor
    cannot be fed. Its subclass does not: one check_scale Assert, and the
    tensor stays feedable (the check reads the fed value)."""
    with tf.Graph().as_default() as graph:
        manager = make()
        _step(path, manager)
        assert len(_check_ops(graph)) == (1 if checked else 0), _check_ops(graph)
        assert nl.managers.declares_scale_in_range(manager) is not checked


def test_a_subclass_that_breaks_the_range_fails_the_run(graph):
    """What the check is for: a subclass whose scale is 2**-127 (subnormal)
    fails the run naming the class, before any weight moves."""

    class Tiny(HalvingSubclass):
        def get_loss_scale(self):
            return self._scale.read_value() * 2.0 ** -127

    x, w, update = _step("builder", Tiny(start=1.0))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError, match="Tiny"):
            sess.run(update, {x: FINITE})
        assert sess.run(w).tolist() == W0


def test_the_floor_warning_hook_reads_its_public_properties(graph):
    """8 -> 4 -> 2 -> 1 on three overflows: at the floor with a streak of 3
    (>= floor_warning_after=2): warned once, naming the class. The hook reads
    on every second run, which here runs no update (Halving's two variables
    are read by two ops, which a run's update could land between)."""
    manager = Halving(start=8.0, floor_warning_after=2)
    x, _, update = _step("builder", manager)
    idle = tf.no_op()
    hook = nl.monitoring.FloorWarningHook([manager], every_n_steps=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with tf.train.MonitoredSession(hooks=[hook]) as sess:
            for _ in range(5):
                sess.run(update, {x: OVERFLOW})
                sess.run(idle)  # the hook reads here
    given = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(given) == 1, given
    assert "the loss scale of Halving sits at its floor (1) after 3 consecutive" in given[0]


def test_a_saver_checkpoints_its_state(graph, tmp_path):
    """Its variables are global variables: a default Saver saves and restores
    them with the model (scale 2 and streak 2 after two overflows)."""
    path = str(tmp_path / "model")
    manager = Halving(start=8.0)
    x, w, update = _step("optimizer", manager)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for fed in (FINITE, OVERFLOW, OVERFLOW):
            sess.run(update, {x: fed})
        tf.train.Saver().save(sess, path)
    with tf.Graph().as_default():
        manager = Halving(start=8.0)
        x, w, update = _step("optimizer", manager)
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, path)
            assert sess.run([manager.loss_scale, manager.overflow_streak]) == [2.0, 2.0]
            assert sess.run(w).tolist() == [0.0, 4.0]
            sess.run(update, {x: FINITE})  # training goes on from there
            assert sess.run(w).tolist() == [-1.0, 6.0]


class Boxed(nl.LossScaleManager):
    """Keeps its scale in a dict, not in an attribute: declares ``variables``."""

    keeps_scale_in_range = True  # 8, halved on overflow, floored at 1

    def __init__(self):
        self.box = {"scale": tf.Variable(8.0, trainable=False, name="boxed_scale")}

    @property
    def variables(self):
        return [self.box["scale"]]

    def get_loss_scale(self):
        return self.box["scale"].read_value()

    def update_loss_scale(self, finite_grads):
        scale = self.box["scale"].read_value()
        new_scale = tf.where(finite_grads, scale, tf.maximum(scale * 0.5, 1.0))
        with tf.control_dependencies([new_scale]):
            return tf.assign(self.box["scale"], new_scale).op


def test_the_variables_hook_feeds_object_checkpoints(graph, tmp_path):
    """Without the declaration no attribute of Boxed is a variable; with it,
    LossScaleOptimizer tracks the scale in tf.train.Checkpoint: saved at 4
    (one overflow), overwritten with 64, restored to 4."""
    manager = Boxed()
    assert not [v for v in vars(manager).values() if isinstance(v, tf.Variable)]
    assert nl.managers.manager_variables(manager) == [manager.box["scale"]]
    x, w, loss = _model()
    optimizer = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(LR), manager,
                                      backend="is_finite")
    update = optimizer.minimize(loss, var_list=[w])
    checkpoint = tf.train.Checkpoint(optimizer=optimizer)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(update, {x: OVERFLOW})
        saved = checkpoint.save(str(tmp_path / "ckpt"), session=sess)
        sess.run(tf.assign(manager.box["scale"], 64.0))
        checkpoint.restore(saved).run_restore_ops(session=sess)
        assert sess.run(manager.get_loss_scale()) == 4.0


def test_the_readme_manager_drives_the_builder(graph):
    """The docs' "Adding a manager" class (docs/managers.md), as written."""
    code = block("manager-example")
    assert code, "the docs lost their manager example"
    namespace = {}
    exec(code, namespace)  # pylint: disable=exec-used
    manager = namespace["HalvingManager"]()
    x, w, update = _step("builder", manager)
    assert _check_ops(graph) == []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(update, {x: OVERFLOW})
        assert sess.run(manager.get_loss_scale()) == 2.0 ** 14
        sess.run(update, {x: FINITE})
        assert sess.run(w).tolist() == [0.0, 4.0]
