"""Skip conditions (``seams.SkipCondition``) after the overflow check:
steps asked to be skipped (``requested``), and loss spikes
(``loss_spikes``). Each is a value for ``build(skip_conditions=[...])``::

  scaler.build(global_step=step, count_skipped_steps=True,
               skip_conditions=[skips.requested(range(4000, 4100)),
                                skips.loss_spikes(3.0)])

is ``build(..., skip_global_steps=range(4000, 4100), skip_loss_spikes=3.0)``.
"""

from __future__ import absolute_import, division, print_function

from npu_lossscale.skips.on_request import RequestedSkips, requested
from npu_lossscale.skips.spikes import LossSpikes, loss_spikes

__all__ = ["LossSpikes", "RequestedSkips", "loss_spikes", "requested"]
