"""Shim-only controls and machinery of the CPU emulation of ``npu_bridge``.

THIS MODULE IS NOT PART OF THE REAL npu_bridge API.  It exists only in the
CPU shim under ``shims/``; production code must never import it.  Tests use it
to pick what the emulated Ascend stack looks like and to inspect graphs.

Controls (process-wide, not thread-local)
-----------------------------------------
* op set: ``"v2"`` (default; gen-ops module has the v1 *and* v2 float-status
  ops) or ``"v1"`` (older adapter: ``npu_get_float_status_v2`` /
  ``npu_clear_float_status_v2`` are absent from the ``get_gen_ops()`` module,
  so ``hasattr(gen_ops, "npu_get_float_status_v2")`` is False).  The gate is
  evaluated on every attribute access, so a module object cached at import
  time follows later changes.  Default from env ``NPU_SHIM_OP_SET`` (a
  shim-only variable), else ``"v2"``.
* overflow mode: ``"inf_nan"`` or ``"saturation"``, the emulated device
  overflow mode (tf_adapter: ``npu_plugin.set_device_sat_mode(0|1)`` /
  ``is_inf_nan_enabled()``, which ask the runtime, ``aclrtSet/GetDeviceSatMode``;
  tf_adapter/util/ge_plugin.cc).  Default from the shim-only env var
  ``NPU_SHIM_OVERFLOW_MODE`` ("inf_nan" or "1", "saturation" or "0"), else
  ``"inf_nan"``: the runtime default on Atlas A2/A3 (docs/en/tfadapter_1/
  apiref/npu_plugin/set_device_sat_mode.md; the Atlas training series, 910A,
  supports only saturation).  ``INF_NAN_MODE_ENABLE`` is PyTorch's (torch_npu)
  variable; tf_adapter never reads it and neither does the shim.  The mode is
  sampled when a float16 op is *built* (graph construction), not at run time.

  INF/NaN mode: float16 results keep their IEEE inf/nan values and the
  emulated status register is NEVER set (the op-creation callback adds
  nothing).  A status read in this mode therefore reports "no overflow" even
  right after an overflow.  tf_adapter never relies on the register in this
  mode (NPULossScaleOptimizer takes contrib's is_finite path when
  ``is_inf_nan_enabled()``), so a library that reads it here is wrong, and
  the shim makes that visible: its injected-overflow tests fail.  Building a
  status read in INF/NaN mode logs a warning.
* checked dtypes: which floating dtypes feed the emulated status register.
  Default ``(tf.float16,)``.  ``tf.bfloat16`` / ``tf.float32`` can be added.
* precision mode: GE's ``precision_mode`` session option, which the real
  stack reads from the ``NpuOptimizer`` custom optimizer of the session
  config (``custom_op.parameter_map["precision_mode"]``) or from
  ``NPURunConfig(precision_mode=...)``, and applies when it compiles the
  graph.  ``"must_keep_origin_dtype"`` (default): ops run in the dtype the
  graph was written in, as the shim always did.  ``"allow_mix_precision"``:
  GE computes the matrix ops of a float32 graph in float16; the shim rounds
  the float32 result of every op in ``MIXED_PRECISION_OPS`` (MatMul, the
  batch matmuls, the convolutions and their gradients) to float16 and back
  when the op is built.  The float16 copy is an ordinary float16 result:
  in saturation mode it is checked (register, +-65504 clip) like any other,
  in INF/NaN mode an overflow is inf.  Gradients pass through float16 too:
  the gradient of the cast back is a float16 cast (checked in saturation
  mode), and the gradient matmuls are rounded in turn.  Default from the
  shim-only env var ``NPU_SHIM_PRECISION_MODE``; the shim cannot see the
  session, so a test that writes the real config passes it to
  ``apply_session_config(config)`` before building the model.  Limits:
  GE rounds the inputs of such an op to float16 and computes in float16;
  the shim computes in float32 and rounds the result only (so an input
  below float16's range that a float32 product brings back into it is not
  lost); which ops GE converts follows its own lists, here only the ones
  named.

  Setters: ``set_op_set``, ``set_overflow_mode``, ``set_checked_dtypes``,
  ``set_precision_mode``, ``apply_session_config``; context managers:
  ``op_set``, ``overflow_mode``, ``checked_dtypes``, ``precision_mode``;
  ``reset()`` restores the env-derived defaults.

The float-status register
-------------------------
One sticky register per *session* (per root ``tf.Graph`` handle, per TF
session resource manager): a ``MutableHashTable`` int64 -> int32 resource
(shared_name ``npu_shim_float_status_register``).  Keys 0..7 are the 8 status
words; word 0 is set to 1 on overflow.  It is NOT a variable: it is in no
variable collection (so snapshots of ``tf.global_variables()`` never see it),
needs no initializer (an absent key reads as 0) and persists across
``session.run`` calls until cleared.  Its handle tensor is stored in the graph
collection ``REGISTER_COLLECTION``.  A new ``tf.Session`` gets a fresh, zero
register (as a fresh device context would).

How the register gets set (instrumentation)
-------------------------------------------
``install()`` (called by ``import npu_bridge``) adds a TF op-creation
callback (``tensorflow.python.framework.op_callbacks``, the mechanism used by
``tf.debugging.enable_check_numerics``) for the current thread.  For every op
built afterwards in a ``tf.Graph`` (or in a cond_v2 branch / while_v2 body
nested in one) that has inputs and produces a checked-dtype output, the
callback adds in saturation mode (and nothing in INF/NaN mode), under
``<op name>/npu_shim_overflow_check/``:

* ``flag = not all(is_finite(output))`` (float16 results that overflow are
  inf in IEEE arithmetic, so this is ``|x| > 65504 or nan``);
* an insert into the register (key 0 if flag else a dummy key 8, value 1:
  an idempotent "set bit", so concurrent ops cannot lose updates);
* a saturated copy ``clip(x, -max, max)`` with NaN -> 0
  (Ascend docs: "saturation mode: Inf -> +-MAX, NaN -> 0");
* the tensor handed back to Python (and thus to every consumer built later)
  is ``IdentityN([saturated, x])[0]`` with a straight-through gradient,
  control-dependent on the insert.  So the register is set whenever the op's result is used, in any
  ``session.run``, including runs that read no status.

The callback is thread-local (TF op callbacks are).  ``uninstall()`` removes
it; a callback left behind after the ``npu_bridge`` modules were dropped from
``sys.modules`` without ``uninstall()`` does nothing, and the next
``install()`` removes it.

Ordering between register writes, reads (get) and clears is plain TF
dataflow: a read sees exactly the writes of instrumented ops that are its
ancestors plus whatever else already ran; a clear resets everything written
before it.  Races the graph leaves open are real races, as on the device.

Ops built while the callback was not installed (e.g. a model built before
``import npu_bridge``, or in another thread) are instrumented retroactively
when a status read (v1 or v2 get) is built in saturation mode: the shim walks the read's
ancestors (data + control inputs) in its graph and rewires all existing
consumers of unchecked outputs with ``Operation._update_input``.  Python
handles to those raw tensors still give raw values in that case.

Counting status reads / clears
------------------------------
Every op the shim builds in place of a real adapter op carries the attribute
``_npu_shim_op_type`` (``SHIM_OP_TYPE_ATTR``) whose value is the real op type
(``NpuGetFloatStatusV2``, ``NpuClearFloatStatusV2``, ``NpuAllocFloatStatus``,
``NpuGetFloatStatus``, ``NpuClearFloatStatus``, ``HcomAllReduce``,
``HcomBroadcast``) and, unless
a name is passed, is *named* like a real op would be (``NpuGetFloatStatusV2``,
``scope/NpuGetFloatStatusV2_1``...).  ``count_ops(graph, op_type)`` counts
such ops in the GraphDef including function bodies (cond_v2 branches);
``count_status_reads`` / ``count_status_clears`` sum the v1 and v2 types;
``find_ops`` returns the live top-level ``tf.Operation`` objects.

Limits of the emulation
-----------------------
* Only outputs of the checked dtypes (default float16, incl. casts to
  float16) set the register; the device also flags float32 AI-core math.
* Not instrumented: ops with no inputs (Const, Placeholder: a fed inf is not
  an overflow), identity / reshape / state / queue / control-flow plumbing
  ops (see ``_SKIP_TYPES``), the outputs of If/While/Case (their bodies are
  instrumented), ops in tf.function / tf.data function graphs and while_v2
  *cond* graphs.
* The raw op output still exists in the graph: gradient functions that use
  ``op.outputs`` (e.g. Exp's) see the unsaturated value in saturation mode
  (their own float16 results are then checked and saturated in turn).
* The register write is a separate op after the producer; it is ordered
  only by dataflow.  A forward overflow that no ancestor of the read needs
  (e.g. gradients that do not use the forward value once grappler folds
  ``Shape(loss)``) may land after the read/clear, i.e. in the next step.
  Put the loss / forward outputs in the read's control dependencies.
* Mode is sampled at graph-build time; the register is per session; the
  callback is per thread; graph mode only (no eager).
* ``npu_alloc_float_status`` returns ``float32_ref`` (static shape [8]; the
  real TF shape function says [1]) so that the in-place write of
  ``npu_get_float_status`` is visible to later readers of the buffer; do not
  capture it into cond_v2 / while_v2 bodies.
* About 10 extra ops per instrumented op; a gradient named
  ``NpuShimSaturateStraightThrough`` is registered process-wide.
"""
from __future__ import absolute_import, division, print_function

