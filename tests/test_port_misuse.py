"""The port command misused as users misuse it (issue 44, 13 and 14 and the
port's refused and confusing cases): what each gets. docs/port.md, "What
each misuse gets", says the same.

No TensorFlow: the command's paths, encodings and refusals are source work.
"""

import os
import sys

import pytest

from npu_lossscale.port import REPORT_SUFFIX, main, port
from npu_lossscale.tools.port._report import (BY_HAND, CHANGED, LEFT_ALONE, AuditedRun, CheckResult,
                                        Report)
from npu_lossscale.tools.port._rewrite import port_source

TWO = ("import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n\n"
       "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8))\n"
       "g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8))\n"
       "d_train = d_opt.minimize(d_loss, var_list=d_vars)\n"
       "g_train = g_opt.minimize(g_loss, var_list=g_vars)\n"
       "sess.run([d_train, g_train])\n")


def _script(folder, name="train.py", text=TWO):
    path = folder / name
    path.write_text(text)
    return path


def test_an_output_hard_linked_to_the_input_is_refused(tmp_path, capsys):
    script = _script(tmp_path)
    link = tmp_path / "linked.py"
    os.link(str(script), str(link))
    assert main([str(script), "-o", str(link)]) == 2
    assert "would overwrite the input file" in capsys.readouterr().err
    assert script.read_text() == TWO


def test_a_hard_link_inside_a_folders_output_is_refused_before_anything_is_written(tmp_path,
                                                                                   capsys):
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    _script(source, "a.py")
    script = _script(source, "b.py")
    os.link(str(script), str(out / "b.py"))
    assert main([str(source), "-o", str(out)]) == 2
    assert "would overwrite the input file" in capsys.readouterr().err
    assert script.read_text() == TWO and not (out / "a.py").exists()


def test_an_input_named_as_the_report_would_be_is_refused(tmp_path, capsys):
    """OUTPUT + REPORT_SUFFIX is INPUT: the report would overwrite it."""
    script = _script(tmp_path, "train.py" + REPORT_SUFFIX)
    assert main([str(script), "-o", str(tmp_path / "train.py")]) == 2
    assert "would overwrite the input file" in capsys.readouterr().err
    assert script.read_text() == TWO and not (tmp_path / "train.py").exists()


def test_a_latin1_script_with_its_coding_line_is_ported_and_written_back_in_latin1(tmp_path):
    text = "# -*- coding: latin-1 -*-\n# Modèle de l'équipe\n" + TWO
    script = tmp_path / "train.py"
    script.write_bytes(text.encode("latin-1"))
    out = tmp_path / "out.py"
    report = port(str(script), str(out))
    assert "builder" in [e.rule for e in report.entries if e.kind == CHANGED]
    written = out.read_bytes()
    assert b"# Mod\xe8le de l'\xe9quipe\n" in written  # latin-1 bytes, as it came
    assert "nl.MultiOptimizerLossScale" in written.decode("latin-1")
    with pytest.raises(UnicodeDecodeError):
        written.decode("utf-8")


def test_bytes_that_are_not_text_in_the_declared_encoding_are_copied(tmp_path):
    script = tmp_path / "train.py"
    raw = b"# -*- coding: utf-8 -*-\nx = '\xe8'\n"
    script.write_bytes(raw)
    report = port(str(script), str(tmp_path / "out.py"))
    assert [(e.rule, e.kind) for e in report.entries] == [("unparsable", BY_HAND)]
    assert (tmp_path / "out.py").read_bytes() == raw


@pytest.mark.parametrize("line", ["import npu_lossscale.audit\n",
                                  "from npu_lossscale import audit\n",
                                  "from npu_lossscale.audit import audit\n"])
def test_a_script_that_imports_only_the_audit_is_not_already_ported(line):
    new, entries = port_source(line + TWO, "t.py")
    rules = [e.rule for e in entries]
    assert "already-ported-mixed" not in rules and "already-ported" not in rules
    assert "builder" in rules and "nl.MultiOptimizerLossScale" in new


def test_a_script_that_imports_the_library_is_still_already_ported():
    for line in ("import npu_lossscale as nl\n", "from npu_lossscale import audit, "
                 "MultiOptimizerLossScale\n", "from npu_lossscale.builder import build\n"):
        new, entries = port_source(line + TWO, "t.py")
        assert new == line + TWO
        assert [e.rule for e in entries if e.kind == BY_HAND] == ["already-ported-mixed"] * 2


