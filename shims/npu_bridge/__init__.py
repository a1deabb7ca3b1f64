"""CPU emulation ("shim") of the parts of Huawei's ``npu_bridge`` (Ascend TF
1.15 adapter) that npu_lossscale uses.  NOT the real package.

Only importable when ``shims/`` is put on ``sys.path`` explicitly.  Importing
it installs the float-status emulation (an op-creation callback, for the
importing thread) so that float16 ops built afterwards set the emulated
overflow register; see ``npu_bridge._emulation`` (shim-only controls) and
``shims/README.md``.

The real package is tf_adapter/python/npu_bridge/ (Huawei tf_adapter,
hicann/tensorflow or Ascend/tensorflow on GitHub).

Emulated public surface (mirrors the real module paths; the table in
shims/README.md names the tf_adapter source file of each):
  npu_bridge.npu_init  (``from npu_bridge.npu_init import *``)
  npu_bridge.helper.helper.get_gen_ops()
  npu_bridge.hccl.hccl_ops.allreduce(...) / broadcast(...)
  npu_bridge.estimator.npu.npu_plugin.is_inf_nan_enabled() / set_device_sat_mode()
  npu_bridge.estimator.npu.npu_loss_scale_manager.{FixedLossScaleManager,
      ExponentialUpdateLossScaleManager}
  npu_bridge.estimator.npu.npu_loss_scale_optimizer.NPULossScaleOptimizer
  npu_bridge.estimator.npu.npu_optimizer.{NPUOptimizer, NPUDistributedOptimizer,
      npu_distributed_optimizer_wrapper, allreduce}
  npu_bridge.estimator.npu.npu_hook.{NPUBroadcastGlobalVariablesHook,
      broadcast_global_variables, SetIterationsVarHook, NPUCheckpointSaverHook}
  npu_bridge.estimator.npu.util.{get_ranksize, set_iteration_per_loop,
      IterationPerLoop, create_or_get_var, check_positive_integer, ...}
  npu_bridge.estimator.npu.npu_config.{NPURunConfig, DumpConfig, ProfilingConfig}
  npu_bridge.estimator.npu.npu_estimator.{NPUEstimator, NPUEstimatorSpec}
  npu_bridge.estimator.npu_ops.{dropout, initialize_system, shutdown_system}

The device loop of ``iterations_per_loop`` is emulated by
``npu_bridge._device_loop`` (shim-only, called by the loop's own functions).
"""
from npu_bridge import _emulation

IS_CPU_SHIM = True  # marker: the real npu_bridge has no such attribute

_emulation.install()
