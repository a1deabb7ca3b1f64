"""Targets, and results.json / results.md / results.png from a results dict."""

from __future__ import absolute_import, division, print_function

import json
import os

MEDIUM_KEY = "size/medium"
OVERHEAD_MEDIUM = 1.03
OVERHEAD_ALL = 1.05
PEER_A_MAX = 1.00
CHECK_EFFICIENCY_MAX = 1.5
BUILD_SLOPE_MAX = 1.1
BUILD_PEER_A_MAX = 1.1

VARIANT_LABELS = {
    "floor": "floor (no loss scaling)",
    "builder": "builder, is_finite",
    "builder_xla": "builder, xla (check and unscale in one XLA cluster)",
    "builder_npu": "builder, npu on the CPU shim",
    "peer_a": "peer A: TF MixedPrecisionLossScaleOptimizer x groups",
    "peer_b": "peer B: per-optimizer npu pattern, is_finite",
}


def _ok(item):
    return item is not None and item.get("status") == "ok"


def _fmt(value, digits=3):
    return "n/a" if value is None else ("%.*f" % (digits, value))


def _yes(flag):
    return "n/a" if flag is None else ("yes" if flag else "**NO**")


def row_targets(config, variant="builder"):
    """Per-row verdicts for a builder-like row: dict name -> True/False/None."""
    item = config["variants"].get(variant)
    if not _ok(item):
        return {}
    limit = OVERHEAD_MEDIUM if config["key"] == MEDIUM_KEY else OVERHEAD_ALL
    verdict = {"floor": item.get("ratio_floor", 99) <= limit}
    peer = config["variants"].get("peer_a")
    if _ok(peer) and item["exec_ops"] < peer["exec_ops"]:
        verdict["peer_a"] = item["ratio_peer_a"] <= PEER_A_MAX
    else:
        verdict["peer_a"] = None
    if _ok(peer):
        verdict["build"] = item["build_ratio_peer_a"] <= BUILD_PEER_A_MAX
    else:
        verdict["build"] = None
    return verdict


def evaluate_targets(results):
    """The issue's targets, each with its measured value and a plain verdict."""
    configs = results["configs"]
    targets = []

    medium = [c for c in configs if c["key"] == MEDIUM_KEY]
    if medium and _ok(medium[0]["variants"].get("builder")):
        item = medium[0]["variants"]["builder"]
        targets.append({
            "target": "step overhead over floor <= %.2fx on the medium GAN" % OVERHEAD_MEDIUM,
            "value": "%.3fx (IQR %.3f)" % (item["ratio_floor"], item["ratio_floor_iqr"]),
            "met": item["ratio_floor"] <= OVERHEAD_MEDIUM})
    else:
        targets.append({"target": "step overhead over floor <= %.2fx on the medium GAN"
                                  % OVERHEAD_MEDIUM, "value": "not measured in this run",
                        "met": None})

    rows = [(c["label"], c["variants"]["builder"]) for c in configs
            if _ok(c["variants"].get("builder"))]
    if rows:
        worst = max(rows, key=lambda r: r[1]["ratio_floor"])
        over = [label for label, item in rows if item["ratio_floor"] > OVERHEAD_ALL]
        targets.append({
            "target": "step overhead over floor <= %.2fx everywhere" % OVERHEAD_ALL,
            "value": "worst %.3fx (%s); over the limit: %s" % (
                worst[1]["ratio_floor"], worst[0], ", ".join(over) or "none"),
            "met": not over})

    fewer = [(c["label"], c["variants"]["builder"]) for c in configs
             if _ok(c["variants"].get("builder")) and _ok(c["variants"].get("peer_a"))
             and c["variants"]["builder"]["exec_ops"] < c["variants"]["peer_a"]["exec_ops"]]
    if fewer:
        over = ["%s (%.3fx)" % (label, item["ratio_peer_a"]) for label, item in fewer
                if item["ratio_peer_a"] > PEER_A_MAX]
        targets.append({
            "target": "<= %.2fx peer A wherever the builder executes fewer ops" % PEER_A_MAX,
            "value": "%d of %d configurations with fewer ops; over: %s" % (
                len(fewer) - len(over), len(fewer), ", ".join(over) or "none"),
            "met": not over})

    effs = results.get("check_efficiency", [])
    if effs:
        over = ["%s (%.2fx)" % (e["layout"], e["checks"]["check"]["efficiency"])
                for e in effs if e["checks"]["check"]["efficiency"] > CHECK_EFFICIENCY_MAX]
        targets.append({
            "target": "check efficiency <= %.1fx one read pass" % CHECK_EFFICIENCY_MAX,
            "value": "; ".join("%s %.2fx" % (e["layout"], e["checks"]["check"]["efficiency"])
                               for e in effs),
            "met": not over})

    scaling = results.get("build_scaling", {}).get("builder")
    if scaling:
        targets.append({
            "target": "graph build time linear in variables (log-log slope <= %.1f)"
                      % BUILD_SLOPE_MAX,
            "value": "slope %.2f (peer A %s), %.2f ms per tensor at %d tensors" % (
                scaling["loglog_slope"],
                _fmt(results["build_scaling"].get("peer_a", {}).get("loglog_slope"), 2),
                scaling["ms_per_tensor_at_max"], scaling["points"][-1][0]),
            "met": scaling["loglog_slope"] <= BUILD_SLOPE_MAX})
    builds = [(c["label"], c["variants"]["builder"]) for c in configs
              if _ok(c["variants"].get("builder")) and "build_ratio_peer_a" in c["variants"]["builder"]]
    if builds:
        over = ["%s (%.2fx)" % (label, item["build_ratio_peer_a"]) for label, item in builds
                if item["build_ratio_peer_a"] > BUILD_PEER_A_MAX]
        targets.append({
            "target": "graph build time <= %.1fx peer A's" % BUILD_PEER_A_MAX,
            "value": "worst %.2fx; over: %s" % (
                max(item["build_ratio_peer_a"] for _, item in builds), ", ".join(over) or "none"),
            "met": not over})
    return targets


