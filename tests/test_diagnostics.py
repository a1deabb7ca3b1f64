"""Skip reasons (npu_lossscale/diagnostics/): each injected fault gets its
reason, its groups and exactly its variables, on the is_finite backend and
on the npu shim in saturation and INF/NaN modes; the record is written only
in the skip branch.

What the register backend can know comes from tf_adapter's documentation of
the overflow modes (docs/en/tfadapter_1/apiref/npu_plugin/
set_device_sat_mode.md, "saturation mode: Inf -> +-MAX, NaN -> 0"), which the
shim emulates (shims/npu_bridge/_emulation.py): a float16 overflow in
saturation mode is +-65504, finite, and sets the float-status register; a NaN
becomes 0. So there:

* an inf or a too-large value poured into one gradient reaches the variable
  as exactly +-65504 (cast to float32 at the master weight), which names it;
* a NaN loss (the loss itself is float32 here, which the shim does not
  saturate) is seen as a NaN loss, but its NaN gradients are flushed to 0:
  no variable is named;
* a forward overflow whose saturated value never reaches the loss or a
  gradient leaves only the register set: "register_outside_gradients".
  With is_finite (and INF/NaN mode) the same fault changes nothing that is
  checked, and the step applies.
"""

import collections
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from tensorflow.core.protobuf import config_pb2

import npu_lossscale as nl
from npu_lossscale import diagnostics
from conftest import GRAPH_MODE, REPO, SHIMS, fresh_process
from readme_blocks import run_example
from skip_faults import (GROUPS, HUGE_GRADIENT, INF_GRADIENT, NAN_LOSS, Fault, build_model,
                         build_shared_model, build_step, expected, fault_feed, schedule)
import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))

