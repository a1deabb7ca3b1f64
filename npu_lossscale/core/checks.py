"""The boundary: what the library accepts from its callers, checked once,
where it is handed in, before any op is made. Each check raises ValueError or
TypeError naming the argument, its value and the fix; inside the step,
checked values are trusted. (Managers: ``managers.base``.)"""

from __future__ import absolute_import, division, print_function

import math
import numbers
import re

import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals
from npu_lossscale.graph_values import is_variable, of_another_graph, op_of  # re-exported
from npu_lossscale.core import graph_walk as _graph_walk

#: The skip policies ``build`` accepts.
SKIP_POLICIES = ("all", "per_group")
#: How the apply gate is built: "pivot" (one Switch/Merge, the cheapest),
#: "cond" (``tf.cond``, which Ascend's adapter can take), or "auto".
GATES = ("auto", "pivot", "cond")

_LOSS_SCALE_WRAPPERS = ("LossScaleOptimizer", "NPULossScaleOptimizer",
                        "MixedPrecisionLossScaleOptimizer")
#: What ``enable_mixed_precision_graph_rewrite`` wraps an optimizer in: it
#: scales the loss itself, and applies in a cond.
_GRAPH_REWRITE_WRAPPER = "MixedPrecisionLossScaleOptimizer"
_GRAPH_REWRITE_DOC = "docs/features.md, 'Graph-rewrite mixed precision'"
#: Group names are TF name scopes.
_GROUP_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\-]*$")


def check_optimizer(optimizer, argument="optimizer"):
    """Raises TypeError unless ``optimizer`` is a plain TF1 optimizer."""
    if not isinstance(optimizer, tf.train.Optimizer):
        raise TypeError(
            "%s must be a tf.compat.v1.train.Optimizer (not a Keras one), got %r. Pass "
            "e.g. tf.compat.v1.train.AdamOptimizer()." % (argument, optimizer))
    if type(optimizer).__name__ == "NPUOptimizer" and _tf_internals.npu_optimizer_flag(
            optimizer, "is_loss_scale"):
        raise TypeError(
            "%s scales the loss itself (an NPUOptimizer with is_loss_scale=True), got "
            "%r. Build it with is_loss_scale=False." % (argument, optimizer))
    wrappers = [cls.__name__ for cls in type(optimizer).__mro__
                if cls.__name__ in _LOSS_SCALE_WRAPPERS]
    if _GRAPH_REWRITE_WRAPPER in wrappers:
        raise TypeError(
            "%s is TF's %s (from enable_mixed_precision_graph_rewrite), which scales "
            "the loss itself, got %r. Pass the optimizer you gave that call (%s)."
            % (argument, _GRAPH_REWRITE_WRAPPER, optimizer, _GRAPH_REWRITE_DOC))
    if wrappers:
        raise TypeError(
            "%s is already a loss-scale wrapper (%s), got %r. Pass the optimizer it "
            "wraps." % (argument, wrappers[0], optimizer))


def check_global_step(global_step):
    """Checks the ``global_step`` a step is to advance: None, or an integer
    variable of this graph (TypeError, ValueError)."""
    if global_step is None:
        return
    dtype = getattr(global_step, "dtype", None)
    if not (is_variable(global_step) and dtype.base_dtype.is_integer):
        raise TypeError(
            "global_step must be None or an integer tf.Variable, got %r. Use "
            "tf.train.get_or_create_global_step()." % (global_step,))
    if of_another_graph(global_step):
        raise ValueError(
            "global_step %r belongs to another graph. Call "
            "tf.train.get_or_create_global_step() in the graph you train in."
            % (global_step,))


#: The ``TrainOps`` fields the monitoring reads; by name, as builder.py
#: imports this module.
_TRAIN_OPS_FIELDS = ("update_op", "loss_scale", "applied", "skipped_steps", "clear_status",
                     "diagnosis", "per_group", "window_end")


