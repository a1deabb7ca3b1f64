"""Python 3.7 compatibility of everything under npu_lossscale/, shims/, examples/.

Users run TF 1.15 on Python 3.7; tests run on 3.11.  Two independent checks:

1. ``vermin`` (pinned in requirements/tf221.txt) with::

       vermin --no-config-file -t=3.7- --no-tips --violations \
              --format parsable --no-make-paths-absolute -p=1 [--eval-annotations --feature union-types] FILES

   ``-t=3.7-`` means "must run on 3.7 (or older 3.x)"; ``--violations`` makes
   vermin exit 1 and print only the offending constructs (walrus, ``def f(a,
   /)``, ``f"{x=}"``, ``"s".removeprefix``, ``functools.cache``,
   ``typing.Literal``...).  Files *without* ``from __future__ import
   annotations`` are also checked with ``--eval-annotations --feature
   union-types``, because 3.7 evaluates their annotations at definition time
   (``def f(x: list[int])`` or ``int | None`` raise TypeError on import);
   files with the future import keep lazy string annotations, so those flags
   would be false positives there.  ``# novm`` comments are honoured (vermin's
   own escape hatch, for code behind a ``sys.version_info`` check).
   vermin runs in a subprocess via ``python -c`` (the package has no
   ``__main__``), so its multiprocessing stays out of the pytest process.

2. A pure-``ast`` fallback, no third-party code: ``ast.parse(src,
   feature_version=(3, 7))`` rejects 3.8+ *grammar* (walrus, positional-only
   parameters, ``f"{x=}"``, parenthesised context managers, ``match``), plus a
   small heuristic for 3.9+ str methods vermin cannot see on receivers of
   unknown type (``x.removeprefix(...)``, ``x.removesuffix(...)``).
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
SCANNED_DIRS = ("npu_lossscale", "shims", "examples")

VERMIN_PIN = "vermin==1.9.2"
VERMIN_BASE_ARGS = [
    "--no-config-file",
    "-t=3.7-",
    "--no-tips",
    "--violations",
    "--format",
    "parsable",
    "--no-make-paths-absolute",
    "-p=1",  # a few dozen files: a process pool costs more than it saves
]
VERMIN_EVAL_ARGS = ["--eval-annotations", "--feature", "union-types"]
_VERMIN_CMD = [sys.executable, "-c", "import sys; from vermin.main import main; sys.argv[0] = 'vermin'; sys.exit(main())"]

# Methods added in 3.8+ whose names are distinctive enough to flag on any receiver.
NEW_METHODS = {"removeprefix": "3.9 (str/bytes)", "removesuffix": "3.9 (str/bytes)"}


def scanned_files() -> list:
    out = []
    for d in SCANNED_DIRS:
        root = REPO_ROOT / d
        if not root.is_dir():
            continue
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(REPO_ROOT)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            out.append(p)
    return out


def read_source(path: Path) -> str:
    data = path.read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


def has_future_annotations(src: str) -> bool:
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            if any(a.name == "annotations" for a in node.names):
                return True
    return False


# --------------------------------------------------------------------------
# vermin
# --------------------------------------------------------------------------


def _require_vermin():
    try:
        import vermin  # noqa: F401
    except ImportError:
        pytest.fail(f"vermin is not installed: pip install {VERMIN_PIN} (see requirements/tf221.txt)",
                    pytrace=False)


def run_vermin(files: list, cwd: Path) -> list:
    """Violations as 'path:line: requires 3.x: what' strings (empty list = all 3.7-compatible)."""
    _require_vermin()
    lazy, evaluated = [], []
    for f in files:
        (lazy if has_future_annotations(read_source(cwd / f)) else evaluated).append(str(f))
    problems = []
    for group, extra in ((lazy, []), (evaluated, VERMIN_EVAL_ARGS)):
        if not group:
            continue
        proc = subprocess.run(
            _VERMIN_CMD + VERMIN_BASE_ARGS + extra + ["--"] + group,
            cwd=cwd, capture_output=True, text=True, timeout=120,
        )
        found = []
        for line in proc.stdout.splitlines():
            # parsable: file:line:col:py2:py3:feature  (summary lines have no line number)
            parts = line.split(":", 5)
            if len(parts) == 6 and parts[0] and parts[1]:
                found.append(f"{parts[0]}:{parts[1]}: requires {parts[4]}: {parts[5]}")
        if proc.returncode != 0 and not found:
            found.append(f"vermin exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        problems.extend(found)
    return problems


def test_repo_is_python37_compatible_vermin():
    files = [p.relative_to(REPO_ROOT) for p in scanned_files()]
    if not files:
        return
    problems = run_vermin(files, REPO_ROOT)
    assert not problems, "code not compatible with Python 3.7 (vermin):\n" + "\n".join(problems)


SNIPPETS = {
    "walrus.py": "if (n := 10) > 5:\n    pass\n",
    "posonly.py": "def f(a, /):\n    return a\n",
    "removeprefix.py": "s = 'npu_scale'\nt = s.removeprefix('npu_')\n",
    "selfdoc.py": "x = 1\nprint(f'{x=}')\n",
    "generic_ann.py": "def f(x: list[int]) -> dict[str, int]:\n    return {}\n",
    "union_ann.py": "def f(x: int | None = None):\n    return x\n",
    "ok37.py": (
        "from __future__ import annotations\n"
        "import dataclasses\n"
        "def f(x: list[int] | None = None, *args, **kw) -> dict[str, int]:\n"
        "    return {**kw}\n"
        "async def g():\n"
        "    yield [*range(3)]\n"
        "flags = 1 | 2\n"
    ),
    "ok37_plain.py": "from typing import Optional, List\ndef f(x: Optional[List[int]] = None):\n    return f'{x!r}'\n",
}


def test_vermin_check_bites(tmp_path):
    for name, src in SNIPPETS.items():
        (tmp_path / name).write_text(src, encoding="utf-8")
    problems = run_vermin([Path(n) for n in sorted(SNIPPETS)], tmp_path)
    flagged = {p.split(":", 1)[0] for p in problems}
    assert flagged == {"walrus.py", "posonly.py", "removeprefix.py", "selfdoc.py",
                       "generic_ann.py", "union_ann.py"}, problems
    assert any(p.startswith("walrus.py:1: requires 3.8") for p in problems), problems


# --------------------------------------------------------------------------
# pure-ast fallback
# --------------------------------------------------------------------------


def ast_problems(src: str, name: str) -> list:
    try:
        tree = ast.parse(src, filename=name, feature_version=(3, 7))
    except SyntaxError as e:
        return [f"{name}:{e.lineno}: {e.msg}"]
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in NEW_METHODS
        ):
            out.append(f"{name}:{node.lineno}: .{node.func.attr}() requires Python {NEW_METHODS[node.func.attr]}")
    return out


def test_repo_parses_as_python37_ast():
    problems = []
    for p in scanned_files():
        rel = p.relative_to(REPO_ROOT).as_posix()
        problems.extend(ast_problems(read_source(p), rel))
    assert not problems, "code not compatible with Python 3.7 (ast):\n" + "\n".join(problems)


def test_ast_fallback_bites():
    assert ast_problems(SNIPPETS["walrus.py"], "w.py") and "3.8" in ast_problems(SNIPPETS["walrus.py"], "w.py")[0]
    assert ast_problems(SNIPPETS["posonly.py"], "p.py")
    assert ast_problems(SNIPPETS["selfdoc.py"], "s.py")
    assert ast_problems("def f(name):\n    return name.removeprefix('x')\n", "r.py") == [
        "r.py:2: .removeprefix() requires Python 3.9 (str/bytes)"
    ]
    assert ast_problems(SNIPPETS["ok37.py"], "ok.py") == []
    assert ast_problems(SNIPPETS["ok37_plain.py"], "ok.py") == []
