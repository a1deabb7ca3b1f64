"""The underflow measurement: how much of each group's gradient float16
flushes to zero at the scale in use, how much is subnormal, and how much
headroom the scale leaves below float16's largest value.

Two sides are compared, element by element:

* the **float16 side**: the step's scaled gradients, as the float16 backprop
  produced them (for float32 master weights, the float16 values cast to
  float32 at the weights' ``Cast``);
* the **float32 view**: the gradient of the same loss through a float32 copy
  of its forward graph, unscaled (``float32_view``): the gradient the graph
  would give if it computed in float32. It exists only where the model keeps
  float32 variables (master weights).

The measurement is built on demand: ``MultiOptimizerLossScale.build(
measure_underflow=True)`` gives ``TrainOps.underflow`` (ops the user fetches,
every N steps: nothing runs while they are not fetched), and a manager that
listens (``managers.base.listens_to_underflow``) gets one behind a gate that
opens on the runs it asks for (``listen``). Either way it runs after the
step's overflow check, so its float32 ops never reach a float-status
register read.
"""

from __future__ import absolute_import, division, print_function

import collections

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale import manager_protocol as _manager_protocol
from npu_lossscale import seams as _seams
from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.underflow.float32_view import Float32View, check_float32_view

__all__ = ["FLOAT16_MAX", "FLOAT16_MIN_NORMAL", "RAISE_BITS", "Underflow", "Measurement",
           "Hearing", "combine", "measure_first_scale", "measure_underflow", "summaries"]

#: float16's largest finite value (IEEE 754 binary16), the top of the
#: headroom (``managers.base.FLOAT16_MAX``).
FLOAT16_MAX = _manager_protocol.FLOAT16_MAX
#: float16's smallest normal value, 2**-14: below it a float16 value is
#: subnormal and keeps fewer than its 11 significant bits.
FLOAT16_MIN_NORMAL = 2.0 ** -14
#: ``Underflow.underflow_by_raise`` predicts the underflow share at the
#: scale times 2**k for k = 0 .. RAISE_BITS (the scale range's 2**-126 to
#: 2**126 is 252 bits wide; 64 is as far as a raise ever needs to look).
RAISE_BITS = 64
# The float32 view's non-zero elements are counted by binary exponent: bin
# i holds the |g| in [2**(i - 160), 2**(i - 159)), from below float32's
# smallest subnormal (2**-149) to 2**31 and beyond in the last bin.
_EXPONENT_OFFSET = 160
_EXPONENT_BINS = 192


class Underflow(collections.namedtuple(
        "Underflow", ["flushed_share", "subnormal_share", "headroom", "zero_share",
                      "float32_zero_share", "max_abs", "float32_max_abs", "scale",
                      "elements", "zeros", "float32_zeros", "flushed", "subnormal",
                      "underflow_by_raise"])):
    """One group's underflow measurement, for one run (float32 scalars).

    Fetch it every N steps, with ``update_op`` (the run's own gradients) or
    alone (the gradients at the current scale, nothing applied). Fetched,
    each field is a number.

    Attributes:
      flushed_share: of the gradient elements that are non-zero in the
        float32 view, the share that is zero on the float16 side at this
        scale: what float16 flushed. 0 when the view has no non-zero
        element.
      subnormal_share: of the same elements, the share whose value on the
        float16 side is subnormal (0 < |g| < 2**-14): kept, with fewer than
        float16's 11 significant bits. ``flushed_share + subnormal_share``
        is the share of them that underflowed.
      headroom: ``log2(65504 / max(max_abs, scale * float32_max_abs))``:
        how many powers of two the scale could grow before the float16
        backprop overflows, by what the step read and by what the float32
        view says every float16 tensor of the backprop holds at this scale;
        inf when all of it is zero, -inf when a gradient overflowed (inf,
        NaN, or beyond 65504).
      zero_share: the share of all elements that are zero on the float16
        side (true zeros and flushed ones).
      float32_zero_share: the share of all elements that are zero in the
        float32 view (true zeros: dead units, unused rows).
      max_abs: the largest |g| on the float16 side, scaled, and, for a
        float16 loss, the loss's own gradient (the scale itself, which the
        backprop casts to float16 first).
      float32_max_abs: the largest |gradient| of the float32 view,
        unscaled: over the variables' gradients and those of every tensor
        the forward pass computes in float16 (which the float16 backprop
        holds, times the scale).
      scale: the loss scale the float16 side was computed at.
      elements: the number of gradient elements (an IndexedSlices counts
        its rows).
      zeros, float32_zeros, flushed, subnormal: the counts behind the
        shares (float32: exact up to 2**24 each).
      underflow_by_raise: float32[RAISE_BITS + 1]; element k is the share of
        the float32 view's non-zero elements that would be below 2**-14
        (flushed or subnormal) at ``scale * 2**k``, by their binary
        exponents. Element 0 estimates ``flushed_share + subnormal_share``
        from the float32 side alone (the float16 backprop may flush more on
        its way); the first element at most 1 % says how far to raise.
    """


