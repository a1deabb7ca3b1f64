"""Why a step skipped: the reasons, where they are computed, and the record
of the last skip.

A step that skips is diagnosed inside the skip branch of its own gate (the
pivot gate's false output, the ``tf.cond`` gate's false branch), so an
applied step runs none of it. The branch works out one reason:

==  ===========================  ==========================================
0   applied                      the step applied (every group)
1   loss_not_finite              a group's loss, before any scaling, is not
                                 finite: the forward pass or the data
2   gradients_overflowed         the scaled gradients overflowed
3   other_worker_overflowed      the flags summed across workers say
                                 overflow while this worker's are clear
4   register_outside_gradients   Ascend's float-status register says
                                 overflow while every gradient is finite and
                                 unsaturated: an op outside the gradients
==  ===========================  ==========================================

It also works out which groups and which variables overflowed on this
worker, and writes all of it to the record ``TrainOps.last_skip`` reads
(the variable ``loss_scale/last_skip``), with counts of skips by reason and
by group.
``TrainOps.skip_reason`` and ``TrainOps.groups_overflowed`` read that record
after the run, for the run itself.

On a saturating register (Ascend's saturation mode) an overflowing float16
result is +-65504 and a NaN is 0 (tf_adapter's documentation of
``npu_plugin.set_device_sat_mode``: "saturation mode: Inf -> +-MAX, NaN ->
0"), so a gradient counts as overflowed when it holds a non-finite value or
exactly +-65504 (also as a float32 value cast from float16), or the largest
value of its own dtype. A saturated value that was added to other terms
before reaching the gradient, and a NaN flushed to 0, leave no mark on the
gradients: such a step reads as ``register_outside_gradients``.
"""

from __future__ import absolute_import, division, print_function

import collections
import contextlib

import numpy as np
import tensorflow.compat.v1 as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.ops import cond_v2

# A module import: gradients imports the managers, whose floor warning
# (monitoring) imports this module.
from npu_lossscale import gradients as _gradients
from npu_lossscale import graph_walk as _graph_walk

#: The reason codes, by name; ``TrainOps.skip_reason`` is an index into it.
REASONS = ("applied", "loss_not_finite", "gradients_overflowed",
           "other_worker_overflowed", "register_outside_gradients")
APPLIED, LOSS_NOT_FINITE, GRADIENTS_OVERFLOWED, OTHER_WORKER_OVERFLOWED, \
    REGISTER_OUTSIDE_GRADIENTS = range(len(REASONS))

#: What to do about each reason, as the collapse message says it.
FIXES = (
    "nothing to fix.",
    "the loss is inf or nan before any scaling, so no loss scale can help: it is a "
    "model or data bug. Check the input batch for inf/nan, and keep exp, log, "
    "softmax and the losses in float32.",
    "the named variables' gradients overflow float16 even at this scale: keep the "
    "ops that produce them in float32, or bound their inputs (clip, normalise); "
    "lowering min_loss_scale only hides it.",
    "another worker overflowed, not this one: read that worker's last_skip record "
    "(its reason and variables name the fault) and check its data shard.",
    "the float-status register was set while every gradient was finite: an op "
    "outside the gradients overflowed, usually a forward op or the input data. "
    "Find it with npu_lossscale.audit or by checking the forward outputs, and "
    "keep it in float32.",
)

#: float16's largest finite value: the image of +-inf in saturation mode.
FLOAT16_MAX = float(np.finfo(np.float16).max)


def reason_name(code):
    """The name of a reason code (``REASONS[code]``).

    Args:
      code: an int (or numpy integer) in ``range(len(REASONS))``.

    Returns:
      A str, e.g. "loss_not_finite".

    Raises:
      TypeError: if ``code`` is not an integer.
      ValueError: if it is not a known code.
    """
    if isinstance(code, bool) or not isinstance(code, (int, np.integer)):
        raise TypeError("code must be an int reason code, got %r. Pass the value "
                        "fetched from TrainOps.skip_reason." % (code,))
    if not 0 <= int(code) < len(REASONS):
        raise ValueError("code must be in 0..%d, got %r. Pass the value fetched from "
                         "TrainOps.skip_reason." % (len(REASONS) - 1, code))
    return REASONS[int(code)]


