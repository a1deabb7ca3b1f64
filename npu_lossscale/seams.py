"""The step's four declared extension points.

The step (``core``) names no optional capability. Each one plugs into one
of these seams, and a new one is a subclass, passed in, with no edit to the
library:

* ``GradientTransform``: a group's unscaled gradients, changed before they
  are applied (``add(transform_grads_fn=...)``, ``clip_norm``);
* ``SkipCondition``: a further reason to skip a step, through the same gate
  (``build(skip_global_steps=..., skip_loss_spikes=...)``); the overflow
  check is the first of them;
* ``StepObserver``: what reads the step: the skip diagnosis, the underflow
  measurement, the listening manager's hearing, the measured first scale;
* ``ReductionEngine``: how the flags and gradients of replicas combine:
  in-graph towers, Horovod, HCCL, a SyncReplicasOptimizer's chief.

Each hook receives a ``StepState``: what the step has made so far, in the
seams' own records (``PlanView``, ``GroupView``, ``ManagerView``,
``CheckView``, ``ConditionView``, ``BackendView``, ``ScaleView``,
``CloseView``), which the step makes from its own.
"""

from __future__ import absolute_import, division, print_function

import collections
import contextlib

__all__ = ["GradientTransform", "SkipCondition", "StepObserver", "ReductionEngine",
           "StepState", "Hooked", "GroupView", "ManagerView", "PlanView", "CheckView",
           "ConditionView", "BackendView", "ScaleView", "CloseView"]


class _ClassName(object):
    """The class's name, until a subclass or an instance sets its own."""

    def __get__(self, instance, owner):
        return owner.__name__


class GroupView(collections.namedtuple(
        "GroupView", ["name", "loss", "var_list", "optimizer", "manager", "checked",
                      "own_backprop", "transforms"], defaults=((),))):
    """One group of the step (one ``add()``), as the hooks see it.

    Attributes:
      name: the group's name (a valid name scope).
      loss: its scalar loss tensor (with in-graph towers, their mean); None
        for given gradients.
      var_list: tuple of the variables it updates.
      optimizer: its optimizer.
      manager: the loss-scale manager whose scale it uses.
      checked: whether an overflow check covers its gradients (its manager
        skips overflowing steps).
      own_backprop: whether its optimizer computes its own gradients (it
        overrides ``compute_gradients``, as Horovod's does), which no other
        group then shares.
      transforms: tuple of its ``GradientTransform``s, in order.
    """


class ManagerView(collections.namedtuple("ManagerView", ["name", "manager", "groups"])):
    """One loss-scale manager of the step and the names of the ``groups``
    that use its scale (none for the builder's own when every group brings
    one); ``name`` scopes its ops ("shared" for the builder's)."""


class CheckView(collections.namedtuple("CheckView", ["name", "groups"])):
    """One overflow check of the step: its flag's ``name`` ("shared" or a
    group's) and the names of the ``groups`` whose gradients it covers."""


class ConditionView(collections.namedtuple("ConditionView", ["name", "condition"])):
    """One ``SkipCondition`` of the step and its flag's ``name``."""


class BackendView(collections.namedtuple("BackendView", ["reads_register", "gives_evidence",
                                                         "on_npu"])):
    """The step's overflow backend: whether it ``reads_register`` (a float
    status register, which saturates), ``gives_evidence`` (its flag follows
    the gradients' own values) and runs ``on_npu`` (Ascend)."""


class PlanView(collections.namedtuple(
        "PlanView", ["groups", "managers", "gate_kind", "engine", "checks", "conditions",
                     "backend", "crosses_workers", "window_steps"],
        defaults=((), (), BackendView(False, False, False), False, 1))):
    """The step's groups and managers, as the hooks see them.

    Attributes:
      groups: tuple of ``GroupView``, in ``add()`` order (a per-group op's
        holds its own group).
      managers: tuple of ``ManagerView``, the builder's first.
      gate_kind: "pivot" or "cond", the step's gate (``build(gate=...)``).
      engine: the step's ``ReductionEngine``.
      checks: tuple of ``CheckView``; groups in none are never skipped.
      conditions: tuple of ``ConditionView``, after the checks, in order.
      backend: the ``BackendView``.
      crosses_workers: whether the engine combines workers before the gate.
      window_steps: micro-batches per applied step (1: no accumulation).
    """

    @property
    def group_names(self):
        """The groups' names, in order."""
        return tuple(group.name for group in self.groups)

    def group(self, name):
        """The ``GroupView`` called ``name`` (KeyError if none)."""
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(name)


