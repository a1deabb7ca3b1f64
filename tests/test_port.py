"""``python -m npu_lossscale.port`` (issue 33) on the kept original scripts.

tests/port_scripts/ holds unported scripts in their authors' styles, one per
pattern the tool rewrites and one per pattern it must leave to a person.
The folder is ported once (``ported``); then, for each rewritten script:

* it builds and trains three steps, an overflow injected in the second
  (``--inject-overflow-at 2``), with a checkpoint after each step; the
  reference is the script's own checkpoints: after the poisoned step every
  weight, slot, moving statistic and ``global_step`` of every group equals
  the step before (bit for bit), and the next step moves the weights again;
* the report names every change: each changed region of the diff holds a
  "changed" entry, and the rules each pattern must produce are there.

The tool's output on the npu_bridge DCGAN's original trains exactly as the
hand port in examples/porting (``--style builder_alternating``) does. The
tool never writes INPUT, a second run over its output changes nothing, and
what it cannot prove is left byte for byte as it was.
"""

import ast
import difflib
import hashlib
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from conftest import REPO, SKIPPED_STEPS
import npu_lossscale as nl
from npu_lossscale.port import REPORT_SUFFIX, main, port
from npu_lossscale.tools.port._report import BY_HAND, CHANGED, LEFT_ALONE

SCRIPTS = os.path.join(REPO, "tests", "port_scripts")
EXAMPLE = os.path.join(REPO, "examples", "porting", "dcgan_alternating.py")
POISONED = 2  # of 3 steps: checkpoints 1 (before), 2 (the skipped step), 3 (applied)

#: The rewritten scripts: whether they import npu_bridge (the shim), and the
#: rules their report must hold at least.
RUNNABLE = {
    "npu_three_joint.py": (True, ["builder", "manager-mapped", "minimize-to-add",
                                  "global-step-to-build", "manager-per-group",
                                  "train-ops-bound", "wrapper-removed", "import-added"]),
    "contrib_update_ops.py": (False, ["builder", "manager-mapped", "update-ops-gated",
                                      "train-ops-bound", "wrapper-removed"]),
    "tf_mixed_precision_alternating.py": (False, ["builder", "loss-scale-mapped",
                                                  "train-ops-bound", "wrapper-removed"]),
    "graph_rewrite_joint.py": (False, ["builder", "loss-scale-mapped", "global-step-to-build",
                                       "train-ops-bound", "wrapper-removed"]),
    "unscaled_joint.py": (False, ["builder", "scaling-added", "global-step-to-build",
                                  "train-ops-bound"]),
    "npu_single.py": (True, ["drop-in", "manager-mapped", "import-added"]),  # and see
    # test_reasons_name_what_to_do: "update-ops-ungated"
    "dcgan_npu_bridge.py": (True, ["builder", "manager-mapped", "update-ops-gated",
                                   "global-step-to-build", "train-ops-bound"]),
    "modelzoo_dcgan_alternating.py": (True, ["builder", "constructor-moved", "manager-mapped",
                                             "update-ops-gated", "update-ops-each-group",
                                             "minimize-to-add", "wrapper-removed",
                                             "train-ops-bound"]),
    "pix2pix_name_scopes.py": (True, ["builder", "manager-mapped", "manager-per-group",
                                      "distributed-mapped",
                                      "update-ops-gated", "minimize-to-add", "wrapper-removed",
                                      "train-ops-bound"]),
    "pix2pix_authors.py": (True, ["builder", "manager-mapped", "manager-per-group",
                                  "update-ops-gated", "compute-apply-to-add", "train-ops-chained",
                                  "constructor-moved", "wrapper-removed", "train-ops-bound"]),
    "cyclegan_contrib_monitored.py": (False, ["builder", "manager-mapped", "manager-per-group",
                                              "update-ops-gated", "global-step-to-build",
                                              "minimize-to-add", "wrapper-removed",
                                              "train-ops-bound"]),
}

#: The training runs of one step, each skipped once in the poisoned step.
RUNS_PER_STEP = {"tf_mixed_precision_alternating.py": 2, "modelzoo_dcgan_alternating.py": 3}

#: The scripts left to a person: (rule, line) of each reason the report gives.
BY_HAND_SCRIPTS = {
    "byhand_loop.py": [("built-in-loop", 13), ("train-op-unfollowed", 15)],
    "byhand_function.py": [("optimizer-through-function", 9), ("optimizer-unfollowed", 24),
                           ("optimizer-unfollowed", 25)],
    "byhand_compute_apply.py": [("compute-apply-gradients", 17)],
    "byhand_reused.py": [("optimizer-reused", 17), ("optimizer-reused", 18)],
    "byhand_fetch.py": [("fetch-unmapped", 19), ("fetch-unmapped", 19)],
}


