"""docs/port.md, run: its shell and Python blocks, the report and the diff it
shows, and its tables against the rules the tool reports.

The shell block runs as written, with bash, in a scratch folder laid out as
the repository root is (``shims/``, ``tests/port_scripts/``, the package,
and a ``.venv/bin/python`` that is this interpreter), so the page's paths
and commands are the ones tested.
"""

import ast
import contextlib
import difflib
import io
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

DOC = os.path.join(REPO, "docs", "port.md")
PORT = os.path.join(REPO, "npu_lossscale", "tools", "port")


def _doc():
    with open(DOC) as handle:
        return handle.read()


def _block(name, language):
    found = re.search(r"<!-- %s -->\s*```%s\n(.*?)```" % (re.escape(name), language), _doc(),
                      re.S)
    assert found, "docs/port.md lost its %r block" % name
    return found.group(1)


def test_every_shell_and_python_block_is_run_here():
    blocks = re.findall(r"(<!-- ([\w-]+) -->\s*)?```(bash|sh|shell|python)\n", _doc())
    assert sorted(name for _, name, _ in blocks) == ["port-api", "port-run"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A scratch repository root; the run block has run in it."""
    root = tmp_path_factory.mktemp("root")
    (root / "tests").mkdir()
    (root / ".venv" / "bin").mkdir(parents=True)
    python = root / ".venv" / "bin" / "python"
    python.write_text('#!/bin/sh\nexec "%s" "$@"\n' % sys.executable)
    python.chmod(0o755)
    os.symlink(os.path.join(REPO, "shims"), str(root / "shims"))
    os.symlink(os.path.join(REPO, "npu_lossscale"), str(root / "npu_lossscale"))
    os.symlink(os.path.join(REPO, "tests", "port_scripts"), str(root / "tests" / "port_scripts"))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("PYTHONPATH", None)
    run = subprocess.run(["bash", "-c", _block("port-run", "bash")], cwd=str(root), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return root, run.stdout


def test_the_run_prints_the_report_the_page_shows(root):
    folder, printed = root
    shown = _block("port-report", "text").splitlines()
    lines = printed.splitlines()
    assert len(lines) == len(shown), "\n".join(difflib.unified_diff(shown, lines, lineterm=""))
    for want, got in zip(shown, lines):
        if want.endswith("..."):  # the page cuts the audit's long messages
            assert got.startswith(want[:-3]), (want, got)
        else:
            assert got == want
    written = folder / "ported" / "dcgan_npu_bridge.py.port_report.txt"
    assert written.read_text() == printed
    assert (folder / "runs" / "check" / "checkpoint").is_file()  # the check ran the script


def test_the_page_shows_the_diff_the_run_made(root):
    folder, _ = root
    with open(os.path.join(REPO, "tests", "port_scripts", "dcgan_npu_bridge.py")) as handle:
        source = handle.read().splitlines()
    target = (folder / "ported" / "dcgan_npu_bridge.py").read_text().splitlines()
    diff = list(difflib.unified_diff(source, target, lineterm="", n=0))[2:]
    assert diff == _block("port-diff", "diff").splitlines()


def test_the_api_block(root, monkeypatch):
    folder, _ = root
    monkeypatch.chdir(str(folder))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_block("port-api", "python"), "port-api", "exec"), {})  # pylint: disable=exec-used
    lines = printed.getvalue().splitlines()
    assert [line.split(" One optimizer")[0] for line in lines] == [
        "byhand_reused.py:17 [optimizer-reused]", "byhand_reused.py:18 [optimizer-reused]"]
    assert (folder / "ported" / "byhand_reused.py").read_text() == (
        folder / "tests" / "port_scripts" / "byhand_reused.py").read_text()


def _rules_in_code():
    """Every rule name the tool can report."""
    rules = set()
    for name in os.listdir(PORT):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(PORT, name)) as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            position = {"changed": 1, "left_alone": 1, "by_hand": 1, "refuse": 1, "add": 3,
                        "Entry": 3}.get(called)
            if position is not None and len(node.args) > position and isinstance(
                    node.args[position], ast.Constant) and isinstance(
                        node.args[position].value, str):
                rules.add(node.args[position].value)
    return rules


def test_the_tables_name_every_rule_and_no_other():
    rules = _rules_in_code()
    assert len(rules) > 40 and "optimizer-reused" in rules and "unparsable" in rules
    named = set(re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)*)`", _doc()))
    assert rules <= named, sorted(rules - named)
    # Hyphenated names in backticks are rules: none of them stale.
    assert not [n for n in named - rules if "-" in n], sorted(named - rules)


def test_each_row_of_the_refusal_table_is_one_function_of_the_rules():
    """docs/port.md's "What it leaves to you": each rule of a row is a
    function of ``_rules`` named after it (``unparsable``, a file the tool
    cannot read, is the rewrite's own), and ``_rules`` has no other."""
    from npu_lossscale.tools.port import _rules  # pylint: disable=import-outside-toplevel
    section = _doc().split("## What it leaves to you", 1)[1].split("\nFive items", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = [name for row in rows for name in re.findall(r"`([a-z-]+)`", row.split("|")[1])]
    assert len(named) > 25 and "unparsable" in named
    expected = [name.replace("-", "_") for name in named if name != "unparsable"]
    functions = [name for name, value in vars(_rules).items() if callable(value)
                 and getattr(value, "__module__", "") == _rules.__name__
                 and not name.startswith("_")]
    assert sorted(functions) == sorted(expected)


def test_the_sections_the_report_names_exist():
    """README sections (or, once the README moves into docs/, a page's)."""
    from npu_lossscale.tools.port import _sections  # pylint: disable=import-outside-toplevel
    texts = [_doc()]
    for folder in (REPO, os.path.join(REPO, "docs")):
        texts.extend(open(os.path.join(folder, n)).read()
                     for n in sorted(os.listdir(folder)) if n.endswith(".md"))
    headings = set(re.findall(r"^#+ (.*?)\s*$", "\n".join(texts), re.M))
    sections = [getattr(_sections, n) for n in dir(_sections) if n.startswith("SECTION_")]
    assert len(sections) >= 10
    for section in sections:
        title = re.search(r'"([^"]+)"', section).group(1)
        assert title in headings or "`%s`" % title in headings, section
