"""``build(skip_loss_spikes=k)``: a step whose loss spikes is skipped through
the step's own gate (Megatron's spiky-loss check).

Each group's loss is compared with ``k`` times its exponential moving
average over the steps that applied; after ``warmup`` applied steps, a loss
above it skips the step (every group), with the reason ``loss_spike``. The
average moves only on applied steps, so a spike never raises it. A loss
whose average is not positive (a critic's loss around 0) is never a spike:
the ratio has no meaning there. A loss that is inf or NaN is no spike and
never enters the average (an inf in it would hide every later spike, a NaN
would end the comparison): a step on which a loss is not finite moves no
average and does not count toward the warm-up; where its gradients overflow
too, the overflow check skips it (``loss_not_finite``, the scale backs off).
The average and the count are
non-trainable global variables (``<scope>/loss_spikes/...``), saved with
checkpoints, so a restart keeps them.
"""

from __future__ import absolute_import, division, print_function

import numbers

import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams
from npu_lossscale import plugin_helpers as _helpers

#: Applied steps before a spike can skip: the average needs that many
#: samples (0.99 ** 100 = 0.37 of the first loss's weight is left then).
DEFAULT_WARMUP = 100
#: The average's decay per applied step.
DEFAULT_DECAY = 0.99


class LossSpikes(_seams.SkipCondition):
    """Skips a step whose loss exceeds ``factor`` times its moving average.

    It keeps one builder's state: pass one to each builder (another
    builder's step in the same graph is refused, ``check_plan``).

    Args:
      factor: the spike threshold, a number > 1.
      warmup: applied steps before a spike can skip.
      decay: the moving average's decay per applied step, in (0, 1).
    """

    name = "loss_spikes"
    reason = "loss_spike"
    fix = ("a loss exceeded skip_loss_spikes times its moving average: check the batch "
           "behind it; the weights and the loss scale stayed as they were.")

    def __init__(self, factor, warmup=DEFAULT_WARMUP, decay=DEFAULT_DECAY):
        self.factor = float(factor)
        self.warmup = int(warmup)
        self.decay = float(decay)
        self._scope = _helpers.current_scope()
        self._count = None
        self._averages = {}  # group name -> its average variable
        self._optimizers = ()  # the groups' optimizers of the builder that owns them

    def check_plan(self, plan, options, global_step, api):
        """Refuses a step of another builder of this graph (other
        optimizers): the count and the averages (by group name) are one
        builder's, and its step would move them too, mixing groups of one
        name (ValueError). The same builder's retry keeps them; in another
        graph the condition starts afresh."""
        del options, global_step, api
        optimizers = tuple(group.optimizer for group in plan.groups)
        live = self._count is not None and any(
            variable is self._count for variable in tf.global_variables())
        if not live:
            self._count, self._averages, self._optimizers = None, {}, optimizers
        elif len(optimizers) != len(self._optimizers) or any(
                mine is not theirs for mine, theirs in zip(optimizers, self._optimizers)):
            raise ValueError(
                "skip_conditions: %r already keeps the loss averages of another builder's "
                "step in this graph (%s), which this step would move too. Make one "
                "skips.loss_spikes(k) per builder." % (self, self._count.name))

    def _variables(self, names):
        """The count and each named group's average, made on first use."""
        with _helpers.outside(self._scope), tf.name_scope("loss_spikes"):
            # Resource variables: ``on_apply`` writes them inside the gate,
            # a functional ``If`` under gate="cond" with control flow v2,
            # where a ref variable cannot be assigned.
            if self._count is None:
                self._count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                          use_resource=True, name="applied_steps")
            for name in names:
                if name not in self._averages:
                    self._averages[name] = tf.Variable(0.0, dtype=tf.float32, trainable=False,
                                                       use_resource=True,
                                                       name="average_%s" % name)
        return self._count, [self._averages[name] for name in names]

    def flag(self, state):
        groups = [group for group in state.plan.groups if group.loss is not None]
        count, averages = self._variables([group.name for group in groups])
        warm = tf.greater_equal(count.read_value(), self.warmup)
        spikes = []
        for group, average in zip(groups, averages):
            loss = tf.cast(group.loss, tf.float32)
            mean = average.read_value()
            spikes.append(tf.logical_and(
                tf.logical_and(tf.greater(mean, 0.0), _helpers.finite(loss)),
                tf.greater(loss, self.factor * mean)))
        spiked = tf.logical_and(warm, tf.reduce_any(tf.stack(spikes)))
        return tf.cast(spiked, tf.float32)

    def on_apply(self, state):
        groups = [group for group in state.plan.groups if group.loss is not None]
        count, averages = self._variables([group.name for group in groups])
        first = tf.equal(count.read_value(), 0)
        losses = [tf.cast(group.loss, tf.float32) for group in groups]
        finite = tf.reduce_all(tf.stack([_helpers.finite(loss) for loss in losses]))
        ops = []
        for loss, average in zip(losses, averages):
            old = average.read_value()
            moved = tf.where(first, loss, self.decay * old + (1.0 - self.decay) * loss)
            ops.append(tf.assign(average, tf.where(finite, moved, old)).op)
        with tf.control_dependencies(ops):
            ops.append(tf.assign_add(count, tf.cast(finite, tf.int64)).op)
        return ops


def loss_spikes(factor, argument="k"):
    """A condition that skips a step whose loss exceeds ``factor`` times its
    moving average (``skips.loss_spikes``; ``build(skip_loss_spikes=k)``).

    Args:
      factor: a number > 1.
      argument: the argument's name, for the messages.

    Returns:
      A ``LossSpikes``.

    Raises:
      TypeError: for a non-number (a bool, a str, a tensor).
      ValueError: for a number that is not finite or not above 1.
    """
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError("%s must be a number > 1, got %r. Pass e.g. %s=3.0 (skip a loss "
                        "above 3x its average)." % (argument, factor, argument))
    if not 1.0 < float(factor) < float("inf"):
        raise ValueError("%s must be a finite number > 1, got %r. Pass e.g. %s=3.0."
                         % (argument, factor, argument))
    return LossSpikes(factor)
