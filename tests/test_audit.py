"""npu_lossscale.audit: each hazard is found in its real-world form, and the
same model without it (and every graph the library builds) audits clean.

Runs under both graph modes (NPU_LOSSSCALE_GRAPH_MODE=v1 / v2). Graphs are
only built and read, never run.
"""

import json
import os
import sys

import pytest
import tensorflow.compat.v1 as tf

import audit_graphs as ag
import models
import npu_lossscale as nl
from conftest import GRAPH_MODE, REPO
from npu_lossscale.audit import CODES, Finding, audit
from npu_lossscale.tools.audit_cli import main
import warm_python


def codes(findings, severities=("error", "warning")):
    return sorted(set(f.code for f in findings if f.severity in severities))


def assert_clean(findings):
    bad = [f for f in findings if f.severity in ("error", "warning")]
    assert not bad, "\n".join("%s %s: %s %s" % (f.code, f.severity, f.message, f.ops)
                              for f in bad)


def only(findings, code):
    found = [f for f in findings if f.code == code]
    assert found, "no %s in %s" % (code, [(f.code, f.message) for f in findings])
    return found


# -- the record and the API ---------------------------------------------------------

def test_finding_is_a_named_record_with_documented_codes():
    case = ag.per_optimizer_wrappers(backend="is_finite")
    findings = audit(case.graph, case.fetches)
    assert findings and all(isinstance(f, Finding) for f in findings)
    for finding in findings:
        assert finding.code in CODES
        assert finding.severity in ("error", "warning", "info")
        assert isinstance(finding.ops, tuple) and finding.message.endswith(".")
    assert Finding._fields == ("code", "severity", "message", "ops")


def test_every_code_has_its_row_in_the_docs():
    with open(os.path.join(REPO, "docs", "audit.md")) as docs:
        text = docs.read()
    for code in CODES:
        assert "| `%s` |" % code in text, code


def test_accepts_graph_graphdef_metagraphdef_and_names():
    case = ag.per_optimizer_wrappers(backend="is_finite")
    names = [f.name for f in case.fetches]
    by_graph = codes(audit(case.graph, case.fetches))
    assert codes(audit(case.graph.as_graph_def(), names)) == by_graph
    meta = tf.train.export_meta_graph(graph=case.graph)
    assert codes(audit(meta, names)) == by_graph
    # Nested dicts and lists, ops and tensors ("...:0") by name.
    assert names[2].endswith(":0")
    assert codes(audit(meta, {"d": names[0], "g": [names[1]], "losses": names[2:]})) == by_graph
    with case.graph.as_default():
        assert codes(audit(fetches=case.fetches)) == by_graph


def test_bad_arguments():
    with pytest.raises(TypeError, match="tf.Graph, GraphDef or MetaGraphDef"):
        audit("model.meta")
    case = ag.plain_gan()
    with pytest.raises(ValueError, match="no_such_op"):
        audit(case.graph, ["no_such_op"])
    with pytest.raises(TypeError, match="each fetch"):
        audit(case.graph, [3])


def test_without_fetches_says_which_checks_needed_them():
    case = ag.per_optimizer_wrappers(backend="is_finite")
    findings = audit(case.graph)
    info = only(findings, "NLS000-needs-fetches")[0]
    assert info.severity == "info" and "fetches" in info.message
    assert findings[-1] is info  # errors, warnings, then info
    assert "NLS000-needs-fetches" not in codes(audit(case.graph, case.fetches),
                                               ("info",))


# -- graphs built with the library audit clean -------------------------------------

@pytest.mark.parametrize("accumulation_steps", [1, 3])
@pytest.mark.parametrize("skip_policy", ["all", "per_group"])
def test_builder_is_clean_is_finite(accumulation_steps, skip_policy):
    case = ag.builder_gan(accumulation_steps=accumulation_steps, skip_policy=skip_policy)
    assert_clean(audit(case.graph, case.fetches))
    assert codes(audit(case.graph)) == []


@pytest.mark.parametrize("op_set", ["v1", "v2"])
@pytest.mark.parametrize("accumulation_steps", [1, 3])
@pytest.mark.parametrize("backend", sorted({"npu", ag.REGISTER_BACKEND}))
def test_builder_is_clean_npu_shim(npu_shim, op_set, accumulation_steps, backend):
    from npu_bridge import _emulation  # pylint: disable=import-outside-toplevel
    with _emulation.op_set(op_set):
        case = ag.builder_gan(backend=backend, accumulation_steps=accumulation_steps)
        serial = ag.builder_gan(backend=backend, skip_policy="per_group")
    if backend == ag.REGISTER_BACKEND:
        # The graph's one clear (TrainOps.clear_status, run first) and one read.
        assert count_status_ops(case.graph) == 2
        assert count_status_ops(serial.graph) == 3
    assert_clean(audit(case.graph, case.fetches))
    # per_group on the register: two reads, serialised, after the one clear.
    assert_clean(audit(serial.graph, serial.fetches))


def count_status_ops(graph):
    from npu_lossscale.audit import _facts, _graph  # pylint: disable=import-outside-toplevel
    model = _graph.load(graph)
    return sum(1 for node in model.nodes.values() if node.type in _facts.STATUS_TYPES)


def test_builder_with_shared_and_per_group_managers_is_clean():
    case = ag.builder_gan(per_group_managers=True)
    assert_clean(audit(case.graph, case.fetches))
    # Independent scales and decisions on purpose: reported (docs/audit.md).
    apex = ag.builder_gan(per_group_managers=True, skip_policy="per_group")
    assert codes(audit(apex.graph, apex.fetches)) == ["NLS008-independent-scales"]


@pytest.mark.parametrize("accumulation_steps", [1, 3])
@pytest.mark.parametrize("per_group_managers", [False, True])
def test_builder_measuring_its_first_scale_is_clean(accumulation_steps, per_group_managers):
    """Issue 44: the measured first scale's one assign (behind the
    ``first_scale_measured`` latch) was counted as a second update of the
    manager per step: NLS011 error and NLS005 warning, CLI exit 1."""
    case = ag.builder_gan(accumulation_steps=accumulation_steps,
                          per_group_managers=per_group_managers, measure_first_scale=True)
    assert_clean(audit(case.graph, case.fetches))
    assert codes(audit(case.graph)) == []


