"""The seams and the skips, misused as users misuse them (issue 44): each
misuse gets a clear error at build time (or at run time where only the run
can know), or works; docs/errors.md says what each gets.

Each test holds the step against an independent reference: hand-computed
gradients and norms, TF's own ops, a counter of the user's.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import seams

#: ``_net``'s gradient: ``C`` itself, global norm 50.
C = np.array([30.0, 40.0], np.float32)


def _net(name="w"):
    """A float32 ``w`` of two elements and the loss ``w . C`` (gradient
    ``C``, norm 50), fed nothing."""
    w = tf.get_variable(name, initializer=np.array([1.0, 2.0], np.float32))
    return w, tf.reduce_sum(w * tf.constant(C))


class NormAbove(seams.SkipCondition):
    """Skips when the global norm of the gradients it sees exceeds
    ``limit``; remembers the norm it saw."""

    reason = "norm_above_limit"
    fix = "the gradient norm exceeds the limit: lower the learning rate."

    def __init__(self, limit):
        self.limit = limit
        self.norm = None

    def flag(self, state):
        self.norm = tf.global_norm([grad for pairs in state.grads.values()
                                    for grad, _ in pairs])
        return tf.cast(self.norm > self.limit, tf.float32)


class ReportNorm(seams.StepObserver):
    """Reports the global norm of the gradients it sees."""

    def report(self, state):
        return tf.global_norm([grad for pairs in state.grads.values() for grad, _ in pairs])


@pytest.mark.parametrize("clip_norm", [None, 1.0], ids=["unclipped", "clip_norm"])
@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_conditions_observers_and_grads_and_vars_see_the_unclipped_gradients(
        graph, clip_norm, accumulation_steps):
    """Issue 44: the clip was fused into the unscale, so a condition on the
    norm of ``state.grads`` saw the clipped norm (1) and never fired on a
    norm-50 gradient, while with accumulation it saw the unclipped one. Now
    conditions, observers' reports and ``TrainOps.grads_and_vars`` all see
    this run's unscaled gradients before any transform: norm 50 in every
    case, and the condition skips."""
    w, loss = _net()
    condition = NormAbove(10.0)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 8), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net",
               clip_norm=clip_norm)
    train = scaler.build(accumulation_steps=accumulation_steps, skip_conditions=[condition],
                         observers=[ReportNorm()])
    fields = tf.global_norm([grad for grad, _ in train.grads_and_vars["net"]])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(accumulation_steps):
            seen, reported, listed, applied = sess.run(
                [condition.norm, train.observed["ReportNorm"], fields, train.applied,
                 train.update_op])[:4]
            assert seen == reported == listed == pytest.approx(50.0, rel=1e-6)
        assert not applied
        np.testing.assert_array_equal(sess.run(w), [1.0, 2.0])
