"""npu_bridge's (and TF 1.15 contrib's) rule: ``ExponentialUpdateLossScaleManager``."""

from __future__ import absolute_import, division, print_function

from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.managers.base import (_DEFAULT_FLOOR_WARNING_AFTER, _DEFAULT_MAX_LOSS_SCALE,
                                         _DEFAULT_MIN_LOSS_SCALE, _check_initial_scale,
                                         _check_period, _check_ratio, _float32)
from npu_lossscale.managers.counting import _CountingLossScaleManager

# npu_bridge's defaults, the same as TF 1.15 contrib's
# (tf_adapter/python/npu_bridge/estimator/npu/npu_loss_scale_manager.py).
_DEFAULT_DECR_EVERY_N_NAN_OR_INF = 2
_DEFAULT_INCR_RATIO = 2.0
_DEFAULT_DECR_RATIO = 0.8
# npu_bridge grows only while `loss_scale < 3.4e+38 / incr_ratio`: this
# constant, not float32's maximum, and a `less`, not contrib's `is_finite`.
_NPU_BRIDGE_FLOAT_MAX = 3.4e+38


class ExponentialUpdateLossScaleManager(_CountingLossScaleManager):
    """npu_bridge's exponential-update rule (TF 1.15 contrib's, with
    npu_bridge's growth ceiling).

    On a finite step, if ``good + 1 >= incr_every_n_steps`` the scale is
    multiplied by ``incr_ratio`` (while ``scale < 3.4e38 / incr_ratio``, and
    up to ``min(max_loss_scale, 2**126)``) and both counters reset; else
    ``good += 1``. On a non-finite step, if ``bad + 1 >=
    decr_every_n_nan_or_inf`` the scale becomes ``max(min_loss_scale, scale
    * decr_ratio)`` and both counters reset; else ``bad += 1`` and ``good =
    0``. E.g. ``init_loss_scale=1024, decr_ratio=0.5,
    decr_every_n_nan_or_inf=2`` gives 512 after two bad steps.

    As in npu_bridge, the tensor ``loss_scale:0`` is the scale of a single
    manager built at the root name scope. The state is the variable
    ``exponential_loss_scale/state``.

    Args:
      init_loss_scale: the starting scale, in [min_loss_scale, 2**126]
        (npu_bridge examples use 2**32).
      incr_every_n_steps: finite steps needed before the scale grows, in
        [1, 2**24].
      decr_every_n_nan_or_inf: non-finite steps needed before it shrinks, in
        [1, 2**24].
      incr_ratio: growth factor, > 1.
      decr_ratio: back-off factor, in (0, 1).
      min_loss_scale: floor of the scale (npu_bridge's is 1), as low as
        2**-126.
      max_loss_scale: cap on growth, or None (npu_bridge's: no cap); the
        scale stops at 2**126 in any case.
      floor_warning_after: warn, once, when the scale sits at
        ``min_loss_scale`` after this many consecutive overflowing steps
        (see ``check_floor``); None never warns.

    Raises:
      TypeError: if an argument has the wrong type.
      ValueError: if an argument is out of range, NaN or infinite.
    """

    keeps_scale_in_range = True  # the counting rule's bounds

    def __init__(self, init_loss_scale, incr_every_n_steps,
                 decr_every_n_nan_or_inf=_DEFAULT_DECR_EVERY_N_NAN_OR_INF,
                 incr_ratio=_DEFAULT_INCR_RATIO, decr_ratio=_DEFAULT_DECR_RATIO,
                 min_loss_scale=_DEFAULT_MIN_LOSS_SCALE,
                 max_loss_scale=_DEFAULT_MAX_LOSS_SCALE,
                 floor_warning_after=_DEFAULT_FLOOR_WARNING_AFTER):
        _helpers.require_graph_mode("ExponentialUpdateLossScaleManager")
        _check_initial_scale("init_loss_scale", init_loss_scale, min_loss_scale,
                             max_loss_scale, floor_warning_after)
        _check_period("incr_every_n_steps", incr_every_n_steps, 1000)
        _check_period("decr_every_n_nan_or_inf", decr_every_n_nan_or_inf, 2)
        _check_ratio("incr_ratio", incr_ratio, 2)
        _helpers.check_number("decr_ratio", decr_ratio, minimum=0, maximum=1,
                             min_open=True, max_open=True, hint="Pass e.g. 0.5.")
        self._decr_every = int(decr_every_n_nan_or_inf)
        self._decr_ratio = float(decr_ratio)
        super(ExponentialUpdateLossScaleManager, self).__init__(
            init_loss_scale, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio,
            min_loss_scale, max_loss_scale, floor_warning_after,
            growth_ceiling=_float32(_NPU_BRIDGE_FLOAT_MAX / float(incr_ratio)),
            name="exponential_loss_scale", scale_name_in_scope=False)

    def _shrink_factor(self):
        return self._decr_ratio  # contrib and npu_bridge multiply

    @property
    def incr_every_n_steps(self):
        """Finite steps needed before the scale grows."""
        return self._grow_every

    @property
    def decr_every_n_nan_or_inf(self):
        """Non-finite steps needed before the scale shrinks."""
        return self._decr_every

    @property
    def incr_ratio(self):
        """The growth factor."""
        return self._incr_ratio

    @property
    def decr_ratio(self):
        """The back-off factor."""
        return self._decr_ratio

