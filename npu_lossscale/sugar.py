"""The keyword arguments that name a shipped plug-in, in one table.

Each capability is a value (``transforms``, ``skips``, ``underflow``,
``distributed``); a keyword argument of ``add()``, ``build()`` or
``MultiOptimizerLossScale(...)`` is sugar for one. ``TABLE`` holds one row
per keyword: the entry point that takes it, its default, the function that
turns a value into the plug-ins (with the checks and messages of that
keyword), and the field of ``Resolved`` they go to. So::

  build(skip_loss_spikes=3.0, measure_underflow=True)

is ``build(skip_conditions=[skips.loss_spikes(3.0)],
observers=[underflow.measure_underflow()])``, and a new shipped capability
is its module plus one row here.
"""

from __future__ import absolute_import, division, print_function

import collections
import textwrap

from npu_lossscale import distributed as _distributed
from npu_lossscale.diagnostics import record as _record
from npu_lossscale import seams as _seams
from npu_lossscale import skips as _skips
from npu_lossscale.skips import on_request as _on_request
from npu_lossscale import transforms as _transforms
from npu_lossscale import underflow as _underflow
from npu_lossscale.core import checks as _checks
from npu_lossscale.underflow import first_scale as _first_scale

#: The clip_norm values for which clip_by_global_norm stays exact.
CLIP_NORM_RANGE = _transforms.CLIP_NORM_RANGE


class Row(collections.namedtuple("Row", ["kwarg", "entry", "default", "resolve", "gives",
                                         "doc"])):
    """One keyword argument and the plug-in it names.

    Attributes:
      kwarg: the keyword's name.
      entry: who takes it: "init" (``MultiOptimizerLossScale(...)``), "add"
        or "build".
      default: its value when not given.
      resolve: ``resolve(value, given)``, with ``given`` the ``Given``,
        returns what it adds to ``Resolved.<gives>``: a tuple of plug-ins,
        or for "engine" and "sequence" the field's new value.
      gives: the field of ``Resolved``.
      doc: what the keyword does, for the entry's docstring
        (``documents``).
    """

    def __new__(cls, kwarg, entry, default, resolve, gives, doc=""):
        return super(Row, cls).__new__(cls, kwarg, entry, default, resolve, gives, doc)


class Given(collections.namedtuple("Given", ["kwarg", "values", "context", "resolved"])):
    """What a row's ``resolve`` may read.

    Attributes:
      kwarg: the row's keyword, for messages.
      values: dict from keyword to the value passed (defaults left out).
      context: dict of the entry's own arguments a row needs
        (``global_step``, ``count_skipped_steps`` for "build").
      resolved: the ``Resolved`` of the rows before it.
    """

    def get(self, kwarg):
        """The value of ``kwarg``, passed or default."""
        return self.values.get(kwarg, _ROWS[kwarg].default)


class Resolved(collections.namedtuple(
        "Resolved", ["transforms", "conditions", "observers", "engine", "sequence"])):
    """The plug-ins an entry's keywords name.

    Attributes:
      transforms: ``seams.GradientTransform``s of a group, in order.
      conditions: ``seams.SkipCondition``s, before the ones passed.
      observers: ``seams.StepObserver``s, before the ones passed.
      engine: the ``seams.ReductionEngine``, or None.
      sequence: ``build(sequence=...)``'s value, or None (its own entry:
        several steps in one op, not a capability of one step).
    """

    def __new__(cls, transforms=(), conditions=(), observers=(), engine=None, sequence=None):
        return super(Resolved, cls).__new__(cls, transforms, conditions, observers, engine,
                                            sequence)


def _optional(make):
    """The ``resolve`` of a keyword whose value, unless None, is the
    argument of ``make(value, kwarg)``, a plug-in's checked constructor."""
    def resolve(value, given):
        return () if value is None else (make(value, given.kwarg),)
    return resolve


def _transform_grads_fn(value, given):
    del given
    return _transforms.as_transforms(value)


def _clip_norm(value, given):
    del given
    if value is None:
        return ()
    return (_transforms.ClipByGlobalNorm(_transforms.check_norm(
        "clip_norm", value, "Pass a global norm such as 1.0, or None not to clip.")),)


