"""Every use of TensorFlow's private API, in one module: each entry names the
private member or module it reaches and the TF versions it exists in (users
run 1.15; the tests run 2.15 and 2.21). A TF upgrade breaks this module alone.
"""

from __future__ import absolute_import, division, print_function

import collections

from tensorflow.core.framework import attr_value_pb2, types_pb2, variable_pb2  # 1.15-2.21
from tensorflow.python.framework import op_def_registry  # 1.15-2.21
from tensorflow.python.ops import cond_v2 as _cond_v2  # 1.15-2.21
from tensorflow.python.ops import resource_variable_ops  # 1.15-2.21
from tensorflow.python.training.experimental import mixed_precision  # 1.15-2.21

# pylint: disable=protected-access

#: ``AttrValue``, ``DataType`` and ``VariableDef`` protos
#: (tensorflow/core/framework/*.proto, 1.15-2.21).
AttrValue = attr_value_pb2.AttrValue
DT_HALF = types_pb2.DT_HALF
DT_FLOAT = types_pb2.DT_FLOAT
VariableDef = variable_pb2.VariableDef


def refuse_graph_rewrite_wrapping(optimizer_cls, refusal):
    """Makes ``enable_mixed_precision_graph_rewrite(opt)`` raise ``refusal``
    (an exception) for an instance of ``optimizer_cls`` when it would wrap
    it: ``mixed_precision._REGISTERED_WRAPPER_OPTIMIZER_CLS`` (1.15-2.21;
    values are wrapper classes in 1.15, ``(wrapper_fn, wrapper_cls)`` since
    2.1), with this class's entry first so that it is consulted before
    ``tf.train.Optimizer``'s."""
    class Refused(object):  # pylint: disable=too-few-public-methods
        """Never an instance; built, it raises the refusal."""

        def __new__(cls, opt, loss_scale):
            raise type(refusal)(*refusal.args)

    table = mixed_precision._REGISTERED_WRAPPER_OPTIMIZER_CLS
    entries = list(table.items())
    entry = (Refused, Refused) if entries and isinstance(entries[0][1], tuple) else Refused
    table.clear()
    table[optimizer_cls] = entry
    table.update((key, value) for key, value in entries if key is not optimizer_cls)


def registered_op_def(op_type):
    """The ``OpDef`` registered for ``op_type``, or None.

    ``op_def_registry.get`` (TF 2.x) or ``get_registered_ops()`` (TF 1.15).
    """
    get = getattr(op_def_registry, "get", None)
    if get is not None:
        return get(op_type)
    return op_def_registry.get_registered_ops().get(op_type)


def cond_v2(pred, true_fn, false_fn, name):
    """A functional ``If`` whatever the control-flow version:
    ``tensorflow.python.ops.cond_v2.cond_v2`` (1.15-2.21)."""
    return _cond_v2.cond_v2(pred, true_fn, false_fn, name=name)


def keep_if_whole(if_op):
    """Keeps a functional ``If`` from being lowered into Switch/Merge:
    ``Operation._set_attr`` of ``_lower_using_switch_merge`` (1.15-2.21)."""
    if_op._set_attr("_lower_using_switch_merge", AttrValue(b=False))


def control_flow_context(graph_or_op):
    """The v1 control-flow context ops are made in (a ``tf.Graph``) or an op
    was made in (a ``tf.Operation``), None at the top level:
    ``_get_control_flow_context`` (1.15-2.21)."""
    return graph_or_op._get_control_flow_context()


def add_control_input(op, dep):
    """Makes the existing ``op`` run after ``dep``:
    ``Operation._add_control_input`` (1.15-2.21)."""
    op._add_control_input(dep)


def is_ref_dtype(dtype):
    """Whether ``dtype`` is a ref type (a v1 variable's):
    ``DType._is_ref_dtype`` (1.15-2.21)."""
    return dtype._is_ref_dtype


def is_resource_variable(value):
    """``resource_variable_ops.is_resource_variable`` (1.15-2.21)."""
    return resource_variable_ops.is_resource_variable(value)


def graph_function(graph, name):
    """The function ``name`` defined in ``graph``, or None:
    ``Graph._get_function`` (1.15-2.21)."""
    get = getattr(graph, "_get_function", None)
    return None if get is None else get(name)


def library_state(graph, make):
    """The library's record, an attribute of the ``tf.Graph`` object itself
    (made by ``make()`` on first use)."""
    state = getattr(graph, "_npu_lossscale_state", None)
    if state is None:
        state = make()
        graph._npu_lossscale_state = state
    return state


