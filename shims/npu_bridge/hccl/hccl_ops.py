"""Shim of ``npu_bridge.hccl.hccl_ops`` (allreduce only).

Single worker only: with ``RANK_SIZE`` unset or "1" allreduce is the
identity for every reduction (a reduction over one rank); a larger
``RANK_SIZE`` raises NotImplementedError when the op is built.
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
