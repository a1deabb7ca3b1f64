"""Static guarantee that library/shim/example code only uses TF 1.15 API.

Our users run TensorFlow 1.15 (Python 3.7); the test suite runs a recent TF 2.x
through ``tensorflow.compat.v1``.  ``tf.compat.v1`` on TF 2.x is a *superset*
of what TF 1.15 has (``tf.compat.v1.mixed_precision`` exists on 2.x, not on
1.15), so passing tests on 2.x proves nothing for 1.15.  This test parses every
``.py`` file under ``npu_lossscale/``, ``shims/`` and ``examples/`` with
``ast`` (nothing is imported or executed) and checks every TensorFlow reference
against two manifests generated from the real TF 1.15.0 wheel by
``tools/make_tf115_manifest.py``:

* ``tests/data/tf115_compat_v1_api.txt``: dotted names reachable as
  ``tf.<name>`` after ``import tensorflow.compat.v1 as tf`` on 1.15; a name is
  a module iff it is a proper prefix of another entry.
* ``tests/data/tf115_python_modules.txt``: importable private modules
  (``tensorflow.python.ops.math_ops``, ``tensorflow.core.protobuf.*_pb2``),
  plus ``pkg:name`` lines for names a package ``__init__`` defines.

Import forms understood (anywhere in the file, including inside functions):

``import tensorflow.compat.v1 as tf`` / ``from tensorflow.compat import v1 as tf``
    ``tf.<chain>`` is checked against the compat.v1 manifest.  So is
    ``tf.compat.v1.<x>``: TF 1.15's ``compat.v1`` has *no* nested
    ``compat.v1`` (2.x has one), so that spelling fails.
``import tensorflow as tf`` / ``import tensorflow``
    Plain ``tensorflow`` is the v1 API on 1.15 but the v2 API on 2.x, so only
    ``tf.compat.v1.<chain>`` (checked against the manifest; 1.15 has
    ``tf.compat.v1`` at top level), the ``tf.compat`` helpers that exist in
    both (``tf.compat.as_bytes``...), dunders like ``tf.__version__`` and
    ``tensorflow.python....`` module paths are allowed.
``from tensorflow.compat.v1 import x`` / ``from tensorflow.compat.v1.train import y``
    The imported name must be in the manifest; if it is a module its uses
    (``x.<chain>``) are checked too.
``from tensorflow.python.ops import math_ops`` / ``import tensorflow.python.x``
    The module must be in the modules manifest.  ``from <pkg> import y``
    where ``y`` is not a module passes if ``pkg`` is a plain module (its
    symbols are not recorded: unverified) or ``pkg/__init__.py`` defines
    ``y``.  Attribute chains on private modules are checked the same way.

Chain resolution: for ``tf.train.AdamOptimizer(1e-3).minimize`` only the
maximal *attribute* chain ``tf.train.AdamOptimizer`` is considered, and it is
walked from the left: while the prefix is a module of the manifest the next
component must be in the manifest; the first component that is a leaf (class,
function, constant) ends the check.  ``getattr(tf, "name")`` counts as
``tf.name``; ``getattr(tf, "name", default)`` is a guarded lookup.

Always failures (guards do not exempt them, they are project rules):
``tf.keras`` / any ``keras`` import (``tensorflow.keras``,
``tensorflow.python.keras``, ``keras``, ``tf_keras``) and any use of
``compat.v2`` (``import tensorflow.compat.v2``, ``tf.compat.v2``).
``tensorflow_core`` (1.15-only) and other ``tensorflow.<x>`` namespaces
(``tensorflow.contrib``, ``tensorflow.estimator``...) are failures unless
guarded.

Guard exemption rule (code that is allowed to probe for newer API):

1. Anything lexically inside the *body* of a ``try`` whose handlers name
   ``AttributeError``, ``ImportError`` or ``ModuleNotFoundError`` (alone or in
   a tuple) is exempt.  ``except Exception``/bare ``except`` do not count (be
   explicit).  The ``except``/``else``/``finally`` blocks are still checked:
   the fallback must be 1.15 API.
2. A test "probes" if it contains a ``hasattr(...)`` call, a
   ``getattr(x, "n", default)`` call, or a name that was assigned anywhere in
   the file from an expression containing such a call
   (``_HAS_MP = hasattr(tf, "mixed_precision")``).  For ``if``/ternary: the
   branch taken when the probe succeeded is exempt: the body for
   ``if hasattr(...)``, the ``else`` for ``if not hasattr(...)`` /
   ``if getattr(..., None) is None``.  In ``a and b`` every operand after a
   positive probe is exempt; in ``a or b`` every operand after a negative one.
3. The exemption is by lexical region, not per name: everything inside the
   guarded block is exempt.

Limitations: aliases are tracked per file, not per scope; names bound by
assignment (``opt_cls = tf.train.AdamOptimizer``) are not followed; symbols of
non-package private modules (``math_ops.reduce_sum``) are not verified.
Regenerate the manifests with ``python tools/make_tf115_manifest.py``.
"""

