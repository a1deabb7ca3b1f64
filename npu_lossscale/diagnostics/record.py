"""The skip branch's diagnosis (``SkipDiagnosis``, seam: ``StepObserver``):
the branch that runs it, and the last skip's record it writes (``Record``).
What it inspects is ``evidence``'s, why it skipped ``diagnose``'s, the
reasons and the reading of the record ``diagnostics``'s.
"""

from __future__ import absolute_import, division, print_function

import collections
import contextlib

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams
from npu_lossscale import tf_internals as _tf_internals
from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.diagnostics import diagnose as _diagnose
from npu_lossscale.diagnostics import evidence as _inspection
from npu_lossscale.diagnostics import reasons as _reasons
from npu_lossscale.diagnostics import LastSkip, RecentSkips


class SkipDiagnosis(_seams.StepObserver):
    """The observer that diagnoses a skipped step in the gate's skip branch
    and writes the builder's ``Record``.

    What it inspects (``Evidence``): on a run that closes its own step, the
    losses and the unscaled gradients (the scaled ones on a register
    backend: a saturated value is +-65504 only before the unscale); at the
    close of an accumulation window, or for given gradients, the gradients
    the close is handed.

    The diagnosis is the body of one functional ``If`` that TF does not
    lower into Switch/Merge: under the gate's false side it is one dead
    node on an applied step, where its own ops, one or more per gradient,
    would each be a dead node the executor passes over. The write that
    follows it is a few ops under the same false side. The run's
    ``SkipReport`` is a second ``If`` op on the same branch functions,
    outside the gate, so the diagnosis is built once and runs only when
    the step skips or the report is fetched.

    Args:
      record: the builder's ``Record``.
      substep: the index of the step's sub-step in a sequence
        (``build(sequence=...)``), written with each skip; 0 otherwise.
    """

    name = "skip_diagnosis"

    def __init__(self, record, substep=0):
        self.record = record
        self.substep = substep
        self._branch = None  # the last on_skip's _Branch, for report()

    def on_skip(self, state):
        plan, record = state.plan, self.record
        evidence = _evidence(state)
        flags = list(state.reduced_flags.values())
        with tf.name_scope("diagnose"):
            # True on every run that gets here (flags are >= 0, and one is
            # set); a value, not a constant, so that nothing folds it.
            skipped = tf.greater(tf.add_n(flags), 0.0)
            step = _global_step(state.global_step)
            if not _at_top_level(flags[0].graph):
                # Inside a cond's branch (the "cond" gate): the diagnosis
                # and the write make one If there, and the report its own.
                def diagnose_and_write():
                    found = _diagnose.diagnose(record, plan, evidence, state.closing.flags,
                                               state.reduced_flags)
                    with tf.control_dependencies([record.write(found, step, self.substep)]):
                        return tf.constant(True)

                done = _tf_internals.cond_v2(skipped, diagnose_and_write,
                                             lambda: tf.constant(False), name="diagnose")
                _keep_whole(done)
                return [done.op]
            found, if_op = self._diagnosed(skipped, state, evidence)
            self._branch = _Branch(state, if_op)
            with tf.device(record.variable.device):  # the host, off Ascend (Record)
                return [record.write(found, step, self.substep)]

    def _diagnosed(self, skipped, state, evidence):
        """The ``Diagnosed`` of ``state`` as the outputs of one functional
        ``If`` on ``skipped`` (zeros when False), and that ``If`` op."""
        plan, record = state.plan, self.record

        def diagnose():
            return tuple(_diagnose.diagnose(record, plan, evidence, state.closing.flags,
                                            state.reduced_flags))

        def blank():
            return (tf.constant(0, tf.int64), tf.zeros([len(record.group_names)], tf.int64),
                    tf.zeros([len(record.variable_names)], tf.int64))

        found = _tf_internals.cond_v2(skipped, diagnose, blank, name="diagnose")
        return _diagnose.Diagnosed(*found), _keep_whole(found[0])

    def report(self, state):
        """``SkipReport`` of the run: its reason and the groups that
        overflowed, worked out in a functional ``If`` that runs the
        diagnosis only when the run skips: the skip branch's own branch
        functions where the run closes its step there, else built here.
        Nothing of it writes, so fetching it alone changes nothing; it runs
        only when fetched.

        Returns:
          ``(skip_reason, groups_overflowed)``: an int32 scalar, and a dict
          from group name to a bool scalar; None when ``state`` has no
          close (a worker whose chief decides).
        """
        if state.reduced_flags is None:
            return None
        names = self.record.group_names
        with tf.name_scope("skip_report"):
            if not state.reduced_flags:  # nothing can skip
                return (tf.constant(0, tf.int32, name="skip_reason"),
                        dict((name, tf.constant(False, name="overflowed_%d" % index))
                             for index, name in enumerate(names)))
            skipped = tf.greater(tf.add_n(list(state.reduced_flags.values())), 0.0)
            if state.window_end is not None:
                skipped = tf.logical_and(state.window_end, skipped)
            branch = self._branch
            if branch is not None and branch.state is state and state.window_end is None:
                found = _diagnose.Diagnosed(*_helpers.copy_op(
                    branch.op, [skipped] + list(branch.op.inputs)[1:], name="diagnose").outputs)
            else:
                found, _ = self._diagnosed(skipped, state, _evidence(state))
            overflowed = tf.unstack(tf.cast(found.groups, tf.bool), num=len(names))
            return (tf.cast(found.reason, tf.int32, name="skip_reason"),
                    dict((name, tf.identity(overflowed[index], name="overflowed_%d" % index))
                         for index, name in enumerate(names)))