import contextlib
import os
import sys
import threading
import weakref

import tensorflow.compat.v1 as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import execute as _execute
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import array_ops as _array_ops
from tensorflow.python.ops import gen_array_ops as _gen_array_ops
from tensorflow.python.ops import gen_lookup_ops as _gen_lookup_ops
from tensorflow.python.ops import math_ops as _math_ops

try:  # TF >= 2.x
    from tensorflow.python.ops import control_flow_v2_func_graphs as _cf_graphs
    _CF_GRAPH_TYPES = (_cf_graphs.CondBranchFuncGraph, _cf_graphs.WhileBodyFuncGraph)
except ImportError:  # pragma: no cover - very old TF
    _CF_GRAPH_TYPES = ()

OP_SET_V1 = "v1"
OP_SET_V2 = "v2"
OP_SETS = (OP_SET_V1, OP_SET_V2)
MODE_INF_NAN = "inf_nan"
MODE_SATURATION = "saturation"
MODES = (MODE_INF_NAN, MODE_SATURATION)

#: shim-only env var selecting the default overflow mode ("inf_nan"/"1" or
#: "saturation"/"0").  Not INF_NAN_MODE_ENABLE: that is torch_npu's variable,
#: tf_adapter never reads it.
MODE_ENV_VAR = "NPU_SHIM_OVERFLOW_MODE"
#: shim-only env var selecting the default op set ("v1" or "v2")
OP_SET_ENV_VAR = "NPU_SHIM_OP_SET"

