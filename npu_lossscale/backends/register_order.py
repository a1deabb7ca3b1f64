"""The float-status register's clear ordering: the graph's one clear runs
before every op a read follows, and the record of who reads the register."""

from __future__ import absolute_import, division, print_function

import collections
import warnings

from npu_lossscale import tf_internals as _tf_internals
from npu_lossscale import plugin_helpers as _helpers


class Reader(collections.namedtuple("Reader", ["owner", "what"])):
    """An object that reads the float-status register, and its description."""


def order_after_clear(clear, tensors):
    """Makes every op that ``tensors`` (or ops) depend on run after ``clear``.

    ``clear`` becomes a control input of each ancestor that takes an input
    from a graph input: an op without inputs (placeholder, variable,
    constant) or a feedable op (``placeholder_with_default``, a get-next),
    which itself gets none, since feeding it would cut the edge out. Every
    other ancestor depends on those. Consumers of a chain of
    value-preserving ops after a graph input get it too
    (``_passes_on_input``). A fed tensor that is not a placeholder cuts its
    producer, and the edge, out of the run. Ops ``clear`` itself follows
    are left as they are.
    """
    passes = {}  # op -> whether it passes graph inputs on (_passes_on_input)

    def parents_of(op):
        return [tensor.op for tensor in op.inputs] + list(op.control_inputs)

    # What runs before ``clear`` (a sequence's sub-step clear follows the
    # sub-steps before it) stays there, and so do its ancestors.
    earlier = set(_helpers.depth_first(parents_of(clear), parents_of))
    roots = [getattr(t, "op", t) for t in tensors]
    for op in _helpers.depth_first(
            [op for op in roots if op is not clear and op not in earlier],
            lambda op: [parent for parent in parents_of(op)
                        if parent is not clear and parent not in earlier]):
        parents = parents_of(op)
        # Not on a feedable op: grappler drops its consumers' edges as
        # implied by its own, and a feed cuts both out. Not inside a v1
        # loop's frame, which an outside edge may not enter: its Enter ops.
        if (op.type not in _helpers.FEEDABLE_TYPES and clear not in parents
                and not _inside_loop(op)
                and any(_is_graph_input(parent) or _passes_on_input(parent, passes)
                        for parent in parents)):
            _helpers.defer_control_input(op, clear)


def _is_graph_input(op):
    return op.type in _helpers.FEEDABLE_TYPES or (
        len(op.inputs) == 0 and len(op.control_inputs) == 0)


def _passes_on_input(op, memo):
    """Whether ``op`` hands graph inputs on unchanged, through a chain of
    value-preserving ops (a variable's ``read``, a Reshape of a
    placeholder): grappler may move a following cast above the chain, away
    from its control inputs. Post order, each op decided once (``memo``).
    """
    stack, visiting = [op], set()
    while stack:
        current = stack[-1]
        if current in memo:
            stack.pop()
            continue
        if current.type not in _VALUE_PRESERVING_TYPES:
            memo[current] = False
            stack.pop()
            continue
        parents = [tensor.op for tensor in current.inputs if not _is_graph_input(tensor.op)]
        pending = [parent for parent in parents
                   if parent not in memo and parent not in visiting]
        if pending and current not in visiting:
            visiting.add(current)
            stack.extend(pending)
            continue
        memo[current] = all(memo.get(parent, False) for parent in parents)
        visiting.discard(current)
        stack.pop()
    return memo[op]


def _inside_loop(op):
    """Whether ``op`` runs in a v1 while loop's frame: inside the loop body,
    or an Enter into a loop nested in another loop."""
    context = _tf_internals.control_flow_context(op)
    loop = context.GetWhileContext() if context is not None else None
    if loop is None:
        return False
    if op.type in _helpers.ENTER_TYPES:
        outer = loop.outer_context
        return outer is not None and outer.GetWhileContext() is not None
    return True


#: Ops grappler may swap a cast with (core/grappler/op_types.cc,
#: IsValue*Preserving). Not Enter: an outside edge may not enter a frame.
_VALUE_PRESERVING_TYPES = _helpers.IDENTITY_TYPES | frozenset([
    "CheckNumerics", "PreventGradient", "StopGradient", "Print", "DebugGradientIdentity",
    "DeepCopy", "ExpandDims", "Reshape", "Squeeze", "Transpose"])


def claim_register(owner, what):
    """Records that ``owner`` (described by ``what``) reads the register in
    this graph, and warns when another object does too: each would skip, and
    lower its scale, for the other's overflow."""
    readers = _helpers.graph_state_of().register_readers
    if any(reader.owner is owner for reader in readers):
        return
    if readers:
        warnings.warn(
            "%s reads Ascend's float-status register, and so does %s in the same graph. "
            "The register cannot tell their overflows apart: fetched in one session.run, "
            "neither misses an overflow (the run clears the register once, first), but "
            "each also skips its step and lowers its loss scale for the other's "
            "overflow. Register every optimizer with one MultiOptimizerLossScale "
            "(build(per_group_ops=True) for alternating runs), or fetch one of them per "
            "run." % (what, readers[0].what),
            UserWarning, stacklevel=3)
    readers.append(Reader(owner, what))
