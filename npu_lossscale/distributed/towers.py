"""In-graph towers: ``add([loss_0, loss_1, ...], optimizer, var_list)``.

Each tower is one replica of the model on its own device, computing a loss
on its share of the batch (the SAGAN and StyleGAN idiom). Each tower's
backprop is built beside its forward ops (``colocate_gradients_with_ops``),
so its gradients are computed on its device; the towers' gradients are then
averaged (in float32 for float16 gradients, so that the sum cannot overflow
where the mean does not) and the step checks, decides and applies once for
all towers. The average is an ordinary in-graph op: there is no collective,
so nothing waits inside a cond. Across workers, the engine the towers
wrap (Horovod, HCCL) reduces as it does without them.
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams
from npu_lossscale import plugin_helpers as _helpers


class Towers(_seams.ReductionEngine):
    """Several in-graph replicas of some groups' losses (the module
    docstring), around the engine that reduces across workers.

    Args:
      inner: the ``seams.ReductionEngine`` across workers (one worker by
        default).
      replicas: dict from group name to the tuple of its towers' losses.
    """

    def __init__(self, inner, replicas):
        self.inner = inner
        self.replicas = dict(replicas)

    @property
    def name(self):
        """The name of the engine the towers wrap: its ``reduce`` and
        ``close`` are the ones called, so messages name it."""
        return self.inner.name

    @property
    def mode(self):
        return self.inner.mode

    def check_plan(self, plan, options, global_step, api):
        if self.inner.mode == "chief":
            raise ValueError(
                "%s: tower losses with a SyncReplicasOptimizer group, whose chief "
                "aggregates the workers' pushes. Pass one loss per group there, or use "
                "distributed='horovod'." % (api,))
        self.inner.check_plan(plan, options, global_step, api)

    def replica_losses(self, group):
        return self.replicas.get(group.name, (group.loss,))

    def replica_scope(self, group, index):
        """The tower loss's device, for an optimizer's own
        ``compute_gradients``, which the step cannot ask to colocate."""
        losses = self.replica_losses(group)
        if group.own_backprop and len(losses) > 1:
            return tf.device(losses[index].device)
        return super(Towers, self).replica_scope(group, index)

    def combine_replicas(self, group, per_replica):
        """Each variable's mean over the towers, a tower without its
        gradient counting as zero (the gradient of the towers' mean loss)."""
        grads = collections.OrderedDict((var.name, (var, [])) for var in group.var_list)
        for pairs in per_replica:
            for grad, var in pairs:
                grads[var.name][1].append(grad)
        with tf.name_scope("tower_mean"):
            return [(_mean(found, len(per_replica)), var)
                    for var, found in grads.values() if found]

    def reduce(self, flags, grads, allreduce_gradients):
        return self.inner.reduce(flags, grads, allreduce_gradients)

    def close(self, plan, closing, global_step, skipped_steps, observers=()):
        return self.inner.close(plan, closing, global_step, skipped_steps, observers)


def _mean(grads, count):
    """The mean of one variable's tower gradients, in its dtype (summed in
    float32 when narrower)."""
    if any(isinstance(grad, tf.IndexedSlices) for grad in grads):
        slices = [grad if isinstance(grad, tf.IndexedSlices)
                  else tf.IndexedSlices(grad, tf.range(tf.shape(grad)[0]), tf.shape(grad))
                  for grad in grads]
        return tf.IndexedSlices(tf.concat([s.values for s in slices], 0) / count,
                                tf.concat([s.indices for s in slices], 0),
                                slices[0].dense_shape)
    dtype = grads[0].dtype.base_dtype
    wide = [grad if dtype == tf.float32 else tf.cast(grad, tf.float32) for grad in grads]
    mean = tf.add_n(wide) * (1.0 / count)
    return mean if dtype == tf.float32 else tf.cast(mean, dtype)


def tower_losses(losses, group_name):
    """Checks the towers of one group and returns them as a tuple.

    Args:
      losses: a list or tuple of scalar float loss tensors, one per tower.
      group_name: the group's name, for messages.

    Returns:
      A tuple of the checked losses.

    Raises:
      TypeError: for an entry that is no float scalar tensor.
      ValueError: for an empty list, a loss listed twice, or losses of
        different dtypes.
    """
    if not losses:
        raise ValueError("group %r: add() got an empty list of tower losses, %r. Pass one "
                         "loss per tower, e.g. [loss_gpu0, loss_gpu1]." % (group_name, losses))
    checked = tuple(_helpers.check_loss(loss) for loss in losses)
    for index, loss in enumerate(checked):
        if any(loss is other for other in checked[:index]):
            raise ValueError("group %r: tower loss %r is listed twice. Pass each tower's own "
                             "loss once." % (group_name, loss))
    dtypes = sorted(set(loss.dtype.base_dtype.name for loss in checked))
    if len(dtypes) > 1:
        raise ValueError("group %r: the tower losses have dtypes %s. Build every tower "
                         "alike." % (group_name, dtypes))
    return checked


def mean_loss(losses):
    """The towers' mean loss (float32): the group's loss for what reads one
    (the diagnosis, the spike check, the underflow measurement)."""
    with tf.name_scope("tower_loss"):
        return tf.add_n([tf.cast(loss, tf.float32) for loss in losses]) * (1.0 / len(losses))