@pytest.mark.parametrize("latched", [False, True])
def test_a_scale_write_behind_a_flag_is_once_only_behind_a_latch(latched):
    """A write of the manager's state in a branch whose predicate reads a
    bool variable is one-time only when that branch also sets the
    variable (``if not done: write; done = True``); behind a flag it
    leaves alone it runs on every step it is set, and fetched with
    ``update_op`` is still a second update (NLS011)."""
    graph = tf.Graph()
    with graph.as_default():
        w = tf.Variable([1.0, 2.0], name="w")
        manager = nl.DynamicLossScaleManager()
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(tf.reduce_sum(tf.cast(w, tf.float16) ** 2), tf.train.AdamOptimizer(1e-3),
                   var_list=[w])
        train = scaler.build()
        done = tf.Variable(False, trainable=False, use_resource=True, name="reset_done")

        def reset():
            write = manager.assign_loss_scale(tf.constant(2.0 ** 10))
            if not latched:
                return tf.group(write)
            with tf.control_dependencies([write]):
                return tf.group(done.assign(True))

        once = tf.cond(tf.logical_not(done.read_value()), reset, tf.no_op, name="reset")
    findings = audit(graph, [train.update_op, once])
    if latched:
        assert "NLS011-double-scale-update" not in codes(findings)
    else:
        assert "NLS011-double-scale-update" in codes(findings)


def test_builder_with_accumulate_op_is_clean():
    case = ag.builder_gan(accumulation_steps=4)
    train = case.info["train"]
    assert_clean(audit(case.graph, [train.accumulate_op]))
    assert_clean(audit(case.graph, case.fetches))


@pytest.mark.parametrize("backend", sorted({"is_finite", "npu", ag.REGISTER_BACKEND}))
def test_loss_scale_optimizer_alone_is_clean(npu_shim, backend):
    case = ag.optimizer_wrapper(backend)
    assert_clean(audit(case.graph, case.fetches))


def test_plain_float32_gan_is_clean():
    case = ag.plain_gan()
    assert_clean(audit(case.graph, case.fetches))


# -- NLS001: the float-status race (seed 003) -------------------------------------

@pytest.mark.parametrize("op_set", ["v1", "v2"])
def test_npu_loss_scale_optimizers_in_one_run_race(npu_shim, op_set):
    """Huawei's FAQ case with npu_bridge's own optimizer (the shim's copy of
    tf_adapter npu_bridge/estimator/npu/npu_loss_scale_optimizer.py: read
    after the gradients, clear right after the read), one per network."""
    from npu_bridge import _emulation  # pylint: disable=import-outside-toplevel
    with _emulation.op_set(op_set), _emulation.overflow_mode("saturation"):
        case = ag.npu_loss_scale_optimizer_gan()
    race = only(audit(case.graph, case.fetches), "NLS001-status-race")[0]
    assert race.severity == "error"
    reads = [n for n in race.ops if "NpuGetFloatStatus" in n]
    assert len(reads) == 2, race.ops
    # Each optimizer in its own session.run: no race.
    for train in case.fetches[:2]:
        assert "NLS001-status-race" not in codes(audit(case.graph, [train]))
    # Without fetches the race is possible, not certain: a warning.
    whole = only(audit(case.graph), "NLS001-status-race")[0]
    assert whole.severity == "warning"


@pytest.mark.parametrize("op_set", ["v1", "v2"])
def test_two_of_our_wrappers_in_one_run_share_the_clear(npu_shim, op_set):
    """Two LossScaleOptimizers read after the graph's one clear and never
    clear after reading: no race. Their two scales and gates are reported."""
    from npu_bridge import _emulation  # pylint: disable=import-outside-toplevel
    with _emulation.op_set(op_set), pytest.warns(UserWarning, match="cannot tell"):
        case = ag.per_optimizer_wrappers()
    findings = audit(case.graph, case.fetches)
    assert codes(findings) == ["NLS008-independent-scales"]
    for train in ("d_train", "g_train"):
        findings = audit(case.graph, [case.info[train]])
        assert_clean(findings)
        assert only(findings, "NLS002-untrained-variables")[0].severity == "info"


def test_a_clear_before_a_read_but_after_its_forward_pass_races(npu_shim):
    """Ordered is not enough: a clear between two reads that comes after
    ops of the second read's step (G's forward, shared with D's loss) can
    wipe their overflow."""
    case = ag.serial_reads_with_a_clear_between()
    race = only(audit(case.graph, case.fetches), "NLS001-status-race")[0]
    assert race.severity == "error"
    assert sorted(race.ops) == sorted(
        ["NpuClearFloatStatusV2", "NpuGetFloatStatusV2_1"]), race.ops


@pytest.mark.parametrize("op_set", ["v1", "v2"])
def test_npu_loss_scale_optimizer_per_network_races(npu_shim, op_set):
    """The FAQ's pattern with npu_bridge's own optimizer (the shim's copy,
    where the shim has it), and the same GAN ported to the builder."""
    pytest.importorskip("npu_bridge.estimator.npu.npu_loss_scale_optimizer")
    from npu_bridge import _emulation  # pylint: disable=import-outside-toplevel
    with _emulation.op_set(op_set), _emulation.overflow_mode("saturation"):
        per_network = ag.npu_loss_scale_optimizer_gan()
        ported = ag.npu_loss_scale_optimizer_gan(per_optimizer=False)
    findings = audit(per_network.graph, per_network.fetches)
    assert only(findings, "NLS001-status-race")[0].severity == "error"
    assert "NLS008-independent-scales" in codes(findings)
    assert_clean(audit(ported.graph, ported.fetches))


def test_a_clear_after_the_forward_pass_races(npu_shim):
    """A clear before the read but after the loss it follows wipes the
    forward pass's overflows: the ops that run before a clear are not
    exempt."""
    case = ag.clear_after_the_forward_pass()
    race = only(audit(case.graph, case.fetches), "NLS001-status-race")[0]
    assert race.severity == "error"


