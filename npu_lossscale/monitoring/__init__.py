"""What a user watches while training: the summaries (``scalars``),
``LossScaleHook`` (``hook``), the collapse policy (``CollapseMonitor``,
``collapse``) and the floor warning (``check_floor``, ``FloorWarningHook``,
``floor``)."""

from __future__ import absolute_import, division, print_function

__all__ = ["COLLAPSE_ACTIONS", "Collapse", "CollapseMonitor", "DEFAULT_WARNING_EVERY_N_STEPS",
           "FloorWarningHook", "LossScaleCollapse", "LossScaleHook", "check_floor", "summaries"]

from npu_lossscale.monitoring.collapse import (COLLAPSE_ACTIONS, Collapse, CollapseMonitor,
                                               LossScaleCollapse)
from npu_lossscale.monitoring.floor import (DEFAULT_WARNING_EVERY_N_STEPS, FloorWarningHook,
                                            check_floor)
from npu_lossscale.monitoring.hook import LossScaleHook
from npu_lossscale.monitoring.scalars import summaries