def _engine(value, given):
    del given
    return _distributed.resolve_engine(value)


def _allreduce_float16(value, given):
    _checks.check_bool("allreduce_float16", value,
                       "Pass True to average float16 gradients in float16.")
    engine = given.resolved.engine
    if not value:
        return engine
    if not isinstance(engine, _distributed.CollectiveEngine):
        raise ValueError(
            "allreduce_float16=True needs distributed='horovod' or 'hccl', got "
            "distributed=%r. Pass one of them, or leave allreduce_float16 off."
            % (given.get("distributed"),))
    return engine.reducing_float16()


def _skip_global_steps(value, given):
    condition = _on_request.requested_skips(value, given.context["global_step"],
                                            given.context["count_skipped_steps"])
    return () if condition is None else (condition,)


def _measure_first_scale(value, given):
    observer = _first_scale.check_first_scale(value, given.get("first_scale_margin"))
    return () if observer is None else (observer,)


def _read_with_measure_first_scale(value, given):
    del value, given  # measure_first_scale's row reads and checks it
    return ()


def _measure_underflow(value, given):
    del given
    _checks.check_bool("measure_underflow", value, "Pass True to build TrainOps.underflow.")
    return (_underflow.measure_underflow(),) if value else ()


def _sequence(value, given):
    del given  # checked by sequence.check_sequence, with the groups
    return value


#: The keywords, in the order they resolve (and check) within an entry.
TABLE = (
    Row("distributed", "init", None, _engine, "engine",
        'None, "horovod", "hccl" or False. With "horovod" or "hccl" every worker '
        "reaches the same decision: the overflow flags are summed across workers before "
        "the apply gate (zero means finite everywhere), and no collective is ever "
        "placed inside a cond or the gate. With ``hvd.broadcast_global_variables(0)`` "
        "(or the engine's equivalent) at start, weights and loss scales stay equal on "
        "every worker. None: one worker; ``build()`` refuses it when the environment "
        "names several (RANK_SIZE, a Horovod/MPI launcher, a TF_CONFIG cluster), unless "
        "a SyncReplicasOptimizer group's chief decides, or every checked group's "
        "optimizer averages its gradients before the check "
        "(``hvd.DistributedOptimizer``; not on the float-status register). False: the "
        "workers are independent (asynchronous parameter-server workers), each skipping "
        "on its own overflows. Sugar for an engine of ``distributed`` (or your own "
        "``seams.ReductionEngine``, passed as it is)."),
    Row("allreduce_float16", "init", False, _allreduce_float16, "engine",
        "with \"horovod\" or \"hccl\", average float16 gradients in float16, each worker's "
        "divided by the number of workers first (a sum of values at most 65504 / n "
        "cannot overflow): half the bytes of the default float32 average, at the cost "
        "of the values below n * 2**-24, which flush to 0. For bandwidth-bound float16 "
        "models; an accumulation window's sums are float32 and stay so. Sugar for the "
        "engine's ``reducing_float16()``."),
    Row("transform_grads_fn", "add", None, _transform_grads_fn, "transforms",
        "TF-GAN's hook: a function from the group's list of unscaled (gradient, "
        "variable) pairs to the list to apply, or a ``seams.GradientTransform``, or a "
        "``transforms.chain(...)`` of them (the group takes each in order). It runs "
        "before the decision, and the overflow check covers what it returns; "
        "``clip_norm`` clips after it."),
    Row("clip_norm", "add", None, _clip_norm, "transforms",
        "if set, the group's unscaled gradients are clipped by their global norm to "
        "this value before the apply, on finite steps only (with accumulation: the "
        "window's mean). Sugar for ``transforms.clip_by_global_norm(clip_norm)``, after "
        "``transform_grads_fn``."),
    Row("skip_global_steps", "build", None, _skip_global_steps, "conditions",
        "steps to skip through the gate, to restart past a known-bad range of batches: a "
        "collection of global steps (a ``range``, list or set; needs ``global_step`` and "
        "``count_skipped_steps=True``), or a bool scalar tensor (or variable), True on the "
        "runs to skip; one computed from ``global_step``, or from a step fed back from it, "
        "needs ``count_skipped_steps=True`` too, or the step it names skips forever (feed a "
        "count of your own iterations instead). Reason ``requested``; the scale stays. "
        "Sugar for ``skip_conditions=[skips.requested(steps)]``."),
    Row("skip_loss_spikes", "build", None, _optional(_skips.loss_spikes), "conditions",
        "a number k > 1: after 100 applied steps, a step whose loss exceeds k times its "
        "moving average skips (reason ``loss_spike``; the scale stays). Sugar for "
        "``skip_conditions=[skips.loss_spikes(k)]``."),
    Row("measure_first_scale", "build", False, _measure_first_scale, "observers",
        "measure the first loss scale from the first step's float32 view, before that step "
        "reads it: the largest power of two under which every tensor the backprop holds "
        "stays below 65504 / 2**first_scale_margin (``underflow.first_scale``). Needs "
        "managers with ``assign_loss_scale`` (the dynamic ones) and float32 master weights. "
        "Sugar for ``observers=[underflow.measure_first_scale(margin)]``."),
    Row("first_scale_margin", "build", _first_scale.DEFAULT_MARGIN,
        _read_with_measure_first_scale, "observers",
        "powers of two of headroom for ``measure_first_scale``, an int in 0..15; only with "
        "it."),
    Row("measure_underflow", "build", False, _measure_underflow, "observers",
        "also build ``TrainOps.underflow``, the per-group underflow measurement (a float32 "
        "copy of each loss's float16 forward graph and its backprop, run only when "
        "fetched). Needs float32 variables and a forward graph of plain ops "
        "(``underflow.check_float32_view``). Sugar for "
        "``observers=[underflow.measure_underflow()]``."),
    Row("sequence", "build", None, _sequence, "sequence",
        'group names, repeats allowed (``["d", "d", "g"]``): ``update_op`` then runs '
        "those sub-steps in order in one op, each a whole step of its group (scale, check, "
        "gate, skip, manager update) built under the previous one, whose loss callable "
        "(``add(lambda: ...)``) is called again there so that its forward pass reads the "
        "weights the previous sub-step wrote. For a GAN on a device loop (docs/features.md, "
        '"Sub-steps in one op"). Every group must be named and have a callable loss; not '
        "with accumulation, ``update_ops`` (a sub-step gates the UPDATE_OPS its callable "
        "adds), ``per_group_ops``, towers, an engine, a SyncReplicasOptimizer, "
        "``measure_underflow``, ``measure_first_scale`` or ``observers``. Not a plug-in: "
        "the entry of several steps in one op (``sequence.py``)."),
)
_ROWS = dict((row.kwarg, row) for row in TABLE)


