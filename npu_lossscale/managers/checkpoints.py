"""Offline conversion of name-based checkpoints between the managers'
layouts: npu_lossscale 0.1's, npu_bridge's (and contrib's), and this version's
``[scale, good, bad, streak]`` state vector (``convert_checkpoint``)."""

from __future__ import absolute_import, division, print_function

import collections
import os
import re
import warnings

import tensorflow.compat.v1 as tf

from npu_lossscale.managers.counting import _BAD, _GOOD, _SCALE, _STATE_SIZE

# npu_lossscale 0.1: float32 scale, int32 counters and a bool under the scope.
_OLD_FIELD = re.compile(
    r"^(?P<prefix>(?:.*/)?)(?P<kind>dynamic|exponential)_loss_scale(?P<suffix>_\d+)?/"
    r"(?P<field>loss_scale|good_steps|bad_steps|overflows_at_floor|floor_warned)$")
# npu_bridge / contrib: variables "loss_scale" (float32), "good_steps" and
# "bad_steps" (int32) in the current name scope, TF-uniquified with _N
# (tf_adapter/python/npu_bridge/estimator/npu/npu_loss_scale_manager.py).
_NPU_BRIDGE_SCALE = re.compile(r"^(?P<prefix>(?:.*/)?)loss_scale(?P<suffix>_\d+)?$")
# Any field of that layout; at the top name scope (no prefix) is where
# npu_bridge's managers are when made outside any name scope, as tf_adapter's
# examples make them.
_NPU_BRIDGE_FIELD = re.compile(
    r"^(?P<prefix>(?:.*/)?)(?P<field>loss_scale|good_steps|bad_steps)(?P<suffix>_\d+)?$")
_STATE = re.compile(
    r"^(?P<prefix>(?:.*/)?)(?P<kind>dynamic|exponential)_loss_scale(?P<suffix>_\d+)?/state$")
_FORMATS = ("npu_lossscale", "npu_bridge")


class _Tensor(collections.namedtuple("_Tensor", ["value", "dtype"])):
    """One tensor of a checkpoint: its value (as read) and its dtype."""


class _Layout(collections.namedtuple("_Layout", ["dtype", "shape"])):
    """The dtype and shape a manager saves one of its variables with."""

    def holds(self, tensor):
        """Whether the ``_Tensor`` has exactly this dtype and shape."""
        return (tensor.dtype == self.dtype
                and tuple(getattr(tensor.value, "shape", ())) == self.shape)


# The exact layouts the managers write: a tensor is converted only when it and
# its siblings match one of them, so a user's own "model/loss_scale" or
# "good_steps" is copied unchanged.
# npu_lossscale 0.1: scalars; the first release had the three counters, the
# floor warning added "overflows_at_floor" and "floor_warned".
_OLD_LAYOUT = {
    "loss_scale": _Layout(tf.float32, ()),
    "good_steps": _Layout(tf.int32, ()),
    "bad_steps": _Layout(tf.int32, ()),
    "overflows_at_floor": _Layout(tf.int32, ()),
    "floor_warned": _Layout(tf.bool, ()),
}
_OLD_FIELD_SETS = (frozenset(["loss_scale", "good_steps", "bad_steps"]),
                   frozenset(_OLD_LAYOUT))
# npu_bridge / contrib: float32 and int32 scalars (contrib's
# tensorflow/contrib/mixed_precision/python/loss_scale_manager.py, which
# npu_bridge's ExponentialUpdateLossScaleManager subclasses).
_NPU_BRIDGE_LAYOUT = collections.OrderedDict([
    ("loss_scale", _Layout(tf.float32, ())),
    ("good_steps", _Layout(tf.int32, ())),
    ("bad_steps", _Layout(tf.int32, ())),
])
# This version: one float32[4] vector.
_STATE_LAYOUT = _Layout(tf.float32, (_STATE_SIZE,))


class _Converted(collections.namedtuple("_Converted", ["new", "consumed"])):
    """One conversion pass: tensors to write (name -> ``_Tensor``) and the
    names of the tensors they replace."""


