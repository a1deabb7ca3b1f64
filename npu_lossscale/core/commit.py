"""The commit, inside phase 4 (``close``): the gate, the grouped applies, and
the step counters (the only place ``global_step`` and ``skipped_steps``
move)."""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale.core import graph_copy as _graph_copy
from npu_lossscale.core import graph_state as _graph_state
from npu_lossscale.core import graph_walk as _graph_walk


def run_if(pred, build, name, data=None, existing=(), otherwise=None):
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
      existing: ops made before (batch-norm updates) that must run only on
        True steps: the pivot becomes one of their control inputs.
      otherwise: None, or ``build``'s mirror for False steps: called with
        the name scope under the Switch's false output (``pivot_f``), whose
        ops run only when ``pred`` is False (the skip branch). On True steps
        they are dead, as ``build``'s are on False steps: nothing of them
        runs.

    Returns:
      ``data``'s value, live on every step: on True steps it follows
      everything ``build`` returned, on False steps everything ``otherwise``
      returned.
    """
    with tf.name_scope(name) as scope:
        pred = tf.convert_to_tensor(pred)
        data = pred if data is None else data
        when_false, when_true = tf.raw_ops.Switch(data=data, pred=pred, name="switch")
        pivot = tf.identity(when_true, name="pivot_t")
    with tf.control_dependencies([pivot]):
        done = list(build(scope.rstrip("/"))) + list(existing)
    for op in existing:
        _graph_state.add_control_input(op, pivot.op)
    with tf.control_dependencies([pivot]):
        with tf.control_dependencies(done), tf.name_scope(scope):
            ran = tf.identity(pivot, name="ran")
    if otherwise is not None:
        with tf.name_scope(scope):
            pivot_f = tf.identity(when_false, name="pivot_f")
        with tf.control_dependencies([pivot_f]):
            skipped = list(otherwise(scope.rstrip("/")))
            with tf.control_dependencies(skipped), tf.name_scope(scope):
                when_false = tf.identity(pivot_f, name="skipped")
    with tf.name_scope(scope):
        return tf.raw_ops.Merge(inputs=[when_false, ran], name="merge")[0]


class Apply(collections.namedtuple("Apply", ["name", "optimizer", "grads_and_vars"])):
    """One optimizer's apply behind a gate.

    Attributes:
      name: the group's name (the apply op is ``<gate>/<name>``).
      optimizer: the optimizer.
      grads_and_vars: the (gradient, variable) pairs to apply.
    """


def cond_if(pred, build, name, existing=(), otherwise=None):
    """``run_if`` as a ``tf.cond``: no raw Switch/Merge of ours.

    Under control flow v2 this is one functional ``If`` op, which Ascend's
    adapter keeps as it is; under v1 control flow a v1 cond, which the
    adapter's ``ENABLE_FORCE_V2_CONTROL=1`` functionalization converts (a raw
    Switch/Merge pair it does not). Dearer than the pivot on CPU/GPU: a v1
    cond switches every captured tensor.

    Args:
      pred: bool scalar.
      build: called with the branch's name scope (no trailing "/"); returns
        the ops or tensors the result must follow.
      name: the name of the cond.
      existing: ops made before (batch-norm updates) that must run only on
        True steps: each is copied into the true branch (same type, inputs
        and attributes), and only the copy runs.
      otherwise: None, or ``build``'s mirror for the false branch (the skip
        branch), called with that branch's name scope.

    Returns:
      A bool scalar: ``pred``, after everything ``build`` returned when True
      (``otherwise`` when False).
    """
    def when_true():
        with tf.name_scope(name) as scope:
            done = list(build(scope.rstrip("/"))) + [_graph_copy.copy_op(op) for op in existing]
        with tf.control_dependencies(done):
            return tf.constant(True)

    def when_false():
        if otherwise is None:
            return tf.constant(False)
        with tf.name_scope("skipped") as scope:
            skipped = list(otherwise(scope.rstrip("/")))
        with tf.control_dependencies(skipped):
            return tf.constant(False)

    return tf.cond(pred, when_true, when_false, name=name)


def gate(kind, pred, build, name, existing=(), otherwise=None):
    """``run_if`` for kind "pivot", ``cond_if`` for kind "cond".

    ``existing`` ops run only on True steps: under the pivot gate the
    originals get the pivot as a control input (so fetching them elsewhere
    is gated too), unless they are ``Copies``; under the cond gate, and for
    ``Copies``, copies made inside the gate run instead of the originals.
    ``otherwise`` builds the ops of False steps (the skip branch), or None.
    The result's op is recorded as a step's gate (``check_update_ops``).
    """
    if kind == "cond":
        applied = cond_if(pred, build, name, existing, otherwise=otherwise)
    elif isinstance(existing, Copies):
        applied = run_if(pred, lambda scope: list(build(scope)) + [
            _graph_copy.copy_op(op) for op in existing], name, otherwise=otherwise)
    else:
        applied = run_if(pred, build, name, existing=existing, otherwise=otherwise)
    _mark_gate(applied)
    return applied


class Copies(tuple):
    """Update ops to run as copies made inside a gate, the originals left as
    they are (another gate already holds them)."""


def _mark_gate(applied):
    """Records the op of a gate's result (and a v2 cond's ``If`` behind its
    output identity) as a step's gate, in its graph's ``GraphState``."""
    op = applied.op
    gates = _graph_state.of(op.graph).gates
    gates.add(op.name)
    gates.update(tensor.op.name for tensor in op.inputs
                 if tensor.op.type in _graph_walk.CONTROL_FLOW_TYPES)


def guarded_apply(is_finite, applies, global_step=None, name="apply_if_finite",
                  kind="pivot", update_ops=(), on_skip=None, on_apply=None):
    """Applies every ``Apply``, or nothing at all when not finite (``run_if``).

    Args:
      is_finite: bool scalar; None when nothing can skip (no check, no
        condition): the applies and the updates are built with no gate.
      applies: list of ``Apply``.
      global_step: a variable advanced by one on finite steps, or None.
      name: the name scope of the gate.
      kind: "pivot" or "cond" (``gate``).
      update_ops: ops made before (batch-norm statistics) that run only
        when the gate applies.
      on_skip: None, or the builder of the ops that run only when the gate
        skips (the gate's ``otherwise``).
      on_apply: None, or a function returning further ops to run only
        when the gate applies.

    Returns:
      A bool scalar tensor: True when this run applied the updates.
    """
    def apply_all(scope):
        # Optimizer state (Adam's beta powers) is named after the name scope
        # current at apply_gradients(). From the root scope it gets the names
        # plain training gives it, so checkpoints stay interchangeable; the
        # update ops still go under this scope through `name`.
        with tf.name_scope(None):
            updates = [item.optimizer.apply_gradients(
                item.grads_and_vars, name="%s/%s" % (scope, item.name)) for item in applies]
        if on_apply is not None:
            updates = updates + list(on_apply())
        if global_step is not None:
            with tf.control_dependencies(updates):
                updates = [_increment(global_step)]
        return updates

    if is_finite is None:  # nothing can skip: no gate
        with tf.name_scope(name) as scope:
            done = list(apply_all(scope.rstrip("/")))
            if isinstance(update_ops, Copies):
                done += [_graph_copy.copy_op(op) for op in update_ops]
            with tf.control_dependencies(done + list(update_ops)):
                return tf.constant(True, name="applied")
    return gate(kind, is_finite, apply_all, name, existing=update_ops, otherwise=on_skip)


class SkippedSteps(object):
    """The checkpointed count of steps on which some group did not apply.

    ``variable`` is ``<scope>/skipped_steps`` (int64, not trainable), with
    ``<scope>`` the name scope current at construction; ``before`` is its
    value before this run's increment, read once per run (a ``Snapshot``: a
    ref variable's identity would alias the buffer the increment
    overwrites). Both are made on first use (``graph_state.outside``).
    """

    def __init__(self):
        self._scope = _graph_state.current_scope()
        self._made = None

    def _make(self):
        if self._made is None:
            with _graph_state.outside(self._scope):
                variable = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_steps")
                before = tf.raw_ops.Snapshot(input=variable.read_value(),
                                             name="skipped_steps_before")
            self._made = (variable, before)
        return self._made

    @property
    def variable(self):
        """The counter variable."""
        return self._make()[0]

    @property
    def before(self):
        """Its value before this run's increment."""
        return self._make()[1]

    def increment(self, by):
        """``+= by`` (a bool), after this run's ``before`` was read."""
        with tf.control_dependencies([self.before]):
            return _increment(self.variable, by=by)