BACKENDS = {
    # name: (backend, shim overflow mode or None)
    "is_finite": ("is_finite", None),
    "npu_saturation": ("npu", "saturation"),
    "npu_inf_nan": ("npu", "inf_nan"),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    """A backend name, with the shim on sys.path in the overflow mode it needs."""
    name, mode = BACKENDS[request.param]
    if mode is None:
        yield name, False
        return
    request.getfixturevalue("npu_shim")
    from npu_bridge.estimator.npu import npu_plugin
    npu_plugin.set_device_sat_mode(0 if mode == "saturation" else 1)
    yield name, mode == "saturation"


def _observed(sess, train, feed):
    _, reason, overflowed, applied = sess.run(
        [train.update_op, train.diagnosis.skip_reason, train.diagnosis.groups_overflowed, train.applied], feed)
    return reason, overflowed, applied


def test_one_hundred_faults_each_get_their_reason_groups_and_variables(graph, backend):
    """Built once, 100 faults fed through one session, a clean run between
    faults. A fault's reason, groups and exactly its variables are in the
    record after its run, and skip_reason/groups_overflowed say the same for
    the run; clean runs apply with reason 0."""
    name, saturation = backend
    model = build_model()
    train = build_step(model, name)
    faults = schedule(100, seed=3)
    right, wrong, skips = 0, [], 0
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert diagnostics.read_last_skip(sess, train) is None
        for fault in faults:
            reason, overflowed, applied = _observed(sess, train, model.feed)
            assert (reason, applied) == (0, True) and not any(overflowed.values())
            want_reason, want_groups, want_variables = expected(fault, model, saturation)
            reason, overflowed, applied = _observed(sess, train, fault_feed(model, fault))
            record = diagnostics.read_last_skip(sess, train)
            if want_reason == "applied":
                got = (diagnostics.reason_name(reason), applied, record and record.number)
                ok = got == ("applied", True, skips or None)
            else:
                skips += 1
                got = (diagnostics.reason_name(reason), applied,
                       tuple(g for g in GROUPS if overflowed[g]), record)
                ok = (got[:3] == (want_reason, False, want_groups)
                      and record == diagnostics.Skip(skips, record.global_step, want_reason,
                                                     want_groups, want_variables))
            if ok:
                right += 1
            else:
                wrong.append((fault, got))
        counts = sess.run(train.diagnosis.last_skip.reason_counts)
    assert right == 100, wrong[:4]
    by_reason = collections.Counter(expected(f, model, saturation)[0] for f in faults)
    assert [int(c) for c in counts] == [0] + [by_reason[r] for r in diagnostics.REASONS[1:]]


@pytest.mark.parametrize("kind", [INF_GRADIENT, HUGE_GRADIENT])
def test_a_backward_overflow_in_a_variable_used_twice_names_it(graph, backend, kind):
    """A discriminator weight applied to the real batch and to the fakes:
    its gradient is the sum of the two uses'. The fake use's overflows; in
    saturation mode it is +-65504, which the sum does not keep (it read as
    register_outside_gradients with no group, and the fix pointed at the
    forward pass): every backend names the group and the variable."""
    name, _ = backend
    model = build_shared_model()
    train = build_step(model, name)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert _observed(sess, train, model.feed)[::2] == (0, True)
        reason, overflowed, applied = _observed(
            sess, train, fault_feed(model, Fault(kind, ("d",), ("d/w",))))
        assert (diagnostics.reason_name(reason), overflowed, applied) == (
            "gradients_overflowed", {"d": True, "g": False}, False)
        assert diagnostics.read_last_skip(sess, train) == diagnostics.Skip(
            1, 1, "gradients_overflowed", ("d",), ("d/w",))
        assert _observed(sess, train, model.feed)[::2] == (0, True)


@pytest.mark.parametrize("gate", ["pivot", "cond"])
def test_the_summed_terms_are_read_only_in_the_skip_branch(graph, saturation_mode, gate):
    """The terms of the shared weight's gradient are read by its sum, by
    the skip branch's capture (the If, or a v1 cond's Switch) and by the
    skip report's If (run only when ``diagnosis.skip_reason`` is fetched),
    nothing else: an applied step computes nothing more than the sum, and
    runs nothing of the diagnosis but a lowered or v1 cond's Switch per
    captured tensor."""
    model = build_shared_model()
    train = build_step(model, "npu", gate=gate)
    (unscaled, _), = train.grads_and_vars["d"]
    scaled = [t for t in unscaled.op.inputs if t.op.type == "AddN"]
    assert len(scaled) == 1 and len(scaled[0].op.inputs) == 2
    for term in scaled[0].op.inputs:
        readers = sorted(op.type for op in term.consumers())
        readers.remove("AddN")
        assert 1 <= len(readers) <= 2, readers
        assert set(readers) <= {"If", "StatelessIf", "Switch"}, readers
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        metadata = config_pb2.RunMetadata()
        applied = sess.run([train.update_op, train.applied], model.feed,
                           options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
                           run_metadata=metadata)[1]
        ran = [node.node_name for dev in metadata.step_stats.dev_stats
               for node in dev.node_stats]
    assert applied and ran
    # A v1 cond switches each tensor its branch captures (see above).
    assert not [name for name in ran if "/diagnose/" in name
                and not re.search(r"/(Switch(_\d+)?|_\d+)$", name)]


@pytest.mark.parametrize("gate", ["pivot", "cond"])
@pytest.mark.parametrize("skip_policy", ["all", "per_group"])
def test_every_gate_and_policy_diagnoses_in_its_skip_branch(graph, gate, skip_policy):
    """The pivot gate's false output, the cond gate's false branch, and with
    several gates (per_group) a skip branch of their own: the same record."""
    model = build_model()
    train = build_step(model, "is_finite", gate=gate, skip_policy=skip_policy)
    fault = Fault(INF_GRADIENT, ("b",), ("b/w",))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        gs = tf.train.get_global_step()
        assert _observed(sess, train, model.feed)[0] == 0
        reason, overflowed, applied = _observed(sess, train, fault_feed(model, fault))
        # per_group: group a still applied, so global_step moved after the read.
        assert applied == (skip_policy == "per_group")
        assert (reason, overflowed) == (diagnostics.GRADIENTS_OVERFLOWED,
                                        {"a": False, "b": True})
        assert diagnostics.read_last_skip(sess, train) == diagnostics.Skip(
            1, 1, "gradients_overflowed", ("b",), ("b/w",))
        assert sess.run(gs) == (2 if skip_policy == "per_group" else 1)
        assert _observed(sess, train, model.feed)[0] == 0
        assert diagnostics.read_last_skip(sess, train).number == 1


@pytest.mark.parametrize("gate", ["pivot", "cond"])
def test_an_applied_step_runs_nothing_of_the_diagnosis(graph, gate):
    """Traced: an applied step executes no op of the skip branch and, of the
    record, only its variable's handle (every tensor a branch reads is
    computed each step); nor the loss heads, which the backprop does not
    need and the branch copies; a skipped step executes the diagnosis."""
    model = build_model()
    train = build_step(model, "is_finite", gate=gate)

    def executed(sess, feed):
        metadata = config_pb2.RunMetadata()
        sess.run(train.update_op, feed,
                 options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
                 run_metadata=metadata)
        return set(node.node_name for dev in metadata.step_stats.dev_stats
                   for node in dev.node_stats)

    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        applied = executed(sess, model.feed)
        skipped = executed(sess, fault_feed(model, Fault(INF_GRADIENT, ("a",), ("a/w",))))
    ours = sorted(name for name in applied if "last_skip" in name or "/diagnose/" in name
                  or "skip_report" in name)
    assert "loss_scale/last_skip" in ours
    ours.remove("loss_scale/last_skip")
    # A cond switches each tensor its false branch captures, on every step
    # (v1 control flow, and TF's lowering of the If on CPU/GPU): those
    # Switches run, nothing the branch computes does.
    switches = [name for name in ours if re.search(r"/(Switch(_\d+)?|_\d+)$", name)]
    assert ours == (switches if gate == "cond" else [])
    assert not any(model.losses[group].op.name in applied for group in GROUPS)
    if gate == "pivot":  # a cond's branch function runs as one op
        assert any("/diagnose/" in name for name in skipped)


def test_the_record_stays_out_of_checkpoints(graph, tmp_path):
    """Bookkeeping of one session, as the run-time claims: a default Saver
    neither saves nor expects it, so a checkpoint written before the record
    existed (here: one without its key) restores; no initializer is needed
    for it; a restored session starts blank and counts from there."""
    model = build_model()
    train = build_step(model, "is_finite")
    assert not [v for v in tf.global_variables() + tf.local_variables()
                if "last_skip" in v.op.name]
    saver = tf.train.Saver()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert diagnostics.read_last_skip(sess, train) is None
        sess.run(train.update_op, fault_feed(model, Fault(NAN_LOSS, ("a",), ())))
        assert diagnostics.read_last_skip(sess, train).number == 1
        path = saver.save(sess, str(tmp_path / "ckpt"))
    saved = [name for name, _ in tf.train.list_variables(path)]
    assert "loss_scale/skipped_steps" in saved
    assert not [name for name in saved if "last_skip" in name]
    with tf.Session() as sess:
        saver.restore(sess, path)  # no initializer runs
        assert diagnostics.read_last_skip(sess, train) is None
        assert sess.run(train.skipped_steps) == 1
        sess.run(train.update_op, fault_feed(model, Fault(NAN_LOSS, ("b",), ())))
        skip = diagnostics.read_last_skip(sess, train)
        counts = sess.run(train.diagnosis.last_skip.reason_counts)
    assert (skip.number, skip.groups, int(counts[diagnostics.LOSS_NOT_FINITE])) == (1, ("b",), 1)


def _record_device(graph):
    return graph.get_operation_by_name("loss_scale/last_skip").device


def test_the_record_lives_on_the_host_off_ascend(graph, npu_shim):
    """On an H100 (TF 2.21) a skipped step whose branch wrote the record on
    the GPU killed the process; on the host it ran (diagnosis.Record). A
    job/task device scope (a parameter-server cluster) is kept; on Ascend
    (a backend that runs there) the adapter places it."""
    with tf.device("/job:worker/task:1"):
        build_step(build_model(), "is_finite")
    assert tf.DeviceSpec.from_string(_record_device(graph)).to_string() == (
        "/job:worker/task:1/device:CPU:0")
    from npu_bridge._emulation import overflow_mode  # pylint: disable=import-outside-toplevel
    with tf.Graph().as_default() as npu_graph, overflow_mode("saturation"):
        build_step(build_model(), "npu")
        assert _record_device(npu_graph) == ""


def test_per_group_ops_write_the_shared_record(graph):
    """An alternating loop's per-group step records its skips too, with the
    builder's full name lists (the other group's entries False)."""
    model = build_model()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    for group in GROUPS:
        scaler.add(model.losses[group], tf.train.GradientDescentOptimizer(0.01),
                   var_list=model.var_lists[group], name=group)
    train = scaler.build(per_group_ops=True)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.per_group["a"], model.feed)
        sess.run(train.per_group["b"], fault_feed(model, Fault(HUGE_GRADIENT, ("b",), ("b/b",))))
        assert diagnostics.read_last_skip(sess, train) == diagnostics.Skip(
            1, None, "gradients_overflowed", ("b",), ("b/b",))
        assert list(sess.run(train.diagnosis.last_skip.group_counts)) == [0, 1]