def _state_from_old(tensors):
    """npu_lossscale 0.1's groups -> state vectors, as a ``_Converted``.

    A group converts only if its fields are one of ``_OLD_FIELD_SETS``, each
    with its exact layout, and its state name is not already taken.
    """
    groups = collections.OrderedDict()  # state name -> {field: tensor name}
    for name in sorted(tensors):
        match = _OLD_FIELD.match(name)
        if match:
            target = "%s%s_loss_scale%s/state" % (
                match.group("prefix"), match.group("kind"), match.group("suffix") or "")
            groups.setdefault(target, {})[match.group("field")] = name
    new, consumed = {}, set()
    for target, fields in groups.items():
        if (frozenset(fields) not in _OLD_FIELD_SETS or target in tensors
                or not all(_OLD_LAYOUT[field].holds(tensors[name])
                           for field, name in fields.items())):
            continue
        values = dict((field, tensors[name].value) for field, name in fields.items())
        state = [float(values["loss_scale"]), float(values["good_steps"]),
                 float(values["bad_steps"]), float(values.get("overflows_at_floor", 0))]
        new[target] = _Tensor(state, tf.float32)
        consumed.update(fields.values())
    return _Converted(new, consumed)


class _Triple(collections.namedtuple("_Triple", ["names", "target"])):
    """One npu_bridge manager in a checkpoint: its tensors' names (an ordered
    dict from field to name) and the name of the state it converts to."""


def _triple(scale, good=None, bad=None):
    """The ``_Triple`` of a manager whose scale is ``scale``: its counters
    carry the same scope and ``_N`` unless named. The state takes the scope
    and ``_N`` of ``scale``, or of ``good`` when it is named so (TF numbers
    the counters by manager unless a user's variable also has their name)."""
    match = _NPU_BRIDGE_SCALE.match(scale)
    prefix, suffix = match.group("prefix"), match.group("suffix") or ""
    names = collections.OrderedDict(
        (field, prefix + field + suffix) for field in _NPU_BRIDGE_LAYOUT)
    if good is not None:
        names["good_steps"], names["bad_steps"] = good, bad
        counter = _NPU_BRIDGE_FIELD.match(good)
        if counter and counter.group("field") == "good_steps":
            prefix, suffix = counter.group("prefix"), counter.group("suffix") or ""
    return _Triple(names, "%sexponential_loss_scale%s/state" % (prefix, suffix))


def _holds_triple(tensors, triple):
    return all(name in tensors and _NPU_BRIDGE_LAYOUT[field].holds(tensors[name])
               for field, name in triple.names.items())


def _top_scope_triples(tensors, taken):
    """The default's npu_bridge managers: the triples at the top name scope.

    A triple converts if all three exist with npu_bridge's exact layout, with
    one ``_N``, and its state name is neither in the checkpoint (which then
    holds this version's state: the triple is someone else's) nor in
    ``taken`` (names the 0.1 pass writes). A triple under a name scope is
    taken for a user's own and left, with a warning.

    Raises:
      ValueError: if a top-scope field of the layout has no siblings with
        its ``_N`` beside a whole triple: TF numbered a user's variable and
        a manager's apart, and only names tell which is the manager's.
    """
    triples, fields, paired, scoped = [], [], set(), []
    for name in sorted(tensors):
        match = _NPU_BRIDGE_FIELD.match(name)
        if (match and not match.group("prefix")
                and _NPU_BRIDGE_LAYOUT[match.group("field")].holds(tensors[name])):
            fields.append(name)
        match = _NPU_BRIDGE_SCALE.match(name)
        if not match or _OLD_FIELD.match(name):
            continue
        triple = _triple(name)
        if not _holds_triple(tensors, triple):
            continue
        if match.group("prefix"):
            scoped.append(name)
            continue
        paired.update(triple.names.values())
        if triple.target not in tensors and triple.target not in taken:
            triples.append(triple)
    unpaired = [name for name in fields if name not in paired]
    if triples and unpaired:
        raise ValueError(
            "npu_bridge_names is None and the top scope holds %s beside the triple(s) %s: "
            "which is a manager's is unclear. Pass npu_bridge_names=[(loss_scale, "
            "good_steps, bad_steps)] naming each manager's."
            % (unpaired, [t.names["loss_scale"] for t in triples]))
    if scoped:
        warnings.warn(
            "convert_checkpoint: %s have npu_bridge's layout under a name scope and "
            "were copied unchanged; pass npu_bridge_names=%r if they are a manager's."
            % (", ".join(scoped), scoped), UserWarning, stacklevel=4)
    return triples


