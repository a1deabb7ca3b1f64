"""Two shim ranks (two processes) running npu_bridge's distributed API.

From tf_adapter (paths under tf_adapter/python/npu_bridge/):
* estimator/npu/npu_loss_scale_optimizer.py: ``is_distributed=True`` sums
  the status with ``hccl_ops.allreduce([status], "sum", fusion=0)``, so every
  rank skips when any rank's register saw an overflow;
* estimator/npu/npu_optimizer.py: NPUDistributedOptimizer averages the
  gradients (HcomAllReduce sum / rank count);
* estimator/npu/npu_hook.py: NPUBroadcastGlobalVariablesHook broadcasts the
  trainable variables from rank 0 when the session is created.

Each rank is a separate process with RANK_SIZE=2, RANK_ID, JOB_ID and the
shim-only NPU_SHIM_HCCL_DIR (see shims/README.md).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import assert_float16_reduction_matches
import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS = os.path.join(os.path.dirname(HERE), "shims")

_WORKER = r"""
import json, os, sys
from graph_mode import set_graph_mode
set_graph_mode()
import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *

rank = int(os.environ["RANK_ID"])
is_distributed = sys.argv[1] == "1"
overflow_rank = 1
x = tf.placeholder(tf.float16, [])
w = tf.Variable(1.0 + rank)                     # ranks start apart: the hook fixes it
loss = tf.cast(x * tf.cast(w, tf.float16) * 1000.0, tf.float32)
manager = ExponentialUpdateLossScaleManager(4.0, 1000, decr_every_n_nan_or_inf=1, decr_ratio=0.5)
opt = NPULossScaleOptimizer(NPUDistributedOptimizer(tf.train.GradientDescentOptimizer(1e-4)),
                            manager, is_distributed=is_distributed)
train = opt.minimize(loss, var_list=[w])
hooks = npu_hooks_append()
for hook in hooks:
    hook.begin()
rows = []
with tf.Session(config=npu_config_proto()) as sess:
    sess.run(tf.global_variables_initializer())
    for hook in hooks:
        hook.after_create_session(sess, None)
    rows.append([float(sess.run(w)), float(sess.run(manager.get_loss_scale()))])
    for step in range(3):
        xv = 100.0 if (step == 1 and rank == overflow_rank) else 1.0
        sess.run(train, {x: xv})
        rows.append([float(sess.run(w)), float(sess.run(manager.get_loss_scale()))])
