"""The reasons a step skips, as values: each ``Reason`` with its fix, and a
builder's ``Reasons`` by code.

The checks' reasons are written here; each skip condition declares its own
(``reason``, ``fix``, ``moves_scale``), the shipped ones in ``skips``.
A builder collects its own (``collect``): the shipped ones (``SHIPPED``),
then its skip conditions' and its groups' transforms' reasons, in that
order. Its skip record is made with them and carries them, so each
builder decodes its own codes, and nothing is registered for the process.
"""

from __future__ import absolute_import, division, print_function

import collections

import numpy as np

from npu_lossscale.skips import spikes as _loss_spikes
from npu_lossscale.skips import on_request as _requested


class Reason(collections.namedtuple("Reason", ["name", "fix", "holds_scale"])):
    """One reason a step skips.

    Attributes:
      name: the reason's name, e.g. "loss_not_finite".
      fix: what to do about a skip for it, one sentence.
      holds_scale: whether a skip for it leaves the loss scale as it was
        (asked-for skips, loss spikes): it says nothing of the scale, so
        the collapse policy passes over it.
    """


#: The checks' own reasons (the overflow check's, as the diagnosis tells
#: them apart, and "applied"): a skip condition cannot take one.
APPLIED = Reason("applied", "nothing to fix.", False)
LOSS_NOT_FINITE = Reason(
    "loss_not_finite",
    "the loss is inf or nan before any scaling, so no loss scale can help: it is a "
    "model or data bug. Check the input batch for inf/nan, and keep exp, log, "
    "softmax and the losses in float32.", False)
GRADIENTS_OVERFLOWED = Reason(
    "gradients_overflowed",
    "the named variables' gradients overflow float16 even at this scale: keep the "
    "ops that produce them in float32, or bound their inputs (clip, normalise); "
    "lowering min_loss_scale only hides it.", False)
OTHER_WORKER_OVERFLOWED = Reason(
    "other_worker_overflowed",
    "another worker overflowed, not this one: read that worker's last_skip record "
    "(its reason and variables name the fault) and check its data shard.", False)
REGISTER_OUTSIDE_GRADIENTS = Reason(
    "register_outside_gradients",
    "the float-status register was set while every gradient was finite: an op "
    "outside the gradients overflowed, usually a forward op or the input data. "
    "Find it with npu_lossscale.audit or by checking the forward outputs, and "
    "keep it in float32.", False)
BACKEND_FLAGGED = Reason(
    "backend_flagged",
    "the step's backend (a Backend of your own) flagged values that are all finite, "
    "and it gives no per-variable evidence: ask the backend which values it "
    "flagged.", False)


def reason_of(condition):
    """The ``Reason`` a ``seams.SkipCondition`` (a class or an instance)
    declares: its ``reason``, its ``fix``, and whether it holds the scale
    (not ``moves_scale``)."""
    return Reason(condition.reason, condition.fix, not condition.moves_scale)


#: The shipped skip conditions' reasons, collected from their classes
#: (``skips.requested``, ``skips.loss_spikes``): their codes are fixed, so
#: every builder has them.
REQUESTED = reason_of(_requested.RequestedSkips)
LOSS_SPIKE = reason_of(_loss_spikes.LossSpikes)

CHECKS = (APPLIED, LOSS_NOT_FINITE, GRADIENTS_OVERFLOWED, OTHER_WORKER_OVERFLOWED,
          REGISTER_OUTSIDE_GRADIENTS, BACKEND_FLAGGED)