def _digests(folder):
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, folder)] = hashlib.sha256(handle.read()).hexdigest()
    return found


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    """tests/port_scripts ported once: ``(output folder, report)``."""
    before = _digests(SCRIPTS)
    out = str(tmp_path_factory.mktemp("port") / "out")
    report = port(SCRIPTS, out)
    assert _digests(SCRIPTS) == before, "the port wrote into its input"
    return out, report


def _entries(report, name, kind=None):
    return [e for e in report.entries if e.path == name and (kind is None or e.kind == kind)]


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checkpoints(folder, steps):
    states = {}
    for step in steps:
        reader = tf.train.load_checkpoint(os.path.join(folder, "model.ckpt-%d" % step))
        states[step] = dict((n, reader.get_tensor(n)) for n in reader.get_variable_to_shape_map())
    return states


def _is_scale_state(name):
    """The managers' state and the builder's own counters: by design they
    move on a skipped step."""
    return "loss_scale" in name


@pytest.mark.parametrize("name", sorted(n for n in RUNNABLE if not n.startswith("dcgan")))
def test_ported_script_trains_and_skips_an_overflow_atomically(ported, tmp_path, request, name):
    """(The DCGAN poisons the generator's run alone:
    test_dcgan_port_trains_as_the_hand_port runs it.)"""
    out, _ = ported
    if RUNNABLE[name][0]:
        request.getfixturevalue("npu_shim")
    module = _load(os.path.join(out, name), "ported_" + name[:-3])
    run = str(tmp_path / "run")
    os.makedirs(run)
    module.main(["--steps", "3", "--inject-overflow-at", str(POISONED), "--out", run])
    states = _checkpoints(run, (1, 2, 3))
    model = sorted(n for n in states[2] if not _is_scale_state(n))
    weights = [n for n in model if n.split("/")[-1] in ("w", "w1", "w2")]
    assert weights, model
    # The drop-in keeps the script's control_dependencies(UPDATE_OPS): its
    # moving statistics run on skipped steps as before (the report says so).
    ungated = ["moving_mean"] if name == "npu_single.py" else []
    # Pix2Pix's own step counter, in its tf.group beside the train ops.
    ungated += ["global_step"] if name.startswith("pix2pix") else []
    # And the authors' moving average of the loss terms, in that tf.group too.
    ungated += [n for n in model if n.endswith("ExponentialMovingAverage")]
    for variable in ungated:
        assert not np.array_equal(states[2][variable], states[1][variable]), variable
    for variable in sorted(set(model) - set(ungated)):  # nothing of any group moved
        assert np.array_equal(states[2][variable], states[1][variable]), variable
    statistics = [n for n in model if "moving" in n]
    assert bool(statistics) == (name in ("contrib_update_ops.py", "npu_single.py",
                                         "modelzoo_dcgan_alternating.py",
                                         "pix2pix_name_scopes.py", "pix2pix_authors.py",
                                         "cyclegan_contrib_monitored.py"))
    for variable in weights + statistics:  # the next step applied, with its updates
        assert not np.array_equal(states[3][variable], states[2][variable]), variable
        assert np.all(np.isfinite(states[3][variable])), variable
    if SKIPPED_STEPS in states[2]:  # one skip per run
        runs = RUNS_PER_STEP.get(name, 1)
        assert states[2][SKIPPED_STEPS] == states[1][SKIPPED_STEPS] + runs == runs


def _changed_regions(source, target):
    """The input line ranges (1-based, inclusive) that the output changes."""
    matcher = difflib.SequenceMatcher(None, source.splitlines(), target.splitlines(),
                                      autojunk=False)
    return [(i1 + 1, max(i1 + 1, i2)) for tag, i1, i2, _, _ in matcher.get_opcodes()
            if tag != "equal"]


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_report_names_every_change(ported, name):
    out, report = ported
    with open(os.path.join(SCRIPTS, name)) as handle:
        source = handle.read()
    with open(os.path.join(out, name)) as handle:
        target = handle.read()
    lines = [e.line for e in _entries(report, name, CHANGED)]
    regions = _changed_regions(source, target)
    assert regions
    for first, last in regions:
        # An insertion after line N shows as (N + 1, N + 1): the entry may
        # name the line it follows.
        assert any(first - 1 <= line <= last for line in lines), (name, first, last, lines)
    for entry in _entries(report, name, CHANGED):
        assert entry.message and entry.rule
    rules = set(e.rule for e in _entries(report, name, CHANGED))
    assert set(RUNNABLE[name][1]) <= rules, sorted(set(RUNNABLE[name][1]) - rules)


@pytest.mark.parametrize("name", ["modelzoo_dcgan_alternating.py", "pix2pix_name_scopes.py",
                                  "cyclegan_contrib_monitored.py", "pix2pix_authors.py"])
def test_the_kept_originals_port_with_no_by_hand_item(ported, name):
    """Issue 46: the DCGAN, Pix2Pix and CycleGAN shapes as their authors
    wrote them port in one command, nothing left to do by hand."""
    _, report = ported
    assert _entries(report, name, CHANGED)
    assert [(e.rule, e.line) for e in _entries(report, name, BY_HAND)] == []