class ScaleView(collections.namedtuple("ScaleView", ["value", "inverse", "is_unit"])):
    """One manager's loss scale as this run reads it: ``value``, a float32
    scalar that every use in the step reads; ``inverse``, ``1 / value``;
    ``is_unit``, True when the scale is the constant 1."""


class CloseView(collections.namedtuple("CloseView", ["flags", "grads", "mean_over",
                                                     "loss_flags", "transformed"])):
    """What the close of a step decides on.

    Attributes:
      flags: ordered dict from check or condition name to float32 flag,
        before the reduction across workers.
      grads: ordered dict from group name to (gradient, variable) pairs:
        this run's unscaled gradients, or an accumulation window's sums.
      mean_over: the number of micro-batches ``grads`` sum (1 without
        accumulation).
      loss_flags: for an accumulation window, ordered dict from group name
        to the count of its micro-batches whose loss was not finite; None
        when the losses themselves are at hand.
      transformed: ordered dict from group name to the pairs its transforms
        returned, for the groups whose transforms may turn finite values
        into non-finite ones; None where the close transformed nothing.
    """


class StepState(collections.namedtuple(
        "StepState", ["plan", "global_step", "scales", "scaled", "grads", "flags",
                      "closing", "reduced_flags", "window_end", "loss_scales"])):
    """What the step has made when a hook is called (None: not yet).

    Attributes:
      plan: the ``PlanView``: its ``groups`` (``GroupView``: ``name``,
        ``loss``, ``var_list``, ``optimizer``, ``manager``), ``group_names``
        and ``managers``.
      global_step: the integer variable the step advances, or None.
      scales: ordered dict from a ``ManagerView``'s name to the
        ``ScaleView`` read this run (empty for given gradients).
      scaled: ordered dict from group name to its (gradient, variable)
        pairs, still multiplied by the loss scale (empty for given
        gradients).
      grads: ordered dict from group name to this run's unscaled pairs,
        before the reduction across workers, an accumulation window's mean
        and every transform (``clip_norm`` too, though the step fuses it
        into the unscale): the same with and without them. In-graph
        towers' pairs are combined (``combine_replicas``).
      flags: ordered dict from check or condition name to this run's
        float32 flag, 0.0 to apply.
      closing: at the close, the ``CloseView`` it decides on (this run's,
        or an accumulation window's sums and flags).
      reduced_flags: at the close, the flags after the reduction across
        replicas and workers.
      window_end: for ``report`` in an accumulation window closed by
        ``update_op`` itself, the bool that this run closes the window
        (``closing`` is then the window as the run sees it, read without
        writing); None when the run closes its step.
      loss_scales: ordered dict from group name to the float32 loss scale
        its gradients were scaled by this run (empty for given gradients).
    """

    def __new__(cls, plan, global_step=None, scales=None, scaled=None, grads=None,
                flags=None, closing=None, reduced_flags=None, window_end=None,
                loss_scales=None):
        return super(StepState, cls).__new__(cls, plan, global_step, scales, scaled, grads,
                                             flags, closing, reduced_flags, window_end,
                                             loss_scales)


class Hooked(collections.namedtuple("Hooked", ["ops", "entry_ops"])):
    """Ops an observer added, and the ops every write of them follows (the
    step's run-time claim attaches there; empty when they write nothing)."""

    def __new__(cls, ops=(), entry_ops=()):
        return super(Hooked, cls).__new__(cls, tuple(ops), tuple(entry_ops))


