"""The README's runnable examples: a ``<!-- name -->`` python block, run as a
script, and the ``<!-- name-output -->`` text block that shows its output."""

import os
import re
import subprocess
import sys

from conftest import REPO


def block(name, language="python"):
    """The README's block marked ``<!-- name -->``, or None."""
    with open(os.path.join(REPO, "README.md")) as handle:
        readme = handle.read()
    found = re.search(r"<!-- %s -->\s*```%s\n(.*?)```" % (re.escape(name), language),
                      readme, re.S)
    return found and found.group(1)


def run_example(name, tmp_path, timeout=300):
    """Runs the README's ``name`` block as written, in a fresh interpreter.

    Returns:
      ``(stdout, shown)``: what it printed, and the README's
      ``name-output`` text block (None when the README shows none).
    """
    code = block(name)
    assert code, "README lost its %r block" % name
    script = tmp_path / ("%s.py" % name.replace("-", "_"))
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, block(name + "-output", "text")