def test_accumulation_diagnoses_the_window_sums(graph):
    """With accumulation the closing run inspects the window's float32
    sums and the window's count of non-finite losses: a NaN loss in an
    earlier micro-batch is loss_not_finite (issue 32), and the variables
    are those whose sums are not finite."""
    model = build_model()
    train = build_step(model, "is_finite", build_args={"accumulation_steps": 2})
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, fault_feed(model, Fault(NAN_LOSS, ("b",), ())))
        reason = sess.run([train.update_op, train.diagnosis.skip_reason], model.feed)[1]
        assert reason == diagnostics.LOSS_NOT_FINITE
        assert diagnostics.read_last_skip(sess, train) == diagnostics.Skip(
            1, 0, "loss_not_finite", ("b",), ("b/w", "b/b"))
        sess.run(train.update_op, model.feed)
        assert sess.run([train.update_op, train.diagnosis.skip_reason], model.feed)[1] == 0


def test_reason_names_and_messages():
    assert diagnostics.REASONS[0] == "applied"
    assert diagnostics.REASONS[:8] == (
        "applied", "loss_not_finite", "gradients_overflowed", "other_worker_overflowed",
        "register_outside_gradients", "requested", "loss_spike", "backend_flagged")
    count = len(diagnostics.REASONS)
    assert [diagnostics.reason_name(code) for code in range(count)] == list(diagnostics.REASONS)
    assert diagnostics.reason_name(np.int32(3)) == "other_worker_overflowed"
    with pytest.raises(ValueError, match=r"code must be in 0..%d, got %d" % (count - 1, count)):
        diagnostics.reason_name(count)
    with pytest.raises(TypeError, match=r"got 'applied'"):
        diagnostics.reason_name("applied")
    with pytest.raises(TypeError):
        diagnostics.reason_name(True)
    skip = diagnostics.Skip(3, 41, "loss_not_finite", ("g",), ("g/w", "g/b"))
    text = diagnostics.describe(skip)
    assert text.startswith("skip #3 at global step 41: loss_not_finite; groups g; "
                           "variables g/w, g/b. Fix: the loss is inf or nan before any "
                           "scaling")
    many = skip._replace(global_step=None, variables=tuple("v%d" % i for i in range(10)))
    assert "variables v0, v1, v2, v3, v4, v5, v6, v7, and 2 more." in diagnostics.describe(many)
    assert "at global step" not in diagnostics.describe(many)


