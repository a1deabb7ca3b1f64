"""The ``--check`` side that runs in the script's own interpreter.

``python -m npu_lossscale.tools.port._probe RESULT.json SCRIPT [ARGS...]`` runs
SCRIPT as ``__main__`` with ARGS, as ``python SCRIPT ARGS`` would. Before the
first ``session.run`` of each distinct set of fetches that trains (whose ops
include an optimizer's update of a variable), it audits the session's graph
with those fetches (``npu_lossscale.audit``) and writes every audited run to
RESULT.json. A script that trains in no ``session.run`` gets its graph
audited whole when it ends. Only the port imports this module, and only in
the child process: it imports TensorFlow.
"""

from __future__ import absolute_import, division, print_function

import json
import os
import runpy
import sys

#: Distinct training runs audited at most (a loop fetches a few, not many).
MAX_RUNS = 10


class _Probe(object):
    """Audits the training runs of one process and records them."""

    def __init__(self, result_path):
        self._result_path = result_path
        self._seen = set()
        self._graphs = []
        self.runs = []

    def before_run(self, session, fetches):
        """Called with each ``session.run``'s fetches, before it runs."""
        graph = session.graph
        if not any(graph is g for g in self._graphs):
            self._graphs.append(graph)
        names = sorted(set(_fetch_names(fetches)))
        key = (id(graph), tuple(names))
        if key in self._seen or len(self.runs) >= MAX_RUNS:
            return
        self._seen.add(key)
        try:
            if not _trains(graph, names):
                return
            findings = _audit(graph, names)
        except Exception as error:  # pylint: disable=broad-except
            findings = [("audit-failed", "warning", "the audit failed: %s" % (error,))]
        self.runs.append({"fetches": names, "findings": findings})
        self.write()

    def finish(self):
        """Audits the last graph whole when no training run was seen."""
        if not self.runs:
            import tensorflow.compat.v1 as tf  # pylint: disable=import-outside-toplevel
            graphs = self._graphs or [tf.get_default_graph()]
            if graphs[-1].get_operations():
                self.runs.append({"fetches": ["(the whole graph: no training session.run)"],
                                  "findings": _audit(graphs[-1], None)})
        self.write()

    def write(self):
        with open(self._result_path, "w") as handle:
            json.dump(self.runs, handle)


def _fetch_names(fetches):
    """The names of the ops and tensors in a ``session.run`` fetch structure."""
    if isinstance(fetches, dict):
        fetches = list(fetches.values())
    if isinstance(fetches, (list, tuple)):
        names = []
        for fetch in fetches:
            names.extend(_fetch_names(fetch))
        return names
    if isinstance(fetches, str):
        return [fetches]
    name = getattr(fetches, "name", None)
    return [name] if isinstance(name, str) else []


def _trains(graph, names):
    """True when the ops a run needs include an optimizer's variable update."""
    from npu_lossscale.audit import trains  # pylint: disable=import-outside-toplevel
    return trains(graph, names)


def _audit(graph, names):
    from npu_lossscale.audit import audit  # pylint: disable=import-outside-toplevel
    return [(f.code, f.severity, f.message) for f in audit(graph, fetches=names)]


def _patch(probe):
    """Makes every ``tf.Session`` and ``tf.InteractiveSession`` tell the
    probe its fetches before it runs them."""
    import tensorflow.compat.v1 as tf  # pylint: disable=import-outside-toplevel

    def patched(original):
        def run(self, fetches, *args, **kwargs):
            probe.before_run(self, fetches)
            return original(self, fetches, *args, **kwargs)
        return run

    for cls in (tf.Session, tf.InteractiveSession):
        cls.run = patched(cls.run)


def main(argv=None):
    """Runs ``SCRIPT`` under the probe; returns its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    result_path, script, args = argv[0], argv[1], argv[2:]
    probe = _Probe(result_path)
    probe.write()
    _patch(probe)
    sys.argv = [script] + list(args)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        probe.finish()
    return status


if __name__ == "__main__":
    sys.exit(main())
