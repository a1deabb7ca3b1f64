"""What ``from npu_bridge.npu_init import *`` gives on the shim, against the real module.

The reference is Huawei's tf_adapter/python/npu_bridge/npu_init.py in
hicann/tensorflow, commit 4f8aa5a7e9a6d5558cb54aa4cb16845f87c0d990 (the last
commit touching the file; unchanged at master 82957b92d1ade2f48ca51dda811f0baec23b04c7).
The module has no ``__all__``, so a star import brings every module-level
name that does not start with an underscore: REAL_NAMES below is that list,
read off the file's imports, assignments, functions and classes.
"""
import os
import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS_README = os.path.join(os.path.dirname(HERE), "shims", "README.md")

# tf_adapter/python/npu_bridge/npu_init.py @ 4f8aa5a7: every public module-level name.
REAL_NAMES = frozenset("""
    os tf backend
    NPURunConfig ProfilingConfig MemoryConfig DumpConfig DynamicInputConfig decorator_tf_session
    NPUEstimator NPUEstimatorSpec
    NPUCheckpointSaverHook NPUOutputTensorHook NPUBroadcastGlobalVariablesHook
    SetIterationsVarHook TellMeStepOrLossHook
    NPUDistributedOptimizer KerasDistributeOptimizer npu_distributed_optimizer_wrapper
    NPUOptimizer npu_allreduce
    NPULossScaleOptimizer FixedLossScaleManager ExponentialUpdateLossScaleManager
    NPUBroadcastGlobalVariablesCallback
    npu_ops npu_rnn npu_scope keras_to_npu npu_strategy util npu_plugin npu_unary_ops hccl_ops
    config_pb2 rewriter_config_pb2 RewriterConfig session session_run_hook
    create_group destroy_group get_rank_size get_local_rank_size get_rank_id get_local_rank_id
    get_world_rank_from_group_rank get_group_rank_from_world_rank
    set_split_strategy_by_idx set_split_strategy_by_size
    profiler npu_cpu_ops scoped_graph_manager
    experimental_options npu_hooks_append npu_callbacks_append npu_config_proto
    npu_graph_options npu_optimizer_options npu_run_config_init set_keras_session_npu_config
    init_resource shutdown_resource close_session
    get_npu_rank_id get_npu_local_rank_id get_npu_rank_size get_npu_local_rank_size
    NpuEmptyHook npu_keras_optimizer npu_tf_optimizer npu_clear_session
""".split())

# What a CPU emulation cannot give: the device (npu_ops, npu_rnn, npu_unary_ops,
# npu_cpu_ops, profiler, init/shutdown of the device and the rank ids that
# init_resource records), CANN's separate ``hccl`` package (hccl.manage.api,
# hccl.split.api), tf.estimator (absent from TF 2.16 on), Keras, and the
# session patch (decorator_tf_session). shims/README.md must list each one.
NOT_EMULATED = frozenset("""
    backend
    MemoryConfig DynamicInputConfig decorator_tf_session
    NPUOutputTensorHook TellMeStepOrLossHook
    KerasDistributeOptimizer NPUBroadcastGlobalVariablesCallback
    npu_rnn npu_scope keras_to_npu npu_unary_ops
    create_group destroy_group get_rank_size get_local_rank_size get_rank_id get_local_rank_id
    get_world_rank_from_group_rank get_group_rank_from_world_rank
    set_split_strategy_by_idx set_split_strategy_by_size
    profiler npu_cpu_ops scoped_graph_manager
    npu_callbacks_append npu_run_config_init set_keras_session_npu_config
    init_resource shutdown_resource
    get_npu_rank_id get_npu_local_rank_id get_npu_rank_size get_npu_local_rank_size
    npu_keras_optimizer npu_clear_session
""".split())


def _star_import():
    namespace = {}
    exec("from npu_bridge.npu_init import *", namespace)  # noqa: S102
    return set(name for name in namespace if name != "__builtins__")


def test_star_import_gives_the_real_names_less_the_listed_ones(npu_shim):
    assert NOT_EMULATED <= REAL_NAMES
    names = _star_import()
    assert sorted(names - REAL_NAMES) == [], "the shim exports names the real module lacks"
    assert sorted((REAL_NAMES - NOT_EMULATED) - names) == [], \
        "names the real module exports, the shim can give, and does not"
    assert names == REAL_NAMES - NOT_EMULATED


