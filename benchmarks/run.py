"""Benchmarks of MultiOptimizerLossScale against the unscaled floor and TF's
own loss scaling, in one process.

  python benchmarks/run.py            # full run, writes benchmarks/results.*
  python benchmarks/run.py --quick    # smoke run: 2 small models, 4 rounds, the
                                      # ablation on the small model
  python benchmarks/run.py --out DIR  # write results.json/.md/.png to DIR

What is compared (see variants.py): ``floor`` (no loss scaling), ``builder``
(MultiOptimizerLossScale on is_finite), ``builder_npu`` (the same on the CPU
shim of npu_bridge, reported apart), ``peer_a`` (TF's
MixedPrecisionLossScaleOptimizer per optimizer), ``peer_b`` (npu_bridge's
per-optimizer pattern by hand, on is_finite). Over which models: gan.py.

Method: every (model, variant) gets its own tf.Graph and Session (2 intra-op,
2 inter-op threads), is warmed up, traced once (FULL_TRACE: ops executed per
step), then all sessions are run round-robin: each round visits every model
and, in a fresh random order, every variant of it for K timed steps. A
variant's time is the median over rounds of its per-round median step time;
its ratio to the floor (or to peer A) is the median over rounds of the
per-round ratio of the two (paired, so load that drifts between rounds
cancels), with the inter-quartile range of those per-round ratios as noise.
"""

from __future__ import absolute_import, division, print_function

import argparse
import collections
import datetime
import json
import math
import os
import platform
import random
import sys
import time