def documents(entry):
    """A decorator: the entry's docstring, its line ``SUGAR_KEYWORDS``
    replaced by the table's keywords of ``entry`` and their ``doc``, indented
    as that line is."""
    def document(documented):
        doc = documented.__doc__
        if doc:  # None under python -OO
            marker = doc.index("SUGAR_KEYWORDS")
            indent = marker - doc.rindex("\n", 0, marker) - 1
            lines = []
            for row in TABLE:
                if row.entry == entry:
                    lines.extend(textwrap.wrap("%s: %s" % (row.kwarg, row.doc), 78,
                                               initial_indent=" " * indent,
                                               subsequent_indent=" " * (indent + 2),
                                               break_on_hyphens=False))
            documented.__doc__ = doc.replace(" " * indent + "SUGAR_KEYWORDS",
                                             "\n".join(lines))
        return documented
    return document


class Passed(collections.namedtuple("Passed", ["conditions", "observers", "given"])):
    """A build's plug-ins: the keywords' first, then the ones passed.

    Attributes:
      conditions: the ``seams.SkipCondition``s.
      observers: the ``seams.StepObserver``s.
      given: the observers passed as ``observers`` (``TrainOps.observed``).
    """


def with_passed(resolved, skip_conditions, observers):
    """``build()``'s plug-ins: ``resolved``'s, then ``skip_conditions`` and
    ``observers``, checked as one list of each.

    Returns:
      A ``Passed``.

    Raises:
      TypeError: for what is no instance of its seam, or a non-bool
        ``moves_scale``.
      ValueError: for a condition listed twice, two observers of one
        name, an observer that a keyword makes too, or one that takes the
        name of a shipped observer of another class.
    """
    conditions = list(resolved.conditions) + _checks.check_instances(
        "skip_conditions", skip_conditions, _seams.SkipCondition)
    for index, condition in enumerate(conditions):
        if any(condition is other for other in conditions[:index]):
            raise ValueError(
                "skip_conditions: %r is listed twice; each would run its flag and on_apply, "
                "so its state would move twice a step. List it once." % (condition,))
        _checks.check_bool("%s.moves_scale" % condition.name, condition.moves_scale,
                           "Set it True when a skip for this reason should count as an "
                           "overflow for the loss-scale managers.")
    given = _checks.check_instances("observers", observers, _seams.StepObserver)
    for observer in given:
        for made in resolved.observers:
            if type(made) is type(observer):  # pylint: disable=unidiomatic-typecheck
                keyword = getattr(_SHIPPED.get(made.name), "keyword",
                                  None) or "a keyword of build()"
                raise ValueError("observers: %r is what %s makes too, and both would run. "
                                 "Pass %s or the observer, not both."
                                 % (observer, keyword, keyword))
        shipped = _SHIPPED.get(observer.name)
        if shipped is not None and shipped.keyword is None and isinstance(observer,
                                                                          shipped.cls):
            raise ValueError(
                "observers: %r is %s, which every build() makes itself where the step needs "
                "one. Leave it out; read its report from TrainOps." % (observer, shipped.what))
        if shipped is not None and not isinstance(observer, shipped.cls):
            raise ValueError(
                "observers: %r is named %r, the name of %s, whose report TrainOps reads "
                "by that name. Give yours another name (its name attribute), or pass %s "
                "itself." % (observer, observer.name, shipped.what, shipped.what))
    observers = list(resolved.observers) + given
    _checks.check_unique_names("observers", observers)
    return Passed(conditions, observers, given)