def check_train_ops(train_ops, argument="train_ops"):
    """Raises TypeError unless ``train_ops`` is a ``TrainOps`` of ``build()``."""
    if isinstance(train_ops, tuple) and all(hasattr(train_ops, field)
                                            for field in _TRAIN_OPS_FIELDS):
        return
    if isinstance(train_ops, (tf.Operation, tf.Tensor)):
        raise TypeError("%s must be the TrainOps returned by build(), got the %s %r. Pass "
                        "the whole TrainOps (train, not one of its ops)."
                        % (argument, type(train_ops).__name__, train_ops.name))
    shown = repr(train_ops)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise TypeError("%s must be the TrainOps returned by MultiOptimizerLossScale.build(), "
                    "got %s (%s). Pass the TrainOps that build() returned."
                    % (argument, shown, type(train_ops).__name__))


def is_session(value):
    """True for an object with ``run`` and a ``tf.Graph`` as ``graph``
    (``tf.Session``, ``MonitoredSession``), not a ``tf.Operation``."""
    return (not isinstance(value, tf.Operation)
            and isinstance(getattr(value, "graph", None), tf.Graph)
            and callable(getattr(value, "run", None)))


def check_session(session, graph, owner):
    """Raises TypeError unless ``session`` is a session, ValueError unless it
    runs ``graph`` (that of ``owner``, e.g. "train_ops", for the message)."""
    if not is_session(session):
        raise TypeError("session must be a tf.Session or MonitoredSession, got %r (%s). "
                        "Pass the session that runs the training step."
                        % (session, type(session).__name__))
    if session.graph is not graph:
        raise ValueError("session must run the graph of %s, got %r, which runs another "
                         "graph. Pass the training step's session, e.g. "
                         "tf.Session(graph=<the graph of %s>)." % (owner, session, owner))


def computed_from(tensor, source):
    """True when ``tensor``'s value is computed, through data inputs, from
    the op ``source`` (a variable's op, a tensor's op)."""
    return _graph_walk.first_reached([tensor.op], lambda op: [t.op for t in op.inputs],
                                     [source]) is not None


def check_loss(loss):
    """Returns ``loss`` if it is a floating scalar tensor of the default
    graph; TypeError for a non-tensor or non-float, ValueError otherwise."""
    if not isinstance(loss, tf.Tensor):
        raise TypeError("loss must be a tf.Tensor, got %r. Pass the scalar loss tensor."
                        % (loss,))
    if not loss.dtype.base_dtype.is_floating:
        raise TypeError("loss must be a floating-point tensor, got %r. Cast it: "
                        "tf.cast(loss, tf.float32)." % (loss,))
    if loss.shape.ndims is not None and loss.shape.ndims != 0:
        raise ValueError("loss must be a scalar, got %r. Reduce it first, e.g. "
                         "tf.reduce_mean(loss)." % (loss,))
    if loss.graph is not tf.get_default_graph():
        raise ValueError("loss %r belongs to another graph. Call add() inside that "
                         "graph's `with graph.as_default():` block." % (loss,))
    return loss


def check_gradients(grads, argument="grads"):
    """Checks a list of gradients, as ``all_finite`` takes it.

    Args:
      grads: a list or tuple of float tensors or ``tf.IndexedSlices`` of
        this graph, or None.
      argument: the argument's name, for the messages.

    Returns:
      The gradients that are not None, as a list.

    Raises:
      TypeError: for anything but a list or tuple, for (gradient, variable)
        pairs, and for entries that are not float tensors.
      ValueError: for gradients of another graph, or when every entry is None.
    """
    fix = "Pass a list, e.g. [g for g, _ in grads_and_vars]."
    if isinstance(grads, (tf.Tensor, tf.IndexedSlices)) or is_variable(grads):
        raise TypeError("%s must be a list of gradients, got the single %r. Pass "
                        "[grad]." % (argument, grads))
    if not isinstance(grads, (list, tuple)):
        raise TypeError("%s must be a list of gradients, got %r (%s). %s"
                        % (argument, grads, type(grads).__name__, fix))
    present = []
    for index, grad in enumerate(grads):
        if grad is None:
            continue
        if (isinstance(grad, (list, tuple)) and len(grad) == 2
                and (is_variable(grad[1]) or isinstance(grad[1], tf.Tensor))):
            raise TypeError("%s[%d] must be a gradient, got the pair %r. %s"
                            % (argument, index, grad, fix))
        if not isinstance(grad, (tf.Tensor, tf.IndexedSlices)):
            raise TypeError("%s[%d] must be a tf.Tensor, tf.IndexedSlices or None, got "
                            "%r. %s" % (argument, index, grad, fix))
        if not grad.dtype.base_dtype.is_floating:
            raise TypeError("%s[%d] must be a floating-point gradient, got %r. Leave it "
                            "out: only floats overflow." % (argument, index, grad))
        if of_another_graph(grad):
            raise ValueError("%s[%d] %r belongs to another graph. Call all_finite() in "
                             "that graph." % (argument, index, grad))
        present.append(grad)
    if not present:
        raise ValueError("%s holds no gradient (None entries are left out), got %r. "
                         "Pass the step's gradients." % (argument, grads))
    return present


