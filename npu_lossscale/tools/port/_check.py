"""``--check``: run the rewritten script and audit the graph it builds.

The command is the user's (``"python train.py --steps 2"``): its interpreter
runs ``_probe`` instead of the script, which runs the rewritten script as the
command would and audits each distinct training ``session.run``
(``npu_lossscale.audit``). The script named in the command is the input's;
the probe runs its rewritten copy.
"""

from __future__ import absolute_import, division, print_function

import json
import os
import re
import shlex
import subprocess
import tempfile

from npu_lossscale.tools.port._report import AuditedRun, CheckResult

#: Lines of the command's output kept in the report when it fails.
TAIL_LINES = 15
#: The folder that holds npu_lossscale/ (this file is npu_lossscale/tools/port/_check.py).
_LIBRARY_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def parse_command(command):
    """``(interpreter, script, args)`` of a ``python SCRIPT [ARGS]`` command.

    Raises:
      ValueError: for any other shape of command.
    """
    tokens = shlex.split(command)
    if len(tokens) < 2 or tokens[1].startswith("-") or not tokens[1].endswith(".py"):
        raise ValueError("--check %r is not 'python SCRIPT.py [ARGS...]'. Pass the command "
                         "that runs the script, e.g. 'python train.py --steps 2'." % command)
    return tokens[0], tokens[1], tokens[2:]


def rewritten_script(script, source, destination):
    """The rewritten copy of the script a command names.

    Args:
      script: the script as the command names it (absolute, or relative to
        the working directory or to INPUT's folder).
      source: INPUT (a file or a folder).
      destination: what the port wrote: the rewritten file, or the folder.

    Returns:
      The path to run, or None when the script is none of INPUT's.
    """
    path = os.path.abspath(script)
    if os.path.isdir(source):
        for root in (os.path.abspath(source), os.path.abspath(destination)):
            if path.startswith(root + os.sep):
                return os.path.join(destination, os.path.relpath(path, root))
        candidate = os.path.join(destination, script)
        return candidate if not os.path.isabs(script) and os.path.isfile(candidate) else None
    if path in (os.path.abspath(source), os.path.abspath(destination)) or (
            os.path.basename(script) == os.path.basename(source)):
        return destination
    return None


def run_check(command, script, timeout):
    """Runs the rewritten ``script`` as ``command`` runs its original.

    Args:
      command: the user's command, e.g. "python train.py --steps 2".
      script: the rewritten script to run in its place.
      timeout: seconds before the command is stopped.

    Returns:
      A ``CheckResult``.
    """
    interpreter, _, args = parse_command(command)
    handle, result_path = tempfile.mkstemp(suffix=".json", prefix="npu_lossscale_check_")
    os.close(handle)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_LIBRARY_ROOT] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    argv = [interpreter, "-m", "npu_lossscale.tools.port._probe", result_path, script] + list(args)
    try:
        try:
            done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  universal_newlines=True, timeout=timeout, env=env)
            returncode, output = done.returncode, done.stdout
        except subprocess.TimeoutExpired as expired:
            returncode, output = None, _text(expired.output) + "\n(stopped after %d s)" % timeout
        except OSError as error:
            returncode, output = None, "cannot run %s: %s" % (interpreter, error)
        with open(result_path) as result:
            text = result.read()
        runs = [AuditedRun(run["fetches"], [tuple(f) for f in run["findings"]])
                for run in (json.loads(text) if text.strip() else [])]
    finally:
        os.remove(result_path)
    return CheckResult(command, returncode, runs, "" if returncode == 0 else _tail(output))


#: The line of a traceback that names the exception (``module.Error: ...``).
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(:|$)")


def _tail(output):
    """The lines of a failed command's output the report keeps: the
    exception's own lines, then the last ``TAIL_LINES``. A TF error's
    message is followed by stack traces of where its ops were made (the
    "Original stack trace" parts), which would fill the tail with frames:
    its unindented lines (the message, the node) come first."""
    lines = output.splitlines()
    last = lines[-TAIL_LINES:]
    starts = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
    if not starts or starts[-1] >= len(lines) - TAIL_LINES:
        return "\n".join(last)
    message = [line for line in lines[starts[-1]:] if line.strip() and not line[0].isspace()]
    return "\n".join(message[:TAIL_LINES] + ["..."] + last)


def _text(output):
    if output is None:
        return ""
    return output.decode("utf-8", "replace") if isinstance(output, bytes) else output
