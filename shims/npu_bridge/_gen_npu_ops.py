"""Emulated adapter op module (what ``helper.get_gen_ops()`` returns).

Signatures follow the TF-generated wrappers of the real op registrations
(tf_adapter/ops/aicore/npu_mixed_precesion_ops.cc, tf_adapter/ops/hccl/
hccl_ops.cc): inputs first, then attrs, then ``name=None``; an op without
outputs returns its ``tf.Operation``.

Op (real type)         | shim result
-----------------------+---------------------------------------------------
NpuAllocFloatStatus    | float32_ref [8], zeros: a per-step buffer
                       | (TemporaryVariable + Assign) so that
                       | NpuGetFloatStatus can write into it in place, as the
                       | device does.  Real TF-side static shape is [1]
                       | (shape fn Vector(1)); the device buffer has 8 floats.
NpuGetFloatStatus(x)   | float32 [8] status; if ``x`` is a ref (the alloc
                       | buffer) the status is also written into it.
NpuClearFloatStatus(x) | float32 zeros shaped like ``x``; clears the register.
NpuGetFloatStatusV2()  | int32 [8] status (word 0 = 1 after an overflow).
NpuClearFloatStatusV2()| tf.Operation (no outputs); clears the register.
HcomAllReduce(...)     | identity (one worker), same dtype/shape as input;
                       | with more than one rank (RANK_SIZE, else
                       | CM_WORKER_SIZE, as util.get_ranksize() reads them)
                       | and NPU_SHIM_HCCL_DIR set, a real reduction across
                       | the processes through files in that directory (see
                       | ``_FileAllReduce``); in saturation mode a float16
                       | result across ranks saturates and sets the register
                       | (``_emulation.check_collective_output``).
HcomAllGather(...)     | identity (one worker); across processes every
                       | rank's input concatenated along dimension 0, in
                       | rank order (same file exchange).
HcomBroadcast(...)     | list in, list out (T: list(type)): identity on one
                       | rank; across processes each output is root_rank's
                       | tensor (same file exchange).

The v2 functions are only visible when the shim op set is "v2" (see
``npu_bridge._emulation.op_set``); this is checked on every attribute access.
"""
from __future__ import absolute_import, division, print_function

import os
import time

import numpy as np
import tensorflow.compat.v1 as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import gen_array_ops as _gen_array_ops
from tensorflow.python.ops import gen_lookup_ops as _gen_lookup_ops
from tensorflow.python.ops import gen_state_ops as _gen_state_ops

from npu_bridge import _emulation as _emu

# HcomAllReduce's T (tf_adapter/ops/hccl/hccl_ops.cc)
_HCOM_DTYPES = (tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.float32, tf.bfloat16)
_HCOM_REDUCTIONS = ("min", "max", "prod", "sum")


def _graph():
    g = _ops.get_default_graph()
    if tf.executing_eagerly():
        raise RuntimeError("npu_bridge shim: float-status ops are emulated in graph mode only")
    return g


def _find_status(g, handle, name):
    """Register read (LookupTableFindV2 -> int32[8]) that picks up the active
    control dependencies itself (its constant inputs are built outside them)."""
    with _emu._without_control_deps(g):  # pylint: disable=protected-access
        keys = _emu.status_keys()
        default = tf.constant(0, dtype=tf.int32, name="default")
    return _gen_lookup_ops.lookup_table_find_v2(handle, keys, default, name=name)


# ------------------------------------------------------------------ v1 ops
def npu_alloc_float_status(name=None):
    """Emulated NpuAllocFloatStatus: float32_ref [8] zero buffer (per step)."""
    _graph()
    with tf.name_scope(name, "NpuAllocFloatStatus") as scope:
        buf = _gen_state_ops.temporary_variable(
            shape=[_emu.STATUS_WORDS], dtype=tf.float32, name="buffer")
        zeros = tf.zeros([_emu.STATUS_WORDS], dtype=tf.float32)
        out = _gen_state_ops.assign(buf, zeros, name=scope)
    _emu.tag_op(out.op, "NpuAllocFloatStatus")
    return out