print("RESULT " + json.dumps(rows))
"""


def _run_two_ranks(tmp_path, mode, script, *args):
    """Runs ``script`` as two shim HCCL ranks in ``mode``; each rank's RESULT."""
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items()
               if k not in ("CM_WORKER_SIZE", "INF_NAN_MODE_ENABLE", "NPU_SHIM_OP_SET")}
        env.update(RANK_SIZE="2", RANK_ID=str(rank), JOB_ID="1", NPU_SHIM_HCCL_DIR=str(tmp_path),
                   NPU_SHIM_HCCL_TIMEOUT="60", NPU_SHIM_OVERFLOW_MODE=mode,
                   TF_CPP_MIN_LOG_LEVEL="3",
                   PYTHONPATH=os.pathsep.join([SHIMS, HERE, os.path.dirname(HERE)]))
        procs.append(warm_python.Popen(
            [sys.executable, "-c", script] + list(args), env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, err[-3000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


@pytest.mark.parametrize("mode", ["saturation", "inf_nan"])
def test_is_distributed_every_rank_skips_when_one_overflows(tmp_path, mode):
    rank0, rank1 = _run_two_ranks(tmp_path, mode, _WORKER, "1")
    # broadcast hook: rank 1 starts from rank 0's weight
    assert rank0[0] == rank1[0] == [1.0, 4.0]
    assert rank0 == rank1                       # identical replicas all along
    # step 1 applies (averaged grad 1000 * 4 / 4 = 1000 -> w = 1 - 0.1);
    # step 2 overflows on rank 1 only: skipped on both ranks, scale halved
    assert rank0[1][0] == pytest.approx(0.9) and rank0[1][1] == 4.0
    assert rank0[2] == [rank0[1][0], 2.0]
    assert rank0[3][0] == pytest.approx(0.8) and rank0[3][1] == 2.0


def test_without_is_distributed_saturation_replicas_drift(tmp_path):
    # Saturation mode, is_distributed=False: each rank decides from its own
    # register.  Rank 1 skips; rank 0 saw no overflow and applies the
    # averaged gradient, which contains rank 1's saturated value.
    rank0, rank1 = _run_two_ranks(tmp_path, "saturation", _WORKER, "0")
    assert rank0[1] == rank1[1]
    assert rank1[2] == [rank1[1][0], 2.0]       # rank 1 skipped
    assert rank0[2][1] == 4.0 and rank0[2][0] != rank1[2][0]   # rank 0 applied: drift


_SUM_WORKER = r"""
import json, os, sys
from graph_mode import set_graph_mode
set_graph_mode()
import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *
import npu_lossscale as nl

x = tf.placeholder(tf.float16, [])
w = tf.Variable(tf.constant(0.0, tf.float16))   # float16 weights: float16 gradients
scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend=sys.argv[1],
                                    distributed="hccl")
scaler.add(w * x, tf.train.GradientDescentOptimizer(1e-4), var_list=[w], name="w")
train = scaler.build()
with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    finite = sess.run([train.update_op, train.is_finite], {x: 40000.0})[1]
    print("RESULT " + json.dumps([float(sess.run(w)), bool(finite)]))
"""


@pytest.mark.parametrize("mode,backend", [("saturation", "npu"), ("inf_nan", "npu"),
                                          ("saturation", "float_status")])
def test_builder_allreduce_of_float16_gradients_cannot_overflow(tmp_path, mode, backend):
    """Each rank's float16 gradient is 40000 (finite); their float16 sum,
    80000, is not. HCCL's AllReduce is an overflow-checked op on Ascend
    (tf_adapter estimator/npu/npu_optimizer.py sums float16 gradients with
    hccl_ops.allreduce(grad, "sum") and NPULossScaleOptimizer reads the
    status after those reduced gradients, estimator/npu/
    npu_loss_scale_optimizer.py), so a float16 sum that overflows after the
    builder's read would be applied saturated (65504 / 2) and missed. The
    builder averages float16 gradients in float32, so the mean is the exact
    40000 and the step applies it: w = -1e-4 * 40000 on both ranks."""
    results = _run_two_ranks(tmp_path, mode, _SUM_WORKER, backend)
    assert results[0] == results[1] == [float(np.float16(-1e-4 * 40000.0)), True]


_HALF_WORKER = r"""
import json, os, sys
from graph_mode import set_graph_mode
set_graph_mode()
import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *
import npu_lossscale as nl

rank = int(os.environ["RANK_ID"])
x = tf.placeholder(tf.float16, [])
w = tf.Variable(tf.constant(0.0, tf.float16))
scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="npu",
                                    distributed="hccl", allreduce_float16=True)
scaler.add(w * x, tf.train.GradientDescentOptimizer(1e-4), var_list=[w], name="w")
train = scaler.build()
data = np.random.RandomState(rank).uniform(-3e4, 3e4, size=[64]).astype(np.float16)
both, reduced = [], []


def shim_type(op):
    try:
        return op.get_attr("_npu_shim_op_type").decode()
    except (ValueError, TypeError):
        return None


for index, half in enumerate((False, True)):
    one = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="npu",
                                     distributed="hccl", allreduce_float16=half)
    u = tf.Variable(tf.zeros([64], tf.float16), name="u%d" % index)
    one.add(tf.reduce_sum(u * tf.constant(data)), tf.train.GradientDescentOptimizer(1.0),
            var_list=[u], name="u")
    before = len(tf.get_default_graph().get_operations())
    both.append((one.build().update_op, u))
    # The dtype the gradient is all-reduced in (the flag sum is float32).
    reduced.append(sorted(set(op.inputs[0].dtype.name
                              for op in tf.get_default_graph().get_operations()[before:]
                              if shim_type(op) == "HcomAllReduce" and op.inputs
                              and op.inputs[0].shape.num_elements() == 64)))
with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    finite = sess.run([train.update_op, train.is_finite], {x: 40000.0})[1]
    for op, _ in both:
        sess.run(op)
    print("RESULT " + json.dumps([float(sess.run(w)), bool(finite)]
                                 + [sess.run(u).astype(np.float32).tolist() for _, u in both]
                                 + [reduced]))
"""


def test_hccl_float16_reduction_equals_the_float32_one_within_float16_rounding(tmp_path):
    """allreduce_float16=True on two shim HCCL ranks, in saturation mode on
    the register (issue 34): the 40000 + 40000 gradients, halved before the
    float16 sum, give the exact mean; 64 random float16 gradients per rank
    reduce to the float32 reduction's values within float16 rounding, the
    same on both ranks, through a float16 HcomAllReduce."""
    ranks = _run_two_ranks(tmp_path, "saturation", _HALF_WORKER)
    assert_float16_reduction_matches(ranks)
    # The default reduces the float16 gradient in float32, the option in
    # float16 (half the bytes); with two ranks the halving is exact, so the
    # two agree to the bit here.
    assert ranks[0][4] == [["float32"], ["float16"]], ranks[0][4]


_HCOM_WORKER = r"""
import json, sys
from graph_mode import set_graph_mode
set_graph_mode()
import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.hccl import hccl_ops
from npu_bridge.helper import helper

ops = helper.get_gen_ops()
x = tf.placeholder(tf.float16, [2])
clear = ops.npu_clear_float_status_v2()
with tf.control_dependencies([clear]):
    start = tf.identity(x)
narrow = hccl_ops.allreduce(start, "sum")
wide = hccl_ops.allreduce(tf.cast(start, tf.float32), "sum")
with tf.control_dependencies([narrow]):
    after_narrow = ops.npu_get_float_status_v2()
with tf.control_dependencies([after_narrow]):
    clear_again = ops.npu_clear_float_status_v2()
with tf.control_dependencies([clear_again, wide]):
    after_wide = ops.npu_get_float_status_v2()
with tf.Session() as sess:
    rows = []
    for value in [[1000.0, 2.0], [40000.0, 2.0]]:
        out = sess.run([narrow, wide, after_narrow, after_wide], {x: value})
        rows.append([[float(v) for v in out[0]], [float(v) for v in out[1]],
                     int(out[2][0]), int(out[3][0])])
print("RESULT " + json.dumps(rows))
"""


@pytest.mark.parametrize("mode", ["saturation", "inf_nan"])
def test_a_float16_hcom_sum_across_ranks_saturates_and_sets_the_register(tmp_path, mode):
    """HCCL gives its reductions the runtime context's overflow address as
    their overflow flag (DispatcherPub::SetGlobalWorkSpace, CANN's hccl
    dispatcher: hrtCtxGetOverflowAddr), so in saturation mode a float16 sum
    that overflows is +-65504 and the float-status read after it reports
    it. In INF/NaN mode the sum is inf and the register is not used. The
    same sum in float32 (what the builder reduces) is exact either way."""
    results = _run_two_ranks(tmp_path, mode, _HCOM_WORKER)
    assert results[0] == results[1]
    fits, overflows = results[0]
    assert fits == [[2000.0, 4.0], [2000.0, 4.0], 0, 0]  # no overflow: nothing set
    if mode == "saturation":
        assert overflows == [[65504.0, 4.0], [80000.0, 4.0], 1, 0]
    else:
        assert overflows == [[float("inf"), 4.0], [80000.0, 4.0], 0, 0]


_SPARSE_WORKER = r"""
import json, os, sys
from graph_mode import set_graph_mode
set_graph_mode()
import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.npu_init import *
from npu_bridge.estimator.npu.npu_optimizer import NPUDistributedOptimizer
import npu_lossscale as nl

ROWS, DIM = 10 ** 5, 16
rank = int(os.environ["RANK_ID"])
table0 = np.random.RandomState(0).normal(0, 0.1, [ROWS, DIM]).astype(np.float32)
ids = tf.placeholder(tf.int32, [3])
x = tf.placeholder(tf.float32, [3, DIM])
y = tf.placeholder(tf.float32, [DIM])


def model(suffix):
    table = tf.get_variable("table" + suffix, initializer=table0, use_resource=True)
    w = tf.get_variable("w" + suffix, initializer=np.arange(DIM, dtype=np.float32),
                        use_resource=True)
    sparse = tf.reduce_sum(tf.nn.embedding_lookup(table, ids) * x)
    return table, w, sparse, tf.reduce_sum(w * y)




def build():
    table, w, sparse_loss, dense_loss = model("")
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), distributed="hccl")
    scaler.add(sparse_loss, tf.train.GradientDescentOptimizer(0.5), var_list=[table],
               name="embedding")
    scaler.add(dense_loss, tf.train.GradientDescentOptimizer(0.25), var_list=[w], name="dense")
    train = scaler.build()
    ref_table, ref_w, ref_sparse, ref_dense = model("_ref")
    reference = tf.group(
        NPUDistributedOptimizer(tf.train.GradientDescentOptimizer(0.5)).minimize(
            ref_sparse, var_list=[ref_table]),
        NPUDistributedOptimizer(tf.train.GradientDescentOptimizer(0.25)).minimize(
            ref_dense, var_list=[ref_w]))
    return table, w, train, ref_table, ref_w, reference


if sys.argv[1] == "npu_strategy":  # the converter's MirroredStrategy
    from npu_bridge.estimator.npu.npu_strategy import NPUStrategy
    strategy = NPUStrategy()
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        table, w, train, ref_table, ref_w, reference = (
            strategy.extended.call_for_each_replica(build))
else:
    table, w, train, ref_table, ref_w, reference = build()


def shim_type(op):
    try:
        return op.get_attr("_npu_shim_op_type").decode()
    except (ValueError, TypeError):
        return None


def ancestors(op):
    seen, stack = set(), [op]
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return seen


def collectives(root):
    ops = ancestors(root)
    return {"table_shaped": sorted(op.type for op in ops for t in op.outputs
                                   if t.shape.as_list() == [ROWS, DIM]
                                   if t.dtype != tf.resource),
            "types": sorted(shim_type(op) for op in ops if shim_type(op))}


graph = {"builder": collectives(train.update_op.op if hasattr(train.update_op, "op")
                                else train.update_op),
         "reference": collectives(reference)}
# Rank 0 looks up rows 1, 5, 7; rank 1 rows 5, 99999, 3 (row 5 on both).
feed = {ids: [[1, 5, 7], [5, ROWS - 1, 3]][rank], y: np.full([DIM], 1.0 + rank, np.float32),
        x: np.random.RandomState(1 + rank).normal(0, 1, [3, DIM]).astype(np.float32)}
rows = [1, 3, 5, 7, ROWS - 1]
steps = []
with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for step in range(3):
        poisoned = dict(feed)
        if step == 1 and rank == 1:  # inf in this rank's sparse values only
            poisoned[x] = np.where(np.arange(3 * DIM).reshape(3, DIM) == 4, np.inf,
                                   feed[x]).astype(np.float32)
        before = sess.run([tf.gather(table, rows), w])
        applied = sess.run([train.update_op, train.applied], poisoned)[1]
        if step != 1:
            sess.run(reference, feed)
        after = sess.run([tf.gather(table, rows), w, tf.gather(ref_table, rows), ref_w])
        steps.append({"applied": bool(applied),
                      "unchanged": all(np.array_equal(a, b) for a, b in zip(before, after[:2])),
                      "equal_to_reference": bool(np.array_equal(after[0], after[2])
                                                 and np.array_equal(after[1], after[3])),
                      "moved": bool(not np.array_equal(before[0], after[0])),
                      "untouched_row": bool(np.array_equal(sess.run(table[2]), table0[2]))})
print("RESULT " + json.dumps({"graph": graph, "steps": steps}))
"""


@pytest.mark.parametrize("strategy", ["none", "npu_strategy"])
def test_sparse_gradients_are_gathered_over_hccl_as_npu_distributed_optimizer_does(tmp_path,
                                                                                   strategy):
    """Issue 43, point 5: a 10**5 x 16 embedding group and a dense group on
    two shim HCCL ranks. tf_adapter's npu_optimizer.allreduce
    (estimator/npu/npu_optimizer.py) gathers an IndexedSlices with two
    hccl_ops.allgather calls, values and indices, and divides the values by
    the rank count; the HCCL engine does the same, so no tensor of the
    table's shape is made (the HCCL engine made the gradient dense and
    all-reduced 6.4 MB a step), and each update equals
    NPUDistributedOptimizer's bit for bit, including the row both ranks
    looked up. An inf in rank 1's sparse values skips both ranks. The same
    under tf_adapter's NPUStrategy (estimator/npu/npu_strategy.py: one
    replica per process, num_replicas_in_sync == RANK_SIZE), built in its
    replica context."""
    ranks = _run_two_ranks(tmp_path, "inf_nan", _SPARSE_WORKER, strategy)
    assert ranks[0] == ranks[1]
    graph = ranks[0]["graph"]
    for name in ("builder", "reference"):
        assert graph[name]["table_shaped"] == [], (name, graph[name])
        assert graph[name]["types"].count("HcomAllGather") == 2, (name, graph[name])
    # The dense group's gradient and the overflow flags: all-reduced.
    assert graph["builder"]["types"].count("HcomAllReduce") == 2, graph["builder"]
    steps = ranks[0]["steps"]
    assert [step["applied"] for step in steps] == [True, False, True]
    assert [step["equal_to_reference"] for step in steps] == [True, True, True]
    assert steps[0]["moved"] and steps[2]["moved"] and steps[1]["unchanged"]
    assert all(step["untouched_row"] for step in steps)
