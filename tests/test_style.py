"""The library's docstring and comment lines per code line (issue 31), and the
floors core/ imports from (issue 45).

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


#: What the step (core/) may import of the package: itself and the ground
#: floor beside ``seams`` (issue 45): the seams, the protocols and their
#: readers, and the one room for TF's internals.
_GROUND_FLOOR = frozenset(["seams", "tf_internals", "manager_protocol", "backend_protocol",
                           "graph_values", "cluster"])


def _package_imports(path):
    """The ``npu_lossscale`` modules a file imports, as dotted names below
    the package (``from npu_lossscale import seams`` gives "seams")."""
    with open(path) as source:
        tree = ast.parse(source.read(), path)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module + "." + alias.name if node.module == "npu_lossscale"
                      else node.module for alias in node.names]
    return sorted(set(name[len("npu_lossscale."):] for name in names
                      if name.startswith("npu_lossscale.")))


def test_core_imports_only_itself_and_the_ground_floor():
    core = os.path.join(REPO, "npu_lossscale", "core")
    above = dict((name, [module for module in _package_imports(os.path.join(core, name))
                         if module.split(".")[0] != "core" and module not in _GROUND_FLOOR])
                 for name in sorted(os.listdir(core)) if name.endswith(".py"))
    assert dict((name, found) for name, found in above.items() if found) == {}


def test_the_ground_floor_imports_only_itself():
    package = os.path.join(REPO, "npu_lossscale")
    above = dict((name, [module for module in _package_imports(
        os.path.join(package, name + ".py")) if module not in _GROUND_FLOOR])
                 for name in sorted(_GROUND_FLOOR))
    assert dict((name, found) for name, found in above.items() if found) == {}


#: The packages that plug into the step, or stand beside it behind a protocol.
_PLUG_INS = ("transforms", "skips", "underflow", "diagnostics", "distributed", "backends",
             "managers")


def _core_names_reached(path):
    """The (core module, name) pairs a file reaches: names imported from a
    core module, and attributes read of a core module it imports."""
    with open(path) as source:
        tree = ast.parse(source.read(), path)
    aliases, reached = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "npu_lossscale.core":
            aliases.update((alias.asname or alias.name, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "npu_lossscale.core."):
            reached.update((node.module.split(".")[2], alias.name) for alias in node.names)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            reached.add((aliases[node.value.id], node.attr))
    return reached


def test_plug_ins_reach_only_the_declared_helpers_of_core():
    import importlib  # pylint: disable=import-outside-toplevel
    helpers = importlib.import_module("npu_lossscale.plugin_helpers")
    declared = [getattr(helpers, name) for name in helpers.__all__]
    undeclared = []
    for package in _PLUG_INS:
        folder = os.path.join(REPO, "npu_lossscale", package)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py"):
                continue
            for module, attribute in sorted(_core_names_reached(os.path.join(folder, name))):
                value = getattr(importlib.import_module("npu_lossscale.core." + module),
                                attribute)
                if not any(value is helper for helper in declared):
                    undeclared.append("%s/%s: core.%s.%s" % (package, name, module, attribute))
    assert undeclared == []


#: The packages that plug into the step's seams, and the managers and
#: backends beside them: they import ``core`` only through ``plugin_helpers``.
_SEAM_PLUG_INS = ("transforms", "skips", "underflow", "diagnostics", "distributed",
                  "managers", "backends")


def test_the_seams_plug_ins_import_core_only_through_plugin_helpers():
    found = []
    for package in _SEAM_PLUG_INS:
        folder = os.path.join(REPO, "npu_lossscale", package)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                found += ["%s/%s: %s" % (package, name, module)
                          for module in _package_imports(os.path.join(folder, name))
                          if module.split(".")[0] == "core"]
    assert found == []
