"""The float32 view of a loss: the gradient of the same loss through a
float32 copy of its forward graph, for the underflow measurement
(``underflow``).

Every op between the variables and the loss that computes in float16 is
copied with float32 in place of float16, reading the same variables and the
same inputs (placeholders, input pipelines and random draws are taken as
they are, cast to float32), and differentiated in float32, unscaled. That is
the gradient the graph would give if it computed in float32. It exists only
where the model keeps float32 variables (master weights): a float16
variable's gradient ends in float16 whatever computes before it
(``check_float32_view``).
"""

from __future__ import absolute_import, division, print_function

import collections

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals

from npu_lossscale import plugin_helpers as _helpers

#: Ops the float32 view never copies: they are inputs of the step (their
#: values are fed or delivered), taken as they are.
_INPUT_TYPES = _helpers.FEEDABLE_TYPES.union(["Placeholder", "PlaceholderV2"])
#: Ops the float32 view cannot copy: their bodies or frames are not ops of
#: the graph.
_UNCOPYABLE_TYPES = _helpers.CONTROL_FLOW_TYPES.union(_helpers.FUNCTION_CALL_TYPES)


class Float32View(object):
    """The float32 copy of losses' forward graphs (the module docstring).

    Ops are copied once, however many losses share them (a GAN's two losses
    share the generator). Ops are made in the current graph, name scope and
    control-dependency context, so a view built under a gate runs only when
    the gate opens.

    Args:
      losses: the loss tensors to copy.

    Raises:
      ValueError: as ``check_float32_view``.
    """

    def __init__(self, losses):
        self._casts = {}  # float16 tensor name -> its float32 cast
        self._copies = _helpers.Copies(outside=self._input, dtype=_widened,
                                       attr=_widened_attr)
        # loss name -> (its _Copy, (float16 tensor, copy) pairs)
        self._losses = {}
        for loss in losses:
            self._float32(loss)

    def loss(self, loss):
        """The float32 view of ``loss`` (one given to the constructor)."""
        return self._copies.tensor(loss) if loss.op in self._copies else loss

    def backprop(self, loss, var_list):
        """The float32 backprop of ``loss``, unscaled.

        Args:
          loss: a loss given to the constructor.
          var_list: the variables whose gradients are wanted.

        Returns:
          A ``ViewBackprop``.
        """
        copy, activations = self._losses[loss.name]
        activations = _downstream(activations, copy.ancestors, var_list)
        grads = tf.gradients(self.loss(loss), list(var_list) + activations)
        held = [tf.reduce_max(tf.abs(_helpers.dense_values(grad)))
                for grad in grads[len(var_list):] if grad is not None]
        return ViewBackprop(grads[:len(var_list)],
                            tf.reduce_max(tf.stack(held)) if held else tf.zeros([]))

    def _float32(self, loss):
        """Copies every op that ``loss`` needs in float32, in graph order."""
        copy = _ops_to_copy(loss)
        with tf.name_scope("float32_view"):
            self._copies.copy(copy.ops)
        self._losses[loss.name] = (copy, [
            (tensor, self._copies.tensor(tensor)) for op in copy.ops for tensor in op.outputs
            if _is_float16(tensor)])

    def _input(self, tensor):
        """What a copied op takes for ``tensor``, an output of an op not
        copied: the tensor itself, in float32 (a float16 tensor cast once)."""
        if tensor.dtype.base_dtype != tf.float16:
            return tensor
        if tensor.name not in self._casts:
            self._casts[tensor.name] = tf.cast(tensor, tf.float32)
        return self._casts[tensor.name]


def _consumers(op):
    """The ops that take an output of ``op``."""
    return [consumer for tensor in op.outputs for consumer in tensor.consumers()]


def _downstream(activations, ancestors, var_list):
    """The copies of the float16 tensors that depend on a variable of
    ``var_list``: the tensors the float16 backprop of those variables holds.

    Args:
      activations: (original tensor, copy) pairs.
      ancestors: the set of ops the loss depends on.
      var_list: the variables.
    """
    sources = set()
    for var in var_list:
        sources.add(var.op)
        handle = getattr(var, "handle", None)
        if handle is not None:
            sources.add(handle.op)
    descendants = _helpers.reachable(sources, _consumers,
                                     stop=lambda op: op not in ancestors)
    return [copy for original, copy in activations if original.op in descendants]


class ViewBackprop(collections.namedtuple("ViewBackprop", ["grads", "activations_max_abs"])):
    """A loss's float32 backprop, unscaled.

    Attributes:
      grads: the variables' gradients, in order (None where unconnected).
      activations_max_abs: the largest |gradient| of the tensors the forward
        pass computes in float16 (what the float16 backprop holds, over the
        scale); 0 when there is none.
    """


def _widened(dtype):
    """float32 for float16, any other dtype as it is (no ref types here)."""
    dtype = dtype.base_dtype
    return tf.float32 if dtype == tf.float16 else dtype


