"""Audit a TF1 training graph for loss-scaling hazards, without running it.

``audit(graph, fetches)`` reads a graph definition (a ``tf.Graph``, a
``GraphDef`` or a ``MetaGraphDef``) and returns ``Finding``s: two loss-scale
checks racing on Ascend's float-status register, a collective inside a cond,
batch-norm statistics updated on skipped steps, a loss scale missing from the
checkpoint, and the other hazards listed in ``CODES`` and docs/audit.md.

It never imports the graph into a ``tf.Graph`` and never runs it, so it works
on a ``.meta`` file written on an Ascend host, with npu_bridge's op types
(``NpuGetFloatStatusV2``, ``HcomAllReduce``...) unregistered here::

  python -m npu_lossscale.audit model.meta --fetch train_op --json

Example::

  findings = npu_lossscale.audit(tf.get_default_graph(),
                                       fetches=[d_train_op, g_train_op])
  for finding in findings:
      print(finding.code, finding.severity, finding.message)
"""

from __future__ import absolute_import, division, print_function

import collections

import tensorflow.compat.v1 as tf

from npu_lossscale.audit import _checks
from npu_lossscale.audit import _facts
from npu_lossscale.audit import _graph
from npu_lossscale.audit._checks import CODES, Finding

__all__ = ["CODES", "Finding", "audit", "load_meta_graph", "trains"]

_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def audit(graph=None, fetches=None):
    """Finds loss-scaling hazards in a TF1 graph definition.

    Args:
      graph: a ``tf.Graph``, ``GraphDef`` or ``MetaGraphDef``; None audits
        the default graph. A ``GraphDef`` has no collections, so the checks
        that read them (trainable variables, UPDATE_OPS, savers' var lists)
        see less.
      fetches: what the user runs together in one ``session.run``: op or
        tensor names (``"train"``, ``"loss:0"``), ``tf.Operation``s or
        ``tf.Tensor``s, or a list or dict of them. Everything these depend
        on (data and control inputs, and the bodies of the If/While/call
        ops among them) counts as running in that step. None audits the
        whole graph as one run and adds an "info" finding saying which
        checks needed fetches.

    Returns:
      A list of ``Finding``s, errors first, then warnings, then info.

    Raises:
      TypeError: if ``graph`` is of another type, or a fetch is neither a
        name, an op nor a tensor.
      ValueError: if a fetch names no node of the graph, or an output the
        op does not have (``"train_op:7"``).
    """
    model = _graph.load(graph)
    requested = _fetches(fetches)
    if requested is None:
        run, fetched = set(model.nodes), False
    else:
        missing = [f.text for f in requested if f.node not in model.nodes]
        if missing:
            raise ValueError(
                "fetches %r name no node of the graph. Pass the names of the ops or "
                "tensors you run, e.g. 'train_op' or 'loss:0'." % (missing,))
        for fetch in requested:
            _check_output(model, fetch)
        run, fetched = model.ancestors([f.node for f in requested]), True
    context = _checks.Context(_facts.Facts(model), run, fetched)
    findings = []
    for check in _checks.CHECKS:
        findings.extend(check(context))
    if not fetched:
        findings.append(_checks.needs_fetches_note())
    findings.sort(key=lambda f: (_SEVERITY_ORDER[f.severity], f.code))
    return findings


def trains(graph, fetches):
    """Whether a run of ``fetches`` updates a variable through an optimizer.

    The port's ``--check`` audits only the runs that train; the initializer
    or a loss alone it passes over.

    Args:
      graph: a ``tf.Graph``, ``GraphDef`` or ``MetaGraphDef``.
      fetches: op or tensor names (``"train"``, ``"loss:0"``, ``"^init"``);
        a name of no node of the graph is passed over.

    Returns:
      True when the nodes the run needs include an optimizer's update of a
      variable (the updates the checks call train updates).

    Raises:
      TypeError: if ``graph`` is of another type.
    """
    model = _graph.load(graph)
    nodes = [name.lstrip("^").split(":")[0] for name in fetches]
    run = model.ancestors([node for node in nodes if node in model.nodes])
    return bool(set(run) & set(_facts.Facts(model).train_updates))


