"""Which nodes belong to a loss's gradient: the ops of a ``gradients`` scope,
and the seeds that start each loss's backprop.
"""

from __future__ import absolute_import, division, print_function

import re

from npu_lossscale.core import graph_walk
from npu_lossscale.audit import _graph

__all__ = ["find_seeds", "is_gradient_op"]

_GRADIENT_SCOPE = re.compile(r"(^|/)gradients(_\d+)?/")
_SEED = re.compile(r"(^|/)grad_ys_\d+$")
#: Ops a gradient seed passes through on its way to the loss's gradient.
_IDENTITY_TYPES = graph_walk.IDENTITY_TYPES | frozenset(["IdentityN"])


def is_gradient_op(name):
    """True for a node of a ``gradients`` name scope or a gradient seed."""
    return bool(_GRADIENT_SCOPE.search(name) or _SEED.search(name))


def _consumers_through_identities(name, consumers, nodes):
    """Consumers of a node, looking through identities and the shim's
    instrumentation (which sits between a float16 tensor and its users):
    each identity's consumers in order, identities walked depth first."""

    def passes_on(consumer):
        return (_graph.is_shim_internal(consumer)
                or nodes[consumer].type in _IDENTITY_TYPES)

    result = []
    for node in graph_walk.depth_first(
            [name], lambda node: [c for c in consumers.get(node, ()) if passes_on(c)]):
        result.extend(c for c in consumers.get(node, ())
                      if c != name and c not in result and not passes_on(c))
    return result


def _forward_op_of(gradient_op, prefix, nodes):
    """X for a gradient op named ``<prefix>X_grad/...``, if X is a node."""
    if not gradient_op.startswith(prefix):
        return None
    rest = gradient_op[len(prefix):]
    start = 0
    while True:
        index = rest.find("_grad/", start)
        if index < 0:
            return None
        if rest[:index] in nodes:
            return rest[:index]
        start = index + 1


def find_seeds(model):
    """Gradient seeds and their losses.

    ``tf.gradients(ys, ...)`` seeds the backprop of each ``y`` with a
    ``Fill`` named ``<scope>/gradients/grad_ys_<i>``, or with an
    ``Identity`` of that name when the caller passes ``grad_ys`` (the
    library seeds with the loss scale). Its loss is the input of the
    ``Shape`` it fills (when the shape is not folded to a constant) or
    the forward op ``X`` that the gradient ops consuming the seed are
    named after (``<scope>/gradients/X_grad/...``): the seed's own
    consumers first (an ``AddV2`` loss's gradient is identities named
    after it), then those behind identities.

    Args:
      model: a ``GraphModel``.

    Returns:
      A dict from gradient seed node to its loss node.
    """
    seeds = {}
    nodes = model.nodes
    consumers = graph_walk.children(
        nodes, lambda name: [source for source, _ in nodes[name].inputs])
    for name, node in nodes.items():
        if not _SEED.search(name) or not node.inputs:
            continue
        shape = nodes.get(node.inputs[0][0])
        if shape is not None and shape.type == "Shape" and shape.inputs:
            seeds[name] = shape.inputs[0][0]
            continue
        prefix = name[:name.rindex("grad_ys_")]
        for consumer in (list(consumers.get(name, ()))
                         + _consumers_through_identities(name, consumers, nodes)):
            loss = _forward_op_of(consumer, prefix, nodes)
            if loss is not None:
                seeds[name] = loss
                break
    return seeds
