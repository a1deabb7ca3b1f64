"""The manager protocol: what the step reads from a loss-scale manager.

``LossScaleManager`` declares the protocol; the functions below are the only
code that reads it (``check_manager``, ``manager_variables``,
``overflow_check_enabled``, ``static_scale``, ``scale_moves``,
``declares_scale_in_range``, ``listens_to_underflow``, ``describe``). The
argument checks and named defaults the managers share live here too.
"""

from __future__ import absolute_import, division, print_function

import inspect
import struct

from npu_lossscale.core import checks as _checks

# The floor of 1 is contrib's, npu_bridge's (`maximum(1., loss_scale *
# decr_ratio)` in npu_loss_scale_manager.py), Keras' (`max(scale / m, 1)`)
# and jmp's default (`DynamicLossScale.min_loss_scale`, ones). A lower floor,
# down to SCALE_RANGE's 2**-126, may be passed, as jmp allows; PyTorch's
# GradScaler has none (`_amp_update_scale_` multiplies by backoff_factor).
_DEFAULT_MIN_LOSS_SCALE = 1.0
# No ceiling by default: npu_bridge and contrib have none besides float32's
# range, and npu_bridge examples start at 2**32. Pass a number to cap growth.
_DEFAULT_MAX_LOSS_SCALE = None
# The largest finite float32, (2 - 2**-23) * 2**127 (IEEE 754 binary32).
_FLOAT32_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127
# float32 represents every integer up to 2**24 exactly (24-bit significand);
# the step counters must stay below it, so the periods are capped there.
_MAX_PERIOD = 2 ** 24
# A scale stuck at its floor while steps keep overflowing is the "loss scale
# collapses" report users file (apex #834, fairseq #1529): no scale can help,
# the overflow is in the forward pass or the data. Warn after this many
# consecutive overflowing steps, once the scale sits at its floor.
_DEFAULT_FLOOR_WARNING_AFTER = 20


def _float32(value):
    """Rounds a Python float to the nearest float32, as TF's constants do.

    Raises:
      OverflowError: if the value rounds to infinity.
    """
    return struct.unpack("<f", struct.pack("<f", value))[0]


#: The scales the step accepts from a manager: those whose inverse is a
#: normal float32 too, 2**-126 to 2**126. Then both have full precision and
#: unscaling by a power of two is exact. Outside it TF's CPU kernels flush the
#: subnormal (the scale below, the inverse above) to zero: a scale of 0 makes
#: the unscaled gradients NaN, an inverse of 0 applies zero gradients as a
#: finite step. NaN and inf skip every step. Scales below 1 are accepted:
#: PyTorch's GradScaler may back off below 1, and they suit float32 gradients
#: (with float16 ones, small gradients flush to 0 there: the manager's choice).
SCALE_RANGE = (2.0 ** -126, 2.0 ** 126)
# Our managers never exceed 2**126, the top of SCALE_RANGE: above it 1/scale
# is subnormal and TF's CPU kernels flush it to 0, so a model with float32
# gradients would apply zero gradients as "finite" steps (measured). The
# dynamic managers cap growth at min(max_loss_scale, 2**126): a deviation
# from npu_bridge, which grows while scale < 3.4e38 / incr_ratio, and from
# TF's DynamicLossScale and contrib, which grow while scale * ratio is finite.
_MAX_SCALE = SCALE_RANGE[1]
#: float16's largest finite value (IEEE 754 binary16): the top of the
#: underflow measurement's headroom (``underflow.Underflow``), which a
#: listening manager reads; the fixed scale above which a unit float16 loss
#: gradient is inf; the image of +-inf on a saturating register
#: (``skip_inspection``).
FLOAT16_MAX = 65504.0