@pytest.mark.parametrize("name", sorted(BY_HAND_SCRIPTS))
def test_what_the_tool_cannot_prove_is_left_as_it_was(ported, name):
    out, report = ported
    with open(os.path.join(SCRIPTS, name), "rb") as source, \
            open(os.path.join(out, name), "rb") as target:
        assert source.read() == target.read()
    assert not _entries(report, name, CHANGED)
    found = sorted((e.rule, e.line) for e in _entries(report, name, BY_HAND))
    assert found == sorted(BY_HAND_SCRIPTS[name])


def test_reasons_name_what_to_do(ported):
    _, report = ported
    compute = _entries(report, "byhand_compute_apply.py", BY_HAND)[0]
    assert "transform_grads_fn" in compute.message
    reused = _entries(report, "byhand_reused.py", BY_HAND)[0]
    assert "beta powers" in reused.message
    rewrite = [e for e in _entries(report, "graph_rewrite_joint.py", BY_HAND)]
    assert [e.rule for e in rewrite] == ["graph-rewrite-session-config"]
    assert "auto_mixed_precision" in rewrite[0].message
    assert rewrite[0].section == 'README "Graph-rewrite mixed precision"'
    steps = _entries(report, "dcgan_npu_bridge.py", BY_HAND)
    assert [e.rule for e in steps] == ["global-step-per-group"]
    kept = _entries(report, "npu_three_joint.py", LEFT_ALONE)
    assert [e.rule for e in kept] == ["npu-init-import"]
    single = _entries(report, "npu_single.py", LEFT_ALONE)
    assert sorted((e.rule, e.line) for e in single) == [("npu-init-import", 10),
                                                         ("update-ops-ungated", 42)]


def test_a_second_run_changes_nothing(ported, tmp_path):
    """(The by-hand scripts come out as they went in: their second run is
    their first, test_what_the_tool_cannot_prove_is_left_as_it_was.)"""
    out, _ = ported
    first = str(tmp_path / "first")
    os.makedirs(first)
    for name in RUNNABLE:
        with open(os.path.join(out, name)) as source:
            (tmp_path / "first" / name).write_text(source.read())
    again = str(tmp_path / "again")
    report = port(first, again)
    assert _digests(again) == _digests(first)
    assert not [e for e in report.entries if e.kind == CHANGED]
    assert set(e.rule for e in report.entries if e.kind == LEFT_ALONE) >= {"already-ported"}


def test_the_rewrites(ported):
    """The builder's lines as the README's recipe writes them."""
    out, _ = ported
    with open(os.path.join(out, "dcgan_npu_bridge.py")) as handle:
        dcgan = handle.read()
    assert ('        scaler.add(g_loss, g_opt, var_list=g_vars, name="g_train", '
            'loss_scale_manager=g_manager)\n'
            '        train = scaler.build(global_step=global_step, per_group_ops=True,\n'
            '                             update_ops={"g_train": g_updates})\n'
            '        d_train = train.per_group["d_train"]\n') in dcgan
    assert "# batch norm's moving statistics\n        scaler.add(g_loss" in dcgan
    with open(os.path.join(out, "npu_single.py")) as handle:
        single = handle.read()
    assert "optimizer = nl.LossScaleOptimizer(tf.train.AdamOptimizer(1e-2), manager)" in single
    assert "with tf.control_dependencies(" in single  # the drop-in keeps the rest
    with open(os.path.join(out, "graph_rewrite_joint.py")) as handle:
        rewrite = handle.read()
    assert "enable_mixed_precision_graph_rewrite(" not in rewrite
    assert "# mixed precision: the graph rewrite and a dynamic loss scale\n" in rewrite


class _RecordedRuns(object):
    """``tf.Session`` in the scripts, recording each run's graph and fetches
    (``sessions``), so that a test can read the runs a script made."""

    def __init__(self, monkeypatch):
        self.runs = []
        recorded = self.runs

        class Session(tf.Session):
            def run(self, fetches, *args, **kwargs):
                recorded.append((self.graph, fetches))
                return super(Session, self).run(fetches, *args, **kwargs)

        monkeypatch.setattr(tf, "Session", Session)


def _fetched_ops(graph, fetches):
    """The ops a ``session.run`` of ``fetches`` asks for (a Saver fetches by
    name)."""
    if isinstance(fetches, dict):
        return [op for value in fetches.values() for op in _fetched_ops(graph, value)]
    if isinstance(fetches, (list, tuple)):
        return [op for value in fetches for op in _fetched_ops(graph, value)]
    if isinstance(fetches, str):
        fetches = graph.as_graph_element(fetches)
    return [fetches if isinstance(fetches, tf.Operation) else fetches.op]