def test_builder_through_a_loop_and_a_cond_is_clean(npu_shim):
    """Function body nodes (v2) start when their While/If node starts, so
    they follow the clear through it; v1 frames follow it through Enter."""
    case = ag.builder_with_loop_and_cond()
    assert_clean(audit(case.graph, case.fetches))


def test_real_adapter_op_types_without_npu_bridge(npu_shim, tmp_path):
    from npu_bridge import _emulation  # pylint: disable=import-outside-toplevel
    with _emulation.overflow_mode("saturation"):
        case = ag.npu_loss_scale_optimizer_gan()
    meta = ag.ascend_meta_graph(tf.train.export_meta_graph(graph=case.graph))
    types = set(n.op for n in meta.graph_def.node)
    types |= set(n.op for f in meta.graph_def.library.function for n in f.node_def)
    assert "NpuGetFloatStatusV2" in types
    with tf.Graph().as_default(), pytest.raises(Exception):
        tf.train.import_meta_graph(meta)  # unknown op types
    names = [f.name for f in case.fetches]
    assert "NLS001-status-race" in codes(audit(meta, names))


# -- NLS002 / NLS010 / NLS003: the DCGAN port bug ----------------------------------

def test_dcgan_port_bug():
    case = ag.dcgan_port_bug()
    findings = audit(case.graph, case.fetches)
    untrained = only(findings, "NLS002-untrained-variables")[0]
    assert set(untrained.ops) == {"generator/w", "generator/b"}
    assert untrained.severity == "warning"
    double = only(findings, "NLS010-double-update")
    assert {f.ops[0] for f in double} == {"discriminator/w", "discriminator/b"}
    assert all(f.severity == "error" for f in double)
    assert_clean(audit(ag.plain_gan().graph, ag.plain_gan().fetches))


def test_foreign_loss():
    case = ag.swapped_gradients()
    finding = only(audit(case.graph, case.fetches), "NLS003-foreign-loss")[0]
    assert finding.severity == "error"
    assert "discriminator/w" in finding.message and "e_loss" in finding.message
    assert "NLS003-foreign-loss" not in codes(audit(case.graph, case.info["fixed"]))


def test_builder_plus_leftover_minimize():
    case = ag.builder_plus_minimize()
    double = only(audit(case.graph, case.fetches), "NLS010-double-update")
    updated = {f.ops[0] for f in double}
    assert {"discriminator/w", "discriminator/b", "global_step"} <= updated
    assert "global_step advances" in " ".join(f.message for f in double)
    # The builder's op alone is fine.
    assert_clean(audit(case.graph, [case.info["train"].update_op]))


def test_two_builders_advance_global_step_twice():
    graph = tf.Graph()
    with graph.as_default():
        model, step = ag.gan()
        ops = []
        for name, loss, variables in (("d", model.d_loss, model.d_vars),
                                      ("g", model.g_loss, model.g_vars)):
            scaler = nl_builder()
            scaler.add(loss, tf.train.AdamOptimizer(1e-3), var_list=variables, name=name)
            ops.append(scaler.build(global_step=step).update_op)
    findings = audit(graph, ops)
    double = only(findings, "NLS010-double-update")
    assert [f.ops[0] for f in double] == ["global_step"]
    assert "NLS008-independent-scales" in codes(findings)


def nl_builder():
    import npu_lossscale as nl  # pylint: disable=import-outside-toplevel
    return nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")


# -- NLS004: collectives inside conds ---------------------------------------------

def test_hccl_allreduce_inside_cond(npu_shim):
    inside = ag.hccl_allreduce_in_cond(inside=True)
    finding = only(audit(inside.graph, inside.fetches), "NLS004-collective-in-cond")[0]
    assert finding.severity == "error" and len(finding.ops) == 2
    outside = ag.hccl_allreduce_in_cond(inside=False)
    assert "NLS004-collective-in-cond" not in codes(audit(outside.graph, outside.fetches))


def test_horovod_allreduce_inside_cond():
    pytest.importorskip("horovod.tensorflow")
    inside = ag.horovod_allreduce_in_cond(inside=True)
    only(audit(inside.graph, inside.fetches), "NLS004-collective-in-cond")
    outside = ag.horovod_allreduce_in_cond(inside=False)
    assert "NLS004-collective-in-cond" not in codes(audit(outside.graph, outside.fetches))


def test_builder_distributed_hccl_is_clean(npu_shim):
    import npu_lossscale as nl  # pylint: disable=import-outside-toplevel
    for steps in (1, 3):
        graph = tf.Graph()
        with graph.as_default():
            model, step = ag.gan()
            scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(),
                                                backend=ag.REGISTER_BACKEND,
                                                distributed="hccl")
            scaler.add(model.d_loss, tf.train.AdamOptimizer(1e-3), var_list=model.d_vars,
                       name="d")
            scaler.add(model.g_loss, tf.train.AdamOptimizer(1e-3), var_list=model.g_vars,
                       name="g")
            train = scaler.build(global_step=step, accumulation_steps=steps)
        assert_clean(audit(graph, [train.update_op]))
        if train.accumulate_op is not None:
            assert_clean(audit(graph, [train.accumulate_op]))


# -- NLS005: updates on skipped steps -----------------------------------------------

def test_batch_norm_update_ops_beside_the_gate():
    case = ag.batch_norm_beside_gate()
    finding = only(audit(case.graph, case.fetches), "NLS005-ungated-update")[0]
    assert finding.severity == "error"
    assert any("bn" in op for op in finding.ops)
    fixed = ag.batch_norm_beside_gate(gated=True)
    assert_clean(audit(fixed.graph, fixed.fetches))


def test_float32_batch_norm_beside_the_gate_is_a_warning():
    case = ag.batch_norm_beside_gate(compute_dtype=tf.float32)
    finding = only(audit(case.graph, case.fetches), "NLS005-ungated-update")[0]
    assert finding.severity == "warning"