class LossScaleManager(object):
    """The protocol every manager follows (TF 1.15 contrib / npu_bridge).

    Required: ``get_loss_scale`` and ``update_loss_scale``. The builder never
    requires this base class: any object with those two methods works,
    including ``tf.contrib.mixed_precision`` and npu_bridge managers. The
    optional hooks below have the defaults the step assumes for an object
    that lacks them; the functions of this module are the only step code
    that reads them.

    For the floor warning (``monitoring.check_floor``,
    ``monitoring.FloorWarningHook``) a manager exposes four public
    properties: ``loss_scale`` and ``overflow_streak`` (float32 scalar
    tensors made once, read whenever fetched), ``min_loss_scale`` (a number)
    and ``floor_warning_after`` (an int, or None never to warn).

    A manager that listens to the underflow measurement (docs/diagnosis.md,
    "Is the scale too low?") defines two optional methods; with both, the step
    measures the manager's groups on the runs it asks for, and on no other
    (``listens_to_underflow``; without them nothing is measured for it):

    * ``underflow_due()``: a bool scalar tensor, True on the runs the
      manager wants a measurement (e.g. every N-th update), read from its
      state once per run, before anything of the measurement runs;
    * ``observe_underflow(measurement)``: called once at build, inside a
      gate that opens on those runs only, with one ``underflow.Underflow``
      of tensors over the manager's groups (this run's gradients, after the
      overflow check); returns the op that records what the manager needs.
      Its ``update_loss_scale`` of the same run follows that op, so the
      update can read the record at once.

    A manager that takes a measured first scale
    (``build(measure_first_scale=True)``) defines ``assign_loss_scale(scale)``:
    the op that sets its scale to ``scale`` (a float32 scalar tensor) within
    its bounds, and leaves its state as it is when ``scale`` is NaN
    (``takes_measured_scale``).

    Example, a manager written against this protocol (docs/managers.md,
    "Adding a manager")::

      class HalvingManager(LossScaleManager):
          keeps_scale_in_range = True  # in [1, 2**15], never fed

          def __init__(self):
              self.scale = tf.Variable(2.0 ** 15, trainable=False)

          def get_loss_scale(self):
              return self.scale.read_value()

          def update_loss_scale(self, finite_grads):
              scale = self.scale.read_value()
              new_scale = tf.where(finite_grads, scale, tf.maximum(scale / 2, 1.0))
              with tf.control_dependencies([new_scale]):  # read before the write
                  return tf.assign(self.scale, new_scale).op
    """

    #: Optional: the variables that hold the manager's state, a list. None
    #: (the default, and what the step assumes for a manager without it)
    #: means "not declared": the manager's attributes that are variables are
    #: taken, by name (``manager_variables``). They are read to refuse a
    #: manager of another graph (``check_manager_graph``), to track the state
    #: in ``LossScaleOptimizer``'s object checkpoints (``tf.train.Checkpoint``)
    #: and to name the manager in messages (``describe``). Name-based
    #: ``tf.train.Saver`` checkpoints need nothing: the state variables are
    #: global variables, which a default Saver saves. Declare it when the
    #: state is not a direct attribute (in a list, a dict, a helper object).
    variables = None

    #: Set to True in a class's own body to promise that its scale stays in
    #: ``SCALE_RANGE``: ``get_loss_scale()`` returns a float32 scalar in
    #: [2**-126, 2**126] in every state ``update_loss_scale`` can reach from
    #: the constructor's, and the tensor it returns is not meant to be fed.
    #: The step then adds no run-time check of the scale (one ``Assert`` per
    #: step that fails the run on a scale outside the range) and refuses
    #: feeds of that tensor. The promise is per class
    #: (``declares_scale_in_range``): a subclass does not inherit it, since
    #: it may override the rule; it gets the check until its own body sets
    #: the flag again. Our three managers set it.
    keeps_scale_in_range = False

    def get_loss_scale(self):
        """Returns the current loss scale as a float32 scalar tensor."""
        raise NotImplementedError

    def update_loss_scale(self, finite_grads):
        """Returns an op that updates the scale given this step's finiteness.

        Args:
          finite_grads: bool scalar tensor, True when every gradient was finite.

        Returns:
          An op.
        """
        raise NotImplementedError

    def get_enable_overflow_check(self):
        """Returns whether steps with non-finite gradients are skipped.

        Optional (npu_bridge's FixedLossScaleManager has it). A manager without
        it is treated as returning True.

        Returns:
          A Python bool, fixed at graph-build time.
        """
        return True

    @property
    def static_loss_scale(self):
        """The scale as a Python float when it is a build-time constant.

        Optional. None (the default, and what the builder assumes for a manager
        without it) means the scale is a run-time value; a constant 1.0 lets
        the builder skip unscaling.
        """
        return None


