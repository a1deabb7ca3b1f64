"""The code blocks of README.md and docs/*.md, and how the tests run them.

HTML comments right before a fenced block (blank lines between are allowed)
say how it is tested:

* ``<!-- NAME -->``: a test file runs it by its name, with ``block("NAME")``
  or ``run_example("NAME", ...)`` and its own checks. A ``text`` block marked
  ``<!-- NAME-output -->`` shows what the block prints; ``run_example``
  returns it for the test to compare.
* ``<!-- setup: SETUP -->``: a fragment. tests/test_docs.py runs it after the
  set-up SETUP of tests/docs_setups.py (the model, feeds and session the
  fragment takes as given), then that set-up's checks.
* ``<!-- not run: REASON -->``: not run by the tests; REASON says why (Ascend
  hardware, a launcher, a cluster, minutes of training, a placeholder path).
* none: tests/test_docs.py runs it as it is, a complete program.

Python blocks and shell blocks (``bash``, ``sh``, ``console``) are code;
every other fence names what it holds (``text``, ``diff``, ``json``) and is
not run. Shell blocks run with ``bash -e`` from the repository root, where
their commands are typed: leave one unmarked only when it is quick and
writes nothing there.
"""

import collections
import glob
import json
import os
import re
import subprocess
import sys

from conftest import REPO, SHIMS
import warm_python

PYTHON = "python"
SHELL = ("bash", "sh", "console")
CODE = (PYTHON,) + SHELL

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>\S*)\s*$")
_COMMENT = re.compile(r"^\s*<!--\s*(?P<text>.*?)\s*-->\s*$")


def pages():
    """README.md and docs/*.md, as paths relative to the repository."""
    found = sorted(os.path.relpath(path, REPO)
                   for path in glob.glob(os.path.join(REPO, "docs", "*.md")))
    return ["README.md"] + [path.replace(os.sep, "/") for path in found]


class Block(collections.namedtuple("Block", ["page", "line", "ordinal", "language",
                                             "code", "comments"])):
    """One fenced block: where it is, its language, its text (dedented to
    its fence) and the HTML comments right before it.

    Attributes:
      page: the page, relative to the repository (``docs/features.md``).
      line: the 1-based line of the opening fence.
      ordinal: its number among the page's blocks, from 1.
      language: the fence's language, or "" when it names none.
      code: the block's text.
      comments: the texts of the comments before it, in order.
    """

    @property
    def id(self):
        """A readable test id: the page and the block's ordinal."""
        return "%s#%d" % (self.page, self.ordinal)

    def _marker(self, prefix):
        values = [c[len(prefix):].strip() for c in self.comments if c.startswith(prefix)]
        assert len(values) <= 1, "%s: two %r markers" % (self.id, prefix)
        return values[0] if values else None

    @property
    def not_run(self):
        """The reason of a ``not run:`` marker, or None."""
        return self._marker("not run:")

    @property
    def setup(self):
        """The set-up named by a ``setup:`` marker, or None."""
        return self._marker("setup:")

    @property
    def name(self):
        """The block's name (a comment that is no marker), or None."""
        names = [c for c in self.comments
                 if not c.startswith(("not run:", "setup:")) and re.match(r"^[\w:. -]+$", c)]
        assert len(names) <= 1, "%s has two names: %r" % (self.id, names)
        return names[0] if names else None

    @property
    def is_code(self):
        return self.language in CODE


def page_blocks(page):
    """The fenced blocks of one page, in order."""
    with open(os.path.join(REPO, page)) as handle:
        lines = handle.read().split("\n")
    found, index = [], 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        indent = len(fence.group("indent"))
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        assert end < len(lines), "%s:%d: a block that never closes" % (page, index + 1)
        code = "".join(line[indent:] + "\n" for line in lines[index + 1:end])
        comments, above = [], index - 1
        while above >= 0 and (not lines[above].strip() or _COMMENT.match(lines[above])):
            if lines[above].strip():
                comments.insert(0, _COMMENT.match(lines[above]).group("text"))
            above -= 1
        found.append(Block(page, index + 1, len(found) + 1, fence.group("language"), code,
                           tuple(comments)))
        index = end + 1
    return found


def blocks():
    """Every fenced block of README.md and docs/*.md."""
    return [found for page in pages() for found in page_blocks(page)]


def block(name, language=PYTHON):
    """The text of the block named ``name`` (on whichever page), or None."""
    named = [b for b in blocks() if b.name == name and b.language == language]
    assert len(named) <= 1, "two blocks named %r: %s" % (name, [b.id for b in named])
    return named[0].code if named else None


def run_example(name, tmp_path, timeout=300):
    """Runs the block ``name`` as written, in a fresh interpreter.

    Returns:
      ``(stdout, shown)``: what it printed, and the ``name-output`` text
      block that shows its output (None when the docs show none).
    """
    code = block(name)
    assert code, "the docs lost their %r block" % name
    script = tmp_path / ("%s.py" % re.sub(r"\W", "_", name))
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    out = warm_python.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, block(name + "-output", "text")


Result = collections.namedtuple("Result", ["ok", "stdout", "error"])


def _start_python(jobs, folder, shim):
    """Starts tests/docs_runner.py on ``jobs`` in one interpreter."""
    jobs_path, results_path = folder / "jobs.json", folder / "results.json"
    jobs_path.write_text(json.dumps(jobs))
    path = [SHIMS, REPO] if shim else [REPO]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), TF_CPP_MIN_LOG_LEVEL="3")
    runner = os.path.join(REPO, "tests", "docs_runner.py")
    process = warm_python.Popen([sys.executable, runner, str(jobs_path), str(results_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                               cwd=str(folder), universal_newlines=True)
    return process, results_path


def run_blocks(to_run, setups, tmp_path, timeout=600):
    """Runs blocks: the Python ones after their set-ups, in two interpreters
    (one with the npu_bridge shim on the path, one without) that run at the
    same time, each block in a fresh graph and its own folder under
    ``tmp_path``; the shell ones with ``bash -e`` from the repository root.

    Args:
      to_run: the ``Block``s.
      setups: set-up name -> ``docs_setups.Setup``.

    Returns:
      dict from block id to ``Result``.
    """
    groups = {False: [], True: []}
    results = {}
    for found in to_run:
        if found.language != PYTHON:
            continue
        setup = setups[found.setup] if found.setup else None
        groups[bool(setup and setup.shim)].append({
            "id": found.id, "code": found.code,
            "setup": setup.code if setup else "", "after": setup.after if setup else "",
            "cwd": str(tmp_path / re.sub(r"\W", "_", found.id))})
    started = []
    for shim, jobs in sorted(groups.items()):
        if jobs:
            folder = tmp_path / ("runner_shim" if shim else "runner")
            folder.mkdir()
            started.append(_start_python(jobs, folder, shim))
    for found in to_run:
        if found.language in SHELL:
            proc = subprocess.run(["bash", "-e", "-c", found.code], cwd=REPO, timeout=timeout,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  universal_newlines=True)
            results[found.id] = Result(proc.returncode == 0, proc.stdout,
                                       "exit status %d" % proc.returncode)
    for process, results_path in started:
        output, _ = process.communicate(timeout=timeout)
        assert process.returncode == 0, output[-3000:]
        for key, value in json.loads(results_path.read_text()).items():
            results[key] = Result(value["ok"], value["stdout"], value.get("error"))
    return results
