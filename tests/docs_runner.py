"""Runs documentation blocks one after another in this interpreter.

Usage: ``docs_runner.py JOBS.json RESULTS.json`` (readme_blocks.run_blocks
starts it). Each job runs in a fresh ``tf.Graph``, a namespace of its own and
its own working directory: the set-up's code, then the block's (its output
captured, and given to the checks as ``block_output``), then the set-up's
checks. The results map each job's id to ``{"ok", "stdout", "error"}``.
"""

import contextlib
import io
import json
import os
import sys
import traceback


def _close_sessions(namespace):
    for value in namespace.values():
        close = getattr(value, "close", None)
        if type(value).__name__ in ("Session", "FirstRunInitialises") and close:
            close()


def _reset_shim():
    emulation = sys.modules.get("npu_bridge._emulation")
    if emulation is not None:
        emulation.reset()


def run(job):
    """Runs one job; returns its result."""
    import tensorflow.compat.v1 as tf  # pylint: disable=import-outside-toplevel
    os.makedirs(job["cwd"])
    os.chdir(job["cwd"])
    namespace = {"__name__": "__main__"}
    printed = io.StringIO()
    stage = "set-up"
    try:
        with tf.Graph().as_default():
            exec(compile(job["setup"], "<set-up of %s>" % job["id"], "exec"), namespace)  # pylint: disable=exec-used
            stage = "block"
            with contextlib.redirect_stdout(printed):
                exec(compile(job["code"], job["id"], "exec"), namespace)  # pylint: disable=exec-used
            namespace["block_output"] = printed.getvalue()
            stage = "checks after"
            exec(compile(job["after"], "<checks after %s>" % job["id"], "exec"), namespace)  # pylint: disable=exec-used
            _close_sessions(namespace)
        return {"ok": True, "stdout": printed.getvalue(), "error": None}
    except BaseException:  # pylint: disable=broad-except
        return {"ok": False, "stdout": printed.getvalue(),
                "error": "in the %s:\n%s" % (stage, traceback.format_exc()[-4000:])}
    finally:
        _reset_shim()


def main(jobs_path, results_path):
    with open(jobs_path) as handle:
        jobs = json.load(handle)
    results = dict((job["id"], run(job)) for job in jobs)
    with open(results_path, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
