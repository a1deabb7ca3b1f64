"""What the library accepts from its callers, checked as TF objects: losses,
optimizers, variables, managers and global steps, in graph mode."""

from __future__ import absolute_import, division, print_function

import collections
import inspect
import re

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import resource_variable_ops

_LOSS_SCALE_WRAPPERS = ("LossScaleOptimizer", "NPULossScaleOptimizer",
                        "MixedPrecisionLossScaleOptimizer")


#: Group names must be usable as TF name scopes.
_GROUP_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\-]*$")


def check_manager(manager, argument="loss_scale_manager"):
    """Raises TypeError unless ``manager`` follows the loss-scale protocol."""
    if inspect.isclass(manager):
        raise TypeError(
            "%s must be a manager instance, got the class %s. Call it: e.g. "
            "%s=%s() (or with its arguments)." % (
                argument, manager.__name__, argument, manager.__name__))
    if not (callable(getattr(manager, "get_loss_scale", None))
            and callable(getattr(manager, "update_loss_scale", None))):
        raise TypeError(
            "%s must have get_loss_scale() and update_loss_scale(finite_grads) "
            "methods, got %r. Pass a DynamicLossScaleManager, "
            "ExponentialUpdateLossScaleManager or FixedLossScaleManager "
            "(npu_bridge's and tf.contrib's managers work too)." % (argument, manager))


def check_optimizer(optimizer, argument="optimizer"):
    """Raises TypeError unless ``optimizer`` is a plain TF1 optimizer."""
    if not isinstance(optimizer, tf.train.Optimizer):
        raise TypeError(
            "%s must be a tf.compat.v1.train.Optimizer, got %r (%s). Keras "
            "optimizers are not supported in TF1 graph mode; use e.g. "
            "tf.compat.v1.train.AdamOptimizer." % (
                argument, optimizer, type(optimizer).__name__))
    if type(optimizer).__name__ == "NPUOptimizer" and getattr(optimizer, "_is_loss_scale",
                                                              False):
        # tf_adapter npu_bridge/estimator/npu/npu_optimizer.py: NPUOptimizer
        # scales the loss and reads the float status itself when asked.
        raise TypeError(
            "%s is an NPUOptimizer with is_loss_scale=True, got %r: it scales the "
            "loss and checks overflow itself, so loss scaling would be applied "
            "twice. Build it with is_loss_scale=False, or pass the optimizer it "
            "wraps." % (argument, optimizer))
    wrappers = [cls.__name__ for cls in type(optimizer).__mro__
                if cls.__name__ in _LOSS_SCALE_WRAPPERS]
    if wrappers:
        raise TypeError(
            "%s is already a loss-scale wrapper (%s), got %r. Loss scaling would "
            "be applied twice; pass the wrapped optimizer itself." % (
                argument, wrappers[0], optimizer))


def check_global_step(global_step):
    """Raises TypeError unless ``global_step`` is None or an integer variable."""
    if global_step is None:
        return
    dtype = getattr(global_step, "dtype", None)
    if not (is_variable(global_step) and dtype.base_dtype.is_integer):
        raise TypeError(
            "global_step must be None or an integer tf.Variable, got %r. Use "
            "tf.train.get_or_create_global_step()." % (global_step,))


def is_variable(value):
    """True for ref and resource variables alike (TF 1.15 and 2.x)."""
    return (isinstance(value, tf.Variable)
            or resource_variable_ops.is_resource_variable(value))



def require_graph_mode(what):
    """Raises ValueError when called while eager execution is enabled.

    Args:
      what: the name of the API being used, for the message.

    Raises:
      ValueError: if eager execution is enabled.
    """
    if tf.executing_eagerly():
        raise ValueError(
            "%s builds a TF1 graph and cannot run eagerly. Call "
            "tf.compat.v1.disable_eager_execution() (or disable_v2_behavior()) "
            "at program start, or build inside `with tf.Graph().as_default():`."
            % what)


def require_top_level(what):
    """Raises ValueError inside a function or control-flow body.

    A float-status step orders the graph's one register clear before the
    ops its read follows; that needs the read at the top level of a
    ``tf.Graph``, not in a ``tf.cond``/``tf.while_loop`` body or a
    ``tf.function``.

    Args:
      what: the name of the API being used, for the message.

    Raises:
      ValueError: inside a function graph or a v1 control-flow context.
    """
    graph = tf.get_default_graph()
    if graph.building_function:
        inside = "function graph %r" % (graph.name,)
    elif graph._get_control_flow_context() is not None:  # pylint: disable=protected-access
        inside = "control-flow body"
    else:
        return
    raise ValueError(
        "%s reads Ascend's float-status register and must be built at the top "
        "level of the graph, got a %s. Build it outside tf.cond, tf.while_loop "
        "and tf.function (compute the losses there if you need to), or pass "
        "backend='is_finite'." % (what, inside))


