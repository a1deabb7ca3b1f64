"""Loss-scale managers: where the loss scale lives and how it moves.

Every manager follows the protocol of TF 1.15 contrib's and npu_bridge's
``LossScaleManager``: ``get_loss_scale()`` returns a float32 scalar tensor,
``update_loss_scale(finite_grads)`` an op. ``base.LossScaleManager`` declares
it with its optional hooks, and ``base``'s functions are the only step code
that reads them, so a new manager is one class (docs/managers.md).
"""

from __future__ import absolute_import, division, print_function

# The protocol's functions are re-exported for the step; FloorWarningHook
# (monitoring) for code that imports it from here.
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