def _unordered_accesses(graph, fetches):
    """The (variable, read, write) node names of one run of ``fetches``
    where a read of a variable and a write of it can both run and neither
    waits for the other, so that the read may see the value before or after
    the write: a race. Function bodies (a functional If gate's branches)
    are inlined, and nodes of branches that exclude each other (a gate's
    apply and skip sides) never race. Read by the audit's graph model."""
    from npu_lossscale.audit import _graph
    model = _graph.load(graph)
    names = model.ancestors([op.name for op in _fetched_ops(graph, fetches)])
    reads, writes = {}, {}
    for name in names:
        node = model.nodes[name]
        if not node.inputs:
            continue
        variable = model.resolve_variable(node.inputs[0])
        if variable is None:
            continue
        if node.type in ("ReadVariableOp", "ResourceGather"):
            reads.setdefault(variable, []).append(name)
        elif _graph.is_mutation(node.type):
            writes.setdefault(variable, []).append(name)
    before = {}

    def ancestors(name):
        if name not in before:
            before[name] = model.ancestors([name])
        return before[name]

    found = []
    for variable, written in writes.items():
        for write in written:
            for other in reads.get(variable, []) + written:
                if (other == write or other in ancestors(write) or write in ancestors(other)
                        or model.exclusive(model.conditions(other), model.conditions(write))):
                    continue
                found.append((variable, other, write))
    return sorted(set(found))


def test_the_race_check_finds_a_read_unordered_against_its_write(graph):
    """The control of ``_unordered_accesses``: a read and an increment of
    one variable fetched together race; ordered, or in the two branches of
    a cond, they do not."""
    v = tf.Variable(1.0, name="v", use_resource=True)
    read, increment = v.read_value(), v.assign_add(1.0).op
    assert [(found[0], found[2]) for found in _unordered_accesses(graph, [read, increment])] \
        == [("v", increment.name)]
    with tf.control_dependencies([read]):
        after = v.assign_add(1.0).op
    assert _unordered_accesses(graph, [read, after]) == []
    pred = tf.placeholder(tf.bool, [])
    branches = tf.cond(pred, lambda: v.assign_add(1.0), lambda: v.read_value())
    assert _unordered_accesses(graph, [branches]) == []


def test_dcgan_port_trains_as_the_hand_port(ported, tmp_path, npu_shim, monkeypatch):
    """The tool's output on the original and examples/porting's hand port
    (builder_alternating): same seed, data and feeds, an overflow in the
    generator's run of the last iteration. Every weight, slot and moving
    statistic agrees bit for bit, and so do the losses; the poisoned run
    changed nothing of the generator, the discriminator's run before it
    applied.

    Bit-for-bit equality holds only if no run of either script reads a
    variable unordered against a write of it (a race, whose outcome the
    scheduler picks): each run's fetches are checked for one, through the
    audit's graph model with function bodies inlined. On a mismatch the
    message names every variable that differs, with both values, and both
    scripts' losses."""
    out, _ = ported
    # The hand port never imports the shim: no shim callback may be left in
    # this thread to instrument its graph (npu_shim drops one at its setup).
    assert _shim_callbacks() == []
    hand_dir, tool_dir = str(tmp_path / "hand"), str(tmp_path / "tool")
    common = ["--steps", "3", "--batch-size", "16", "--inject-overflow-at", "3"]
    recorded = _RecordedRuns(monkeypatch)
    hand = _load(EXAMPLE, "porting_dcgan_alternating").main(
        common + ["--style", "builder_alternating", "--backend", "is_finite",
                  "--log-every", "1", "--save-every", "1", "--out", hand_dir])
    tool = _load(os.path.join(out, "dcgan_npu_bridge.py"), "ported_dcgan").main(
        common + ["--out", tool_dir])
    runs = dict(((id(run_graph), repr(fetches)), (run_graph, fetches))
                for run_graph, fetches in recorded.runs)
    assert len(runs) >= 6, runs  # each script's D and G runs, init, reads
    for run_graph, fetches in runs.values():
        assert _unordered_accesses(run_graph, fetches) == [], fetches
    hand_states, tool_states = _checkpoints(hand_dir, (3,)), _checkpoints(tool_dir, (2, 3))
    model = sorted(n for n in hand_states[3] if not _is_scale_state(n))
    assert sorted(n for n in tool_states[3] if not _is_scale_state(n)) == model
    differ = dict((variable, (tool_states[3][variable], hand_states[3][variable]))
                  for variable in model
                  if not np.array_equal(tool_states[3][variable], hand_states[3][variable]))
    losses = dict(tool=(tool["d_loss"], tool["g_loss"]), hand=(hand["d_loss"], hand["g_loss"]))
    assert not differ and losses["tool"] == losses["hand"], (losses, differ)
    assert tool["global_step"] == hand["global_step"] == 5  # D's 3 runs, G's 2 applied
    for variable in model:
        unchanged = np.array_equal(tool_states[3][variable], tool_states[2][variable])
        if variable.startswith("generator/"):
            assert unchanged, variable
        elif variable.startswith("discriminator/"):
            assert not unchanged, variable