class GradientTransform(object):
    """Changes one group's unscaled gradients before the apply.

    Called per group at the close, after the reduction across replicas (and
    the mean of an accumulation window), before the decision: on a step
    that skips, what it returns is never applied, and when ``keeps_finite``
    is False the step's overflow check also covers what it returns (a skip
    for its own inf or NaN is diagnosed as ``<name>_not_finite``, and the
    loss scale holds on it: the transform failed, not the scale). Its ops
    run before the gate, so state a transform keeps (a variable it assigns)
    moves on skipped steps too, and each ``per_group_ops`` op calls it
    again, with a copy of that state: keep such state in a
    ``SkipCondition.on_apply``.

    Example::

      class Scale(GradientTransform):
          keeps_finite = True

          def __init__(self, factor):
              self.factor = factor

          def transform(self, group, grads_and_vars):
              return [(g * self.factor, v) for g, v in grads_and_vars]

    Attributes:
      name: names the transform in messages; the class name by default.
      keeps_finite: a bool, True when finite gradients in always give
        finite gradients out (a clip by a finite norm), so no check of the
        output is needed. Default False.
    """

    name = _ClassName()
    keeps_finite = False

    def transform(self, group, grads_and_vars):
        """The pairs to apply.

        Args:
          group: the ``GroupView`` (its ``name``, ``var_list``...).
          grads_and_vars: list of (gradient, variable) pairs, unscaled.

        Returns:
          A list of (gradient, variable) pairs: one for each variable it was
          given, in any order, each gradient of its variable's dtype and
          shape.
        """
        raise NotImplementedError("%s must implement transform(group, grads_and_vars)."
                                  % type(self).__name__)

    def unscale_factor(self, group, scaled_pairs, inverse):
        """Optional: one scalar that unscales and transforms at once.

        A transform that multiplies every gradient by one scalar (a clip by
        the global norm) overrides this; when it is a group's only transform
        and the unscaled gradients are the ones applied (no accumulation
        window, no reduction across workers), the step multiplies the scaled
        gradients by this scalar instead of unscaling and then calling
        ``transform``. Otherwise ``transform`` is called.

        Args:
          group: the ``GroupView``.
          scaled_pairs: its scaled (gradient, variable) pairs.
          inverse: float32 scalar, one over the loss scale.

        Returns:
          A float32 scalar tensor computed from ``inverse``: ``inverse``
          times the transform's factor.
        """
        raise NotImplementedError("%s does not fuse with the unscale."
                                  % type(self).__name__)

    @classmethod
    def fuses_with_unscale(cls):
        """True when the class overrides ``unscale_factor``."""
        return cls.unscale_factor is not GradientTransform.unscale_factor


class SkipCondition(object):
    """A further in-graph reason to skip a step, through the step's gate.

    Its flag joins the overflow flags: summed across replicas and the
    micro-batches of an accumulation window, and a step applies only when
    every flag is 0.0. A step that it skips is counted in
    ``skipped_steps``, diagnosed with its reason, and, unless
    ``moves_scale``, leaves every loss scale where it was.

    Example::

      class SkipWhenNegative(SkipCondition):
          reason = "negative_loss"
          fix = "the loss went negative: check the data."

          def flag(self, state):
              # Every group of the step: a per-group op's plan holds its own.
              losses = [tf.cast(group.loss, tf.float32) for group in state.plan.groups]
              return tf.cast(tf.reduce_any(tf.stack(losses) < 0.0), tf.float32)

    Attributes:
      name: names its flag (a name scope); the class name by default.
      reason: the reason code's name, a str, added to the builder's own
        reasons (``diagnostics.reasons.collect``): a new one, or one another
        condition of the builder gives with the same ``fix`` and
        ``moves_scale`` (the checks' own reasons, such as "applied" or
        "gradients_overflowed", are not a condition's).
      fix: what to do about a skip for this reason, one sentence.
      moves_scale: whether a skip for this reason counts as an overflow
        for the loss-scale managers, a bool. Default False.
    """

    name = _ClassName()
    reason = None
    fix = ""
    moves_scale = False

    def check_plan(self, plan, options, global_step, api):
        """Optional: refuses a ``PlanView`` the condition cannot run
        (ValueError), before any op. Default: accepts."""

    def flag(self, state):
        """This run's flag: a float32 scalar, 0.0 to apply; any other value
        (1.0, a negative one, NaN) skips, and counts as 1.0.

        Built at the top level of the graph, after the gradients.

        Args:
          state: the ``StepState`` (``plan``, ``global_step``, ``grads``).

        Returns:
          A float32 scalar tensor.
        """
        raise NotImplementedError("%s must implement flag(state)." % type(self).__name__)

    def on_apply(self, state):
        """Ops to run only on steps where every group applies (e.g. a
        moving average of the loss). Default: none.

        Returns:
          A list of ops.
        """
        del state
        return []