def check_manager(manager, argument="loss_scale_manager"):
    """Checks a loss-scale manager given to a builder, group or optimizer.

    Args:
      manager: the value passed as the manager.
      argument: the argument's name, for messages.

    Raises:
      ValueError: for None (as TF's ``MixedPrecisionLossScaleOptimizer``
        does), or a manager whose variables belong to another graph.
      TypeError: for a class, or an object without the protocol.
    """
    if manager is None:
        # TF raises ValueError for a None loss scale: tensorflow/python/
        # training/experimental/loss_scale_optimizer_test.py
        # testPassingNoneToLossScale ('loss_scale cannot be None').
        raise ValueError("%s must be a loss-scale manager, got None. Pass e.g. "
                         "%s=DynamicLossScaleManager()." % (argument, argument))
    if inspect.isclass(manager):
        raise TypeError("%s must be a manager instance, got the class %s. Call it: "
                        "%s=%s()." % (argument, manager.__name__, argument,
                                      manager.__name__))
    if not (callable(getattr(manager, "get_loss_scale", None))
            and callable(getattr(manager, "update_loss_scale", None))):
        raise TypeError("%s must have get_loss_scale() and update_loss_scale(finite_grads), "
                        "got %r. Pass e.g. DynamicLossScaleManager()." % (argument, manager))
    check_manager_graph(manager, argument)


def manager_variables(manager):
    """The variables holding a manager's state (ours, npu_bridge's, contrib's).

    Args:
      manager: a loss-scale manager.

    Returns:
      A list of variables: the manager's ``variables`` attribute where it
      declares one, else its attributes that are variables, by name.
    """
    declared = getattr(manager, "variables", None)
    if declared is not None and not callable(declared):
        return list(declared)
    return [value for _, value in sorted(vars(manager).items()) if _checks.is_variable(value)]


def check_manager_graph(manager, argument="loss_scale_manager"):
    """Raises ValueError when ``manager``'s variables are of another graph.

    A manager made before ``tf.reset_default_graph()`` (or in another
    ``tf.Graph``) keeps its scale in that graph, which this step cannot
    read or update.

    Args:
      manager: a loss-scale manager.
      argument: the argument's name, for the message.

    Raises:
      ValueError: if one of the manager's variables belongs to a graph other
        than the default one (or a graph the default one is nested in).
    """
    for variable in manager_variables(manager):
        if _checks.of_another_graph(variable):
            raise ValueError(
                "%s %r keeps its state in %r of another graph. Make the manager in "
                "the graph you train in (after tf.reset_default_graph(), or inside "
                "model_fn)." % (argument, manager, variable.name))


def overflow_check_enabled(manager):
    """Whether the manager wants steps with inf/nan gradients skipped.

    Reads the optional ``get_enable_overflow_check`` hook of the manager
    protocol (``managers.LossScaleManager``); a manager without it is checked.
    """
    getter = getattr(manager, "get_enable_overflow_check", None)
    return True if getter is None else bool(getter())


def declares_scale_in_range(manager):
    """Whether ``manager``'s class promises a scale in ``SCALE_RANGE``.

    The promise (``LossScaleManager.keeps_scale_in_range``) counts only where
    the manager's own class sets it in its body: a subclass of a declaring
    class, which may override ``update_loss_scale`` or the helpers it calls,
    gets the run-time check until it declares the promise itself.

    Args:
      manager: any loss-scale manager (a subclass of ``LossScaleManager`` or
        not).

    Returns:
      A Python bool.
    """
    return vars(type(manager)).get("keeps_scale_in_range", False) is True


def listens_to_underflow(manager):
    """Whether ``manager`` defines the optional hooks ``underflow_due`` and
    ``observe_underflow`` (see ``LossScaleManager``): then the step measures
    its groups' underflow on the runs it asks for.

    Args:
      manager: any loss-scale manager.

    Returns:
      A Python bool.
    """
    return (callable(getattr(manager, "underflow_due", None))
            and callable(getattr(manager, "observe_underflow", None)))


def takes_measured_scale(manager):
    """Whether ``manager`` defines the optional hook ``assign_loss_scale(scale)``
    (``build(measure_first_scale=True)`` sets its first scale through it)."""
    return callable(getattr(manager, "assign_loss_scale", None))