# ---------------------------------------------------------------------------
# Markdown.
# ---------------------------------------------------------------------------

def markdown(results):
    meta = results["meta"]
    settings = results["settings"]
    lines = ["# npu_lossscale benchmarks (%s run)" % meta["mode"], ""]
    lines.append("%s; TensorFlow %s; Python %s; %s, %s cores (%s); load average %s at "
                 "start, %s at end; %s rounds x %s steps; run took %ss." % (
                     meta["date"], meta["tensorflow"], meta["python"], meta["cpu_model"],
                     meta["cores"], meta["threads"], meta["load_avg_start"],
                     meta.get("load_avg_end", "?"), settings["rounds"], settings["steps"],
                     meta.get("runtime_s", "?")))
    lines.append("")
    lines.append("Graph mode: %s. %s" % (meta["graph_mode"], meta["onednn_note"]))
    lines.append("")
    lines.append("## Targets")
    lines.append("")
    lines.append("| target | measured | met? |")
    lines.append("|---|---|---|")
    for t in results["targets"]:
        lines.append("| %s | %s | %s |" % (t["target"], t["value"], _yes(t["met"])))
    lines.append("")
    lines.append("## Step time")
    lines.append("")
    lines.append("Median step time over rounds (IQR of round medians); x floor and x peer A "
                 "are medians of per-round paired ratios (IQR). Ops: nodes in the graph "
                 "(with function bodies) / nodes executed in one traced step. Build: "
                 "median graph-construction time of the training op (backprop included), "
                 "model excluded. Target met? (builder rows): x floor <= %.2f (medium) or "
                 "%.2f; x peer A <= %.2f where the builder executes fewer ops; build <= "
                 "%.1fx peer A." % (OVERHEAD_MEDIUM, OVERHEAD_ALL, PEER_A_MAX,
                                    BUILD_PEER_A_MAX))
    lines.append("")
    lines.append("| model | variant | ms | x floor | x peer A | graph ops | executed ops "
                 "| build ms | target met? |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for config in results["configs"]:
        spec = config["spec"]
        model = "%s (w%d, %d tensors, %d groups, %.2fM params)" % (
            config["label"], spec["width"], spec["tensors"], spec["groups"],
            spec["params"] / 1e6)
        for variant, item in config["variants"].items():
            if not _ok(item):
                lines.append("| %s | %s | missing: %s | | | | | | |" % (
                    model, variant, item.get("reason", "?")))
                continue
            verdict = ""
            if variant == "builder":
                v = row_targets(config, variant)
                verdict = "floor %s, A %s, build %s" % (
                    _yes(v["floor"]), _yes(v["peer_a"]), _yes(v["build"]))
            elif variant == "builder_npu":
                verdict = "(shim: no target)"
            lines.append("| %s | %s | %.2f (%.2f) | %s (%s) | %s (%s) | %d | %d | %.0f | %s |" % (
                model, variant, item["median_ms"], item["iqr_ms"],
                _fmt(item.get("ratio_floor")), _fmt(item.get("ratio_floor_iqr")),
                _fmt(item.get("ratio_peer_a")), _fmt(item.get("ratio_peer_a_iqr")),
                item["graph_ops"], item["exec_ops"], item["build_ms"], verdict))
            if item["steps_applied"] != item["steps_run"] and variant != "builder_npu":
                lines.append("| | | note: %d of %d steps applied | | | | | | |" % (
                    item["steps_applied"], item["steps_run"]))
    lines.append("")
    if results.get("check_efficiency"):
        lines.append("## Check efficiency")
        lines.append("")
        lines.append("One check over float32 gradients already in memory, divided by one "
                     "reduce_sum over a single contiguous buffer of the same bytes (the "
                     "read floor: every byte must be read once; one kernel over contiguous "
                     "memory is the cheapest read). Each time is (t(M chained checks) - "
                     "t(1 check)) / (M - 1), M calibrated so the chain takes ~3 ms, "
                     "median over rounds; efficiency IQR in brackets. "
                     "check = IsFiniteBackend as shipped; per-tensor sum = the check before "
                     "this benchmark; stacked all-finite = TF's _is_all_finite (peer A).")
        lines.append("")
        lines.append("| gradients | tensors | MB | read floor us | check us (x floor) "
                     "| per-tensor sum us (x floor) | stacked all-finite us (x floor) |")
        lines.append("|---|---|---|---|---|---|---|")
        for e in results["check_efficiency"]:
            cells = []
            for kind in ("check", "per_tensor_sum", "stacked_all_finite"):
                c = e["checks"][kind]
                cells.append("%.0f (%.2fx, IQR %.2f)" % (c["us"], c["efficiency"],
                                                          c["efficiency_iqr"]))
            lines.append("| %s | %d | %.2f | %.0f | %s |" % (
                e["layout"], e["tensors"], e["bytes"] / 1e6, e["read_floor_us"],
                " | ".join(cells)))
        lines.append("")
    if results.get("build_scaling"):
        lines.append("## Graph build time over the variable sweep")
        lines.append("")
        lines.append("| variant | log-log slope | ms at each tensor count |")
        lines.append("|---|---|---|")
        for variant, s in results["build_scaling"].items():
            lines.append("| %s | %.2f | %s |" % (variant, s["loglog_slope"], ", ".join(
                "%d: %.0f" % (n, ms) for n, ms in s["points"])))
        lines.append("")
    lines.append("## Variants")
    lines.append("")
    for variant, label in VARIANT_LABELS.items():
        lines.append("* `%s`: %s" % (variant, label))
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Plot.
# ---------------------------------------------------------------------------

def plot(results, path):
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    configs = results["configs"]
    shown = ["builder", "peer_a", "peer_b"]
    colors = {"builder": "tab:blue", "peer_a": "tab:orange", "peer_b": "tab:green",
              "floor": "black"}
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))

    ax = axes[0]
    width = 0.8 / len(shown)
    for i, variant in enumerate(shown):
        xs, ys, errs = [], [], []
        for j, config in enumerate(configs):
            item = config["variants"].get(variant)
            if _ok(item) and item.get("ratio_floor") is not None:
                xs.append(j + (i - len(shown) / 2.0 + 0.5) * width)
                ys.append(item["ratio_floor"])
                errs.append(item["ratio_floor_iqr"] / 2.0)
        if xs:
            ax.bar(xs, [y - 1.0 for y in ys], width, bottom=1.0, yerr=errs,
                   color=colors[variant], label=variant, capsize=2)
    ax.axhline(OVERHEAD_ALL, color="red", linestyle="--", linewidth=1, label="1.05 target")
    ax.axhline(OVERHEAD_MEDIUM, color="red", linestyle=":", linewidth=1,
               label="1.03 target (medium)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([c["label"] for c in configs], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("step time / floor (median of paired rounds, IQR/2 bars)")
    ax.set_title("Step overhead over the unscaled floor")
    ax.legend(fontsize=7)

    ax = axes[1]
    for variant, s in results.get("build_scaling", {}).items():
        pts = s["points"]
        ax.loglog([p[0] for p in pts], [p[1] for p in pts], "o-",
                  color=colors.get(variant, "gray"),
                  label="%s (slope %.2f)" % (variant, s["loglog_slope"]))
    ax.set_xlabel("trainable tensors (fixed ~0.5M-parameter budget)")
    ax.set_ylabel("train-op build time (ms)")
    ax.set_title("Graph build time")
    if results.get("build_scaling"):
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no variable sweep in this run", ha="center",
                transform=ax.transAxes)

    ax = axes[2]
    effs = results.get("check_efficiency", [])
    kinds = ["check", "per_tensor_sum", "stacked_all_finite"]
    kcolors = {"check": "tab:blue", "per_tensor_sum": "tab:gray",
               "stacked_all_finite": "tab:orange"}
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        xs = [j + (i - len(kinds) / 2.0 + 0.5) * width for j in range(len(effs))]
        ys = [max(e["checks"][kind]["efficiency"], 1e-2) for e in effs]
        if xs:
            ax.bar(xs, ys, width, color=kcolors[kind], label=kind)
    ax.axhline(CHECK_EFFICIENCY_MAX, color="red", linestyle="--", linewidth=1,
               label="1.5 target")
    ax.set_yscale("log")
    ax.set_xticks(range(len(effs)))
    ax.set_xticklabels(["%s\n(%d tensors)" % (e["layout"], e["tensors"]) for e in effs],
                       fontsize=8)
    ax.set_ylabel("check time / one contiguous read of the same bytes")
    ax.set_title("Check efficiency")
    ax.legend(fontsize=7)

    meta = results["meta"]
    fig.suptitle("npu_lossscale benchmarks, %s, TF %s, %s, %s cores" % (
        meta["date"], meta["tensorflow"], meta["cpu_model"], meta["cores"]), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(results, out):
    with open(os.path.join(out, "results.json"), "w") as handle:
        json.dump(results, handle, indent=1, sort_keys=False)
        handle.write("\n")
    with open(os.path.join(out, "results.md"), "w") as handle:
        handle.write(markdown(results))
    plot(results, os.path.join(out, "results.png"))