class StepObserver(object):
    """Reads the step where it runs today: before the scale read, before the
    managers' updates, in the skip branch, or when fetched.

    Each hook may return nothing. An applied step pays only for what
    ``before_scale_read`` and ``before_update`` add.

    Attributes:
      name: names the observer; the class name by default.
    """

    name = _ClassName()

    def check_plan(self, plan, options, global_step, api):
        """Optional: refuses a ``PlanView`` the observer cannot read
        (ValueError), before any op. Default: accepts."""

    def before_scale_read(self, state):
        """Ops every scale read of this run follows. Default: none.

        Returns:
          A ``Hooked``.
        """
        del state
        return Hooked()

    def before_update(self, state):
        """Ops the managers' updates follow, built after the overflow
        flags. Default: none.

        Returns:
          A ``Hooked``.
        """
        del state
        return Hooked()

    def on_skip(self, state):
        """Ops built in the gate's skip branch: they run only on a step
        that skips. Default: none.

        Returns:
          A list of ops.
        """
        del state
        return []

    def report(self, state):
        """Tensors for the user to fetch (run only when fetched), built
        after the overflow flags. Default: None.

        Returns:
          Anything; the builder hands it back.
        """
        del state
        return None


class ReductionEngine(object):
    """How the flags and gradients of replicas combine into one decision.

    The default is one replica on one worker. In-graph replicas (towers)
    give each group (a ``GroupView``) one loss per replica, each
    differentiated in ``replica_scope``, combined by ``combine_replicas``;
    workers sum their flags and average their gradients in ``reduce``, at
    the top level of the graph (never inside a cond: workers that disagree
    would deadlock).

    Attributes:
      name: names the engine in messages; the class name by default.
      mode: "local" (one worker), "workers" (``reduce`` combines workers
        before the gate) or "chief" (``close`` hands each worker's step to a
        chief, which decides on the aggregate: the SyncReplicas entry point's
        own, handed core records, no seam for a user's engine). Read in this
        module alone: the step asks ``crosses_workers(engine)``,
        ``applies_here(engine)`` and ``wrap_close``.
    """

    name = _ClassName()
    mode = "local"

    def wrap_close(self, close):
        """The close the step runs, given the core's own.

        Args:
          close: ``close(plan, closing, global_step, skipped_steps,
            update_ops, observers, state)``, which returns a
            ``core.close.Closed``.

        Returns:
          A function of the same arguments: ``close`` itself by default;
          with mode "chief", one that hands the step to ``self.close``.
        """
        if applies_here(self):
            return close

        def handed_to_chief(plan, closing, global_step, skipped_steps=None, update_ops=(),
                            observers=(), state=None):
            del update_ops, state  # the chief's sync op runs the step's writes
            return self.close(plan, closing, global_step, skipped_steps, observers)

        return handed_to_chief

    def check_plan(self, plan, options, global_step, api):
        """Refuses a step the engine cannot run (ValueError), before any op.

        Args:
          plan: the step's ``PlanView``.
          options: the build's options, as the public API took them
            (``accumulation_steps``, ``count_skipped_steps``, ``engine``...).
          global_step: the integer variable the step advances, or None.
          api: the public name being built, for messages.
        """

    def replica_losses(self, group):
        """The group's loss per in-graph replica. Default: its one loss."""
        return (group.loss,)

    def replica_scope(self, group, index):
        """Where replica ``index``'s backprop is built. Default: as is."""
        del group, index
        return contextlib.suppress()

    def combine_replicas(self, group, per_replica):
        """One list of pairs from the replicas' lists. Default: the one."""
        del group
        return per_replica[0]

    def reduce(self, flags, grads, allreduce_gradients):
        """The flags summed and the gradients averaged across workers.

        Args:
          flags: ordered dict from name to float32 flag.
          grads: ordered dict from group name to (gradient, variable) pairs.
          allreduce_gradients: whether to average the gradients too.

        Returns:
          ``(flags, grads)``, new ordered dicts. Default: as given.
        """
        del allreduce_gradients
        return flags, grads

    def close(self, plan, closing, global_step, skipped_steps, observers=()):
        """With mode "chief": this worker's close (push and wait); the
        chief's close gives ``observers`` its skip branch. Returns a
        ``core.close.Closed``."""
        raise NotImplementedError("%s has mode %r but no close()." % (type(self).__name__,
                                                                     self.mode))


def crosses_workers(engine):
    """Whether ``engine``'s ``reduce`` combines workers before the gate (mode
    "workers"): its result is checked, and an accumulation window runs it
    once, in ``update_op``."""
    return engine.mode == "workers"


def applies_here(engine):
    """Whether a step with ``engine`` applies what this worker computes and
    moves its own state: False with mode "chief", whose chief applies the
    aggregate (so no transform fuses with this worker's unscale)."""
    return engine.mode != "chief"