def check_loss(loss):
    """Raises unless ``loss`` is a floating scalar tensor of the default graph.

    Args:
      loss: the value passed as a group's loss.

    Returns:
      The loss.

    Raises:
      TypeError: for a non-tensor or non-float loss.
      ValueError: for a non-scalar loss or one of another graph.
    """
    if not isinstance(loss, tf.Tensor):
        raise TypeError(
            "loss must be a tf.Tensor, got %r (%s). Pass the scalar loss "
            "tensor of the graph." % (loss, type(loss).__name__))
    if not loss.dtype.base_dtype.is_floating:
        raise TypeError(
            "loss must be a floating-point tensor, got %r with dtype %s. Cast "
            "it with tf.cast(loss, tf.float32)." % (loss, loss.dtype.name))
    if loss.shape.ndims is not None and loss.shape.ndims != 0:
        raise ValueError(
            "loss must be a scalar, got %r with shape %s. Reduce it first, "
            "e.g. tf.reduce_mean(loss)." % (loss, loss.shape))
    if loss.graph is not tf.get_default_graph():
        raise ValueError(
            "loss %r belongs to another graph than the default one. Call "
            "add() inside the graph's `with graph.as_default():` block." % (loss,))
    return loss


def check_group_name(name, taken):
    """Raises ValueError unless ``name`` is a free, valid name scope.

    Args:
      name: the group name.
      taken: the names already used.

    Returns:
      The name.
    """
    if not isinstance(name, str) or not _GROUP_NAME.match(name):
        raise ValueError(
            "name must be a string usable as a TF name scope (letters, digits, "
            "'_', '.', '-'), got %r. Pass e.g. name='generator'." % (name,))
    if name in taken:
        raise ValueError(
            "name %r is already used by another group. Give each group a "
            "unique name." % (name,))
    return name


def default_var_list():
    """Every trainable variable, ref and resource alike."""
    return (tf.trainable_variables()
            + tf.get_collection(tf.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))


def check_var_list(var_list, name, other_groups):
    """Checks a group's variables and returns them as a tuple.

    Args:
      var_list: the variables, or None for every trainable variable.
      name: the group's name, for messages.
      other_groups: the groups recorded before, each with ``name`` and
        ``var_list``.

    Returns:
      A tuple of variables.

    Raises:
      TypeError: for a single variable, a string or a non-variable entry.
      ValueError: for an empty list, a repeated variable, or one already in
        another group.
    """
    if var_list is None:
        var_list = default_var_list()
    elif is_variable(var_list) or isinstance(var_list, (tf.Tensor, str, bytes)):
        raise TypeError(
            "var_list must be a list of variables, got the single %r. Pass the "
            "variables themselves in a list: var_list=[v] (or "
            "tf.trainable_variables('scope') for a scope's variables)." % (var_list,))
    var_list = tuple(var_list)
    if not var_list:
        raise ValueError(
            "var_list for group %r is empty, got %r. Pass the variables this "
            "optimizer trains (e.g. tf.trainable_variables('generator'))."
            % (name, list(var_list)))
    for index, var in enumerate(var_list):
        if not is_variable(var):
            raise TypeError(
                "var_list for group %r must hold tf.Variable objects, got %r. "
                "Pass variables, not tensors read from them." % (name, var))
        if any(var is other for other in var_list[:index]):
            raise ValueError(
                "var_list for group %r lists variable %r twice. Pass each "
                "variable once." % (name, var.name))
        for group in other_groups:
            if any(other is var for other in group.var_list):
                raise ValueError(
                    "variable %r is in group %r and again in group %r. A "
                    "variable can be updated by one optimizer only; split "
                    "the var_lists." % (var.name, group.name, name))
    return var_list


