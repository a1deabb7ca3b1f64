#!/usr/bin/env python3
"""Generate the TF 1.15 API manifests used by tests/test_tf115_api.py.

Our users run TensorFlow 1.15 on Python 3.7; the test suite runs on a recent
TF 2.x through ``tensorflow.compat.v1``.  To catch code that only works on the
newer TF, this tool records what TF 1.15 actually provides, by *static*
inspection of the released wheel (TF 1.15 cannot be installed on Python 3.11):

``tests/data/tf115_compat_v1_api.txt``
    Every public name reachable as ``tf.<chain>`` after
    ``import tensorflow.compat.v1 as tf`` on TF 1.15, one dotted name per line
    (``train``, ``train.Optimizer``, ``nn.conv2d`` ...).  A name is a *module*
    exactly when it is a proper prefix of another line; every other line is a
    leaf (class, function, constant, or an opaque non-API module such as
    ``flags``).  Extracted from the generated API package
    ``tensorflow_core/_api/v1/compat/v1/**/__init__.py`` plus the hooks at the
    end of its root ``__init__.py``: ``estimator`` (from the
    ``tensorflow-estimator==1.15.1`` wheel, a hard dependency of
    tensorflow-cpu 1.15.0), ``keras`` (``tensorflow/python/keras/api/_v1``),
    ``flags`` and ``app.flags``.

``tests/data/tf115_python_modules.txt``
    Every importable private module under ``tensorflow_core/python/`` and
    ``tensorflow_core/core/`` (protobuf ``*_pb2`` modules), spelled the way
    user code imports them in 1.15: ``tensorflow.python.ops.math_ops``.
    Packages are listed too (``tensorflow.python.ops``); a module is listed
    only if every parent package has an ``__init__.py``.  Native extensions
    (``*.so``) count as modules.  Additionally, ``package:name`` lines record
    the public names a package's ``__init__.py`` itself defines (``package:*``
    if it star-imports), so that ``from tensorflow.python.ops import cond``
    (a TF 2.x-only module; ops/__init__.py is empty in 1.15) can be rejected.

Usage (needs network access to PyPI; the wheel is ~110 MB and is downloaded to
a temporary directory that is removed afterwards)::

    python tools/make_tf115_manifest.py                 # download + write
    python tools/make_tf115_manifest.py --wheel-dir DIR # reuse wheels in DIR

The output is deterministic (sorted, no timestamps) so regenerating it gives a
byte-identical file.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

TF_REQ = "tensorflow-cpu==1.15.0"
EST_REQ = "tensorflow-estimator==1.15.1"  # pinned by tensorflow-cpu 1.15.0's METADATA
PIP_PLATFORM_ARGS = [
    "--no-deps",
    "--only-binary=:all:",
    "--python-version",
    "3.7",
    "--platform",
    "manylinux2010_x86_64",
]

# (zip directory of the API tree, its import name)
COMPAT_V1_ROOT = ("tensorflow_core/_api/v1/compat/v1", "tensorflow._api.v1.compat.v1")
KERAS_ROOT = ("tensorflow_core/python/keras/api/_v1/keras", "tensorflow.python.keras.api._v1.keras")
ESTIMATOR_ROOT = (
    "tensorflow_estimator/python/estimator/api/_v1/estimator",
    "tensorflow_estimator.python.estimator.api._v1.estimator",
)
PRIVATE_TREES = ("tensorflow_core/python", "tensorflow_core/core")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "data"


def _is_public(name: str) -> bool:
    """Public API names: no leading underscore, except dunders like __version__."""
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        return name not in {"__init__", "__all__", "__path__", "__file__"}
    return not name.startswith("_")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(req: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", *PIP_PLATFORM_ARGS, "-d", str(dest), req]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    return _find_wheel(dest, req)


def _find_wheel(directory: Path, req: str) -> Path:
    dist, version = req.split("==")
    prefix = f"{dist.replace('-', '_')}-{version}-"
    hits = sorted(p for p in directory.glob("*.whl") if p.name.startswith(prefix))
    if not hits:
        raise SystemExit(f"no wheel for {req} in {directory}")
    return hits[0]


class ApiTree:
    """Module tree of a generated TF API package (``_api/.../__init__.py`` files)."""

    def __init__(self, zf: zipfile.ZipFile, root_dir: str, import_name: str):
        self.zf = zf
        self.root_dir = root_dir.rstrip("/")
        self.import_name = import_name
        self.inits = {}  # relative module path tuple -> source
        for info in zf.infolist():
            name = info.filename
            if name.startswith(self.root_dir + "/") and name.endswith("/__init__.py"):
                rel = PurePosixPath(name).relative_to(self.root_dir).parent.parts
                self.inits[tuple(rel)] = zf.read(name).decode("utf-8")
        if () not in self.inits:
            raise SystemExit(f"{root_dir}/__init__.py not found in {zf.filename}")

    def names(self, hooks: dict | None = None) -> set[str]:
        """Dotted public names reachable from the root (modules and leaves)."""
        out: set[str] = set()
        hooks = hooks or {}
        unreached = set(self.inits) - {()}
        stack = [()]
        while stack:
            rel = stack.pop()
            prefix = ".".join(rel)
            members = self._members(rel, hooks if rel == () else {})
            for member, kind in sorted(members.items()):
                full = f"{prefix}.{member}" if prefix else member
                out.add(full)
                if kind == "submodule":
                    child = rel + (member,)
                    unreached.discard(child)
                    stack.append(child)
                elif isinstance(kind, set):  # merged external tree
                    out.update(f"{full}.{n}" for n in kind)
        if unreached:
            # A directory its parent does not import is not reachable as an
            # attribute (TF 1.15's keras has two empty ones: premade,
            # layers.experimental), so it is left out.
            print(f"note: {self.import_name}: not imported by parent, skipped: "
                  f"{['.'.join(u) for u in sorted(unreached)]}", file=sys.stderr)
        return out

    def _members(self, rel: tuple, hooks: dict) -> dict:
        src = self.inits[rel]
        tree = ast.parse(src, filename="/".join((self.root_dir,) + rel + ("__init__.py",)))
        pkg = ".".join((self.import_name,) + rel)
        members: dict = {}

        def visit(stmts):
            for node in stmts:
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    for alias in node.names:
                        if alias.name == "*":
                            raise SystemExit(f"star import in {pkg}: {node.module}")
                        local = alias.asname or alias.name
                        if not _is_public(local):
                            continue
                        is_child = (
                            node.module == pkg
                            and alias.name == local
                            and (rel + (local,)) in self.inits
                        )
                        if node.module == pkg and alias.name in hooks:
                            continue  # handled by setattr hook below
                        members[local] = "submodule" if is_child else "leaf"
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        local = alias.asname or alias.name.split(".")[0]
                        if _is_public(local):
                            members[local] = "leaf"
                elif isinstance(node, ast.Assign):
                    for tgt in node.targets:
                        if isinstance(tgt, ast.Name) and _is_public(tgt.id):
                            members[tgt.id] = "leaf"
                        elif isinstance(tgt, ast.Attribute):
                            # `_current_module.app.flags = flags`
                            chain = _attr_chain(tgt)
                            if chain and chain[0] == "_current_module" and len(chain) > 1:
                                members[".".join(chain[1:])] = "leaf"
                elif isinstance(node, ast.Delete):
                    for tgt in node.targets:
                        if isinstance(tgt, ast.Name):
                            members.pop(tgt.id, None)
                elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                    call = node.value
                    # `setattr(_current_module, "estimator", estimator)`
                    if (
                        isinstance(call.func, ast.Name)
                        and call.func.id == "setattr"
                        and len(call.args) == 3
                        and isinstance(call.args[0], ast.Name)
                        and call.args[0].id == "_current_module"
                        and isinstance(call.args[1], ast.Constant)
                        and isinstance(call.args[1].value, str)
                    ):
                        name = call.args[1].value
                        if name in hooks:
                            members[name] = hooks[name]
                        else:
                            members[name] = "leaf"
                elif isinstance(node, ast.Try):
                    # The estimator/keras hooks live in `try: ... except ImportError`.
                    # Both are importable in a normal TF 1.15 install.
                    visit(node.body)
                elif isinstance(node, ast.If):
                    visit(node.body)

        visit(tree.body)
        return members


def _attr_chain(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def compat_v1_names(tf_zip: zipfile.ZipFile, est_zip: zipfile.ZipFile | None) -> set[str]:
    hooks = {"keras": ApiTree(tf_zip, *KERAS_ROOT).names()}
    if est_zip is not None:
        hooks["estimator"] = ApiTree(est_zip, *ESTIMATOR_ROOT).names()
    names = ApiTree(tf_zip, *COMPAT_V1_ROOT).names(hooks)
    # Sanity checks: a manifest missing these would be a broken extraction.
    for must in ("train.Optimizer", "train.AdamOptimizer", "nn.conv2d", "Session",
                 "float16", "debugging.assert_all_finite", "flags", "app.flags",
                 "__version__"):
        if must not in names:
            raise SystemExit(f"sanity check failed: {must!r} not extracted")
    if est_zip is not None and "estimator.Estimator" not in names:
        raise SystemExit("sanity check failed: estimator.Estimator not extracted")
    modules = {n.rsplit(".", 1)[0] for n in names if "." in n}
    missing_parents = modules - names
    if missing_parents:
        raise SystemExit(f"dangling names, parent not listed: {sorted(missing_parents)[:10]}")
    return names


def private_module_names(tf_zip: zipfile.ZipFile) -> set[str]:
    files = set(tf_zip.namelist())
    out: set[str] = set()
    for name in files:
        if not name.startswith(tuple(t + "/" for t in PRIVATE_TREES)):
            continue
        p = PurePosixPath(name)
        if p.suffix == ".py":
            parts = list(p.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
        elif p.suffix == ".so":
            parts = list(p.parent.parts) + [p.name.split(".")[0]]
        else:
            continue
        # every enclosing package (below tensorflow_core/) needs an __init__.py
        importable = all(
            "/".join(parts[:i]) + "/__init__.py" in files for i in range(2, len(parts))
        )
        if not importable or not all(x.isidentifier() for x in parts):
            continue
        parts[0] = "tensorflow"  # tensorflow_core.* is forwarded as tensorflow.*
        out.add(".".join(parts))
    out |= package_exports(tf_zip, files)
    for must in ("tensorflow.python", "tensorflow.python.ops.math_ops",
                 "tensorflow.python.training.optimizer",
                 "tensorflow.core.protobuf.rewriter_config_pb2"):
        if must not in out:
            raise SystemExit(f"sanity check failed: {must!r} not extracted")
    return out


def package_exports(tf_zip: zipfile.ZipFile, files: set[str]) -> set[str]:
    """``package:name`` lines for names a package's ``__init__.py`` defines.

    Lets the checker tell ``from tensorflow.python.ops import math_ops`` (a
    module) from ``from tensorflow.python.ops import cond`` (neither a module
    nor defined by ops/__init__.py in 1.15).  ``package:*`` marks an
    ``__init__`` with a star import (its names are not enumerated).  The keras
    tree is skipped: Keras is banned by the checker anyway.
    """
    out: set[str] = set()
    for name in files:
        if not (name.startswith(tuple(t + "/" for t in PRIVATE_TREES)) and name.endswith("/__init__.py")):
            continue
        parts = list(PurePosixPath(name).parent.parts)
        if parts[:3] == ["tensorflow_core", "python", "keras"]:
            continue
        parts[0] = "tensorflow"
        pkg = ".".join(parts)
        tree = ast.parse(tf_zip.read(name).decode("utf-8"), filename=name)
        names: set[str] = set()

        def visit(stmts):
            for node in stmts:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names.update(t.id for t in node.targets if isinstance(t, ast.Name))
                elif isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        names.add("*" if alias.name == "*" else alias.asname or alias.name)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        names.add(alias.asname or alias.name.split(".")[0])
                elif isinstance(node, (ast.Try, ast.If)):
                    visit(node.body)
                    visit(node.orelse)

        visit(tree.body)
        for n in names:
            if n == "*" or not n.startswith("_"):
                out.add(f"{pkg}:{n}")
    return out


def _write(path: Path, header: list[str], names: set[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(f"# {h}\n" if h else "#\n" for h in header) + "".join(
        n + "\n" for n in sorted(names)
    )
    path.write_text(body, encoding="utf-8", newline="\n")
    print(f"wrote {path} ({len(names)} names, {len(body.encode())} bytes)", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel-dir", type=Path,
                    help="use already-downloaded wheels from this directory instead of pip download")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-estimator", action="store_true",
                    help="do not fetch tensorflow-estimator (tf.estimator then omitted)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tf115-wheel-") as tmp:
        if args.wheel_dir:
            tf_whl = _find_wheel(args.wheel_dir, TF_REQ)
            est_whl = None if args.no_estimator else _find_wheel(args.wheel_dir, EST_REQ)
        else:
            tf_whl = _download(TF_REQ, Path(tmp))
            est_whl = None if args.no_estimator else _download(EST_REQ, Path(tmp))

        wheels = [(tf_whl.name, _sha256(tf_whl))]
        if est_whl is not None:
            wheels.append((est_whl.name, _sha256(est_whl)))
        with zipfile.ZipFile(tf_whl) as tf_zip:
            est_zip = zipfile.ZipFile(est_whl) if est_whl is not None else None
            try:
                api = compat_v1_names(tf_zip, est_zip)
            finally:
                if est_zip is not None:
                    est_zip.close()
            mods = private_module_names(tf_zip)

    src_lines = [f"source wheel: {n} sha256={h}" for n, h in wheels]
    _write(
        args.out_dir / "tf115_compat_v1_api.txt",
        [
            "Public names reachable as tf.<name> after `import tensorflow.compat.v1 as tf`",
            "on TensorFlow 1.15.0. Generated by tools/make_tf115_manifest.py; do not edit.",
            *src_lines,
            "from: tensorflow_core/_api/v1/compat/v1/**/__init__.py (+ estimator, keras, flags hooks)",
            "A name is a module iff it is a proper prefix of another line.",
        ],
        api,
    )
    _write(
        args.out_dir / "tf115_python_modules.txt",
        [
            "Importable private modules of TensorFlow 1.15.0 (tensorflow_core/{python,core}/,",
            "imported as tensorflow.*). Generated by tools/make_tf115_manifest.py; do not edit.",
            src_lines[0],
            "Lines without ':' are modules/packages. 'pkg:name' = a public name defined by",
            "pkg/__init__.py (keras excluded); 'pkg:*' = that __init__ has a star import.",
        ],
        mods,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
