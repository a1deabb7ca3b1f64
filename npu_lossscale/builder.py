"""One loss-scaled, overflow-checked update op for several optimizers.

The steps a user takes::

  scaler = MultiOptimizerLossScale(DynamicLossScaleManager())
  scaler.add(d_loss, d_opt, var_list=d_vars, name="discriminator")
  scaler.add(g_loss, g_opt, var_list=g_vars, name="generator")
  train = scaler.build(global_step=tf.train.get_or_create_global_step())
  sess.run({"train": train.update_op, "finite": train.is_finite, ...})

What ``build`` puts in the graph, under the name scope ``loss_scale/``:

1. one snapshot of the loss scale for the step;
2. the scaled gradients of every group (backprop once per distinct loss);
3. one overflow decision for all groups, through one float-status read;
4. the unscaled gradients, in each variable's dtype;
5. one ``cond``: on a finite step every group's ``apply_gradients`` and the
   global-step increment, on an overflow nothing at all;
6. the manager's update, fed with this step's decision.
"""

from __future__ import absolute_import, division, print_function

import collections
import re

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import gen_array_ops
from tensorflow.python.ops import resource_variable_ops

from npu_lossscale import _validation
from npu_lossscale import backends as _backends


class TrainOps(collections.namedtuple(
        "TrainOps", ["update_op", "is_finite", "loss_scale", "grads_and_vars"])):
    """What ``MultiOptimizerLossScale.build`` returns.

    Attributes:
      update_op: the single op to run each step, in place of the per-optimizer
        ``minimize`` ops. It applies every group (or none) and updates the
        loss scale.
      is_finite: bool scalar tensor, this step's overflow decision. Fetch it
        in the same ``session.run`` as ``update_op``.
      loss_scale: float32 scalar tensor, the scale used for this step (before
        the manager's update).
      grads_and_vars: dict from group name to the list of unscaled
        ``(gradient, variable)`` pairs of that group.
    """


_Group = collections.namedtuple("_Group", ["name", "loss", "optimizer", "var_list"])

_GROUP_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\-]*$")
_LOSS_SCALE_WRAPPERS = ("LossScaleOptimizer", "NPULossScaleOptimizer",
                        "MixedPrecisionLossScaleOptimizer")


# ---------------------------------------------------------------------------
# The machinery shared with LossScaleOptimizer.
# ---------------------------------------------------------------------------

def check_manager(manager):
    """Raises TypeError unless ``manager`` follows the loss-scale protocol."""
    if not (callable(getattr(manager, "get_loss_scale", None))
            and callable(getattr(manager, "update_loss_scale", None))):
        raise TypeError(
            "loss_scale_manager must have get_loss_scale() and "
            "update_loss_scale(finite_grads) methods, got %r. Pass a "
            "DynamicLossScaleManager, ExponentialUpdateLossScaleManager or "
            "FixedLossScaleManager (npu_bridge's and tf.contrib's managers work too)."
            % (manager,))


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


def static_scale(manager):
    """The scale as a Python float when it is a known constant, else None."""
    return getattr(manager, "static_loss_scale", None)


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


def decide(backend, manager, grads):
    """One overflow decision for the step.

    The returned bool is ordered after every gradient, so any update gated on
    it runs only once all gradients of all groups exist.

    Args:
      backend: an object with ``overflow_flag(tensors)``.
      manager: the loss-scale manager (its overflow-check flag is honoured).
      grads: every gradient of the step.

    Returns:
      (is_finite, overflow_flag): a bool scalar and the float32 flag (None when
      the manager disables the check).
    """
    deps = [grad.values if isinstance(grad, tf.IndexedSlices) else grad for grad in grads]
    if overflow_check_enabled(manager):
        flag = backend.overflow_flag(grads)
        finite = tf.equal(flag, 0.0)
    else:
        flag = None
        finite = tf.constant(True)
    with tf.control_dependencies(deps):
        return tf.identity(finite, name="is_finite"), flag


