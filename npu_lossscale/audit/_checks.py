"""The audit's checks: one function per finding code, grouped by theme in
the sibling modules, run in the order of ``CHECKS``.

Each check takes a ``Context`` (the facts, the set of nodes in the run, and
whether fetches were given) and returns a list of ``Finding``s.
"""

from __future__ import absolute_import, division, print_function

from npu_lossscale.audit._distributed import check_collective_in_cond
from npu_lossscale.audit._dtypes import check_float16_master
from npu_lossscale.audit._findings import CODES, Context, Finding, needs_fetches_note
from npu_lossscale.audit._scale_state import (
    check_double_scale_updates, check_independent_scales, check_unsaved_scale)
from npu_lossscale.audit._status_race import check_status_race
from npu_lossscale.audit._sync_replicas import check_sync_token_stall
from npu_lossscale.audit._updates import (
    check_double_updates, check_foreign_loss, check_shared_optimizer_state,
    check_ungated_accumulation, check_ungated_updates, check_untrained_variables)

__all__ = ["CHECKS", "CODES", "Context", "Finding", "needs_fetches_note"]

CHECKS = (check_status_race, check_untrained_variables, check_foreign_loss,
          check_collective_in_cond, check_ungated_updates, check_unsaved_scale,
          check_float16_master, check_independent_scales, check_ungated_accumulation,
          check_double_updates, check_double_scale_updates, check_sync_token_stall,
          check_shared_optimizer_state)