def test_shims_readme_lists_every_missing_name():
    # Whatever the star import does not give on the shim is named in
    # shims/README.md's npu_init row, so a porting user can look it up.
    text = open(SHIMS_README).read()
    row = [line for line in text.splitlines() if line.startswith("| `npu_init`:")]
    assert len(row) == 1, "shims/README.md lost its npu_init row"
    missing = [name for name in sorted(NOT_EMULATED)
               if not re.search(r"`%s`" % re.escape(name), row[0])]
    assert missing == []


def test_npu_allreduce_one_rank(npu_shim, graph):
    # estimator/npu/npu_optimizer.py npu_allreduce / _npu_allreduce: a list
    # (or tuple) in gives a list out, a tensor gives a tensor; "mean" is an
    # HcomAllReduce "sum" divided by int(util.get_ranksize()); other
    # reductions pass through; fusion, fusion_id and group go to hccl_ops.allreduce.
    from npu_bridge import _emulation
    from npu_bridge import npu_init
    a = tf.constant([1.0, -2.0])
    b = tf.constant([[3.0]], tf.float16)
    listed = npu_init.npu_allreduce([a, b])
    single = npu_init.npu_allreduce(a, reduction="max", fusion=0, fusion_id=3, group="g")
    from_tuple = npu_init.npu_allreduce((a,), reduction="sum")
    assert isinstance(listed, list) and len(listed) == 2 and isinstance(from_tuple, list)
    assert isinstance(single, tf.Tensor) and listed[1].dtype == tf.float16
    ops = _emulation.find_ops(graph, "HcomAllReduce")
    assert len(ops) == 4
    assert [op.get_attr("_npu_shim_reduction") for op in ops] == [b"sum", b"sum", b"max", b"sum"]
    assert ops[2].get_attr("_npu_shim_fusion") == 0
    assert ops[2].get_attr("_npu_shim_fusion_id") == 3
    assert ops[2].get_attr("_npu_shim_group") == b"g"
    with tf.Session() as sess:
        out = sess.run([listed, single, from_tuple])
    np.testing.assert_array_equal(out[0][0], [1.0, -2.0])   # one rank: sum / 1
    np.testing.assert_array_equal(out[0][1], [[3.0]])
    np.testing.assert_array_equal(out[1], [1.0, -2.0])
    np.testing.assert_array_equal(out[2][0], [1.0, -2.0])


def test_npu_allreduce_mean_divides_by_rank_count(npu_shim, graph, monkeypatch, tmp_path):
    # estimator/npu/npu_optimizer.py _npu_allreduce: mean = sum / the rank
    # count from util.get_ranksize() (RANK_SIZE). Built only: running it
    # would wait for the other rank.
    monkeypatch.setenv("RANK_SIZE", "4")
    monkeypatch.setenv("RANK_ID", "0")
    monkeypatch.setenv("NPU_SHIM_HCCL_DIR", str(tmp_path))
    from npu_bridge import npu_init
    mean = npu_init.npu_allreduce(tf.constant([8.0]))
    assert mean.op.type in ("RealDiv", "Div")
    divisor = tf.get_static_value(mean.op.inputs[1])
    assert divisor == 4.0


def test_npu_allreduce_gathers_indexed_slices(npu_shim, graph):
    # npu_init.py imports npu_allreduce from estimator/npu/npu_optimizer.py,
    # which gathers IndexedSlices with two hccl_ops.allgather calls (values
    # and indices) and divides the values by the rank count for "mean": on
    # one rank, the same slices.
    from npu_bridge import npu_init
    from npu_bridge.estimator.npu import npu_optimizer
    assert npu_init.npu_allreduce is npu_optimizer.npu_allreduce
    slices = tf.IndexedSlices(tf.constant([[1.0], [3.0]]), tf.constant([0, 1]),
                              tf.constant([2, 1]))
    reduced, = npu_init.npu_allreduce([slices])
    assert isinstance(reduced, tf.IndexedSlices)
    types = set(op.type for op in tf.get_default_graph().get_operations())
    assert "HcomAllGather" in types or any(
        op.get_attr("_npu_shim_op_type") == b"HcomAllGather"
        for op in tf.get_default_graph().get_operations()
        if "_npu_shim_op_type" in op.node_def.attr)
    with tf.Session() as sess:
        values, indices = sess.run([reduced.values, reduced.indices])
    np.testing.assert_array_equal(values, [[1.0], [3.0]])
    np.testing.assert_array_equal(indices, [0, 1])


def test_close_session(npu_shim, graph):
    # npu_init.py close_session(sess): sess.close().
    from npu_bridge import npu_init
    sess = tf.Session()
    assert sess.run(tf.constant(3.0)) == 3.0
    npu_init.close_session(sess)
    with pytest.raises(RuntimeError, match="closed"):
        sess.run(tf.constant(1.0))