#: GE's precision modes the shim emulates (the real option has more:
#: force_fp16, force_fp32, allow_fp32_to_fp16, ... which it refuses).
PRECISION_KEEP_DTYPE = "must_keep_origin_dtype"
PRECISION_MIX = "allow_mix_precision"
PRECISION_MODES = (PRECISION_KEEP_DTYPE, PRECISION_MIX)
#: shim-only env var selecting the default precision mode
PRECISION_MODE_ENV_VAR = "NPU_SHIM_PRECISION_MODE"
#: the custom graph optimizer whose parameter_map holds GE's session options
NPU_OPTIMIZER_NAME = "NpuOptimizer"
#: float32 op types whose results "allow_mix_precision" rounds to float16:
#: the matrix (cube unit) ops of GE's mixed-precision allow list, forward
#: and backward.
MIXED_PRECISION_OPS = frozenset([
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
    "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter",
    "Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2",
    "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
    "DepthwiseConv2dNativeBackpropFilter",
])

#: node attribute naming the real adapter op type an emulated op stands for
SHIM_OP_TYPE_ATTR = "_npu_shim_op_type"
#: graph collection holding the register's resource handle (root graph)
REGISTER_COLLECTION = "npu_shim_float_status_register"
REGISTER_SHARED_NAME = "npu_shim_float_status_register"
#: name-scope marker of every op added by the overflow instrumentation
INTERNAL_SCOPE = "npu_shim_overflow_check"

STATUS_WORDS = 8
_DUMMY_KEY = STATUS_WORDS  # written when an op did not overflow

READ_OP_TYPES = ("NpuGetFloatStatus", "NpuGetFloatStatusV2")
CLEAR_OP_TYPES = ("NpuClearFloatStatus", "NpuClearFloatStatusV2")

_ST_GRAD_NAME = "NpuShimSaturateStraightThrough"