@pytest.mark.parametrize("compute_dtype,severity", [(tf.float16, "error"),
                                                     (tf.float32, "warning")])
def test_batch_norm_updated_in_place_says_to_use_update_ops(compute_dtype, severity):
    """contrib batch norm with updates_collections=None updates its moving
    statistics inside the forward pass (not in UPDATE_OPS): reported in
    float16 and float32 alike, with the fix that works (build(update_ops=)
    refuses ops the loss depends on): the default updates_collections and
    update_ops= to build()."""
    case = ag.batch_norm_in_place(compute_dtype)
    finding = only(audit(case.graph, case.fetches), "NLS005-ungated-update")
    assert len(finding) == 1 and finding[0].severity == severity
    writes = [op for op in finding[0].ops if op.startswith("BatchNorm/AssignMovingAvg")]
    assert len(writes) == 2, finding[0].ops  # the moving mean and variance
    assert "updates_collections=None" in finding[0].message
    assert "default updates_collections" in finding[0].message
    assert "build(update_ops=...)" in finding[0].message
    assert "control_dependencies" not in finding[0].message
    graph_def = only(audit(case.graph.as_graph_def(), [f.name for f in case.fetches]),
                     "NLS005-ungated-update")
    assert [f.message for f in graph_def] == [finding[0].message]
    # The UPDATE_OPS form keeps its advice, which names the in-place case too.
    beside = only(audit(*ag.batch_norm_beside_gate()[:2]), "NLS005-ungated-update")[0]
    assert "beside the loss-scale gate" in beside.message
    assert "updates_collections=None" in beside.message


@pytest.mark.parametrize("step", ["builder", "optimizer"])
def test_control_dependencies_on_update_ops_around_the_step(step):
    """tf.control_dependencies(UPDATE_OPS) around build() or minimize(): the
    batch-norm updates are control inputs of the step's own ops, so they
    run on skipped steps too. The finding gives that cause and its fix
    (build(update_ops=...) without the control_dependencies), not batch
    norm's updates_collections=None nor a wrapper, from a GraphDef too; the
    fix audits clean."""
    case = ag.batch_norm_around_step(step)
    for graph, fetches in ((case.graph, case.fetches),
                           (case.graph.as_graph_def(), [f.name for f in case.fetches])):
        found = only(audit(graph, fetches), "NLS005-ungated-update")
        assert len(found) == 1 and found[0].severity == "error", found
        message = found[0].message
        assert "are control inputs of the step's own ops" in message
        assert "tf.control_dependencies(tf.get_collection(tf.GraphKeys.UPDATE_OPS))" in message
        assert "drop that control_dependencies" in message
        assert "build(update_ops=...)" in message
        assert "updates_collections" not in message and "wrap" not in message
        assert len([op for op in found[0].ops if op.startswith("bn/")]) == 2, found[0].ops
    fixed = ag.batch_norm_around_step(fixed=True)
    assert_clean(audit(fixed.graph, fixed.fetches))


@pytest.mark.parametrize("wrap", sorted(models.UPDATE_WRAPPERS))
def test_an_update_whose_wrapper_alone_is_gated(wrap):
    """A gate that holds only a wrapper (tf.tuple, check_numerics,
    stop_gradient, a tf.print or a constant under control_dependencies, or a
    nesting) of a variable update: the update runs on skipped steps too, an
    error naming the update and the wrapper. The same model with the wrapper
    passed to build(update_ops=...) gates the update and audits clean."""
    case = ag.wrapped_update(wrap)
    found = [f for f in only(audit(case.graph, case.fetches), "NLS005-ungated-update")
             if "only wrap them" in f.message]
    assert len(found) == 1 and found[0].severity == "error", found
    updates = [op for op in found[0].ops if op.startswith("AssignAdd")]
    assert len(updates) == 1 and updates[0] in found[0].message
    assert "build(update_ops=...)" in found[0].message
    fixed = ag.wrapped_update(wrap, fixed=True)
    assert_clean(audit(fixed.graph, fixed.fetches))


def test_weight_average_and_skip_counter_beside_the_gate_are_fine():
    case = ag.weight_average_beside_gate()
    assert_clean(audit(case.graph, case.fetches))


def test_metrics_beside_the_gate_are_fine():
    case = ag.batch_norm_beside_gate(gated=True)
    with case.graph.as_default():
        loss = case.fetches[1]
        mean_loss, update_mean = tf.metrics.mean(loss)
    findings = audit(case.graph, case.fetches + [update_mean, mean_loss])
    assert_clean(findings)
    assert_clean(audit(tf.train.export_meta_graph(graph=case.graph),
                       [f.name for f in case.fetches + [update_mean]]))


# -- NLS006: the scale missing from checkpoints ------------------------------------

def test_saver_without_the_scale():
    case = ag.saver_without_scale()
    finding = only(audit(case.graph, case.fetches), "NLS006-unsaved-scale")[0]
    assert "dynamic_loss_scale/state" in finding.ops  # the manager's state vector
    meta = tf.train.export_meta_graph(graph=case.graph)
    assert "NLS006-unsaved-scale" in codes(audit(meta, [f.name for f in case.fetches]))
    full = ag.saver_without_scale(explicit=False)
    assert_clean(audit(full.graph, full.fetches))


