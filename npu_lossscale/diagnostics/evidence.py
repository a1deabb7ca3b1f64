"""What the skip branch inspects (``Evidence``, ``evidence_of``), and what it
computes from it: the losses' values, their heads copied into the branch
(``LossHeads``), and for each loss and gradient whether it overflowed
(``bad_entries``).
"""

from __future__ import absolute_import, division, print_function

import collections

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals
from npu_lossscale import plugin_helpers as _helpers
# float16's largest finite value: the image of +-inf in saturation mode.
from npu_lossscale.manager_protocol import FLOAT16_MAX


class LossHeads(object):
    """The losses as a skip branch reads them, computed there.

    A loss's own value is often not computed by the step: TF runs only what
    the fetched ops need, and the backprop needs little of the loss head
    (not a ``Mean``'s output, not an ``L2Loss``: its gradient is the weight).
    Read as it is, the loss would make every step compute its head. So the
    head's ops that the backprop does not need are copied into the branch,
    where they run only when it does. The backprop needs the data ancestors
    of the gradients, short of shape-only ops (``Shape``, ``Size``, which TF
    folds where the shape is static): a loss that TF computes anyway all the
    same is only computed twice on skipped steps. Ops that cannot be copied
    (graph inputs, stateful ops, control flow, function calls) are read as
    they are, and the copies leave out control inputs. On a register backend
    every read follows the losses (``overflow.flags``): they are computed
    anyway, and read as they are.

    Args:
      evidence: the ``Evidence``.
    """

    def __init__(self, evidence):
        self._computed = None  # None: every op is computed anyway
        if evidence.losses and not evidence.saturation:
            roots = [_helpers.dense_values(grad).op for pairs in evidence.grads.values()
                     for grad, _ in pairs]
            self._computed = _helpers.reachable(
                roots, _helpers.data_inputs, stop=lambda op: op.type in _SHAPE_TYPES)
        # On the original's device; its colocation is the original's own.
        self._copies = _helpers.Copies(on_device=True)

    def value(self, loss):
        """``loss``'s value, the head the backprop does not need copied here."""
        def new(op):
            return op not in self._copies and self._copied(op)

        head = [op for op in _helpers.depth_first(
            [loss.op], _helpers.data_inputs, stop=lambda op: not new(op)) if new(op)]
        members = set(head)
        self._copies.copy(_helpers.topological(
            head, lambda op: [parent for parent in _helpers.data_inputs(op)
                              if parent in members]))
        return self._copies.tensor(loss)

    def _copied(self, op):
        """Whether ``op`` is copied: not needed by the backprop, and copyable
        (a variable's read is not: it costs nothing, and stays by its
        variable)."""
        return (self._computed is not None and op not in self._computed and op.inputs
                and not any(t.dtype.base_dtype != t.dtype or t.dtype == tf.resource
                            for t in op.inputs)
                and op.type not in _helpers.FEEDABLE_TYPES
                and op.type not in _helpers.CONTROL_FLOW_TYPES
                and op.type not in _helpers.FUNCTION_CALL_TYPES
                and op.type not in _SHAPE_TYPES
                and not op.op_def.is_stateful
                and _tf_internals.control_flow_context(op) is None)


#: Ops that read only their input's shape.
_SHAPE_TYPES = frozenset(["Shape", "ShapeN", "Size", "Rank"])


def bad_entries(tensors, saturation, terms_from=None):
    """One bool per tensor: whether it holds a value that overflowed.

    A tensor overflowed when its float32 sum is not finite (an inf or a NaN
    makes it so; for a float32 tensor also a finite sum beyond float32, as
    in ``backends.IsFiniteBackend``), and with ``saturation`` also when its
    largest magnitude is exactly 65504 or its dtype's largest value (a
    saturated float16 value, also cast to float32, in a tensor that holds
    no larger one).
    Small tensors of one shape and dtype are stacked and reduced row by row:
    a handful of ops per shape, not per tensor.

    With ``saturation``, a gradient (an entry from ``terms_from`` on) also
    overflowed when one of the terms it sums did (``summed_terms``): a
    variable used more than once gets the sum of its uses' gradients, and a
    saturated term added to the others leaves no mark on the sum. The terms
    are read only here, in the skip branch; until the gate decides they are
    held as the gradients are.

    With the register, no ``IsFinite`` op: CANN does not support
    ``tf.is_finite`` (tf_adapter's docs; npu_bridge's managers test with
    ``less`` instead). There a sum is non-finite when it differs from itself
    (NaN) or its magnitude exceeds float32's largest (inf).

    Args:
      tensors: tensors or ``tf.IndexedSlices`` (their values are read).
      saturation: whether the register backend reads the step.
      terms_from: the index of the first gradient among ``tensors`` (the
        entries before it are losses); None: no entry is a gradient.

    Returns:
      A bool vector, one entry per tensor, in their order.
    """
    owners = list(range(len(tensors)))
    if saturation and terms_from is not None:
        expanded = list(tensors)
        for index in range(terms_from, len(tensors)):
            for term in summed_terms(tensors[index]):
                expanded.append(term)
                owners.append(index)
        if len(expanded) > len(tensors):
            bad = _bad_entries(expanded, saturation)
            membership = np.array([[owner == index for owner in owners]
                                   for index in range(len(tensors))])
            return tf.reduce_any(tf.logical_and(bad[None, :], membership), axis=1)
    return _bad_entries(tensors, saturation)


