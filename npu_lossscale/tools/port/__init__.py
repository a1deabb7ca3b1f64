"""Port a TF1 training script to npu_lossscale in one command.

::

  python -m npu_lossscale.port train.py -o ported/train.py
  python -m npu_lossscale.port my_project/ -o ported/ --check "python train.py --steps 2"

INPUT (a file or a folder) is never written. Each ``.py`` file is rewritten
under OUTPUT (a folder's other files are copied as they are), and a report is
printed and written beside OUTPUT (``OUTPUT.port_report.txt``): what the port
changed, what it recognised but left alone, and what a person must do by
hand, each with file:line, the rule and the docs section to read
(docs/port.md).

Per-optimizer loss scaling over several optimizers (npu_bridge's
``NPULossScaleOptimizer``, contrib's ``LossScaleOptimizer``, TF's
``MixedPrecisionLossScaleOptimizer``, ``enable_mixed_precision_graph_rewrite``
per optimizer, or several ``minimize`` ops with no loss scaling) becomes one
``MultiOptimizerLossScale``; a single wrapper becomes ``LossScaleOptimizer``.
What the tool cannot prove keeps its meaning is left as it is and listed
under "by hand". Running it on its own output changes nothing.

The steps, one module each:

* ``_names``: what the TF, contrib and npu_bridge names mean;
* ``_find``: finding the patterns in one module (libcst and its metadata);
* ``_flow``: the order of statements (which assignment a read gets, what
  a line reads and binds);
* ``_plan``: deciding what each becomes, or why it cannot be done, in the
  steps the rewrite takes, each a set of functions that return edit
  records (``_edits``, which also merges them into the plan): tracing
  where optimizers, wrappers and managers come from (``_trace``, with
  npu_bridge's distributed layers in ``_engines``); the refusal rules
  (``_rules``, applied to a builder's groups by ``_checks``); the manager
  mapping (``_managers``); emitting the code (``_generate``, its lines
  wrapped and indented by ``_emit``); the report (``_entries``, the docs
  sections it names in ``_sections``);
* ``_rewrite``: applying the plan, keeping formatting and comments;
* ``_report``: the three lists and the check's findings;
* ``_check`` and ``_probe``: ``--check``, which runs the rewritten script
  (``_probe`` runs inside it) and audits the graph it builds.

libcst is an optional extra (``pip install '.[port]'``); nothing here imports
TensorFlow, except ``_probe`` inside the checked script's process.
"""

from __future__ import absolute_import, division, print_function

import argparse
import io
import os
import shutil
import sys
import tokenize

from npu_lossscale.tools.port._report import BY_HAND, Report

__all__ = ["port", "main", "REPORT_SUFFIX"]

#: The report's file name is OUTPUT's plus this.
REPORT_SUFFIX = ".port_report.txt"
INSTALL_HINT = "pip install '.[port]'"
_SKIPPED_FOLDERS = ("__pycache__", ".git", ".hg", ".svn")


def _require_libcst():
    """Raises ImportError naming the extra when libcst is missing."""
    try:
        import libcst  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        raise ImportError("npu_lossscale.port needs libcst, which is not installed. Install "
                          "the extra: %s (libcst 1.0.1)." % INSTALL_HINT)


def port(source, destination, check=None, check_timeout=600):
    """Ports a TF1 script, or every ``.py`` file of a folder.

    Args:
      source: INPUT, a script (read as Python whatever its name ends with)
        or a folder (its ``.py`` files ported, the others copied). It is
        only read.
      destination: OUTPUT. For a folder, the folder to write (made if
        missing). For a file, the file to write, or an existing folder to
        write it into under its own name.
      check: a command that runs the script, e.g. "python train.py --steps
        2", or None. The rewritten script runs in its place, and the graph it
        builds is audited (``npu_lossscale.audit``).
      check_timeout: seconds the check's command may run.

    Returns:
      The ``Report``, also written to the output's path plus
      ``REPORT_SUFFIX``.

    Raises:
      ValueError: if ``source`` does not exist, the output would write
        into ``source`` or over one of its files (a hard link, a file named
        as the report would be), cannot be written, or ``source`` is a
        folder and ``destination`` a file; or ``check`` is not a script
        command or names no script of ``source``.
      EnvironmentError: if a file of ``source`` cannot be read.
      ImportError: if libcst is not installed.
    """
    _require_libcst()
    from npu_lossscale.tools.port import (  # pylint: disable=import-outside-toplevel
        _check, _rewrite)
    if not os.path.exists(source):
        raise ValueError("source %r does not exist. Pass a .py file or a folder." % (source,))
    if check is not None:
        _check.parse_command(check)
    folder = os.path.isdir(source)
    if folder and os.path.exists(destination) and not os.path.isdir(destination):
        raise ValueError("output %r is a file, and the input %r is a folder. Pass a folder "
                         "(made if missing) as the output." % (destination, source))
    output = destination
    if not folder and (os.path.isdir(destination) or destination.endswith(os.sep)):
        output = os.path.join(destination, os.path.basename(source))
    _refuse_overlap(source, output, folder)
    inputs = [(relative, path, os.path.join(output, relative) if folder else output)
              for relative, path in _inputs(source, folder)]
    report_path = output.rstrip(os.sep) + REPORT_SUFFIX
    _refuse_same_files([(path, target) for _, path, target in inputs]
                       + [(path, report_path) for _, path, _ in inputs])
    report = Report()
    for relative, path, target in inputs:
        parent = os.path.dirname(target)
        if parent and not os.path.isdir(parent):
            _write(target, os.makedirs, parent)
        if folder and not path.endswith(".py"):  # a file named as INPUT is a script
            _write(target, shutil.copyfile, path, target)
            continue
        with open(path, "rb") as handle:
            raw = handle.read()
        report.files.append(relative)
        data = raw
        try:
            text, encoding = _decode(raw)
        except (SyntaxError, LookupError, UnicodeDecodeError) as error:
            report.add(BY_HAND, relative, 0, "unparsable",
                       "The file's bytes are not text in its encoding (%s); it is copied as it "
                       "is." % (error,))
        else:
            new, entries = _rewrite.port_source(text, relative)
            report.extend(entries)
            if new != text:
                data = new.encode(encoding)
        _write(target, _write_bytes, target, data)
    if check is not None:
        script = _check.rewritten_script(_check.parse_command(check)[1], source, output)
        if script is None:
            raise ValueError("check %r names no script of %r. Name the input script, e.g. "
                             "'python %s --steps 2'." % (check, source, report.files[0]
                                                         if report.files else "train.py"))
        report.check = _check.run_check(check, script, check_timeout)
    _write(report_path, _write_bytes, report_path, report.format().encode("utf-8"))
    return report


