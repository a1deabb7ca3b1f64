"""The pieces of one loss-scaled step, shared by the builder and
``LossScaleOptimizer``: argument checks, scaling, unscaling, the overflow
decision, the guarded apply and the manager update."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import gen_array_ops
from tensorflow.python.ops import resource_variable_ops

_LOSS_SCALE_WRAPPERS = ("LossScaleOptimizer", "NPULossScaleOptimizer",
                        "MixedPrecisionLossScaleOptimizer")


def check_manager(manager, argument="loss_scale_manager"):
    """Raises TypeError unless ``manager`` follows the loss-scale protocol."""
    if not (callable(getattr(manager, "get_loss_scale", None))
            and callable(getattr(manager, "update_loss_scale", None))):
        raise TypeError(
            "%s must have get_loss_scale() and update_loss_scale(finite_grads) "
            "methods, got %r. Pass a DynamicLossScaleManager, "
            "ExponentialUpdateLossScaleManager or FixedLossScaleManager "
            "(npu_bridge's and tf.contrib's managers work too)." % (argument, manager))


def check_optimizer(optimizer, argument="optimizer"):
    """Raises TypeError unless ``optimizer`` is a plain TF1 optimizer."""
    if not isinstance(optimizer, tf.train.Optimizer):
        raise TypeError(
            "%s must be a tf.compat.v1.train.Optimizer, got %r (%s). Keras "
            "optimizers are not supported in TF1 graph mode; use e.g. "
            "tf.compat.v1.train.AdamOptimizer." % (
                argument, optimizer, type(optimizer).__name__))
    wrappers = [cls.__name__ for cls in type(optimizer).__mro__
                if cls.__name__ in _LOSS_SCALE_WRAPPERS]
    if wrappers:
        raise TypeError(
            "%s is already a loss-scale wrapper (%s), got %r. Loss scaling would "
            "be applied twice; pass the wrapped optimizer itself." % (
                argument, wrappers[0], optimizer))


def check_global_step(global_step):
    """Raises TypeError unless ``global_step`` is None or an integer variable."""
    if global_step is None:
        return
    dtype = getattr(global_step, "dtype", None)
    if not (is_variable(global_step) and dtype.base_dtype.is_integer):
        raise TypeError(
            "global_step must be None or an integer tf.Variable, got %r. Use "
            "tf.train.get_or_create_global_step()." % (global_step,))


def is_variable(value):
    """True for ref and resource variables alike (TF 1.15 and 2.x)."""
    return (isinstance(value, tf.Variable)
            or resource_variable_ops.is_resource_variable(value))


def dense_values(grad):
    """The tensor that holds a gradient's values (IndexedSlices or dense)."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def overflow_check_enabled(manager):
    """Whether the manager wants steps with inf/nan gradients skipped."""
    getter = getattr(manager, "get_enable_overflow_check", None)
    return True if getter is None else bool(getter())


def scale_snapshot(manager):
    """Reads the loss scale once for the step, as float32.

    Every use of the scale in a step goes through this one tensor, so the
    manager's update, which runs after it, cannot change the scale under the
    step's feet. It is a ``Snapshot`` (a copy), not an ``Identity``: with ref
    variables an identity aliases the variable's buffer, which ``Assign``
    overwrites in place.
    """
    scale = tf.convert_to_tensor(manager.get_loss_scale())
    if scale.dtype.base_dtype != tf.float32:
        scale = tf.cast(scale, tf.float32)
    return gen_array_ops.snapshot(scale, name="scale")


def inverse_scale(manager, scale):
    """1/scale, or None when the scale is the constant 1 (no unscale needed)."""
    if getattr(manager, "static_loss_scale", None) == 1.0:
        return None
    return tf.reciprocal(scale, name="inv_scale")


def scale_loss(loss, scale):
    """The loss times the scale, computed in float32."""
    if loss.dtype.base_dtype != tf.float32:
        loss = tf.cast(loss, tf.float32)
    return tf.multiply(loss, scale, name="scaled_loss")


def unscale(grads_and_vars, inv_scale):
    """Multiplies each gradient by the reciprocal scale, in its own dtype.

    Args:
      grads_and_vars: (gradient, variable) pairs, no gradient None.
      inv_scale: float32 scalar, 1/scale; None to leave gradients as they are.

    Returns:
      A list of (gradient, variable) pairs.
    """
    if inv_scale is None:
        return list(grads_and_vars)
    result = []
    for grad, var in grads_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            factor = tf.cast(inv_scale, grad.values.dtype.base_dtype)
            grad = tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
        else:
            grad = grad * tf.cast(inv_scale, grad.dtype.base_dtype)
        result.append((grad, var))
    return result


def overflow_flag(backend, manager, grads, after=()):
    """The float32 overflow flag of ``grads`` (0 = finite), or None when the
    manager disables the check. ``after`` (the losses) orders a status read."""
    if not overflow_check_enabled(manager):
        return None
    return backend.overflow_flag(grads, after=after)


def finite_from(flag, after, name="is_finite"):
    """The bool decision ``flag == 0``, ordered after every tensor in ``after``.

    Anything gated on it therefore runs only once all of the step's gradients
    exist: no group's update can race another group's backprop.
    """
    finite = tf.constant(True) if flag is None else tf.equal(flag, 0.0)
    with tf.control_dependencies([dense_values(t) for t in after]):
        return tf.identity(finite, name=name)


def _clipped(grads_and_vars, clip_norm):
    if clip_norm is None:
        return grads_and_vars
    grads, _ = tf.clip_by_global_norm([g for g, _ in grads_and_vars], clip_norm)
    return list(zip(grads, [v for _, v in grads_and_vars]))


def guarded_apply(is_finite, applies, global_step=None, name="apply_if_finite"):
    """Applies every group under one cond; nothing changes when not finite.

    Args:
      is_finite: bool scalar.
      applies: list of (optimizer, grads_and_vars, name, clip_norm); the
        gradients are clipped by their global norm inside the cond, so only
        on finite steps.
      global_step: a variable advanced by one inside the cond, or None.
      name: the cond's name.

    Returns:
      A bool scalar tensor: True when this run applied the updates.
    """
    def apply_all():
        scope = tf.get_default_graph().get_name_scope()
        # Optimizer state (Adam's beta powers) is named after the name scope
        # current at apply_gradients(). From the root scope it gets the names
        # plain training gives it, so checkpoints stay interchangeable; the
        # update ops still go under this scope through `name`.
        with tf.name_scope(None):
            updates = [optimizer.apply_gradients(
                _clipped(grads_and_vars, clip_norm),
                name="%s/%s" % (scope, group) if scope else group)
                for optimizer, grads_and_vars, group, clip_norm in applies]
        if global_step is not None:
            with tf.control_dependencies(updates):
                updates = [increment(global_step)]
        with tf.control_dependencies(updates):
            return tf.constant(True)

    def skip():
        return tf.constant(False)

    return tf.cond(is_finite, apply_all, skip, name=name)


def increment(global_step, by=None):
    """``global_step += by`` (1 by default, or a bool tensor cast to 0/1)."""
    dtype = global_step.dtype.base_dtype
    amount = tf.ones([], dtype) if by is None else tf.cast(by, dtype)
    return tf.assign_add(global_step, amount).op


def update_manager(manager, is_finite, after):
    """The manager's update, ordered after ``after`` (the step's scale reads)."""
    with tf.control_dependencies(after):
        update = manager.update_loss_scale(is_finite)
    if isinstance(update, tf.Tensor):
        update = update.op
    return update