#: One fetch: as given (``text``), its node, and the output port it names
#: (None for an op).
Fetch = collections.namedtuple("Fetch", ["text", "node", "port"])


def _fetches(fetches):
    """The ``Fetch``es of ``fetches`` (None stays None).

    Raises:
      TypeError: for a fetch that is neither a name, an op nor a tensor.
      ValueError: for a tensor name whose port is not a number.
    """
    if fetches is None:
        return None
    if isinstance(fetches, dict):
        fetches = list(fetches.values())
    elif isinstance(fetches, (str, tf.Operation, tf.Tensor)) or not hasattr(fetches, "__iter__"):
        fetches = [fetches]
    found = []
    for fetch in fetches:
        if isinstance(fetch, (list, tuple, dict)):
            found.extend(_fetches(fetch))
            continue
        name = fetch if isinstance(fetch, str) else getattr(fetch, "name", None)
        if not isinstance(name, str):
            raise TypeError(
                "each fetch must be an op or tensor name, a tf.Operation or a "
                "tf.Tensor, got %r (%s). Pass e.g. train_op or 'train_op'."
                % (fetch, type(fetch).__name__))
        found.append(_parse_fetch(name))
    return found


def _parse_fetch(name):
    """'^a' or 'a' -> Fetch(name, 'a', None); 'a:1' -> Fetch(name, 'a', 1)."""
    bare = name[1:] if name.startswith("^") else name
    if ":" not in bare:
        return Fetch(name, bare, None)
    node, port = bare.rsplit(":", 1)
    if not port.isdigit():
        raise ValueError(
            "fetch %r has output %r, which is not a number. Name an op ('%s') or "
            "one of its outputs by index ('%s:0')." % (name, port, node, node))
    return Fetch(name, node, int(port))


def _check_output(model, fetch):
    """Refuses a fetch of an output its op does not have (when the graph
    tells how many the op has)."""
    if fetch.port is None:
        return
    count = model.output_count(fetch.node)
    if count is None or fetch.port < count:
        return
    if count == 0:
        fix = "fetch the op itself ('%s')" % fetch.node
    else:
        fix = "fetch one of %s, or the op itself ('%s')" % (
            ", ".join("'%s:%d'" % (fetch.node, i) for i in range(min(count, 4)))
            + (", ..." if count > 4 else ""), fetch.node)
    raise ValueError(
        "fetch %r asks for output %d of op %r (%s), which has %s; %s."
        % (fetch.text, fetch.port, fetch.node, model.nodes[fetch.node].type,
           "no outputs" if count == 0 else "%d output%s (numbered from 0)"
           % (count, "" if count == 1 else "s"), fix))


def load_meta_graph(path):
    """Reads a ``MetaGraphDef`` from a binary ``.meta`` file or a text proto.

    Args:
      path: the file written by ``tf.train.export_meta_graph`` or a Saver.

    Returns:
      A ``MetaGraphDef``.

    Raises:
      IOError: if the file cannot be read.
      ValueError: if the file is empty, holds no MetaGraphDef, or one whose
        graph has no nodes.
    """
    with open(path, "rb") as handle:
        data = handle.read()
    if not data.strip():
        raise ValueError(
            "%s is empty (%d bytes). Pass a .meta file written by "
            "tf.train.export_meta_graph or a Saver's save (re-export it if the write "
            "was cut short)." % (path, len(data)))
    meta = tf.MetaGraphDef()
    try:
        meta.ParseFromString(data)
        if meta.graph_def.node:
            return meta
    except Exception:  # pylint: disable=broad-except
        pass
    from google.protobuf import text_format  # pylint: disable=import-outside-toplevel
    meta = tf.MetaGraphDef()
    try:
        text_format.Merge(data.decode("utf-8"), meta)
    except Exception as error:  # pylint: disable=broad-except
        raise ValueError(
            "%s holds no MetaGraphDef, binary or text (%s). Pass a .meta file written "
            "by tf.train.export_meta_graph or a Saver's save." % (path, error))
    if not meta.graph_def.node:
        raise ValueError(
            "%s holds a MetaGraphDef whose graph has no nodes. Export the graph after "
            "building it (tf.train.export_meta_graph or a Saver's save)." % (path,))
    return meta
