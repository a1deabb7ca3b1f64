"""Loss-scale managers: where the loss scale lives and how it moves.

Every manager follows the protocol of TF 1.15 contrib's ``LossScaleManager``
and npu_bridge's managers, so the builder accepts any of them:

* ``get_loss_scale()`` returns a float32 scalar tensor;
* ``update_loss_scale(finite_grads)`` takes a bool scalar tensor and returns an
  op that moves the scale according to the manager's rule.

``base.LossScaleManager`` declares the protocol with its optional hooks and
the declaration ``keeps_scale_in_range``; ``base``'s functions are the only
step code that reads them, so a new manager is one class and needs no edit
here (docs/managers.md, "Adding a manager"). Our managers keep the scale in
[min_loss_scale, 2**126] (the floor is 1 by default, as low as 2**-126):
beyond that range the scale or its inverse is subnormal.

The dynamic managers keep all their state in ONE non-trainable float32
variable of four elements, ``[loss_scale, good_steps, bad_steps,
overflow_streak]``, updated by one assign per step:

* float32, not int32: TensorFlow keeps int32 tensors in host memory on a GPU,
  so int32 counters cost host/device copies and host ops in the middle of
  every step. A float32 vector stays on the device.
* float32 counts integers exactly up to 2**24. ``good_steps`` and
  ``bad_steps`` reset whenever they reach their period, and the periods are
  limited to 2**24, so they never leave that range. ``overflow_streak`` only
  grows on consecutive overflows and saturates at 2**24 (``x + 1 == x`` in
  float32 there), which is harmless: it is read only by the floor warning.
* The update is a dozen elementwise ops and selects: no cond, no Switch or
  Merge, no ``IsFinite`` (Ascend's saturation mode does not support it).

``tf.train.Saver`` checkpoints the state with the model. Checkpoints written by
npu_lossscale 0.1 (separate int32 counters) or by npu_bridge's
``ExponentialUpdateLossScaleManager`` restore after ``convert_checkpoint``.
"""

from __future__ import absolute_import, division, print_function

# The package's modules, one idea each: base (the protocol, its checks, the
# shared argument checks), fixed, counting (the rule both dynamic managers
# share), exponential, dynamic, listening (the dynamic rule steered by the
# underflow measurement), and checkpoints (offline conversion). The
# protocol's functions are re-exported for the step (builder, optimizer,
# gradients); FloorWarningHook (monitoring) for code that imported it here.
from npu_lossscale.managers.base import (SCALE_RANGE, LossScaleManager, check_manager,
                                         check_manager_graph, declares_scale_in_range,
                                         describe, listens_to_underflow, manager_variables,
                                         overflow_check_enabled, scale_may_be_below_one,
                                         scale_moves, static_scale)
from npu_lossscale.managers.checkpoints import convert_checkpoint
from npu_lossscale.managers.dynamic import DynamicLossScaleManager
from npu_lossscale.managers.exponential import ExponentialUpdateLossScaleManager
from npu_lossscale.managers.fixed import FixedLossScaleManager, NoOpLossScaleManager
from npu_lossscale.managers.listening import ListeningLossScaleManager
from npu_lossscale.monitoring import FloorWarningHook

__all__ = [
    "DynamicLossScaleManager",
    "ExponentialUpdateLossScaleManager",
    "FixedLossScaleManager",
    "ListeningLossScaleManager",
    "LossScaleManager",
    "NoOpLossScaleManager",
    "convert_checkpoint",
]