def _widened_attr(value):
    """An ``AttrValue`` with every float16 type (or float16 tensor) float32."""
    which = value.WhichOneof("value")
    if which == "type" and value.type == _tf_internals.DT_HALF:
        return _tf_internals.AttrValue(type=_tf_internals.DT_FLOAT)
    if which == "list" and _tf_internals.DT_HALF in value.list.type:
        widened = _tf_internals.AttrValue()
        widened.CopyFrom(value)
        del widened.list.type[:]
        widened.list.type.extend(_tf_internals.DT_FLOAT if item == _tf_internals.DT_HALF else item
                                 for item in value.list.type)
        return widened
    if which == "tensor" and value.tensor.dtype == _tf_internals.DT_HALF:
        array = tf.make_ndarray(value.tensor).astype(np.float32)
        return _tf_internals.AttrValue(tensor=tf.make_tensor_proto(array))
    return value


def _is_float16(tensor):
    return tensor.dtype.base_dtype == tf.float16


class _Copy(collections.namedtuple("_Copy", ["ops", "ancestors"])):
    """What the float32 view of a loss copies: ``ops``, in topological
    order, out of ``ancestors``, the set of ops the loss depends on."""


def _ops_to_copy(loss):
    """The ops of ``loss``'s forward graph the float32 view copies
    (``_Copy``).

    An op is copied when it computes something float16 (a float16 input or
    output) or takes a copied op's output, unless it is an input of the step
    (``_INPUT_TYPES``) or stateful (a variable read, a random draw, whose
    value is taken as it is) with no input that changes.

    Raises:
      ValueError: for a stateful op, control flow or a function call that
        would need copying (its float inputs change).
    """
    ancestors = _helpers.reachable([loss.op], _helpers.data_inputs,
                                   stop=lambda op: op.type in _INPUT_TYPES)
    copied = set()
    ordered = []
    for op in _helpers.topological(sorted(ancestors, key=lambda op: op.name),
                                   _helpers.data_inputs):
        if op not in ancestors or op.type in _INPUT_TYPES:
            continue
        changed = [tensor for tensor in op.inputs
                   if tensor.op.name in copied or _is_float16(tensor)]
        if op.type == "Const":
            needed = any(_is_float16(tensor) for tensor in op.outputs)
        elif _stateful(op):
            needed = False
            if any(tensor.dtype.base_dtype.is_floating for tensor in changed):
                raise _cannot_copy(loss, op, "it is stateful")
        else:
            needed = bool(changed) or any(_is_float16(tensor) for tensor in op.outputs)
        if needed and op.type in _UNCOPYABLE_TYPES:
            raise _cannot_copy(loss, op, "it is control flow or a function call")
        if needed:
            copied.add(op.name)
            ordered.append(op)
    return _Copy(ordered, ancestors)


def _stateful(op):
    try:
        return op.op_def.is_stateful
    except (AttributeError, ValueError):
        return True


def _cannot_copy(loss, op, why):
    return ValueError(
        "the float32 view of loss %r cannot copy op %r (%s), which computes in "
        "float16 on the way to the loss. Measure a loss whose float16 part is plain "
        "ops, or leave measure_underflow off (and use a non-listening manager)."
        % (loss.name, op.name, why + ", " + op.type))


def check_float32_view(loss, var_list, group, asked_by, fix):
    """Checks, before any op is made, that ``loss`` has a float32 view, and
    float16 gradients for it to compare with.

    Args:
      loss: the group's loss tensor.
      var_list: its variables.
      group: its name, for the message.
      asked_by: what asks for the measurement, for the message
        (``"measure_underflow=True"``, a listening manager's class name).
      fix: the sentence that ends the messages that ``asked_by`` can fix.

    Raises:
      ValueError: for a float16 variable (its gradient ends in float16);
        a stateful op, control flow or a function call that computes in
        float16 on the way to the loss; no float16 tensor between the
        variables and the loss (a float32 or bfloat16 model, or the float32
        graph of a session rewrite to float16, which would rewrite the view
        as well); or float32 matrix ops that come out rounded to float16 as
        they are built (a precision-mode emulation, which would round the
        view too).
    """
    for var in var_list:
        if var.dtype.base_dtype == tf.float16:
            raise ValueError(
                "group %r: variable %r is float16, so the underflow measurement has no "
                "float32 view of its gradient. Keep the variables float32 and cast them "
                "to float16 in the forward pass." % (group, var.name))
    copy = _ops_to_copy(loss)
    float16 = [(tensor, tensor) for op in copy.ops for tensor in op.outputs
               if _is_float16(tensor)]
    if not _downstream(float16, copy.ancestors, var_list):
        raise ValueError(
            "group %r computes nothing in float16 between its variables and its loss (a "
            "float32 or bfloat16 model, or a graph rewrite), so %s has nothing to "
            "measure. %s" % (group, asked_by, fix))
    rounded = _built_matmul_type()
    if rounded != "MatMul":
        raise ValueError(
            "group %r: a float32 MatMul is built as a %r (a precision mode rounds it to "
            "float16), so %s cannot build a float32 view. %s" % (group, rounded, asked_by, fix))


def _built_matmul_type():
    """The type of the op that a float32 ``tf.matmul`` gives back when it is
    built (in a graph of its own): "MatMul", unless an op callback rewrites
    float32 matrix ops as they are built."""
    with tf.Graph().as_default():
        return tf.matmul(tf.zeros([1, 1]), tf.zeros([1, 1])).op.type
