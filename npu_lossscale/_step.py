"""The pieces of one loss-scaled step, shared by the builder and
``LossScaleOptimizer``: argument checks, scaling, unscaling, the overflow
decision, the guarded apply and the manager update."""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import gen_array_ops
from tensorflow.python.ops import gen_control_flow_ops
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


def run_if(pred, build, name, data=None):
    """Runs the ops ``build`` makes only on steps where ``pred`` is True.

    Not a ``tf.cond``: a lowered cond puts a ``Switch`` on every tensor its
    branch captures (for an apply: each gradient, each variable and slot
    handle, about four per Adam variable) and runs every branch constant each
    step. Here one ``Switch`` of ``pred`` makes the pivot ``pivot_t``, and
    ``build`` runs under ``control_dependencies([pivot_t])``, which gives the
    pivot as a control input to every op it creates that has no input created
    under it; the others depend on those through their inputs. When ``pred``
    is False the pivot is dead, and the executor skips every op downstream of
    a dead input, control edges included, as it does for a v1 cond's branch
    constants. A v1 cond inside ``build`` switches on a ``pred_id`` made under
    the pivot, and a v2 ``If`` is an op like the others, so they follow too.
    Ops made under ``init_scope`` (slots, beta powers) escape the control
    dependency, as they escape a cond: they are only their initialisers.

    Args:
      pred: bool scalar.
      build: called with the name scope (no trailing "/") under the pivot;
        returns the ops or tensors the result must follow.
      name: the name scope of the Switch (``<name>/switch``), the pivot and
        the result's ``Merge`` (``<name>/merge``).

      data: the tensor switched and returned; ``pred`` if None.

    Returns:
      ``data``'s value, live on every step: on True steps it follows
      everything ``build`` returned.
    """
    with tf.name_scope(name) as scope:
        pred = tf.convert_to_tensor(pred)
        data = pred if data is None else data
        when_false, when_true = gen_control_flow_ops.switch(data, pred, name="switch")
        pivot = tf.identity(when_true, name="pivot_t")
    with tf.control_dependencies([pivot]):
        done = build(scope.rstrip("/"))
        with tf.control_dependencies(done), tf.name_scope(scope):
            ran = tf.identity(pivot, name="ran")
    with tf.name_scope(scope):
        return gen_control_flow_ops.merge([when_false, ran], name="merge")[0]


def guarded_apply(is_finite, applies, global_step=None, name="apply_if_finite"):
    """Applies every group, or nothing at all when not finite (``run_if``).

    Args:
      is_finite: bool scalar.
      applies: list of (optimizer, grads_and_vars, name, clip_norm); the
        gradients are clipped by their global norm on finite steps only.
      global_step: a variable advanced by one on finite steps, or None.
      name: the name scope of the gate.

    Returns:
      A bool scalar tensor: True when this run applied the updates.
    """
    def apply_all(scope):
        # Optimizer state (Adam's beta powers) is named after the name scope
        # current at apply_gradients(). From the root scope it gets the names
        # plain training gives it, so checkpoints stay interchangeable; the
        # update ops still go under this scope through `name`.
        with tf.name_scope(None):
            updates = [optimizer.apply_gradients(
                _clipped(grads_and_vars, clip_norm), name="%s/%s" % (scope, group))
                for optimizer, grads_and_vars, group, clip_norm in applies]
        if global_step is not None:
            with tf.control_dependencies(updates):
                updates = [increment(global_step)]
        return updates

    return run_if(is_finite, apply_all, name)


#: Dense gradients with fewer elements than this that share shape and dtype
#: are unscaled (and checked) as one stacked tensor.
PACK_BELOW_ELEMENTS = 16384


class Packing(object):
    """Small same-shaped dense gradients, stacked once per domain.

    Unscaling k of them then costs three ops (``Pack``, ``Mul``, ``Unpack``;
    ``Unpack`` along axis 0 shares the product's buffer when rows are 64-byte
    aligned) instead of k, and checking them one ``Sum`` of the pack.
    Values are bit-identical: the same elementwise products. Packs never
    cross domains, and a pack is checked as a whole, so a domain must hold
    only gradients that are checked together (one group's, or every checked
    group's under one decision; unchecked ones in a domain of their own).

    Args:
      domains: lists of gradients; each list is packed on its own.
    """

    def __init__(self, domains):
        self._where = {}
        self._packs = []
        self._rows = {}
        for grads in domains:
            same = collections.OrderedDict()
            for grad in grads:
                if isinstance(grad, tf.IndexedSlices) or id(grad) in self._where:
                    continue
                shape = grad.shape
                if (shape.is_fully_defined() and grad.dtype.base_dtype.is_floating
                        and shape.num_elements() < PACK_BELOW_ELEMENTS):
                    same.setdefault((grad.dtype.base_dtype, tuple(shape.as_list())),
                                    []).append(grad)
            for members in same.values():
                if len(members) < 2:
                    continue
                for row, grad in enumerate(members):
                    self._where[id(grad)] = (len(self._packs), row)
                self._packs.append(tf.stack(members, name="packed_grads"))

    def to_check(self, grads):
        """``grads`` with the packed ones replaced by their packs (once each)."""
        result, seen = [], set()
        for grad in grads:
            where = self._where.get(id(grad))
            if where is None:
                result.append(grad)
            elif where[0] not in seen:
                seen.add(where[0])
                result.append(self._packs[where[0]])
        return result

    def unscale(self, grads_and_vars, inv_scale):
        """``unscale``, taking packed gradients from their unscaled pack."""
        if inv_scale is None:
            return list(grads_and_vars)
        result, loose = [], []
        for grad, var in grads_and_vars:
            where = self._where.get(id(grad))
            if where is None:
                loose.append(len(result))
                result.append((grad, var))
            else:
                result.append((self._unscaled(where[0], inv_scale)[where[1]], var))
        for index, pair in zip(loose, unscale([result[i] for i in loose], inv_scale)):
            result[index] = pair
        return result

    def _unscaled(self, index, inv_scale):
        key = (index, id(inv_scale))
        if key not in self._rows:
            pack = self._packs[index]
            product = pack * tf.cast(inv_scale, pack.dtype.base_dtype)
            self._rows[key] = tf.unstack(product, name="unscaled_grads")
        return self._rows[key]


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
