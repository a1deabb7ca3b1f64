"""Test setup: graph mode, quiet TF logs, and small shared helpers.

The graph mode is process-global in TF, so it is chosen once, by the
environment variable NPU_LOSSSCALE_GRAPH_MODE (v2 by default, or v1; see
graph_mode.py).

``make test`` runs every test file under v2 and the Makefile's V1_TESTS under
v1 too.

Layout: a file per module of the step, named after it (test_plan.py,
test_gradients.py, test_overflow.py, test_window.py, test_close.py, with the
gate's in test_gate.py; test_update_ops.py, test_claims.py,
test_graph_state.py, ...); the public APIs end to end in test_builder.py,
test_optimizer.py, test_alternating.py and test_recipes.py; every refusal
in test_misuse.py, by the module that refuses, with the managers' in
test_manager_misuse.py. The two-group model is the ``gan`` fixture below;
models.py holds the shared models and set-ups.

Python processes that a test starts (the examples, the shim's HCCL ranks,
the parameter-server clusters, the docs' scripts) go through
``warm_python.run``/``warm_python.Popen``: each is a fresh process forked
from a server that has imported TensorFlow once, so that none of them
imports it again. NPU_LOSSSCALE_TESTS_FRESH=1 starts them as plain
interpreters instead. Tests that check what a module imports (no
TF) and horovodrun's ranks keep ``subprocess``.
"""

import gc
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import graph_mode  # noqa: E402

GRAPH_MODE = graph_mode.mode()
#: tensorflow.compat.v1, imported by pytest_configure.
tf = None


def pytest_configure(config):
    """Imports TF and sets the graph mode in each process that runs tests.

    pytest-xdist's controller only hands out files to its workers: it skips
    the import, which would delay every worker's start.
    """
    global tf  # pylint: disable=global-statement
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        return
    tf = graph_mode.import_tensorflow()
    graph_mode.set_graph_mode()
    # The objects of TF's import would otherwise be traversed by every full
    # collection of the worker's cyclic garbage collector.
    gc.freeze()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIMS = os.path.join(REPO, "shims")

#: Marks a test whose code runs in a fresh interpreter that chooses its own
#: graph mode (eager, or set in the script): this process's mode plays no
#: part, so the v1 leg would only repeat the v2 run.
fresh_process = pytest.mark.skipif(
    GRAPH_MODE == "v1", reason="runs in a fresh process with its own graph mode; "
                               "the v2 run of this file covers it")


#: The files that take longest, longest first. The Makefile runs each leg
#: on two pytest-xdist workers with ``--dist loadfile --no-loadscope-reorder``,
#: which hands out whole files in collection order; starting with the long
#: ones (whole scripts, several processes, many builds) lets the short ones
#: fill the end, so that both workers finish together. (xdist's own order,
#: by number of tests, would start these few-test files last.)
LONGEST_FIRST = (
    "test_distributed.py", "test_audit.py", "test_diagnostics.py", "test_porting.py",
    "test_examples.py", "test_benchmarks_quick.py", "test_npu_backend.py",
    "test_monitoring.py", "test_sync_replicas.py", "test_alternating.py", "test_port.py",
    "test_port_docs.py", "test_first_scale.py", "test_managers_listening.py",
)


def pytest_collection_modifyitems(items):
    """Orders the collected tests by LONGEST_FIRST, the rest after them in
    their own order (a stable sort: each file keeps its tests' order)."""
    rank = dict((name, index) for index, name in enumerate(LONGEST_FIRST))
    items.sort(key=lambda item: rank.get(os.path.basename(item.nodeid.split("::")[0]),
                                         len(rank)))


@pytest.fixture
def graph():
    """A fresh default graph with a fixed seed."""
    g = tf.Graph()
    with g.as_default():
        tf.set_random_seed(0)
        yield g


