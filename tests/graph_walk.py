"""Graph inspections used by the tests: collectives inside conds."""

# Op types of the collectives a data-parallel step may contain.
COLLECTIVE_MARKERS = ("allreduce", "allgather", "broadcast", "hcom", "hccl")


def is_collective(op_type, op_name=""):
    """True for Horovod/HCCL collective op types (and the shim's stand-ins)."""
    text = (op_type + " " + op_name).lower()
    return any(marker in text for marker in COLLECTIVE_MARKERS)


# Names of the conds npu_lossscale builds (the apply, per-group applies, the
# accumulation window, the floor warning).
OUR_CONDS = ("apply_if_finite", "_if_finite", "window", "warn_at_floor")


def collectives_inside_conds(graph, only_ours=False):
    """Names of collective ops that sit inside a cond branch.

    v1 control flow: an op inside a cond has a control-flow context. v2
    control flow: cond branches are functions in the graph's library, so any
    collective node in a function body counts. With ``only_ours``, only the
    conds npu_lossscale builds are searched.
    """
    def ours(name):
        return not only_ours or any(marker in name for marker in OUR_CONDS)

    found = []
    for op in graph.get_operations():
        context = op._get_control_flow_context()  # pylint: disable=protected-access
        if (context is not None and is_collective(op.type, op.name)
                and ours(context.name)):
            found.append(op.name)
    for function in graph.as_graph_def().library.function:
        for node in function.node_def:
            if is_collective(node.op, node.name) and ours(function.signature.name):
                found.append("%s/%s" % (function.signature.name, node.name))
    return found


def collectives_outside_conds(graph):
    """Names of collective ops at the top level of the graph."""
    return [op.name for op in graph.get_operations()
            if op._get_control_flow_context() is None  # pylint: disable=protected-access
            and is_collective(op.type, op.name)]


def count_ops(graph, marker):
    """How many ops' type or name contains ``marker`` (case-insensitive)."""
    marker = marker.lower()
    return sum(1 for op in graph.get_operations()
               if marker in op.type.lower() or marker in op.name.lower())

