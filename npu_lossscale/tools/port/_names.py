"""What the port recognises: the loss-scale wrappers, managers and optimizers
of TF 1.15, its contrib and npu_bridge, by qualified name.

A name is resolved through the script's imports (libcst's
``QualifiedNameProvider``), then normalised: ``tensorflow.compat.v1.x`` is
``tensorflow.x``, and TF 2.x's ``tensorflow.mixed_precision.x`` (the v1
mixed-precision API's later home) is ``tensorflow.train.experimental.x``. Two
spellings resolve without an import the provider can follow: the names a
``from npu_bridge.npu_init import *`` brings (that module has no
``__all__``), and ``tf.x`` where ``tf`` comes from such a star import.
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst
from libcst.metadata import QualifiedNameProvider

#: The star imports that bring npu_bridge's loss-scale names into a script.
NPU_STAR_MODULES = ("npu_bridge.npu_init",)

#: What ``from npu_bridge.npu_init import *`` brings that the port reads.
NPU_INIT_NAMES = {
    "NPULossScaleOptimizer": "npu_bridge.npu_init.NPULossScaleOptimizer",
    "ExponentialUpdateLossScaleManager": "npu_bridge.npu_init.ExponentialUpdateLossScaleManager",
    "FixedLossScaleManager": "npu_bridge.npu_init.FixedLossScaleManager",
    "NPUDistributedOptimizer": "npu_bridge.npu_init.NPUDistributedOptimizer",
    "npu_tf_optimizer": "npu_bridge.npu_init.npu_tf_optimizer",
    "npu_distributed_optimizer_wrapper": "npu_bridge.npu_init.npu_distributed_optimizer_wrapper",
    "tf": "tensorflow",
}

_PREFIXES = (
    ("tensorflow.compat.v1.mixed_precision.", "tensorflow.train.experimental."),
    ("tensorflow.compat.v1.", "tensorflow."),
    ("tensorflow.mixed_precision.", "tensorflow.train.experimental."),
    ("tensorflow.contrib.mixed_precision.python.loss_scale_optimizer.",
     "tensorflow.contrib.mixed_precision."),
    ("tensorflow.contrib.mixed_precision.python.loss_scale_manager.",
     "tensorflow.contrib.mixed_precision."),
)

#: The per-optimizer loss-scale wrappers, by kind.
NPU_BRIDGE, CONTRIB, TF_MIXED_PRECISION, GRAPH_REWRITE = (
    "npu_bridge", "contrib", "tf_mixed_precision", "graph_rewrite")

#: What each wrapper kind is called in the report.
WRAPPER_TITLES = {
    NPU_BRIDGE: "npu_bridge's NPULossScaleOptimizer",
    CONTRIB: "contrib's LossScaleOptimizer",
    TF_MIXED_PRECISION: "TF's MixedPrecisionLossScaleOptimizer",
    GRAPH_REWRITE: "enable_mixed_precision_graph_rewrite",
}

#: A manager the port maps to one of ours: its origin, our class, and our
#: keyword for each of its keywords, in its positional order.
ManagerMap = collections.namedtuple("ManagerMap", ["origin", "ours", "keywords"])

_FIXED = ("FixedLossScaleManager", (("loss_scale", "loss_scale"),
                                    ("enable_overflow_check", "enable_overflow_check")))
_EXPONENTIAL = ("ExponentialUpdateLossScaleManager", (
    ("init_loss_scale", "init_loss_scale"), ("incr_every_n_steps", "incr_every_n_steps"),
    ("decr_every_n_nan_or_inf", "decr_every_n_nan_or_inf"), ("incr_ratio", "incr_ratio"),
    ("decr_ratio", "decr_ratio")))
# TF 1.15's tf.train.experimental loss scales (the argument of
# MixedPrecisionLossScaleOptimizer and enable_mixed_precision_graph_rewrite).
_TF_FIXED = ("FixedLossScaleManager", (("loss_scale_value", "loss_scale"),))
_TF_DYNAMIC = ("DynamicLossScaleManager", (("initial_loss_scale", "initial_scale"),
                                           ("increment_period", "growth_steps"),
                                           ("multiplier", "multiplier")))


def _manager_maps():
    maps = {}
    for origin, prefixes in (("npu_bridge", ("npu_bridge.npu_init.",
                                             "npu_bridge.estimator.npu.npu_loss_scale_manager.")),
                             ("contrib", ("tensorflow.contrib.mixed_precision.",))):
        for ours, keywords in (_FIXED, _EXPONENTIAL):
            for prefix in prefixes:
                maps[prefix + ours] = ManagerMap(origin, ours, keywords)
    for name, (ours, keywords) in (("FixedLossScale", _TF_FIXED),
                                   ("DynamicLossScale", _TF_DYNAMIC)):
        maps["tensorflow.train.experimental." + name] = ManagerMap("tensorflow", ours, keywords)
    return maps


#: Qualified name -> ``ManagerMap``.
MANAGERS = _manager_maps()

#: Qualified name -> wrapper kind.
WRAPPERS = {
    "npu_bridge.npu_init.NPULossScaleOptimizer": NPU_BRIDGE,
    "npu_bridge.estimator.npu.npu_loss_scale_optimizer.NPULossScaleOptimizer": NPU_BRIDGE,
    "tensorflow.contrib.mixed_precision.LossScaleOptimizer": CONTRIB,
    "tensorflow.train.experimental.MixedPrecisionLossScaleOptimizer": TF_MIXED_PRECISION,
    "tensorflow.train.experimental.enable_mixed_precision_graph_rewrite": GRAPH_REWRITE,
}

#: Optimizer wrappers that average gradients across workers: a port of their
#: loss scaling needs the builder's ``distributed=`` (by hand).
DISTRIBUTED = frozenset([
    "npu_bridge.npu_init.NPUDistributedOptimizer", "npu_bridge.npu_init.npu_tf_optimizer",
    "npu_bridge.npu_init.npu_distributed_optimizer_wrapper",
    "npu_bridge.estimator.npu.npu_optimizer.NPUDistributedOptimizer",
    "npu_bridge.estimator.npu.npu_optimizer.npu_distributed_optimizer_wrapper",
    "horovod.tensorflow.DistributedOptimizer",
    "tensorflow.train.SyncReplicasOptimizer",
])

#: npu_bridge's distributed layers a script puts around a loss-scale
#: wrapper: "averaging" ones average the gradients across devices on any
#: launch (``npu_tf_optimizer`` is ``NPUDistributedOptimizer``), "inert" ones
#: only when several devices run (``npu_distributed_optimizer_wrapper``).
LAYERS = {
    "npu_bridge.npu_init.npu_tf_optimizer": "averaging",
    "npu_bridge.npu_init.npu_distributed_optimizer_wrapper": "inert",
    "npu_bridge.estimator.npu.npu_optimizer.npu_distributed_optimizer_wrapper": "inert",
}

CONTROL_DEPENDENCIES = "tensorflow.control_dependencies"
GROUP = "tensorflow.group"
SYNC_REPLICAS = "tensorflow.train.SyncReplicasOptimizer"
NAME_SCOPE = "tensorflow.name_scope"
GLOBAL_STEP_GETTERS = frozenset(["tensorflow.train.get_or_create_global_step",
                                 "tensorflow.train.get_global_step"])
#: The library itself: a script that imports it is (being) ported already.
LIBRARY = "npu_lossscale"
#: The library's tools, which an unported script may import (the audit of
#: its graph): importing them is not a port.
TOOL_MODULES = ("npu_lossscale.audit", "npu_lossscale.port", "npu_lossscale.tools")


def is_library_module(name):
    """True when importing module ``name`` (or a name of the package, as
    ``npu_lossscale.X``) makes a script one that uses the library: the
    package or its modules, not its tools."""
    if name.split(".")[0] != LIBRARY:
        return False
    return not any(name == tool or name.startswith(tool + ".") for tool in TOOL_MODULES)


def normalise(name):
    """The canonical spelling of a qualified name (see the module docstring)."""
    for prefix, canonical in _PREFIXES:
        if name.startswith(prefix):
            return canonical + name[len(prefix):]
    return name


def is_tf_optimizer(name):
    """True for TF 1.15's own ``tf.train.<X>Optimizer`` classes."""
    if not name or not name.startswith("tensorflow.train."):
        return False
    leaf = name[len("tensorflow.train."):]
    return "." not in leaf and leaf.endswith("Optimizer") and leaf not in (
        "Optimizer", "SyncReplicasOptimizer")


class Resolver(object):
    """Qualified names of expressions in one module.

    Args:
      visitor: a metadata-dependent libcst visitor whose dependencies include
        ``QualifiedNameProvider``, visiting the module.
      star_npu: whether the module star-imports npu_bridge's ``npu_init``.
    """

    def __init__(self, visitor, star_npu):
        self._visitor = visitor
        self._star_npu = star_npu

    def name_of(self, node):
        """The normalised qualified name of ``node`` (a Name or Attribute
        chain), or None when it resolves to nothing or to several things."""
        names = self._visitor.get_metadata(QualifiedNameProvider, node, set())
        if len(names) == 1:
            return normalise(next(iter(names)).name)
        if names or not self._star_npu:
            return None
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head in NPU_INIT_NAMES:
            return normalise(NPU_INIT_NAMES[head] + ("." + rest if rest else ""))
        return None


def _dotted(node):
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        return None
    parts.append(node.value)
    return ".".join(reversed(parts))