from __future__ import annotations

import ast
import functools
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
DATA_DIR = TESTS_DIR / "data"
API_MANIFEST = DATA_DIR / "tf115_compat_v1_api.txt"
MODULES_MANIFEST = DATA_DIR / "tf115_python_modules.txt"
SCANNED_DIRS = ("npu_lossscale", "shims", "examples")

GUARD_EXCEPTIONS = frozenset({"AttributeError", "ImportError", "ModuleNotFoundError"})
# Attributes every Python module object has.
MODULE_DUNDERS = frozenset(
    {"__name__", "__file__", "__doc__", "__dict__", "__path__", "__package__",
     "__spec__", "__loader__", "__class__", "__all__"}
)
KERAS_TOP = frozenset({"keras", "tf_keras"})

HINTS = {
    "mixed_precision": "TF 1.15 has the loss-scale API under tf.train.experimental "
    "(DynamicLossScale, FixedLossScale, MixedPrecisionLossScaleOptimizer, "
    "enable_mixed_precision_graph_rewrite), which TF 2.x compat.v1 also keeps",
    "compat.v1": "`tf` is already tensorflow.compat.v1; TF 1.15's compat.v1 has no nested compat.v1",
    "compat.v2": "compat.v2 is banned (project rule)",
}


# --------------------------------------------------------------------------
# manifests
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    api: frozenset  # compat.v1 names
    api_modules: frozenset  # names that are modules (prefix of another name)
    modules: frozenset  # private module paths
    packages: frozenset  # private modules that have submodules
    pkg_names: frozenset  # "pkg:name" lines

    def api_is_module(self, dotted: str) -> bool:
        return dotted == "" or dotted in self.api_modules


def _read_lines(path: Path) -> list:
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run `python tools/make_tf115_manifest.py`")
    return [
        ln.strip()
        for ln in path.read_text(encoding="utf-8").splitlines()
        if ln.strip() and not ln.startswith("#")
    ]


@functools.lru_cache(maxsize=None)
def load_manifest() -> Manifest:
    api = frozenset(_read_lines(API_MANIFEST))
    api_modules = frozenset(n.rsplit(".", 1)[0] for n in api if "." in n)
    lines = _read_lines(MODULES_MANIFEST)
    modules = frozenset(ln for ln in lines if ":" not in ln)
    pkg_names = frozenset(ln for ln in lines if ":" in ln)
    packages = frozenset(m.rsplit(".", 1)[0] for m in modules if "." in m)
    return Manifest(api, api_modules, modules, packages, pkg_names)


# --------------------------------------------------------------------------
# checker
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    chain: str
    reason: str

    def __str__(self):
        return f"{self.path}:{self.line}: {self.chain} -- {self.reason}"


@dataclass(frozen=True)
class Binding:
    """What a local name refers to."""

    kind: str  # "root" (plain tensorflow), "v1" (compat.v1), "private" (module path)
    path: tuple  # components inside that namespace (for private: full dotted parts)


class _Problem(Exception):
    def __init__(self, shown: str, reason: str, always: bool = False):
        super().__init__(reason)
        self.shown = shown  # the offending prefix as written (for messages)
        self.reason = reason
        self.always = always  # project rule: not exempt by guards


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _keras(shown: str) -> _Problem:
    return _Problem(shown, "Keras is banned in library/shims/examples (project rule)", always=True)


def _hint(key: str) -> str:
    h = HINTS.get(key)
    return f" ({h})" if h else ""


def resolve_v1(m: Manifest, path: tuple, shown_prefix: str) -> None:
    """Check a compat.v1 chain; raise _Problem on the first bad component."""
    for i, comp in enumerate(path):
        parent = ".".join(path[:i])
        dotted = f"{parent}.{comp}" if parent else comp
        shown = f"{shown_prefix}.{'.'.join(path[: i + 1])}"
        if comp == "keras":
            raise _keras(shown)
        if dotted == "compat.v2":
            raise _Problem(shown, HINTS["compat.v2"], always=True)
        if comp in MODULE_DUNDERS:
            return
        if dotted not in m.api:
            raise _Problem(shown, f"`{dotted}` is not in TF 1.15 tf.compat.v1{_hint(dotted)}")
        if not m.api_is_module(dotted):
            return  # a leaf: whatever follows is an attribute of a class/function/object