def _named_triples(tensors, ours, names):
    """The npu_bridge managers ``npu_bridge_names`` asks for (``ours``: the
    0.1 pass's ``_Converted``).

    Raises:
      ValueError: if a named triple is not in the checkpoint with npu_bridge's
        layout, is npu_lossscale 0.1's, or its state name is taken.
    """
    triples = []
    for entry in names:
        triple = _triple(*((entry,) if isinstance(entry, str) else entry))
        if not _holds_triple(tensors, triple):
            found = ", ".join("%s %s" % (name, _describe(tensors.get(name)))
                              for name in triple.names.values())
            raise ValueError(
                "npu_bridge_names entry %r is not an npu_bridge manager here (%s). "
                "Name float32 and int32 scalars from tf.train.list_variables(source)."
                % (entry, found))
        if triple.target in tensors or triple.target in ours.new or (
                set(triple.names.values()) & ours.consumed):
            raise ValueError(
                "npu_bridge_names entry %r converts to %r, which this checkpoint already "
                "holds or the 0.1 layout uses. Leave that entry out." % (entry, triple.target))
        triples.append(triple)
    return triples


def _describe(tensor):
    """'float32[]' for a ``_Tensor``, 'missing' for None."""
    if tensor is None:
        return "missing"
    return "%s%s" % (tensor.dtype.name, list(getattr(tensor.value, "shape", ())))


def _state_from_npu_bridge(tensors, ours, names):
    """npu_bridge's triples -> exponential state vectors, as a ``_Converted``.

    Args:
      tensors: the checkpoint's tensors.
      ours: the 0.1 pass's ``_Converted`` (names it writes and consumes).
      names: ``npu_bridge_names`` as checked (None: the top scope's triples).
    """
    if names is None:
        triples = _top_scope_triples(tensors, set(ours.new))
    else:
        triples = _named_triples(tensors, ours, names)
    new, consumed = {}, set()
    for triple in triples:
        state = [float(tensors[name].value) for name in triple.names.values()] + [0.0]
        new[triple.target] = _Tensor(state, tf.float32)
        consumed.update(triple.names.values())
    return _Converted(new, consumed)


def _npu_bridge_from_state(tensors):
    """Exponential state vectors -> npu_bridge's triples, as a ``_Converted``.

    Raises:
      ValueError: if a name the triple needs is taken by another tensor.
    """
    new, consumed = {}, set()
    for name in sorted(tensors):
        match = _STATE.match(name)
        if (not match or match.group("kind") != "exponential"
                or not _STATE_LAYOUT.holds(tensors[name])):
            continue
        prefix, suffix = match.group("prefix"), match.group("suffix") or ""
        names = collections.OrderedDict(
            (field, prefix + field + suffix) for field in _NPU_BRIDGE_LAYOUT)
        taken = [other for other in names.values() if other in tensors]
        if taken:
            raise ValueError(
                "to=\"npu_bridge\": the state %r would become %s, overwriting %s "
                "(%s), which is not a manager's. Rename that variable and save again."
                % (name, ", ".join(names.values()), ", ".join(taken),
                   ", ".join("%s %s%s" % (other, tensors[other].dtype.name,
                                          list(getattr(tensors[other].value, "shape", ())))
                             for other in taken)))
        state = [float(x) for x in tensors[name].value]
        new[names["loss_scale"]] = _Tensor(state[_SCALE], tf.float32)
        new[names["good_steps"]] = _Tensor(int(state[_GOOD]), tf.int32)
        new[names["bad_steps"]] = _Tensor(int(state[_BAD]), tf.int32)
        consumed.add(name)
    return _Converted(new, consumed)


def _applied(tensors, converted):
    """``tensors`` with a ``_Converted`` pass applied."""
    result = dict((name, tensor) for name, tensor in tensors.items()
                  if name not in converted.consumed)
    result.update(converted.new)
    return result


