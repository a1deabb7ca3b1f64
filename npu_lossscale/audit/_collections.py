"""What the audit reads from a graph's collections and saver definitions:
from a ``tf.Graph``'s collections, or from a ``MetaGraphDef``'s
``collection_def`` and ``saver_def`` (a ``GraphDef`` has neither).
"""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import tf_internals as _tf_internals

__all__ = ["Collections", "node_name", "of_graph", "of_meta_graph"]


def node_name(name):
    """'^a', 'a:0' or 'a' -> 'a'."""
    name = name[1:] if name.startswith("^") else name
    return name.split(":")[0]


class Collections(object):
    """What the audit reads from graph collections and the saver definition.

    Attributes:
      trainable: set of the trainable variables' node names.
      initializers: set of the variables' initializer op names.
      update_ops: set of node names in ``UPDATE_OPS``.
      global_step: set of node names in ``global_step``.
      local: set of the local and metric variables' node names.
      collected: set of the node names of every variable some variable
        collection holds (global, local, model). Empty when the graph
        came without collections.
      saver_defs: list of ``SaverDef`` protos (the MetaGraphDef's saver_def
        and the ``savers`` collection).
    """

    def __init__(self):
        self.trainable = set()
        self.initializers = set()
        self.update_ops = set()
        self.global_step = set()
        self.local = set()
        self.collected = set()
        self.saver_defs = []


def _names(items):
    names = set()
    for item in items:
        name = getattr(item, "name", None)
        if isinstance(name, str):
            names.add(node_name(name))
    return names


def of_graph(graph):
    """What the audit reads from a graph's collections.

    Args:
      graph: a ``tf.Graph``.

    Returns:
      A ``Collections``.
    """
    found = Collections()
    for key in ("trainable_variables", "trainable_resource_variables"):
        found.trainable |= _names(v.op for v in graph.get_collection(key)
                                  if hasattr(v, "op"))
    for key in ("variables", "local_variables", "model_variables"):
        found.collected |= _names(v.op for v in graph.get_collection(key) if hasattr(v, "op"))
        for var in graph.get_collection(key):
            initializer = getattr(var, "initializer", None)
            if initializer is not None:
                found.initializers.add(initializer.name)
    for key in ("local_variables", "metric_variables"):
        found.local |= _names(v.op for v in graph.get_collection(key) if hasattr(v, "op"))
    found.update_ops = _names(graph.get_collection(tf.GraphKeys.UPDATE_OPS))
    found.global_step = _names(graph.get_collection(tf.GraphKeys.GLOBAL_STEP))
    for saver in graph.get_collection(tf.GraphKeys.SAVERS):
        saver_def = getattr(saver, "saver_def", None)
        if saver_def is not None:
            found.saver_defs.append(saver_def)
    return found


def _variable_defs(meta, key):
    if key not in meta.collection_def:
        return []
    result = []
    for raw in meta.collection_def[key].bytes_list.value:
        var_def = _tf_internals.VariableDef()
        var_def.ParseFromString(raw)
        result.append(var_def)
    return result


def of_meta_graph(meta):
    """What the audit reads from a ``MetaGraphDef``'s ``collection_def``
    (``VariableDef`` protos and node lists) and ``saver_def``.

    Args:
      meta: a ``MetaGraphDef``.

    Returns:
      A ``Collections``.
    """
    found = Collections()
    for key in ("trainable_variables", "trainable_resource_variables"):
        found.trainable |= set(node_name(v.variable_name)
                               for v in _variable_defs(meta, key))
    for key in ("variables", "local_variables", "model_variables"):
        found.collected |= set(node_name(v.variable_name) for v in _variable_defs(meta, key))
        found.initializers |= set(node_name(v.initializer_name)
                                  for v in _variable_defs(meta, key) if v.initializer_name)
    for key in ("local_variables", "metric_variables"):
        found.local |= set(node_name(v.variable_name) for v in _variable_defs(meta, key))
    for key, target in ((tf.GraphKeys.UPDATE_OPS, "update_ops"),
                        (tf.GraphKeys.GLOBAL_STEP, "global_step")):
        if key in meta.collection_def:
            collection = meta.collection_def[key]
            names = list(collection.node_list.value)
            if not names:
                names = [v.variable_name for v in _variable_defs(meta, key)]
            setattr(found, target, set(node_name(n) for n in names))
    if meta.HasField("saver_def") and meta.saver_def.save_tensor_name:
        found.saver_defs.append(meta.saver_def)
    if tf.GraphKeys.SAVERS in meta.collection_def:
        for raw in meta.collection_def[tf.GraphKeys.SAVERS].bytes_list.value:
            saver_def = tf.train.SaverDef()
            saver_def.ParseFromString(raw)
            found.saver_defs.append(saver_def)
    return found