class Committed(collections.namedtuple("Committed", ["applied", "ops"])):
    """What the commit made.

    Attributes:
      applied: bool scalar, True when this run applied (any group).
      ops: the gates and the step counters' increments; anything that must
        follow the applies (the manager updates) depends on these.
    """


def commit(plan, grads, decisions, global_step, skipped_steps=None, update_ops=(),
           on_skip=None, on_apply=None):
    """The plan's gates, each applying its groups when its checks and the
    step's skip conditions pass.

    This is the only place the step counters move: ``global_step`` by one
    inside the gate with a single gate, by one if any gate applied with
    several, or by one on every step (after the gates) with
    ``plan.count_skipped_steps``; ``skipped_steps`` by one on every step on
    which some group did not apply.

    Args:
      plan: the ``plan.Plan``.
      grads: ordered dict from group name to the pairs to apply.
      decisions: the step's ``close.Decisions``.
      global_step: an integer variable, or None.
      skipped_steps: the ``SkippedSteps`` counter, or None.
      update_ops: ops (batch-norm statistics) that run only on steps where
        every group applies.
      on_skip: None, or the builder of ops that run only on steps where
        some group does not apply (``diagnosis.Diagnosis.skip_branch``):
        the single gate's skip branch, or with several gates the skip branch
        of the gate of ``update_ops`` (or of one of its own), so that an
        applied step runs none of it. Any ``global_step`` increment follows
        it.
      on_apply: None, or a function returning ops to run only on steps
        where every group applies (the skip conditions' ``on_apply``).

    Returns:
      A ``Committed``.
    """
    def applies(item):
        return [Apply(name, plan.group(name).optimizer, grads[name]) for name in item.groups]

    conditions = [item.name for item in plan.conditions]
    counted_inside = None if plan.count_skipped_steps else global_step

    def decision(names):
        return decisions.all_of(names) if plan.flag_names else None

    if len(plan.gates) == 1:
        item = plan.gates[0]
        applied = guarded_apply(decision(list(item.checks) + conditions),
                                applies(item), counted_inside, item.name, plan.gate_kind,
                                update_ops, on_skip=on_skip, on_apply=on_apply)
        ops, every_group = [applied], applied
    else:
        ops = [guarded_apply(decision(list(item.checks) + conditions), applies(item),
                             name=item.name, kind=plan.gate_kind)
               for item in plan.gates]
        applied = tf.reduce_any(tf.stack(ops[:len(plan.gates)]))
        every_group = tf.reduce_all(tf.stack(ops[:len(plan.gates)]))
        if update_ops and not plan.flag_names:  # nothing can skip: no gate
            ops.append(tf.group(*([_graph_copy.copy_op(op) for op in update_ops]
                                  if isinstance(update_ops, Copies) else update_ops)))
        elif update_ops or on_apply is not None:
            every = decisions.all_of(list(plan.flag_names), name="all_finite")
            ops.append(gate(plan.gate_kind, every,
                            lambda scope: [] if on_apply is None else list(on_apply()),
                            "update_ops_if_finite", existing=update_ops, otherwise=on_skip))
        elif on_skip is not None:
            skip_gate = cond_if if plan.gate_kind == "cond" else run_if
            ops.append(skip_gate(every_group, lambda scope: [], "diagnose_if_skipped",
                                 otherwise=on_skip))
        if counted_inside is not None:
            # After the skip branch, which reads global_step.
            with tf.control_dependencies(ops[len(plan.gates):]):
                ops.append(_increment(counted_inside, by=applied))
    if plan.count_skipped_steps and global_step is not None:
        with tf.control_dependencies(ops):
            ops = ops + [_increment(global_step)]
    if skipped_steps is not None and plan.flag_names:
        ops.append(skipped_steps.increment(tf.logical_not(every_group)))
    return Committed(applied, ops)


def _increment(global_step, by=None):
    """``global_step += by`` (1 by default, or a bool tensor cast to 0/1)."""
    dtype = global_step.dtype.base_dtype
    amount = tf.ones([], dtype) if by is None else tf.cast(by, dtype)
    return tf.assign_add(global_step, amount).op
