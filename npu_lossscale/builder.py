"""One loss-scaled, overflow-checked update op for several optimizers.

The steps a user takes::

  scaler = MultiOptimizerLossScale(DynamicLossScaleManager())
  scaler.add(d_loss, d_opt, var_list=d_vars, name="discriminator")
  scaler.add(g_loss, g_opt, var_list=g_vars, name="generator")
  train = scaler.build(global_step=tf.train.get_or_create_global_step())
  sess.run({"train": train.update_op, "finite": train.is_finite, ...})

``build`` checks its arguments, then runs the step of ``step.py`` under the
name scope ``loss_scale/`` (once more per group with ``per_group_ops``):
plan (``plan``), gradients (``gradients``), overflow (``overflow``), the
accumulation window (``window``), close (``close``: reduce, decide, commit,
manager update), and the run-time claims (``claims``).
"""

from __future__ import absolute_import, division, print_function

from npu_lossscale import assembly as _assembly
from npu_lossscale import backends as _backends
from npu_lossscale.core import checks as _checks
from npu_lossscale.core import context as _context
from npu_lossscale.core import hooks as _hooks
from npu_lossscale import groups as _groups
from npu_lossscale import manager_protocol as _managers
from npu_lossscale.core import step as _step
from npu_lossscale.core import update_ops as _update_ops
from npu_lossscale import sugar as _sugar
from npu_lossscale import train_ops as _train_ops
# What build() returns, defined with the step ops it is made of.
from npu_lossscale.train_ops import GroupReport, SkipReport, TrainOps  # noqa: F401

#: The clip_norm values for which clip_by_global_norm stays exact
#: (``transforms.CLIP_NORM_RANGE``).
CLIP_NORM_RANGE = _sugar.CLIP_NORM_RANGE