@pytest.mark.parametrize("manager_first", [False, True])
def test_saver_made_before_build_says_to_make_it_later(manager_first):
    """A Saver made before the loss scaling: the fix is to create it after
    build(), not to leave var_list out (it already did). The manager's state
    (made after the Saver) or the builder's loss_scale/skipped_steps counter
    is named, with the other variables made after it (Adam's slots)."""
    case = ag.saver_before_build(manager_first=manager_first)
    findings = audit(case.graph, case.fetches)
    found = only(findings, "NLS006-unsaved-scale")
    assert len(found) == 1
    message = found[0].message
    assert "create the Saver after build()" in message
    assert "leave var_list out" not in message
    assert message.startswith("Saver 'save' (filename tensor 'save/Const:0')")
    assert "does save" not in message  # no other Saver saves the scale
    expected = "loss_scale/skipped_steps" if manager_first else "dynamic_loss_scale/state"
    assert expected in found[0].ops
    with case.graph.as_default():  # Adam's slots and beta powers, made by build()
        slots = [v for v in tf.global_variables()
                 if "/Adam" in v.op.name or "_power" in v.op.name]
    assert len(slots) == 12 and "nor 12 other variable(s) made after it" in message
    assert ("dynamic_loss_scale/state" in found[0].ops) is (not manager_first)
    # The same from the exported .meta (node order kept).
    meta = tf.train.export_meta_graph(graph=case.graph)
    again = only(audit(meta, [f.name for f in case.fetches]), "NLS006-unsaved-scale")
    assert again[0].message == message
    # An explicit var_list made after build() keeps the var_list advice.
    explicit = only(audit(ag.saver_without_scale().graph), "NLS006-unsaved-scale")
    assert all("leave var_list out" in f.message for f in explicit)
    assert not any("create the Saver after" in f.message for f in explicit)


def test_an_unused_early_saver_is_named_beside_the_one_that_saves():
    """The pix2pix port: the authors' ``tf.train.Saver()`` (scope ``save``,
    made before the loss scaling, no longer used) beside the port's Saver
    made after build() (``save_1``). The finding names the early Saver by
    its scope and filename tensor, says that this Saver does not save the
    scale, and that ``save_1`` does; it is the only warning without fetches."""
    case = ag.per_group_port(authors_saver=True)
    findings = audit(case.graph)
    assert [f.code for f in findings if f.severity in ("error", "warning")] == [
        "NLS006-unsaved-scale"]
    message = only(findings, "NLS006-unsaved-scale")[0].message
    port = case.info["saver"].saver_def
    assert port.filename_tensor_name == "save_1/Const:0"
    assert message.startswith("Saver 'save' (filename tensor 'save/Const:0') was created "
                              "before the loss-scale state dynamic_loss_scale/state")
    assert "so this Saver does not save them" in message
    assert ("Saver 'save_1' (filename tensor 'save_1/Const:0') does save them: if that "
            "is the Saver you checkpoint with, delete this unused one") in message
    assert "else create the Saver after build()" in message
    meta = tf.train.export_meta_graph(graph=case.graph)
    assert only(audit(meta), "NLS006-unsaved-scale")[0].message == message
    # An explicit var_list without the scale, beside a Saver of everything.
    explicit = ag.saver_without_scale(explicit=True)
    with explicit.graph.as_default():
        tf.train.Saver(name="full_saver")
    found = only(audit(explicit.graph, explicit.fetches), "NLS006-unsaved-scale")
    assert len(found) == 1 and "leave var_list out" in found[0].message
    assert "Saver 'full_saver' (filename tensor 'full_saver/Const:0') does save" in (
        found[0].message)


def test_bare_graph_def_leaves_the_session_bookkeeping_out():
    """A GraphDef has no collections, so it does not say that the last-skip
    record and the claims' tables are in none: the audit tells them by
    their shape (read only behind their own is-initialized check; the
    claims' counting) and reports neither as unsaved state, while the
    manager's state a Saver leaves out still is."""
    for case in (ag.builder_gan(), ag.shared_manager_steps("builders"),
                 ag.per_group_port(authors_saver=False)):
        graph_def = case.graph.as_graph_def()
        assert codes(audit(graph_def)) == []
        assert_clean(audit(graph_def, [case.fetches[0].name]))
    missing = ag.saver_without_scale()
    finding = only(audit(missing.graph.as_graph_def(), [f.name for f in missing.fetches]),
                   "NLS006-unsaved-scale")
    assert len(finding) == 1 and "dynamic_loss_scale/state" in finding[0].ops
    assert not any("last_skip" in op or "claims" in op for op in finding[0].ops)


def test_saver_def_of_meta_graph_is_read():
    case = ag.builder_gan(saver=False)
    with case.graph.as_default():
        saver = tf.train.Saver(var_list=tf.trainable_variables(), name="model_saver")
    meta = tf.train.export_meta_graph(graph=case.graph, saver_def=saver.as_saver_def())
    finding = only(audit(meta), "NLS006-unsaved-scale")[0]
    assert "'model_saver'" in finding.message


# -- NLS007: float16 weights without masters ---------------------------------------

def test_float16_variables_updated_directly():
    case = ag.float16_weights()
    finding = only(audit(case.graph, case.fetches), "NLS007-float16-master")[0]
    assert "w" in finding.ops
    fixed = ag.float16_weights(master=True)
    assert_clean(audit(fixed.graph, fixed.fetches))


# -- NLS008: independent loss scales -------------------------------------------------

def test_two_managers_two_gates():
    case = ag.per_optimizer_wrappers(backend="is_finite")
    findings = audit(case.graph, case.fetches)
    finding = only(findings, "NLS008-independent-scales")[0]
    assert finding.severity == "warning" and len(finding.ops) == 2
    assert "NLS001-status-race" not in codes(findings)  # no register on is_finite


# -- NLS009: accumulation outside the window's gate ---------------------------------

def test_hand_written_accumulation_gated_on_one_micro_batch():
    case = ag.hand_accumulation()
    findings = audit(case.graph, case.fetches)
    finding = only(findings, "NLS009-ungated-accumulation")[0]
    assert finding.severity == "error" and "acc_" in " ".join(finding.ops)
    fixed = ag.hand_accumulation(gate_on_window=True)
    assert "NLS009-ungated-accumulation" not in codes(audit(fixed.graph, fixed.fetches))


# -- NLS011: one manager updated twice per run -------------------------------------