class LastSkip(collections.namedtuple(
        "LastSkip", ["number", "global_step", "reason", "groups", "variables",
                     "group_names", "variable_names", "reason_counts", "group_counts"])):
    """The record of the last skipped step, as tensors that read it.

    Written only in the skip branch of the step, so reading it never runs a
    step: fetch it in a run of its own (``read_last_skip``). Fetched in the
    same run as ``update_op`` it may show the record before or after that
    run's skip; use ``TrainOps.skip_reason`` for the run itself. It reads
    one variable, ``loss_scale/last_skip`` (``Record``), that no collection
    holds: checkpoints do not save it (a checkpoint written before it
    existed restores with a default Saver), no initializer is needed, and
    it starts blank in each new session (number 0, counts 0).

    Attributes:
      number: int64 scalar, the skip's number: how many skips the record
        has seen in this session; 0 before any skip.
      global_step: int64 scalar, the global step's value when the skipped
        step ran (-1 when the step has none, or before any skip).
      reason: int32 scalar, the skip's reason code (``REASONS``).
      groups: bool vector, one per name of ``group_names``: the groups whose
        loss or gradients were not finite (or saturated) on this worker.
      variables: bool vector, one per name of ``variable_names``: the
        variables whose gradients were not finite (or saturated).
      group_names: string vector, the builder's group names.
      variable_names: string vector, the names of every group's variables.
      reason_counts: int64 vector, the number of skips for each reason code
        in this session (the first, "applied", stays 0).
      group_counts: int64 vector, for each group the number of skips in
        which it overflowed.
    """


class Skip(collections.namedtuple(
        "Skip", ["number", "global_step", "reason", "groups", "variables"])):
    """One skipped step, as Python values (``decode``, ``read_last_skip``).

    Attributes:
      number: the skip's number (1 for the first).
      global_step: the global step when it ran, or None if the step has none.
      reason: the reason's name (``REASONS``).
      groups: tuple of the names of the groups that overflowed.
      variables: tuple of the names of the variables that overflowed.
    """

    @property
    def fix(self):
        """What to do about this skip's reason, one sentence."""
        return FIXES[REASONS.index(self.reason)]


def decode(values):
    """The ``Skip`` in fetched ``LastSkip`` values, or None before any skip.

    Args:
      values: what ``session.run(train_ops.last_skip)`` returned.

    Returns:
      A ``Skip``, or None when ``values.number`` is 0.
    """
    if int(values.number) == 0:
        return None

    def names(mask, all_names):
        return tuple(decoded(name) for name, bad in zip(all_names, mask) if bad)

    return Skip(number=int(values.number),
                global_step=None if int(values.global_step) < 0 else int(values.global_step),
                reason=reason_name(int(values.reason)),
                groups=names(values.groups, values.group_names),
                variables=names(values.variables, values.variable_names))


def decoded(name):
    """A name fetched from a string tensor (bytes), as a str."""
    return name.decode("utf-8") if isinstance(name, bytes) else str(name)


def read_last_skip(session, train_ops):
    """Reads the last skip's record in a run of its own; no step runs.

    Args:
      session: a session of the graph of ``train_ops``.
      train_ops: the ``TrainOps`` of ``MultiOptimizerLossScale.build``.

    Returns:
      A ``Skip``, or None when no step has skipped yet.
    """
    return decode(session.run(train_ops.last_skip))


def describe(skip):
    """A short text about ``skip``: its reason, groups, variables and fix.

    Args:
      skip: a ``Skip``.

    Returns:
      A str of one or two sentences.
    """
    where = "" if skip.global_step is None else " at global step %d" % skip.global_step
    parts = ["skip #%d%s: %s" % (skip.number, where, skip.reason)]
    if skip.groups:
        parts.append("groups %s" % ", ".join(skip.groups))
    if skip.variables:
        shown = list(skip.variables[:8])
        if len(skip.variables) > len(shown):
            shown.append("and %d more" % (len(skip.variables) - len(shown)))
        parts.append("variables %s" % ", ".join(shown))
    return "%s. Fix: %s" % ("; ".join(parts), skip.fix)


class Evidence(collections.namedtuple("Evidence", ["losses", "grads", "saturation"])):
    """What the skip branch inspects.

    Attributes:
      losses: ordered dict from group name to the group's loss, before any
        scaling (empty when the step has none at hand: an accumulation
        window, or given gradients).
      grads: ordered dict from group name to the (gradient, variable) pairs
        the overflow check read on this worker: the scaled gradients, or an
        accumulation window's float32 sums.
      saturation: whether a value of exactly +-65504 (or its dtype's
        largest) counts as overflowed: the gradients of a run read by a
        float-status register, which saturates.
    """