@pytest.mark.parametrize("misuse", ["swapped", "no session", "str session",
                                    "other graph", "per-group op", "None", "last_skip"])
def test_read_last_skip_names_a_wrong_argument(graph, misuse):
    """Before: swapped arguments and None failed with AttributeError, a
    per-group op with "'Operation' object has no attribute 'last_skip'",
    and a TrainOps of another graph with TF's "not an element of this
    graph"."""
    model = build_model()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    for group in GROUPS:
        scaler.add(model.losses[group], tf.train.GradientDescentOptimizer(0.01),
                   var_list=model.var_lists[group], name=group)
    train = scaler.build(per_group_ops=True)
    init = tf.global_variables_initializer()
    op = train.per_group["a"]
    with tf.Graph().as_default() as other:
        tf.constant(1.0)
    other_sess = tf.Session(graph=other)
    with tf.Session() as sess:
        sess.run(init)
        session, train_ops, error, fragments = {
            "swapped": (train, sess, TypeError, [
                "read_last_skip takes (session, train_ops), got a TrainOps first",
                "read_last_skip(sess, train)"]),
            "no session": (None, train, TypeError, [
                "session must be a tf.Session or MonitoredSession, got None"]),
            "str session": ("sess", train, TypeError, ["got 'sess' (str)"]),
            "other graph": (other_sess, train, ValueError, [
                "session must run the graph of train_ops", "another graph"]),
            "per-group op": (sess, op, TypeError, [
                "train_ops must be the TrainOps returned by build(), got the Operation "
                "%r" % op.name, "the whole TrainOps"]),
            "None": (sess, None, TypeError, ["train_ops must be the TrainOps", "got None"]),
            "last_skip": (sess, train.diagnosis.last_skip, TypeError, [
                "train_ops must be the TrainOps", "(LastSkip)"]),
        }[misuse]
        with pytest.raises(error) as raised:
            diagnostics.read_last_skip(session, train_ops)
        assert diagnostics.read_last_skip(sess, train) is None  # the right call works
    other_sess.close()
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))


