"""Phase 0 of the step, the plan: who shares a backprop, a check, a manager
and a gate, decided in plain Python before any TF op exists.

No TensorFlow: the objects given are only compared by identity. Every
cross-group rule is checked here, so a rejected ``build()`` changes nothing.
"""

from __future__ import absolute_import, division, print_function

import collections

from npu_lossscale import seams as _seams


class Group(collections.namedtuple(
        "Group", ["name", "loss", "optimizer", "var_list", "transforms", "manager",
                  "checked", "own_backprop"])):
    """One ``add()``: a loss minimised by an optimizer over variables.

    Attributes:
      name: the group's name (a valid name scope).
      loss: the scalar loss tensor (with in-graph replicas, their mean).
      optimizer: the group's own optimizer.
      var_list: tuple of the variables it updates.
      transforms: tuple of ``seams.GradientTransform``, applied in order to
        the unscaled gradients before the apply.
      manager: the loss-scale manager the group uses.
      checked: whether the manager wants overflowing steps skipped.
      own_backprop: whether the optimizer overrides ``compute_gradients``
        (Horovod's), so its gradients cannot be shared.
    """


class Backprop(collections.namedtuple("Backprop", ["loss", "manager", "groups"])):
    """One gradient computation: a ``loss`` scaled by ``manager``'s scale,
    and the ``groups`` (names) it serves. Groups with one loss and one
    manager share it, unless a group has its own backprop."""


class Check(collections.namedtuple("Check", ["name", "groups"])):
    """One overflow flag (``name``: "shared" or a group's) and the ``groups``
    (names) whose gradients it covers."""


class ManagerUse(collections.namedtuple("ManagerUse", ["name", "manager", "groups",
                                                       "checks"])):
    """A manager, the groups that use its scale, and what it is updated from.

    Attributes:
      name: name scope of its scale snapshot ("shared" for the builder's).
      manager: the manager object.
      groups: tuple of the group names using it (none for the builder's
        when every group brings its own: read, never updated).
      checks: tuple of the check names covering its groups; its update is
        fed with the conjunction of their decisions (True if none).
    """


class Gate(collections.namedtuple("Gate", ["name", "groups", "checks"])):
    """One guarded apply (``name``, a scope): the ``groups`` applied together
    when the ``checks`` they wait for pass (none: always)."""


class Condition(collections.namedtuple("Condition", ["name", "condition"])):
    """A ``seams.SkipCondition`` of the step and the name of its flag."""


class Window(collections.namedtuple("Window", ["steps", "closed_by_update_op"])):
    """The accumulation window: ``steps`` micro-batches per applied step;
    ``closed_by_update_op`` with an engine (``accumulate_op`` adds the
    others), so that collectives run once per window at the top level."""


class Reduction(collections.namedtuple("Reduction", ["engine", "allreduce_gradients"])):
    """How replicas combine: the ``seams.ReductionEngine``, and whether it
    averages the gradients."""

    @property
    def active(self):
        """Whether anything crosses workers before the gate."""
        return _seams.crosses_workers(self.engine)

    @property
    def applies_here(self):
        """Whether this worker applies its step (not a chief for it)."""
        return _seams.applies_here(self.engine)


class Plan(collections.namedtuple(
        "Plan", ["groups", "backprops", "checks", "serial_reads", "managers", "gates",
                 "skip_policy", "window", "reduction", "count_skipped_steps",
                 "gate_kind", "backend", "conditions"])):
    """Everything ``build()`` will make, as plain records.

    Attributes:
      groups: tuple of ``Group``, in ``add()`` order.
      backprops: tuple of ``Backprop``.
      checks: tuple of ``Check``; groups in none of them are never skipped.
      serial_reads: whether each check reads the (shared) status register
        after its own groups' gradients, one after another.
      managers: tuple of ``ManagerUse``; the builder's manager first.
      gates: tuple of ``Gate`` (one for ``skip_policy="all"``, one per group
        for ``"per_group"``).
      skip_policy: "all" or "per_group".
      window: the ``Window``.
      reduction: the ``Reduction``.
      count_skipped_steps: whether ``global_step`` advances on skipped steps.
      gate_kind: "pivot" or "cond" (see ``checks.GATES``).
      backend: the overflow backend every check of the step uses.
      conditions: tuple of ``Condition``: the skip conditions after the
        overflow check, each with its flag's name.
    """

    @property
    def flag_names(self):
        """The checks' flag names, then the conditions'."""
        return tuple(item.name for item in self.checks) + tuple(
            item.name for item in self.conditions)

    def group(self, name):
        """The ``Group`` called ``name``."""
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(name)

    def check_of(self, group_name):
        """The name of the check covering ``group_name``, or None if unchecked."""
        for check in self.checks:
            if group_name in check.groups:
                return check.name
        return None

    def scale_of(self, group_name):
        """The name of the ``ManagerUse`` whose scale ``group_name`` uses."""
        return self.manager_use(self.group(group_name).manager).name

    def manager_use(self, manager):
        """The ``ManagerUse`` of ``manager`` (compared by identity)."""
        for use in self.managers:
            if use.manager is manager:
                return use
        raise KeyError(manager)

    @property
    def losses(self):
        """The distinct loss tensors, in ``add()`` order."""
        return tuple(distinct(group.loss for group in self.groups
                               if group.loss is not None))

    @property
    def group_names(self):
        """Group names in ``add()`` order."""
        return tuple(group.name for group in self.groups)


def distinct(items):
    """Items in first-seen order, without repeats by identity."""
    result = []
    for item in items:
        if not any(item is seen for seen in result):
            result.append(item)
    return result


