"""The GAN examples: smoke runs, resume, the quality metric, bad input.

The examples run as subprocesses (``sys.executable``), each in its own TF
process, with tiny step counts and batches. The metric module is imported
directly (it needs no TensorFlow).
"""

import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GAN_DIR = os.path.join(REPO, "examples", "gan")
DCGAN = os.path.join(GAN_DIR, "dcgan.py")
ENCODER_GAN = os.path.join(GAN_DIR, "encoder_gan.py")
sys.path.insert(0, GAN_DIR)

import digits  # noqa: E402
import metrics  # noqa: E402
import warm_python

TINY_DCGAN = ["--steps", "4", "--batch-size", "8", "--eval-samples", "40",
              "--log-every", "2", "--ckpt-every", "2"]
TINY_ENCODER = ["--steps", "3", "--batch-size", "8", "--log-every", "2"]
METRICS_KEYS = {"steps", "skipped_steps", "final_loss_scale", "inception_score",
                "class_coverage", "seconds_per_step", "precision", "backend",
                "real_inception_score"}


def _env():
    # The shim runs as an Atlas training (910A) device would: saturation
    # mode, so that backend "npu" reads the float-status register. (Its
    # default, INF/NaN as on Atlas A2/A3, would make "npu" check the
    # gradients with is_finite, as npu_bridge does.)
    return dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3",
                NPU_SHIM_OVERFLOW_MODE="saturation")


def run(script, *args):
    return warm_python.run([sys.executable, script] + list(args), env=_env(),
                          capture_output=True, text=True, timeout=240)


def _check(proc, stdout, stderr):
    assert proc.returncode == 0, "exit %d\nstdout:\n%s\nstderr:\n%s" % (
        proc.returncode, stdout, stderr[-4000:])
    return stdout


def ok(script, *args):
    proc = run(script, *args)
    return _check(proc, proc.stdout, proc.stderr)


class Background(object):
    """A script started at once; ``wait()`` asserts it succeeded, returns stdout."""

    def __init__(self, script, *args):
        self._proc = warm_python.Popen([sys.executable, script] + list(args), env=_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      universal_newlines=True)
        self._output = None

    def wait(self):
        if self._output is None:
            self._output = self._proc.communicate(timeout=300)
        return _check(self._proc, *self._output)


def read_metrics(out):
    with open(os.path.join(str(out), "metrics.json")) as handle:
        return json.load(handle)


def checkpoint_variables(out):
    prefix = tf.train.latest_checkpoint(str(out))
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(prefix)}


