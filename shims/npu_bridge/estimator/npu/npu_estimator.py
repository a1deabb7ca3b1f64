"""Shim of ``npu_bridge.estimator.npu.npu_estimator``: ``NPUEstimator`` and
``NPUEstimatorSpec``.

Mirrors tf_adapter/python/npu_bridge/estimator/npu/npu_estimator.py
(hicann/tensorflow):

* ``NPUEstimator(model_fn, model_dir=None, config=None, params=None,
  job_start_file='', warm_start_from=None)``: ``config`` must be an
  ``NPURunConfig`` (ValueError otherwise, the real message); a ``model_dir``
  given both here and in the config must agree; the session config gets the
  ``NpuOptimizer`` custom optimizer with ``iterations_per_loop``,
  ``enable_data_pre_proc``, ``mix_compile_mode``, ``hcom_parallel`` and
  ``precision_mode`` (``__load_graph_optimizers``). In TRAIN mode the
  ``model_fn`` is wrapped as the real ``__augment_model_fn`` wraps it:

  - with more than one rank and not ``horovod_mode``, an
    ``NPUBroadcastGlobalVariablesHook``;
  - with ``save_checkpoints_steps`` or ``_secs``, an ``NPUCheckpointSaverHook``
    (so the Estimator adds no second saver);
  - an ``NPUEstimatorSpec``'s ``host_call`` runs once per iteration, after the
    iteration's ``train_op``;
  - with ``iterations_per_loop`` > 1, a ``SetIterationsVarHook`` and
    ``train_op = tf.group(train_op, name="IterationOp")``: the device loop
    (emulated by ``npu_bridge._device_loop``) runs the step that many times
    per ``Session.run``, and the global step moves as the step moves it.

* ``NPUEstimatorSpec(mode, ..., host_call=None)``: an ``EstimatorSpec`` with a
  ``host_call`` of ``(fn, [tensors])`` or ``(fn, {name: tensor})``, checked as
  the real ``_OutfeedHostCall.validate`` checks it.

What differs: the real ``host_call`` sends the tensors to the host through an
outfeed queue and calls ``fn`` on the host for each iteration; the shim calls
``fn`` once, on the tensors read after ``train_op``, and runs its ops in every
iteration. There is no job configuration (``JOB_ID``, ``job_start_file``) to
read, and the graph-optimizer names that stock TF lacks
(``GradFusionOptimizer``) are not added. ``tf.estimator`` is gone from TF 2.16
on: there construction raises ImportError.
"""
from __future__ import absolute_import, division, print_function

import inspect
import os

import tensorflow.compat.v1 as tf

from npu_bridge import _device_loop
from npu_bridge.estimator.npu import npu_config
from npu_bridge.estimator.npu import npu_hook
from npu_bridge.estimator.npu import util
from npu_bridge.estimator.npu.npu_config import NPURunConfig


def _check_host_call(host_call):
    """``_OutfeedHostCall.validate`` of the real module, for one host call."""
    if not isinstance(host_call, (tuple, list)):
        raise ValueError("{} should be tuple or list".format("host_call"))
    if len(host_call) != 2:
        raise ValueError("{} should have two elements.".format("host_call"))
    if not callable(host_call[0]):
        raise TypeError("{}[0] should be callable.".format("host_call"))
    if not isinstance(host_call[1], (tuple, list, dict)):
        raise ValueError("{}[1] should be tuple or list, or dict.".format("host_call"))
    if isinstance(host_call[1], (tuple, list)):
        spec = inspect.getfullargspec(host_call[0])
        args = [arg for arg in spec.args if arg != "self"]
        if spec.varargs is None and len(host_call[1]) != len(args):
            raise RuntimeError(
                "In TPUEstimatorSpec.{}, length of tensors {} does not match method args of "
                "the function, which takes {}.".format("host_call", len(host_call[1]), len(args)))


class NPUEstimatorSpec(npu_config.estimator_class("EstimatorSpec")):
    """An ``EstimatorSpec`` with a ``host_call`` (see the module docstring)."""

    def __new__(cls, mode, predictions=None, loss=None, train_op=None, eval_metric_ops=None,
                export_outputs=None, training_chief_hooks=None, training_hooks=None,
                scaffold=None, evaluation_hooks=None, prediction_hooks=None, host_call=None):
        npu_config.estimator_module()
        if host_call is not None:
            _check_host_call(host_call)
        spec = super(NPUEstimatorSpec, cls).__new__(
            cls, mode=mode, predictions=predictions, loss=loss, train_op=train_op,
            eval_metric_ops=eval_metric_ops, export_outputs=export_outputs,
            training_chief_hooks=training_chief_hooks, training_hooks=training_hooks,
            scaffold=scaffold, evaluation_hooks=evaluation_hooks,
            prediction_hooks=prediction_hooks)
        spec._host_call = host_call
        return spec