def assign_scale(manager, scale):
    """``manager.assign_loss_scale(scale)``, checked to be an op.

    Raises:
      TypeError: when the hook returns no op.
    """
    update = manager.assign_loss_scale(scale)
    op = _checks.op_of(update)
    if op is None:
        raise TypeError("%s.assign_loss_scale(scale) returned %r, not an op. Return the "
                        "assign op." % (type(manager).__name__, update))
    return op


def static_scale(manager):
    """The manager's ``static_loss_scale`` hook: its scale as a Python float
    when that is a build-time constant, else None (also for a manager
    without the hook)."""
    return getattr(manager, "static_loss_scale", None)


def scale_may_be_below_one(manager):
    """Whether ``manager``'s scale may be below 1, so that unscaling
    multiplies by more than 1: a float16 gradient can then overflow in the
    unscale itself. False for a constant scale of at least 1 and for a
    floor (``min_loss_scale``) of at least 1; True for a manager that
    declares neither."""
    static = static_scale(manager)
    if static is not None:
        return static < 1.0
    floor = getattr(manager, "min_loss_scale", None)
    return not (isinstance(floor, (int, float)) and floor >= 1.0)


def scale_moves(manager):
    """Whether ``manager``'s update can change its state.

    False for a manager that declares a constant scale
    (``static_loss_scale``, as ``FixedLossScaleManager`` does): its update is
    a no-op, so any number of steps may update it in one run.

    Args:
      manager: any loss-scale manager.

    Returns:
      A Python bool.
    """
    return static_scale(manager) is None


def describe(manager):
    """A short description of ``manager`` for messages: its class and the
    name of its first state variable, e.g. "loss-scale manager
    DynamicLossScaleManager (state loss_scale/state)"; no quotes, which
    run-time messages would print escaped."""
    variables = manager_variables(manager)
    if not variables:
        return "loss-scale manager %s" % type(manager).__name__
    return "loss-scale manager %s (state %s)" % (type(manager).__name__, variables[0].op.name)


def _check_bounds(init_name, init_value, min_loss_scale, max_loss_scale):
    """The floor, the ceiling and the starting scale between them."""
    _checks.check_number("min_loss_scale", min_loss_scale, minimum=SCALE_RANGE[0],
                         maximum=_MAX_SCALE,
                         hint="Pass e.g. 1 (the default; within 2**-126 to 2**126).")
    if max_loss_scale is not None:
        _checks.check_number("max_loss_scale", max_loss_scale, minimum=min_loss_scale,
                             maximum=_FLOAT32_MAX,
                             hint="Pass a ceiling >= min_loss_scale, or None for none.")
    high = _MAX_SCALE if max_loss_scale is None else min(max_loss_scale, _MAX_SCALE)
    _checks.check_number(init_name, init_value, minimum=min_loss_scale, maximum=high,
                         hint="Keep it within [min_loss_scale, max_loss_scale] and "
                              "at most 2**126.")


def _check_floor_warning(floor_warning_after):
    """``floor_warning_after`` as an int, or None (never warn)."""
    if floor_warning_after is None:
        return None
    return _checks.check_count("floor_warning_after", floor_warning_after,
                               hint="Pass e.g. 20, or None never to warn.")


def _check_period(name, value, example):
    """A growth or back-off period as an int in [1, 2**24] (the state
    counts in float32, exact up to 2**24)."""
    return _checks.check_count(name, value, maximum=_MAX_PERIOD,
                               hint="Pass e.g. %d (at most 2**24)." % example)


def _check_ratio(name, value, example):
    _checks.check_number(name, value, minimum=1, min_open=True, maximum=_FLOAT32_MAX,
                         hint="Pass e.g. %r." % example)
    if _float32(float(value)) <= 1.0:
        raise ValueError(
            "%s must exceed 1 in float32, got %r (it rounds to 1.0). Pass e.g. %r."
            % (name, value, example))


def _check_initial_scale(name, value, min_loss_scale, max_loss_scale, floor_warning_after):
    """The checks both dynamic managers make of their starting scale and bounds."""
    if value is None:
        raise ValueError("%s must be a number, got None. Pass e.g. 2**15." % name)
    _check_floor_warning(floor_warning_after)
    _checks.check_number(name, value, minimum=SCALE_RANGE[0], maximum=_MAX_SCALE,
                         hint="Pass e.g. 2**15 (within 2**-126 to 2**126).")
    _check_bounds(name, value, min_loss_scale, max_loss_scale)

