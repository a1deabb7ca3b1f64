"""Which step op of a ``TrainOps`` a run runs (``StepRuns``), and the
device-loop check of the one a loop runs (``loop_problems``): what the hook
and the collapse policy watch."""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale import device_loop as _device_loop
from npu_lossscale.core import graph_walk as _graph_walk

#: Fetch sets ``StepRuns`` remembers before it starts again (a loop has a few).
_MAX_KNOWN_FETCHES = 256


def loop_problems(train_ops, loop, step_runs=None):
    """``device_loop.check_loop`` of the step op of ``train_ops`` that the
    device loop ``loop`` (the ``IterationOp``) runs; no problem when it runs
    none of them.

    Args:
      train_ops: the ``TrainOps``.
      loop: the ``IterationOp``.
      step_runs: the ``StepRuns`` of ``train_ops``, or None to make one.

    Returns:
      A list of sentences, each a problem and its fix.
    """
    step = (step_runs or StepRuns(train_ops)).of([loop])
    if step is None:
        return []
    return _device_loop.check_loop(train_ops, _device_loop.Looped(loop, step.name, step.joint))


class StepOp(collections.namedtuple("StepOp", ["key", "joint", "name"])):
    """A step op of a ``TrainOps``, as the hook watches it.

    Attributes:
      key: its streak's key for ``CollapseMonitor.observe``: None for the
        joint step, "per_group['<name>']" for a per-group op.
      joint: whether it is the joint step (``update_op``).
      name: None for the joint step, else the per-group op's group name.
    """


class StepRuns(object):
    """Which step op of a ``TrainOps`` a run runs: the one its fetches depend
    on, over data and control edges. Reads the graph only (finalized is
    fine), once per set of fetches."""

    def __init__(self, train_ops):
        self._graph = train_ops.update_op.graph
        self._targets = {train_ops.update_op: StepOp(None, True, None)}
        for name, op in train_ops.per_group.items():
            self._targets[op] = StepOp("per_group[%r]" % (name,), False, name)
        self._known = {}

    def of(self, fetches):
        """The ``StepOp`` a run of ``fetches`` (any form ``session.run``
        takes) runs, or None."""
        ops = frozenset(self._fetched_ops(fetches))
        if ops not in self._known:
            if len(self._known) >= _MAX_KNOWN_FETCHES:
                self._known.clear()
            found = _graph_walk.first_reached(
                ops, lambda op: [tensor.op for tensor in op.inputs] + list(op.control_inputs),
                self._targets)
            self._known[ops] = None if found is None else self._targets[found]
        return self._known[ops]

    def _fetched_ops(self, fetches):
        """The ops of ``fetches``; what is not of this graph is left to
        ``session.run`` to refuse."""
        stack = [fetches]
        while stack:
            fetch = stack.pop()
            if isinstance(fetch, dict):
                stack.extend(fetch.values())
            elif isinstance(fetch, (list, tuple)):
                stack.extend(fetch)
            elif isinstance(fetch, (tf.SparseTensor, tf.IndexedSlices)):
                stack.extend(part for part in (fetch.indices, fetch.values, fetch.dense_shape)
                             if part is not None)
            else:
                try:
                    element = self._graph.as_graph_element(fetch, allow_tensor=True,
                                                           allow_operation=True)
                except (TypeError, ValueError, KeyError):
                    continue
                yield element if isinstance(element, tf.Operation) else element.op