class Diagnosis(collections.namedtuple("Diagnosis", ["record", "evidence"])):
    """The record a step writes when it skips, and what it inspects.

    Attributes:
      record: the builder's ``Record``.
      evidence: the ``Evidence``, or None to inspect the gradients the close
        is handed (an accumulation window's sums).
    """

    def skip_branch(self, plan, closing, reduced_flags, global_step):
        """The builder of the skip branch's ops, for ``commit.commit``.

        The diagnosis is the body of one functional ``If`` that TF does not
        lower into Switch/Merge: under the gate's false side it is one dead
        node on an applied step, where its own ops, one or more per
        gradient, would each be a dead node the executor passes over (about
        as dear as running a small op: 16 % of a step of a model of 200
        small variables, measured).

        Args:
          plan: the ``plan.Plan``.
          closing: the ``close.Closing`` (this worker's flags and gradients,
            before the reduction across workers).
          reduced_flags: ordered dict from check name to the flag summed
            across workers (``closing.flags`` on one worker).
          global_step: an integer variable, or None.

        Returns:
          A function taking the branch's name scope and returning the ops
          to follow; call it only under the gate's false side.
        """
        evidence = self.evidence
        if evidence is None:
            evidence = Evidence(collections.OrderedDict(), closing.grads, False)
        record = self.record

        def build(scope):
            del scope
            with tf.name_scope("diagnose"):
                # True on every run that gets here (flags are >= 0, and one
                # is set); a value, not a constant, so that nothing folds it.
                skipped = tf.greater(tf.add_n(list(reduced_flags.values())), 0.0)
                # Read out here: a ref variable cannot enter a function.
                step = (tf.constant(-1, tf.int64) if global_step is None
                        else tf.cast(global_step.read_value(), tf.int64))

                def diagnose():
                    with tf.control_dependencies([record.write(plan, evidence, closing.flags,
                                                               step)]):
                        return tf.constant(True)

                done = cond_v2.cond_v2(skipped, diagnose, lambda: tf.constant(False),
                                       name="diagnose")
                _keep_whole(done)
                return [done]
        return build