def _decode(raw):
    """``(text, encoding)`` of a Python source's bytes, in the encoding its
    coding line declares (PEP 263; UTF-8 without one). A UTF-8 byte-order
    mark stays in the text, so that it is written back.

    Raises:
      SyntaxError: a coding line that names an unknown encoding, or
        disagrees with the byte-order mark.
      UnicodeDecodeError: bytes that are not text in that encoding.
    """
    encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    if encoding == "utf-8-sig":
        encoding = "utf-8"
    return raw.decode(encoding), encoding


def _write_bytes(path, data):
    with open(path, "wb") as handle:
        handle.write(data)


def _write(path, function, *args):
    """Calls ``function(*args)``, which writes ``path``; an OS error (a
    folder that cannot be written, a full disk) becomes a ValueError that
    names the path and says the fix (the command exits 2 on it)."""
    try:
        function(*args)
    except (IOError, OSError) as error:
        raise ValueError("cannot write %r (%s). Pass an output you can write."
                         % (path, error.strerror or error))


def _refuse_same_files(pairs):
    """Raises ValueError when a file to write is one of INPUT's files under
    another name (a hard link, a symbolic link) or by its name."""
    for path, target in pairs:
        same = os.path.realpath(path) == os.path.realpath(target) or (
            os.path.exists(target) and os.path.samefile(path, target))
        if same:
            raise ValueError("writing %r would overwrite the input file %r (the same file "
                             "under another name). Pass an output that is not an input file."
                             % (target, path))


def _refuse_overlap(source, output, folder):
    """Raises ValueError when writing ``output`` could touch ``source``."""
    source_path, output_path = os.path.realpath(source), os.path.realpath(output)
    inside = (output_path == source_path
              or (folder and output_path.startswith(source_path + os.sep))
              or (folder and source_path.startswith(output_path + os.sep)))
    if inside:
        raise ValueError("output %r would write into the input %r. Pass an output outside it."
                         % (output, source))


def _inputs(source, folder):
    """``(relative, path)`` of each file to port or copy, in a fixed order."""
    if not folder:
        return [(os.path.basename(source), source)]
    found = []
    for root, folders, files in os.walk(source):
        folders[:] = sorted(f for f in folders if f not in _SKIPPED_FOLDERS)
        for name in sorted(files):
            path = os.path.join(root, name)
            found.append((os.path.relpath(path, source), path))
    return found


def main(argv=None):
    """The command line; returns the exit status.

    0: ported (by-hand items do not fail the run); 1: ``--check``'s command
    failed or the audit found an error; 2: a usage error (bad paths, a bad
    ``--check`` command, an OUTPUT that cannot be written or would
    overwrite an input file, an input that cannot be read, libcst missing).
    """
    parser = argparse.ArgumentParser(
        prog="python -m npu_lossscale.port",
        description="Port TF1 per-optimizer loss scaling to npu_lossscale; "
                    "write a report of what changed, what was left alone and "
                    "what to do by hand.")
    parser.add_argument("input", help="a .py file or a folder (never written)")
    parser.add_argument("-o", "--output", required=True,
                        help="where to write the ported file or folder")
    parser.add_argument("--check", metavar="COMMAND",
                        help="run the rewritten script as this command runs the input's "
                             "(e.g. \"python train.py --steps 2\") and audit its graph")
    parser.add_argument("--check-timeout", type=int, default=600, metavar="SECONDS",
                        help="seconds the --check command may run (default 600)")
    args = parser.parse_args(argv)
    try:
        report = port(args.input, args.output, check=args.check,
                      check_timeout=args.check_timeout)
    except (ValueError, ImportError) as error:
        sys.stderr.write("npu_lossscale.port: %s\n" % (error,))
        return 2
    except EnvironmentError as error:  # an input that cannot be read
        sys.stderr.write("npu_lossscale.port: cannot read %r (%s). Pass an input you can "
                         "read.\n" % (error.filename, error.strerror or error))
        return 2
    sys.stdout.write(report.format())
    return 1 if report.check_failed() else 0
