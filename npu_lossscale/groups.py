"""What ``MultiOptimizerLossScale.add`` records: a group's arguments,
each checked where it is handed in, as one ``plan.Group``, with its tower
losses and its loss callable beside it."""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale import assembly as _assembly
from npu_lossscale import manager_protocol as _managers
from npu_lossscale import sugar as _sugar
from npu_lossscale.core import checks as _checks
from npu_lossscale.core import plan as _plan


class Added(collections.namedtuple("Added", ["group", "towers", "loss_fn"])):
    """One group ``add()`` took.

    Attributes:
      group: its ``plan.Group`` (a tower group's loss its first tower's,
        until ``build()`` puts the towers' mean in its place).
      towers: its tower losses, checked; empty for one loss.
      loss_fn: the loss callable it was given, or None for a tensor.
    """


def checked_group(loss, optimizer, var_list, name, loss_scale_manager, keywords, groups,
                  default_manager, engine, allreduce_gradients):
    """The group of ``add(loss, optimizer, var_list, name, ...)``, checked.

    Args:
      loss, optimizer, var_list, name, loss_scale_manager: as ``add()``
        took them.
      keywords: dict of ``add()``'s keywords of ``sugar.TABLE``
        (``transform_grads_fn``, ``clip_norm``).
      groups: the builder's groups so far.
      default_manager: the builder's manager.
      engine: the builder's ``seams.ReductionEngine``, or None.
      allreduce_gradients: the builder's ``allreduce_gradients``.

    Returns:
      An ``Added``.

    Raises:
      TypeError, ValueError: as ``MultiOptimizerLossScale.add`` says.
    """
    loss_fn = None
    if callable(loss) and not isinstance(loss, tf.Tensor):
        loss_fn, loss = loss, loss()  # as tf.train.Optimizer.minimize accepts
    towers = loss if isinstance(loss, (list, tuple)) else None
    if towers is None:
        loss = _checks.check_loss(loss)
    _checks.check_optimizer(optimizer)
    transforms = _sugar.resolve("add", "add()", keywords).transforms
    for transform in transforms:
        _checks.check_bool("%s.keeps_finite" % transform.name, transform.keeps_finite,
                           "Set it True only when finite gradients in always give finite "
                           "gradients out (a clip by a finite norm).")
    if name is None:
        name = "group_%d" % len(groups)
    name = _checks.check_group_name(name, [group.name for group in groups])
    if towers is not None:
        towers = _assembly.tower_losses(towers, name)
        loss = towers[0]  # the towers' mean replaces it at build()
    for group in groups:
        if group.optimizer is optimizer:
            raise ValueError("optimizer %r is already group %r's. Give each group its "
                             "own optimizer." % (optimizer, group.name))
    var_list = _checks.check_var_list(var_list, name, groups)
    _assembly.check_group_engine(engine, optimizer, name, allreduce_gradients)
    if loss_scale_manager is None:
        loss_scale_manager = default_manager
    else:
        _managers.check_manager(loss_scale_manager)
    # An optimizer whose compute_gradients is its own (Horovod's, NPU's,
    # or one patched in place by npu_distributed_optimizer_wrapper) must
    # compute its gradients itself: a shared tf.gradients would bypass it.
    own_backprop = (type(optimizer).compute_gradients
                    is not tf.train.Optimizer.compute_gradients
                    or "compute_gradients" in vars(optimizer))
    return Added(_plan.Group(name, loss, optimizer, var_list, transforms, loss_scale_manager,
                             _managers.overflow_check_enabled(loss_scale_manager), own_backprop),
                 tuple(towers or ()), loss_fn)