def check_resource_variables(var_list, name):
    """Raises ValueError for a ref variable that a functional ``If`` must assign.

    A branch of a control-flow-v2 ``If`` cannot assign a ref variable, which
    is why Huawei's docs pair control flow v2 with resource variables.

    Args:
      var_list: a group's variables.
      name: the group's name, for the message.
    """
    for var in var_list:
        if not resource_variable_ops.is_resource_variable(var):
            raise ValueError(
                "group %r: variable %r is a ref variable, but the apply gate is a "
                "functional If (control flow v2 is on, with gate='cond', the npu "
                "backend or ENABLE_FORCE_V2_CONTROL=1), whose branch cannot assign "
                "ref variables. Call tf.enable_resource_variables() at program "
                "start (as Huawei's docs do with control flow v2), or "
                "tf.disable_control_flow_v2() to get a v1 cond." % (name, var.name))


def check_no_ref_inputs(ops):
    """Raises ValueError for an update op that writes a ref variable, which a
    functional ``If`` branch cannot do (its copy runs inside the branch)."""
    for op in ops:
        if any(tensor.dtype._is_ref_dtype for tensor in op.inputs):  # pylint: disable=protected-access
            raise ValueError(
                "update op %r writes a ref variable, but the apply gate is a functional "
                "If (control flow v2 with gate='cond', the npu backend or "
                "ENABLE_FORCE_V2_CONTROL=1), whose branch cannot assign ref variables. "
                "Call tf.enable_resource_variables() at program start." % (op.name,))


#: Ops whose gradient is None whatever flows into them.
_GRADIENT_STOPS = ("StopGradient", "PreventGradient")


def reaches_variables(loss, var_list):
    """Whether any of ``var_list`` is a differentiable ancestor of ``loss``.

    A walk of the graph's inputs from the loss through floating-point edges
    (gradients flow through no others), stopping at ``tf.stop_gradient``.
    It makes no op, so ``build()`` can reject a loss that reaches none of
    its variables before anything is added to the graph.

    Args:
      loss: a scalar tensor.
      var_list: variables.

    Returns:
      True if some variable feeds the loss.
    """
    targets = set()
    for var in var_list:
        handle = getattr(var, "handle", None)
        targets.add((handle if handle is not None else var).op.name)
        targets.add(var.op.name)
    seen, stack = set(), [loss.op]
    while stack:
        op = stack.pop()
        if op.name in targets:
            return True
        if op.name in seen or op.type in _GRADIENT_STOPS:
            continue
        seen.add(op.name)
        for tensor in op.inputs:
            dtype = tensor.dtype.base_dtype
            if dtype.is_floating or dtype == tf.resource or dtype.is_complex:
                stack.append(tensor.op)
    return False


class ManagerClaim(collections.namedtuple("ManagerClaim", ["manager", "owner", "what"])):
    """A record that ``owner`` (a builder or a ``LossScaleOptimizer``)
    updates ``manager`` in a graph; ``what`` describes the owner."""


def _manager_claims(graph):
    """The graph's list of ``ManagerClaim``s, kept on the graph object."""
    claims = getattr(graph, "_npu_lossscale_manager_claims", None)
    if claims is None:
        claims = []
        graph._npu_lossscale_manager_claims = claims  # pylint: disable=protected-access
    return claims


def claim_manager(manager, owner, what):
    """Records that ``owner`` updates ``manager`` in the default graph.

    Each builder and ``LossScaleOptimizer`` updates its managers once per
    run; a manager updated by two of them would move its scale twice per
    run (and count each step twice). The same owner may claim again (a
    builder's per-group steps, a group reusing the builder's manager).

    Args:
      manager: a loss-scale manager.
      owner: the builder or optimizer that updates it.
      what: a description of the owner for messages, e.g.
        "a MultiOptimizerLossScale (groups d, g)".

    Raises:
      ValueError: if another owner already claimed ``manager`` in this graph.
    """
    claims = _manager_claims(tf.get_default_graph())
    for claim in claims:
        if claim.manager is manager:
            if claim.owner is owner:
                return
            raise ValueError(
                "loss_scale_manager %r is already updated by %s in this graph, and "
                "%s would update it too: its scale would move twice per run. A manager "
                "belongs to one MultiOptimizerLossScale or LossScaleOptimizer. Give "
                "each its own manager, or add both losses to one "
                "MultiOptimizerLossScale (build(per_group_ops=True) for alternating "
                "runs)." % (manager, claim.what, what))
    claims.append(ManagerClaim(manager, owner, what))


def release_managers(owner):
    """Drops ``owner``'s claims in the default graph (after a failed build).

    Args:
      owner: the builder or optimizer whose claims to drop.
    """
    claims = _manager_claims(tf.get_default_graph())
    claims[:] = [claim for claim in claims if claim.owner is not owner]
