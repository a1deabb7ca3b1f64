"""The helpers of the step that code outside ``core`` may call: the shipped
plug-ins (transforms, skips, underflow, diagnostics, distributed), the
managers and the backends. Anything of ``core`` not named here is the
step's own (tests/test_style.py checks that the plug-ins reach no other).

* Checks at the boundary, raising ValueError or TypeError that name the
  argument: ``check_bool``, ``check_count``, ``check_number``,
  ``check_gradients``, ``check_loss``, ``check_optimizer``,
  ``check_session``, ``check_train_ops``, ``is_session``, ``is_variable``,
  ``of_another_graph``, ``computed_from``.
* Where ops are made: ``require_graph_mode``, ``require_top_level``,
  ``outside`` and ``current_scope`` (state made once, outside any control
  flow), ``graph_state_of`` and ``defer_control_input``.
* Tensors: ``finite``, ``dense_values``, ``values_flag``,
  ``SMALL_GRADIENT_ELEMENTS``.
* Branches of the gate: ``run_if``, ``cond_if``.
* Graph walks and copies: ``depth_first``, ``reachable``, ``topological``,
  the op type sets, ``copy_op``, ``Copies``, ``data_inputs``; collectives:
  ``is_collective``, ``values_op``, ``data_parents``, ``check_reduced``.
* ``distinct`` (items once each, by identity, in order) and
  ``replica_losses`` (an engine's losses per in-graph replica, checked).
* For the SyncReplicas route, an entry point of its own that builds a
  second step on the chief (docs/design.md, "Data parallelism"):
  ``make_plan``, ``overflow_flags``, ``Packing``, ``close_step``,
  ``Closing``, ``Closed``, ``Decisions``. No hook is given these records.
"""

from __future__ import absolute_import, division, print_function

from npu_lossscale.core.checks import (check_bool, check_count, check_gradients, check_loss,
                                       check_number, check_optimizer, check_session,
                                       check_train_ops, computed_from, is_session,
                                       is_variable, of_another_graph)
from npu_lossscale.core.close import Closed, Closing, Decisions
from npu_lossscale.core.close import close as close_step
from npu_lossscale.core.collectives import check_reduced, data_parents, is_collective, values_op
from npu_lossscale.core.commit import cond_if, run_if
from npu_lossscale.core.context import require_graph_mode, require_top_level
from npu_lossscale.core.gradients import SMALL_GRADIENT_ELEMENTS, Packing, dense_values, finite
from npu_lossscale.core.graph_copy import Copies, copy_op, data_inputs
from npu_lossscale.core.graph_state import current_scope, defer_control_input, outside
from npu_lossscale.core.graph_state import of as graph_state_of
from npu_lossscale.core.graph_walk import (ACCUMULATOR_TAKE_TYPES, CONTROL_FLOW_TYPES,
                                           ENTER_TYPES, FEEDABLE_TYPES, FUNCTION_CALL_TYPES,
                                           IDENTITY_TYPES, depth_first, reachable, topological)
from npu_lossscale.core.hooks import replica_losses
from npu_lossscale.core.overflow import flags as overflow_flags
from npu_lossscale.core.overflow import values_flag
from npu_lossscale.core.plan import distinct, make_plan

__all__ = [
    "check_bool", "check_count", "check_number", "check_gradients", "check_loss",
    "check_optimizer", "check_session", "check_train_ops", "is_session", "is_variable",
    "of_another_graph", "computed_from",
    "require_graph_mode", "require_top_level", "outside", "current_scope", "graph_state_of",
    "defer_control_input",
    "finite", "dense_values", "values_flag", "SMALL_GRADIENT_ELEMENTS",
    "run_if", "cond_if",
    "depth_first", "reachable", "topological", "ACCUMULATOR_TAKE_TYPES", "CONTROL_FLOW_TYPES",
    "ENTER_TYPES", "FEEDABLE_TYPES", "FUNCTION_CALL_TYPES", "IDENTITY_TYPES", "copy_op",
    "Copies", "data_inputs", "is_collective", "values_op", "data_parents", "check_reduced",
    "make_plan", "distinct", "replica_losses", "overflow_flags", "Packing", "close_step",
    "Closing", "Closed", "Decisions",
]
