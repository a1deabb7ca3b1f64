"""Shim of ``npu_bridge.npu_init``: what ModelZoo scripts get from
``from npu_bridge.npu_init import *``.

Mirrors tf_adapter/python/npu_bridge/npu_init.py (hicann/tensorflow), which
has no ``__all__``: a star import brings every public name it imports or
defines.  The shim exports the ones that make sense on CPU:

* optimizers and managers: NPULossScaleOptimizer, FixedLossScaleManager,
  ExponentialUpdateLossScaleManager, NPUOptimizer, NPUDistributedOptimizer,
  npu_distributed_optimizer_wrapper, npu_tf_optimizer (=
  ``NPUDistributedOptimizer(opt)``), npu_allreduce (real home:
  estimator/npu/npu_optimizer.py, see below);
* hooks: NPUBroadcastGlobalVariablesHook, npu_hooks_append (appends
  ``NPUBroadcastGlobalVariablesHook(0, int(RANK_ID or 0))``), NpuEmptyHook,
  SetIterationsVarHook, NPUCheckpointSaverHook;
* the Estimator: NPUEstimator, NPUEstimatorSpec, NPURunConfig, DumpConfig,
  ProfilingConfig (tf.estimator, so TF <= 2.15; on a newer TF they import and
  raise ImportError when used), and the device loop of
  ``iterations_per_loop`` (``util.set_iteration_per_loop``, emulated by
  ``npu_bridge._device_loop``);
* npu_ops: initialize_system, shutdown_system, NPUInit, NPUShutdown, dropout;
* config: npu_config_proto, npu_graph_options, npu_optimizer_options,
  experimental_options, RewriterConfig, config_pb2, rewriter_config_pb2;
* sessions: close_session(sess) (``sess.close()``);
* modules: npu_ops, npu_plugin, npu_strategy, util, hccl_ops, session, session_run_hook, os, and
  ``tf``.  The real module does ``import tensorflow as tf`` (TF 1.15's API);
  on TF 2 the shim exports ``tensorflow.compat.v1`` under that name, so a
  script's ``tf`` stays the TF1 API after the star import.

``npu_config_proto(config_proto=None)`` (real semantics): a ConfigProto
(a new one unless a ConfigProto is passed, which is modified in place)
with a custom graph optimizer named ``NpuOptimizer`` (added once; when it is
added, ``memory_optimization`` is set OFF), ``allow_soft_placement=True``,
``log_device_placement=False``, ``remapping=OFF`` and
``global_jit_level=OFF``.  Stock TensorFlow on CPU cannot find a custom
optimizer called NpuOptimizer and skips it, so sessions made with it run
the graph on CPU.

``npu_allreduce(values, reduction="mean", fusion=1, fusion_id=-1,
group="hccl_world_group")`` is the real module's import from
``estimator/npu/npu_optimizer.py``: each value summed over the ranks with
``hccl_ops.allreduce`` (divided by the rank count for "mean"), an
IndexedSlices gathered with two ``hccl_ops.allgather`` calls.

Not emulated (they need the device, Keras session plumbing, tf.estimator
or CANN's separate ``hccl`` package); shims/README.md lists every one of
them: MemoryConfig, DynamicInputConfig,
decorator_tf_session, KerasDistributeOptimizer, the other hooks
(NPUOutputTensorHook, TellMeStepOrLossHook),
NPUBroadcastGlobalVariablesCallback, npu_rnn, npu_scope, keras_to_npu, npu_unary_ops, npu_cpu_ops,
profiler, scoped_graph_manager, Keras' ``backend``, init_resource /
shutdown_resource, get_npu_rank_id & co., the ``hccl.manage.api`` /
``hccl.split.api`` functions, npu_run_config_init,
set_keras_session_npu_config, npu_keras_optimizer, npu_clear_session,
npu_callbacks_append.  The real module also patches ``Session.__init__``
and ``InteractiveSession.__init__`` so that every session gets the
npu_config_proto settings; the shim does not (it would outlive the shim in a
test process).
"""
import os  # noqa: F401  (exported, as by the real module)

import tensorflow.compat.v1 as tf  # noqa: F401  (exported as ``tf``)
from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: F401
from tensorflow.core.protobuf.rewriter_config_pb2 import RewriterConfig
from tensorflow.python.client import session  # noqa: F401
from tensorflow.python.training import session_run_hook

