"""Phase 2 of the step, the overflow decision: one flag per check (one status
read or one is_finite pass), the cross-worker sum of the flags, and the bool
decisions the gates follow."""

from __future__ import absolute_import, division, print_function

import collections
import contextlib

import tensorflow.compat.v1 as tf

from npu_lossscale import backends as _backends
from npu_lossscale import checks as _checks
from npu_lossscale import gradients as _gradients


def all_finite(grads, backend="auto"):
    """The bool decision the builder itself would take for ``grads``.

    Args:
      grads: gradients (tensors or IndexedSlices; None entries are left out).
      backend: "auto", "is_finite", "npu", "float_status" or a
        ``backends.Backend`` instance, as for the builder. With the register
        (Ascend, saturation mode) the read follows every gradient, and the
        graph's one register clear (``clear_status`` of the backend) is
        ordered before everything the gradients follow.

    Returns:
      A bool scalar tensor, True when no gradient overflowed.

    Raises:
      TypeError: unless ``grads`` is a list or tuple of float gradients (one
        tensor, (gradient, variable) pairs, None, a number or a str are
        refused), a backend neither a name nor a ``Backend``, or a flag
        that is not a float32 scalar.
      ValueError: for an unknown backend name, no gradient at all, gradients
        of another graph, or the register inside a ``tf.cond``/``tf.while_loop``
        body or a ``tf.function``.
    """
    grads = _checks.check_gradients(grads)
    flag = _backends.checked_flag(_backends.resolve_backend(backend), grads)
    return Decisions({"all": flag}, grads).all_of(["all"])


class Checked(collections.namedtuple("Checked", ["scaled", "flags", "packing"])):
    """The step's scaled gradients and their overflow flags.

    Attributes:
      scaled: ordered dict from group name to scaled (gradient, variable)
        pairs.
      flags: ordered dict from check name to a float32 scalar, 0.0 when the
        check's gradients are finite.
      packing: the ``gradients.Packing`` of the small gradients.
    """

    @property
    def gradients(self):
        """Every scaled gradient of the step, in group order."""
        return [grad for pairs in self.scaled.values() for grad, _ in pairs]


def check(plan, backend, scales):
    """Computes the scaled gradients and one overflow flag per check.

    With one shared check (or per-group is_finite checks) every gradient is
    computed first and each check reads its own. With ``plan.serial_reads``
    (per-group skips on the shared status register) each group's backprop
    follows the previous group's read. The register is never cleared
    between reads, so a read sees its own group's overflows and those of
    the groups read before it: a group skips when it or an earlier group
    (in ``add()`` order) overflowed, and never misses its own overflow.

    Args:
      plan: the ``plan.Plan``.
      backend: the overflow backend.
      scales: the ``gradients.read_scales`` result.

    Returns:
      A ``Checked``.
    """
    flags = collections.OrderedDict()
    if plan.serial_reads:
        scaled, after = collections.OrderedDict(), []
        for item in plan.checks:
            group = plan.group(item.groups[0])
            scaled.update(_gradients.scaled_gradients(plan, scales, item.groups, after))
            with tf.name_scope(item.name):
                grads = [grad for grad, _ in scaled[group.name]]
                flags[item.name] = _backends.checked_flag(backend, grads, after=[group.loss])
            after = [flags[item.name]]  # the next group follows this read
        # Unchecked groups follow the last read.
        rest = tuple(name for name in plan.group_names if name not in scaled)
        if rest:
            scaled.update(_gradients.scaled_gradients(plan, scales, rest, after))
        scaled = collections.OrderedDict((name, scaled[name]) for name in plan.group_names)
        return Checked(scaled, flags, _gradients.pack(plan, scaled))

    scaled = _gradients.scaled_gradients(plan, scales, plan.group_names)
    packing = _gradients.pack(plan, scaled)
    for item in plan.checks:
        grads = packing.to_check([grad for name in item.groups for grad, _ in scaled[name]])
        # A scope of its own only when there are several checks to tell apart.
        scope = tf.name_scope(item.name) if len(plan.checks) > 1 else contextlib.suppress()
        with scope:
            flags[item.name] = _backends.checked_flag(backend, grads, after=list(plan.losses))
    return Checked(scaled, flags, packing)


def reduce_across_workers(reduction, flags, grads):
    """Sums the flags across workers (one collective) and averages the
    gradients, at the top level of the graph: never inside a cond or gate.

    Args:
      reduction: the ``plan.Reduction``.
      flags: ordered dict from check name to float32 flag.
      grads: ordered dict from group name to (gradient, variable) pairs.

    Returns:
      ``(flags, grads)``: new ordered dicts, reduced; the inputs unchanged
      without an engine.
    """
    if not reduction.active:
        return flags, grads
    engine = reduction.engine
    if flags:
        with tf.name_scope("reduce_overflow_flags"):
            summed = engine.sum(tf.stack(list(flags.values())))
            flags = collections.OrderedDict(
                (name, summed[index]) for index, name in enumerate(flags))
    if reduction.allreduce_gradients:
        with tf.name_scope("allreduce_gradients"):
            grads = collections.OrderedDict(
                (name, [(engine.mean_gradient(grad), var) for grad, var in pairs])
                for name, pairs in grads.items())
    return flags, grads


class Decisions(object):
    """The step's bool decisions: one per check, ordered after the gradients.

    Anything gated on a decision therefore runs only once all of the step's
    gradients exist: no group's update can race another group's backprop.

    Args:
      flags: ordered dict from check name to float32 flag.
      after: tensors every decision must follow (the step's gradients).
    """

    def __init__(self, flags, after):
        self._after = [_gradients.dense_values(t) for t in after]
        self.by_check = collections.OrderedDict()
        for name, flag in flags.items():
            with tf.control_dependencies(self._after):
                self.by_check[name] = tf.identity(tf.equal(flag, 0.0),
                                                  name="group_is_finite")
        self._always = None

    @property
    def ops(self):
        """The decision ops made so far: every write gated on a decision
        follows one of them."""
        tensors = list(self.by_check.values())
        if self._always is not None:
            tensors.append(self._always)
        return [tensor.op for tensor in tensors]

    def all_of(self, checks, name=None):
        """True when every check in ``checks`` passed (True if there is none).

        Args:
          checks: check names.
          name: the op name of a conjunction of several decisions.

        Returns:
          A bool scalar tensor; one decision is returned as it is.
        """
        decisions = [self.by_check[check] for check in checks]
        if not decisions:
            if self._always is None:
                with tf.control_dependencies(self._after):
                    self._always = tf.identity(tf.constant(True), name="always_finite")
            return self._always
        if len(decisions) == 1:
            return decisions[0]
        return tf.reduce_all(tf.stack(decisions), name=name)