def wrapped_optimizer(optimizer):
    """The optimizer a wrapper applies through, or None: ``_opt`` of
    ``SyncReplicasOptimizer`` (1.15-2.21) and of contrib's and npu_bridge's
    loss-scale optimizers, ``_optimizer`` of npu_bridge's
    ``NPUDistributedOptimizer``."""
    inner = getattr(optimizer, "_optimizer", None)
    if inner is None:
        inner = getattr(optimizer, "_opt", None)
    return inner


def npu_optimizer_flag(optimizer, name):
    """An ``NPUOptimizer`` constructor flag (``_is_loss_scale``,
    ``_is_distributed``; tf_adapter npu_bridge/estimator/npu/npu_optimizer.py),
    False when absent."""
    return bool(getattr(optimizer, "_" + name, False))


# -- tf.train.Optimizer's state tables and checkpoint hooks ------------------
# ``Optimizer._slots``, ``_non_slot_dict`` and ``_deferred_slot_restorations``
# (1.15-2.21) hold an optimizer's slot variables and non-slot variables
# (Adam's beta powers); ``Trackable._maybe_initialize_trackable``,
# ``_deferred_dependencies`` and ``_unconditional_checkpoint_dependencies``
# (1.15-2.21) are the checkpoint machinery's per-object state.

def share_optimizer_state(wrapper, holder):
    """Makes ``wrapper`` read and write ``holder``'s slot and non-slot tables."""
    wrapper._slots = holder._slots
    wrapper._non_slot_dict = holder._non_slot_dict
    wrapper._deferred_slot_restorations = holder._deferred_slot_restorations


def deferred_dependencies(holder):
    """``holder``'s checkpoint restores waiting for their variable."""
    holder._maybe_initialize_trackable()
    return holder._deferred_dependencies


def tracked_children(holder):
    """``(name, object)`` of what ``holder`` tracks itself, in order."""
    holder._maybe_initialize_trackable()
    return [(reference.name, reference.ref)
            for reference in holder._unconditional_checkpoint_dependencies]


def trackable_reference(name, ref):
    """A ``TrackableReference``: ``tensorflow.python.trackable.base`` (2.10
    and later) or ``tensorflow.python.training.tracking.base`` (1.15-2.9)."""
    try:
        from tensorflow.python.trackable import base  # pylint: disable=import-outside-toplevel
    except ImportError:
        from tensorflow.python.training.tracking import base  # pylint: disable=import-outside-toplevel
    return base.TrackableReference(name, ref)


def reference_dtype_inputs(op):
    """Whether any input of ``op`` is a ref tensor (a v1 variable's)."""
    return any(is_ref_dtype(tensor.dtype) for tensor in op.inputs)


class CheckpointsWrappedState(object):
    """Checkpoint hooks for an optimizer that stands for the one it wraps.

    Mixed into ``LossScaleOptimizer``: saves the state of ``self._holder``
    (which holds the wrapped optimizer's slots) and what ``self._opt``
    tracks as its own, and restores the layout that tracked the wrapped
    optimizer as the child ``previous_child``. Overrides ``Trackable``'s
    ``_deferred_dependencies``, ``_lookup_dependency``,
    ``_checkpoint_dependencies`` (1.15) and ``_trackable_children`` (2.x).
    """

    previous_child = None

    @property
    def _deferred_dependencies(self):
        return deferred_dependencies(self._holder)

    def _lookup_dependency(self, name, *args, **kwargs):
        found = super(CheckpointsWrappedState, self)._lookup_dependency(name, *args, **kwargs)
        if found is None and name == self.previous_child:
            return self._opt
        if found is None:
            found = self._wrapped_children().get(name)
        return found

    def _wrapped_children(self):
        children = collections.OrderedDict()
        for holder in (self._opt, self._holder):
            for name, ref in tracked_children(holder):
                children.setdefault(name, ref)
        return children

    @property
    def _checkpoint_dependencies(self):
        own = super(CheckpointsWrappedState, self)._checkpoint_dependencies
        names = set(reference.name for reference in own)
        return own + [trackable_reference(name, ref)
                      for name, ref in self._wrapped_children().items() if name not in names]

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super(CheckpointsWrappedState, self)._trackable_children(save_type, **kwargs)
        for name, ref in self._wrapped_children().items():
            children.setdefault(name, ref)
        return children