def check_measurable(plan, measure_underflow):
    """The build-time check of every group the step will measure.

    Args:
      plan: the step's ``seams.PlanView``.
      measure_underflow: whether ``TrainOps.underflow`` is asked for (every
        group); otherwise only the groups of listening managers are measured.

    Raises:
      ValueError: as ``check_float32_view``.
    """
    for group in plan.groups:
        if group.loss is None:
            continue
        if measure_underflow:
            check_float32_view(group.loss, group.var_list, group.name,
                               "measure_underflow=%r" % (measure_underflow,),
                               "Build with measure_underflow=False.")
        elif _manager_protocol.listens_to_underflow(group.manager):
            check_float32_view(group.loss, group.var_list, group.name,
                               type(group.manager).__name__,
                               "Use a DynamicLossScaleManager instead.")


def measure(plan, scales, scaled, names, after=()):
    """Each named group's ``Underflow``, built in the current context.

    Args:
      plan: the ``seams.PlanView``.
      scales: ordered dict from group name to its float32 loss scale
        (``seams.StepState.loss_scales``).
      scaled: ordered dict from group name to its scaled (gradient,
        variable) pairs.
      names: the groups to measure.
      after: tensors the measurement follows (the step's overflow flags).

    Returns:
      Ordered dict from group name to ``Underflow``.
    """
    result = collections.OrderedDict()
    with tf.control_dependencies(list(after)):
        view = Float32View(_helpers.distinct([plan.group(name).loss for name in names]))
        for name in names:
            group = plan.group(name)
            with tf.name_scope(name):
                backprop = view.backprop(group.loss, group.var_list)
                wide = dict(zip([var.name for var in group.var_list], backprop.grads))
                counts = [_counts(grad, wide[var.name]) for grad, var in scaled[name]]
                seed = None
                if group.loss.dtype.base_dtype == tf.float16:
                    # The float16 backprop starts from the scale itself.
                    seed = scales[name]
                result[name] = _record(counts, scales[name],
                                       backprop.activations_max_abs, seed)
    return result


class _Counts(collections.namedtuple(
        "_Counts", ["elements", "zeros", "float32_zeros", "flushed", "subnormal", "max_abs",
                    "overflowed", "float32_max_abs", "exponents"])):
    """One gradient's counts (float32 scalars; ``overflowed`` bool;
    ``exponents`` float32[_EXPONENT_BINS], its float32 view's non-zero
    elements by binary exponent)."""


def _dense_pair(grad, wide):
    """The two sides as float32 tensors of the same shape."""
    if isinstance(grad, tf.IndexedSlices) and isinstance(wide, tf.IndexedSlices):
        return tf.cast(grad.values, tf.float32), tf.cast(wide.values, tf.float32)
    return (tf.cast(tf.convert_to_tensor(grad), tf.float32),
            tf.cast(tf.convert_to_tensor(wide), tf.float32))