@fresh_process
def test_the_readme_diagnosis_runs_and_prints_the_message_shown(tmp_path):
    """docs/diagnosis.md, "Why a step skipped": the script runs as written,
    stops after five skips, and prints the message the page shows."""
    stdout, shown = run_example("diagnosis", tmp_path)
    assert shown and stdout.split() == shown.split()


_RANK_WORKER = r"""
import json, os, sys
from graph_mode import set_graph_mode
set_graph_mode()
import numpy as np
import tensorflow.compat.v1 as tf
from npu_bridge.estimator.npu import npu_plugin
import npu_lossscale as nl
from npu_lossscale import diagnostics
import skip_faults as t

backend, mode = sys.argv[1], sys.argv[2]
if mode != "none":
    npu_plugin.set_device_sat_mode(0 if mode == "saturation" else 1)
rank = int(os.environ["RANK_ID"])
model = t.build_model()
scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1024.0), backend=backend,
                                    distributed="hccl")
for group in t.GROUPS:
    scaler.add(model.losses[group], tf.train.GradientDescentOptimizer(0.01),
               var_list=model.var_lists[group], name=group)
train = scaler.build(global_step=tf.train.get_or_create_global_step())
faults = t.schedule(int(sys.argv[3]), seed=5)
rows = []
with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for index, fault in enumerate(faults):
        poisoned = index % 2  # the rank the fault is injected on
        feed = t.fault_feed(model, fault) if rank == poisoned else model.feed
        reason, overflowed, applied = sess.run(
            [train.update_op, train.diagnosis.skip_reason, train.diagnosis.groups_overflowed, train.applied],
            feed)[1:]
        skip = diagnostics.read_last_skip(sess, train)
        rows.append([int(reason), sorted(g for g in overflowed if overflowed[g]), bool(applied),
                     None if skip is None else [skip.reason, list(skip.groups),
                                                list(skip.variables)]])
print("RESULT " + json.dumps(rows))
"""