@pytest.fixture
def gan(graph):
    """The two-group set-up the step's tests share: ``models.two_group_gan()``
    (a generator and a discriminator, each loss reading both networks'
    weights) in a fresh ``graph``. ``models.add_gan_groups`` registers its
    two groups ("d", then "g"), each with its own optimizer."""
    from models import two_group_gan
    return two_group_gan()


def _drop_npu_shim():
    """Restores the shim's emulation defaults, removes its op-creation
    callbacks from this thread (those of an earlier import whose modules are
    gone too: they carry ``_npu_shim_callback``) and forgets its modules, so
    that the next ``import npu_bridge`` starts a fresh shim."""
    emulation = sys.modules.get("npu_bridge._emulation")
    if emulation is not None:
        emulation.reset()
        emulation.uninstall()
    from tensorflow.python.eager import context
    ctx = context.context()
    for callback in [c for c in ctx.op_callbacks if getattr(c, "_npu_shim_callback", False)]:
        ctx.remove_op_callback(callback)
    for name in [m for m in sys.modules if m == "npu_bridge" or m.startswith("npu_bridge.")]:
        del sys.modules[name]


@pytest.fixture
def npu_shim():
    """Puts shims/ first on sys.path for one test, so `import npu_bridge` works.

    The test starts from a fresh shim: one that an earlier test of this
    process left imported (through a copy of shims/ it put on sys.path, as
    examples/porting's ``use_npu`` does), with its overflow mode and its
    op-creation callback, is dropped first. A saturation mode left so
    clipped the float16 ops of every graph built after it, the ones of a
    test's scripts that never import the shim too. The copies of shims/ the
    test adds to sys.path go with it."""
    _drop_npu_shim()
    copies = sys.path.count(SHIMS)
    sys.path.insert(0, SHIMS)
    try:
        yield
    finally:
        _drop_npu_shim()
        while sys.path.count(SHIMS) > copies:
            sys.path.remove(SHIMS)


@pytest.fixture
def saturation_mode(npu_shim):
    """Saturation mode, the only mode in which tf_adapter reads the register.

    The switch is the real one: ``npu_plugin.set_device_sat_mode(0)``
    (tf_adapter ``npu_bridge/estimator/npu/npu_plugin.py``); ``npu_shim``'s
    teardown resets it.
    """
    from npu_bridge.estimator.npu import npu_plugin
    npu_plugin.set_device_sat_mode(0)


#: The builder's skipped-steps counter: library state, like a manager's, that
#: moves on a skipped step by design.
SKIPPED_STEPS = "loss_scale/skipped_steps"
#: The builder's last-skip record (npu_lossscale/diagnostics/), a variable
#: in no collection that a skipped step writes by design.
LAST_SKIP = "loss_scale/last_skip"


def snapshot_globals(sess, exclude=()):
    """Values of every global variable, by name (for skip-atomicity checks)."""
    variables = [v for v in tf.global_variables() if v.op.name not in exclude]
    values = sess.run(variables)
    return {v.op.name: np.array(val) for v, val in zip(variables, values)}


def op_ancestors(op):
    """Every op ``op`` needs to run (data and control inputs), itself included."""
    return _ancestors(_op_parents, [op])


def _op_parents(op):
    return [t.op for t in op.inputs] + list(op.control_inputs)


def _ancestors(parents, starts):
    seen, stack = set(), list(starts)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(parents(current))
    return seen


def _not_after(parents, roots, first, exempt):
    """The ancestors of ``roots`` that need not wait for ``first``, except
    the ``exempt`` ones. ``first``'s own ancestors count: they run before
    it, so it would wipe their overflows."""
    pending = [a for a in _ancestors(parents, roots) if a is not first]
    inside = getattr(first, "name", first) + "/"  # the clear's own ops
    pending = [a for a in pending if not getattr(a, "name", a).startswith(inside)]
    after, changed = set([first]), True
    while changed:  # more than one pass only for v1 loop back edges
        changed = False
        for current in pending:
            if current not in after and any(p in after for p in parents(current)):
                after.add(current)
                changed = True
    return [a for a in pending if a not in after and not exempt(a)]


