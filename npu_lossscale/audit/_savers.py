"""The graph's savers: what each saves, and the tensor its checkpoint
prefix comes from.
"""

from __future__ import absolute_import, division, print_function

import collections

from npu_lossscale.audit import _collections

__all__ = ["SAVE_TYPES", "SaverUse", "find"]

#: One Saver of the graph: its name (top name scope), its save op names,
#: the set of variables it saves, and the name of its filename tensor (the
#: checkpoint prefix ``Saver.save`` feeds; None where the graph does not
#: show one).
SaverUse = collections.namedtuple("SaverUse", ["name", "saves", "saved", "filename"])

SAVE_TYPES = {"SaveV2": 3, "Save": 2, "SaveSlices": 3}


def find(model, variables):
    """The ``SaverUse``s of the graph's savers.

    Args:
      model: a ``GraphModel``.
      variables: the names of its variable nodes.

    Returns:
      A list of ``SaverUse``.
    """
    save_nodes = [n for n, node in model.nodes.items() if node.type in SAVE_TYPES]
    result, covered = [], set()
    for saver_def in model.collections.saver_defs:
        root = _collections.node_name(saver_def.save_tensor_name)
        if root not in model.nodes:
            continue
        saves = [n for n in model.ancestors([root]) if n in save_nodes]
        if saves:
            covered |= set(saves)
            result.append((root.split("/")[0], saves, saver_def.filename_tensor_name))
    leftovers = {}
    for name in save_nodes:
        if name not in covered:
            leftovers.setdefault(name.split("/")[0], []).append(name)
    result.extend((scope, saves, None) for scope, saves in sorted(leftovers.items()))
    named = []
    for saver, saves, filename in result:
        saved = set()
        for save in saves:
            node = model.nodes[save]
            sources = [s for s, _ in node.inputs[SAVE_TYPES[node.type]:]]
            saved |= model.ancestors(sources, data_only=True) & variables
        named.append(SaverUse(saver, sorted(saves), saved,
                              filename or _prefix_input(model, saves[0])))
    return named


def _prefix_input(model, save):
    """The placeholder a save op's prefix comes from (``<scope>/Const:0``
    for a ``tf.train.Saver``), as a tensor name, or None."""
    node = model.nodes[save]
    if not node.inputs:
        return None
    for name in sorted(model.ancestors([node.inputs[0][0]], data_only=True)):
        if model.nodes[name].type in ("PlaceholderWithDefault", "Placeholder"):
            return name + ":0"
    return None