def private_member_ok(m: Manifest, module: str, name: str) -> bool:
    if f"{module}.{name}" in m.modules:
        return True
    if module not in m.packages:
        return True  # plain module: its symbols are not recorded (unverified)
    return f"{module}:{name}" in m.pkg_names or f"{module}:*" in m.pkg_names


def resolve_private(m: Manifest, parts: tuple, shown: str, is_import: bool) -> None:
    """parts: full module path components, e.g. ('tensorflow','python','ops','math_ops', 'foo')."""
    if "keras" in parts:
        raise _keras(shown)
    # the longest module prefix
    i = len(parts)
    while i > 0 and ".".join(parts[:i]) not in m.modules:
        i -= 1
    if i < 2:
        raise _Problem(shown, f"`{'.'.join(parts[:2])}` is not a TF 1.15 module")
    if i == len(parts):
        return
    module = ".".join(parts[:i])
    if is_import:  # `import a.b.c`: every component must be a module
        raise _Problem(shown, f"`{'.'.join(parts[: i + 1])}` is not a module in TF 1.15")
    if not private_member_ok(m, module, parts[i]):
        raise _Problem(
            shown, f"`{parts[i]}` is neither a module nor defined in `{module}` in TF 1.15"
        )


def resolve_root(m: Manifest, path: tuple, shown_prefix: str) -> None:
    """Check a chain on the plain ``tensorflow`` namespace."""
    if not path:
        return
    c0 = path[0]
    shown0 = f"{shown_prefix}.{c0}"
    if c0 == "keras":
        raise _keras(shown0)
    if _is_dunder(c0):
        if c0 in MODULE_DUNDERS or c0 in m.api:  # __version__, __git_version__ ...
            return
        raise _Problem(shown0, f"`{c0}` is not a TF 1.15 top-level attribute")
    if c0 == "compat":
        if len(path) == 1:
            return
        c1 = path[1]
        shown1 = f"{shown0}.{c1}"
        if c1 == "v1":
            resolve_v1(m, path[2:], shown1)
            return
        if c1 == "v2":
            raise _Problem(shown1, HINTS["compat.v2"], always=True)
        if f"compat.{c1}" in m.api and not m.api_is_module(f"compat.{c1}"):
            return
        raise _Problem(shown1, f"`compat.{c1}` is not in TF 1.15 tf.compat")
    if c0 in ("python", "core"):
        resolve_private(m, ("tensorflow",) + tuple(path), f"{shown_prefix}.{'.'.join(path)}", False)
        return
    raise _Problem(
        shown0,
        "plain `tensorflow` is the v1 API on TF 1.15 but the v2 API on TF 2.x; "
        f"use tf.compat.v1.{'.'.join(path)} (or import tensorflow.compat.v1 as tf)",
    )


def resolve_binding(m: Manifest, b: Binding, chain: tuple, shown_prefix: str) -> None:
    if b.kind == "v1":
        # The binding's own path (e.g. `train` for `from tensorflow.compat.v1
        # import train`) was checked at the import; shown_prefix spells it.
        full = b.path + chain
        if not chain:
            return
        # Display relative to what the user wrote.
        try:
            resolve_v1(m, full, "tf")
        except _Problem as p:
            written = shown_prefix + "".join(
                "." + c for c in chain[: len(p.shown.split(".")) - 1 - len(b.path)]
            )
            raise _Problem(written, p.reason, p.always) from None
    elif b.kind == "root":
        if not chain and not b.path:
            return
        try:
            resolve_root(m, b.path + chain, "tensorflow")
        except _Problem as p:
            n_written = len(p.shown.split(".")) - 1 - len(b.path)
            written = shown_prefix + "".join("." + c for c in chain[:max(n_written, 0)])
            raise _Problem(written, p.reason, p.always) from None
    elif b.kind == "private":
        if chain:
            try:
                resolve_private(m, b.path + chain[:1], shown_prefix + "." + chain[0], False)
            except _Problem as p:
                raise _Problem(shown_prefix + "." + chain[0], p.reason, p.always) from None


