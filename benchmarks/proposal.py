"""Graph changes proposed for ``npu_lossscale/_step.py`` (not applied there).

The benchmark measures them through the optional row ``builder_proposal``
(``run.py --proposal``), which builds the ordinary builder with these functions
patched in for the duration of ``build()``. They are written against the
``_step`` module as it stands; if its functions are renamed the row is
reported missing, never faked.

1. ``guarded_apply``: the same all-or-nothing guard as ``tf.cond`` without
   its per-input cost. A lowered ``cond`` puts a ``Switch`` on every tensor
   the branch captures (each gradient, each variable and slot handle: about
   four per Adam variable) and executes every branch constant on each step.
   Here one ``Switch`` of the decision makes two pivots; every op the
   applies create gets the true pivot as a control input (TF's
   ``control_dependencies`` adds it to each new op that has no input made in
   the block), so on an overflow the pivot is dead and the executor
   propagates the deadness along those control edges: no apply, no slot or
   beta-power update, no step increment runs. A ``Merge`` of the two pivots
   gives ``applied``. This is what TF1's ``cond`` does for a branch's
   input-less ops (constants); here it covers every op of the branch.

2. ``unscale`` with packing: dense gradients smaller than
   ``PACK_BELOW_ELEMENTS`` that share shape and dtype are stacked once
   (``Pack``), multiplied by 1/scale once and unstacked (``Unpack`` along
   axis 0 shares the buffer when rows are 64-byte aligned), so k small
   gradients cost 3 ops instead of k. Values are bit-identical (the same
   elementwise products). The check then reads each pack with one
   ``Sum`` (``PackedIsFiniteBackend``).
"""

from __future__ import absolute_import, division, print_function

import collections
import contextlib

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import gen_control_flow_ops

from npu_lossscale import _step
from npu_lossscale import backends as _backends

PACK_BELOW_ELEMENTS = 16384


def guarded_apply(is_finite, applies, global_step=None, name="apply_if_finite"):
    """``_step.guarded_apply`` without a ``cond``: deadness through a pivot."""
    graph = tf.get_default_graph()
    with tf.name_scope(name):
        pred = tf.convert_to_tensor(is_finite)
        when_false, when_true = gen_control_flow_ops.switch(pred, pred, name="switch")
        pivot_true = tf.identity(when_true, name="pivot_t")
        pivot_false = tf.identity(when_false, name="pivot_f")
        scope = graph.get_name_scope()
    with tf.control_dependencies([pivot_true]):
        with tf.name_scope(None):
            updates = [optimizer.apply_gradients(
                _step._clipped(grads_and_vars, clip_norm),  # pylint: disable=protected-access
                name="%s/%s" % (scope, group) if scope else group)
                for optimizer, grads_and_vars, group, clip_norm in applies]
        if global_step is not None:
            with tf.control_dependencies(updates):
                updates = [_step.increment(global_step)]
        with tf.control_dependencies(updates):
            applied_true = tf.identity(pivot_true, name="%s/applied_t" % name)
    applied, _ = gen_control_flow_ops.merge([pivot_false, applied_true], name=name + "/merge")
    return applied


class _Packs(object):
    """Per graph: which small gradients were stacked together, by tensor id."""

    def __init__(self):
        self.where = {}      # id(grad) -> (pack index, row)
        self.packs = []      # stacked tensors
        self.unscaled = {}   # (pack index, id(inv_scale)) -> list of rows

    def pack(self, tensors):
        groups = collections.OrderedDict()
        for t in tensors:
            if isinstance(t, tf.IndexedSlices) or id(t) in self.where:
                continue
            shape = t.shape
            if (shape.is_fully_defined() and shape.num_elements() < PACK_BELOW_ELEMENTS
                    and t.dtype.base_dtype.is_floating):
                groups.setdefault((t.dtype.base_dtype, tuple(shape.as_list())), []).append(t)
        for members in groups.values():
            if len(members) < 2:
                continue
            index = len(self.packs)
            self.packs.append(tf.stack(members, name="packed_grads"))
            for row, t in enumerate(members):
                self.where[id(t)] = (index, row)

    def rows(self, index, inv_scale):
        key = (index, id(inv_scale))
        if key not in self.unscaled:
            pack = self.packs[index]
            product = pack * tf.cast(inv_scale, pack.dtype.base_dtype)
            self.unscaled[key] = tf.unstack(product, name="unscaled_grads")
        return self.unscaled[key]


import weakref  # noqa: E402

_PACKS = weakref.WeakKeyDictionary()


def _packs_of_graph():
    graph = tf.get_default_graph()
    if graph not in _PACKS:
        _PACKS[graph] = _Packs()
    return _PACKS[graph]


class PackedIsFiniteBackend(_backends.IsFiniteBackend):
    """The is_finite check over packs: one ``Sum`` per pack, the rest as usual."""

    def overflow_flag(self, tensors, after=()):
        packs = _packs_of_graph()
        packs.pack(tensors)
        rest, used = [], set()
        for t in tensors:
            where = packs.where.get(id(t))
            if where is None:
                rest.append(t)
            elif where[0] not in used:
                used.add(where[0])
                rest.append(packs.packs[where[0]])
        return super(PackedIsFiniteBackend, self).overflow_flag(rest, after=after)


def unscale(grads_and_vars, inv_scale):
    """``_step.unscale``, taking packed gradients from their pack."""
    if inv_scale is None:
        return list(grads_and_vars)
    packs = _packs_of_graph()
    result, loose = [], []
    for grad, var in grads_and_vars:
        where = packs.where.get(id(grad))
        if where is None:
            loose.append(len(result))
            result.append((grad, var))
        else:
            result.append((packs.rows(where[0], inv_scale)[where[1]], var))
    unscaled_loose = ORIGINAL["unscale"]([result[i] for i in loose], inv_scale)
    for i, pair in zip(loose, unscaled_loose):
        result[i] = pair
    return result


ORIGINAL = {"guarded_apply": _step.guarded_apply, "unscale": _step.unscale}


@contextlib.contextmanager
def patched(gate=True, pack=True):
    """Builds inside the block use the proposed functions."""
    saved = {"guarded_apply": _step.guarded_apply, "unscale": _step.unscale}
    saved_resolve = _backends.resolve_backend
    try:
        if gate:
            _step.guarded_apply = guarded_apply
        if pack:
            _step.unscale = unscale

            def resolve(name):
                backend = saved_resolve(name)
                if backend.name == "is_finite":
                    return PackedIsFiniteBackend()
                return backend
            _backends.resolve_backend = resolve
        yield
    finally:
        _step.guarded_apply = saved["guarded_apply"]
        _step.unscale = saved["unscale"]
        _backends.resolve_backend = saved_resolve