# Ops never instrumented: no computation of new values (identity / data
# movement / state access / control flow plumbing / input pipeline).
_SKIP_TYPES = frozenset([
    "Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient",
    "CheckNumerics", "CheckNumericsV2", "EnsureShape", "Print", "PrintV2",
    "Placeholder", "PlaceholderV2", "PlaceholderWithDefault", "Const", "HostConst",
    "ReadVariableOp", "VarHandleOp", "VariableV2", "Variable", "TemporaryVariable",
    "DestroyTemporaryVariable", "ResourceGather", "ResourceGatherNd",
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit",
    "RefExit", "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger",
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "SymbolicGradient",
    "Reshape", "Squeeze", "ExpandDims", "NoOp",
    # Host-side Python (the shim's multi-process HcomAllReduce among them).
    "PyFunc", "EagerPyFunc",
])
_SKIP_PREFIXES = ("Stack", "TensorArray", "TensorList", "Queue", "Iterator",
                  "MultiDeviceIterator", "Optional", "Assign", "Scatter", "Debug",
                  "_")

_lock = threading.RLock()
_state = {}


def _env_mode():
    val = os.environ.get(MODE_ENV_VAR, "").strip().lower()
    if val in ("", "1", MODE_INF_NAN):
        return MODE_INF_NAN
    if val in ("0", MODE_SATURATION):
        return MODE_SATURATION
    raise ValueError("%s must be 'inf_nan' (or '1') or 'saturation' (or '0'), got %r"
                     % (MODE_ENV_VAR, os.environ.get(MODE_ENV_VAR)))


def _env_op_set():
    val = os.environ.get(OP_SET_ENV_VAR, "").strip() or OP_SET_V2
    if val not in OP_SETS:
        raise ValueError("%s must be one of %s, got %r" % (OP_SET_ENV_VAR, OP_SETS, val))
    return val


def _env_precision_mode():
    val = os.environ.get(PRECISION_MODE_ENV_VAR, "").strip() or PRECISION_KEEP_DTYPE
    if val not in PRECISION_MODES:
        raise ValueError("%s must be one of %s, got %r"
                         % (PRECISION_MODE_ENV_VAR, PRECISION_MODES, val))
    return val


def reset():
    """Restore op set, overflow mode, checked dtypes and precision mode to
    their defaults."""
    with _lock:
        _state["op_set"] = _env_op_set()
        _state["mode"] = _env_mode()
        _state["dtypes"] = (tf.float16,)
        _state["precision"] = _env_precision_mode()


reset()


# ----------------------------------------------------------------- controls
@contextlib.contextmanager
def _temporarily(get, set_, value):
    """Context manager: ``set_(value)``, then the old ``get()`` back."""
    old = get()
    set_(value)
    try:
        yield
    finally:
        set_(old)


def get_op_set():
    return _state["op_set"]


def set_op_set(name):
    if name not in OP_SETS:
        raise ValueError("op set must be one of %s, got %r" % (OP_SETS, name))
    with _lock:
        _state["op_set"] = name


def op_set(name):
    """Context manager: temporarily emulate the given op set ("v1"/"v2")."""
    return _temporarily(get_op_set, set_op_set, name)


def get_overflow_mode():
    return _state["mode"]


def set_overflow_mode(mode):
    if mode not in MODES:
        raise ValueError("overflow mode must be one of %s, got %r" % (MODES, mode))
    with _lock:
        _state["mode"] = mode


def overflow_mode(mode):
    """Context manager: temporarily use "inf_nan" or "saturation" mode."""
    return _temporarily(get_overflow_mode, set_overflow_mode, mode)


def get_checked_dtypes():
    return _state["dtypes"]


def set_checked_dtypes(dtypes):
    dts = tuple(tf.as_dtype(d) for d in dtypes)
    for d in dts:
        if d not in _MAX_FINITE:
            raise ValueError("unsupported checked dtype %r (use float16, bfloat16, float32)" % d)
    with _lock:
        _state["dtypes"] = dts


def checked_dtypes(dtypes):
    return _temporarily(get_checked_dtypes, set_checked_dtypes, dtypes)


def get_precision_mode():
    return _state["precision"]


def set_precision_mode(mode):
    """GE's precision mode for ops built afterwards: "must_keep_origin_dtype"
    or "allow_mix_precision" (see the module docstring)."""
    if mode not in PRECISION_MODES:
        raise ValueError("precision mode must be one of %s (the ones the shim emulates), "
                         "got %r" % (PRECISION_MODES, mode))
    with _lock:
        _state["precision"] = mode


def precision_mode(mode):
    """Context manager: temporarily use a precision mode."""
    return _temporarily(get_precision_mode, set_precision_mode, mode)


