"""The README's quick start runs as written."""

import re

from readme_blocks import run_example


def test_quickstart_runs_as_written(tmp_path):
    stdout, _ = run_example("quickstart", tmp_path)
    match = re.search(r"global step (\d+) skipped (\d+) loss scale ([\d.]+)", stdout)
    assert match, stdout
    step, skipped = int(match.group(1)), int(match.group(2))
    assert step + skipped == 20