class _Shipped(collections.namedtuple("_Shipped", ["cls", "what", "keyword"])):
    """A shipped observer: its class, what it is (for messages), and the
    keyword of build() that makes it; None for one every build() makes
    itself where the step needs it."""


#: The shipped observers by name: TrainOps reads their reports by these
#: names, so no other observer may take one.
_SHIPPED = dict((shipped.cls.name, shipped) for shipped in (
    _Shipped(_underflow.Measurement, "underflow.measure_underflow()", "measure_underflow=True"),
    _Shipped(_first_scale.FirstScale, "underflow.measure_first_scale()",
             "measure_first_scale=True"),
    _Shipped(_underflow.Hearing, "the listening managers' hearing", None),
    _Shipped(_record.SkipDiagnosis, "the skip diagnosis (TrainOps.diagnosis)", None)))


def keywords(entry):
    """The keywords ``entry`` takes, in the table's order."""
    return [row.kwarg for row in TABLE if row.entry == entry]


def resolve(entry, api, values, **context):
    """The plug-ins that ``values``, keyword arguments of ``entry``, name.

    Args:
      entry: "init", "add" or "build".
      api: the entry's name for a message, e.g. "build()".
      values: dict from keyword to value.
      **context: the entry's own arguments the rows read.

    Returns:
      A ``Resolved``.

    Raises:
      TypeError: for a keyword the entry does not take, as Python says it,
        with the ones it takes; or as a row's checks.
      ValueError: as a row's checks.
    """
    known = keywords(entry)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise TypeError("%s got an unexpected keyword argument %r; besides its own it "
                        "takes %s." % (api, unknown[0], ", ".join(known)))
    resolved = Resolved()
    for row in TABLE:
        if row.entry != entry:
            continue
        made = row.resolve(values.get(row.kwarg, row.default),
                           Given(row.kwarg, values, context, resolved))
        if row.gives not in ("engine", "sequence"):
            made = getattr(resolved, row.gives) + tuple(made)
        resolved = resolved._replace(**{row.gives: made})
    return resolved
