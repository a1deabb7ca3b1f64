"""Shim of ``npu_bridge.estimator.npu.npu_strategy``.

Mirrors tf_adapter/python/npu_bridge/estimator/npu/npu_strategy.py
(hicann/tensorflow), the strategy Huawei's converter puts where a script
had ``MirroredStrategy`` (its ``tf_strategy`` mode): one replica in the
graph of each process, on the one device the process drives, and as many
replicas in sync as there are ranks.

``NPUStrategy(device="/cpu:0")``
    A ``StrategyV1`` over ``NPUExtended``, a ``OneDeviceExtended`` whose
    ``num_replicas_in_sync`` is ``int(util.get_ranksize())`` (RANK_SIZE,
    else CM_WORKER_SIZE, default 1); any other ``device`` is a ValueError,
    as in the real class.  ``experimental_distribute_dataset`` shards the
    dataset by rank, ``dataset.shard(rank_size, rank_id)``: the real class
    asks CANN's ``hccl.manage.api`` (``get_rank_size``, ``get_rank_id``),
    which the shim does not have, so it reads the rank count as above and
    the rank from ``RANK_ID`` (default 0).  Like the real class, it reduces
    nothing itself: the gradients are reduced by HCCL (an optimizer wrapped
    with ``npu_distributed_optimizer_wrapper``, or npu_lossscale's
    ``distributed="hccl"``).
"""
from __future__ import absolute_import, division, print_function

import os

from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import one_device_strategy

from npu_bridge.estimator.npu import util as util_lib


def _rank_size():
    return int(util_lib.get_ranksize().strip() or "1")


def _rank_id():
    return int(os.environ.get("RANK_ID", "").strip() or "0")


class NPUExtended(one_device_strategy.OneDeviceExtended):
    """NPU implemented oneDevice strategy"""

    def __init__(self, container_strategy, device):
        super(NPUExtended, self).__init__(container_strategy, device)

    @property
    def _num_replicas_in_sync(self):
        return _rank_size()

    def _experimental_distribute_dataset(self, dataset, options=None):
        del options
        return dataset.shard(_rank_size(), _rank_id())


class NPUStrategy(distribute_lib.StrategyV1):
    """NPU distribute strategy"""

    def __init__(self, device="/cpu:0"):
        if device != "/cpu:0":
            raise ValueError('"device" only support "/cpu:0"')
        super(NPUStrategy, self).__init__(NPUExtended(self, device))
