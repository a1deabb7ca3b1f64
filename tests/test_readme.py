"""The README's quick start runs as written."""

import os
import re
import subprocess
import sys

from conftest import REPO


def test_quickstart_runs_as_written(tmp_path):
    readme = open(os.path.join(REPO, "README.md")).read()
    block = re.search(r"<!-- quickstart -->\s*```python\n(.*?)```", readme, re.S)
    assert block, "README lost its quickstart block"
    script = tmp_path / "quickstart.py"
    script.write_text(block.group(1))
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(r"global step (\d+) skipped (\d+) loss scale ([\d.]+)", out.stdout)
    assert match, out.stdout
    step, skipped = int(match.group(1)), int(match.group(2))
    assert step + skipped == 20