def test_an_unwritable_output_is_one_line_and_exit_2(tmp_path, capsys):
    """Exit 1 is a failed --check's: an OUTPUT that cannot be written (here
    under a file, which no user can write into) is a usage error."""
    script = _script(tmp_path)
    (tmp_path / "a_file").write_text("")
    for output in (tmp_path / "a_file" / "out.py", tmp_path / "a_file" / "sub" / "out.py"):
        assert main([str(script), "-o", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("npu_lossscale.port: cannot write ") and err.count("\n") == 1
        assert "Traceback" not in err and "Pass an output you can write." in err


@pytest.mark.parametrize("body", [
    "class Model(object):\n"
    "    def __init__(self, loss, var_list):\n"
    "        self.opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), "
    "FixedLossScaleManager(8))\n"
    "        self.train = self.opt.minimize(loss, var_list=var_list)\n\n"
    "model = Model(loss, var_list)\nsess.run(model.train)\n",
    "opts = {}\nopts['d'] = NPULossScaleOptimizer(tf.train.AdamOptimizer(), "
    "FixedLossScaleManager(8))\ntrain = opts['d'].minimize(loss)\nsess.run(train)\n"])
def test_a_wrapper_built_in_a_class_or_kept_in_an_object_is_refused(body):
    """It was the drop-in, its minimize listed as having no loss scaling."""
    source = "import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n\n" + body
    new, entries = port_source(source, "t.py")
    assert new == source
    [entry] = [e for e in entries if e.kind == BY_HAND]
    assert entry.rule == "wrapper-on-object" and "nl.LossScaleOptimizer" in entry.message
    assert ("class Model" in body) == ("method __init__() of class Model" in entry.message)
    assert "unscaled-beside" not in [e.rule for e in entries if e.kind == LEFT_ALONE]


def test_wrappers_in_a_method_minimized_there_are_followed():
    """The guard refuses what the tool cannot follow, not every class: a
    method that builds its wrappers as local names and minimizes them there
    (a GAN class's build_model) is ported."""
    body = "".join("        " + line for line in TWO.splitlines(True)[3:7])
    source = ("import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n\n"
              "class GAN(object):\n    def train(self, sess, d_loss, g_loss, d_vars, g_vars):\n"
              + body + "        sess.run([d_train, g_train])\n")
    new, entries = port_source(source, "t.py")
    assert "wrapper-on-object" not in [e.rule for e in entries]
    assert "        scaler = nl.MultiOptimizerLossScale(" in new


def test_a_failed_checks_report_shows_the_exception_message(tmp_path):
    """A TF error's message comes before the stack traces of its ops, which
    filled the report's tail: the exception's lines come first."""
    from npu_lossscale.tools.port import _check  # pylint: disable=import-outside-toplevel
    script = tmp_path / "train.py"
    frames = "".join('    File "x.py", line %d, in f\\n' % n for n in range(40))
    script.write_text(
        "import sys\n"
        "sys.stderr.write('Traceback (most recent call last):\\n%s"
        "tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution "
        "error:\\n\\nDetected at node z:\\n%sNode: z\\nYou must feed a value for placeholder "
        "tensor z\\n\\nOriginal stack trace for z:\\n%s')\n"
        "sys.exit(1)\n" % (frames, frames, frames))
    result = _check.run_check("%s train.py" % sys.executable, str(script), 60)
    assert result.returncode == 1
    lines = result.output_tail.splitlines()
    assert lines[0].startswith("tensorflow.python.framework.errors_impl.InvalidArgumentError")
    assert "You must feed a value for placeholder tensor z" in lines
    assert lines[-1] == '    File "x.py", line 39, in f'  # and the output's last lines


@pytest.mark.parametrize("head,after", [
    ("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
     "import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n",
     "from npu_bridge.npu_init import *\n"),
    ("import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\nimport matplotlib\n"
     "matplotlib.use('Agg')\n", "matplotlib.use('Agg')\n")])
def test_the_added_import_does_not_split_matplotlib_from_its_use(head, after):
    source = head + "\n" + TWO.split("\n\n", 1)[1]
    new, _ = port_source(source, "t.py")
    assert after + "import npu_lossscale as nl\n" in new


def test_a_star_import_inside_try_is_recognised():
    source = TWO.replace("from npu_bridge.npu_init import *\n",
                         "try:\n    from npu_bridge.npu_init import *\nexcept ImportError:\n"
                         "    pass\n")
    new, entries = port_source(source, "t.py")
    assert "nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8))" in new
    assert ("npu-init-import", 3) in [(e.rule, e.line) for e in entries if e.kind == LEFT_ALONE]


def test_the_checks_report_says_whether_a_skip_is_atomic():
    report = Report()
    report.check = CheckResult("python t.py", 0, [
        AuditedRun(["u"], [("NLS011-double-scale-update", "info", "m")]),
        AuditedRun(["v"], [("NLS005-ungated-update", "error", "bn")])], "")
    text = report.format()
    assert "    skips: atomic as far as the audit sees (no NLS001/NLS005/NLS008/NLS009" in text
    assert "    skips: NOT atomic (NLS005): a skipped run still changes state" in text
