"""The README is the entry point: its quick start runs as written, it stays
short, its API summary names the public API, its figures are the measured
ones, and its two commands are the Makefile's. (tests/test_docs.py runs its
other blocks and checks its links.)"""

import os
import re

import npu_lossscale as nl
from conftest import REPO
from readme_blocks import page_blocks, run_example

#: issue 31: the README is an entry point, not the manual.
MAX_LINES = 400


def _read(path):
    with open(os.path.join(REPO, path)) as handle:
        return handle.read()


def _section(text, heading):
    start = text.index("\n" + heading + "\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_quickstart_runs_as_written(tmp_path):
    stdout, _ = run_example("quickstart", tmp_path)
    match = re.search(r"global step (\d+) skipped (\d+) loss scale ([\d.]+)", stdout)
    assert match, stdout
    step, skipped = int(match.group(1)), int(match.group(2))
    assert step + skipped == 20


def test_readme_is_at_most_400_lines():
    assert _read("README.md").count("\n") <= MAX_LINES


def test_api_summary_names_every_public_name_once_with_its_page():
    table = _section(_read("README.md"), "## API")
    rows = [line for line in table.splitlines() if line.startswith("| [`")]
    names = [re.match(r"\| \[`(\w+)`\]\((docs/\w+\.md)(#[\w-]+)?\)", row) for row in rows]
    assert all(names), [row for row, name in zip(rows, names) if not name]
    assert sorted(name.group(1) for name in names) == sorted(nl.__all__)


def test_dated_figures_only_in_the_current_figures_table():
    # Dated measurement histories live in docs/benchmarks.md; the README has
    # one table of current figures, each with its date.
    text = _read("README.md")
    figures = _section(text, "## Current figures")
    dated = [line for line in text.splitlines() if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    rows = [line for line in figures.splitlines() if line.startswith("| [")]
    assert rows and dated == rows
    for row in rows:
        assert "](docs/benchmarks.md#" in row, row


def _warm(text):
    found = set(re.findall(r"(\d+ min \d+ s)\*?\*? warm", text))
    assert len(found) == 1, found
    return found.pop()


def test_the_two_commands_are_the_makefiles_with_its_measured_time():
    readme = _read("README.md")
    commands = _section(readme, "## The two commands")
    shown = [b for b in page_blocks("README.md") if "make demo" in b.code]
    assert len(shown) == 1
    assert [line.split("#")[0].split() for line in shown[0].code.splitlines()] == [
        ["make", "demo"], ["make", "test"]]
    makefile = _read("Makefile")
    for target in ("demo", "test", "help"):
        assert re.search(r'^\t@echo "make %s ' % target, makefile, re.M), target
        assert re.search(r"^%s:" % target, makefile, re.M), target
    assert "```bash\nmake help\n```" in commands
    # One warm time: the Makefile's comment, the README's line and its
    # figures table, and docs/benchmarks.md say the same.
    warm = _warm(re.search(r"# Measured on .*?warm", makefile, re.S).group(0))
    assert _warm(commands) == warm
    figures = _section(readme, "## Current figures")
    assert "| %s (" % warm in figures
    assert _warm(_section(_read("docs/benchmarks.md"), "## The two commands, measured")) == warm


def test_porting_starts_with_the_port_command_and_links_the_rules():
    porting = _section(_read("README.md"), "## Porting a TF1 script")
    body = porting.split("\n", 2)[2].lstrip()
    assert body.startswith("`python -m npu_lossscale.port INPUT -o OUTPUT`")
    assert "read the report, and do by hand what it lists" in porting
    assert "](docs/porting.md)" in porting and "](docs/port.md)" in porting