def _keep_whole(output):
    """Keeps the ``If`` behind a ``cond_v2`` output from being lowered into
    Switch/Merge (``_lower_using_switch_merge``, TF's lowering pass): it
    runs as one op, its branches as functions."""
    graph_op = output.op
    while graph_op.type not in ("If", "StatelessIf"):
        graph_op = graph_op.inputs[0].op
    graph_op._set_attr(  # pylint: disable=protected-access
        "_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))


def evidence_of(plan, scaled):
    """The ``Evidence`` of a run that closes its own step.

    Args:
      plan: the ``plan.Plan``.
      scaled: ordered dict from group name to the scaled pairs the check read.

    Returns:
      An ``Evidence``.
    """
    losses = collections.OrderedDict(
        (group.name, group.loss) for group in plan.groups if group.loss is not None)
    return Evidence(losses, scaled, plan.backend.reads_register)


#: The record's scalar fields; the others are vectors.
_SCALAR_FIELDS = ("number", "global_step", "reason")


class Record(object):
    """The last skip's record: one variable, written only in a skip branch.

    One per builder, shared by its joint step and its per-group steps: an
    int64 vector ``<scope>/last_skip`` (``loss_scale/last_skip``), a
    resource variable so that a functional ``If`` branch can write it. One
    variable, because every tensor a skip branch reads is computed on every
    step, applied or not: here that is one variable handle. Its layout
    (``LastSkip`` reads it back by field):

    ``[number, global_step, reason, reason_counts..., group_counts...,
    groups..., variables...]``, with ``len(REASONS)`` reason counts, one
    count and one 0/1 entry per group and one 0/1 entry per variable.

    The variable is in no collection, as the run-time claims' tables
    (claims.py): bookkeeping of one session, so Savers leave it out and a
    checkpoint from before it existed restores. Reads and the write see the
    blank record until the first write (``VarIsInitializedOp``), so no
    initializer has to run.

    Args:
      groups: the builder's ``plan.Group`` records, in ``add()`` order.
    """

    def __init__(self, groups):
        self.group_names = tuple(group.name for group in groups)
        self.variable_names = tuple(var.op.name for group in groups for var in group.var_list)
        sizes = [("number", 1), ("global_step", 1), ("reason", 1),
                 ("reason_counts", len(REASONS)), ("group_counts", len(self.group_names)),
                 ("groups", len(self.group_names)), ("variables", len(self.variable_names))]
        self._slices, offset = {}, 0
        for field, size in sizes:
            self._slices[field] = (offset, offset + size)
            offset += size
        self._blank = np.zeros([offset], np.int64)
        self._blank[self._slices["global_step"][0]] = -1
        self.variable = tf.Variable(self._blank, trainable=False, use_resource=True,
                                    collections=[],
                                    name="last_skip")

    def _field(self, values, field):
        """A field of the record's ``values``: a scalar or a vector."""
        start, stop = self._slices[field]
        return values[start] if field in _SCALAR_FIELDS else values[start:stop]

    def _values(self):
        """The record's values: the variable's, or the blank record before
        its first write."""
        return tf.cond(self.variable.is_initialized(), self.variable.read_value,
                       lambda: tf.constant(self._blank), name="values")

    def last_skip(self):
        """A ``LastSkip`` of one fresh read of the record."""
        with tf.name_scope("last_skip_read"):
            values = self._values()
            return LastSkip(
                number=self._field(values, "number"),
                global_step=self._field(values, "global_step"),
                reason=tf.cast(self._field(values, "reason"), tf.int32),
                groups=tf.cast(self._field(values, "groups"), tf.bool),
                variables=tf.cast(self._field(values, "variables"), tf.bool),
                group_names=tf.constant(self.group_names, tf.string, name="group_names"),
                variable_names=tf.constant(self.variable_names, tf.string,
                                           name="variable_names"),
                reason_counts=self._field(values, "reason_counts"),
                group_counts=self._field(values, "group_counts"))

    def write(self, plan, evidence, local_flags, step):
        """The op that diagnoses a skipped step and writes the record.

        Build it only in a skip branch. Every op made here is a node the
        executor passes over (dead) on each applied step, so the checks are
        vectors: one reduction per large gradient, one per pack of small
        ones of a shape, then one test of all the sums (``_bad_entries``).

        Args:
          plan: the ``plan.Plan`` of the step (the builder's, or one group's).
          evidence: the ``Evidence``.
          local_flags: ordered dict from check name to this worker's flag,
            before the sum across workers (the branch runs only when the
            summed flags say overflow).
          step: int64 scalar, the global step's value (-1 without one).

        Returns:
          The write op.
        """
        checked = [name for name in plan.group_names
                   if any(name in check.groups for check in plan.checks)]
        heads = _LossHeads(evidence)
        losses = [(name, heads.value(evidence.losses[name]))
                  for name in checked if evidence.losses.get(name) is not None]
        grads = [(name, grad, var.op.name) for name in checked
                 for grad, var in evidence.grads.get(name, ())]
        # One entry per loss, then per gradient; bad[i] for entry i.
        entries = [loss for _, loss in losses] + [grad for _, grad, _ in grads]
        entry_groups = [name for name, _ in losses] + [name for name, _, _ in grads]
        bad = _bad_entries(entries, evidence.saturation)
        flags = tf.cast(bad, tf.int64)
        if entries:
            membership = np.array([[int(group == name) for group in entry_groups]
                                   for name in self.group_names], np.int64)
            groups = tf.reduce_max(flags[None, :] * membership, axis=1)
        else:
            groups = tf.zeros([len(self.group_names)], tf.int64)
        position = dict((var, len(losses) + index) for index, (_, _, var) in enumerate(grads))
        variables = tf.gather(tf.concat([flags, tf.zeros([1], tf.int64)], 0),
                              [position.get(var, len(entries)) for var in self.variable_names])
        reason = tf.constant(REGISTER_OUTSIDE_GRADIENTS if evidence.saturation
                             else GRADIENTS_OVERFLOWED, tf.int64)
        if grads:
            reason = tf.where(tf.reduce_any(bad[len(losses):]),
                              tf.constant(GRADIENTS_OVERFLOWED, tf.int64), reason)
        if plan.reduction.active and local_flags:
            clear = tf.reduce_all(tf.equal(tf.stack(list(local_flags.values())), 0.0))
            reason = tf.where(clear, tf.constant(OTHER_WORKER_OVERFLOWED, tf.int64), reason)
        if losses:
            reason = tf.where(tf.reduce_any(bad[:len(losses)]),
                              tf.constant(LOSS_NOT_FINITE, tf.int64), reason)
        old = self._values()
        new = tf.concat([
            tf.stack([self._field(old, "number") + 1, step, reason]),
            self._field(old, "reason_counts") + tf.one_hot(reason, len(REASONS),
                                                           dtype=tf.int64),
            self._field(old, "group_counts") + groups, groups, variables], 0)
        return self.variable.assign(new, read_value=False)

    def report(self, skipped_steps, applied):
        """``TrainOps.skip_reason`` and ``groups_overflowed``: reads of the
        record after the run, for the run (zero and False unless it skipped).

        Args:
          skipped_steps: the ``commit.SkippedSteps`` counter.
          applied: the step's ``applied`` tensor (it follows the step).

        Returns:
          ``(skip_reason, groups_overflowed)``: an int32 scalar, and a dict
          from group name to a bool scalar.
        """
        with tf.name_scope("skip_report"), tf.control_dependencies([applied]):
            skipped = tf.greater(skipped_steps.variable.read_value(), skipped_steps.before,
                                 name="skipped")
            values = self._values()
            reason = tf.where(skipped, tf.cast(self._field(values, "reason"), tf.int32),
                              tf.zeros([], tf.int32), name="skip_reason")
            groups = tf.cast(self._field(values, "groups"), tf.bool)
            overflowed = dict((name, tf.logical_and(skipped, groups[index],
                                                    name="overflowed_%d" % index))
                              for index, name in enumerate(self.group_names))
        return reason, overflowed


class _LossHeads(object):
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
            roots = [_gradients.dense_values(grad).op for pairs in evidence.grads.values()
                     for grad, _ in pairs]
            self._computed = _graph_walk.reachable(
                roots, lambda op: [tensor.op for tensor in op.inputs],
                stop=lambda op: op.type in _SHAPE_TYPES)
        self._copies = {}

    def value(self, loss):
        """``loss``'s value, the head the backprop does not need copied here."""
        stack = [loss.op]
        while stack:
            op = stack[-1]
            if op in self._copies or not self._copied(op):
                stack.pop()
                continue
            pending = [t.op for t in op.inputs
                       if t.op not in self._copies and self._copied(t.op)]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            node = op.node_def
            # On the original's device; its colocation is the original's own.
            with tf.device(op.device) if op.device else contextlib.suppress():
                self._copies[op] = tf.get_default_graph().create_op(
                    op.type, [self._tensor(t) for t in op.inputs],
                    [output.dtype for output in op.outputs],
                    input_types=[t.dtype for t in op.inputs], name=op.name.rsplit("/", 1)[-1],
                    attrs=dict((key, node.attr[key]) for key in node.attr if key != "_class"))
        return self._tensor(loss)

    def _copied(self, op):
        """Whether ``op`` is copied: not needed by the backprop, and copyable
        (a variable's read is not: it costs nothing, and stays by its
        variable)."""
        return (self._computed is not None and op not in self._computed and op.inputs
                and not any(t.dtype.base_dtype != t.dtype or t.dtype == tf.resource
                            for t in op.inputs)
                and op.type not in _graph_walk.FEEDABLE_TYPES
                and op.type not in _graph_walk.CONTROL_FLOW_TYPES
                and op.type not in _graph_walk.FUNCTION_CALL_TYPES
                and op.type not in _SHAPE_TYPES
                and not op.op_def.is_stateful
                and op._get_control_flow_context() is None)  # pylint: disable=protected-access

    def _tensor(self, tensor):
        copy = self._copies.get(tensor.op)
        return tensor if copy is None else copy.outputs[tensor.value_index]


#: Ops that read only their input's shape.
_SHAPE_TYPES = frozenset(["Shape", "ShapeN", "Size", "Rank"])


def _bad_entries(tensors, saturation):
    """One bool per tensor: whether it holds a value that overflowed.

    A tensor overflowed when its float32 sum is not finite (an inf or a NaN
    makes it so; for a float32 tensor also a finite sum beyond float32, as
    in ``backends.IsFiniteBackend``), and with ``saturation`` also when its
    largest magnitude is exactly 65504 or its dtype's largest value (a
    saturated float16 value, also cast to float32, in a tensor that holds
    no larger one).
    Small tensors of one shape and dtype are stacked and reduced row by row:
    a handful of ops per shape, not per tensor.

    With the register, no ``IsFinite`` op: CANN does not support
    ``tf.is_finite`` (tf_adapter's docs; npu_bridge's managers test with
    ``less`` instead). There a sum is non-finite when it differs from itself
    (NaN) or its magnitude exceeds float32's largest (inf).

    Args:
      tensors: tensors or ``tf.IndexedSlices`` (their values are read).
      saturation: whether the register backend reads the step.

    Returns:
      A bool vector, one entry per tensor, in their order.
    """
    if not tensors:
        return tf.zeros([0], tf.bool)
    sums, maxes, limits, order = [], [], [], []
    small, single = collections.OrderedDict(), []
    for index, tensor in enumerate(tensors):
        values = _gradients.dense_values(tensor)
        shape = values.shape
        if shape.is_fully_defined() and shape.num_elements() < _gradients.SMALL_GRADIENT_ELEMENTS:
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
