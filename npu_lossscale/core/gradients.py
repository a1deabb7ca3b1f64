"""Phase 1 of the step, the gradients: read each scale once, scale the
losses, backprop once per distinct loss, unscale (small gradients packed), and
clip (applied later, inside the gate)."""

from __future__ import absolute_import, division, print_function

import collections

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale.core import checks as _checks
from npu_lossscale.core import hooks as _hooks
# The scale read, re-exported for the callers that read it from here.
from npu_lossscale.core.scales import SCALE_RANGE, Scale, read_scale

#: Dense gradients with fewer elements than this count as small: those of one
#: shape and dtype are unscaled as one stacked tensor (``Packing``) and read by
#: one reduction per shape (``backends.IsFiniteBackend``). Per-op cost
#: dominates below it, reading cost above it (measured by
#: benchmarks/small_tensor_reads.py).
SMALL_GRADIENT_ELEMENTS = 16384

def finite(tensor):
    """Elementwise: whether a float32 ``tensor`` is finite, without
    ``IsFinite``, which CANN lacks (tf_adapter's docs): NaN differs from
    itself, and inf exceeds float32's largest value."""
    return tf.logical_and(tf.equal(tensor, tensor),
                          tf.less_equal(tf.abs(tensor), np.finfo(np.float32).max))


def dense_values(grad):
    """The tensor that holds a gradient's values (IndexedSlices or dense)."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


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
      scales: the ``scales.read_scales`` result.
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
                with tf.name_scope(first.name), engine.replica_scope(
                        _hooks.group_view(first), index):
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
                 else engine.combine_replicas(_hooks.group_view(group), replicas))
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
      scales: the ``scales.read_scales`` result.
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
                factor = fused.unscale_factor(_hooks.group_view(plan.group(name)), pairs,
                                              inverse)
                scale = scale._replace(inverse=_checked_factor(fused, name, inverse, factor),
                                       is_unit=False)
        result[name] = packing.unscale(pairs, scale)
    return result


def before_transforms(plan, scales, scaled, packing, unscaled):
    """Every group's unscaled pairs before any transform, as the hooks see
    them (``seams.StepState.grads``).

    Args:
      plan: the ``plan.Plan``.
      scales: the ``scales.read_scales`` result.
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