def _shim_callbacks():
    """The npu_bridge shim's op-creation callbacks active in this thread."""
    from tensorflow.python.eager import context
    return [c for c in context.context().op_callbacks if getattr(c, "_npu_shim_callback", False)]


def test_a_shim_left_by_an_earlier_test_is_dropped_before_the_next(request):
    """The cause of test_dcgan_port_trains_as_the_hand_port's one flake:
    a shim left imported in saturation mode by an earlier test of the same
    worker (which files a worker runs before this one depends on the load)
    keeps its op-creation callback, which clips the float16 ops of every
    graph built after it, the hand port's too: the poisoned run's gradients
    come out finite and apply. npu_shim drops such a shim at its setup."""
    sys.path.insert(0, os.path.join(REPO, "shims"))
    try:
        from npu_bridge.estimator.npu import npu_plugin
        npu_plugin.set_device_sat_mode(0)
    finally:
        sys.path.remove(os.path.join(REPO, "shims"))
    assert _shim_callbacks() and "npu_bridge" in sys.modules
    request.getfixturevalue("npu_shim")
    assert _shim_callbacks() == []
    assert not [m for m in sys.modules if m.split(".")[0] == "npu_bridge"]


def test_folder_input_copies_other_files_and_keeps_the_tree(tmp_path):
    source = tmp_path / "project"
    (source / "nets").mkdir(parents=True)
    with open(os.path.join(SCRIPTS, "npu_single.py")) as handle:
        (source / "nets" / "train.py").write_text(handle.read())
    (source / "config.yaml").write_text("steps: 3\n")
    (source / "broken.py").write_text("def broken(:\n")
    before = _digests(str(source))
    report = port(str(source), str(tmp_path / "out"))
    assert _digests(str(source)) == before
    assert (tmp_path / "out" / "config.yaml").read_text() == "steps: 3\n"
    assert (tmp_path / "out" / "broken.py").read_text() == "def broken(:\n"
    assert "nl.LossScaleOptimizer" in (tmp_path / "out" / "nets" / "train.py").read_text()
    assert report.files == ["broken.py", os.path.join("nets", "train.py")]
    assert [e.rule for e in report.entries if e.kind == BY_HAND] == ["unparsable"]
    assert os.path.isfile(str(tmp_path / "out") + REPORT_SUFFIX)


