"""The scale read of phase 1: each manager's loss scale read once per step,
as an unfeedable float32 snapshot with its inverse, checked at run time
when the manager does not declare its range."""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale import manager_protocol as _manager_protocol

#: The manager protocol's range of scales (``managers.SCALE_RANGE`` says
#: why).
SCALE_RANGE = _manager_protocol.SCALE_RANGE
#: The scales ``check_scale`` accepts from a manager that does not declare
#: its range: the protocol's, floored at float16's smallest subnormal
#: (2**-24), below which a float16 gradient under 0.5 flushes to 0.
CUSTOM_SCALE_RANGE = (2.0 ** -24, SCALE_RANGE[1])


class Scale(collections.namedtuple("Scale", ["value", "inverse", "is_unit"])):
    """One manager's loss scale for this step.

    Attributes:
      value: float32 scalar, the scale every use in the step reads.
      inverse: float32 scalar ``1 / value``; unused when ``is_unit``.
      is_unit: True when the manager's scale is the constant 1, so there is
        nothing to unscale.
    """


def scale_snapshot(manager):
    """Reads the loss scale once for the step, as float32.

    Every use of the scale in a step goes through this one tensor, so the
    manager's update, which runs after it, cannot change the scale under the
    step's feet. It is a ``Snapshot`` (a copy), not an ``Identity``: with ref
    variables an identity aliases the variable's buffer, which ``Assign``
    overwrites in place.

    For a manager whose class does not declare ``keeps_scale_in_range``
    (custom, contrib's, npu_bridge's, subclasses of ours), the snapshot waits
    for ``check_scale``: a scale outside ``CUSTOM_SCALE_RANGE`` (0, negative, NaN,
    inf, a float64 or float16 value that is inf in float32) fails the run
    before anything of the step runs. A declaring class (this package's
    managers) gets no check (``managers.declares_scale_in_range``).

    The tensors made here (the float32 cast, the snapshot) and, for a
    declaring class, the tensor ``get_loss_scale()`` returned cannot be
    fed (``Graph.prevent_feeding``): a ``feed_dict`` entry for them makes
    ``session.run`` raise ValueError before the step runs, where a fed 0
    used to apply NaN weights. A custom manager's own tensor may still be
    fed (a placeholder may be its design): the check reads the fed value.

    Args:
      manager: a loss-scale manager.

    Returns:
      A float32 scalar tensor.

    Raises:
      TypeError: if ``get_loss_scale()`` returns None or a non-number.
      ValueError: if it returns a non-scalar.
    """
    raw = manager.get_loss_scale()
    if raw is None:
        raise TypeError(
            "%s.get_loss_scale() returned None. Return the scale as a scalar tensor, e.g. "
            "self._scale.read_value()." % type(manager).__name__)
    scale = tf.convert_to_tensor(raw)
    if not (scale.dtype.base_dtype.is_floating or scale.dtype.base_dtype.is_integer):
        raise TypeError("%s.get_loss_scale() returned %r, not a number. Return a float32 "
                        "scalar tensor." % (type(manager).__name__, raw))
    if scale.shape.ndims is not None and scale.shape.ndims != 0:
        raise ValueError("%s.get_loss_scale() returned shape %s, not a scalar. Return one "
                         "scale, e.g. tf.reshape(scale, [])."
                         % (type(manager).__name__, scale.shape))
    own = _manager_protocol.declares_scale_in_range(manager)
    if own:
        _prevent_feeding(scale)
    if scale.dtype.base_dtype != tf.float32:
        scale = _prevent_feeding(tf.cast(scale, tf.float32))
    checks = [] if own else [check_scale(manager, scale)]
    with tf.control_dependencies(checks):
        return _prevent_feeding(tf.raw_ops.Snapshot(input=scale, name="scale"))


def _prevent_feeding(tensor):
    """``tensor``, which ``session.run`` now refuses to take from a feed_dict."""
    tensor.graph.prevent_feeding(tensor)
    return tensor


def check_scale(manager, scale):
    """The run-time check that a manager's scale lies in
    ``CUSTOM_SCALE_RANGE``.

    A scale of 0 zeroes every scaled gradient and makes its unscaled value
    NaN (0 * inf); a NaN or infinite scale makes every gradient non-finite,
    so every step is skipped without a word; above 2**126 the inverse is
    subnormal, read as 0. The two comparisons are false for all of them (NaN
    compares false), for negative and for subnormal scales; one ``Assert`` op
    (no cond guard) fails the run on them.

    Args:
      manager: the manager the scale comes from (its class names the error).
      scale: float32 scalar tensor, the scale as read this step.

    Returns:
      The ``Assert`` op; it fails the run with InvalidArgumentError, printing
      the manager's class, the scale and the fix.
    """
    low, high = CUSTOM_SCALE_RANGE
    message = (
        "npu_lossscale: the loss-scale manager %s returned a loss scale outside "
        "[2**-24, 2**126] from get_loss_scale() (0 makes the gradients NaN, NaN "
        "and inf skip every step, beyond 2**126 1/scale flushes to 0, below 2**-24 "
        "every float16 gradient under 0.5 flushes to 0 and nothing trains). Keep it "
        "there in its update_loss_scale, e.g. tf.clip_by_value(new_scale, 1.0, "
        "2.0 ** 64). The scale was:"
        % type(manager).__name__)
    in_range = tf.logical_and(tf.greater_equal(scale, low), tf.less_equal(scale, high))
    # The raw op: tf.Assert would wrap a float datum in a cond guard.
    return tf.raw_ops.Assert(condition=in_range, data=[message, scale],
                             summarize=1, name="check_scale")


def read_scale(manager):
    """The ``Scale`` of ``manager`` for this step: a snapshot and its inverse.

    Args:
      manager: a loss-scale manager.

    Returns:
      A ``Scale``; ``inverse`` is None when the manager declares the constant
      scale 1 (``static_loss_scale == 1``). Neither tensor can be fed.
    """
    value = scale_snapshot(manager)
    if _manager_protocol.static_scale(manager) == 1.0:
        return Scale(value, None, True)
    return Scale(value, _prevent_feeding(tf.reciprocal(value, name="inv_scale")), False)


def read_scales(plan, after=()):
    """Each manager's ``Scale``, read once under its own name scope.

    Args:
      plan: the ``plan.Plan``.
      after: ops every read must follow (an observer's work before the
        scale read).

    Returns:
      Ordered dict from ``ManagerUse.name`` to ``Scale``, the builder's first.
    """
    scales = collections.OrderedDict()
    for use in plan.managers:
        with tf.name_scope(use.name), tf.control_dependencies(list(after)):
            scales[use.name] = read_scale(use.manager)
    return scales