def guarded_apply(is_finite, applies, global_step):
    """Applies every (optimizer, grads_and_vars, name) under one cond.

    Args:
      is_finite: bool scalar; nothing changes when it is False.
      applies: list of (optimizer, grads_and_vars, name).
      global_step: a variable incremented by one per applied step, or None.

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
                grads_and_vars, name="%s/%s" % (scope, name) if scope else name)
                for optimizer, grads_and_vars, name in applies]
        if global_step is not None:
            with tf.control_dependencies(updates):
                updates = [tf.assign_add(global_step, tf.ones([], global_step.dtype.base_dtype))]
        with tf.control_dependencies(updates):
            return tf.constant(True)

    def skip():
        return tf.constant(False)

    return tf.cond(is_finite, apply_all, skip, name="apply_if_finite")


def update_manager(manager, is_finite, after):
    """The manager's update, ordered after ``after`` (the step's scale reads)."""
    with tf.control_dependencies(after):
        update = manager.update_loss_scale(is_finite)
    if isinstance(update, tf.Tensor):
        update = update.op
    return update


def check_global_step(global_step):
    """Raises TypeError unless ``global_step`` is None or an integer variable."""
    if global_step is None:
        return
    dtype = getattr(global_step, "dtype", None)
    if not (hasattr(global_step, "assign_add") and dtype is not None
            and dtype.base_dtype.is_integer):
        raise TypeError(
            "global_step must be None or an integer tf.Variable, got %r. Use "
            "tf.train.get_or_create_global_step()." % (global_step,))


# ---------------------------------------------------------------------------
# The builder.
# ---------------------------------------------------------------------------

def _default_var_list():
    return (tf.trainable_variables()
            + tf.get_collection(tf.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))


def is_variable(value):
    """True for ref and resource variables alike (TF 1.15 and 2.x)."""
    return (isinstance(value, tf.Variable)
            or resource_variable_ops.is_resource_variable(value))


def _uses_default_compute_gradients(optimizer):
    return type(optimizer).compute_gradients is tf.train.Optimizer.compute_gradients


class MultiOptimizerLossScale(object):
    """Loss scaling for several optimizers, with one decision per step.

    Each ``add`` registers a group: a loss, its optimizer and its variables.
    ``build`` returns one update op that computes every group's scaled
    gradients, checks them for overflow once, and applies all groups or none
    under a single ``cond``. The loss scale, the skip decision and the global
    step are shared by all groups.

    Example::

      scaler = MultiOptimizerLossScale(DynamicLossScaleManager())
      scaler.add(d_loss, tf.train.AdamOptimizer(2e-4), var_list=d_vars, name="d")
      scaler.add(g_loss, tf.train.AdamOptimizer(2e-4), var_list=g_vars, name="g")
      train = scaler.build(global_step=tf.train.get_or_create_global_step())
      sess.run(train.update_op)

    Args:
      loss_scale_manager: any object with ``get_loss_scale()`` and
        ``update_loss_scale(finite)``: this package's managers, npu_bridge's or
        tf.contrib's.
      backend: "auto" (npu when ``npu_bridge`` imports, else is_finite),
        "is_finite" (CPU/GPU) or "npu" (Ascend float-status register).

    Raises:
      TypeError: if the manager lacks the protocol.
      ValueError: for an unknown backend, "npu" without npu_bridge, or eager mode.
    """

    def __init__(self, loss_scale_manager, backend="auto"):
        _validation.require_graph_mode("MultiOptimizerLossScale")
        check_manager(loss_scale_manager)
        self._manager = loss_scale_manager
        self._backend = _backends.resolve_backend(backend)
        self._groups = []
        self._built = False

    @property
    def backend(self):
        """The resolved backend's name: "is_finite" or "npu"."""
        return self._backend.name

    def add(self, loss, optimizer, var_list=None, name=None):
        """Registers a group: a loss minimised by an optimizer over variables.

        Args:
          loss: a floating-point scalar tensor (float16 is fine).
          optimizer: a ``tf.compat.v1.train.Optimizer``, not shared with
            another group and not already loss-scale wrapped.
          var_list: the variables this optimizer updates; defaults to every
            trainable variable (only sensible with a single group).
          name: the group's name (a valid name scope); defaults to
            ``group_<index>``. Keys ``TrainOps.grads_and_vars``.

        Returns:
          The group's name.

        Raises:
          TypeError: for a non-tensor or non-float loss, or a wrong optimizer.
          ValueError: for a non-scalar loss, an empty var_list, a variable or
            optimizer already in another group, a duplicate or invalid name,
            or a call after ``build()``.
        """
        if self._built:
            raise ValueError(
                "add() was called after build(), for loss %r. Register every "
                "group with add() first, then call build() once." % (loss,))
        loss = self._check_loss(loss)
        check_optimizer(optimizer)
        name = self._check_name(name)
        for group in self._groups:
            if group.optimizer is optimizer:
                raise ValueError(
                    "optimizer %r is already used by group %r. Each group needs its "
                    "own optimizer instance (its slots belong to its variables); "
                    "create a second one." % (optimizer, group.name))
        var_list = self._check_var_list(var_list, name)
        self._groups.append(_Group(name, loss, optimizer, var_list))
        return name

    def _check_loss(self, loss):
        if not isinstance(loss, tf.Tensor):
            raise TypeError(
                "loss must be a tf.Tensor, got %r (%s). Pass the scalar loss "
                "tensor of the graph." % (loss, type(loss).__name__))
        if not loss.dtype.base_dtype.is_floating:
            raise TypeError(
                "loss must be a floating-point tensor, got %r with dtype %s. Cast "
                "it with tf.cast(loss, tf.float32)." % (loss, loss.dtype.name))
        if loss.shape.ndims is not None and loss.shape.ndims != 0:
            raise ValueError(
                "loss must be a scalar, got %r with shape %s. Reduce it first, "
                "e.g. tf.reduce_mean(loss)." % (loss, loss.shape))
        if loss.graph is not tf.get_default_graph():
            raise ValueError(
                "loss %r belongs to another graph than the default one. Call "
                "add() inside the graph's `with graph.as_default():` block." % (loss,))
        return loss

    def _check_name(self, name):
        if name is None:
            name = "group_%d" % len(self._groups)
        if not isinstance(name, str) or not _GROUP_NAME.match(name):
            raise ValueError(
                "name must be a string usable as a TF name scope (letters, digits, "
                "'_', '.', '-'), got %r. Pass e.g. name='generator'." % (name,))
        if any(group.name == name for group in self._groups):
            raise ValueError(
                "name %r is already used by another group. Give each group a "
                "unique name." % (name,))
        return name

    def _check_var_list(self, var_list, name):
        if var_list is None:
            var_list = _default_var_list()
        elif is_variable(var_list) or isinstance(var_list, tf.Tensor):
            raise TypeError(
                "var_list must be a list of variables, got the single %r. Wrap it "
                "in a list: var_list=[v]." % (var_list,))
        var_list = list(var_list)
        if not var_list:
            raise ValueError(
                "var_list for group %r is empty, got %r. Pass the variables this "
                "optimizer trains (e.g. tf.trainable_variables('generator'))."
                % (name, var_list))
        seen = set()
        for var in var_list:
            if not is_variable(var):
                raise TypeError(
                    "var_list for group %r must hold tf.Variable objects, got %r. "
                    "Pass variables, not tensors read from them." % (name, var))
            if id(var) in seen:
                raise ValueError(
                    "var_list for group %r lists variable %r twice. Pass each "
                    "variable once." % (name, var.name))
            seen.add(id(var))
            for group in self._groups:
                if any(other is var for other in group.var_list):
                    raise ValueError(
                        "variable %r is in group %r and again in group %r. A "
                        "variable can be updated by one optimizer only; split "
                        "the var_lists." % (var.name, group.name, name))
        return var_list

    def build(self, global_step=None):
        """Builds the single update op for every registered group.

        Args:
          global_step: an integer variable advanced by exactly one per applied
            step (never on a skipped step), or None.

        Returns:
          A ``TrainOps``.

        Raises:
          ValueError: if called twice, with no groups, in eager mode, or when a
            group's loss reaches none of its variables.
          TypeError: for a global_step that is not an integer variable.
        """
        _validation.require_graph_mode("MultiOptimizerLossScale.build")
        if self._built:
            raise ValueError(
                "build() was already called on this MultiOptimizerLossScale. It "
                "returns the one update op for all groups; reuse the TrainOps it "
                "returned instead of building again.")
        if not self._groups:
            raise ValueError(
                "build() was called with no groups. Call add(loss, optimizer, "
                "var_list) for each optimizer first.")
        check_global_step(global_step)
        self._built = True

        with tf.name_scope("loss_scale"):
            scale = scale_snapshot(self._manager)
            fixed = static_scale(self._manager)
            inv_scale = None if fixed == 1.0 else tf.reciprocal(scale, name="inv_scale")
            scaled = self._scaled_gradients(scale)
            all_grads = [grad for pairs in scaled.values() for grad, _ in pairs]
            is_finite, _ = decide(self._backend, self._manager, all_grads)
            grads_and_vars = collections.OrderedDict(
                (name, unscale(pairs, inv_scale)) for name, pairs in scaled.items())
            applied = guarded_apply(
                is_finite,
                [(group.optimizer, grads_and_vars[group.name], group.name)
                 for group in self._groups],
                global_step)
            update = update_manager(self._manager, is_finite, [applied, scale])
            update_op = tf.group(applied.op, update, name="update")
        return TrainOps(update_op=update_op, is_finite=is_finite, loss_scale=scale,
                        grads_and_vars=dict(grads_and_vars))

    def _scaled_gradients(self, scale):
        """Scaled (gradient, variable) pairs per group, None gradients dropped.

        Groups that share a loss tensor and use the stock
        ``Optimizer.compute_gradients`` share one backprop over the union of
        their variables. An optimizer that overrides ``compute_gradients``
        (Horovod's DistributedOptimizer, for one) gets its own call.
        """
        # Keyed by id(): graph tensors are not hashable in every TF version.
        scaled_losses = {}
        shared = collections.OrderedDict()
        for group in self._groups:
            if _uses_default_compute_gradients(group.optimizer):
                shared.setdefault(id(group.loss), []).append(group)

        def scaled_loss_of(group):
            if id(group.loss) not in scaled_losses:
                scaled_losses[id(group.loss)] = scale_loss(group.loss, scale)
            return scaled_losses[id(group.loss)]

        raw = {}
        for groups in shared.values():
            with tf.name_scope(groups[0].name):
                variables = [var for group in groups for var in group.var_list]
                grads = tf.gradients(scaled_loss_of(groups[0]), variables,
                                     gate_gradients=True)
            offset = 0
            for group in groups:
                count = len(group.var_list)
                raw[group.name] = list(zip(grads[offset:offset + count], group.var_list))
                offset += count

        result = collections.OrderedDict()
        for group in self._groups:
            if group.name not in raw:
                with tf.name_scope(group.name):
                    raw[group.name] = group.optimizer.compute_gradients(
                        scaled_loss_of(group), var_list=group.var_list)
            pairs = [(grad, var) for grad, var in raw[group.name] if grad is not None]
            if not pairs:
                raise ValueError(
                    "group %r: its loss %r reaches none of its %d variables (every "
                    "gradient is None). Check var_list, or that the loss depends on "
                    "those variables." % (group.name, group.loss, len(group.var_list)))
            result[group.name] = pairs
        return result