class _Branch(collections.namedtuple("_Branch", ["state", "op"])):
    """A skip branch's diagnosis: the ``StepState`` it diagnoses and its
    functional ``If`` op."""


def _evidence(state):
    """What a diagnosis of ``state``'s close inspects (``SkipDiagnosis``)."""
    plan, closing = state.plan, state.closing
    if plan.window_steps == 1 and state.scaled:
        # The pairs the step carries (a fused clip applied), not
        # ``state.grads``: a tensor the skip branch reads runs on every step.
        found = _inspection.evidence_of(plan, state.scaled if plan.backend.reads_register
                            else closing.grads)
    else:
        found = _inspection.Evidence(collections.OrderedDict(), closing.grads, False,
                                     closing.loss_flags)
    return found._replace(transformed=closing.transformed)


def _global_step(global_step):
    """int64 scalar: the global step's value (-1 without one), read out of
    any function (a ref variable cannot enter one)."""
    return (tf.constant(-1, tf.int64) if global_step is None
            else tf.cast(global_step.read_value(), tf.int64))


def _at_top_level(graph):
    """Whether ops made now land in ``graph`` itself, outside any function
    being built and any v1 cond."""
    here = tf.get_default_graph()
    return here is graph and _tf_internals.control_flow_context(here) is None


def _keep_whole(output):
    """Keeps the ``If`` behind a ``cond_v2`` output from being lowered into
    Switch/Merge (``_lower_using_switch_merge``, TF's lowering pass): it
    runs as one op, its branches as functions. Returns the ``If`` op."""
    graph_op = output.op
    while graph_op.type not in ("If", "StatelessIf"):
        graph_op = graph_op.inputs[0].op
    _tf_internals.keep_if_whole(graph_op)
    return graph_op


#: The record's scalar fields; the others are vectors.
_SCALAR_FIELDS = ("number", "global_step", "reason")

#: The skips the record's history keeps by default: one per iteration of the
#: device loop most ModelZoo scripts run (``NPURunConfig(iterations_per_loop=1000)``),
#: so that a loop whose every iteration skips still shows each skip.
DEFAULT_HISTORY = 1000
#: The history's columns before the group mask (``RecentSkips``).
_HISTORY_COLUMNS = ("number", "global_step", "reason", "streak", "substep")