def choose_gate(gate, on_npu, force_v2_control, control_flow_v2):
    """The gate kind, "pivot" or "cond", for ``gate`` ("auto", "pivot" or
    "cond").

    "auto" builds a ``tf.cond`` under ``ENABLE_FORCE_V2_CONTROL=1``
    (``force_v2_control``) or on Ascend (``on_npu``) with control flow v2,
    since Ascend's adapter functionalizes conds, not raw Switch/Merge
    (docs/design.md, "The gate"); elsewhere the cheaper pivot.
    """
    if gate != "auto":
        return gate
    return "cond" if force_v2_control or (on_npu and control_flow_v2) else "pivot"


def make_plan(groups, manager, backend, skip_policy="all", engine=None,
              allreduce_gradients=True, accumulation_steps=1,
              count_skipped_steps=False, gate_kind="pivot", conditions=()):
    """Decides who shares what in the step, without making any op.

    Args:
      groups: the recorded ``Group`` records, in ``add()`` order.
      manager: the builder's manager (read first, updated if a group uses it).
      backend: the overflow backend; one that ``reads_register`` cannot
        check groups apart in one read.
      skip_policy: "all" or "per_group".
      engine: the distributed engine, or None.
      allreduce_gradients: whether the engine averages the gradients.
      accumulation_steps: micro-batches per applied step, an int >= 1.
      count_skipped_steps: whether ``global_step`` advances on skipped steps.
      gate_kind: "pivot" or "cond", from ``choose_gate``.
      conditions: the ``seams.SkipCondition``s after the overflow check.

    Returns:
      A ``Plan``.

    Raises:
      ValueError: with no groups, or for groups sharing a loss that
        serialised status reads cannot tell apart.
    """
    groups = tuple(groups)
    if not groups:
        raise ValueError("build() got no groups. Call add(loss, optimizer, var_list) "
                         "for each optimizer first.")
    reads_register = backend.reads_register
    serial_reads = skip_policy == "per_group" and reads_register and len(groups) > 1
    if serial_reads:
        _check_no_shared_loss(groups)
    checks = _checks(groups, skip_policy, reads_register, serial_reads)
    engine = _seams.ReductionEngine() if engine is None else engine
    return Plan(
        groups=groups,
        backprops=_backprops(groups),
        checks=checks,
        serial_reads=serial_reads,
        managers=_managers(groups, manager, checks),
        gates=_gates(groups, skip_policy, checks),
        skip_policy=skip_policy,
        window=Window(accumulation_steps,
                      _seams.crosses_workers(engine) and accumulation_steps > 1),
        reduction=Reduction(engine, allreduce_gradients),
        backend=backend,
        count_skipped_steps=count_skipped_steps,
        gate_kind=gate_kind,
        conditions=_conditions(conditions, checks))


def _conditions(conditions, checks):
    """Each condition with a flag name no check or condition has."""
    taken = set(item.name for item in checks)
    result = []
    for condition in conditions:
        name, index = condition.name, 1
        while name in taken:
            name, index = "%s_%d" % (condition.name, index), index + 1
        taken.add(name)
        result.append(Condition(name, condition))
    return tuple(result)


def _check_no_shared_loss(groups):
    for index, group in enumerate(groups):
        for other in groups[:index]:
            if other.loss is group.loss:
                raise ValueError(
                    "groups %r and %r share one loss, which one status register cannot "
                    "check apart. Pass skip_policy='all' or backend='is_finite'."
                    % (other.name, group.name))


def _backprops(groups):
    shared = []  # Backprops of the stock-compute_gradients groups, by (loss, manager)
    own = []
    for group in groups:
        if group.own_backprop:
            own.append(Backprop(group.loss, group.manager, (group.name,)))
            continue
        for index, backprop in enumerate(shared):
            if backprop.loss is group.loss and backprop.manager is group.manager:
                shared[index] = backprop._replace(groups=backprop.groups + (group.name,))
                break
        else:
            shared.append(Backprop(group.loss, group.manager, (group.name,)))
    return tuple(shared) + tuple(own)


def _checks(groups, skip_policy, reads_register, serial_reads):
    """One check per group where groups can (and must) be told apart, else one
    shared check over every checked group."""
    checked = [group for group in groups if group.checked]
    if not checked:
        return ()
    apart = serial_reads or (not reads_register and (
        skip_policy == "per_group" or len(distinct(g.manager for g in checked)) > 1))
    if apart:
        return tuple(Check(group.name, (group.name,)) for group in checked)
    return (Check("shared", tuple(group.name for group in checked)),)


def _managers(groups, manager, checks):
    for group in groups:
        if group.name == "shared" and group.manager is not manager:
            raise ValueError(
                "name 'shared' is the builder's scale scope, so a group with its own "
                "manager cannot take it. Pass another name, e.g. name='shared_net'.")
    result = []
    for candidate, scope in [(manager, "shared")] + [(g.manager, g.name) for g in groups]:
        if any(use.manager is candidate for use in result):
            continue
        names = tuple(g.name for g in groups if g.manager is candidate)
        covering = tuple(check.name for check in checks
                         if any(name in check.groups for name in names))
        result.append(ManagerUse(scope, candidate, names, covering))
    return tuple(result)


def _gates(groups, skip_policy, checks):
    def covering(names):
        return tuple(check.name for check in checks
                     if any(name in check.groups for name in names))

    if skip_policy == "all":
        names = tuple(group.name for group in groups)
        return (Gate("apply_if_finite", names, covering(names)),)
    return tuple(Gate("apply_%s_if_finite" % group.name, (group.name,),
                      covering((group.name,))) for group in groups)
