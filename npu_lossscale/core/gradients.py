"""Phase 1 of the step, the gradients: read each scale once, scale the
losses, backprop once per distinct loss, unscale (small gradients packed), and
clip (applied later, inside the gate)."""

from __future__ import absolute_import, division, print_function

import collections

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale import manager_protocol as _manager_protocol
from npu_lossscale.core import checks as _checks
from npu_lossscale.core import hooks as _hooks

#: Dense gradients with fewer elements than this count as small: those of one
#: shape and dtype are unscaled as one stacked tensor (``Packing``) and read by
#: one reduction per shape (``backends.IsFiniteBackend``). Per-op cost
#: dominates below it, reading cost above it (measured by
#: benchmarks/small_tensor_reads.py).
SMALL_GRADIENT_ELEMENTS = 16384

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


def finite(tensor):
    """Elementwise: whether a float32 ``tensor`` is finite, without
    ``IsFinite``, which CANN lacks (tf_adapter's docs): NaN differs from
    itself, and inf exceeds float32's largest value."""
    return tf.logical_and(tf.equal(tensor, tensor),
                          tf.less_equal(tf.abs(tensor), np.finfo(np.float32).max))


def dense_values(grad):
    """The tensor that holds a gradient's values (IndexedSlices or dense)."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


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


def scale_loss(loss, scale):
    """The loss times the scale, computed in float32."""
    if loss.dtype.base_dtype != tf.float32:
        loss = tf.cast(loss, tf.float32)
    return tf.multiply(loss, scale, name="scaled_loss")


def scaled(loss, scale):
    """The loss to differentiate for ``scale`` (a ``Scale``): the loss itself,
    in its own dtype, when the scale is the constant 1 (no cast, no
    multiply: a bfloat16 loss is differentiated as it is), else
    ``scale_loss``."""
    return loss if scale.is_unit else scale_loss(loss, scale.value)


def seed(loss, scale):
    """The ``grad_ys`` that makes ``tf.gradients(loss, ...)`` the gradients
    of ``scaled(loss, scale)``: the scale in the loss's dtype.

    The same numbers as differentiating ``scale_loss``'s float32 product,
    without it: the product's gradient with respect to the loss is the scale
    (cast to a float16 loss's dtype by the cast's gradient), and the seed
    starts the backprop there. TF's constant seed ``ones_like(loss)`` and
    the product's gradient ops go; a float32 loss takes the scale as it is.

    Args:
      loss: a scalar floating loss (static shape ``[]``).
      scale: the ``Scale``; not ``is_unit`` (the plain loss needs no seed).

    Returns:
      A scalar tensor of the loss's dtype.
    """
    dtype = loss.dtype.base_dtype
    return scale.value if dtype == tf.float32 else tf.cast(scale.value, dtype, name="seed")


def times_inverse(values, inverse):
    """``values * inverse``, exact for every floating dtype: a float16 or
    bfloat16 tensor is multiplied in float32 and cast back, since the
    inverse of a scale above 2**24 is 0 in float16 (below its smallest
    subnormal) and a non-power-of-two inverse loses its low bits in either
    narrow type; float32 and float64 multiply in their own dtype.

    Args:
      values: a floating tensor (a gradient, or a pack of them).
      inverse: float32 scalar, one over the loss scale (or that times a
        fused transform's factor).

    Returns:
      A tensor of ``values``' dtype.
    """
    dtype = values.dtype.base_dtype
    if dtype in (tf.float16, tf.bfloat16):
        return tf.cast(tf.cast(values, tf.float32) * inverse, dtype)
    return values * tf.cast(inverse, dtype)


def unscale(grads_and_vars, scale):
    """Multiplies each gradient by the reciprocal scale (``times_inverse``).

    Args:
      grads_and_vars: (gradient, variable) pairs, no gradient None.
      scale: the ``Scale`` the gradients were computed with.

    Returns:
      A list of (gradient, variable) pairs.
    """
    if scale.is_unit:
        return list(grads_and_vars)
    inv_scale = scale.inverse
    result = []
    for grad, var in grads_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            grad = tf.IndexedSlices(times_inverse(grad.values, inv_scale), grad.indices,
                                    grad.dense_shape)
        else:
            grad = times_inverse(grad, inv_scale)
        result.append((grad, var))
    return result


def scaled_gradients(plan, scales, names, after=()):
    """The scaled (gradient, variable) pairs of the groups called ``names``.

    Each ``plan.Backprop`` serving those groups is computed once per
    replica of its loss (``seams.ReductionEngine.replica_losses``, one
    replica but for in-graph towers): one ``tf.gradients`` over the union of
    its groups' variables, or the group optimizer's own
    ``compute_gradients``, in the engine's ``replica_scope``; the engine
    combines the replicas' pairs. Pairs with a None gradient are dropped.

    Args:
      plan: the ``plan.Plan``.
      scales: the ``read_scales`` result.
      names: the group names to compute; whole backprops only.
      after: ops or tensors every gradient computation must follow.

    Returns:
      Ordered dict from group name to its list of scaled pairs.

    Raises:
      ValueError: if a group gets no gradient at all (possible only through a
        custom ``compute_gradients``; ``add()`` rejects losses that do not
        reach their variables).
    """
    engine = plan.reduction.engine
    scaled_losses = []  # (loss, manager, scaled loss): one product per pair
    seeds = []  # (dtype, manager, seed): one cast per pair
    per_replica = collections.defaultdict(list)  # group name -> one pair list per replica

    def scaled_loss(loss, manager):
        for known_loss, known_manager, product in scaled_losses:
            if known_loss is loss and known_manager is manager:
                return product
        product = scaled(loss, scales[plan.manager_use(manager).name])
        scaled_losses.append((loss, manager, product))
        return product

    def backprop_of(loss, manager, variables, colocate):
        """``tf.gradients`` of the scaled loss: the loss itself seeded with
        the scale where its shape is known to be a scalar; with several
        replicas, each gradient op beside its forward op."""
        scale = scales[plan.manager_use(manager).name]
        if scale.is_unit or loss.shape.ndims != 0:
            return tf.gradients(scaled_loss(loss, manager), variables, gate_gradients=True,
                                colocate_gradients_with_ops=colocate)
        dtype = loss.dtype.base_dtype
        found = [known for known_dtype, known_manager, known in seeds
                 if known_dtype == dtype and known_manager is manager]
        if not found:
            found = [seed(loss, scale)]
            seeds.append((dtype, manager, found[0]))
        return tf.gradients(loss, variables, grad_ys=found[0], gate_gradients=True,
                            colocate_gradients_with_ops=colocate)

    with tf.control_dependencies(list(after)):
        for backprop in plan.backprops:
            if backprop.groups[0] not in names:
                continue
            first = plan.group(backprop.groups[0])
            replicas = _hooks.replica_losses(engine, first)
            for index, loss in enumerate(replicas):
                with tf.name_scope(first.name), engine.replica_scope(first, index):
                    if first.own_backprop:
                        per_replica[first.name].append(first.optimizer.compute_gradients(
                            scaled_loss(loss, first.manager), var_list=list(first.var_list)))
                        continue
                    variables = [var for name in backprop.groups
                                 for var in plan.group(name).var_list]
                    grads = backprop_of(loss, backprop.manager, variables, len(replicas) > 1)
                offset = 0
                for name in backprop.groups:
                    var_list = plan.group(name).var_list
                    per_replica[name].append(
                        list(zip(grads[offset:offset + len(var_list)], var_list)))
                    offset += len(var_list)

    result = collections.OrderedDict()
    for name in names:
        group = plan.group(name)
        replicas = [[(grad, var) for grad, var in pairs if grad is not None]
                    for pairs in per_replica[name]]
        pairs = (replicas[0] if len(replicas) == 1
                 else engine.combine_replicas(group, replicas))
        pairs = [(_summed_duplicates(grad), var) for grad, var in pairs]
        if not pairs:
            raise ValueError(
                "group %r: its optimizer's compute_gradients returned no gradient for its "
                "%d variables. Check its var_list." % (name, len(group.var_list)))
        result[name] = pairs
    return result


def _summed_duplicates(grad):
    """A float16 ``IndexedSlices`` with its duplicate indices summed, in
    float32 and cast back, so that a sum that overflows float16 is an inf
    the check sees; the apply would otherwise sum them after the check.
    Anything else as it is."""
    if not (isinstance(grad, tf.IndexedSlices) and grad.values.dtype.base_dtype == tf.float16):
        return grad
    with tf.name_scope("summed_duplicates"):
        unique, positions = tf.unique(grad.indices)
        summed = tf.unsorted_segment_sum(tf.cast(grad.values, tf.float32), positions,
                                         tf.shape(unique)[0])
        return tf.IndexedSlices(tf.cast(summed, tf.float16), unique, grad.dense_shape)


def means(grads, steps):
    """The mean of summed gradients over ``steps`` micro-batches, each in its
    variable's dtype (an accumulation window's sums are float32).

    Args:
      grads: ordered dict from group name to (sum, variable) pairs.
      steps: the number of micro-batches summed, an int >= 2.

    Returns:
      An ordered dict of the same shape, with the means.
    """
    inverse = 1.0 / steps
    return collections.OrderedDict(
        (name, [(tf.cast(total * inverse, var.dtype.base_dtype), var) for total, var in pairs])
        for name, pairs in grads.items())


class _Row(collections.namedtuple("_Row", ["pack", "row"])):
    """Where a packed gradient sits: pack index and row."""


class Packing(object):
    """Small same-shaped dense gradients, stacked once per domain.

    Unscaling k of them then costs three ops (``Pack``, ``Mul``, ``Unpack``;
    ``Unpack`` along axis 0 shares the product's buffer when rows are 64-byte
    aligned) instead of k, and checking them one ``Sum`` of the pack.
    Values are bit-identical: the same elementwise products. Packs never
    cross domains, and a pack is checked as a whole, so a domain must hold
    only gradients that are checked together and share one scale
    (``domains`` gives them).

    Args:
      domains: lists of gradients; each list is packed on its own.
    """

    def __init__(self, domains):
        self._rows_of = {}  # gradient tensor name -> _Row
        self._packs = []
        self._unscaled_packs = {}  # (pack index, inverse name) -> unstacked rows
        for grads in domains:
            same = collections.OrderedDict()
            for grad in grads:
                if isinstance(grad, tf.IndexedSlices) or grad.name in self._rows_of:
                    continue
                shape = grad.shape
                if (shape.is_fully_defined() and grad.dtype.base_dtype.is_floating
                        and shape.num_elements() < SMALL_GRADIENT_ELEMENTS):
                    same.setdefault((grad.dtype.base_dtype, tuple(shape.as_list())),
                                    []).append(grad)
            for members in same.values():
                if len(members) < 2:
                    continue
                for row, grad in enumerate(members):
                    self._rows_of[grad.name] = _Row(len(self._packs), row)
                self._packs.append(tf.stack(members, name="packed_grads"))

    def _row(self, grad):
        if isinstance(grad, tf.IndexedSlices):
            return None
        return self._rows_of.get(grad.name)

    def to_check(self, grads):
        """``grads`` with the packed ones replaced by their packs (once each)."""
        result, seen = [], set()
        for grad in grads:
            where = self._row(grad)
            if where is None:
                result.append(grad)
            elif where.pack not in seen:
                seen.add(where.pack)
                result.append(self._packs[where.pack])
        return result

    def unscale(self, grads_and_vars, scale):
        """``unscale``, taking packed gradients from their unscaled pack."""
        if scale.is_unit:
            return list(grads_and_vars)
        result, loose = [], []
        for grad, var in grads_and_vars:
            where = self._row(grad)
            if where is None:
                loose.append(len(result))
                result.append((grad, var))
            else:
                result.append((self._unscaled(where.pack, scale.inverse)[where.row], var))
        for index, pair in zip(loose, unscale([result[i] for i in loose], scale)):
            result[index] = pair
        return result

    def _unscaled(self, index, inv_scale):
        key = (index, inv_scale.name)
        if key not in self._unscaled_packs:
            pack = self._packs[index]
            product = times_inverse(pack, inv_scale)
            self._unscaled_packs[key] = tf.unstack(product, name="unscaled_grads")
        return self._unscaled_packs[key]


def pack(plan, scaled):
    """The ``Packing`` of a step's scaled gradients.

    A domain is the groups of one check that share one manager (unchecked
    groups: per manager), so a pack is checked as a whole and unscaled by one
    scale.

    Args:
      plan: the ``plan.Plan``.
      scaled: ordered dict from group name to scaled pairs.

    Returns:
      A ``Packing``.
    """
    domains = collections.OrderedDict()
    for name in scaled:
        key = (plan.check_of(name), plan.manager_use(plan.group(name).manager).name)
        domains.setdefault(key, []).extend(grad for grad, _ in scaled[name])
    return Packing(list(domains.values()))


def unscale_all(plan, scales, scaled, packing):
    """Every group's unscaled pairs, in the variable's dtype, a group's
    ``fused_transform`` applied in the unscale's multiply: the pairs the
    step goes on with.

    Args:
      plan: the ``plan.Plan``.
      scales: the ``read_scales`` result.
      scaled: ordered dict from group name to scaled pairs.
      packing: the step's ``Packing``.

    Returns:
      Ordered dict from group name to unscaled pairs.
    """
    result = collections.OrderedDict()
    for name, pairs in scaled.items():
        scale = scales[plan.manager_use(plan.group(name).manager).name]
        fused = fused_transform(plan, name)
        if fused is not None:
            with tf.name_scope("%s/%s" % (name, fused.name)):
                inverse = tf.ones([]) if scale.is_unit else scale.inverse
                scale = scale._replace(inverse=_checked_factor(
                    fused, name, inverse, fused.unscale_factor(plan.group(name), pairs, inverse)),
                                       is_unit=False)
        result[name] = packing.unscale(pairs, scale)
    return result


def before_transforms(plan, scales, scaled, packing, unscaled):
    """Every group's unscaled pairs before any transform, as the hooks see
    them (``seams.StepState.grads``).

    Args:
      plan: the ``plan.Plan``.
      scales: the ``read_scales`` result.
      scaled: ordered dict from group name to scaled pairs.
      packing: the step's ``Packing``.
      unscaled: the ``unscale_all`` result.

    Returns:
      Ordered dict from group name to pairs: ``unscaled``'s own where no
      transform is fused, else the plain unscale, a multiply of its own
      that runs only where a hook or a fetch reads it.
    """
    result = collections.OrderedDict()
    for name, pairs in unscaled.items():
        if fused_transform(plan, name) is not None:
            with tf.name_scope("%s/before_transforms" % name):
                pairs = packing.unscale(
                    scaled[name], scales[plan.manager_use(plan.group(name).manager).name])
        result[name] = pairs
    return result


def _checked_factor(transform, group_name, inverse, factor):
    """``factor``, refused unless a float32 scalar tensor computed from
    ``inverse`` (a factor that left it out would apply scaled gradients).

    Raises:
      TypeError: for anything but a float32 scalar tensor.
      ValueError: for one that does not derive from ``inverse``.
    """
    if not (isinstance(factor, tf.Tensor) and factor.dtype == tf.float32
            and factor.shape.ndims == 0):
        raise TypeError("group %r: %s.unscale_factor returned %r; return a float32 scalar "
                        "tensor, inverse times the transform's factor."
                        % (group_name, transform.name, factor))
    if not _checks.computed_from(factor, inverse.op):
        raise ValueError("group %r: %s.unscale_factor returned %r, which is not computed from "
                         "inverse (one over the loss scale): the step would apply scaled "
                         "gradients. Return inverse * factor." % (group_name, transform.name,
                                                                   factor))
    return factor


def fused_transform(plan, name):
    """The transform of group ``name`` that the unscale applies in its own
    multiply, or None: its only transform, when it overrides
    ``GradientTransform.unscale_factor`` (a clip by the global norm does) and
    the unscaled gradients are the ones applied (no accumulation window,
    no reduction of the gradients across workers)."""
    transforms = plan.group(name).transforms
    if (len(transforms) != 1 or not transforms[0].fuses_with_unscale()
            or plan.window.steps > 1 or not plan.reduction.applies_here
            or (plan.reduction.active and plan.reduction.allreduce_gradients)):
        return None
    return transforms[0]