def _host_call_op(host_call, train_op):
    """The ops of ``host_call`` on its tensors as read after ``train_op``."""
    fn, tensors = host_call
    with tf.control_dependencies([train_op]):
        if isinstance(tensors, dict):
            result = fn(**dict((name, tf.identity(tensor)) for name, tensor in tensors.items()))
        else:
            result = fn(*[tf.identity(tensor) for tensor in tensors])
    flat = tf.nest.flatten(result) if result is not None else []
    # A resource variable's assign returns a variable-like value; its tensor
    # reads after the write.
    return tf.group(*[item if isinstance(item, tf.Operation) else tf.convert_to_tensor(item)
                      for item in flat])


class NPUEstimator(npu_config.estimator_class("Estimator")):
    """``tf.estimator.Estimator`` with NPU support (see the module docstring)."""

    def __init__(self, model_fn=None, model_dir=None, config=None, params=None,
                 job_start_file="", warm_start_from=None):
        npu_config.estimator_module()
        if config is None or not isinstance(config, NPURunConfig):
            raise ValueError("`config` must be provided with type `NPUConfigs`")
        config = _with_graph_optimizers(config)
        if model_dir is not None and config.model_dir is not None and model_dir != config.model_dir:
            raise ValueError(
                "model_dir are set both in NPUEstimator and NPURunConfig, but with "
                "different values. In constructor: '{}', in NPURunConfig: "
                "'{}' ".format(model_dir, config.model_dir))
        model_dir = model_dir or config.model_dir
        super(NPUEstimator, self).__init__(
            model_fn=_augmented(model_fn), model_dir=model_dir, config=config,
            params=params or {}, warm_start_from=warm_start_from)


def _with_graph_optimizers(config):
    """``config`` with the NpuOptimizer custom optimizer in its session config
    (``__load_graph_optimizers``)."""
    if config.session_config is None:
        config = config.replace(session_config=tf.ConfigProto())
    custom = config.session_config.graph_options.rewrite_options.custom_optimizers.add()
    custom.name = "NpuOptimizer"
    custom.parameter_map["enable_data_pre_proc"].b = config.enable_data_pre_proc
    custom.parameter_map["mix_compile_mode"].b = config.mix_compile_mode
    custom.parameter_map["use_off_line"].b = True
    custom.parameter_map["iterations_per_loop"].i = config.iterations_per_loop
    custom.parameter_map["is_tailing_optimization"].b = config.is_tailing_optimization
    custom.parameter_map["hcom_parallel"].b = config._hcom_parallel  # pylint: disable=protected-access
    if config._precision_mode is not None:  # pylint: disable=protected-access
        custom.parameter_map["precision_mode"].s = tf.compat.as_bytes(
            config._precision_mode)  # pylint: disable=protected-access
    return config


def _augmented(model_fn):
    """``model_fn`` with the NPU hooks and the loop of TRAIN mode
    (``__augment_model_fn``)."""
    model_fn_args = inspect.getfullargspec(model_fn).args

    def _model_fn(features, labels, mode, params, config):
        # ``config`` is the Estimator's own, with its model_dir.
        kwargs = {}
        for name, value in (("labels", labels), ("mode", mode), ("params", params),
                            ("config", config)):
            if name in model_fn_args:
                kwargs[name] = value
        spec = model_fn(features=features, **kwargs)
        if mode != tf.estimator.ModeKeys.TRAIN:
            return spec
        if not isinstance(spec, tf.estimator.EstimatorSpec):
            raise RuntimeError("estimator_spec used by NPU train must have type "
                               "`NPUEstimatorSpec` or `EstimatorSpec`. Got {}".format(type(spec)))
        hooks = []
        rank_size = util.get_ranksize()
        if rank_size.isdigit() and int(rank_size) > 1 and not config.horovod_mode:
            hooks.append(npu_hook.NPUBroadcastGlobalVariablesHook(
                0, int(os.getenv("RANK_ID", "0"))))
        if config.save_checkpoints_steps or config.save_checkpoints_secs:
            hooks.append(npu_hook.NPUCheckpointSaverHook(
                checkpoint_dir=config.model_dir, save_secs=config.save_checkpoints_secs,
                save_steps=config.save_checkpoints_steps,
                saver=tf.train.Saver(max_to_keep=config.keep_checkpoint_max, sharded=True)))
        host_call = getattr(spec, "_host_call", None)
        train_op = spec.train_op
        if host_call is not None:
            train_op = tf.group(train_op, _host_call_op(host_call, train_op))
        if config.iterations_per_loop > 1:
            hooks.append(npu_hook.SetIterationsVarHook(config.iterations_per_loop))
            train_op = tf.group(train_op, name=_device_loop.ITERATION_OP_NAME)
        return spec._replace(train_op=train_op,
                             training_hooks=tuple(hooks + list(spec.training_hooks or ())))

    return _model_fn