@pytest.fixture(scope="module", autouse=True)
def preloaded():
    """The examples' scikit-learn (the digits, the scorer) and matplotlib,
    imported once in the warm server rather than in each run."""
    warm_python.preload("sklearn.datasets", "sklearn.decomposition", "sklearn.neural_network",
                        "sklearn.pipeline", "matplotlib.pyplot")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The four smoke runs, started together (each is mostly TF start-up)."""
    root = tmp_path_factory.mktemp("runs")
    outs = {name: root / name for name in ("dcgan", "dcgan_shim", "encoder", "encoder_shim")}
    started = {
        "dcgan": Background(DCGAN, "--precision", "fp16", "--backend", "is_finite",
                            "--out", str(outs["dcgan"]), *TINY_DCGAN),
        "dcgan_shim": Background(DCGAN, "--npu-shim", "--backend", "npu",
                                 "--out", str(outs["dcgan_shim"]), *TINY_DCGAN),
        "encoder": Background(ENCODER_GAN, "--backend", "is_finite",
                              "--out", str(outs["encoder"]), *TINY_ENCODER),
        "encoder_shim": Background(ENCODER_GAN, "--npu-shim", "--backend", "npu",
                                   "--encoder-only", "--out", str(outs["encoder_shim"]),
                                   *TINY_ENCODER),
    }
    yield {name: (started[name], outs[name]) for name in started}
    for proc in started.values():
        try:
            proc.wait()
        except AssertionError:
            pass  # reported by the test that uses it


# ---------------------------------------------------------------------------
# Smoke runs.
# ---------------------------------------------------------------------------

def test_dcgan_fp16_is_finite_writes_every_output(runs):
    proc, out = runs["dcgan"]
    stdout = proc.wait()
    result = read_metrics(out)
    assert METRICS_KEYS <= set(result)
    assert result["backend"] == "is_finite" and result["precision"] == "fp16"
    assert result["steps"] == 4 == result["global_step"] + result["skipped_steps"]
    assert 1.0 <= result["inception_score"] <= 10.0
    for name in ("samples.png", "curves.png", "history.json", "checkpoint",
                 "model.ckpt-4.index", "model.ckpt-2.index"):
        assert os.path.isfile(os.path.join(str(out), name)), name
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(str(out)))
    assert "outputs in" in stdout


def test_dcgan_records_skip_reasons_and_underflow(runs):
    """history.json: a skip reason per step, an underflow row per group at
    the first and the last step (dcgan.UNDERFLOW_EVERY apart otherwise);
    metrics.json: the last measurement and the skips by reason."""
    proc, out = runs["dcgan"]
    proc.wait()
    with open(os.path.join(str(out), "history.json")) as handle:
        history = json.load(handle)
    assert history["columns"][-1] == "skip_reason"
    assert [row[-1] == 0 for row in history["rows"]] == [bool(row[4]) for row in
                                                         history["rows"]]
    assert [row[:2] for row in history["underflow"]] == [
        [1, "discriminator"], [1, "generator"], [4, "discriminator"], [4, "generator"]]
    for row in history["underflow"]:
        measured = dict(zip(history["underflow_columns"], row))
        assert 0.0 <= measured["flushed_share"] <= measured["zero_share"] + 1e-6 <= 1.0 + 1e-6
        assert 0.0 <= measured["subnormal_share"] <= 1.0
    result = read_metrics(out)
    assert sorted(result["underflow"]) == ["discriminator", "generator"]
    assert sum(result["skips_by_reason"].values()) == result["skipped_steps"]


def test_dcgan_history_helpers_by_hand(tmp_path):
    import outputs  # examples/gan/outputs.py  pylint: disable=import-outside-toplevel
    history = outputs.History(
        rows=[[1, 0.7, 0.7, 4.0, 1, 0], [2, 0.7, 0.7, 4.0, 0, 2], [3, 0.7, 0.7, 2.0, 0, 1]],
        underflow=[[1, "d", 0.5, 0.2, 12.0, 0.5, 0.0], [1, "g", 0.0, 0.0, 12.0, 0.0, 0.0],
                   [21, "d", 0.0, 0.005, 3.0, 0.0, 0.0], [21, "g", 0.004, 0.004, 3.0, 0.0, 0.0],
                   [41, "d", 0.0, 0.02, 3.0, 0.0, 0.0], [41, "g", 0.0, 0.0, 3.0, 0.0, 0.0],
                   [61, "d", 0.0, 0.0, 3.0, 0.0, 0.0], [61, "g", 0.0, 0.0, 3.0, 0.0, 0.0]])
    reasons = ("applied", "loss_not_finite", "gradients_overflowed")
    assert outputs.skips_by_reason(history, reasons) == {
        "gradients_overflowed": 1, "loss_not_finite": 1}
    # Step 21 is healthy (0.5 % and 0.8 % underflowed), 41 is not (2 %).
    assert outputs.healthy_from_step(history) == 61
    assert outputs.last_underflow(history)["d"]["subnormal_share"] == 0.0
    # An older history.json (five columns, no underflow) still plots.
    outputs.save_curves_png(str(tmp_path / "old.png"),
                            outputs.History([[1, 0.7, 0.7, 4.0, 1]]), "t", reasons)
    assert (tmp_path / "old.png").stat().st_size > 0


def test_dcgan_npu_shim_backend(runs):
    proc, out = runs["dcgan_shim"]
    proc.wait()
    result = read_metrics(out)
    assert result["backend"] == "npu"
    assert result["global_step"] + result["skipped_steps"] == 4


def test_encoder_gan_is_finite(runs):
    proc, out = runs["encoder"]
    proc.wait()
    result = read_metrics(out)
    assert result["backend"] == "is_finite" and result["encoder_only"] is False
    assert result["global_step"] + result["skipped_steps"] == 3
    assert np.isfinite(result["final_d_loss"])
    assert any(name.startswith("discriminator/") for name in checkpoint_variables(out))


def test_encoder_only_npu_shim_has_no_discriminator(runs):
    proc, out = runs["encoder_shim"]
    proc.wait()
    result = read_metrics(out)
    assert result["backend"] == "npu" and result["encoder_only"] is True
    assert "final_d_loss" not in result
    names = checkpoint_variables(out)
    assert not any(name.startswith("discriminator/") for name in names)
    assert any(name.startswith("encoder/") for name in names)


# ---------------------------------------------------------------------------
# Resume.
# ---------------------------------------------------------------------------

def test_resume_continues_global_step_and_loss_scale(runs):
    proc, out = runs["dcgan"]
    proc.wait()
    first = checkpoint_variables(out)
    first_metrics = read_metrics(out)
    ok(DCGAN, "--precision", "fp16", "--backend", "is_finite", "--out", str(out),
       "--resume", *(TINY_DCGAN[:1] + ["8"] + TINY_DCGAN[2:]))
    second = checkpoint_variables(out)
    result = read_metrics(out)
    assert result["resumed"] is True and result["steps_this_run"] == 4
    assert int(second["global_step"]) + int(second["skipped_steps"]) == 8
    assert result["global_step"] == int(second["global_step"])
    # The dynamic manager's state went on from the checkpoint: its count of
    # good steps since the last change kept growing (a fresh start would be
    # back at 4), and the scale the resumed run used first is the saved one.
    applied_now = int(second["global_step"]) - int(first["global_step"])
    # The state vector is [scale, good_steps, bad_steps, streak].
    assert int(second["dynamic_loss_scale/state"][1]) == (
        int(first["dynamic_loss_scale/state"][1]) + applied_now)
    with open(os.path.join(str(out), "history.json")) as handle:
        rows = json.load(handle)["rows"]
    assert [row[0] for row in rows] == list(range(1, 9))
    assert rows[4][3] == float(first["dynamic_loss_scale/state"][0]) == \
        first_metrics["final_loss_scale"]


# ---------------------------------------------------------------------------
# The metric.
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    images, labels = digits.load_digits()
    return images, metrics.reference(images, labels, seed=0)


def test_real_digits_score_high_and_cover_every_class(reference):
    images, ref = reference
    assert ref.real_score > 8.0
    assert ref.real_accuracy > 0.9
    score, coverage = ref.classifier.score(images)
    assert score > 8.0 and coverage == 10


def test_constant_images_score_about_one(reference):
    images, ref = reference
    score, coverage = ref.classifier.score(np.repeat(images[:1], 500, axis=0))
    assert score == pytest.approx(1.0, abs=1e-6) and coverage == 1
    score, _ = ref.classifier.score(np.full((500, 16, 16), 0.3, np.float32))
    assert score == pytest.approx(1.0, abs=1e-6)


def test_inception_score_by_hand():
    assert metrics.inception_score(np.eye(10)) == pytest.approx(10.0)
    assert metrics.inception_score(np.full((7, 10), 0.1)) == pytest.approx(1.0)
    two = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    # KL(one-hot || (1/4, 3/4)) is log 4 for the first row, log 4/3 for the rest.
    expected = np.exp((np.log(4.0) + 3 * np.log(4.0 / 3.0)) / 4)
    assert metrics.inception_score(two) == pytest.approx(expected)
    probs = np.zeros((200, 10))
    probs[:, 0] = 1.0
    probs[:3, 0], probs[:3, 1] = 0.0, 1.0  # 1.5% of the rows: covered
    probs[3:4, 0], probs[3:4, 2] = 0.0, 1.0  # 0.5%: not covered
    assert metrics.class_coverage(probs) == 2


# ---------------------------------------------------------------------------
# Bad input: non-zero exit, one line on stderr, no checkpoint written.
# ---------------------------------------------------------------------------

def _bad_cases(tmp):
    blocker = tmp / "a_file"
    blocker.write_text("not a directory")
    no_x = tmp / "no_x.npz"
    np.savez(str(no_x), y_train=np.arange(3))
    flat = tmp / "flat.npz"
    np.savez(str(flat), x_train=np.zeros((5, 784)))
    out = str(tmp / "out")
    return {
        "precision": (["--precision", "fp8", "--out", out], out),
        "backend": (["--backend", "gpu", "--out", out], out),
        "device": (["--device", "tpu", "--out", out], out),
        "loss_scale": (["--loss-scale", "fixed:0.5", "--out", out], out),
        "loss_scale_kind": (["--loss-scale", "static", "--out", out], out),
        "steps_zero": (["--steps", "0", "--out", out], out),
        "steps_negative": (["--steps", "-5", "--out", out], out),
        "unwritable_out": (["--out", str(blocker / "out")], str(blocker / "out")),
        "resume_without_checkpoint": (["--resume", "--out", out], out),
        "npu_without_npu_bridge": (["--device", "npu", "--out", out], out),
        "backend_npu_without_npu_bridge": (["--backend", "npu", "--out", out], out),
        "missing_data": (["--data", str(tmp / "missing.npz"), "--out", out], out),
        "data_without_x_train": (["--data", str(no_x), "--out", out], out),
        "data_wrong_shape": (["--data", str(flat), "--out", out], out),
    }


BAD_CASES = [
    "precision", "backend", "device", "loss_scale", "loss_scale_kind", "steps_zero",
    "steps_negative", "unwritable_out", "resume_without_checkpoint",
    "npu_without_npu_bridge", "backend_npu_without_npu_bridge", "missing_data",
    "data_without_x_train", "data_wrong_shape"]


def _assert_clean_failure(proc, prog, out):
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("%s: error: " % prog), lines[0]
    if os.path.isdir(out):
        assert os.listdir(out) == [], os.listdir(out)


NPU_CASES = ("npu_without_npu_bridge", "backend_npu_without_npu_bridge")


def _npu_bridge_installed():
    proc = subprocess.run([sys.executable, "-c",
                           "import importlib.util, sys; "
                           "sys.exit(importlib.util.find_spec('npu_bridge') is None)"],
                          env=_env())
    return proc.returncode == 0


@pytest.mark.parametrize("case", BAD_CASES)
def test_dcgan_bad_input(tmp_path, case):
    if case in NPU_CASES and _npu_bridge_installed():
        pytest.skip("a real npu_bridge is installed here, so --device/--backend npu is valid")
    args, out = _bad_cases(tmp_path)[case]
    if case == "resume_without_checkpoint":
        os.makedirs(out)
    proc = run(DCGAN, *args)
    _assert_clean_failure(proc, "dcgan.py", out)


@pytest.mark.parametrize("case", ["precision", "steps_zero", "unwritable_out",
                                  "npu_without_npu_bridge", "missing_data"])
def test_encoder_gan_bad_input(tmp_path, case):
    if case in NPU_CASES and _npu_bridge_installed():
        pytest.skip("a real npu_bridge is installed here, so --device/--backend npu is valid")
    args, out = _bad_cases(tmp_path)[case]
    proc = run(ENCODER_GAN, *args)
    _assert_clean_failure(proc, "encoder_gan.py", out)


def test_dcgan_distributed_without_horovod(tmp_path):
    """--distributed horovod where Horovod is missing: one clean error line.
    (The two-rank run itself is in test_distributed.py, on TF 2.15.1.)"""
    proc = subprocess.run([sys.executable, "-c",
                           "import importlib.util, sys; "
                           "sys.exit(importlib.util.find_spec('horovod') is None)"], env=_env())
    if proc.returncode == 0:
        pytest.skip("Horovod is installed here; test_distributed.py runs the example")
    out = str(tmp_path / "out")
    proc = run(DCGAN, "--distributed", "horovod", "--out", out)
    _assert_clean_failure(proc, "dcgan.py", out)
    assert "--distributed horovod needs Horovod" in proc.stderr


# ---------------------------------------------------------------------------
# Out-of-range flags: argparse errors (exit 2) naming the flag, the value and
# the valid range, checked in-process (parsing only, no training).
# ---------------------------------------------------------------------------

PORTING = os.path.join(REPO, "examples", "porting", "dcgan_alternating.py")


def _porting_example():
    import importlib.util  # pylint: disable=import-outside-toplevel
    spec = importlib.util.spec_from_file_location("porting_example_cli", PORTING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exit_lines(call, capsys):
    """Runs ``call``, which must exit with status 2; returns stderr's lines."""
    with pytest.raises(SystemExit) as exited:
        call()
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv,expected", [
    # Silently ignored before: iteration 0 and 11 of a 10-iteration run never come.
    (["--steps", "10", "--inject-overflow-at", "11"],
     "argument --inject-overflow-at: must be in [1, 10] (an iteration of this run: "
     "1 to --steps), got 11"),
    (["--inject-overflow-at", "-1"], "argument --inject-overflow-at: must be in [1, 300]"),
    (["--inject-overflow-at", "0"], "argument --inject-overflow-at: must be in [1, 300]"),
    # NaN losses and exit status 0 before.
    (["--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
    # IndexError (no log row) before.
    (["--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    # ZeroDivisionError (iteration % 0) before.
    (["--save-every", "0"], "argument --save-every: must be an integer >= 1, got 0"),
    (["--log-every", "-2"], "argument --log-every: must be an integer >= 1, got -2"),
    # numpy's RandomState refuses it after the graph is built.
    (["--seed", "-1"], "argument --seed: must be in [0, 4294967295], got -1"),
    (["--loss-scale", "0"], "argument --loss-scale: must be in [1.0, "),
    (["--loss-scale", "nan"], "got nan"),
])
def test_porting_example_out_of_range_flags(argv, expected, capsys, tmp_path):
    module = _porting_example()
    message = _exit_lines(lambda: module.parse_args(argv), capsys)[-1]
    assert expected in message, message
    # main() refuses before it makes --out or builds anything.
    out = tmp_path / "out"
    _exit_lines(lambda: module.main(argv + ["--out", str(out)]), capsys)
    assert not out.exists()


def test_porting_example_accepts_the_range_ends():
    module = _porting_example()
    for inject in ("1", "10"):
        args = module.parse_args(["--steps", "10", "--inject-overflow-at", inject])
        assert args.inject_overflow_at == int(inject) and args.steps == 10
    args = module.parse_args(["--steps", "1", "--batch-size", "1", "--save-every", "1",
                              "--seed", str(2 ** 32 - 1), "--loss-scale", "1"])
    assert (args.steps, args.batch_size, args.seed) == (1, 1, 2 ** 32 - 1)


@pytest.mark.parametrize("parse,argv,expected", [
    # Accepted before, then a traceback after TF start-up (numpy's RandomState,
    # the loss-scale manager) or an inf learning rate in float32.
    ("dcgan", ["--seed", "-1"], "argument --seed: must be in [0, 2147483647], got -1"),
    ("dcgan", ["--seed", str(2 ** 32 - 1)], "argument --seed: must be in [0, 2147483647]"),
    ("dcgan", ["--loss-scale", "fixed:1e39"],
     "argument --loss-scale: fixed:N needs a number N in [1, 2**126]"),
    ("dcgan", ["--loss-scale", "fixed:1e38"],  # float32, but its inverse is subnormal
     "argument --loss-scale: fixed:N needs a number N in [1, 2**126]"),
    ("dcgan", ["--learning-rate", "1e39"],
     "argument --learning-rate: must be in (0, 3.40282e+38], got 1e+39"),
    ("encoder_gan", ["--adversarial-weight", "1e39"],
     "argument --adversarial-weight: must be in [0, 3.40282e+38], got 1e+39"),
    ("encoder_gan", ["--seed", "-3"], "argument --seed: must be in [0, 2147483647], got -3"),
    # Already refused; the shared validator keeps the message.
    ("dcgan", ["--eval-samples", "0"], "argument --eval-samples: must be >= 1, got 0"),
    ("dcgan", ["--learning-rate", "0"], "argument --learning-rate: must be in (0, "),
])
def test_gan_cli_out_of_range_flags(parse, argv, expected, capsys):
    import cli  # examples/gan/cli.py  pylint: disable=import-outside-toplevel
    parser = getattr(cli, "parse_%s_args" % parse)
    prog = parse + ".py"
    lines = _exit_lines(lambda: parser(prog, "doc", argv), capsys)
    assert len(lines) == 1, lines  # cli.py's one-line errors
    assert lines[0].startswith("%s: error: " % prog) and expected in lines[0], lines


def test_gan_cli_loss_scale_specs():
    import cli  # pylint: disable=import-outside-toplevel
    assert cli.loss_scale_spec("listening") == ("listening", None)
    assert cli.loss_scale_spec("listening:1") == ("listening", 1.0)
    assert cli.loss_scale_spec("dynamic:1024") == ("dynamic", 1024.0)
    assert cli.describe_loss_scale(("listening", 1.0)) == "listening:1"
    assert cli.describe_loss_scale(("dynamic", None)) == "dynamic"
    for text, message in (("dynamic:0.5", "dynamic:N needs a number N in [1, 2**126]"),
                          ("listening:x", "listening:N needs a number N in [1, 2**126]"),
                          ("static", "expected dynamic, listening, exponential or fixed:N")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            cli.loss_scale_spec(text)


def test_gan_cli_accepts_the_range_ends():
    import cli  # pylint: disable=import-outside-toplevel
    args = cli.parse_dcgan_args("dcgan.py", "doc", [
        "--seed", str(cli.SEED_MAX), "--loss-scale", "fixed:1", "--steps", "1"])
    assert args.seed == 2 ** 31 - 1 and args.loss_scale == ("fixed", 1.0)
    args = cli.parse_encoder_gan_args("encoder_gan.py", "doc",
                                      ["--seed", "0", "--adversarial-weight", "0"])
    assert args.seed == 0 and args.adversarial_weight == 0.0
