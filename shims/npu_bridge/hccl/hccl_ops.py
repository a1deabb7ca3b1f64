"""Shim of ``npu_bridge.hccl.hccl_ops`` (allreduce, allgather and broadcast).

Mirrors tf_adapter/python/npu_bridge/hccl/hccl_ops.py (hicann/tensorflow):
the same signatures and defaults, each a thin call of the generated op.

One rank (the rank count as ``npu_bridge.estimator.npu.util.get_ranksize()``
reads it: ``RANK_SIZE``, else ``CM_WORKER_SIZE``, default 1): both are the
identity.  Several ranks, one process per rank as on Ascend (``RANK_ID`` is
the rank, shim-only ``NPU_SHIM_HCCL_DIR`` a directory all of them can
write): a real collective across the processes through files, see
``npu_bridge._gen_npu_ops`` and shims/README.md.  Several ranks without
``NPU_SHIM_HCCL_DIR`` raise NotImplementedError when the op is built.

Not emulated: reduce, reduce_scatter, send/receive, the remote_*
and all-to-all ops, and groups other than the whole world (``group`` is
recorded on the node, not used).
"""
from npu_bridge.helper import helper

gen_hccl_ops = helper.get_gen_ops()


def allreduce(tensor, reduction, fusion=1, fusion_id=-1, group="hccl_world_group"):
    """Emulated HcomAllReduce; ``reduction`` in {"min", "max", "prod", "sum"}.

    Like the real generated op, a Python list input is packed into one
    tensor (``allreduce([status], "sum")`` gives shape [1] + status.shape).
    """
    return gen_hccl_ops.hcom_all_reduce(
        input=tensor,
        reduction=reduction,
        fusion=fusion,
        fusion_id=fusion_id,
        group=group)


def allgather(tensor, rank_size, group="hccl_world_group", fusion=0, fusion_id=-1):
    """Emulated HcomAllGather: every rank's ``tensor`` concatenated along
    dimension 0, in rank order; ``rank_size`` is the group's device count."""
    return gen_hccl_ops.hcom_all_gather(
        input=tensor,
        group=group,
        fusion=fusion,
        fusion_id=fusion_id,
        rank_size=rank_size)


def broadcast(tensor, root_rank, fusion=2, fusion_id=0, group="hccl_world_group"):
    """Emulated HcomBroadcast: ``tensor`` is a list of tensors (the real op's
    input is ``T: list(type)``); returns the list of root_rank's values."""
    return gen_hccl_ops.hcom_broadcast(
        input=tensor,
        fusion=fusion,
        fusion_id=fusion_id,
        group=group,
        root_rank=root_rank)