def _counts(grad, wide):
    """The counts of one scaled gradient against its float32 view (None:
    unconnected there, all zero)."""
    if wide is None:
        wide = tf.zeros_like(_helpers.dense_values(grad))
        if isinstance(grad, tf.IndexedSlices):
            wide = tf.IndexedSlices(wide, grad.indices, grad.dense_shape)
    low, high = _dense_pair(grad, wide)

    def count(mask):
        return tf.reduce_sum(tf.cast(mask, tf.float32))

    magnitude = tf.abs(low)
    zero = tf.equal(low, 0.0)
    zero32 = tf.equal(high, 0.0)
    return _Counts(
        elements=tf.cast(tf.size(low), tf.float32), zeros=count(zero),
        float32_zeros=count(zero32),
        flushed=count(tf.logical_and(zero, tf.logical_not(zero32))),
        # Of the elements the float32 view keeps non-zero, as the share's
        # denominator: a float16 rounding that leaves a residue where the
        # float32 terms cancel exactly is no underflow.
        subnormal=count(tf.logical_and(
            tf.logical_not(zero32),
            tf.logical_and(tf.greater(magnitude, 0.0),
                           tf.less(magnitude, FLOAT16_MIN_NORMAL)))),
        max_abs=tf.reduce_max(magnitude),
        # NaN compares false: overflowed unless every value is at most 65504.
        overflowed=tf.logical_not(tf.reduce_all(tf.less_equal(magnitude, FLOAT16_MAX))),
        float32_max_abs=tf.reduce_max(tf.abs(high)),
        exponents=_exponents(tf.abs(high)))


def _exponents(magnitude):
    """float32[_EXPONENT_BINS]: the non-zero elements of ``magnitude`` by
    binary exponent (see ``_EXPONENT_OFFSET``)."""
    # 0 (and NaN) -> -inf -> the first bin, emptied below.
    finite = tf.less_equal(magnitude, np.finfo(np.float32).max)
    exponent = tf.where(tf.logical_and(finite, tf.greater(magnitude, 0.0)),
                        tf.floor(_log2(tf.maximum(magnitude, np.finfo(np.float32).tiny))),
                        tf.fill(tf.shape(magnitude), -np.inf))
    # The bins' centres, so each exponent falls inside its bin.
    counts = tf.histogram_fixed_width(
        tf.reshape(exponent, [-1]) + 0.5,
        [-float(_EXPONENT_OFFSET), float(_EXPONENT_BINS - _EXPONENT_OFFSET)],
        nbins=_EXPONENT_BINS)
    return tf.concat([tf.zeros([1]), tf.cast(counts[1:], tf.float32)], 0)


def _by_raise(exponents, scale):
    """float32[RAISE_BITS + 1]: the share of the counted elements below
    2**-14 at ``scale * 2**k``, k = 0 .. RAISE_BITS."""
    bins = tf.range(_EXPONENT_BINS, dtype=tf.float32) - float(_EXPONENT_OFFSET)
    raised = _log2(scale) + tf.range(RAISE_BITS + 1, dtype=tf.float32)
    # An element in [2**e, 2**(e + 1)) is below 2**-14 at scale 2**r, all of
    # it, when e + 1 + r <= -14.
    below = tf.cast(tf.less_equal(tf.expand_dims(raised, 1) + tf.expand_dims(bins, 0) + 1.0,
                                  -14.0), tf.float32)
    return _share(tf.reduce_sum(below * exponents, 1), tf.reduce_sum(exponents))


def _record(counts, scale, activations_max_abs, seed=None):
    """An ``Underflow`` from per-gradient ``_Counts`` at ``scale``."""
    def total(field):
        return tf.add_n([getattr(item, field) for item in counts])

    maxima = [item.max_abs for item in counts]
    overflows = [item.overflowed for item in counts]
    if seed is not None:
        maxima.append(seed)
        overflows.append(tf.greater(seed, FLOAT16_MAX))
    float32_max_abs = tf.reduce_max(tf.stack(
        [item.float32_max_abs for item in counts] + [activations_max_abs]))
    return _from_counts(scale, total("elements"), total("zeros"), total("float32_zeros"),
                        total("flushed"), total("subnormal"), tf.reduce_max(tf.stack(maxima)),
                        tf.reduce_any(tf.stack(overflows)), float32_max_abs,
                        _by_raise(total("exponents"), scale))


def _share(part, whole):
    """part / whole for counts (0 when whole, and so part, is 0)."""
    return part / tf.maximum(whole, 1.0)


