"""What a device loop means for the step: the op that loops, and what may
loop.

On Ascend, tf_adapter's graph engine runs the subgraph that holds the op
named ``IterationOp`` (``util.set_iteration_per_loop``, or ``NPUEstimator``
with ``NPURunConfig(iterations_per_loop=N)``) N times per ``session.run``; the
host sees the last iteration's fetched values. Everything a step keeps for
the host therefore lives in the graph: the skip record's history and each
skip's streak (``diagnostics.RecentSkips``), which the collapse policy reads
after a looped run (``monitoring.CollapseMonitor``).

Two uses of a loop go wrong without an error from TensorFlow, and
``check_loop`` names them:

* a loop over one per-group op of a builder that has others: only the op
  named ``IterationOp`` loops, so that group trains N times per run of the
  others (``build(sequence=...)`` runs them in one op);
* a loop over a step whose ``global_step`` stands still on skipped steps:
  NPURunConfig counts ``iterations_per_loop`` steps per run, so ``max_steps``
  and ``save_checkpoints_steps`` drift by the skips
  (``build(count_skipped_steps=True)`` keeps them where asked).
"""

from __future__ import absolute_import, division, print_function

import collections

#: The node name tf_adapter's graph engine loops (tf_adapter/kernels/geop_npu.cc).
ITERATION_OP_NAME = "IterationOp"


def iteration_op(graph):
    """The op named ``IterationOp`` in ``graph``, or None."""
    try:
        return graph.get_operation_by_name(ITERATION_OP_NAME)
    except KeyError:
        return None


class Looped(collections.namedtuple("Looped", ["loop", "key", "joint"])):
    """A step op that a device loop runs.

    Attributes:
      loop: the ``IterationOp``.
      key: None for the joint step (``update_op``), else the per-group op's
        group name.
      joint: whether it is the joint step.
    """


def check_loop(train_ops, looped):
    """The errors of a device loop over a step op of ``train_ops``.

    Args:
      train_ops: the ``TrainOps`` of the step.
      looped: the ``Looped`` step op.

    Returns:
      A list of sentences, each a problem and its fix; empty when the loop
      is sound.
    """
    problems = []
    if not looped.joint and len(train_ops.per_group) > 1:
        others = sorted(name for name in train_ops.per_group if name != looped.key)
        problems.append(
            "the device loop (IterationOp) runs train.per_group[%r] every iteration, but "
            "only the op named IterationOp loops, so per_group %s would run once per "
            "session.run. Loop one op that runs every group: build(sequence=[...]) or "
            "update_op." % (looped.key, ", ".join(repr(name) for name in others)))
    if train_ops.counts_skipped_steps is False:
        problems.append(
            "the device loop (IterationOp) runs a step whose global_step stands still on "
            "skipped steps, so NPURunConfig's max_steps and save_checkpoints_steps drift "
            "by the skips. Pass build(count_skipped_steps=True).")
    return problems