def check_group_name(name, taken):
    """Returns ``name`` if it is a valid name scope not in ``taken``;
    ValueError otherwise."""
    if not isinstance(name, str) or not _GROUP_NAME.match(name):
        raise ValueError("name must be a valid TF name scope (letters, digits, '_', '.', "
                         "'-'), got %r. Pass e.g. name='generator'." % (name,))
    if name in taken:
        raise ValueError("name %r is already another group's. Give each group its own "
                         "name." % (name,))
    return name


def default_var_list():
    """Every trainable variable, ref and resource alike."""
    return (tf.trainable_variables()
            + tf.get_collection(tf.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))


def check_var_list(var_list, name, other_groups):
    """Checks a group's variables and returns them as a tuple.

    Args:
      var_list: the variables, one variable (as ``Optimizer.minimize``
        takes it), or None for every trainable variable.
      name: the group's name, for messages.
      other_groups: the groups recorded before.

    Returns:
      A tuple of variables.

    Raises:
      TypeError: for a tensor, a string or a non-variable entry.
      ValueError: for an empty list, a variable of another graph, a repeated
        variable, or one already in another group.
    """
    if var_list is None:
        var_list = default_var_list()
    elif is_variable(var_list):
        var_list = [var_list]
    elif isinstance(var_list, (tf.Tensor, str, bytes)):
        raise TypeError("var_list must be a list of variables, got the single %r. Pass "
                        "var_list=[v]." % (var_list,))
    var_list = tuple(var_list)
    if not var_list:
        raise ValueError("var_list for group %r is empty. Pass the variables it trains, "
                         "e.g. tf.trainable_variables('generator')." % (name,))
    for index, var in enumerate(var_list):
        if not is_variable(var):
            raise TypeError("var_list for group %r must hold variables, got %r. Pass the "
                            "variables, not tensors read from them." % (name, var))
        if of_another_graph(var):
            raise ValueError("var_list for group %r holds %r of another graph. Make the "
                             "model and the builder in one graph." % (name, var.name))
        if any(var is other for other in var_list[:index]):
            raise ValueError("var_list for group %r lists %r twice. List it once."
                             % (name, var.name))
        for group in other_groups:
            if any(other is var for other in group.var_list):
                raise ValueError("variable %r is in group %r and in group %r; one optimizer "
                                 "updates it. Split the var_lists."
                                 % (var.name, group.name, name))
    return var_list


def check_resource_variables(var_list, name):
    """Raises ValueError for a ref variable in ``var_list`` (group ``name``):
    a functional ``If`` cannot assign one, which is why Huawei's docs pair
    control flow v2 with resource variables."""
    for var in var_list:
        if not _tf_internals.is_resource_variable(var):
            raise ValueError(
                "group %r: %r is a ref variable, which the apply gate's functional If "
                "cannot assign. Call tf.enable_resource_variables() at program start, or "
                "tf.disable_control_flow_v2()." % (name, var.name))


def check_no_ref_inputs(ops):
    """Raises ValueError for an update op that writes a ref variable, which a
    functional ``If`` branch cannot do (its copy runs inside the branch)."""
    for op in ops:
        if _tf_internals.reference_dtype_inputs(op):
            raise ValueError(
                "update op %r writes a ref variable, which the apply gate's functional If "
                "cannot do. Call tf.enable_resource_variables() at program start."
                % (op.name,))