def apply_session_config(config):
    """Takes the precision mode from a session ConfigProto written the real
    way (the ``NpuOptimizer`` custom optimizer's
    ``parameter_map["precision_mode"]``); without that entry the mode is
    "must_keep_origin_dtype".  GE reads it when the session compiles the
    graph; the shim converts ops as they are built, so call this before
    building the model.  Returns the mode set."""
    mode = PRECISION_KEEP_DTYPE
    for custom in config.graph_options.rewrite_options.custom_optimizers:
        if custom.name == NPU_OPTIMIZER_NAME and "precision_mode" in custom.parameter_map:
            mode = custom.parameter_map["precision_mode"].s.decode("utf-8")
    set_precision_mode(mode)
    return mode


_MAX_FINITE = {
    tf.float16: 65504.0,
    tf.bfloat16: 3.3895313892515355e38,
    tf.float32: 3.4028234663852886e38,
}


# ------------------------------------------------------------ graph helpers
def _root_graph(graph):
    g = graph
    while isinstance(g, _func_graph.FuncGraph):
        g = getattr(g, "outer_graph", None)
        if g is None:
            return None
    return g


def _graph_is_instrumentable(graph):
    """Root tf.Graph, or v2 control-flow bodies nested (only) in one."""
    g = graph
    while isinstance(g, _func_graph.FuncGraph):
        if not isinstance(g, _CF_GRAPH_TYPES):
            return False
        g = getattr(g, "outer_graph", None)
        if g is None:
            return False
    return g is not None


@contextlib.contextmanager
def _root_scope(root):
    """Build in ``root`` at top level: no name scope, control deps, device,
    colocation or (v1) control-flow context."""
    with root.as_default(), root.name_scope(None), root.control_dependencies(None), \
            root.device(None), root.colocate_with(None, ignore_existing=True):
        ctxt = root._get_control_flow_context()  # pylint: disable=protected-access
        root._set_control_flow_context(None)  # pylint: disable=protected-access
        try:
            yield
        finally:
            root._set_control_flow_context(ctxt)  # pylint: disable=protected-access


@contextlib.contextmanager
def _without_control_deps(graph):
    """Drop the active control dependencies but keep the control-flow context."""
    ctxt = graph._get_control_flow_context()  # pylint: disable=protected-access
    with graph.control_dependencies(None):
        graph._set_control_flow_context(ctxt)  # pylint: disable=protected-access
        try:
            yield
        finally:
            graph._set_control_flow_context(None)  # pylint: disable=protected-access


def register_handle(graph=None):
    """Resource handle of the emulated status register of ``graph``'s root
    graph (created on first use).  Usable from nested cond_v2/while_v2
    bodies (it is captured automatically)."""
    graph = graph if graph is not None else _ops.get_default_graph()
    root = _root_graph(graph)
    if root is None:
        raise RuntimeError("npu_bridge shim: the float-status emulation needs a "
                           "tf.Graph (TF1 graph mode); eager execution is not supported")
    coll = root.get_collection_ref(REGISTER_COLLECTION)
    if not coll:
        with _root_scope(root):
            handle = _gen_lookup_ops.mutable_hash_table_v2(
                key_dtype=tf.int64, value_dtype=tf.int32,
                shared_name=REGISTER_SHARED_NAME, use_node_name_sharing=False,
                name="NpuShimFloatStatusRegister")
        coll.append(handle)
    return coll[0]


def tag_op(op, op_type):
    """Mark ``op`` as the emulation of real adapter op type ``op_type``."""
    op._set_attr(SHIM_OP_TYPE_ATTR,  # pylint: disable=protected-access
                 attr_value_pb2.AttrValue(s=op_type.encode("utf-8")))
    return op


def shim_op_type(op):
    """Real op type an op emulates, or None."""
    try:
        return op.get_attr(SHIM_OP_TYPE_ATTR).decode("utf-8")
    except (ValueError, TypeError):
        return None


def status_keys():
    return tf.constant(list(range(STATUS_WORDS)), dtype=tf.int64, name="status_keys")


def read_register(handle, name=None):
    """Untagged int32[8] read of the register (for building the get ops and
    for tests: a peek that is not counted as a status read)."""
    return _gen_lookup_ops.lookup_table_find_v2(
        handle, status_keys(), tf.constant(0, dtype=tf.int32), name=name)


def register_tensor(graph=None):
    """Test helper: untagged int32[8] read of the register (not a "status
    read" for counting purposes, performs no retroactive instrumentation)."""
    graph = graph if graph is not None else _ops.get_default_graph()
    handle = register_handle(graph)
    with graph.as_default():
        return read_register(handle, name="npu_shim_register_peek")