from npu_bridge.estimator import npu_ops  # noqa: F401
from npu_bridge.estimator.npu import npu_plugin  # noqa: F401
from npu_bridge.estimator.npu import util  # noqa: F401
from npu_bridge.estimator.npu.npu_config import DumpConfig  # noqa: F401
from npu_bridge.estimator.npu.npu_config import NPURunConfig  # noqa: F401
from npu_bridge.estimator.npu.npu_config import ProfilingConfig  # noqa: F401
from npu_bridge.estimator.npu.npu_estimator import NPUEstimator  # noqa: F401
from npu_bridge.estimator.npu.npu_estimator import NPUEstimatorSpec  # noqa: F401
from npu_bridge.estimator.npu.npu_hook import NPUBroadcastGlobalVariablesHook
from npu_bridge.estimator.npu.npu_hook import NPUCheckpointSaverHook  # noqa: F401
from npu_bridge.estimator.npu.npu_hook import SetIterationsVarHook  # noqa: F401
from npu_bridge.estimator.npu.npu_loss_scale_manager import ExponentialUpdateLossScaleManager  # noqa: F401
from npu_bridge.estimator.npu.npu_loss_scale_manager import FixedLossScaleManager  # noqa: F401
from npu_bridge.estimator.npu.npu_loss_scale_optimizer import NPULossScaleOptimizer  # noqa: F401
from npu_bridge.estimator.npu.npu_optimizer import NPUDistributedOptimizer
from npu_bridge.estimator.npu.npu_optimizer import NPUOptimizer  # noqa: F401
from npu_bridge.estimator.npu.npu_optimizer import npu_allreduce  # noqa: F401
from npu_bridge.estimator.npu.npu_optimizer import npu_distributed_optimizer_wrapper  # noqa: F401
from npu_bridge.estimator.npu import npu_strategy  # noqa: F401
from npu_bridge.hccl import hccl_ops  # noqa: F401

experimental_options = {
    "disable_model_pruning": False,
    "function_optimization": RewriterConfig.ON,
    "constant_folding": RewriterConfig.ON,
    "shape_optimization": RewriterConfig.ON,
    "arithmetic_optimization": RewriterConfig.ON,
    "loop_optimization": RewriterConfig.ON,
    "dependency_optimization": RewriterConfig.ON,
    "layout_optimizer": RewriterConfig.ON,
}


def npu_hooks_append(hooks_list=()):
    """``hooks_list`` (a new list unless a list is passed) plus the variable
    broadcast hook from rank 0."""
    if not isinstance(hooks_list, list):
        hooks_list = []
    hooks_list.append(NPUBroadcastGlobalVariablesHook(0, int(os.getenv("RANK_ID", "0"))))
    return hooks_list


def npu_config_proto(config_proto=None):
    """The session config npu_bridge wants (see the module docstring)."""
    if not isinstance(config_proto, config_pb2.ConfigProto):
        config_proto = config_pb2.ConfigProto()
    rewrite_options = config_proto.graph_options.rewrite_options
    if not any(c.name == "NpuOptimizer" for c in rewrite_options.custom_optimizers):
        rewrite_options.custom_optimizers.add().name = "NpuOptimizer"
        rewrite_options.memory_optimization = RewriterConfig.OFF
    config_proto.allow_soft_placement = True
    config_proto.log_device_placement = False
    rewrite_options.remapping = RewriterConfig.OFF
    config_proto.graph_options.optimizer_options.global_jit_level = config_pb2.OptimizerOptions.OFF
    return config_proto


def npu_graph_options(graph_options=None):
    """GraphOptions with XLA JIT off."""
    if not isinstance(graph_options, config_pb2.GraphOptions):
        graph_options = config_pb2.GraphOptions()
    graph_options.optimizer_options.global_jit_level = config_pb2.OptimizerOptions.OFF
    return graph_options


def npu_optimizer_options(optimizer_options=None):
    """OptimizerOptions with XLA JIT off."""
    if not isinstance(optimizer_options, config_pb2.OptimizerOptions):
        optimizer_options = config_pb2.OptimizerOptions()
    optimizer_options.global_jit_level = config_pb2.OptimizerOptions.OFF
    return optimizer_options


class NpuEmptyHook(session_run_hook.SessionRunHook):
    """A SessionRunHook that does nothing."""


def npu_tf_optimizer(opt):
    """``NPUDistributedOptimizer(opt)``."""
    return NPUDistributedOptimizer(opt)


def close_session(sess):
    """Closes ``sess``."""
    sess.close()