class Reasons(collections.namedtuple("Reasons", ["reasons"])):
    """A builder's reasons: ``reasons[code]`` is the ``Reason`` of a code.

    Attributes:
      reasons: tuple of ``Reason``, by code; the first is "applied".
    """

    @property
    def names(self):
        """The reasons' names, by code."""
        return tuple(reason.name for reason in self.reasons)

    @property
    def fixes(self):
        """The reasons' fixes, by code."""
        return tuple(reason.fix for reason in self.reasons)

    @property
    def holding(self):
        """The names of the reasons that hold the scale, a frozenset."""
        return frozenset(reason.name for reason in self.reasons if reason.holds_scale)

    def code(self, name):
        """The code of the reason ``name`` (ValueError if it is none of these)."""
        return self.names.index(name)

    def fix(self, name):
        """The fix of the reason ``name`` (ValueError if it is none of these)."""
        return self.reasons[self.code(name)].fix

    def name(self, code):
        """The name of an int (or numpy integer) ``code``: TypeError for
        another type, ValueError for a code out of range."""
        if isinstance(code, bool) or not isinstance(code, (int, np.integer)):
            raise TypeError("code must be an int reason code, got %r. Pass the value "
                            "fetched from TrainOps.diagnosis.skip_reason." % (code,))
        if not 0 <= int(code) < len(self.reasons):
            raise ValueError("code must be in 0..%d, got %r. Pass the value fetched from "
                             "TrainOps.diagnosis.skip_reason." % (len(self.reasons) - 1, code))
        return self.reasons[int(code)].name

    def with_reason(self, name, fix, holds_scale=False):
        """These reasons with a skip condition's own added, if new.

        Args:
          name: the reason's name, a non-empty str.
          fix: what to do about a skip for this reason, one sentence.
          holds_scale: whether a skip for it leaves the loss scale as it was.

        Returns:
          A ``Reasons``: these, or these and the new one last.

        Raises:
          TypeError: unless ``name`` and ``fix`` are str.
          ValueError: for an empty name, one of the checks' own reasons
            (``CHECKS``), or a name here already with another fix or
            another ``holds_scale``.
        """
        if not isinstance(name, str) or not isinstance(fix, str):
            raise TypeError("a skip condition's reason and fix must be str, got reason=%r, "
                            "fix=%r. Set e.g. reason = 'negative_loss' and fix = 'check the "
                            "data.' on the class." % (name, fix))
        if not name:
            raise ValueError("a skip condition's reason must be a non-empty name, got %r. Set "
                             "e.g. reason = 'negative_loss' on the class." % (name,))
        checks = tuple(reason.name for reason in CHECKS)
        if name in checks:
            raise ValueError("a skip condition's reason %r is one of the step's own (%s): a "
                             "skip for it would be read as one of theirs. Name your "
                             "condition's reason, e.g. reason = 'negative_loss'."
                             % (name, ", ".join(checks)))
        if name not in self.names:
            return Reasons(self.reasons + (Reason(name, fix, bool(holds_scale)),))
        known = self.reasons[self.code(name)]
        if known.fix != fix or known.holds_scale != holds_scale:
            raise ValueError(
                "a skip condition's reason %r is registered already with fix %r and "
                "moves_scale=%r; this one has fix %r and moves_scale=%r. Give it a reason of "
                "its own, or the same fix and moves_scale." % (
                    name, known.fix, not known.holds_scale, fix, not holds_scale))
        return self


#: The shipped reasons, whose codes every builder shares.
SHIPPED = Reasons(CHECKS[:5] + (REQUESTED, LOSS_SPIKE) + CHECKS[5:])


def transform_reason(group):
    """The reason of a skip that ``group``'s own transforms caused: the
    transforms that may turn finite gradients into inf or NaN
    (``seams.GradientTransform.keeps_finite`` False), named, e.g.
    "transform_grads_fn_not_finite"; None when every transform keeps
    finite values.

    Args:
      group: a ``seams.GroupView``.

    Returns:
      A ``Reason``, or None. A skip for it leaves the managers as they
      were (``core.close.update_managers``: the transform failed, not the
      scale), yet it is not ``holds_scale``: it extends the skip streak, so
      a transform that keeps failing is a collapse for ``CollapseMonitor``.
    """
    names = [transform.name for transform in group.transforms if not transform.keeps_finite]
    if not names:
        return None
    which = "+".join(names)
    return Reason("%s_not_finite" % which,
                  "the gradient transform %s returned inf or NaN from finite gradients and "
                  "losses: its own fault, not the loss scale's; make it keep finite values "
                  "(guard its divisions and logs). The loss scale held."
                  % which, False)


def collect(conditions, groups):
    """A builder's reasons: the shipped ones, then its skip conditions'
    (``SkipCondition.reason``, ``fix``, not ``moves_scale``), then its
    groups' transforms' (``transform_reason``), each new name once.

    Args:
      conditions: the step's ``seams.SkipCondition``s, in order.
      groups: the builder's ``seams.GroupView``s.

    Returns:
      A ``Reasons``.

    Raises:
      TypeError, ValueError: for a condition's reason ``Reasons.with_reason``
        refuses.
    """
    reasons = SHIPPED
    for condition in conditions:
        reasons = reasons.with_reason(*reason_of(condition))
    for group in groups:
        fault = transform_reason(group)
        if fault is not None:
            reasons = reasons.with_reason(*fault)
    return reasons