def clear_register_op(handle, name=None):
    return _gen_lookup_ops.lookup_table_insert_v2(
        handle, status_keys(), tf.zeros([STATUS_WORDS], dtype=tf.int32), name=name)


# ---------------------------------------------------------- instrumentation
def _eligible_indices(op_type, n_inputs, outputs):
    if op_type in _SKIP_TYPES or op_type.startswith(_SKIP_PREFIXES) or n_inputs == 0:
        return []
    dts = _state["dtypes"]
    return [i for i, t in enumerate(outputs) if t.dtype in dts]


def _is_internal(op):
    return INTERNAL_SCOPE in op.name


def _st_grad(op, *grads):  # pylint: disable=unused-argument
    # IdentityN([saturated, raw]): route d(out0) straight to the raw tensor.
    return [None, grads[0]]


try:
    _ops.RegisterGradient(_ST_GRAD_NAME)(_st_grad)
except KeyError:  # already registered by an earlier import of this module
    pass


#: Per graph, the names of the scalar constants its checks share
#: (_shared_constant). Names, not tensors: a tensor would keep its graph alive.
_SHARED_CONSTANTS = weakref.WeakKeyDictionary()


def _shared_constant(graph, value, dtype):
    """A scalar constant for the checks built in ``graph``'s current
    control-flow context, made once per (context, dtype, value).

    It is made outside the control dependencies and the colocation active
    where the check is built, so that sharing it ties no two ops together.
    A control-flow context without a name gets a constant of its own each
    time (TF's v1 conds and loops all have one).
    """
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    context_name = None if context is None else getattr(context, "name", None)
    shared = context is None or context_name is not None
    names = _SHARED_CONSTANTS.setdefault(graph, {})
    key = (context_name, dtype.name, value)
    if shared and key in names:
        return graph.get_tensor_by_name(names[key])
    with _without_control_deps(graph), graph.name_scope(None):
        with graph.colocate_with(None, ignore_existing=True):
            constant = tf.constant(value, dtype=dtype, name=INTERNAL_SCOPE + "/shared")
    if shared:
        names[key] = constant.name
    return constant


def _saturate(graph, x):
    """``x`` with +-inf and finite overflows clipped to the dtype's largest
    finite value, and NaN set to 0."""
    dtype = x.dtype.base_dtype
    m = _MAX_FINITE[dtype]
    clipped = _math_ops.minimum(_math_ops.maximum(x, _shared_constant(graph, -m, dtype)),
                                _shared_constant(graph, m, dtype))
    return _array_ops.where_v2(_math_ops.is_nan(x), _shared_constant(graph, 0.0, dtype), clipped)


def _build_check(graph, outputs, indices):
    """Build flag + register write + saturation (saturation mode only);
    return the replacement outputs.

    The write puts 1 at status word 0 when an output holds an inf or a NaN,
    else at the dummy key STATUS_WORDS, which no read looks up.
    """
    handle = register_handle(graph)
    finite = [_math_ops.reduce_all(_math_ops.is_finite(outputs[i])) for i in indices]
    all_finite = finite[0] if len(finite) == 1 else _math_ops.reduce_all(_array_ops.stack(finite))
    key = _array_ops.where_v2(all_finite, _shared_constant(graph, _DUMMY_KEY, tf.int64),
                              _shared_constant(graph, 0, tf.int64))
    write = _gen_lookup_ops.lookup_table_insert_v2(
        handle, key, _shared_constant(graph, 1, tf.int32), name="set_overflow_bit")
    new = list(outputs)
    for i in indices:
        x = outputs[i]
        sat = _saturate(graph, x)
        with graph.control_dependencies([write]), \
                graph.gradient_override_map({"IdentityN": _ST_GRAD_NAME}):
            new[i] = _gen_array_ops.identity_n([sat, x], name="saturated")[0]
    return new


def _mixed_precision(graph, op_type, outputs):
    """Under "allow_mix_precision", the float32 results of an op of
    ``MIXED_PRECISION_OPS`` rounded to float16 (checked in saturation mode)
    and cast back; None for any other op or mode."""
    if (_state["precision"] != PRECISION_MIX or op_type not in MIXED_PRECISION_OPS
            or not _graph_is_instrumentable(graph)):
        return None
    indices = [i for i, t in enumerate(outputs) if t.dtype == tf.float32]
    if not indices:
        return None
    new = list(outputs)
    with graph.name_scope(INTERNAL_SCOPE):
        for i in indices:
            half = _math_ops.cast(outputs[i], tf.float16, name="to_float16")
            if _state["mode"] == MODE_SATURATION and tf.float16 in _state["dtypes"]:
                half = _build_check(graph, [half], [0])[0]
            new[i] = _math_ops.cast(half, tf.float32, name="from_float16")
    return new


