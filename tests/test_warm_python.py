"""tests/warm_python.py against a real interpreter: a child forked from the
warm server sees what ``python`` would give it, and exits as it would."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import warm_python

PROBE = textwrap.dedent("""
    import json, os, sys
    import atexit
    atexit.register(lambda: print("atexit ran"))
    print(json.dumps({
        "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(),
        "env": os.environ.get("WARM_PROBE"), "name": __name__,
        "tf_mode": sys.modules.get("tensorflow") is None or
                   __import__("tensorflow").executing_eagerly(),
        "graph_mode_set": "graph_mode" in sys.modules,
    }))
    sys.stderr.write("to stderr\\n")
    sys.exit(int(os.environ.get("WARM_EXIT", "0")))
""")


def _both(args, tmp_path, **env):
    full = dict(os.environ, WARM_PROBE="seen", PYTHONPATH=str(tmp_path / "extra"), **env)
    real = subprocess.run(args, env=full, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=120)
    warm = warm_python.run(args, env=full, cwd=str(tmp_path), capture_output=True, text=True,
                           timeout=120)
    assert warm_python._warm(args, full), "the probe must run warm"  # noqa pylint: disable=protected-access
    return real, warm


def _fields(stdout):
    lines = stdout.splitlines()
    return json.loads(lines[0]), lines[1:]


@pytest.mark.parametrize("form", ["script", "-c", "-m"])
def test_a_warm_child_sees_what_a_fresh_interpreter_gives(tmp_path, form):
    (tmp_path / "extra").mkdir()
    (tmp_path / "probe.py").write_text(PROBE)
    if form == "script":
        args = [sys.executable, str(tmp_path / "probe.py"), "a", "b"]
    elif form == "-c":
        args = [sys.executable, "-c", PROBE, "a", "b"]
    else:
        args = [sys.executable, "-m", "probe", "a", "b"]
    real, warm = _both(args, tmp_path, WARM_EXIT="3")
    assert (warm.returncode, real.returncode) == (3, 3)
    real_fields, real_rest = _fields(real.stdout)
    warm_fields, warm_rest = _fields(warm.stdout)
    assert warm_fields == real_fields
    assert warm_rest == real_rest == ["atexit ran"]
    assert warm.stderr == real.stderr == "to stderr\n"


def test_an_uncaught_error_exits_1_with_its_traceback(tmp_path):
    args = [sys.executable, "-c", "raise KeyError('boom')"]
    real, warm = _both(args, tmp_path)
    assert warm.returncode == real.returncode == 1
    assert warm.stderr.splitlines()[-1] == real.stderr.splitlines()[-1] == "KeyError: 'boom'"


def test_a_timeout_and_a_kill_behave_as_subprocess(tmp_path):
    process = warm_python.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                stdout=warm_python.PIPE, stderr=warm_python.STDOUT)
    with pytest.raises(subprocess.TimeoutExpired):
        process.communicate(timeout=0.5)
    process.kill()
    assert process.wait(timeout=30) == -9


def test_fresh_mode_and_other_commands_use_subprocess(monkeypatch):
    monkeypatch.setenv("NPU_LOSSSCALE_TESTS_FRESH", "1")
    assert not warm_python._warm([sys.executable, "-c", "pass"], None)  # noqa pylint: disable=protected-access
    monkeypatch.delenv("NPU_LOSSSCALE_TESTS_FRESH")
    assert warm_python._warm([sys.executable, "-c", "pass"], None)  # noqa pylint: disable=protected-access
    for args in (["true"], [sys.executable, "-u", "x.py"], [sys.executable]):
        assert not warm_python._warm(args, None), args  # noqa pylint: disable=protected-access
    changed = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="7")
    assert not warm_python._warm([sys.executable, "-c", "pass"], changed)  # noqa pylint: disable=protected-access


def test_stdout_is_readable_while_the_child_runs_and_stderr_may_be_a_file(tmp_path):
    """The checkpoint test's pattern: read lines as they come, kill the
    child mid-run, find its stderr in the caller's own file."""
    code = ("import sys, time\nsys.stderr.write('err line\\n')\nsys.stderr.flush()\n"
            "print('ready', flush=True)\ntime.sleep(60)\n")
    with open(str(tmp_path / "stderr.txt"), "w+") as stderr:
        process = warm_python.Popen([sys.executable, "-c", code], stdout=warm_python.PIPE,
                                    stderr=stderr, universal_newlines=True)
        assert process._real is None  # noqa pylint: disable=protected-access
        assert process.stdout.readline() == "ready\n"
        assert process.poll() is None
        process.kill()
        assert process.wait(timeout=30) == -9
        assert process.stdout.read() == ""
        process.stdout.close()
        stderr.seek(0)
        assert stderr.read() == "err line\n"


def test_a_preloaded_module_is_imported_in_the_children_forked_after_it():
    """``preload`` imports in the server: a child started before it imports
    the module itself, one started after finds it in sys.modules; a module
    that cannot be imported is named, and the server goes on serving."""
    probe = [sys.executable, "-c", "import sys; print('wave' in sys.modules)"]
    assert warm_python.run(probe, capture_output=True, text=True).stdout == "False\n"
    warm_python.preload("wave")
    assert warm_python.run(probe, capture_output=True, text=True).stdout == "True\n"
    with pytest.raises(RuntimeError, match="cannot preload no_such_module_here"):
        warm_python.preload("no_such_module_here")
    assert warm_python.run(probe, capture_output=True, text=True).stdout == "True\n"