def check_number(name, value, minimum=None, maximum=None, min_open=False,
                 max_open=False, integer=False, hint=""):
    """Returns ``value`` if it is a real number inside the bounds.

    Args:
      name: the argument's name, for the message.
      value: the value to check.
      minimum, maximum: the bounds, or None.
      min_open, max_open: whether each bound is excluded.
      integer: whether the value must be an int (bools are not).
      hint: a sentence appended to the message, saying what to pass instead.

    Raises:
      TypeError: if the value is not a number (or not an int when required).
      ValueError: if it is NaN, infinite (both checked before the bounds,
        which NaN would pass) or outside the bounds.
    """
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError("%s must be %s, got %r (%s). %s" % (
            name, "an int" if integer else "a number", value,
            type(value).__name__, hint))
    if not isinstance(value, numbers.Integral) and not math.isfinite(value):
        raise ValueError("%s must be a finite number, got %r. %s" % (name, value, hint))
    bad = ((minimum is not None and (value < minimum or (min_open and value == minimum)))
           or (maximum is not None and (value > maximum or (max_open and value == maximum))))
    if bad:
        low = "" if minimum is None else ("%s %r" % ("(" if min_open else "[", minimum))
        high = "" if maximum is None else ("%r%s" % (maximum, ")" if max_open else "]"))
        if minimum is None:
            span = "<%s %r" % ("" if max_open else "=", maximum)
        elif maximum is None:
            span = ">%s %r" % ("" if min_open else "=", minimum)
        else:
            span = "in %s, %s" % (low, high)
        raise ValueError("%s must be %s, got %r. %s" % (name, span, value, hint))
    return value


def check_count(name, value, hint, minimum=1, maximum=None):
    """Returns a count (of steps, runs, micro-batches) as an int in
    [minimum, maximum]. An integral float counts as its int, as TF's and
    Keras' own tests pass counts (``increment_period=2.``).

    Args:
      name: the argument's name, for the message.
      value: the value to check.
      hint: a sentence saying what to pass instead, e.g. "Pass e.g. 100.".
      minimum, maximum: the bounds (``maximum`` may be None).

    Raises:
      TypeError: for a bool, a non-number, or a fractional float.
      ValueError: for NaN, infinities, and counts outside the bounds.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError("%s must be a whole number, got %r (%s). %s"
                        % (name, value, type(value).__name__, hint))
    # NaN, inf and the bounds, reported with the value as given.
    check_number(name, value, minimum=minimum, maximum=maximum, hint=hint)
    if not isinstance(value, numbers.Integral) and not float(value).is_integer():
        raise TypeError("%s must be a whole number, got %r. %s" % (name, value, hint))
    return int(value)


def check_bool(name, value, hint):
    """Raises TypeError, naming ``name`` and saying ``hint``, unless
    ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError("%s must be a bool, got %r. %s" % (name, value, hint))


def check_skip_policy(skip_policy):
    """Raises ValueError unless ``skip_policy`` is a known policy."""
    if skip_policy not in SKIP_POLICIES:
        raise ValueError(
            "skip_policy must be one of %r, got %r. Pass 'all' (any overflow skips "
            "every group) or 'per_group'." % (SKIP_POLICIES, skip_policy))


def check_gate(gate):
    """Raises ValueError unless ``gate`` is a known gate kind."""
    if gate not in GATES:
        raise ValueError("gate must be one of %r, got %r. Pass 'auto' unless Ascend "
                         "needs 'cond'." % (GATES, gate))


def check_unique_names(name, values):
    """ValueError when two of ``values`` share a ``name``: ``TrainOps.observed``
    is keyed by it, so one report would hide the other."""
    seen = set()
    for value in values:
        if value.name in seen:
            raise ValueError(
                "%s: two of them are named %r (%r among %r); their reports are keyed by "
                "name. Give each its own, e.g. set the instance's name attribute."
                % (name, value.name, value, values))
        seen.add(value.name)


def check_instances(name, values, base):
    """``values`` (an instance of ``base``, or a list or tuple of them) as a
    list; TypeError for anything else."""
    if isinstance(values, base):
        values = [values]
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(value, base) for value in values):
        raise TypeError("%s must be a list of %s instances, got %r. Pass e.g. %s=[My%s()]."
                        % (name, base.__name__, values, name, base.__name__))
    return list(values)