def npu_get_float_status(input_float, name=None):
    """Emulated NpuGetFloatStatus(addr): float32 [8] status words.

    If ``input_float`` is a reference tensor (the npu_alloc_float_status
    buffer) the status is written into it, so later readers of the buffer see
    it, like the device writes the addr buffer in place.
    """
    g = _graph()
    handle = _emu.register_handle(g)
    with tf.name_scope(name, "NpuGetFloatStatus") as scope:
        addr = input_float
        if not isinstance(addr, tf.Tensor):
            addr = tf.convert_to_tensor(addr, dtype=tf.float32)
        if addr.dtype.base_dtype != tf.float32:
            raise TypeError("NpuGetFloatStatus expects float32, got %s" % addr.dtype)
        with g.control_dependencies([addr.op]):
            words = _find_status(g, handle, "register_read")
        status = tf.cast(words, tf.float32)
        if addr.dtype._is_ref_dtype:  # pylint: disable=protected-access
            written = _gen_state_ops.assign(addr, status, validate_shape=False)
            out = _gen_array_ops.identity(written, name=scope)
        else:
            out = _gen_array_ops.identity(status, name=scope)
    _emu.tag_op(out.op, "NpuGetFloatStatus")
    _emu.retro_instrument(out.op)
    return out


def npu_clear_float_status(float_status, name=None):
    """Emulated NpuClearFloatStatus: clears the register (after its input is
    available) and returns float32 zeros shaped like the input."""
    g = _graph()
    handle = _emu.register_handle(g)
    with tf.name_scope(name, "NpuClearFloatStatus") as scope:
        x = float_status
        if not isinstance(x, tf.Tensor):
            x = tf.convert_to_tensor(x, dtype=tf.float32)
        if x.dtype.base_dtype != tf.float32:
            raise TypeError("NpuClearFloatStatus expects float32, got %s" % x.dtype)
        with _emu._without_control_deps(g):  # pylint: disable=protected-access
            keys = _emu.status_keys()
            zero_words = tf.zeros([_emu.STATUS_WORDS], dtype=tf.int32)
        with g.control_dependencies([x.op]):
            cleared = _gen_lookup_ops.lookup_table_insert_v2(
                handle, keys, zero_words, name="register_clear")
        with g.control_dependencies([cleared]):
            out = _gen_array_ops.identity(_gen_array_ops.zeros_like(x), name=scope)
    _emu.tag_op(out.op, "NpuClearFloatStatus")
    return out


# ------------------------------------------------------------------ v2 ops
def _npu_get_float_status_v2(name=None):
    """Emulated NpuGetFloatStatusV2(): int32 [8] status words (no inputs)."""
    g = _graph()
    handle = _emu.register_handle(g)
    with tf.name_scope(name, "NpuGetFloatStatusV2") as scope:
        out = _find_status(g, handle, scope)
    _emu.tag_op(out.op, "NpuGetFloatStatusV2")
    _emu.retro_instrument(out.op)
    return out


def _npu_clear_float_status_v2(name=None):
    """Emulated NpuClearFloatStatusV2(): no inputs, no outputs; returns the
    tf.Operation that resets the register."""
    g = _graph()
    handle = _emu.register_handle(g)
    with tf.name_scope(name, "NpuClearFloatStatusV2") as scope:
        with _emu._without_control_deps(g):  # pylint: disable=protected-access
            keys = _emu.status_keys()
            zero_words = tf.zeros([_emu.STATUS_WORDS], dtype=tf.int32)
        op = _gen_lookup_ops.lookup_table_insert_v2(handle, keys, zero_words, name=scope)
    _emu.tag_op(op, "NpuClearFloatStatusV2")
    return op


_V2_OPS = {
    "npu_get_float_status_v2": _npu_get_float_status_v2,
    "npu_clear_float_status_v2": _npu_clear_float_status_v2,
}


# -------------------------------------------------------------------- hccl
def _rank_size():
    # The collective's group size: the rank count as tf_adapter reads it
    # (npu_bridge/estimator/npu/util.py get_ranksize: RANK_SIZE, else
    # CM_WORKER_SIZE, error if both).
    from npu_bridge.estimator.npu import util  # pylint: disable=import-outside-toplevel
    value = util.get_ranksize().strip() or "1"  # blank counts as unset here
    try:
        return int(value)
    except ValueError:
        raise ValueError("npu_bridge shim: rank size %r is not an integer" % (value,))


def _tag_hcom(op, op_type, group, fusion, fusion_id, **extra):
    _emu.tag_op(op, op_type)
    op._set_attr("_npu_shim_group", attr_value_pb2.AttrValue(s=str(group).encode()))  # pylint: disable=protected-access
    op._set_attr("_npu_shim_fusion", attr_value_pb2.AttrValue(i=int(fusion)))  # pylint: disable=protected-access
    op._set_attr("_npu_shim_fusion_id", attr_value_pb2.AttrValue(i=int(fusion_id)))  # pylint: disable=protected-access
    for key, value in extra.items():
        attr = (attr_value_pb2.AttrValue(s=value.encode()) if isinstance(value, str)
                else attr_value_pb2.AttrValue(i=int(value)))
        op._set_attr("_npu_shim_" + key, attr)  # pylint: disable=protected-access


