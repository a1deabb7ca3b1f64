"""The graph mode of a test process, from NPU_LOSSSCALE_GRAPH_MODE.

The graph mode is process-global in TF, so every process the tests run
(pytest itself, tests/checkpoint_worker.py, tests/soak.py) sets it once,
through this one function:

* ``v2`` (default): v2 control flow and resource variables inside a tf.Graph
  (``disable_eager_execution`` only);
* ``v1``: ``disable_v2_behavior()``: ref variables and Switch/Merge conds.
"""

import os
import sys

ENV = "NPU_LOSSSCALE_GRAPH_MODE"


def import_tensorflow():
    """Imports and returns ``tensorflow.compat.v1`` without Keras.

    TF 2.15 and 2.21 import Keras while they are imported (tensorflow/
    __init__.py loads ``keras.src.optimizers`` for the SavedModel registry,
    and skips it on ImportError); Keras 3 brings scikit-learn and SciPy with
    it: a large part of TF's import time, in every test process
    (docs/benchmarks.md), and no test needs it there: a test that uses Keras
    imports it, and ``tf.keras`` still loads it on first use.
    """
    if "tensorflow" not in sys.modules and "keras" not in sys.modules:
        sys.modules["keras"] = None  # makes TF's eager import of Keras fail
        try:
            import tensorflow.compat.v1  # noqa: F401 pylint: disable=import-outside-toplevel
        finally:
            del sys.modules["keras"]
    import tensorflow.compat.v1 as tf  # pylint: disable=import-outside-toplevel
    return tf


def mode():
    """The graph mode NPU_LOSSSCALE_GRAPH_MODE names ("v2" when unset)."""
    return os.environ.get(ENV, "v2")


def set_graph_mode():
    """Sets the graph mode named by NPU_LOSSSCALE_GRAPH_MODE (and quiet logs).

    Returns:
      "v1" or "v2".

    Raises:
      ValueError: for any other value.
    """
    name = mode()
    if name not in ("v1", "v2"):
        raise ValueError("%s must be v1 or v2, got %r" % (ENV, name))
    tf = import_tensorflow()
    if name == "v1":
        tf.disable_v2_behavior()
    else:
        tf.disable_eager_execution()
    tf.logging.set_verbosity(tf.logging.ERROR)
    return name
