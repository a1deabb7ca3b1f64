"""Shim of ``npu_bridge.estimator.npu.npu_config``: ``NPURunConfig``,
``DumpConfig``, ``ProfilingConfig``.

Mirrors tf_adapter/python/npu_bridge/estimator/npu/npu_config.py
(hicann/tensorflow). ``NPURunConfig`` is a ``tf.estimator.RunConfig`` with the
NPU fields that ModelZoo scripts set, kept as the real class keeps them
(``iterations_per_loop``, ``mix_compile_mode``, ``enable_data_pre_proc``,
``is_tailing_optimization`` and ``horovod_mode`` public; ``precision_mode``,
``hcom_parallel``, ``dump_config`` and the others as ``_<name>``), and the
real argument errors:

* ``iterations_per_loop`` not a positive int: TypeError / ValueError
  (``util.check_positive_integer``);
* ``mix_compile_mode`` not a bool: TypeError; True with
  ``iterations_per_loop`` != 1: ValueError;
* ``dump_config`` not a ``DumpConfig``: ValueError;
* ``horovod_mode`` not a bool, ``graph_run_mode`` > 1: ValueError;
* ``save_checkpoints_steps`` defaults to 100 when neither it nor
  ``save_checkpoints_secs`` is given.

The rest of the real constructor's arguments are accepted and stored; none of
them changes anything on CPU. ``tf.estimator`` is gone from TF 2.16 on: there
``NPURunConfig(...)`` raises ImportError, and the rest of the shim works.
"""
from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_bridge.estimator.npu import util

def estimator_module():
    """``tf.estimator`` (TF <= 2.15), or ImportError saying so."""
    estimator = getattr(tf, "estimator", None)
    if estimator is None:
        raise ImportError("npu_bridge shim: NPURunConfig and NPUEstimator need tf.estimator, "
                          "which TensorFlow removed in 2.16; run them on TF 2.15 "
                          "(make venv215).")
    return estimator


class DumpConfig(object):
    """Dump settings (stored only: the shim dumps nothing)."""

    def __init__(self, enable_dump=False, dump_path=None, dump_step=None, dump_mode="output",
                 enable_dump_debug=False, dump_debug_mode="all", dump_data="tensor",
                 dump_layer=None):
        self._enable_dump = enable_dump
        self._dump_path = dump_path
        self._dump_step = dump_step
        self._dump_mode = dump_mode
        self._enable_dump_debug = enable_dump_debug
        self._dump_debug_mode = dump_debug_mode
        self.dump_data = dump_data
        self.dump_layer = dump_layer


class ProfilingConfig(object):
    """Profiling settings (stored only)."""

    def __init__(self, enable_profiling=False, profiling_options=None):
        self._enable_profiling = enable_profiling
        self._profiling_options = profiling_options


def estimator_class(name):
    """``tf.estimator.<name>`` to derive from, or ``object`` where TF has no
    tf.estimator (the subclasses call ``estimator_module`` first, which raises
    there)."""
    estimator = getattr(tf, "estimator", None)
    return object if estimator is None else getattr(estimator, name)


class NPURunConfig(estimator_class("RunConfig")):
    """``tf.estimator.RunConfig`` with NPU support (see the module docstring).

    ``iterations_per_loop``: the train steps the device runs per
    ``Session.run``; the global step is then increased ``iterations_per_loop``
    times in one run, and ``save_checkpoints_steps`` should be a multiple of it.
    """

    def __init__(self, iterations_per_loop=1, profiling_config=None, model_dir=None,
                 tf_random_seed=None, save_summary_steps=0, save_checkpoints_steps=None,
                 save_checkpoints_secs=None, session_config=None, keep_checkpoint_max=5,
                 keep_checkpoint_every_n_hours=10000, log_step_count_steps=100,
                 distribute=None, enable_data_pre_proc=True, precision_mode=None,
                 enable_reduce_precision=False, variable_format_optimize=None,
                 mix_compile_mode=False, hcom_parallel=True, graph_memory_max_size=None,
                 variable_memory_max_size=None, dump_config=None,
                 stream_max_parallel_num=None, is_tailing_optimization=False,
                 horovod_mode=False, graph_run_mode=1, train_distribute=None,
                 eval_distribute=None, **other_npu_options):
        estimator_module()
        util.check_positive_integer(iterations_per_loop, "iterations_per_loop")
        if not isinstance(mix_compile_mode, bool):
            raise TypeError('"mix_compile_mode" type must be bool')
        if mix_compile_mode is True and iterations_per_loop != 1:
            raise ValueError('"iterations_per_loop" must be 1 with "mix_compile_mode" is True')
        if dump_config is not None and not isinstance(dump_config, DumpConfig):
            raise ValueError("`dump_config` must be provided with type `DumpConfig`")
        if not isinstance(horovod_mode, bool):
            raise ValueError('"horovod_mode" type must be bool')
        util.check_nonnegative_integer(graph_run_mode, "graph_run_mode")
        if graph_run_mode > 1:
            raise ValueError('"graph_run_mode" value must be 0 or 1')
        if save_checkpoints_secs is None and save_checkpoints_steps is None:
            save_checkpoints_steps = 100
        self.iterations_per_loop = iterations_per_loop
        self.mix_compile_mode = mix_compile_mode
        self.enable_data_pre_proc = enable_data_pre_proc
        self.is_tailing_optimization = is_tailing_optimization
        self.horovod_mode = horovod_mode
        self.graph_run_mode = graph_run_mode
        self.variable_format_optimize = variable_format_optimize
        self._profiling_config = profiling_config
        self._precision_mode = precision_mode
        self._enable_reduce_precision = enable_reduce_precision
        self._hcom_parallel = hcom_parallel
        self._graph_memory_max_size = graph_memory_max_size
        self._variable_memory_max_size = variable_memory_max_size
        self._dump_config = dump_config
        self._stream_max_parallel_num = stream_max_parallel_num
        self._distribute = distribute
        self._other_npu_options = dict(other_npu_options)
        kwargs = dict(model_dir=model_dir, tf_random_seed=tf_random_seed,
                      save_summary_steps=save_summary_steps,
                      save_checkpoints_steps=save_checkpoints_steps,
                      save_checkpoints_secs=save_checkpoints_secs,
                      session_config=session_config, keep_checkpoint_max=keep_checkpoint_max,
                      keep_checkpoint_every_n_hours=keep_checkpoint_every_n_hours,
                      log_step_count_steps=log_step_count_steps,
                      train_distribute=train_distribute, eval_distribute=eval_distribute)
        super(NPURunConfig, self).__init__(**kwargs)
