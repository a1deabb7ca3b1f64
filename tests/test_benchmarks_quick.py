"""The benchmark runner's quick mode runs end to end and writes well-formed
results. Timings are not asserted: whether a target is met is what the
results report, not what this test checks."""

import json
import math
import os
import subprocess
import sys

import pytest
import warm_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(REPO, "benchmarks", "run.py")
VARIANTS = ("floor", "builder", "builder_xla", "builder_npu", "peer_a", "peer_b")
TARGET_VARIANTS = ("floor", "builder", "builder_xla", "peer_a", "peer_b")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ)
    env.pop("NPU_LOSSSCALE_GRAPH_MODE", None)
    proc = warm_python.run([sys.executable, RUNNER, "--quick", "--out", str(out)],
                          cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    with open(os.path.join(str(out), "results.json")) as handle:
        results = json.load(handle)
    return out, results, proc.stdout


def test_outputs_exist(quick_run):
    out, _, _ = quick_run
    for name in ("results.json", "results.md", "results.png", "ablation.json", "ablation.md"):
        path = os.path.join(str(out), name)
        assert os.path.getsize(path) > 0, name
    with open(os.path.join(str(out), "results.png"), "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_meta_records_the_machine(quick_run):
    _, results, _ = quick_run
    meta = results["meta"]
    for key in ("date", "tensorflow", "cpu_model", "cores", "threads", "mode"):
        assert meta[key], key
    assert meta["mode"] == "quick"


def test_every_row_is_present_and_well_formed(quick_run):
    _, results, _ = quick_run
    assert len(results["configs"]) >= 2
    for config in results["configs"]:
        assert tuple(config["variants"]) == VARIANTS, config["key"]
        for variant in TARGET_VARIANTS:
            item = config["variants"][variant]
            assert item["status"] == "ok", (config["key"], variant, item)
        for variant, item in config["variants"].items():
            if item["status"] != "ok":
                # Only the shim row may be missing, and then it says why.
                assert variant == "builder_npu" and item["reason"], (variant, item)
                continue
            for key in ("median_ms", "ratio_floor", "ratio_peer_a", "build_ms"):
                assert item[key] > 0, (config["key"], variant, key, item[key])
            assert item["exec_ops"] > 0 and item["graph_ops"] >= item["exec_ops"] / 4
            assert item["steps_applied"] >= 1
        floor = config["variants"]["floor"]
        assert floor["ratio_floor"] == 1.0
        assert config["variants"]["peer_a"]["ratio_peer_a"] == 1.0


def test_check_efficiency_and_targets_are_reported(quick_run):
    out, results, _ = quick_run
    assert results["check_efficiency"]
    for item in results["check_efficiency"]:
        assert math.isfinite(item["read_floor_us"])
        for kind in ("check", "per_tensor_sum", "stacked_all_finite"):
            assert math.isfinite(item["checks"][kind]["us"])
            assert math.isfinite(item["checks"][kind]["efficiency"])
    assert results["targets"]
    for target in results["targets"]:
        assert target["met"] in (True, False, None)
        assert target["target"] and target["value"]
    with open(os.path.join(str(out), "results.md")) as handle:
        text = handle.read()
    assert "| target | measured | met? |" in text
    for variant in VARIANTS:
        assert "| %s |" % variant in text


def test_ablation_ladder_is_complete(quick_run):
    out, _, _ = quick_run
    with open(os.path.join(str(out), "ablation.json")) as handle:
        ladder = json.load(handle)
    rungs = [row["rung"] for row in ladder["rows"]]
    assert rungs == ["floor", "+scale", "+unscale", "+check", "+gate", "builder",
                     "builder, gate='cond'"]  # both gates measured
    for row in ladder["rows"]:
        assert row["executed_ops"] > 0 and math.isfinite(row["ms"]), row


def test_bench_reports_the_manager_op_counts(quick_run):
    out, _, _ = quick_run
    with open(os.path.join(str(out), "manager_ops.json")) as handle:
        counts = json.load(handle)
    assert counts["dynamic"] - counts["fixed"] == counts["dynamic_extra"] <= 30
    assert counts["exponential_extra"] <= 30