#: Ops whose output is the sum of their inputs, as ``tf.gradients`` sums the
#: gradients of a tensor's uses (``AddN``; ``Add``/``AddV2`` with a tree
#: aggregation method).
_SUM_TYPES = frozenset(["AddN", "Add", "AddV2"])
#: Ops a gradient passes through unchanged in value (``gate_gradients``'
#: tuples; the cast of a float16 gradient to its float32 variable).
_PASS_TYPES = frozenset(["Identity", "Cast"])


def summed_terms(gradient):
    """The terms of the sum behind ``gradient``: the inputs of the
    ``AddN``/``Add`` that makes it (through ``Identity`` and ``Cast``), and
    of the sums among them, in turn.

    Args:
      gradient: a tensor or ``tf.IndexedSlices`` (no terms: its rows are
        concatenated, not summed).

    Returns:
      A list of tensors; empty when no sum is behind ``gradient``.
    """
    if not isinstance(gradient, tf.Tensor):
        return []

    def source(tensor):
        while tensor.op.type in _PASS_TYPES and tensor.op.inputs:
            tensor = tensor.op.inputs[0]
        return tensor

    terms, pending = [], [gradient]
    while pending:
        tensor = pending.pop()
        made = source(tensor)
        if made.op.type in _SUM_TYPES:
            pending.extend(reversed(list(made.op.inputs)))
        elif tensor is not gradient:
            terms.append(tensor)
    return terms


def _bad_entries(tensors, saturation):
    """``bad_entries`` of the tensors themselves."""
    if not tensors:
        return tf.zeros([0], tf.bool)
    sums, maxes, limits, order = [], [], [], []
    small, single = collections.OrderedDict(), []
    for index, tensor in enumerate(tensors):
        values = _helpers.dense_values(tensor)
        shape = values.shape
        if shape.is_fully_defined() and shape.num_elements() < _helpers.SMALL_GRADIENT_ELEMENTS:
            small.setdefault((values.dtype.base_dtype, tuple(shape.as_list())), []).append(
                (index, values))
        else:
            single.append((index, values))
    for (dtype, _), members in small.items():
        if len(members) == 1:
            single.extend(members)
            continue
        rows = tf.reshape(_float32(tf.stack([values for _, values in members])),
                          [len(members), -1])
        order.extend(index for index, _ in members)
        sums.append(tf.reduce_sum(rows, axis=1))
        if saturation:
            maxes.append(tf.reduce_max(tf.abs(rows), axis=1))
            limits.extend([float(dtype.max)] * len(members))
    if single:
        order.extend(index for index, _ in single)
        wides = [_float32(values) for _, values in single]
        sums.append(tf.stack([tf.reduce_sum(wide) for wide in wides]))
        if saturation:
            maxes.append(tf.stack([tf.reduce_max(tf.abs(wide)) for wide in wides]))
            limits.extend(float(values.dtype.base_dtype.max) for _, values in single)
    total = sums[0] if len(sums) == 1 else tf.concat(sums, 0)
    if saturation:
        largest = maxes[0] if len(maxes) == 1 else tf.concat(maxes, 0)
        bad = tf.reduce_any(tf.stack([
            tf.not_equal(total, total), tf.greater(tf.abs(total), _FLOAT32_MAX),
            tf.equal(largest, FLOAT16_MAX), tf.equal(largest, limits)]), axis=0)
    else:
        bad = tf.logical_not(tf.is_finite(total))
    if order == list(range(len(tensors))):
        return bad
    where = dict((index, position) for position, index in enumerate(order))
    return tf.gather(bad, [where[index] for index in range(len(tensors))])


def _float32(tensor):
    return tensor if tensor.dtype.base_dtype == tf.float32 else tf.cast(tensor, tf.float32)


#: float32's largest finite value: a magnitude above it (inf), or none
#: (NaN), is not finite.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class Evidence(collections.namedtuple("Evidence", ["losses", "grads", "saturation",
                                                   "loss_flags", "transformed"],
                                      defaults=(None, None))):
    """What the skip branch inspects.

    Attributes:
      losses: ordered dict from group name to the group's loss, before any
        scaling (empty when the step has none at hand: an accumulation
        window, or given gradients).
      grads: ordered dict from group name to the (gradient, variable) pairs
        to inspect on this worker: the unscaled gradients (the scaled ones
        on a register backend), or an accumulation
        window's float32 sums.
      saturation: whether a value of exactly +-65504 (or its dtype's
        largest) counts as overflowed: the gradients of a run read by a
        float-status register, which saturates.
      loss_flags: where the losses are not at hand (an accumulation
        window), ordered dict from group name to the count of micro-batches
        whose loss was not finite; None otherwise.
      transformed: ordered dict from group name to the pairs its transforms
        returned, for the groups whose transforms may not keep finite
        values (``seams.CloseView.transformed``); None when unknown.
    """


def evidence_of(plan, scaled):
    """The ``Evidence`` of a run that closes its own step.

    Args:
      plan: the ``seams.PlanView``.
      scaled: ordered dict from group name to the pairs to inspect (the
        ``Evidence.grads``).

    Returns:
      An ``Evidence``.
    """
    losses = collections.OrderedDict(
        (group.name, group.loss) for group in plan.groups if group.loss is not None)
    return Evidence(losses, scaled, plan.backend.reads_register)