def _from_counts(scale, elements, zeros, float32_zeros, flushed, subnormal, max_abs,
                 overflowed, float32_max_abs, underflow_by_raise):
    # The larger of what the step read and what the float32 view predicts
    # the float16 backprop holds at this scale.
    largest = tf.maximum(max_abs, scale * float32_max_abs)
    headroom = tf.where(overflowed, tf.constant(-np.inf, tf.float32),
                        _log2(FLOAT16_MAX / largest))
    return Underflow(
        flushed_share=_share(flushed, elements - float32_zeros),
        subnormal_share=_share(subnormal, elements - float32_zeros), headroom=headroom,
        zero_share=_share(zeros, elements), float32_zero_share=_share(float32_zeros, elements),
        max_abs=tf.where(overflowed, tf.constant(np.inf, tf.float32), max_abs),
        float32_max_abs=float32_max_abs, scale=scale, elements=elements, zeros=zeros,
        float32_zeros=float32_zeros, flushed=flushed, subnormal=subnormal,
        underflow_by_raise=underflow_by_raise)


def _log2(x):
    return tf.math.log(x) / np.float32(np.log(2.0))


def combine(records):
    """One ``Underflow`` over several groups' records (of one scale): counts
    summed, maxima taken, shares recomputed.

    Args:
      records: ``Underflow`` records of tensors, at least one.

    Returns:
      An ``Underflow``.
    """
    records = list(records)
    if len(records) == 1:
        return records[0]

    def total(field):
        return tf.add_n([getattr(item, field) for item in records])

    max_abs = tf.reduce_max(tf.stack([item.max_abs for item in records]))
    # Each record's predictions are shares of its non-zero elements.
    nonzero = [item.elements - item.float32_zeros for item in records]
    by_raise = _share(tf.add_n([item.underflow_by_raise * count
                                for item, count in zip(records, nonzero)]), tf.add_n(nonzero))
    return _from_counts(
        records[0].scale, total("elements"), total("zeros"), total("float32_zeros"),
        total("flushed"), total("subnormal"), max_abs,
        tf.logical_not(tf.less_equal(max_abs, FLOAT16_MAX)),
        tf.reduce_max(tf.stack([item.float32_max_abs for item in records])), by_raise)


def listen(plan, scales, scaled, flags):
    """Feeds each listening manager its measurement, on the runs it asks for.

    For each manager whose class defines the optional hooks
    (``managers.base.listens_to_underflow``): ``underflow_due()`` gives the
    bool of this run; behind a gate on it (the step's gate kind: the pivot,
    or a ``tf.cond``) its groups are measured (``measure``, after the
    overflow flags, inside one function call: ``_measured_in_one_call``),
    combined into one ``Underflow`` and handed to ``observe_underflow``,
    whose op runs there. On other runs nothing of it runs.

    Args:
      plan: the ``seams.PlanView``.
      scales: ordered dict from group name to its float32 loss scale.
      scaled: ordered dict from group name to scaled pairs.
      flags: ordered dict from check name to float32 flag.

    Returns:
      A ``seams.Hooked``: one tensor per listening manager, live every run,
      after its measurement and ``observe_underflow`` on the runs it asked
      for (the manager updates follow them), and the ops every write of the
      measurement follows (the ``due`` reads).
    """
    ops, entries = [], []
    for use in plan.managers:
        names = tuple(name for name in use.groups if name in scaled)
        if not names or not _manager_protocol.listens_to_underflow(use.manager):
            continue
        with tf.name_scope("listen"):
            due = tf.identity(use.manager.underflow_due(), name="due")

            def observe(scope, use=use, names=names):
                del scope
                with tf.control_dependencies(list(flags.values())):
                    measured = _measured_in_one_call(plan, scales, scaled, names)
                return [_checked_op(use.manager, use.manager.observe_underflow(measured))]

            if plan.gate_kind == "cond":
                ops.append(_helpers.cond_if(due, observe, "observe"))
            else:
                ops.append(_helpers.run_if(due, observe, "observe"))
        entries.append(due.op)
    return _seams.Hooked(ops, entries)