@_sugar.documents("init")
class MultiOptimizerLossScale(object):
    """Loss scaling for several optimizers, with one decision per step.

    Each ``add`` registers a group: a loss, its optimizer and its variables.
    ``build`` returns one update op that computes every group's scaled
    gradients, checks them for overflow once, and applies all groups or none
    behind a single gate. The loss scale, the skip decision and the global
    step are shared by all groups unless you ask otherwise.

    Example::

      scaler = MultiOptimizerLossScale(DynamicLossScaleManager())
      scaler.add(d_loss, tf.train.AdamOptimizer(2e-4), var_list=d_vars, name="d")
      scaler.add(g_loss, tf.train.AdamOptimizer(2e-4), var_list=g_vars, name="g")
      train = scaler.build(global_step=tf.train.get_or_create_global_step())
      sess.run(train.update_op)

    Args:
      loss_scale_manager: any object with ``get_loss_scale()`` and
        ``update_loss_scale(finite)``: this package's managers, npu_bridge's or
        tf.contrib's. Groups use it unless they bring their own.
      backend: "auto" (npu when ``npu_bridge`` imports, else is_finite),
        "is_finite" (CPU/GPU), "npu" (Ascend: is_finite in INF/NaN mode, the
        float-status register in saturation mode, decided at ``build()`` from
        ``npu_plugin.is_inf_nan_enabled()`` as npu_bridge does) or
        "float_status" (always the register), or a ``backends.Backend``
        instance (your own check). ``backend`` tells the result.
      skip_policy: "all" (default): an overflow in any group skips every
        group. "per_group": each group applies if and only if its own
        gradients are finite. On the float-status register, which cannot
        tell groups apart, the status is read once per group, each group's
        backprop after the previous group's read, and never cleared between:
        a group skips when it or a group added before it overflowed, or when
        any op that ran before its read did (a forward op it shares with a
        later group, or that group's forward pass, which TF may schedule
        early). No group misses its own overflow.
      SUGAR_KEYWORDS
      allreduce_gradients: with ``distributed``, average the gradients across
        workers (outside the gate). Pass False when the optimizers already do
        it (``hvd.DistributedOptimizer``) or for worker-local gradients such
        as SOK embeddings. With accumulation the window's summed gradients
        and flags are reduced once per window, by ``update_op``; the
        micro-batches before it run ``accumulate_op``, which holds no
        collective, so no collective ever needs a cond around it.
      gate: how the apply gate is built. "auto" (default): a ``tf.cond``
        where Ascend needs one (``ENABLE_FORCE_V2_CONTROL=1`` set, or the npu
        backend with control flow v2 on, as for dynamic shapes), else the
        cheaper pivot (one Switch/Merge). "cond" forces the ``tf.cond`` (a
        functional ``If`` under control flow v2; needs resource variables
        there), "pivot" the Switch/Merge.
      skip_history: how many skips the record's history keeps
        (``TrainOps.diagnosis.recent_skips``), an int >= 1. The default,
        1000, keeps every skip of a device loop of ModelZoo's usual
        ``iterations_per_loop=1000``.

    Raises:
      TypeError: if the manager lacks the protocol, a flag is not a bool, or
        backend is neither a name nor a ``Backend`` instance.
      ValueError: for an unknown backend name, skip policy or engine, "npu"
        without npu_bridge, an engine that is missing or not initialised,
        eager mode, or a ``tf.distribute`` strategy with several replicas.
    """

    def __init__(self, loss_scale_manager, backend="auto", skip_policy="all",
                 distributed=None, allreduce_gradients=True, gate="auto",
                 allreduce_float16=False, skip_history=_assembly.DEFAULT_HISTORY):
        _context.require_graph_mode("MultiOptimizerLossScale")
        self._skip_history = _checks.check_count(
            "skip_history", skip_history,
            "Pass how many skips the record keeps, e.g. %d." % _assembly.DEFAULT_HISTORY)
        _managers.check_manager(loss_scale_manager)
        _checks.check_bool(
            "allreduce_gradients", allreduce_gradients,
            "Pass False when the optimizers already allreduce their gradients.")
        _checks.check_skip_policy(skip_policy)
        _checks.check_gate(gate)
        self._gate = gate
        self._manager = loss_scale_manager
        self._requested_backend = backend
        _backends.resolve_backend(backend, warn=False)  # refuses a bad backend now
        self._skip_policy = skip_policy
        self._engine = _sugar.resolve(
            "init", "MultiOptimizerLossScale()",
            {"distributed": distributed, "allreduce_float16": allreduce_float16}).engine
        self._independent = distributed is False
        _assembly.check_no_strategy("MultiOptimizerLossScale")
        self._allreduce_gradients = allreduce_gradients
        self._groups = []
        self._loss_fns = {}  # group name -> the loss callable add() took
        self._towers = {}  # group name -> its tower losses
        self._built = False

    @property
    def backend(self):
        """The name of the check the step would use now: "is_finite", "npu"
        (the register), or the name of the ``Backend`` instance passed.

        "npu" and "auto" follow the Ascend device's overflow mode, which is
        read again by ``build()``: is_finite in INF/NaN mode (the default on
        Atlas A2/A3), the float-status register in saturation mode.
        """
        return _backends.resolve_backend(self._requested_backend, warn=False).name

    @_sugar.documents("add")
    def add(self, loss, optimizer, var_list=None, name=None, clip_norm=None,
            loss_scale_manager=None, transform_grads_fn=None):
        """Registers a group: a loss minimised by an optimizer over variables.

        Only records the group (after checking each argument); no op is made
        until ``build()``.

        Args:
          loss: a floating-point scalar tensor (float16 is fine), or a
            callable taking no argument that returns one: called once here
            (its loss is checked and used by ``update_op``), and again by
            each sub-step of ``build(sequence=...)``, so it must reuse its
            variables (``tf.AUTO_REUSE``) and read its input inside.
            Groups may share one loss tensor; its backprop is then computed
            once. A list of losses is one per in-graph tower, each built on
            its own device: each tower's gradients are computed beside its
            forward ops and the towers' gradients averaged, with one
            decision for all (``distributed.towers``).
          optimizer: a ``tf.compat.v1.train.Optimizer``, not shared with
            another group and not already loss-scale wrapped; on parameter
            servers, an ``npu_lossscale.SyncReplicasOptimizer``.
          var_list: the variables this optimizer updates; defaults to every
            trainable variable (only sensible with a single group).
          name: the group's name (a valid name scope); defaults to
            ``group_<index>``. Keys the dicts of ``TrainOps``.
          SUGAR_KEYWORDS
          loss_scale_manager: a manager for this group alone (its own scale
            and its own updates, as Apex's ``num_losses``); defaults to the
            builder's.

        Returns:
          The group's name.

        Raises:
          TypeError: for a non-tensor or non-float loss, a wrong optimizer,
            var_list, clip_norm or manager.
          ValueError: for a non-scalar loss, an empty var_list, a variable or
            optimizer already in another group, a duplicate or invalid name,
            a clip_norm outside ``CLIP_NORM_RANGE`` (float32's normal
            range, for itself and its reciprocal), or a call
            after ``build()``.
        """
        if self._built:
            raise ValueError("add() came after build(), for loss %r. Add every group "
                             "first, then build() once." % (loss,))
        added = _groups.checked_group(
            loss, optimizer, var_list, name, loss_scale_manager,
            {"transform_grads_fn": transform_grads_fn, "clip_norm": clip_norm},
            self._groups, self._manager, self._engine, self._allreduce_gradients)
        if len(added.towers) > 1:
            self._towers[added.group.name] = added.towers
        self._groups.append(added.group)
        if added.loss_fn is not None:
            self._loss_fns[added.group.name] = added.loss_fn
        return added.group.name

    @_sugar.documents("build")
    def build(self, global_step=None, accumulation_steps=1, count_skipped_steps=False,
              update_ops=None, per_group_ops=False, skip_conditions=(), observers=(),
              **sugar):
        """Builds the single update op for every registered group.

        Args:
          global_step: an integer variable, or None. It advances by exactly one
            per applied step (per applied window with accumulation), never on a
            skipped one, however many groups there are.
          accumulation_steps: each run of ``update_op`` (or ``accumulate_op``)
            is one micro-step; every this many runs the mean of their unscaled
            gradients is applied once, if every micro-step of the window was
            finite (all or nothing). The loss scale is constant within a window
            and the managers update once per window, at its end. With a
            ``distributed`` engine, close each window with ``update_op`` after
            ``accumulation_steps - 1`` runs of ``accumulate_op`` (see
            ``TrainOps``).
          count_skipped_steps: if True, ``global_step`` advances on every step
            (every window end), applied or skipped, as TF-GAN's separate step
            increment does. If False (default) it does not move on a skipped
            step, so a loop keyed on ``global_step`` (``if step % 100 == 0``,
            a dict of scheduled fetches) sees the same step again after a
            skip: count your own loop iterations for such schedules, or pass
            True. ``TrainOps.skipped_steps`` counts the skips either way.
          update_ops: ops that must run only on applied steps, typically
            ``tf.get_collection(tf.GraphKeys.UPDATE_OPS)`` (batch-norm moving
            statistics, which an overflowing step would otherwise poison
            with inf/nan). They run with ``update_op`` when every group
            applies; do not run them yourself as well. An op that wraps
            updates (``tf.group``, ``tf.tuple``, ``check_numerics``, a
            ``tf.print`` under ``control_dependencies``...) stands for the
            variable updates behind it, which are gated instead. With
            ``per_group_ops=True`` pass a dict from group name to that
            group's update ops; an op listed for several groups runs with
            each of their steps that applies (a copy per group). Not with accumulation.
          per_group_ops: also build ``TrainOps.per_group``, one update op per
            group for alternating loops (see ``TrainOps``). Not with
            accumulation.
          skip_conditions: ``seams.SkipCondition``s after the overflow
            check (``skips.requested``, ``skips.loss_spikes`` or your own).
          observers: further ``seams.StepObserver``s, called for every
            step op (``update_op`` and each of ``per_group``, with that
            group's state); what each one's ``report`` returns for
            ``update_op`` is ``TrainOps.observed[observer.name]``
            (``underflow.measure_underflow()``'s is ``TrainOps.underflow``).
          **sugar: the keywords of ``sugar.TABLE``, each a shipped plug-in
            by name (an unknown one is a TypeError); the table's rows:
            SUGAR_KEYWORDS

        Returns:
          A ``TrainOps``.

        Raises:
          ValueError: if called twice, with no groups, in eager mode, when a
            group's loss reaches none of its variables, for
            ``accumulation_steps`` < 1, for ``update_ops`` the gate cannot
            hold (``update_ops.check_update_ops``), or for groups sharing a loss under
            ``skip_policy="per_group"`` on the npu backend, or on the
            float-status register inside a ``tf.cond``/``tf.while_loop`` body
            or a ``tf.function``; for a multi-worker environment without
            ``distributed`` (see there), a ``tf.distribute`` strategy with
            several replicas, or a SyncReplicasOptimizer group that cannot
            work (``sync_replicas.check_plan``: beside other groups, with
            accumulation, ``update_ops``, ``per_group_ops`` or an engine,
            without ``global_step`` or ``count_skipped_steps=True``). Every
            check runs before the first op is made; a build that fails later
            (inside TF, or a custom manager) leaves the builder and the
            graph's variables as they were, so it can be called again.
          TypeError: for a global_step that is not an integer variable, a
            non-int ``accumulation_steps``, a non-bool
            ``count_skipped_steps``, a non-bool ``measure_underflow``, or
            an op name (a string) in ``update_ops``, or a group whose
            optimizer is TF's own ``tf.train.SyncReplicasOptimizer``
            (``npu_lossscale.SyncReplicasOptimizer`` takes its place).
        """
        _context.require_graph_mode("MultiOptimizerLossScale.build")
        _assembly.check_no_strategy("MultiOptimizerLossScale.build")
        if self._built:
            raise ValueError("build() was already called on this MultiOptimizerLossScale. "
                             "Reuse the TrainOps it returned.")
        accumulation_steps = _checks.check_count(
            "accumulation_steps", accumulation_steps,
            "Pass the micro-batches per applied step, e.g. 4 (1: no accumulation).")
        _checks.check_bool(
            "count_skipped_steps", count_skipped_steps,
            "Pass True to advance global_step on skipped steps too.")
        _checks.check_global_step(global_step)
        resolved = _sugar.resolve("build", "build()", sugar, global_step=global_step,
                                  count_skipped_steps=count_skipped_steps)
        conditions, observers, given = _sugar.with_passed(resolved, skip_conditions, observers)
        sequence = resolved.sequence
        if sequence is not None:
            sequence = _assembly.check_sequence(sequence, self._groups, self._loss_fns, {
                "accumulation_steps": accumulation_steps != 1,
                "update_ops": update_ops is not None, "per_group_ops": per_group_ops is True,
                "measure_underflow": sugar.get("measure_underflow") is True,
                "measure_first_scale": sugar.get("measure_first_scale") is True,
                "observers": bool(given), "distributed": self._engine is not None,
                "towers": bool(self._towers)})
        # The builder's own reasons, refused here when in conflict; the
        # record collects them again from the plan.
        _assembly.reasons(conditions, self._groups)
        options = self._options(accumulation_steps, count_skipped_steps, conditions)
        # Checked with each tower group's first tower loss; the towers' mean
        # (ops) is made once every check has passed.
        api = "MultiOptimizerLossScale.build"
        plan = _step.plan_step(self._groups, self._manager, options, global_step, api)
        view = _hooks.plan_view(plan)  # what the plug-ins' checks are given
        shipped = _assembly.hearing(view)
        for plugin in conditions + observers + shipped:
            plugin.check_plan(view, options, global_step, api)
        update_ops = _update_ops.check_argument(update_ops, plan, per_group_ops)
        _assembly.check_sync_replicas_options(view, update_ops, per_group_ops)
        if self._engine is None and not self._independent:
            shipped = [item for item in [_assembly.check_cluster(api, view)]
                       if item is not None] + shipped
        if self._towers:
            plan = _step.plan_step(_assembly.tower_groups(self._groups, self._towers),
                                   self._manager, options, global_step, api)
        if sequence is not None:
            train = _train_ops.sequence_ops(self, plan, global_step, sequence, self._loss_fns,
                                            self._manager, self._skip_history)
        else:
            train = _train_ops.joint_ops(self, plan, global_step, update_ops, per_group_ops,
                                         shipped, observers, given, self._skip_history)
        self._built = True
        return train

    def _options(self, accumulation_steps=1, count_skipped_steps=False, conditions=()):
        engine = _assembly.step_engine([group.optimizer for group in self._groups],
                                       self._engine, self._towers)
        return _step.Options(
            backend=_backends.resolve_backend(self._requested_backend), gate=self._gate,
            skip_policy=self._skip_policy, engine=engine, allreduce_gradients=self._allreduce_gradients,
            accumulation_steps=accumulation_steps, count_skipped_steps=count_skipped_steps,
            conditions=conditions)