@pytest.mark.parametrize("op_set", ["v1", "v2"])
@pytest.mark.parametrize("one_optimizer", [False, True])
def test_one_npu_manager_updated_by_two_minimize_calls(npu_shim, op_set, one_optimizer):
    """npu_bridge's manager shared by two NPULossScaleOptimizers, or one
    NPULossScaleOptimizer minimizing twice (tf_adapter's
    npu_bridge/estimator/npu/npu_loss_scale_optimizer.py, the shim's copy,
    groups update_loss_scale into each minimize): with both train ops in one
    run, the manager's scale and counters are written by two update ops."""
    from npu_bridge import _emulation  # pylint: disable=import-outside-toplevel
    with _emulation.op_set(op_set), _emulation.overflow_mode("saturation"):
        case = ag.shared_manager_npu_optimizers(one_optimizer=one_optimizer)
    findings = audit(case.graph, case.fetches)
    double = only(findings, "NLS011-double-scale-update")
    assert len(double) == 1 and double[0].severity == "error"
    # The manager's three variables (npu_loss_scale_manager.py's names).
    with case.graph.as_default():
        state = sorted(v.op.name for v in tf.global_variables()
                       if v.op.name.split("/")[-1] in ("loss_scale", "good_steps",
                                                      "bad_steps"))
    assert len(state) == 3 and list(double[0].ops[:3]) == state
    assert "updated by 2 update ops in one step" in double[0].message
    # Each train op in its own session.run updates the manager once: an
    # info names the two step ops that must not be fetched together.
    steps = sorted(case.info[train].name for train in ("d_train", "g_train"))
    for train in ("d_train", "g_train"):
        alone = audit(case.graph, [case.info[train]])
        assert "NLS011-double-scale-update" not in codes(alone)
        note = only(alone, "NLS011-double-scale-update")
        assert len(note) == 1 and note[0].severity == "info"
        assert set(steps) <= set(note[0].ops) and "updates the scale twice" in note[0].message
    # Without fetches, the same info (alternating runs are fine), no warning
    # (NLS001 still warns: npu_bridge's optimizers clear the register).
    findings = audit(case.graph)
    assert "NLS011-double-scale-update" not in codes(findings)
    note = only(findings, "NLS011-double-scale-update")
    assert len(note) == 1 and note[0].severity == "info"
    assert all(step in note[0].message for step in steps)


@pytest.mark.parametrize("skip_policy", ["all", "per_group"])
def test_per_group_op_fetched_with_update_op_updates_the_scale_twice(skip_policy):
    """A builder's per_group op with its update_op (or both per_group ops)
    in one run: two updates of the one manager (the library also fails such
    a run, commit.OneStepPerRun; the audit says so before it runs)."""
    case = ag.builder_per_group_ops(skip_policy)
    train = case.info["train"]
    double = only(audit(case.graph, case.fetches), "NLS011-double-scale-update")
    assert double[0].severity == "error"
    assert double[0].ops[0] == "dynamic_loss_scale/state"
    both = audit(case.graph, [train.per_group["d"], train.per_group["g"]])
    assert "NLS011-double-scale-update" in codes(both)
    for alone in (train.update_op, train.per_group["d"], train.per_group["g"]):
        assert "NLS011-double-scale-update" not in codes(audit(case.graph, [alone]))


@pytest.mark.parametrize("kind", ["optimizers", "minimize_twice", "builders"])
def test_one_manager_shared_by_two_of_our_step_ops(kind):
    """The alternating-GAN pattern with this library's classes (issue 24):
    two step ops updating one manager. Fetched together: an error that says
    the run-time claims refuse the run; each alone or without fetches: one
    info naming both step ops, no warning but NLS013's where one
    LossScaleOptimizer (so one Adam) minimizes twice."""
    case = ag.shared_manager_steps(kind)
    shared_adam = ["NLS013-shared-optimizer"] if kind == "minimize_twice" else []
    steps = sorted(op.name for op in case.info["steps"])
    double = only(audit(case.graph, case.fetches), "NLS011-double-scale-update")
    assert [f.severity for f in double] == ["error"]
    assert double[0].ops[0] == "dynamic_loss_scale/state"
    assert "updated by 2 update ops in one step" in double[0].message
    assert "fails with an InvalidArgumentError" in double[0].message
    for fetches in ([case.info["steps"][0]], [case.info["steps"][1]], None):
        findings = audit(case.graph, fetches)
        assert codes(findings) == shared_adam, fetches
        note = only(findings, "NLS011-double-scale-update")
        assert len(note) == 1 and note[0].severity == "info"
        assert set(steps + ["dynamic_loss_scale/state"]) <= set(note[0].ops)
        assert "refuses such a run at run time" in note[0].message


def test_per_group_port_without_fetches_is_precise():
    """A correct per-group port (pix2pix-shaped: batch norm in both networks,
    the discriminator called twice) audited without fetches: the joint
    update_op and the per_group ops are alternatives that the run-time
    claims keep apart, so no NLS010/NLS011 warnings about them running
    together (there were 18 on pix2pix), only one info naming the step ops
    that must not be fetched together."""
    case = ag.per_group_port(authors_saver=False)
    train = case.info["train"]
    findings = audit(case.graph)
    assert_clean(findings)
    infos = [f for f in findings if f.code != "NLS000-needs-fetches"]
    assert [(f.code, f.severity) for f in infos] == [("NLS011-double-scale-update", "info")]
    steps = sorted(op.name for op in [train.update_op] + list(train.per_group.values()))
    assert steps == ["loss_scale/update", "loss_scale_d/update", "loss_scale_g/update"]
    assert set(steps) <= set(infos[0].ops)
    assert "never fetch two of them in one session.run" in infos[0].message
    # Each run of the alternating loop audits clean too.
    assert_clean(audit(case.graph, case.fetches))
    assert_clean(audit(case.graph, case.info["g_fetches"]))
    # Two step ops in one run are still errors: the claims fail that run.
    both = audit(case.graph, [train.per_group["d"], train.update_op])
    assert {"NLS010-double-update", "NLS011-double-scale-update"} <= set(codes(both, ("error",)))