def check_collective_output(out):
    """In saturation mode, a float16 collective's result saturates and sets
    the register, as a real HCCL reduction does.

    HCCL hands its reductions the runtime context's overflow address as their
    overflow flag (``DispatcherPub::SetGlobalWorkSpace`` in CANN's hccl
    dispatcher: ``hrtCtxGetOverflowAddr``, on the 910 and 310P3 series), so
    a float16 sum across ranks that overflows is saturated and recorded in
    the same status the float-status ops read. The shim's multi-process
    reduction runs as host Python (a ``PyFunc``, never instrumented), so the
    check is built here, around its output. INF/NaN mode, dtypes that are
    not checked and graphs that are not instrumented get ``out`` back.
    """
    graph = out.graph
    if (_state["mode"] != MODE_SATURATION or out.dtype.base_dtype not in _state["dtypes"]
            or not _graph_is_instrumentable(graph)):
        return out
    # Outside the op callback the check's own float16 ops would be checked
    # in turn: the callback leaves them alone while this flag is up.
    _BUILDING_CHECK.value = True
    try:
        with graph.name_scope(out.op.name + "/" + INTERNAL_SCOPE):
            return _build_check(graph, [out], [0])[0]
    finally:
        _BUILDING_CHECK.value = False


def _drop_stale_eager_context_switch():
    """Undo a side effect of ``install()`` running before
    ``tf.compat.v1.disable_eager_execution()`` (e.g. ``import npu_bridge``
    first in a TF 2 script): creating the eager context while eager was the
    default pushed an "enter eager mode" entry on this thread's
    context-switch stack, and ``init_scope`` (slot variables created inside
    a cond_v2 branch, e.g. Adam under NPULossScaleOptimizer) would then build
    EagerTensors.  Once the process is in graph mode, drop that entry, as if
    the context had been created after the switch."""
    stack = _context.context().context_switches.stack
    if stack and not stack[0].is_building_function and stack[0].enter_context_fn is _context.eager_mode:
        del stack[0]


def _op_callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):  # pylint: disable=unused-argument
    if graph is None or not outputs:
        return None
    if getattr(_EAGER_AT_INSTALL, "value", False) and \
            _context.default_execution_mode == _context.GRAPH_MODE:
        _drop_stale_eager_context_switch()
        _EAGER_AT_INSTALL.value = False
    if sys.modules.get(__name__) is not _THIS_MODULE:
        # npu_bridge was unloaded from sys.modules without uninstall(): the
        # shim is gone, so this left-over callback does nothing.
        return None
    if getattr(_BUILDING_CHECK, "value", False):
        return None
    converted = _mixed_precision(graph, op_type, outputs)
    if converted is not None:
        # Called inside the op's own name scope ("<op_name>/").
        return converted
    if _state["mode"] != MODE_SATURATION:
        # INF/NaN mode: IEEE results, the status register is never set.
        return None
    indices = _eligible_indices(op_type, len(inputs), outputs)
    if not indices or not _graph_is_instrumentable(graph):
        return None
    # Called inside the op's own name scope ("<op_name>/").
    with graph.name_scope(INTERNAL_SCOPE):
        return _build_check(graph, outputs, indices)


_op_callback._npu_shim_callback = True  # pylint: disable=protected-access
_EAGER_AT_INSTALL = threading.local()
_BUILDING_CHECK = threading.local()
_EAGER_AT_INSTALL.value = False
_THIS_MODULE = sys.modules[__name__]


def _shim_callbacks(ctx):
    return [cb for cb in list(ctx.op_callbacks) if getattr(cb, "_npu_shim_callback", False)]


def install():
    """Install the overflow instrumentation for ops built in this thread.
    Idempotent; also replaces callbacks left by earlier imports of the shim."""
    ctx = _context.context()
    for cb in _shim_callbacks(ctx):
        ctx.remove_op_callback(cb)
    ctx.add_op_callback(_op_callback)
    if ctx.executing_eagerly():
        # same as op_callbacks.add_op_callback does for eager mode
        _execute.execute = _execute.execute_with_callbacks
        _EAGER_AT_INSTALL.value = True