def hcom_all_reduce(input, reduction, group, fusion, fusion_id, name=None):  # pylint: disable=redefined-builtin
    """Emulated HcomAllReduce: identity for one worker, else across processes."""
    if reduction not in _HCOM_REDUCTIONS:
        raise ValueError("HcomAllReduce: reduction must be one of %s, got %r"
                         % (_HCOM_REDUCTIONS, reduction))
    rank_size = _rank_size()
    x = tf.convert_to_tensor(input)
    if x.dtype.base_dtype not in _HCOM_DTYPES:
        raise TypeError("HcomAllReduce: dtype %s not in %s"
                        % (x.dtype.name, [d.name for d in _HCOM_DTYPES]))
    if rank_size == 1:
        out = _gen_array_ops.identity(x, name=name or "HcomAllReduce")
    else:
        out = _multi_process(x, _NUMPY_REDUCE[reduction], rank_size, name or "HcomAllReduce")
    _tag_hcom(out.op, "HcomAllReduce", group, fusion, fusion_id, reduction=reduction)
    # A reduction across ranks can overflow float16 (one rank cannot).
    return out if rank_size == 1 else _emu.check_collective_output(out)


def hcom_broadcast(input, fusion, fusion_id, group, root_rank, name=None):  # pylint: disable=redefined-builtin
    """Emulated HcomBroadcast (T: list(type)): a list of tensors in, the same
    list out, each output being root_rank's value of that input.

    One rank: an IdentityN (root_rank must be 0).  Several processes (see
    ``hcom_all_reduce``): one file exchange per tensor of the list; every
    rank writes its value and takes root_rank's.
    """
    tensors = [tf.convert_to_tensor(t) for t in (input if isinstance(input, (list, tuple)) else [input])]
    rank_size = _rank_size()
    if not 0 <= int(root_rank) < rank_size:
        raise ValueError("HcomBroadcast: root_rank must be in [0, %d), got %r"
                         % (rank_size, root_rank))
    name = name or "HcomBroadcast"
    if rank_size == 1:
        outs = list(_gen_array_ops.identity_n(tensors, name=name)) if tensors else []
        ops_ = [outs[0].op] if outs else []
    else:
        root = int(root_rank)
        outs = []
        with tf.name_scope(name):
            for t in tensors:
                outs.append(_multi_process(t, lambda stacked, r=root: stacked[r], rank_size,
                                           "HcomBroadcast"))
        ops_ = [o.op for o in outs]
    for op in ops_:
        _tag_hcom(op, "HcomBroadcast", group, fusion, fusion_id, root_rank=int(root_rank))
    return outs


def hcom_all_gather(input, group, fusion, fusion_id, rank_size, name=None):  # pylint: disable=redefined-builtin
    """Emulated HcomAllGather: every rank's ``input`` concatenated along
    dimension 0, in rank order (output dimension 0 is ``rank_size`` times
    the input's, as the real op's shape function says,
    tf_adapter/ops/hccl/hccl_ops.cc; every rank gives the same shape).

    One rank: the identity (``rank_size`` must then be 1). Several
    processes (see ``hcom_all_reduce``): one file exchange per run.
    """
    x = tf.convert_to_tensor(input)
    if int(rank_size) < 1:
        raise ValueError("HcomAllGather: rank_size should be greater than 0, got %r"
                         % (rank_size,))
    if int(rank_size) != _rank_size():
        raise ValueError("npu_bridge shim: HcomAllGather rank_size=%r, but this job has %d "
                         "ranks (RANK_SIZE / CM_WORKER_SIZE)" % (rank_size, _rank_size()))
    if int(rank_size) == 1:
        out = _gen_array_ops.identity(x, name=name or "HcomAllGather")
    else:
        out = _multi_process(x, lambda stacked: stacked.reshape((-1,) + stacked.shape[2:]),
                             int(rank_size), name or "HcomAllGather", gathered=True)
    _tag_hcom(out.op, "HcomAllGather", group, fusion, fusion_id, rank_size=int(rank_size))
    return out