def test_listening_manager_updates_its_state_once_per_run(tmp_path, capsys):
    """ListeningLossScaleManager's update writes its state twice, the second
    write following the first on the same decision: one update, not two. A
    manager shared by two builders fetched together still is two."""
    case = ag.listening_builders()
    assert_clean(audit(case.graph, case.fetches))
    findings = audit(case.graph)
    assert [f.code for f in findings] == ["NLS000-needs-fetches"]
    path = tmp_path / "listening.meta"
    tf.train.export_meta_graph(filename=str(path), graph=case.graph)
    assert main([str(path), "--fetch", case.fetches[0].name]) == 0
    assert "no findings" in capsys.readouterr().out
    shared = ag.listening_builders(shared=True)
    double = only(audit(shared.graph, shared.fetches), "NLS011-double-scale-update")
    assert [f.severity for f in double] == ["error"]
    assert "updated by 2 update ops in one step" in double[0].message
    assert len(set(double[0].ops[1:])) == 2, double[0].ops  # two names, one per update
    for alone in shared.fetches:
        assert codes(audit(shared.graph, [alone])) == []


def test_step_ops_are_the_fetched_ops_not_the_diagnosis_reads():
    """NLS011's info names the step ops a user fetches, and nothing else:
    not the skip diagnosis (skip_reason, groups_overflowed, the last-skip
    record's reads) nor, under v1 behaviour, a cond's pivot (switch_t)."""
    for kind in ("builders", "optimizers"):
        case = ag.shared_manager_steps(kind)
        note = only(audit(case.graph), "NLS011-double-scale-update")
        steps = [op.name for op in case.info["steps"]]
        assert sorted(note[0].ops) == sorted(steps + ["dynamic_loss_scale/state"]), kind
    port = ag.per_group_port(authors_saver=False)
    train = port.info["train"]
    steps = [op.name for op in [train.update_op] + list(train.per_group.values())]
    note = only(audit(port.graph), "NLS011-double-scale-update")
    assert sorted(note[0].ops) == sorted(steps + ["dynamic_loss_scale/state"])


def test_two_managers_are_not_a_double_update():
    """One manager per optimizer (independent scales) updates each once."""
    case = ag.per_optimizer_wrappers(backend="is_finite")
    assert "NLS011-double-scale-update" not in codes(audit(case.graph, case.fetches))


# -- NLS013: one optimizer object in two steps -------------------------------------

@pytest.mark.parametrize("kind", ["builders", "builder_and_minimize", "minimize_twice",
                                  "plain"])
def test_one_optimizer_object_in_two_steps(kind):
    """One AdamOptimizer for D's step and G's: its beta powers advance on
    each. Both steps in one run: an error (twice per step); each alone or
    without fetches: a warning (each network's bias correction counts the
    other's steps too). An optimizer per step: nothing."""
    case = ag.shared_optimizer(kind)
    steps = sorted(op.name for op in case.fetches)
    both = only(audit(case.graph, case.fetches), "NLS013-shared-optimizer")
    assert [f.severity for f in both] == ["error"]
    assert both[0].ops == ("beta1_power", "beta2_power") + tuple(steps)
    assert "advances 2 times in one step" in both[0].message
    assert "give each its own optimizer object" in both[0].message
    for fetches in ([case.fetches[0]], [case.fetches[1]], None):
        alone = only(audit(case.graph, fetches), "NLS013-shared-optimizer")
        assert [f.severity for f in alone] == ["warning"], fetches
        assert alone[0].ops == both[0].ops
        assert "also counts the other network's steps" in alone[0].message
    separate = ag.shared_optimizer(kind, separate=True)
    for fetches in (separate.fetches, None):
        assert "NLS013-shared-optimizer" not in codes(audit(separate.graph, fetches),
                                                      ("error", "warning", "info"))


def test_per_group_op_and_update_op_share_their_group_optimizer():
    """A builder's update_op and per_group["d"] both apply D's optimizer:
    alternatives for the same variables, not a shared optimizer."""
    case = ag.builder_per_group_ops()
    train = case.info["train"]
    for fetches in (None, [train.update_op], [train.per_group["d"]]):
        assert "NLS013-shared-optimizer" not in codes(audit(case.graph, fetches),
                                                      ("error", "warning", "info"))


# -- no false positives on the repository's models -------------------------------

@pytest.mark.parametrize("script,argv", [
    ("dcgan", ["--precision", "fp16", "--backend", "is_finite"]),
    ("dcgan", ["--precision", "fp32", "--backend", "is_finite", "--loss-scale", "exponential"]),
    ("encoder_gan", ["--precision", "fp16", "--backend", "is_finite"]),
    ("encoder_gan", ["--precision", "fp16", "--backend", "is_finite", "--encoder-only"]),
])
def test_examples_audit_clean(script, argv):
    graph, built = ag.example_graph(script, argv)
    step = getattr(built, "step_op", None) or getattr(built, "update_opt_op")
    assert_clean(audit(graph, [step, built.summary if hasattr(built, "summary")
                               else built.summary_occasional]))
    meta = tf.train.export_meta_graph(graph=graph)
    assert codes(audit(meta)) == []


@pytest.mark.parametrize("script", ["dcgan", "encoder_gan"])
def test_examples_on_the_npu_shim_audit_clean(npu_shim, script):
    from npu_bridge import _emulation  # pylint: disable=import-outside-toplevel
    with _emulation.overflow_mode("saturation"):
        graph, built = ag.example_graph(script, ["--precision", "fp16", "--backend", "npu"])
    step = getattr(built, "step_op", None) or getattr(built, "update_opt_op")
    assert count_status_ops(graph) == 2  # TrainOps.clear_status, run first; the read
    assert_clean(audit(graph, [step]))


# -- the command line ------------------------------------------------------------

#: A test of the CLI's own process (argument parsing, JSON, exit status) on an
#: exported graph: the audit of a v1 graph is the in-process tests' (e.g.
#: test_examples_audit_clean), so the v1 leg skips the subprocess.
cli_process = pytest.mark.skipif(
    GRAPH_MODE == "v1", reason="the CLI's process: proved on the v2 leg; v1 graphs' audit "
                               "runs in process")


def _cli(args, tmp_path, env=None):
    full_env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    full_env.update(env or {})
    return warm_python.run([sys.executable, "-m", "npu_lossscale.audit"] + args,
                          cwd=str(tmp_path), env=full_env, capture_output=True,
                          text=True, timeout=300)