class Record(object):
    """The last skip's record: one variable, written only in a skip branch.

    One per builder, shared by its joint step and its per-group steps: an
    int64 vector ``<scope>/last_skip`` (``loss_scale/last_skip``), a
    resource variable so that a functional ``If`` branch can write it. One
    variable, because every tensor a skip branch reads is computed on every
    step, applied or not: here that is one variable handle. Its layout
    (``LastSkip`` reads it back by field):

    ``[number, global_step, reason, reason_counts..., group_counts...,
    groups..., variables..., history...]``, with one count per reason code of
    the builder (``reasons``), one
    count and one 0/1 entry per group and one 0/1 entry per variable.

    The variable is in no collection, as the run-time claims' tables
    (claims.py): bookkeeping of one session, so Savers leave it out and a
    checkpoint from before it existed restores. Reads and the write see the
    blank record until the first write (``VarIsInitializedOp``), so no
    initializer has to run.

    Off Ascend the variable, and the write and reads made beside it, live
    on the host (``/device:CPU:0``, under any job or task the graph's
    device scope names): written on a GPU in a skip branch, TF 2.21 crashes
    (docs/benchmarks.md), and an int64 bookkeeping vector has no business
    on the GPU anyway. On Ascend the adapter places it, as the other
    variables.

    Its last part is the history (one row per skip, the last ``history``
    skips in a ring, in the same variable so that a step reads one handle):
    each row holds the skip's
    number, global step, reason, streak and group mask. The streak is the
    skip's place in its run of consecutive skipped steps, worked out in the
    skip branch from the previous skip's global step: with
    ``counts_skipped_steps`` the previous step skipped when its global step
    is one less, without it when the global step is the same (no step
    applied since). A skip for a reason that holds the scale
    (``Reason.holds_scale``) neither extends nor breaks the streak. Without a
    global step every streak is 1. So a host that runs many steps per
    ``session.run`` (a device loop) reads every skip of the run, and the
    longest streak in it, after the run.

    Args:
      groups: the builder's ``seams.GroupView``s, in ``add()`` order.
      reasons: the builder's ``reasons.Reasons`` (``reasons.collect``),
        which its codes index and decoding reads back; the shipped ones
        when None.
      on_host: whether to pin the variable to the host (every backend but
        one that runs on Ascend, ``Backend.on_npu``).
      switch_merge: whether the record may be read through a raw
        Switch/Merge (the "pivot" gate's graphs; the "cond" gate's have none
        of ours).
      history: the number of skips the history keeps, an int >= 1.
      counts_skipped_steps: whether the step's global step advances on
        skipped steps (``build(count_skipped_steps=...)``).
    """

    def __init__(self, groups, reasons=None, on_host=True, switch_merge=True,
                 history=DEFAULT_HISTORY, counts_skipped_steps=False):
        #: The builder's ``reasons.Reasons``, which its codes index.
        self.reasons = _reasons.SHIPPED if reasons is None else reasons
        self.group_names = tuple(group.name for group in groups)
        self.variable_names = tuple(var.op.name for group in groups for var in group.var_list)
        self.history = history
        self._counts_skipped_steps = counts_skipped_steps
        self._history_shape = [history, len(_HISTORY_COLUMNS) + len(self.group_names)]
        sizes = [("number", 1), ("global_step", 1), ("reason", 1),
                 ("reason_counts", len(self.reasons.reasons)),
                 ("group_counts", len(self.group_names)),
                 ("groups", len(self.group_names)), ("variables", len(self.variable_names)),
                 ("history", self._history_shape[0] * self._history_shape[1])]
        self._slices, offset = collections.OrderedDict(), 0
        for field, size in sizes:
            self._slices[field] = (offset, offset + size)
            offset += size
        self._blank = np.zeros([offset], np.int64)
        #: 1 where a write adds to the old value (the skip number and the
        #: counts), 0 where it replaces it.
        self._kept = np.zeros([offset], np.int64)
        for field in ("number", "reason_counts", "group_counts"):
            self._kept[self._slices[field][0]:self._slices[field][1]] = 1
        self._blank[self._slices["global_step"][0]] = -1
        self._on_host = on_host
        self._switch_merge = switch_merge
        self._scope = _helpers.current_scope()
        self._variable = None

    @property
    def variable(self):
        """The record's variable, made on first use (``graph_state.outside``)."""
        if self._variable is None:
            with _helpers.outside(self._scope):
                with tf.device("/device:CPU:0") if self._on_host else contextlib.suppress():
                    self._variable = tf.Variable(self._blank, trainable=False,
                                                 use_resource=True, collections=[],
                                                 name="last_skip")
        return self._variable

    def _fields(self, values):
        """The record's ``values`` by field: a dict from field name to an
        int64 scalar or vector, cut in one ``SplitV``."""
        names = list(self._slices)
        pieces = tf.split(values, [stop - start for start, stop in self._slices.values()])
        return dict((name, tf.squeeze(piece, [0]) if name in _SCALAR_FIELDS else piece)
                    for name, piece in zip(names, pieces))

    def _values(self):
        """The record's values: the variable's, or the blank record before
        its first write.

        Under the "pivot" gate, at the top level of the variable's graph, a
        Switch on ``VarIsInitializedOp`` and a Merge (the read runs only
        when the variable is initialized); otherwise a ``tf.cond``.
        """
        variable = self.variable
        if not (self._switch_merge and _at_top_level(variable.graph)):
            return tf.cond(variable.is_initialized(), variable.read_value,
                           lambda: tf.constant(self._blank), name="values")
        with tf.name_scope("values"), tf.device(variable.device):
            initialized = variable.is_initialized()
            unset, is_set = tf.raw_ops.Switch(data=initialized, pred=initialized)
            with tf.control_dependencies([tf.identity(is_set, name="set")]):
                read = variable.read_value()
            with tf.control_dependencies([tf.identity(unset, name="unset")]):
                blank = tf.constant(self._blank)
            return tf.raw_ops.Merge(inputs=[blank, read])[0]

    def _rows(self, fields):
        """The history's rows in ring order, from the record's ``fields``."""
        return tf.reshape(fields["history"], self._history_shape)

    def last_skip(self):
        """A ``LastSkip`` of one fresh read of the record."""
        with tf.name_scope("last_skip_read"):
            fields = self._fields(self._values())
            return LastSkip(
                number=fields["number"],
                global_step=fields["global_step"],
                reason=tf.cast(fields["reason"], tf.int32),
                groups=tf.cast(fields["groups"], tf.bool),
                variables=tf.cast(fields["variables"], tf.bool),
                group_names=tf.constant(self.group_names, tf.string, name="group_names"),
                variable_names=tf.constant(self.variable_names, tf.string,
                                           name="variable_names"),
                reason_counts=fields["reason_counts"],
                group_counts=fields["group_counts"])

    def recent_skips(self):
        """A ``RecentSkips`` of one fresh read of the history, oldest first."""
        with tf.name_scope("recent_skips_read"):
            fields = self._fields(self._values())
            rows = tf.roll(self._rows(fields), shift=-tf.floormod(fields["number"], self.history),
                           axis=0)
            columns = tf.unstack(rows[:, :len(_HISTORY_COLUMNS)], axis=1)
            fields = dict(zip(_HISTORY_COLUMNS, columns))
            return RecentSkips(
                number=fields["number"], global_step=fields["global_step"],
                reason=tf.cast(fields["reason"], tf.int32), streak=fields["streak"],
                substep=tf.cast(fields["substep"], tf.int32),
                groups=tf.cast(rows[:, len(_HISTORY_COLUMNS):], tf.bool),
                group_names=tf.constant(self.group_names, tf.string, name="group_names"))

    def write(self, diagnosed, step, substep=0):
        """The op that writes a skipped step's ``Diagnosed`` to the record.

        Args:
          diagnosed: what ``diagnose`` found.
          step: int64 scalar, the global step's value (-1 without one).
          substep: the skipped sub-step's index in a sequence (0 otherwise).

        Returns:
          The write op.
        """
        reason, groups, variables = diagnosed
        counts = self._slices["reason_counts"]
        old = self._values()
        history = self._slices["history"]
        # new = old * kept + written: the counters keep their value and add,
        # the skip's own fields are replaced; the history gets a row.
        written = tf.concat([
            tf.stack([tf.constant(1, tf.int64), step, reason]),
            tf.one_hot(reason, counts[1] - counts[0], dtype=tf.int64),
            groups, groups, variables], 0)
        head = old[:history[0]] * self._kept[:history[0]] + written
        rows = self._history_row(self._fields(old), reason, groups, step, substep)
        return self.variable.assign(tf.concat([head, tf.reshape(rows, [-1])], 0),
                                    read_value=False)

    def _history_row(self, before, reason, groups, step, substep):
        """The history's rows with this skip's row written (see the class
        docstring), given the record's fields ``before`` this skip."""
        rows = self._rows(before)
        last = tf.floormod(before["number"] - 1, self.history)
        previous = tf.gather(rows, last)[_HISTORY_COLUMNS.index("streak")]
        follows = tf.equal(before["global_step"],
                           step - 1 if self._counts_skipped_steps else step)
        consecutive = tf.logical_and(tf.logical_and(tf.greater(before["number"], 0),
                                                    tf.greater_equal(step, 0)), follows)
        holding = [code for code, item in enumerate(self.reasons.reasons) if item.holds_scale]
        counted = tf.reduce_all(tf.not_equal(reason, holding)) if holding else True
        streak = (tf.where(consecutive, previous, tf.constant(0, tf.int64))
                  + tf.cast(counted, tf.int64))
        number = before["number"] + 1
        row = tf.concat([tf.stack([number, step, reason, streak,
                                   tf.constant(substep, tf.int64)]), groups], 0)
        place = tf.one_hot(tf.floormod(number - 1, self.history), self.history,
                           dtype=tf.int64)[:, None]
        return rows * (1 - place) + place * row[None, :]