def uninstall():
    """Remove the instrumentation callback(s) of the shim from this thread."""
    ctx = _context.context()
    for cb in _shim_callbacks(ctx):
        ctx.remove_op_callback(cb)
    if not ctx.op_callbacks and _execute.execute is _execute.execute_with_callbacks:
        _execute.execute = _execute.quick_execute


def is_installed():
    return bool(_shim_callbacks(_context.context()))


def _is_checked(op, indices):
    for i in indices:
        for c in op.outputs[i].consumers():
            if _is_internal(c):
                return True
    return False


def retro_instrument(op):
    """Instrument unchecked ancestors of ``op`` (same graph) by rewiring their
    consumers.  Returns the number of ops instrumented."""
    graph = op.graph
    if _state["mode"] != MODE_SATURATION:
        tf.logging.warning(
            "npu_bridge shim: float-status read %s built in INF/NaN mode: the register is "
            "not set in this mode, the read reports no overflow (tf_adapter uses is_finite "
            "when npu_plugin.is_inf_nan_enabled())", op.name)
        return 0
    if not _graph_is_instrumentable(graph):
        return 0
    seen = set()
    stack = [op]
    todo = []
    while stack:
        cur = stack.pop()
        if cur._id in seen:  # pylint: disable=protected-access
            continue
        seen.add(cur._id)  # pylint: disable=protected-access
        for t in cur.inputs:
            if t.graph is graph:
                stack.append(t.op)
        for c in cur.control_inputs:
            if c.graph is graph:
                stack.append(c)
        if cur is op or _is_internal(cur):
            continue
        indices = _eligible_indices(cur.type, len(cur.inputs), cur.outputs)
        if indices and not _is_checked(cur, indices):
            todo.append((cur, indices))
    for cur, indices in todo:
        consumers = {}
        for i in indices:
            consumers[i] = [c for c in cur.outputs[i].consumers() if not _is_internal(c)]
        with graph.as_default(), graph.control_dependencies(None), \
                graph.name_scope(cur.name + "/"), graph.name_scope(INTERNAL_SCOPE):
            graph._set_control_flow_context(cur._get_control_flow_context())  # pylint: disable=protected-access
            try:
                new = _build_check(graph, cur.outputs, indices)
            finally:
                graph._set_control_flow_context(None)  # pylint: disable=protected-access
        for i in indices:
            raw = cur.outputs[i]
            for c in consumers[i]:
                for k, inp in enumerate(list(c.inputs)):
                    if inp is raw:
                        c._update_input(k, new[i])  # pylint: disable=protected-access
    return len(todo)


# ----------------------------------------------------------------- counting
def _graph_def(graph_or_graph_def):
    if isinstance(graph_or_graph_def, tf.GraphDef):
        return graph_or_graph_def
    return graph_or_graph_def.as_graph_def()


def _node_shim_type(node):
    if SHIM_OP_TYPE_ATTR in node.attr:
        return node.attr[SHIM_OP_TYPE_ATTR].s.decode("utf-8")
    return None


def count_ops(graph_or_graph_def, op_type, include_functions=True):
    """Number of nodes emulating real op type ``op_type`` (e.g.
    "NpuGetFloatStatusV2"), including function bodies (cond_v2 / while_v2)
    unless ``include_functions`` is False."""
    gd = _graph_def(graph_or_graph_def)
    types = (op_type,) if isinstance(op_type, str) else tuple(op_type)
    n = sum(1 for node in gd.node if _node_shim_type(node) in types)
    if include_functions:
        for fn in gd.library.function:
            n += sum(1 for node in fn.node_def if _node_shim_type(node) in types)
    return n


def count_status_reads(graph_or_graph_def, include_functions=True):
    """NpuGetFloatStatus + NpuGetFloatStatusV2 nodes."""
    return count_ops(graph_or_graph_def, READ_OP_TYPES, include_functions)


def count_status_clears(graph_or_graph_def, include_functions=True):
    """NpuClearFloatStatus + NpuClearFloatStatusV2 nodes."""
    return count_ops(graph_or_graph_def, CLEAR_OP_TYPES, include_functions)


def find_ops(graph, op_type):
    """Live top-level tf.Operation objects emulating ``op_type`` (a str or a
    tuple of str), in creation order."""
    types = (op_type,) if isinstance(op_type, str) else tuple(op_type)
    return [op for op in graph.get_operations() if shim_op_type(op) in types]
