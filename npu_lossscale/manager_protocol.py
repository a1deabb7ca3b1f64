"""The manager protocol: ``LossScaleManager``, and the functions below, the
only code that reads it, with the check of a manager handed in. The step
(``core``) and the managers both stand on it (docs/managers.md)."""

from __future__ import absolute_import, division, print_function

import inspect

from npu_lossscale import graph_values as _graph_values


#: The scales the step accepts: those whose inverse is a normal float32 too,
#: so unscaling is exact. Outside it TF's CPU kernels flush the subnormal one
#: to zero: a zero scale makes NaN gradients, a zero inverse applies zero
#: gradients as a finite step (docs/managers.md, "Ranges").
SCALE_RANGE = (2.0 ** -126, 2.0 ** 126)
#: float16's largest finite value: the measurement's headroom, and what an
#: overflow saturates to on Ascend.
FLOAT16_MAX = 65504.0


class LossScaleManager(object):
    """The protocol every manager follows (TF 1.15 contrib / npu_bridge).

    Required: ``get_loss_scale`` and ``update_loss_scale``; any object with
    them works, contrib's and npu_bridge's managers included. The optional
    hooks below have the defaults the step assumes for an object without
    them. Further optional hooks:

    * the floor warning (``monitoring.check_floor``) reads the properties
      ``loss_scale``, ``overflow_streak`` (float32 scalar tensors),
      ``min_loss_scale`` and ``floor_warning_after`` (an int, or None);
    * ``underflow_due()`` (a bool scalar tensor, True on the runs the manager
      wants measured) and ``observe_underflow(measurement)`` (called at build
      inside a gate open on those runs, with an ``underflow.Underflow`` of
      its groups; returns the op that records it, which the same run's
      ``update_loss_scale`` follows): with both, the step measures the
      manager's groups on those runs only;
    * ``assign_loss_scale(scale)``: the op that sets the scale within its
      bounds, and changes nothing for a NaN ``scale``, for
      ``build(measure_first_scale=True)`` (``takes_measured_scale``).

    Example (docs/managers.md, "Adding a manager")::

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

    #: Optional: the list of state variables, read for the other-graph check,
    #: object checkpoints and messages. None: the manager's attributes that
    #: are variables. Declare it when the state is not a direct attribute.
    variables = None

    #: True in a class's own body promises a scale in ``SCALE_RANGE`` in
    #: every reachable state, never fed: the step then makes no run-time
    #: check of it and refuses feeds. Not inherited: a subclass may change
    #: the rule (``declares_scale_in_range``).
    keeps_scale_in_range = False

    def get_loss_scale(self):
        """Returns the current loss scale as a float32 scalar tensor."""
        raise NotImplementedError

    def update_loss_scale(self, finite_grads):
        """Returns the op that moves the scale; ``finite_grads`` is a bool
        scalar tensor, True when every gradient was finite."""
        raise NotImplementedError

    def get_enable_overflow_check(self):
        """Optional (npu_bridge's name): whether steps with non-finite gradients
        are skipped, a Python bool fixed at build time."""
        return True

    @property
    def static_loss_scale(self):
        """Optional: the scale as a Python float when it is a build-time
        constant, else None. At 1.0 the step makes no scale ops."""
        return None


def check_manager(manager, argument="loss_scale_manager"):
    """Checks a loss-scale manager given to a builder, group or optimizer.

    Raises:
      ValueError: for None (as TF's testPassingNoneToLossScale expects), or
        a manager of another graph.
      TypeError: for a class, or an object without the protocol.
    """
    if manager is None:
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
    """The list of a manager's state variables: its ``variables`` where it
    declares them, else its attributes that are variables, by name."""
    declared = getattr(manager, "variables", None)
    if declared is not None and not callable(declared):
        return list(declared)
    return [value for _, value in sorted(vars(manager).items()) if _graph_values.is_variable(value)]


def check_manager_graph(manager, argument="loss_scale_manager"):
    """Raises ValueError when ``manager``'s variables are of another graph
    (made before ``tf.reset_default_graph()``), which the step cannot use."""
    for variable in manager_variables(manager):
        if _graph_values.of_another_graph(variable):
            raise ValueError(
                "%s %r keeps its state in %r of another graph. Make the manager in "
                "the graph you train in (after tf.reset_default_graph(), or inside "
                "model_fn)." % (argument, manager, variable.name))


def overflow_check_enabled(manager):
    """The optional ``get_enable_overflow_check()``, True without it."""
    getter = getattr(manager, "get_enable_overflow_check", None)
    return True if getter is None else bool(getter())


def declares_scale_in_range(manager):
    """Whether ``manager``'s own class (not a base) sets
    ``keeps_scale_in_range = True``."""
    return vars(type(manager)).get("keeps_scale_in_range", False) is True


def listens_to_underflow(manager):
    """Whether ``manager`` has both ``underflow_due`` and
    ``observe_underflow`` (``LossScaleManager``)."""
    return (callable(getattr(manager, "underflow_due", None))
            and callable(getattr(manager, "observe_underflow", None)))


def takes_measured_scale(manager):
    """Whether ``manager`` has the optional ``assign_loss_scale(scale)``."""
    return callable(getattr(manager, "assign_loss_scale", None))


def assign_scale(manager, scale):
    """``manager.assign_loss_scale(scale)``; TypeError unless it is an op."""
    update = manager.assign_loss_scale(scale)
    op = _graph_values.op_of(update)
    if op is None:
        raise TypeError("%s.assign_loss_scale(scale) returned %r, not an op. Return the "
                        "assign op." % (type(manager).__name__, update))
    return op


def static_scale(manager):
    """The optional ``static_loss_scale``, None without it."""
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
    """Whether ``manager``'s update can change its state: False for a
    constant scale, which any number of steps may update in one run."""
    return static_scale(manager) is None


def describe(manager):
    """``manager`` for messages, e.g. "loss-scale manager
    DynamicLossScaleManager (state loss_scale/state)" (no quotes: run-time
    messages would print them escaped)."""
    variables = manager_variables(manager)
    if not variables:
        return "loss-scale manager %s" % type(manager).__name__
    return "loss-scale manager %s (state %s)" % (type(manager).__name__, variables[0].op.name)