ONEDNN_NOTE = (
    "TF_ENABLE_ONEDNN_OPTS=0: with oneDNN's graph rewrites on, TF 2.21 fuses the "
    "float16 MatMul+BiasAdd+Tanh of this model into _MklNativeFusedMatMul, which "
    "took ~0.8 s per call on this CPU (a 64x256x256 product; unfused: <1 ms), "
    "so every step would be ~3 s of that kernel and no loss-scaling overhead "
    "could be seen.")


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 small models, 4 rounds, every variant")
    parser.add_argument("--out", default=None,
                        help="output folder (default: the benchmarks/ folder)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds R")
    parser.add_argument("--steps", type=int, default=None, help="timed steps K per round")
    parser.add_argument("--no-npu", action="store_true", help="leave out the shim row")
    parser.add_argument("--no-ablation", action="store_true",
                        help="skip the overhead ladder of ablation.py (ablation.md)")
    parser.add_argument("--onednn", action="store_true",
                        help="keep TF's oneDNN graph rewrites on (see ONEDNN_NOTE)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="where the steps run: cpu (CUDA hidden) or gpu (fails when "
                             "TensorFlow sees no GPU)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


ARGS = _parse(sys.argv[1:]) if __name__ == "__main__" else None
if ARGS is not None and not ARGS.onednn:
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
if ARGS is not None and ARGS.device == "cpu":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf2  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_eager_execution()
tf.logging.set_verbosity(tf.logging.ERROR)

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import checkbench  # noqa: E402
import gan  # noqa: E402
import harness  # noqa: E402
import report  # noqa: E402
import variants  # noqa: E402

# ---------------------------------------------------------------------------
# The plan: which models, how long.
# ---------------------------------------------------------------------------

Config = collections.namedtuple("Config", ["key", "axis", "label", "spec"])


def plan(quick):
    """The model configurations and timing settings of a run."""
    medium = gan.SIZES["medium"]
    configs = []
    if quick:
        configs.append(Config("size/small", "size", "small", gan.SIZES["small"]))
        configs.append(Config("tensors/20", "tensors", "20 tensors",
                              gan.spec_for_tensors(20, budget=gan.params(gan.SIZES["small"]))))
        # The shim row on the first model only: its graph is several times
        # the others' and takes most of a quick run's building.
        # No untimed warm-up builds (its build times are a smoke value), and
        # the ablation ladder on the small model.
        settings = dict(rounds=4, steps=3, warmup=3, build_repeats=1,
                        check_layouts=[("small", gan.SIZES["small"])], check_steps=3,
                        npu_up_to_tensors=2 * gan.SIZES["small"].layers,
                        warm_up_builds=False, ablation_model="small")
        return configs, settings
    for name, spec in gan.SIZES.items():
        configs.append(Config("size/" + name, "size", name, spec))
    for groups in (1, 4, 8):
        configs.append(Config("groups/%d" % groups, "groups", "medium, %d groups" % groups,
                              medium._replace(groups=groups)))
    for tensors in (10, 50, 200, 2000):
        configs.append(Config("tensors/%d" % tensors, "tensors", "%d tensors" % tensors,
                              gan.spec_for_tensors(tensors)))
    settings = dict(rounds=24, steps=4, warmup=4, build_repeats=3,
                    check_layouts=[("medium", medium), ("large", gan.SIZES["large"]),
                                   ("200 tensors", gan.spec_for_tensors(200)),
                                   ("2000 tensors", gan.spec_for_tensors(2000))],
                    check_steps=5, npu_up_to_tensors=NPU_UP_TO_TENSORS,
                    warm_up_builds=True, ablation_model="medium")
    return configs, settings


# ---------------------------------------------------------------------------
# Building.
# ---------------------------------------------------------------------------

def _builders():
    return collections.OrderedDict((v, variants.BUILDERS[v]) for v in variants.VARIANTS)


class Entry(object):
    """One (config, variant): its session and everything measured on it."""

    def __init__(self, config, variant):
        self.config = config
        self.variant = variant
        self.timed = None
        self.missing = None
        self.build_s = []
        self.graph_ops = None
        self.exec_ops = None
        self.steps_run = 0
        self.applied = None
        self.global_step = None


def _log(message):
    print("[bench %s] %s" % (time.strftime("%H:%M:%S"), message), flush=True)


def warm_up_builds(builders, npu_reason, seed):
    """Builds every variant once on a tiny model, untimed: the first graph
    built in a process pays TF's one-off imports and registrations."""
    tiny = gan.ModelSpec(width=8, layers=4, groups=2, batch=4)
    for variant, build in builders.items():
        if variant == "builder_npu" and npu_reason:
            continue
        try:
            harness.build_graph(tiny, build, seed)
        except Exception:  # pylint: disable=broad-except
            pass  # reported when the real build fails


def build_all(configs, settings, builders, seed, npu_reason):
    entries = collections.OrderedDict()
    for config in configs:
        for variant, build in builders.items():
            entry = Entry(config, variant)
            entries[(config.key, variant)] = entry
            if variant == "builder_npu" and npu_reason:
                entry.missing = npu_reason
                continue
            if variant == "builder_npu" and 2 * config.spec.layers > settings["npu_up_to_tensors"]:
                entry.missing = ("not run above %d tensors%s: the shim instruments every "
                                 "float16 op, and building that graph here takes minutes"
                                 % (settings["npu_up_to_tensors"],
                                    "" if settings["npu_up_to_tensors"] == NPU_UP_TO_TENSORS
                                    else " in a quick run"))
                continue
            try:
                graph, built, seconds = harness.build_graph(config.spec, build, seed)
            except Exception as error:  # pylint: disable=broad-except
                entry.missing = "build failed: %s: %s" % (type(error).__name__, error)
                _log("%s %s: %s" % (config.key, variant, entry.missing))
                continue
            entry.build_s.append(seconds)
            entry.graph_ops = harness.graph_op_count(graph)
            entry.timed = harness.Timed((config.key, variant), graph, built.train_op)
            entry.global_step = built.global_step
            entry.timed.warm_up(settings["warmup"])
            entry.exec_ops, _ = harness.traced_op_count(entry.timed.sess, built.train_op)
            entry.steps_run = settings["warmup"] + 1
            _log("%-12s %-16s build %6.2fs  graph ops %6d  executed ops %6d" % (
                config.key, variant, seconds, entry.graph_ops, entry.exec_ops))
    return entries


#: Models with more tensors are built once per variant, not ``build_repeats``
#: times, and get no shim row: TF builds graphs at roughly 1 ms per op here,
#: so a 2000-tensor variant takes minutes to build (the shim triples its ops).
REPEAT_BUILDS_UP_TO_TENSORS = 200
NPU_UP_TO_TENSORS = 200


def repeat_builds(configs, builders, entries, repeats, seed):
    """More graph builds (no session), round-robin, for the build-time medians."""
    for _ in range(repeats - 1):
        for config in configs:
            if 2 * config.spec.layers > REPEAT_BUILDS_UP_TO_TENSORS:
                continue
            order = list(builders.items())
            random.shuffle(order)
            for variant, build in order:
                entry = entries[(config.key, variant)]
                if entry.missing:
                    continue
                _, _, seconds = harness.build_graph(config.spec, build, seed)
                entry.build_s.append(seconds)


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------

def time_all(configs, entries, checks, settings):
    rounds, steps = settings["rounds"], settings["steps"]
    for check in checks:
        check.warm_up(2)
    for r in range(rounds):
        start = time.perf_counter()
        for config in configs:
            live = [e for (key, _), e in entries.items() if key == config.key and e.timed]
            random.shuffle(live)
            for entry in live:
                entry.timed.run_round(steps)
                entry.steps_run += steps
        for check in random.sample(checks, len(checks)):
            check.run_round(settings["check_steps"])
        _log("round %d/%d: %.1fs, load %s" % (r + 1, rounds, time.perf_counter() - start,
                                               _loadavg()))


# ---------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------

def _loadavg():
    try:
        return "%.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "n/a"


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except IOError:
        pass
    return platform.processor() or "unknown"


def _paired(a, b):
    """Median and IQR over rounds of a's round median / b's round median."""
    ratios = a.round_medians() / b.round_medians()
    return harness.median_iqr(ratios)


def summarize(configs, entries, checks, settings, meta):
    results = {"meta": meta, "settings": settings_for_json(settings), "configs": [],
               "check_efficiency": [], "build_scaling": {}, "targets": []}
    for config in configs:
        spec = config.spec
        row = {"key": config.key, "axis": config.axis, "label": config.label,
               "spec": dict(spec._asdict(), tensors=2 * spec.layers, params=gan.params(spec)),
               "variants": collections.OrderedDict()}
        floor = entries[(config.key, "floor")]
        peer_a = entries[(config.key, "peer_a")]
        for variant in [v for (k, v) in entries if k == config.key]:
            entry = entries[(config.key, variant)]
            item = {"status": "missing" if entry.missing else "ok"}
            if entry.missing:
                item["reason"] = entry.missing
                row["variants"][variant] = item
                continue
            times = np.concatenate([np.asarray(r) for r in entry.timed.rounds]) * 1e3
            item["median_ms"], item["iqr_ms"] = harness.median_iqr(entry.timed.round_medians() * 1e3)
            item["p10_ms"] = float(np.percentile(times, 10))
            if floor.timed:
                item["ratio_floor"], item["ratio_floor_iqr"] = _paired(entry.timed, floor.timed)
            if peer_a.timed:
                item["ratio_peer_a"], item["ratio_peer_a_iqr"] = _paired(entry.timed, peer_a.timed)
            item["graph_ops"] = entry.graph_ops
            item["exec_ops"] = entry.exec_ops
            item["build_ms"] = float(np.median(entry.build_s) * 1e3)
            item["build_ms_all"] = [s * 1e3 for s in entry.build_s]
            if floor.timed and floor.build_s:
                item["build_ratio_floor"] = item["build_ms"] / (np.median(floor.build_s) * 1e3)
            if peer_a.timed and peer_a.build_s:
                item["build_ratio_peer_a"] = item["build_ms"] / (np.median(peer_a.build_s) * 1e3)
            with entry.timed.graph.as_default():
                applied = int(entry.timed.sess.run(entry.global_step))
            item["steps_run"] = entry.steps_run
            item["steps_applied"] = applied
            row["variants"][variant] = item
        results["configs"].append(row)

    by_layout = collections.OrderedDict()
    for check in checks:
        by_layout.setdefault(check.layout, {})[check.kind] = check
    for layout, kinds in by_layout.items():
        floor = np.asarray(kinds["read_floor"].samples)
        shapes = kinds["check"].shapes
        item = {"layout": layout, "tensors": len(shapes),
                "elements": int(sum(np.prod(s) for s in shapes)),
                "bytes": int(sum(np.prod(s) for s in shapes)) * 4,
                "read_floor_us": float(np.median(floor) * 1e6), "checks": {}}
        for kind in checkbench.CHECKS:
            if kind == "read_floor":
                continue
            samples = np.asarray(kinds[kind].samples)
            eff, eff_iqr = harness.median_iqr(samples / floor)
            item["checks"][kind] = {"us": float(np.median(samples) * 1e6),
                                    "copies": kinds[kind].copies,
                                    "efficiency": eff, "efficiency_iqr": eff_iqr}
        results["check_efficiency"].append(item)

    sweep = [row for row in results["configs"] if row["axis"] == "tensors"]
    for variant in variants.TARGET_VARIANTS:
        points = [(row["spec"]["tensors"], row["variants"][variant]["build_ms"])
                  for row in sweep if row["variants"].get(variant, {}).get("status") == "ok"]
        if len(points) >= 2:
            x = np.log([p[0] for p in points])
            y = np.log([p[1] for p in points])
            slope = float(np.polyfit(x, y, 1)[0])
            results["build_scaling"][variant] = {
                "points": points, "loglog_slope": slope,
                "ms_per_tensor_at_max": points[-1][1] / points[-1][0]}
    results["targets"] = report.evaluate_targets(results)
    return results


def settings_for_json(settings):
    out = dict(settings)
    out["check_layouts"] = [name for name, _ in settings["check_layouts"]]
    return out


def _check_device(device):
    if device == "gpu" and not tf2.config.list_physical_devices("GPU"):
        sys.exit("--device gpu: TensorFlow sees no GPU (a CPU build, or no CUDA "
                 "libraries on LD_LIBRARY_PATH); see ../shared/GPU.md.")


def manager_op_counts(out):
    """Executed ops per step of the two-group GAN with each manager (the
    issue-16 proxy that tests/test_manager_state.py asserts); written to
    manager_ops.json and printed."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import manager_ops  # pylint: disable=import-outside-toplevel
    counts = manager_ops.manager_op_overhead()
    with open(os.path.join(out, "manager_ops.json"), "w") as handle:
        json.dump(counts, handle, indent=2)
    print("\nExecuted ops per step, two-group GAN: fixed %(fixed)d, dynamic %(dynamic)d "
          "(%(dynamic_extra)+d), exponential %(exponential)d (%(exponential_extra)+d)"
          % counts)
    return counts


def main(args):
    _check_device(args.device)
    started = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    out = args.out or HERE
    os.makedirs(out, exist_ok=True)
    configs, settings = plan(args.quick)
    if args.rounds:
        settings["rounds"] = args.rounds
    if args.steps:
        settings["steps"] = args.steps
    builders = _builders()
    if args.no_npu:
        npu_reason = "left out (--no-npu)"
    else:
        usable, npu_reason = variants.shim_status()
        if usable:
            npu_reason = None
    if npu_reason:
        _log("builder_npu row missing: %s" % npu_reason)

    meta = collections.OrderedDict([
        ("date", datetime.datetime.now().isoformat(timespec="seconds")),
        ("mode", "quick" if args.quick else "full"),
        ("tensorflow", tf2.__version__),
        ("device", args.device),
        ("python", platform.python_version()),
        ("numpy", np.__version__),
        ("cpu_model", _cpu_model()),
        ("cores", os.cpu_count()),
        ("threads", "intra_op=%d inter_op=%d" % (harness.THREADS, harness.THREADS)),
        ("graph_mode", "tf.compat.v1.disable_eager_execution(): resource variables, "
                       "v2 control flow"),
        ("onednn_opts", os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default")),
        ("onednn_note", ONEDNN_NOTE if not args.onednn else ""),
        ("load_avg_start", _loadavg()),
        ("initial_loss_scale", variants.INITIAL_SCALE),
        ("optimizer", "AdamOptimizer(%g) per group" % variants.LEARNING_RATE),
    ])
    _log("TF %s, %s, %s cores, load %s" % (meta["tensorflow"], meta["cpu_model"],
                                             meta["cores"], meta["load_avg_start"]))

    if settings["warm_up_builds"]:
        warm_up_builds(builders, npu_reason, args.seed)
    entries = build_all(configs, settings, builders, args.seed, npu_reason)
    repeat_builds(configs, builders, entries, settings["build_repeats"], args.seed)

    checks = []
    for layout, spec in settings["check_layouts"]:
        shapes = gan.variable_shapes(spec)
        for kind in checkbench.CHECKS:
            check = checkbench.CheckTimer(layout, kind, shapes)
            check.shapes = shapes
            checks.append(check)

    time_all(configs, entries, checks, settings)
    meta["load_avg_end"] = _loadavg()
    results = summarize(configs, entries, checks, settings, meta)
    meta["runtime_s"] = round(time.time() - started, 1)
    report.write_all(results, out)
    for entry in entries.values():
        if entry.timed:
            entry.timed.close()
    for check in checks:
        check.close()
    _log("wrote %s in %.0fs" % (", ".join(os.path.join(out, "results." + e)
                                          for e in ("json", "md", "png")),
                                 time.time() - started))
    print(report.markdown(results))
    if not args.no_ablation:
        # Where the GAN's overhead goes, piece by piece (ablation.py), in
        # this same process.
        import ablation  # pylint: disable=import-outside-toplevel
        rounds = ["--rounds", "3", "--steps", "2"] if args.quick else []
        ablation.main(["--model", settings["ablation_model"], "--out", out] + rounds)
    manager_op_counts(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
