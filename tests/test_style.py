"""The library's docstring and comment lines per code line (issue 31).

``tools/doc_ratio.py`` counts, for every module of npu_lossscale/ outside
audit/ and port/, doc lines (every line of a module, class or function
docstring, blank ones included, and every comment-only line) and code lines
(every other non-blank line). The total stays at or below 0.9, the range of
jmp, optax and TF-GAN.
"""
import ast
import os
import sys

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "tools"))
import doc_ratio  # noqa: E402  pylint: disable=wrong-import-position

_SAMPLE = '''"""Module docstring,

over three lines."""

import os  # an inline comment: a code line

# A comment-only line.


class Thing(object):
    """One line."""

    def method(self):
        """Two lines,

        with a blank one between."""
        text = """not a docstring,
        a code string"""
        return text


def bare():
    return os.sep
'''


def test_the_counting_rule_on_a_sample_counted_by_hand():
    # doc: 3 (module) + 1 (comment) + 1 (class) + 3 (method) = 8;
    # code: import, class, def, text = (2 lines), return, def, return = 8.
    assert doc_ratio.count_source(_SAMPLE) == (8, 8)


def test_the_counting_rule_without_end_lineno(monkeypatch):
    # Python 3.7's ast has no end_lineno: the string tokens give the spans.
    parse = ast.parse

    def parse_as_37(source):
        tree = parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Expr):
                node.end_lineno = None
        return tree

    monkeypatch.setattr(doc_ratio.ast, "parse", parse_as_37)
    assert doc_ratio.count_source(_SAMPLE) == (8, 8)


def test_audit_and_port_are_left_out():
    package = os.path.join(REPO, "npu_lossscale")
    files = [os.path.relpath(path, package).split(os.sep)[0]
             for path in doc_ratio.library_files(package)]
    assert "core" in files and "managers" in files
    assert "audit" not in files and "port" not in files


def test_doc_lines_per_code_line_at_most_the_limit():
    rows, code, doc = doc_ratio.measure(os.path.join(REPO, "npu_lossscale"))
    worst = ", ".join("%s %.2f (code %d, doc %d)" % (os.path.basename(path), ratio, c, d)
                      for ratio, c, d, path in rows[:5])
    assert doc / code <= doc_ratio.DEFAULT_LIMIT, (
        "doc lines per code line %.3f (code %d, doc %d) exceed %.2f; worst: %s"
        % (doc / code, code, doc, doc_ratio.DEFAULT_LIMIT, worst))
