"""The shipped plug-ins every build assembles without a keyword asking.

``sugar`` turns keywords into plug-ins; this module gives the builder the
ones it always wires: the skip record and its diagnosis observer, the
listening managers' hearing, the engine of in-graph towers and of a
SyncReplicasOptimizer's chief around the one asked for, the checks that
workers decide alike, and the sequence entry (``build(sequence=...)``,
several steps in one op). ``builder.py`` reaches them only here, so it names
no feature module.
"""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import distributed as _distributed
from npu_lossscale import seams as _seams
from npu_lossscale import sequence as _sequence
from npu_lossscale import underflow as _underflow
from npu_lossscale.core import hooks as _hooks
from npu_lossscale.diagnostics import reasons as _reasons
from npu_lossscale.diagnostics import record as _record
from npu_lossscale.distributed import sync_replicas as _sync_replicas
from npu_lossscale.distributed import towers as _towers

#: What makes a cluster's workers decide alike, per ``distributed.Cluster.kind``.
CLUSTER_ROUTES = {
    "ascend": "Pass distributed='hccl' to sum the overflow decision across devices",
    "horovod": "Pass distributed='horovod' to sum the overflow decision across ranks",
    "tf_config": "Wrap the group's optimizer in npu_lossscale.SyncReplicasOptimizer, whose "
                 "chief decides on the aggregated gradients",
}
#: How many skips the record's history keeps by default.
DEFAULT_HISTORY = _record.DEFAULT_HISTORY
#: The observer names whose reports ``TrainOps`` reads.
UNDERFLOW = _underflow.Measurement.name
DIAGNOSIS = _record.SkipDiagnosis.name

# The sequence entry (``sequence.py``), for ``build(sequence=...)``.
check_sequence = _sequence.check_sequence
build_sequence = _sequence.build_sequence
# The checks of ``distributed`` and ``towers`` an entry point runs on what it
# is handed.
check_no_strategy = _distributed.check_no_strategy
check_sync_replicas_options = _sync_replicas.check_builder_options
tower_losses = _towers.tower_losses


def check_group_engine(engine, optimizer, name, allreduce_gradients):
    """With an engine, refuses a group whose gradients would be reduced
    twice, and warns when nothing reduces them (ValueError).

    Args:
      engine: the builder's ``seams.ReductionEngine``, or None.
      optimizer: the group's optimizer.
      name: the group's name.
      allreduce_gradients: the builder's ``allreduce_gradients``.
    """
    if engine is None:
        return
    _distributed.check_not_already_reducing(optimizer, name, allreduce_gradients)
    if not allreduce_gradients and not _distributed.reduces_gradients(optimizer):
        tf.logging.warning(
            "npu_lossscale: group %r: allreduce_gradients=False and its optimizer "
            "(%s) does not average gradients across workers, so its replicas "
            "train on local gradients only. That is right for worker-local "
            "variables (embeddings sharded per worker); otherwise wrap the "
            "optimizer or pass allreduce_gradients=True."
            % (name, type(optimizer).__name__))


def step_engine(optimizers, engine, towers):
    """The step's engine: a SyncReplicasOptimizer's chief in place of
    ``engine`` where one of ``optimizers`` is one, wrapped in the towers
    of ``towers`` (dict from group name to its tower losses) if any."""
    engine = _sync_replicas.engine_for(optimizers, engine)
    if towers:
        engine = _towers.Towers(engine if engine is not None else _seams.ReductionEngine(),
                                towers)
    return engine


def tower_groups(groups, towers):
    """``groups``, a tower group's loss the mean of its towers'."""
    return [group._replace(loss=_towers.mean_loss(towers[group.name]))
            if group.name in towers else group for group in groups]


def check_cluster(api, plan):
    """The cluster check of a builder's step without an engine
    (``distributed.check_cluster``): None, or the observer that checks its
    gradients are averaged (ValueError when nothing makes the workers'
    decisions equal)."""
    return _distributed.check_cluster(api, plan, CLUSTER_ROUTES, "distributed=False",
                                      aggregated=not _seams.applies_here(plan.engine))


def hearing(plan):
    """The listening managers' observer, in a list; empty when no manager
    of ``plan`` listens."""
    return [_underflow.Hearing()] if _underflow.listens(plan) else []


def reasons(conditions, groups):
    """A builder's skip reasons (``diagnostics.reasons.collect``): its skip
    conditions' and its groups' transforms', after the shipped ones (the
    groups handed on as ``seams.GroupView``s).

    Raises:
      TypeError, ValueError: for a condition's reason in conflict with
        another (``Reasons.with_reason``), before any op is made.
    """
    return _reasons.collect(conditions, [_hooks.group_view(group) for group in groups])


def record(plan, history):
    """The builder's skip ``Record`` for ``plan``, keeping ``history`` skips."""
    return _record.Record([_hooks.group_view(group) for group in plan.groups],
                          on_host=not plan.backend.on_npu,
                          switch_merge=plan.gate_kind == "pivot", history=history,
                          counts_skipped_steps=plan.count_skipped_steps,
                          reasons=reasons([item.condition for item in plan.conditions],
                                          plan.groups))


def diagnosis(skip_record):
    """The skip diagnosis observer, writing ``skip_record``."""
    return _record.SkipDiagnosis(skip_record)