def _two_ranks(tmp_path, backend, mode, count):
    procs = []
    for rank in range(2):
        env = dict((k, v) for k, v in os.environ.items()
                   if k not in ("CM_WORKER_SIZE", "NPU_SHIM_OP_SET"))
        env.update(RANK_SIZE="2", RANK_ID=str(rank), JOB_ID="1",
                   NPU_SHIM_HCCL_DIR=str(tmp_path), NPU_SHIM_HCCL_TIMEOUT="120",
                   TF_CPP_MIN_LOG_LEVEL="3",
                   PYTHONPATH=os.pathsep.join([SHIMS, HERE, REPO]))
        procs.append(warm_python.Popen(
            [sys.executable, "-c", _RANK_WORKER, backend, mode, str(count)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, err[-3000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


@pytest.mark.skipif(GRAPH_MODE == "v1", reason="the skip branch under v1 control flow is "
                    "tested in process; the two ranks' reduction is the v2 run's")
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_one_hundred_remote_faults_over_two_shim_ranks(tmp_path, name):
    """Two shim HCCL ranks (processes), 100 faults, each injected on one
    rank in turn: both ranks skip (the summed flags) except where nothing
    checked overflowed; the poisoned rank names its own reason, groups and
    variables; the other says "other_worker_overflowed" and names none of
    its own (its gradients were finite)."""
    backend, mode = BACKENDS[name]
    saturation = mode == "saturation"
    count = 100
    ranks = _two_ranks(tmp_path, backend, mode or "none", count)
    with tf.Graph().as_default():
        model = build_model()
    right, wrong = 0, []
    for index, fault in enumerate(schedule(count, seed=5)):
        poisoned = index % 2
        reason, groups, variables = expected(fault, model, saturation)
        want = {poisoned: [reason, list(groups), list(variables)],
                1 - poisoned: ["other_worker_overflowed", [], []]}
        rows = [ranks[rank][index] for rank in range(2)]
        if reason == "applied":
            ok = all(row[:3] == [0, [], True] for row in rows)
        else:
            ok = all(row[:3] == [diagnostics.REASONS.index(want[rank][0]), want[rank][1], False]
                     and row[3] == want[rank] for rank, row in enumerate(rows))
        if ok:
            right += 1
        else:
            wrong.append((index, fault, rows))
    assert (right, wrong[:3]) == (count, [])


# -- issue 32: fetching a diagnosis never trains; the reason table holds ------

def test_reading_the_diagnosis_after_the_step_does_not_train_again(graph):
    """A loop that reads skip_reason (or any field) in a run of its own
    after the step trained twice per iteration (global_step 1, 3, 5, 7).
    Now the read evaluates the batch it feeds and changes nothing."""
    model = build_model()
    train = build_step(model, "is_finite")
    gs = tf.train.get_global_step()
    fields = [train.diagnosis.skip_reason, train.diagnosis.groups_overflowed, train.applied,
              train.is_finite, dict((n, g.is_finite) for n, g in train.groups.items())]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        steps = []
        for _ in range(4):
            sess.run(train.update_op, model.feed)
            before = sess.run([gs, train.skipped_steps, train.diagnosis.last_skip.number])
            sess.run(fields, model.feed)
            sess.run(fields, fault_feed(model, Fault(NAN_LOSS, ("b",), ())))
            assert sess.run([gs, train.skipped_steps,
                             train.diagnosis.last_skip.number]) == before
            steps.append(before[0])
        assert steps == [1, 2, 3, 4]
        # Fetched alone on a bad batch, the fields say what that batch is.
        reason, applied = sess.run([train.diagnosis.skip_reason, train.applied],
                                   fault_feed(model, Fault(NAN_LOSS, ("b",), ())))
        assert (diagnostics.reason_name(reason), applied) == ("loss_not_finite", False)


def test_an_infinite_loss_with_finite_gradients_is_applied_as_documented(graph):
    """docs/diagnosis.md: a loss term that no variable reaches (log(0))
    makes the loss inf and leaves every gradient finite: the step applies,
    and loss_not_finite is the reason only where the gradients broke too."""
    w = tf.Variable([1.0, 2.0])
    loss = tf.reduce_sum(tf.square(w)) + tf.log(tf.constant(0.0))
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.25), var_list=[w])
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        out = sess.run([train.update_op, train.applied, train.diagnosis.skip_reason, loss])
        assert out[1] and out[2] == 0 and np.isinf(out[3])
        np.testing.assert_array_equal(sess.run(w), [0.5, 1.0])


class _Threshold(nl.backends.Backend):
    """A backend of one's own that flags any gradient above 10 (finite)."""

    def overflow_flag(self, tensors, after=()):
        big = [tf.reduce_any(tf.greater(tf.abs(tf.cast(t, tf.float32)), 10.0))
               for t in tensors]
        return tf.cast(tf.reduce_any(tf.stack(big)), tf.float32)


def test_a_custom_backends_skip_says_it_gives_no_per_variable_evidence(graph):
    """Issue 32: a skip that a custom backend flags on finite values is
    backend_flagged, whose fix says so, not gradients_overflowed with no
    variable named."""
    w = tf.Variable([1.0])
    x = tf.placeholder(tf.float32, [])
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend=_Threshold())
    scaler.add(tf.reduce_sum(w * x), tf.train.GradientDescentOptimizer(0.1), var_list=[w])
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        reason = sess.run([train.update_op, train.diagnosis.skip_reason], {x: 50.0})[1]
        assert diagnostics.reason_name(reason) == "backend_flagged"
        skip = diagnostics.read_last_skip(sess, train)
        assert skip.reason == "backend_flagged" and skip.variables == ()
        assert "gives no per-variable evidence" in diagnostics.describe(skip)