def _measured_in_one_call(plan, scales, scaled, names):
    """``combine(measure(...))`` of ``names``, computed by one function call.

    Behind the pivot gate, the ops of a run that does not measure are
    skipped as dead one by one, which costs about as much per op as a small
    kernel: spread over the float32 view (a copy of the forward pass and its
    backprop) that made every step of the demo GAN 60 % slower (measured).
    Inside a function, the gate's closed branch is one call op.

    Returns:
      An ``Underflow`` of tensors (the call's outputs).
    """
    @tf.function(autograph=False)
    def measured():
        return combine(measure(plan, scales, scaled, names).values())

    return measured()


def _checked_op(manager, value):
    op = getattr(value, "op", value)
    if isinstance(op, tf.Operation):
        return op
    raise TypeError(
        "%s.observe_underflow(measurement) returned %r, not an op. Return the op "
        "that records the measurement, e.g. tf.assign(...).op."
        % (type(manager).__name__, value))


def summaries(underflow, family="underflow"):
    """``tf.summary.scalar`` summaries of ``TrainOps.underflow``.

    Per group: ``<family>/<group>/flushed_share``, ``subnormal_share``,
    ``headroom`` and ``float32_zero_share``. Fetching them computes the
    measurement (a float32 backprop), so they are kept out of
    ``tf.GraphKeys.SUMMARIES``: merge them and fetch them every N steps,
    with ``update_op`` or alone.

    Args:
      underflow: ``TrainOps.underflow`` (a dict from group name to
        ``Underflow``), non-empty.
      family: the name prefix of the scalars.

    Returns:
      The list of summary tensors.

    Raises:
      TypeError: if ``underflow`` is not such a dict.
      ValueError: if it is empty (``build(measure_underflow=True)`` was not
        asked).
    """
    if not isinstance(underflow, dict) or not all(
            isinstance(value, Underflow) for value in underflow.values()):
        raise TypeError("underflow must be TrainOps.underflow (a dict of Underflow), got "
                        "%r. Pass train.underflow." % (underflow,))
    if not underflow:
        raise ValueError("underflow is empty, got %r. Build with "
                         "build(measure_underflow=True)." % (underflow,))
    result = []
    with tf.name_scope(None):
        for name, record in sorted(underflow.items()):
            for field in ("flushed_share", "subnormal_share", "headroom",
                          "float32_zero_share"):
                result.append(tf.summary.scalar("%s/%s/%s" % (family, name, field),
                                                getattr(record, field), collections=[]))
    return result


class Measurement(_seams.StepObserver):
    """``build(measure_underflow=True)``: each group's ``Underflow``, ops
    that run only when fetched, after the step's overflow flags (their
    float32 ops never reach a float-status register read)."""

    name = "underflow"

    def check_plan(self, plan, options, global_step, api):
        """Refuses a group whose float32 view cannot be built (ValueError)."""
        del options, global_step, api
        check_measurable(plan, True)

    def report(self, state):
        if not state.scaled:
            return {}
        with tf.name_scope("underflow"):
            return dict(measure(state.plan, state.loss_scales, state.scaled, list(state.scaled),
                                after=state.flags.values()))


class Hearing(_seams.StepObserver):
    """The listening managers' hearing (``listen``): on the runs a manager
    asks for, its groups' measurement, before its update."""

    name = "listening"

    def check_plan(self, plan, options, global_step, api):
        """Refuses a listening group whose float32 view cannot be built."""
        del options, global_step, api
        check_measurable(plan, False)

    def before_update(self, state):
        if not state.scaled:
            return _seams.Hooked()
        return listen(state.plan, state.loss_scales, state.scaled, state.flags)


def measure_underflow():
    """The observer of ``build(measure_underflow=True)``: its report is
    ``TrainOps.underflow``, each group's ``Underflow``."""
    return Measurement()


def listens(plan):
    """Whether a manager of ``plan`` listens to the measurement."""
    return any(_manager_protocol.listens_to_underflow(use.manager) for use in plan.managers)


# The public constructor of the first-scale observer; below, since its module
# imports this package's float32 view.
from npu_lossscale.underflow.first_scale import measure_first_scale  # noqa: E402