# Graph collection counting the multi-process collectives built so far.
_HCOM_COLLECTION = "npu_shim_hcom_all_reduce"
# Seconds a rank waits for the others at one collective before failing.
HCCL_TIMEOUT = float(os.environ.get("NPU_SHIM_HCCL_TIMEOUT", "120"))
_NUMPY_REDUCE = {
    "sum": lambda stacked: np.sum(stacked, axis=0),
    "prod": lambda stacked: np.prod(stacked, axis=0),
    "min": lambda stacked: np.min(stacked, axis=0),
    "max": lambda stacked: np.max(stacked, axis=0),
}


def _multi_process(x, reduce_fn, rank_size, name, gathered=False):
    directory = os.environ.get("NPU_SHIM_HCCL_DIR", "").strip()
    if not directory:
        raise NotImplementedError(
            "npu_bridge shim: %s across %d ranks (RANK_SIZE / CM_WORKER_SIZE) needs "
            "NPU_SHIM_HCCL_DIR, a directory shared by all the processes (the shim "
            "exchanges tensors through files there); one rank is the identity"
            % (name, rank_size))
    try:
        rank = int(os.environ.get("RANK_ID", ""))
    except ValueError:
        rank = -1
    if not 0 <= rank < rank_size:
        raise ValueError("npu_bridge shim: RANK_ID must be in [0, %d), got %r"
                         % (rank_size, os.environ.get("RANK_ID")))
    graph = tf.get_default_graph()
    # Every rank builds the same graph, so the n-th collective built is the
    # same collective on every rank.
    index = len(graph.get_collection(_HCOM_COLLECTION))
    graph.add_to_collection(_HCOM_COLLECTION, index)
    reducer = _FileAllReduce(directory, rank, rank_size, "hcom%d" % index, reduce_fn, name)
    out = tf.py_func(reducer, [x], x.dtype.base_dtype, stateful=True, name=name)
    shape = x.shape
    if gathered and shape.ndims:  # dimension 0 of every rank, concatenated
        first = shape.dims[0].value
        shape = tf.TensorShape([None if first is None else first * rank_size]).concatenate(
            shape[1:])
    out.set_shape(shape)
    return out


class _FileAllReduce(object):
    """One emulated collective: each call is one allreduce across the ranks.

    Call ``n`` of rank ``r`` writes ``<dir>/<key>.<n>.<r>.npy`` (through a
    rename, so it appears whole), waits until every rank's file for call
    ``n`` exists, and reduces them in rank order, so every rank computes the
    same result bit for bit. A rank that has read every file of call ``n``
    knows every rank finished call ``n - 1``, so it then removes its own file
    of call ``n - 1``. A rank that does not arrive within ``HCCL_TIMEOUT``
    seconds fails the run with the missing ranks' ids, like a hung HCCL job
    reports its timeout, instead of hanging.
    """

    def __init__(self, directory, rank, rank_size, key, reduce_fn, op_type="HcomAllReduce"):
        self._directory = directory
        self._rank = rank
        self._rank_size = rank_size
        self._key = key
        self._reduce_fn = reduce_fn
        self._op_type = op_type
        self._calls = 0

    def _path(self, call, rank):
        return os.path.join(self._directory, "%s.%d.%d.npy" % (self._key, call, rank))

    def __call__(self, value):
        call = self._calls
        self._calls += 1
        mine = self._path(call, self._rank)
        with open(mine + ".tmp", "wb") as handle:
            np.save(handle, value)
        os.replace(mine + ".tmp", mine)
        deadline = time.time() + HCCL_TIMEOUT
        values = []
        for rank in range(self._rank_size):
            path = self._path(call, rank)
            while not os.path.exists(path):
                if time.time() > deadline:
                    missing = [r for r in range(self._rank_size)
                               if not os.path.exists(self._path(call, r))]
                    raise RuntimeError(
                        "npu_bridge shim: %s %s (call %d) on rank %d waited "
                        "%gs for rank(s) %s" % (self._op_type, self._key, call, self._rank,
                                                HCCL_TIMEOUT, missing))
                time.sleep(0.001)
            values.append(np.load(path))
        if call > 0:
            os.remove(self._path(call - 1, self._rank))
        stacked = np.stack(values)
        result = self._reduce_fn(stacked)
        return np.asarray(result, dtype=value.dtype)


# ------------------------------------------------------------ op-set gate
def __getattr__(name):  # PEP 562
    if name in _V2_OPS and _emu.get_op_set() == _emu.OP_SET_V2:
        return _V2_OPS[name]
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def __dir__():
    names = [n for n in globals() if not n.startswith("_")]
    if _emu.get_op_set() == _emu.OP_SET_V2:
        names.extend(_V2_OPS)
    return sorted(names)