def test_the_command_line_prints_and_writes_the_report(tmp_path, capsys):
    script = os.path.join(SCRIPTS, "npu_single.py")
    assert main([script, "-o", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    written = tmp_path / ("npu_single.py" + REPORT_SUFFIX)
    assert written.read_text() == printed
    assert printed.startswith("npu_lossscale.port: 1 file read, 3 changed, 2 left alone, "
                              "0 by hand\n")
    assert "npu_single.py:41  [drop-in]" in printed
    assert '      read: README "LossScaleOptimizer"' in printed


def test_refuses_to_write_into_its_input(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("x = 1\n")
    for output in (str(script), str(tmp_path)):
        assert main([str(script), "-o", output]) == 2
        assert "would write into the input" in capsys.readouterr().err
    assert main([str(tmp_path), "-o", str(tmp_path / "inside")]) == 2
    assert main([str(tmp_path / "missing.py"), "-o", str(tmp_path / "o")]) == 2
    assert main([str(script), "-o", str(tmp_path / "o"), "--check", "python -c 1"]) == 2
    assert "is not 'python SCRIPT.py [ARGS...]'" in capsys.readouterr().err
    assert script.read_text() == "x = 1\n"


def test_a_folder_into_a_file_is_a_usage_error_and_a_named_script_is_ported(tmp_path, capsys):
    """A folder's OUTPUT that is a file: exit 2 with the fix, no traceback.
    A script named as INPUT is read as Python whatever its name ends with."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.py").write_text("x = 1\n")
    taken = tmp_path / "taken.txt"
    taken.write_text("")
    assert main([str(folder), "-o", str(taken)]) == 2
    assert "is a file, and the input" in capsys.readouterr().err
    script = tmp_path / "train"  # no .py
    with open(os.path.join(SCRIPTS, "npu_three_joint.py")) as handle:
        script.write_text(handle.read())
    assert main([str(script), "-o", str(tmp_path / "ported")]) == 0
    assert "1 file read" in capsys.readouterr().out
    assert "nl.MultiOptimizerLossScale" in (tmp_path / "ported").read_text()


def test_without_libcst_it_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "libcst", None)
    assert main([os.path.join(SCRIPTS, "npu_single.py"), "-o", str(tmp_path)]) == 2
    assert "pip install '.[port]'" in capsys.readouterr().err


def test_the_port_modules_do_not_import_tensorflow():
    """The rewrite is source work: only the probe, which runs inside the
    checked script's interpreter, imports TensorFlow."""
    folder = os.path.join(REPO, "npu_lossscale", "tools", "port")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py") or name == "_probe.py":
            continue
        with open(os.path.join(folder, name)) as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for module in modules:
                assert not module.startswith(("tensorflow", "npu_lossscale.audit")) and (
                    module in ("npu_lossscale", "npu_lossscale.tools.port")
                    or not module.startswith("npu_lossscale")
                    or module.startswith("npu_lossscale.tools.port.")), (name, module)


def test_the_port_command_loads_no_tensorflow(tmp_path):
    """``python -m npu_lossscale.port`` rewrites a script in a process that
    never imports TensorFlow, nor the library's TensorFlow modules: the
    package binds its public names on their first use."""
    script = ("import runpy, sys\n"
              "sys.argv = ['port', %r, '-o', %r]\n"
              "try:\n"
              "    runpy.run_module('npu_lossscale.port', run_name='__main__', alter_sys=True)\n"
              "except SystemExit as stop:\n"
              "    assert not stop.code, stop.code\n"
              "print(sorted(name for name in sys.modules if name.split('.')[0] in "
              "('tensorflow', 'npu_lossscale') and not name.startswith("
              "('npu_lossscale.port', 'npu_lossscale.tools.port'))))\n"
              % (os.path.join(SCRIPTS, "npu_three_joint.py"), str(tmp_path / "out.py")))
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "['npu_lossscale', 'npu_lossscale.tools']"
    assert "MultiOptimizerLossScale" in (tmp_path / "out.py").read_text()


def test_the_probe_audits_each_training_run_once(tmp_path, graph):
    """--check's probe, in this process: the first session.run of each
    distinct set of fetches that trains is audited; runs that train nothing
    (the initializer, a loss) are not. Two LossScaleOptimizers with their own
    managers fetched in one run: the audit warns about the two scales."""
    import json  # pylint: disable=import-outside-toplevel

    import npu_lossscale as nl  # pylint: disable=import-outside-toplevel
    from npu_lossscale.tools.port import _probe  # pylint: disable=import-outside-toplevel
    x = tf.placeholder(tf.float32, [4, 3])
    ops = []
    for name in ("d", "g"):
        with tf.variable_scope(name):
            w = tf.get_variable("w", [3, 1])
        loss = tf.reduce_mean(tf.matmul(x, w))
        manager = nl.ExponentialUpdateLossScaleManager(8, 100)
        ops.append(nl.LossScaleOptimizer(tf.train.AdamOptimizer(), manager).minimize(
            loss, var_list=[w]))
    result = str(tmp_path / "result.json")
    probe = _probe._Probe(result)  # pylint: disable=protected-access

    class Session(object):
        graph = tf.get_default_graph()

    for fetches in (tf.global_variables_initializer(), loss, {"d": ops[0], "g": ops[1]},
                    [ops[1], ops[0]], ops[0]):
        probe.before_run(Session(), fetches)
    probe.finish()
    with open(result) as handle:
        runs = json.load(handle)
    assert [sorted(run["fetches"]) for run in runs] == [sorted(o.name for o in ops),
                                                        [ops[0].name]]
    assert "NLS008-independent-scales" in [code for code, _, _ in runs[0]["findings"]]


def test_the_check_names_the_rewritten_script(tmp_path):
    from npu_lossscale.tools.port import _check  # pylint: disable=import-outside-toplevel
    folder, out = tmp_path / "in", tmp_path / "out"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "train.py").write_text("")
    assert _check.rewritten_script(str(folder / "sub" / "train.py"), str(folder),
                                   str(out)) == os.path.join(str(out), "sub", "train.py")
    assert _check.rewritten_script("elsewhere.py", str(folder), str(out)) is None
    single = folder / "sub" / "train.py"
    assert _check.rewritten_script("train.py", str(single), str(out / "t.py")) == str(
        out / "t.py")
    assert _check.parse_command("python train.py --steps 2") == ("python", "train.py",
                                                                 ["--steps", "2"])
    with pytest.raises(ValueError, match="is not 'python SCRIPT.py"):
        _check.parse_command("python -m train")


def test_the_report_fails_on_a_failed_check():
    from npu_lossscale.tools.port._report import (AuditedRun, CheckResult,  # pylint: disable=import-outside-toplevel
                                            Report)
    report = Report()
    report.check = CheckResult("python t.py", 0, [AuditedRun(["u"], [("NLS011", "info", "m")])],
                               "")
    assert not report.check_failed()
    report.check = CheckResult("python t.py", 0, [AuditedRun(["u"], [("NLS001", "error", "m")])],
                               "")
    assert report.check_failed()
    report.check = CheckResult("python t.py", 2, [], "Traceback ...")
    assert report.check_failed()
    assert "  exit status 2\n  | Traceback ...\n  no training session.run was audited" in (
        report.format())


def test_a_sync_replicas_drop_in_builds(graph, npu_shim):
    """The drop-in with ours inside builds (TF's own class there is a
    TypeError at minimize)."""
    from npu_lossscale.tools.port._rewrite import port_source  # pylint: disable=import-outside-toplevel
    source = ("import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n\n"
              "w = tf.Variable([1.0])\nloss = tf.reduce_sum(w * w)\n"
              "gs = tf.train.get_or_create_global_step()\n"
              "opt = NPULossScaleOptimizer(tf.train.SyncReplicasOptimizer(\n"
              "    tf.train.AdamOptimizer(), replicas_to_aggregate=2), FixedLossScaleManager(8))\n"
              "train = opt.minimize(loss, gs)\n")
    new, _ = port_source(source, "t.py")
    scope = {}
    exec(compile(new, "t.py", "exec"), scope)  # pylint: disable=exec-used
    assert scope["train"].graph is tf.get_default_graph()
    assert isinstance(scope["opt"].inner_optimizer, nl.SyncReplicasOptimizer)


def test_npu_tf_optimizer_around_the_wrappers_becomes_the_hccl_engine(graph, npu_shim):
    """npu_tf_optimizer(NPULossScaleOptimizer(opt, m, is_distributed=True))
    per network (the converter's spelling): the port's builder takes
    distributed="hccl"; it builds and applies a step on one device."""
    from npu_lossscale.tools.port._rewrite import port_source  # pylint: disable=import-outside-toplevel
    source = ("import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n\n"
              "d_w = tf.Variable([1.0])\ng_w = tf.Variable([2.0])\n"
              "d_loss = tf.reduce_sum(d_w * d_w)\ng_loss = tf.reduce_sum(g_w * g_w)\n"
              "d_opt = npu_tf_optimizer(NPULossScaleOptimizer(tf.train.GradientDescentOptimizer("
              "0.5), FixedLossScaleManager(8), is_distributed=True))\n"
              "g_opt = npu_tf_optimizer(NPULossScaleOptimizer(tf.train.GradientDescentOptimizer("
              "0.5), FixedLossScaleManager(8), is_distributed=True))\n"
              "d_train = d_opt.minimize(d_loss, var_list=[d_w])\n"
              "g_train = g_opt.minimize(g_loss, var_list=[g_w])\n"
              "def step(sess):\n    sess.run([d_train, g_train])\n")
    new, entries = port_source(source, "t.py")
    assert 'nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), distributed="hccl")' in new
    assert "distributed-mapped" in [e.rule for e in entries]
    scope = {}
    exec(compile(new, "t.py", "exec"), scope)  # pylint: disable=exec-used
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        scope["step"](sess)
        assert sess.run([scope["d_w"], scope["g_w"]]) == [[0.0], [0.0]]  # w - 0.5 * 2w


@pytest.mark.parametrize("rank_size", [None, "1"])
def test_a_rank_size_spelling_ports_and_trains_on_one_device(graph, npu_shim, monkeypatch,
                                                             rank_size):
    """Pix2Pix's `if RANK_SIZE > 1:` between npu_tf_optimizer(wrapper) and
    the wrapper: on one device the builder's engine is None, and a step
    applies both groups."""
    from npu_lossscale.tools.port._rewrite import port_source  # pylint: disable=import-outside-toplevel
    if rank_size is None:
        monkeypatch.delenv("RANK_SIZE", raising=False)
    else:
        monkeypatch.setenv("RANK_SIZE", rank_size)
    lines = []
    for name, value in (("d", 1.0), ("g", 2.0)):
        lines += ["%s_w = tf.Variable([%s])" % (name, value),
                  "%s_loss = tf.reduce_sum(%s_w * %s_w)" % (name, name, name),
                  "%s_opt = tf.train.GradientDescentOptimizer(0.5)" % name,
                  "if int(os.getenv('RANK_SIZE', '1')) > 1:",
                  "    %s_opt = npu_tf_optimizer(NPULossScaleOptimizer(%s_opt, "
                  "FixedLossScaleManager(8), is_distributed=True))" % (name, name),
                  "else:",
                  "    %s_opt = NPULossScaleOptimizer(%s_opt, FixedLossScaleManager(8))"
                  % (name, name),
                  "%s_train = %s_opt.minimize(%s_loss, var_list=[%s_w])" % ((name,) * 4)]
    source = ("import os\nimport tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n\n"
              + "\n".join(lines) + "\ndef step(sess):\n    sess.run([d_train, g_train])\n")
    new, _ = port_source(source, "t.py")
    assert "if int(" not in new.split("scaler = ")[0].split("import npu_lossscale as nl")[1]
    scope = {}
    exec(compile(new, "t.py", "exec"), scope)  # pylint: disable=exec-used
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        scope["step"](sess)
        assert sess.run([scope["d_w"], scope["g_w"]]) == [[0.0], [0.0]]


def test_a_checkpoint_of_pix2pixs_original_restores_in_its_port(ported, tmp_path, npu_shim):
    """The name scopes stay, and the model's and optimizers' variables keep
    their names: every variable of the original's checkpoint but the
    managers' own state is in the port's, with its shape."""
    out, _ = ported
    runs = {}
    for label, path in (("original", os.path.join(SCRIPTS, "pix2pix_name_scopes.py")),
                        ("port", os.path.join(out, "pix2pix_name_scopes.py"))):
        folder = str(tmp_path / label)
        os.makedirs(folder)
        _load(path, "pix2pix_" + label).main(["--steps", "1", "--out", folder])
        runs[label] = tf.train.load_checkpoint(
            os.path.join(folder, "model.ckpt-1")).get_variable_to_shape_map()
    managers = ("loss_scale", "good_steps", "bad_steps")
    original = dict((n, s) for n, s in runs["original"].items()
                    if not n.endswith(managers))
    assert len(original) > 10 and any("beta1_power" in n for n in original)
    assert dict((n, runs["port"][n]) for n in original if n in runs["port"]) == original


@pytest.mark.parametrize("fp16", [True, False])
def test_a_precision_if_else_ports_and_trains_in_both_branches(graph, npu_shim, fp16):
    """The loss-scaled branch gets the builder, the plain one stays: each
    builds and applies a step (the builder's on a poisoned step skips)."""
    from npu_lossscale.tools.port._rewrite import port_source  # pylint: disable=import-outside-toplevel
    lines = ["poison = tf.placeholder_with_default(1.0, [])"]
    for name, value in (("d", 1.0), ("g", 2.0)):
        lines += ["%s_w = tf.Variable([%s])" % (name, value),
                  "%s_loss = tf.reduce_sum(%s_w * %s_w) * poison" % (name, name, name),
                  "%s_opt = tf.train.GradientDescentOptimizer(0.5)" % name]
    lines += ["if FP16:"] + [
        "    %s_train = NPULossScaleOptimizer(%s_opt, FixedLossScaleManager(8)).minimize("
        "%s_loss, var_list=[%s_w])" % ((n,) * 4) for n in "dg"] + ["else:"] + [
        "    %s_train = %s_opt.minimize(%s_loss, var_list=[%s_w])" % ((n,) * 4) for n in "dg"]
    source = ("import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n\n"
              "FP16 = %s\n" % fp16 + "\n".join(lines)
              + "\ndef step(sess, feed=None):\n    sess.run([d_train, g_train], feed)\n")
    new, _ = port_source(source, "t.py")
    assert "nl.MultiOptimizerLossScale" in new and "else:\n    d_train = d_opt.minimize" in new
    scope = {}
    exec(compile(new, "t.py", "exec"), scope)  # pylint: disable=exec-used
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        if fp16:  # an overflow: the builder's step skips, both weights stay
            scope["step"](sess, {scope["poison"]: 1e38})
            assert sess.run([scope["d_w"], scope["g_w"]]) == [[1.0], [2.0]]
        scope["step"](sess)
        assert sess.run([scope["d_w"], scope["g_w"]]) == [[0.0], [0.0]]


@pytest.mark.parametrize("fp16", [True, False])
def test_update_ops_around_a_precision_if_are_gated_in_the_scaled_branch(graph, npu_shim, fp16):
    """The block around the if is lifted into the scaled branch's build():
    a poisoned step leaves the update's variable (a batch-norm statistic's
    stand-in) where it was; the plain branch still runs it on every step."""
    from npu_lossscale.tools.port._rewrite import port_source  # pylint: disable=import-outside-toplevel
    lines = ["poison = tf.placeholder_with_default(1.0, [])",
             "stat = tf.Variable(0.0)",
             "update_ops = [tf.assign_add(stat, 1.0)]"]
    for name, value in (("d", 1.0), ("g", 2.0)):
        lines += ["%s_w = tf.Variable([%s])" % (name, value),
                  "%s_loss = tf.reduce_sum(%s_w * %s_w) * poison" % (name, name, name),
                  "%s_opt = tf.train.GradientDescentOptimizer(0.5)" % name]
    lines += ["with tf.control_dependencies(update_ops):", "    if FP16:"] + [
        "        %s_train = NPULossScaleOptimizer(%s_opt, FixedLossScaleManager(8)).minimize("
        "%s_loss, var_list=[%s_w])" % ((n,) * 4) for n in "dg"] + ["    else:"] + [
        "        %s_train = %s_opt.minimize(%s_loss, var_list=[%s_w])" % ((n,) * 4)
        for n in "dg"]
    source = ("import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n\n"
              "FP16 = %s\n" % fp16 + "\n".join(lines)
              + "\ndef step(sess, feed=None):\n    sess.run([d_train, g_train], feed)\n")
    new, entries = port_source(source, "t.py")
    assert "update-ops-lifted" in [e.rule for e in entries]
    scope = {}
    exec(compile(new, "t.py", "exec"), scope)  # pylint: disable=exec-used
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        if fp16:
            scope["step"](sess, {scope["poison"]: 1e38})
            assert sess.run(scope["stat"]) == 0.0  # skipped: the update did not run
        scope["step"](sess)
        assert sess.run(scope["stat"]) == 1.0
