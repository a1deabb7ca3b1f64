"""Graph inspections used by the tests: collectives inside conds and gates."""

# Op types of the collectives a data-parallel step may contain.
COLLECTIVE_MARKERS = ("allreduce", "allgather", "broadcast", "hcom", "hccl")


def is_collective(op_type, op_name=""):
    """True for Horovod/HCCL collective op types (and the shim's stand-ins)."""
    text = (op_type + " " + op_name).lower()
    return any(marker in text for marker in COLLECTIVE_MARKERS)


# Names of the conds and gates npu_lossscale builds (the apply, per-group
# applies, the accumulation window, the floor warning).
OUR_CONDS = ("apply_if_finite", "_if_finite", "window", "warn_at_floor")


def _consumers(graph):
    """op -> the ops that take one of its outputs or it as a control input."""
    consumers = {}
    for op in graph.get_operations():
        for source in [t.op for t in op.inputs] + list(op.control_inputs):
            consumers.setdefault(source, []).append(op)
    return consumers


def gate_pivots(graph):
    """The true pivots of the apply gates (``commit.run_if``), found by their
    shape, not their names: an ``Identity`` of output 1 of a ``Switch`` that
    switches its predicate on itself, whose output 0 feeds a ``Merge``
    (directly, or through the skip branch's ``pivot_f`` and ``skipped``
    identities)."""
    consumers = _consumers(graph)
    pivots = []
    for op in graph.get_operations():
        if op.type != "Identity" or not op.inputs:
            continue
        switched = op.inputs[0]
        switch = switched.op
        if (switch.type != "Switch" or switched.value_index != 1
                or switch.inputs[0] is not switch.inputs[1]):
            continue
        if _false_merge(switch, consumers) is not None:
            pivots.append(op)
    return pivots


def _false_merge(switch, consumers):
    """The ``Merge`` that takes a ``Switch``'s output 0, directly or through
    a chain of identities (the skip branch of ``commit.run_if``), or None."""
    tensor = switch.outputs[0]
    while True:
        users = [c for c in consumers.get(tensor.op, ()) if tensor in list(c.inputs)]
        merges = [c for c in users if c.type == "Merge"]
        if merges:
            return merges[0]
        identities = [c for c in users if c.type == "Identity"]
        if len(identities) != 1:
            return None
        tensor = identities[0].outputs[0]


def _gate_merge(pivot, consumers):
    """The ``Merge`` that ends a pivot's gate (it takes the Switch's output 0)."""
    return _false_merge(pivot.inputs[0].op, consumers)


def gated_ops(graph, pivots=None):
    """Ops of the top-level graph inside an apply gate: every op downstream of
    a gate's true pivot, through data or control edges, short of the gate's
    own ``Merge`` (live on every step). v1 cond contexts and v2 branch
    functions are the other walks' business."""
    consumers = _consumers(graph)
    inside = set()
    for pivot in gate_pivots(graph) if pivots is None else pivots:
        merge = _gate_merge(pivot, consumers)
        stack = [pivot]
        while stack:
            for op in consumers.get(stack.pop(), ()):
                if op not in inside and op is not merge:
                    inside.add(op)
                    stack.append(op)
    return inside


def collectives_inside_conds(graph, only_ours=False):
    """Names of collective ops that sit inside a cond branch or an apply gate.

    v1 control flow: an op inside a cond has a control-flow context. v2
    control flow: cond branches are functions in the graph's library, so any
    collective node in a function body counts. Both: the apply gate is not a
    cond but a Switch whose true pivot every gated op depends on, so any
    collective downstream of a gate's pivot counts (``gated_ops``). With
    ``only_ours``, only the conds and gates npu_lossscale builds are searched.
    """
    def ours(name):
        return not only_ours or any(marker in name for marker in OUR_CONDS)

    pivots = [p for p in gate_pivots(graph) if ours(p.name)]
    found = sorted(op.name for op in gated_ops(graph, pivots)
                   if is_collective(op.type, op.name))
    for op in graph.get_operations():
        context = op._get_control_flow_context()  # pylint: disable=protected-access
        if (context is not None and is_collective(op.type, op.name)
                and ours(context.name) and op.name not in found):
            found.append(op.name)
    for function in graph.as_graph_def().library.function:
        for node in function.node_def:
            if is_collective(node.op, node.name) and ours(function.signature.name):
                found.append("%s/%s" % (function.signature.name, node.name))
    return found


def collectives_outside_conds(graph):
    """Names of collective ops at the top level of the graph, outside every
    apply gate."""
    inside = gated_ops(graph)
    return [op.name for op in graph.get_operations()
            if op._get_control_flow_context() is None  # pylint: disable=protected-access
            and op not in inside and is_collective(op.type, op.name)]


def count_ops(graph, marker):
    """How many ops' type or name contains ``marker`` (case-insensitive)."""
    marker = marker.lower()
    return sum(1 for op in graph.get_operations()
               if marker in op.type.lower() or marker in op.name.lower())