def _handler_names(handler: ast.ExceptHandler) -> set:
    t = handler.type
    elts = t.elts if isinstance(t, ast.Tuple) else [t] if t is not None else []
    out = set()
    for e in elts:
        if isinstance(e, ast.Name):
            out.add(e.id)
        elif isinstance(e, ast.Attribute):
            out.add(e.attr)
    return out


def _is_guarding_try(node) -> bool:
    return any(_handler_names(h) & GUARD_EXCEPTIONS for h in node.handlers)


def _call_name(node) -> str | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id
    return None


def _is_probe_call(node) -> bool:
    name = _call_name(node)
    return name == "hasattr" or (name == "getattr" and len(node.args) == 3)


def _contains_probe(node, flags) -> bool:
    for n in ast.walk(node):
        if _is_probe_call(n):
            return True
        if isinstance(n, ast.Name) and n.id in flags:
            return True
    return False


def probe_polarity(test, flags):
    """True: probe succeeded in the 'then' branch; False: in the 'else' branch; None: no probe."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        p = probe_polarity(test.operand, flags)
        return None if p is None else not p
    if isinstance(test, ast.BoolOp):
        pols = [probe_polarity(v, flags) for v in test.values]
        if isinstance(test.op, ast.And) and True in pols:
            return True
        if isinstance(test.op, ast.Or) and False in pols:
            return False
        if any(p is not None for p in pols):
            return True  # e.g. `hasattr(a) or hasattr(b)`: lenient
        return None
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], (ast.Is, ast.IsNot))
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
        and _contains_probe(test.left, flags)
    ):
        return isinstance(test.ops[0], ast.IsNot)
    if _contains_probe(test, flags):
        return True
    return None


def attr_chain(node):
    """(base Name node, [attrs], guarded_tail) for Name/Attribute/getattr chains, else None."""
    attrs = []
    cur = node
    guarded_tail = False
    while True:
        if isinstance(cur, ast.Attribute):
            attrs.append(cur.attr)
            cur = cur.value
        elif (
            _call_name(cur) == "getattr"
            and len(cur.args) in (2, 3)
            and not cur.keywords
            and isinstance(cur.args[1], ast.Constant)
            and isinstance(cur.args[1].value, str)
        ):
            if len(cur.args) == 3:
                # getattr with default: the looked-up name and anything after
                # it are a guarded probe; only the object part is checked.
                attrs = []
                guarded_tail = True
            else:
                attrs.append(cur.args[1].value)
            cur = cur.args[0]
        elif isinstance(cur, ast.Name):
            return cur, attrs[::-1], guarded_tail
        else:
            return None


class FileChecker:
    def __init__(self, source: str, path: str, manifest: Manifest):
        self.path = path
        self.m = manifest
        self.tree = ast.parse(source, filename=path)
        self.violations: list = []
        self.bindings: dict = {}  # name -> list[(Binding, in_handler)]
        self.flags: set = set()
        self._collect(self.tree, in_handler=False)

    # ---- pass 1: bindings and probe flags ---------------------------------
    def _bind(self, name, binding, in_handler):
        self.bindings.setdefault(name, []).append((binding, in_handler))

    def _collect(self, node, in_handler):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = tuple(a.name.split("."))
                if parts[0] != "tensorflow":
                    continue
                if a.asname is None:
                    self._bind("tensorflow", Binding("root", ()), in_handler)
                else:
                    b = self._binding_for_module(parts)
                    if b is not None:
                        self._bind(a.asname, b, in_handler)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mparts = tuple(node.module.split("."))
            if mparts[0] == "tensorflow":
                for a in node.names:
                    if a.name == "*":
                        continue
                    b = self._binding_for_module(mparts + (a.name,), from_import=True)
                    if b is not None:
                        self._bind(a.asname or a.name, b, in_handler)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if _contains_probe(node.value, set()):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            self.flags.add(n.id)
        if isinstance(node, ast.ExceptHandler):
            in_handler = True
        for child in ast.iter_child_nodes(node):
            self._collect(child, in_handler)

    def _binding_for_module(self, parts, from_import=False):
        """Binding for the object named by the dotted ``parts`` (None: not a module)."""
        rest = parts[1:]
        if rest[:2] == ("compat", "v1"):
            sub = rest[2:]
            if self.m.api_is_module(".".join(sub)):
                return Binding("v1", sub)
            return None
        if rest in ((), ("compat",)):
            return Binding("root", rest)
        if rest and rest[0] in ("python", "core"):
            dotted = ".".join(parts)
            if dotted in self.m.modules or not from_import:
                return Binding("private", parts)
            return None
        return None

    # ---- pass 2: checks ----------------------------------------------------
    def run(self) -> list:
        self._visit(self.tree, guarded=False)
        return self.violations

    def _report(self, node, problem: _Problem, guarded: bool):
        if guarded and not problem.always:
            return
        self.violations.append(Violation(self.path, node.lineno, problem.shown, problem.reason))

    def _visit_all(self, nodes, guarded):
        for n in nodes:
            self._visit(n, guarded)

    def _visit(self, node, guarded):
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            self._visit_all(node.body, guarded or _is_guarding_try(node))
            self._visit_all(node.handlers, guarded)
            self._visit_all(node.orelse, guarded)
            self._visit_all(node.finalbody, guarded)
            return
        if isinstance(node, (ast.If, ast.IfExp)):
            pol = probe_polarity(node.test, self.flags)
            self._visit(node.test, guarded)
            body = node.body if isinstance(node.body, list) else [node.body]
            orelse = node.orelse if isinstance(node.orelse, list) else [node.orelse]
            self._visit_all(body, guarded or pol is True)
            self._visit_all(orelse, guarded or pol is False)
            return
        if isinstance(node, ast.BoolOp):
            g = guarded
            for v in node.values:
                self._visit(v, g)
                pol = probe_polarity(v, self.flags)
                if (isinstance(node.op, ast.And) and pol is True) or (
                    isinstance(node.op, ast.Or) and pol is False
                ):
                    g = True
            return
        if isinstance(node, ast.Import):
            self._check_import(node, guarded)
            return
        if isinstance(node, ast.ImportFrom):
            self._check_import_from(node, guarded)
            return
        if isinstance(node, (ast.Attribute, ast.Call)):
            res = attr_chain(node)
            if res is not None and (res[1] or res[2]):
                base, attrs, guarded_tail = res
                if base.id in self.bindings:
                    if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                        attrs = attrs[:-1]  # `tf.x.y = ...`: only tf.x must exist
                    self._check_chain(node, base.id, tuple(attrs), guarded)
                # descend into call arguments that are not part of the chain
                self._visit_chain_args(node, guarded)
                return
        for child in ast.iter_child_nodes(node):
            self._visit(child, guarded)

    def _visit_chain_args(self, node, guarded):
        cur = node
        while True:
            if isinstance(cur, ast.Attribute):
                cur = cur.value
            elif isinstance(cur, ast.Call):
                # getattr(obj, "name"[, default]): visit the default only
                self._visit_all(cur.args[2:], guarded)
                cur = cur.args[0]
            else:
                return

    def _candidates(self, name):
        bs = self.bindings[name]
        primary = [b for b, in_handler in bs if not in_handler]
        return primary or [b for b, _ in bs]

    def _check_chain(self, node, name, chain, guarded):
        problems = []
        for b in dict.fromkeys(self._candidates(name)):
            try:
                resolve_binding(self.m, b, chain, name)
                return  # valid under at least one binding
            except _Problem as p:
                problems.append(p)
        if problems:
            self._report(node, problems[0], guarded)

    def _check_import(self, node, guarded):
        for a in node.names:
            parts = tuple(a.name.split("."))
            shown = f"import {a.name}"
            try:
                if parts[0] in KERAS_TOP:
                    raise _keras(shown)
                if parts[0] == "tensorflow_core":
                    raise _Problem(shown, "tensorflow_core exists only in TF 1.15; import tensorflow.*")
                if parts[0] != "tensorflow":
                    continue
                self._check_tf_module_path(parts, shown)
            except _Problem as p:
                self._report(node, p, guarded)

    def _check_tf_module_path(self, parts, shown):
        """``import tensorflow.a.b`` / ``from tensorflow.a.b import ...``: the module must exist."""
        rest = parts[1:]
        if not rest:
            return
        if rest[0] == "keras" or "keras" in rest:
            raise _keras(shown)
        if rest[0] == "compat":
            if len(rest) == 1:
                return
            if rest[1] == "v2":
                raise _Problem(shown, HINTS["compat.v2"], always=True)
            if rest[1] == "v1":
                try:
                    resolve_v1(self.m, rest[2:], "tensorflow.compat.v1")
                except _Problem as p:
                    raise _Problem(shown, p.reason, p.always) from None
                if not self.m.api_is_module(".".join(rest[2:])):
                    raise _Problem(shown, f"`{'.'.join(rest[2:])}` is not a module in TF 1.15 compat.v1")
                return
            raise _Problem(shown, f"`tensorflow.{'.'.join(rest)}` is not a TF 1.15 module")
        if rest[0] in ("python", "core"):
            resolve_private(self.m, parts, shown, is_import=True)
            return
        raise _Problem(
            shown,
            f"`tensorflow.{rest[0]}` is not a portable import (use tensorflow.compat.v1 "
            "or a tensorflow.python module)",
        )

    def _check_import_from(self, node, guarded):
        if node.level or not node.module:
            return
        parts = tuple(node.module.split("."))
        for a in node.names:
            shown = f"from {node.module} import {a.name}"
            try:
                if parts[0] in KERAS_TOP:
                    raise _keras(shown)
                if parts[0] == "tensorflow_core":
                    raise _Problem(shown, "tensorflow_core exists only in TF 1.15; import tensorflow.*")
                if parts[0] != "tensorflow":
                    continue
                self._check_tf_module_path(parts, shown)
                if a.name == "*":
                    raise _Problem(shown, "star imports from TensorFlow cannot be checked")
                self._check_from_name(parts, a.name, shown)
            except _Problem as p:
                self._report(node, p, guarded)

    def _check_from_name(self, parts, name, shown):
        rest = parts[1:]
        if name == "keras":
            raise _keras(shown)
        if not rest:  # from tensorflow import X
            if name == "compat" or (_is_dunder(name) and name in self.m.api):
                return
            if name in ("python", "core"):
                return
            raise _Problem(
                shown,
                "plain `tensorflow` is the v1 API on TF 1.15 but the v2 API on TF 2.x; "
                f"use `from tensorflow.compat.v1 import {name}`",
            )
        if rest == ("compat",):
            if name == "v1":
                return
            if name == "v2":
                raise _Problem(shown, HINTS["compat.v2"], always=True)
            if f"compat.{name}" in self.m.api:
                return
            raise _Problem(shown, f"`compat.{name}` is not in TF 1.15 tf.compat")
        if rest[:2] == ("compat", "v1"):
            try:
                resolve_v1(self.m, rest[2:] + (name,), "tensorflow.compat.v1")
            except _Problem as p:
                raise _Problem(shown, p.reason, p.always) from None
            return
        if rest[0] in ("python", "core"):
            module = ".".join(parts)
            if not private_member_ok(self.m, module, name):
                raise _Problem(
                    shown, f"`{name}` is neither a module nor defined in `{module}` in TF 1.15"
                )


def check_source(source: str, path: str = "<snippet>", manifest: Manifest | None = None) -> list:
    return FileChecker(source, path, manifest or load_manifest()).run()


def _read_source(path: Path) -> str:
    with open(path, "rb") as f:
        data = f.read()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


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


def check_repo() -> list:
    m = load_manifest()
    violations = []
    for p in scanned_files():
        rel = p.relative_to(REPO_ROOT).as_posix()
        try:
            src = _read_source(p)
            violations.extend(check_source(src, rel, m))
        except SyntaxError as e:
            violations.append(Violation(rel, e.lineno or 0, "<file>", f"cannot parse: {e.msg}"))
        except (UnicodeDecodeError, ValueError) as e:
            violations.append(Violation(rel, 0, "<file>", f"cannot read: {e}"))
    return violations


# --------------------------------------------------------------------------
# the repository check
# --------------------------------------------------------------------------


def test_repo_uses_only_tf115_api():
    violations = check_repo()
    if violations:
        pytest.fail(
            f"{len(violations)} use(s) of API missing from TF 1.15 "
            "(see tests/test_tf115_api.py docstring for the rules):\n"
            + "\n".join(f"  {v}" for v in violations),
            pytrace=False,
        )


# --------------------------------------------------------------------------
# manifest sanity
# --------------------------------------------------------------------------


def test_manifest_header_names_wheel_and_sha256():
    head = API_MANIFEST.read_text(encoding="utf-8").splitlines()[:8]
    assert any(
        "tensorflow_cpu-1.15.0-cp37-cp37m-manylinux2010_x86_64.whl sha256=" in h for h in head
    ), head


def test_manifest_is_sorted_and_unique():
    for path in (API_MANIFEST, MODULES_MANIFEST):
        lines = _read_lines(path)
        assert lines == sorted(set(lines)), path


@pytest.mark.parametrize(
    "name",
    [
        "train.Optimizer", "train.AdamOptimizer", "nn.conv2d", "nn.conv2d_transpose",
        "debugging.assert_all_finite", "math.is_finite", "is_finite", "where_v2", "cond",
        "control_dependencies", "train.experimental", "train.experimental.DynamicLossScale",
        "train.experimental.MixedPrecisionLossScaleOptimizer", "summary.image", "estimator",
        "estimator.SessionRunHook", "float16", "__version__", "flags", "app.flags",
    ],
)
def test_manifest_has(name):
    assert name in load_manifest().api


@pytest.mark.parametrize("name", ["mixed_precision", "compat.v1", "compat.v2", "config.list_physical_devices"])
def test_manifest_lacks(name):
    assert name not in load_manifest().api


def test_module_manifest():
    m = load_manifest()
    for mod in ("tensorflow.python.ops.math_ops", "tensorflow.python.training.optimizer",
                "tensorflow.python.training.experimental.loss_scale",
                "tensorflow.core.protobuf.rewriter_config_pb2"):
        assert mod in m.modules
    for mod in ("tensorflow.python.ops.cond", "tensorflow.python.framework.tensor",
                "tensorflow.python.trackable"):
        assert mod not in m.modules  # 2.x-only private modules


# --------------------------------------------------------------------------
# unit tests of the checker itself
# --------------------------------------------------------------------------


def _chains(src):
    return [v.chain for v in check_source(src)]


V1 = "import tensorflow.compat.v1 as tf\n"


def test_good_chain_passes():
    assert _chains(V1 + "opt = tf.train.AdamOptimizer(1e-3).minimize(loss)\n") == []
    assert _chains(V1 + "class O(tf.train.Optimizer):\n  pass\n") == []
    assert _chains(V1 + "y = tf.nn.conv2d(x, w, [1,1,1,1], 'SAME').shape.as_list()\n") == []
    assert _chains(V1 + "v = tf.__version__\nd = tf.float16.as_numpy_dtype\n") == []


def test_chain_stops_at_first_leaf():
    # `minimize`/`shape` are attributes of the result, never looked up in the manifest
    assert _chains(V1 + "tf.train.AdamOptimizer.minimize\ntf.Session.run\n") == []


def test_mixed_precision_fails():
    assert "mixed_precision" not in load_manifest().api  # the claim, checked on the data
    v = check_source(V1 + "\n\nls = tf.mixed_precision.DynamicLossScale()\n", "lib.py")
    assert [(x.line, x.chain) for x in v] == [(4, "tf.mixed_precision")]
    assert "lib.py:4: tf.mixed_precision" in str(v[0])
    assert "train.experimental" in v[0].reason


def test_missing_member_of_existing_module_fails():
    assert _chains(V1 + "tf.train.NoSuchOptimizer\n") == ["tf.train.NoSuchOptimizer"]
    assert _chains(V1 + "tf.config.list_physical_devices('GPU')\n") == ["tf.config.list_physical_devices"]
    assert _chains(V1 + "getattr(tf, 'mixed_precision')\n") == ["tf.mixed_precision"]


def test_nested_compat_v1_under_compat_v1_fails():
    assert _chains(V1 + "tf.compat.v1.train.Optimizer\n") == ["tf.compat.v1"]
    assert _chains(V1 + "tf.compat.as_bytes('x')\n") == []


def test_guarded_try_passes():
    src = V1 + (
        "try:\n"
        "    LS = tf.mixed_precision.DynamicLossScale\n"
        "except (ImportError, AttributeError):\n"
        "    LS = tf.train.experimental.DynamicLossScale\n"
    )
    assert _chains(src) == []
    bad_fallback = src.replace("tf.train.experimental.DynamicLossScale", "tf.mixed_precision.LossScale")
    assert _chains(bad_fallback) == ["tf.mixed_precision"]
    wrong_exc = src.replace("(ImportError, AttributeError)", "ValueError")
    assert _chains(wrong_exc) == ["tf.mixed_precision"]


def test_guarded_import_passes():
    src = (
        "try:\n"
        "    from tensorflow.python.ops import cond\n"
        "except ImportError:\n"
        "    cond = None\n"
    )
    assert _chains(src) == []
    assert _chains(src.replace("except ImportError", "except Exception")) == [
        "from tensorflow.python.ops import cond"
    ]


def test_hasattr_guard_passes():
    src = V1 + (
        "if hasattr(tf, 'mixed_precision'):\n"
        "    LS = tf.mixed_precision.DynamicLossScale\n"
        "else:\n"
        "    LS = tf.mixed_precision.LossScale\n"
    )
    assert _chains(src) == ["tf.mixed_precision"]  # only the else branch
    neg = V1 + (
        "if not hasattr(tf, 'mixed_precision'):\n"
        "    LS = tf.train.experimental.DynamicLossScale\n"
        "else:\n"
        "    LS = tf.mixed_precision.DynamicLossScale\n"
    )
    assert _chains(neg) == []
    flag = V1 + (
        "_HAS_MP = hasattr(tf, 'mixed_precision')\n"
        "def f():\n"
        "    if _HAS_MP:\n"
        "        return tf.mixed_precision.DynamicLossScale\n"
    )
    assert _chains(flag) == []
    other = [
        "x = tf.mixed_precision.X if hasattr(tf, 'mixed_precision') else None\n",
        "x = hasattr(tf, 'mixed_precision') and tf.mixed_precision.X\n",
        "x = getattr(tf, 'mixed_precision', None)\n",
        "mp = getattr(tf, 'mixed_precision', None)\nif mp is not None:\n    tf.mixed_precision.X\n",
    ]
    for s in other:
        assert _chains(V1 + s) == [], s


def test_plain_tensorflow_import():
    P = "import tensorflow as tf\n"
    assert _chains(P + "tf.compat.v1.train.Optimizer\ntf.__version__\n") == []
    assert _chains(P + "tf.train.Optimizer\n") == ["tf.train"]
    assert _chains(P + "tf.compat.v1.mixed_precision.DynamicLossScale\n") == ["tf.compat.v1.mixed_precision"]
    assert _chains("import tensorflow\ntensorflow.compat.v1.nn.conv2d\n") == []
    assert _chains("import tensorflow.compat.v1\ntensorflow.compat.v1.nn.nope\n") == [
        "tensorflow.compat.v1.nn.nope"
    ]


def test_from_imports():
    assert _chains("from tensorflow.compat.v1 import train\ntrain.AdamOptimizer\n") == []
    assert _chains("from tensorflow.compat.v1 import train as t\nt.NoSuch\n") == ["t.NoSuch"]
    assert _chains("from tensorflow.compat.v1.train import experimental\n") == []
    assert _chains("from tensorflow.compat.v1 import mixed_precision\n") == [
        "from tensorflow.compat.v1 import mixed_precision"
    ]
    assert _chains("from tensorflow.compat import v1 as tf\ntf.mixed_precision\n") == ["tf.mixed_precision"]
    assert _chains("from tensorflow import float16\n") == ["from tensorflow import float16"]


def test_private_modules():
    ok = (
        "from tensorflow.python.ops import math_ops\n"
        "from tensorflow.python.ops.math_ops import reduce_sum\n"
        "from tensorflow.python.training.experimental import loss_scale\n"
        "import tensorflow.python.ops.control_flow_ops as cfo\n"
        "from tensorflow.core.protobuf import rewriter_config_pb2\n"
        "from tensorflow.python.data import Dataset\n"
        "math_ops.reduce_sum\n"
    )
    assert _chains(ok) == []
    assert _chains("from tensorflow.python.ops import cond\n") == ["from tensorflow.python.ops import cond"]
    assert _chains("from tensorflow.python.framework import tensor\n") == [
        "from tensorflow.python.framework import tensor"
    ]
    assert _chains("import tensorflow.python.trackable.base\n") == ["import tensorflow.python.trackable.base"]
    assert _chains("from tensorflow.python.ops import ops as o\no.x\n") != []
    assert _chains("from tensorflow.python import ops\nops.cond.cond\n") == ["ops.cond"]


def test_keras_and_compat_v2_always_fail():
    assert _chains(V1 + "tf.keras.layers.Dense\n") == ["tf.keras"]
    guarded = V1 + "try:\n    m = tf.keras.mixed_precision\nexcept AttributeError:\n    m = None\n"
    assert _chains(guarded) == ["tf.keras"]
    for s in ("import tensorflow.compat.v2 as tf2\n", "from tensorflow.compat import v2\n",
              "from tensorflow import keras\n", "import keras\n",
              "from tensorflow.python.keras.mixed_precision import policy\n"):
        assert len(check_source(s)) == 1, s
    assert _chains("import tensorflow as tf\ntf.compat.v2.nn\n") == ["tf.compat.v2"]


def test_tf1_only_or_unknown_namespaces_fail():
    assert len(check_source("import tensorflow_core\n")) == 1
    assert len(check_source("from tensorflow.contrib import layers\n")) == 1


def test_unrelated_code_and_shadow_free_names_ignored():
    assert _chains("import numpy as np\nnp.float16\nx = obj.mixed_precision.X\n") == []
