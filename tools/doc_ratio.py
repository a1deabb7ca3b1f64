"""Docstring and comment lines per code line in the library (issue 31).

Counts every .py under npu_lossscale/ except audit/, port/ and tools/ (the
audit and the command-line tools):

- doc lines: every line inside a module, class or function docstring (blank
  ones included), plus every comment-only line;
- code lines: every other non-blank line.

Prints the worst files and the total, and exits 1 when the total ratio is
above the limit.

Usage: python tools/doc_ratio.py [LIMIT] [--root DIR] [--top N]
(LIMIT defaults to 0.9).
"""

import argparse
import ast
import io
import os
import sys
import tokenize

DEFAULT_LIMIT = 0.9
EXCLUDED = ("audit", "port", "tools")
_DOC_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _string_value(node):
    """The str a docstring expression holds, or None (3.7 parses ast.Str)."""
    value = getattr(node, "value", None)
    if isinstance(value, str):
        return value
    if type(node).__name__ == "Str":
        return node.s
    return None


def _docstring_lines(src):
    """The line numbers (1-based) that docstrings span."""
    tree = ast.parse(src)
    # Python 3.7's ast has no end_lineno, and gives a multi-line string the
    # line it ends on: the string tokens give each string's full span.
    spans = [(tok.start[0], tok.end[0])
             for tok in tokenize.generate_tokens(io.StringIO(src).readline)
             if tok.type == tokenize.STRING]
    lines = set()
    for node in ast.walk(tree):
        if not isinstance(node, _DOC_OWNERS) or not node.body:
            continue
        first = node.body[0]
        if not (isinstance(first, ast.Expr) and _string_value(first.value) is not None):
            continue
        end = getattr(first, "end_lineno", None)
        if end is not None:
            lines.update(range(first.lineno, end + 1))
            continue
        for start, stop in spans:
            if start <= first.value.lineno <= stop:
                lines.update(range(start, stop + 1))
                break
    return lines


def counts(path):
    """(code lines, doc lines) of one file."""
    with io.open(path, encoding="utf-8") as f:
        return count_source(f.read())


def count_source(src):
    """(code lines, doc lines) of Python source text."""
    doc = _docstring_lines(src)
    code = docs = 0
    for number, line in enumerate(src.splitlines(), 1):
        stripped = line.strip()
        if number in doc or stripped.startswith("#"):
            docs += 1
        elif stripped:
            code += 1
    return code, docs


def library_files(root):
    """Every .py under root, except those under audit/, port/ and tools/."""
    for dirpath, dirnames, names in os.walk(root):
        if os.path.relpath(dirpath, root) == ".":
            dirnames[:] = [d for d in dirnames if d not in EXCLUDED]
        dirnames.sort()
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def measure(root):
    """Returns (rows, code, doc): rows are (ratio, code, doc, path), worst first."""
    rows = []
    total_code = total_doc = 0
    for path in library_files(root):
        code, doc = counts(path)
        total_code += code
        total_doc += doc
        rows.append((doc / max(code, 1), code, doc, path))
    rows.sort(key=lambda row: (-row[0], row[3]))
    return rows, total_code, total_doc


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("limit", nargs="?", type=float, default=DEFAULT_LIMIT)
    parser.add_argument("--root", default=os.path.join(here, os.pardir, "npu_lossscale"))
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    rows, code, doc = measure(args.root)
    print("ratio  code   doc  file")
    for ratio, c, d, path in rows[:args.top]:
        print("%5.2f %5d %5d  %s" % (ratio, c, d, os.path.relpath(path, args.root)))
    ratio = doc / max(code, 1)
    print("TOTAL code %d doc %d ratio %.3f (limit %.2f)" % (code, doc, ratio, args.limit))
    return 1 if ratio > args.limit else 0


if __name__ == "__main__":
    sys.exit(main())