@cli_process
def test_cli_on_ascend_gan_meta_without_npu_bridge(npu_shim, tmp_path):
    """The per-optimizer GAN exported on an "Ascend host" (real op types):
    the CLI, in a process where npu_bridge is not importable, finds the race
    with --fetch and exits 1; its JSON has the four fields."""
    from npu_bridge import _emulation  # pylint: disable=import-outside-toplevel
    with _emulation.overflow_mode("saturation"):
        case = ag.npu_loss_scale_optimizer_gan()
    meta = ag.ascend_meta_graph(tf.train.export_meta_graph(graph=case.graph))
    path = tmp_path / "gan.meta"
    path.write_bytes(meta.SerializeToString())
    fetches = []
    for fetch in case.fetches[:2]:
        fetches += ["--fetch", fetch.name]
    proc = _cli([str(path), "--json"] + fetches, tmp_path)
    assert proc.returncode == 1, proc.stderr
    findings = json.loads(proc.stdout)
    assert {"code", "severity", "message", "ops"} == set(findings[0])
    assert "NLS001-status-race" in [f["code"] for f in findings]
    assert "npu_bridge" not in proc.stderr


def test_cli_in_process_exit_status(tmp_path, capsys):
    clean = ag.builder_gan()
    path = tmp_path / "clean.meta"
    tf.train.export_meta_graph(filename=str(path), graph=clean.graph)
    assert main([str(path), "--fetch", clean.fetches[0].name]) == 0
    out = capsys.readouterr().out
    assert "NLS" not in out or "NLS000" not in out
    assert main([str(path)]) == 0
    assert "NLS000-needs-fetches info" in capsys.readouterr().out
    bug = ag.dcgan_port_bug()
    path = tmp_path / "bug.meta"
    tf.train.export_meta_graph(filename=str(path), graph=bug.graph, as_text=True)
    fetches = []
    for fetch in bug.fetches:
        fetches += ["--fetch", fetch.name]
    assert main([str(path)] + fetches) == 1
    assert "NLS010-double-update error" in capsys.readouterr().out
    assert main([str(path), "--fetch", "missing"]) == 2
    assert "name no node of the graph. Pass the names" in capsys.readouterr().err
    assert main([str(tmp_path / "none.meta")]) == 2
    assert "cannot read %s (No such file or directory). Pass the path" % (
        tmp_path / "none.meta") in capsys.readouterr().err


@cli_process
def test_cli_on_the_example_dcgan(tmp_path):
    graph, built = ag.example_graph("dcgan", ["--precision", "fp16", "--backend",
                                              "is_finite"])
    path = tmp_path / "dcgan.meta"
    tf.train.export_meta_graph(filename=str(path), graph=graph)
    proc = _cli([str(path), "--fetch", built.step_op.name, "--json"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [f for f in json.loads(proc.stdout) if f["severity"] != "info"] == []


def test_cli_refuses_an_empty_or_nodeless_meta_file(tmp_path, capsys):
    """An empty file (a cut-short export) or a MetaGraphDef without nodes
    is a bad file (exit 2, one message saying so), never "no findings"."""
    empty = tmp_path / "empty.meta"
    empty.write_bytes(b"")
    assert main([str(empty)]) == 2
    captured = capsys.readouterr()
    assert "empty.meta is empty (0 bytes)" in captured.err
    assert "export_meta_graph" in captured.err and "no findings" not in captured.out
    blank = tmp_path / "blank.meta"
    blank.write_text("\n  \n")
    assert main([str(blank), "--json"]) == 2
    assert "is empty" in capsys.readouterr().err
    nodeless = tmp_path / "nodeless.meta"
    nodeless.write_text('meta_info_def { tags: "train" }\n')  # a valid text proto
    assert main([str(nodeless)]) == 2
    assert "has no nodes" in capsys.readouterr().err


def test_fetch_of_an_output_the_op_does_not_have(tmp_path, capsys):
    """'name:7' where the op has fewer outputs names nothing that runs:
    refused with the fetch, the op's output count and the fix. The count
    comes from the exported _output_shapes, so it also works for an op
    type unknown here; a tensor that exists is accepted."""
    case = ag.plain_gan()
    with case.graph.as_default():
        first, second = tf.split(tf.zeros([4, 2]), 2, name="halves")
        loss = tf.identity(first, name="probe").op.name
        nothing = tf.no_op(name="nothing").name
    path = tmp_path / "gan.meta"
    meta = tf.train.export_meta_graph(filename=str(path), graph=case.graph)
    train = case.fetches[0].name
    assert main([str(path), "--fetch", loss + ":7"]) == 2
    err = capsys.readouterr().err
    assert "fetch '%s:7' asks for output 7 of op '%s'" % (loss, loss) in err
    assert "which has 1 output (numbered from 0)" in err and "'%s:0'" % loss in err
    assert main([str(path), "--fetch", nothing + ":0"]) == 2
    assert ("which has no outputs; fetch the op itself ('%s')" % nothing
            in capsys.readouterr().err)
    assert main([str(path), "--fetch", "halves:x"]) == 2
    assert "not a number" in capsys.readouterr().err
    assert main([str(path), "--fetch", "halves:1", "--fetch", train]) == 0
    with pytest.raises(ValueError, match="has 2 outputs .*'halves:0', 'halves:1'"):
        audit(case.graph, ["halves:2"])
    # An op type unknown here (as on an Ascend host): the exported shapes tell.
    for node in meta.graph_def.node:
        if node.name == "halves":
            node.op = "HcomUnknownSplit"
    with pytest.raises(ValueError, match="HcomUnknownSplit.*has 2 outputs"):
        audit(meta, ["halves:2"])
    assert codes(audit(meta, ["halves:1", train])) == []
    # Without _output_shapes (a GraphDef of a tf.Graph), the op's registered
    # signature counts the outputs (num_split for Split).
    with pytest.raises(ValueError, match="has 2 outputs"):
        audit(case.graph.as_graph_def(), ["halves:2"])
    assert first.name == "halves:0" and second.name == "halves:1"