def ops_not_after(op, first):
    """The ops ``op`` follows that compute but need not wait for ``first``.

    Walks ``op``'s ancestors (data and control inputs). Left out: graph
    inputs (ops without inputs, and ``placeholder_with_default``, which a
    run can feed) and the shim's status buffer (``NpuAllocFloatStatus`` takes no input on the device: tf_adapter
    ops/aicore/npu_mixed_precesion_ops.cc). An empty result means ``first``
    runs before every computation ``op`` depends on, in any run.
    """
    def exempt(current):
        return (not _op_parents(current) or current.type == "PlaceholderWithDefault"
                or _shim_op_type(current) == "NpuAllocFloatStatus")

    return sorted(a.name for a in _not_after(_op_parents, [op], first, exempt))


def _shim_op_type(op):
    try:
        return op.get_attr("_npu_shim_op_type").decode("utf-8")
    except (ValueError, TypeError):
        return None


#: Node types of a partition graph that compute nothing that can overflow.
_PLUMBING = frozenset(["Const", "_Arg", "_Retval", "_Recv", "_Send", "_HostRecv", "_HostSend",
                       "NoOp", "PlaceholderWithDefault"])


def partition_nodes_not_after(run_metadata, clear, roots=None):
    """``ops_not_after`` on the graph TF actually ran, after grappler.

    Args:
      run_metadata: a ``RunMetadata`` filled by a run with
        ``RunOptions(output_partition_graphs=True)``.
      clear: the name of the clear node (the register write itself, which
        survives grappler's removal of NoOps).
      roots: a predicate on node names; only the ancestors of the matching
        nodes are checked. None: every node of the run.

    Returns:
      The sorted names of computing nodes that need not wait for ``clear``.
    """
    nodes = {}
    for partition in run_metadata.partition_graphs:
        for node in partition.node:
            nodes[node.name] = node

    def parents(name):
        names = [i.lstrip("^").split(":")[0] for i in nodes[name].input]
        return [n for n in names if n in nodes]

    def exempt(name):
        node = nodes[name]
        shim_type = node.attr["_npu_shim_op_type"].s if "_npu_shim_op_type" in node.attr else b""
        return (not parents(name) or node.op in _PLUMBING
                or shim_type == b"NpuAllocFloatStatus")

    assert clear in nodes, "the run did not run %s" % clear
    roots = [n for n in nodes if roots(n)] if roots else list(nodes)
    assert roots, "no node of the run matched roots"
    return sorted(_not_after(parents, roots, clear, exempt))


def raises_with(error, *fragments):
    """pytest.raises that also checks the message names what went wrong."""
    class _Check(object):
        def __enter__(self):
            self._ctx = pytest.raises(error)
            self._info = self._ctx.__enter__()
            return self._info

        def __exit__(self, *exc):
            result = self._ctx.__exit__(*exc)
            message = str(self._info.value)
            for fragment in fragments:
                assert fragment in message, (fragment, message)
            return result
    return _Check()


def assert_float16_reduction_matches(ranks):
    """Two ranks' ``[w, is_finite, float32-reduced u, float16-reduced u, ...]``
    from the float16 all-reduce workers (Horovod's and the HCCL shim's): each
    rank's 40000 gradient averaged exactly where the float16 sum would
    overflow, and 64 random float16 gradients per rank reduced by
    ``allreduce_float16=True`` to the float32 reduction's values within
    float16 rounding, alike on both ranks."""
    expected = [float(np.float16(-1e-4 * 40000.0)), True]
    assert [rank[:2] for rank in ranks] == [expected, expected]
    for rank in ranks:
        wide, half = np.array(rank[2]), np.array(rank[3])
        assert np.all(np.isfinite(half)) and np.any(half != 0.0)
        # One float16 rounding of the halves and one of their sum: 2 ulps.
        np.testing.assert_allclose(half, wide, rtol=2 * 2.0 ** -10, atol=2.0 ** -14)
    assert ranks[0][2:4] == ranks[1][2:4]