def _checkpoint_path(name, value, fix):
    """``value`` as a str path, checked.

    Raises:
      TypeError: if it is not a str or an ``os.PathLike`` of one.
      ValueError: if it is empty.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError("%s must be a checkpoint prefix (a str or os.PathLike), got "
                        "%r (%s). %s" % (name, value, type(value).__name__, fix))
    if not value:
        raise ValueError("%s must be a checkpoint prefix, got %r. %s" % (name, value, fix))
    return value


def _check_npu_bridge_names(names):
    """``npu_bridge_names`` as a list of entries (None stays None).

    Raises:
      TypeError: if it is not None or a list or tuple of entries, or an entry
        is neither a str nor a tuple or list of three str.
      ValueError: if a str entry, or a tuple's first name, is not named
        ``loss_scale`` or ``loss_scale_N``.
    """
    if names is None:
        return None
    fix = "Pass e.g. [\"loss_scale\"] or [(\"loss_scale_1\", \"good_steps\", \"bad_steps\")]."
    if not isinstance(names, (list, tuple)):
        raise TypeError("npu_bridge_names must be a list, got %r (%s). %s"
                        % (names, type(names).__name__, fix))
    entries = []
    for entry in names:
        if isinstance(entry, (list, tuple)) and len(entry) == 3 and all(
                isinstance(name, str) for name in entry):
            entry = tuple(entry)
        elif not isinstance(entry, str):
            raise TypeError("npu_bridge_names entries must be a str or a (loss_scale, "
                            "good_steps, bad_steps) tuple, got %r. %s" % (entry, fix))
        scale = entry if isinstance(entry, str) else entry[0]
        if not _NPU_BRIDGE_SCALE.match(scale):
            raise ValueError("npu_bridge_names entry %r names no loss_scale variable "
                             "(loss_scale or loss_scale_N in a scope). %s" % (entry, fix))
        entries.append(entry)
    return entries


def convert_checkpoint(source, target, to="npu_lossscale", npu_bridge_names=None):
    """Rewrites a name-based checkpoint's loss-scale state for another layout.

    ``to="npu_lossscale"`` (the default) makes a checkpoint restorable into
    this version's managers. It converts:

    * npu_lossscale 0.1's layout (``<scope>/loss_scale`` float32,
      ``good_steps``, ``bad_steps`` int32, and, once the floor warning came,
      ``overflows_at_floor`` int32 and ``floor_warned`` bool, all scalars,
      under ``dynamic_loss_scale/`` or ``exponential_loss_scale/``) into
      ``<scope>/state`` = ``[scale, good, bad, streak]`` float32, same scope;
      ``floor_warned`` is dropped;
    * npu_bridge's / contrib's ``ExponentialUpdateLossScaleManager`` layout
      (``loss_scale`` float32, ``good_steps`` and ``bad_steps`` int32, all
      scalars, each with the same ``_N`` suffix) into
      ``exponential_loss_scale_N/state`` with a zero streak: by default the
      triples at the top name scope, where npu_bridge's managers are made
      outside any name scope; any others when named in
      ``npu_bridge_names``.

    ``to="npu_bridge"`` goes back: each ``exponential_loss_scale_N/state``
    (float32[4]) becomes npu_bridge's ``loss_scale_N`` (float32),
    ``good_steps_N`` and ``bad_steps_N`` (int32); the streak is dropped.
    ``dynamic_loss_scale`` states are copied as they are (npu_bridge has no
    such manager).

    Only the managers' own variables are converted: tensors are recognised by
    these exact layouts (names, dtypes, shapes, all siblings present), and a
    layout whose converted name the checkpoint already holds is left alone.
    Every other tensor, such as a user's own ``good_steps``, is copied
    unchanged, and so is an npu_bridge layout under a name scope (a user's
    ``model/loss_scale``, ``model/good_steps``, ``model/bad_steps``, with a
    warning) unless ``npu_bridge_names`` asks for it. The mapping assumes the managers are
    built in the same order and name scopes as when the checkpoint was
    written (TF numbers them ``_1``, ``_2``... in creation order).
    Object-based checkpoints (``tf.train.Checkpoint``) are not converted.

    Args:
      source: prefix of the checkpoint to read (as given to ``Saver.restore``),
        a str or ``os.PathLike``.
      target: prefix to write the converted checkpoint to (its directory must
        exist), a str or ``os.PathLike``. Only the checkpoint's data and
        index files are written: the directory's ``checkpoint`` state file
        (``tf.train.latest_checkpoint``) is left as it is.
      to: "npu_lossscale" or "npu_bridge".
      npu_bridge_names: which npu_bridge managers to convert. None: the
        triples at the top name scope (``loss_scale``, ``good_steps``,
        ``bad_steps``, then ``loss_scale_1``...). A list converts exactly
        the managers it names, no others (``[]``: none): each entry is the
        name of a manager's ``loss_scale`` variable, whose counters carry
        the same scope and ``_N`` (``"gan/loss_scale_1"``), or a
        ``(loss_scale, good_steps, bad_steps)`` tuple of names, for a
        manager made after a user's own ``loss_scale`` (TF then names its
        variables ``loss_scale_1``, ``good_steps``, ``bad_steps``). The
        state takes the scope and ``_N`` of the ``loss_scale`` name, or of
        a tuple's ``good_steps`` name
        (``("loss_scale_1", "good_steps", "bad_steps")`` becomes
        ``exponential_loss_scale/state``).

    Returns:
      The sorted names of the loss-scale tensors written in the new layout.

    Raises:
      TypeError: if ``source`` or ``target`` is not a path, ``to`` not a
        str, or ``npu_bridge_names`` not a list of such entries.
      ValueError: if ``to`` is not one of the two formats, ``source`` is not a
        readable checkpoint, ``target``'s directory does not exist, is a file
        or cannot be written, (with ``to="npu_bridge"``) a name
        npu_bridge's layout needs is taken by another tensor, a named
        manager is not in the checkpoint with npu_bridge's layout or its
        state name is taken, or (by default) a top-scope ``loss_scale``,
        ``good_steps`` or ``bad_steps`` has no siblings with its ``_N``
        beside a whole triple (only names tell the manager's then). Nothing
        is written then.
    """
    if not isinstance(to, str):
        raise TypeError("to must be a str, one of %r, got %r (%s). Pass \"npu_lossscale\"."
                        % (_FORMATS, to, type(to).__name__))
    if to not in _FORMATS:
        raise ValueError("to must be one of %r, got %r. Pass \"npu_lossscale\"."
                         % (_FORMATS, to))
    source = _checkpoint_path("source", source,
                              "Pass what Saver.save returned, e.g. \"ckpt/model-1000\".")
    target = _checkpoint_path("target", target,
                              "Pass the prefix to write, e.g. \"converted/model-1000\".")
    npu_bridge_names = _check_npu_bridge_names(npu_bridge_names)
    _check_target_directory(target)
    try:
        reader = tf.train.load_checkpoint(source)
    except (ValueError, tf.errors.OpError) as error:
        raise ValueError("source must be a checkpoint prefix, got %r (%s). Pass what "
                         "Saver.save returned." % (source, error))
    tensors = dict((name, _Tensor(reader.get_tensor(name), dtype))
                   for name, dtype in reader.get_variable_to_dtype_map().items())
    ours = _state_from_old(tensors)
    from_npu_bridge = _state_from_npu_bridge(tensors, ours, npu_bridge_names)
    tensors = _applied(_applied(tensors, ours), from_npu_bridge)
    converted = sorted(ours.new) + sorted(from_npu_bridge.new)
    if to == "npu_bridge":
        back = _npu_bridge_from_state(tensors)
        tensors = _applied(tensors, back)
        converted = sorted(back.new)
    _write_checkpoint(tensors, target)
    return converted


def _check_target_directory(target):
    """Checks that ``target``'s directory exists and takes new files.

    The check writes and removes an empty file there, as the checkpoint
    writer would (``tf.io.gfile``, so remote file systems are checked too).

    Raises:
      ValueError: if the directory does not exist, is a file, or refuses
        the file.
    """
    directory = os.path.dirname(target) or "."
    if not tf.io.gfile.isdir(directory):
        if tf.io.gfile.exists(directory):
            raise ValueError("target must be a prefix in a directory, got %r: %r is a "
                             "file, not a directory. Pass e.g. %r."
                             % (target, directory, os.path.join(
                                 os.path.dirname(directory) or ".",
                                 os.path.basename(target))))
        raise ValueError("target must be a prefix in an existing directory, got %r (%r "
                         "does not exist). Create it: os.makedirs(%r)."
                         % (target, directory, directory))
    probe = os.path.join(directory, ".%s.npu_lossscale_write_test" % os.path.basename(target))
    try:
        with tf.io.gfile.GFile(probe, "w") as stream:
            stream.write("")
        tf.io.gfile.remove(probe)
    except tf.errors.OpError as error:
        raise ValueError("target must be a prefix in a writable directory, got %r (%s: "
                         "%s). Pass a prefix in a directory you can write to."
                         % (target, type(error).__name__, error.message))


def _write_checkpoint(entries, target):
    """Writes {name: ``_Tensor``} as a name-based checkpoint at ``target``:
    its data and index files only. The directory's ``checkpoint`` state file
    (which ``latest_checkpoint`` reads) is left as it is: a conversion into
    the training directory must not replace the list of the user's
    checkpoints."""
    with tf.Graph().as_default():
        feeds, variables = {}, {}
        for index, name in enumerate(sorted(entries)):
            value, dtype = entries[name]
            placeholder = tf.placeholder(dtype, name="value_%d" % index)
            variables[name] = tf.Variable(placeholder, trainable=False,
                                          validate_shape=False, name="v_%d" % index)
            feeds[placeholder] = value
        saver = tf.train.Saver(var_list=variables)
        with tf.Session() as session:
            session.run([v.initializer for v in variables.values()], feeds)
            saver.save(session, target, write_meta_graph=False, write_state=False)
