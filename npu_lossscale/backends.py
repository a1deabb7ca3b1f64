"""Float-status backends: how a step learns that it overflowed.

A backend turns the step's gradients into one float32 scalar *overflow flag*:
0.0 when the step is finite, non-zero when it overflowed. A flag (rather than a
bool) is what data-parallel workers sum across ranks: zero after the sum means
every rank was finite.

* ``IsFiniteBackend`` (CPU/GPU, and Ascend in INF/NaN mode) reads every
  gradient once.
* ``NpuFloatStatusBackend`` (Ascend in saturation mode) reads the device's
  float-status register after all gradients; the graph's one clear runs
  before anything a read follows.
  There, an overflowing float16 result becomes +-65504 instead of inf, so the
  register is the only witness of the overflow.

``resolve_backend`` picks one. A backend declares what the rest of the step
needs to know about it: ``name``, ``reads_register`` (one device-wide read
that cannot tell groups apart) and ``on_npu``.
"""

from __future__ import absolute_import, division, print_function

import collections
import warnings

import tensorflow.compat.v1 as tf

from npu_lossscale import graph_state as _graph_state
from npu_lossscale import checks as _checks
from npu_lossscale.gradients import SMALL_GRADIENT_ELEMENTS, dense_values

BACKENDS = ("auto", "is_finite", "npu", "float_status")


class IsFiniteBackend(object):
    """Checks the gradients themselves: one read per gradient.

    Every gradient is summed in float32 and the sums are added; the total is
    finite exactly when no gradient holds inf or nan (inf + -inf and
    nan + x are nan). A finite gradient whose float32 sum overflows also
    counts as an overflow: such a gradient would overflow the update anyway.

    A reduction per gradient costs one op per gradient, which dominates for
    many small gradients (a 2000-tensor model pays more for the ops than for
    the bytes). So small gradients of one shape and dtype are first added
    elementwise (one ``AddN``; float16 and other dtypes are stacked, then cast
    once), then summed: the same verdict, two ops per shape instead of one per
    gradient. Large gradients keep one ``Sum`` each, which reads them at full
    bandwidth and can run as soon as each one exists.
    """

    name = "is_finite"
    #: Each check reads its own gradients, so groups can be checked apart.
    reads_register = False

    def __init__(self, on_npu=False):
        #: Whether the step runs on Ascend (in INF/NaN mode), where v1
        #: control flow may be rejected.
        self.on_npu = on_npu

    def overflow_flag(self, tensors, after=()):
        """Returns a float32 scalar: 0.0 if every tensor is finite, else 1.0.

        Args:
          tensors: gradients (tensors or IndexedSlices), none of them None.
          after: unused here (the check reads the tensors themselves).

        Returns:
          A float32 scalar tensor.
        """
        del after
        with tf.name_scope("is_finite_check"):
            sums = []
            small = collections.OrderedDict()
            for tensor in tensors:
                values = dense_values(tensor)
                shape = values.shape
                if shape.is_fully_defined() and shape.num_elements() < SMALL_GRADIENT_ELEMENTS:
                    key = (values.dtype.base_dtype, tuple(shape.as_list()))
                    small.setdefault(key, []).append(values)
                    continue
                if values.dtype.base_dtype != tf.float32:
                    values = tf.cast(values, tf.float32)
                sums.append(tf.reduce_sum(values))
            for (dtype, _), same in small.items():
                if dtype == tf.float32:
                    values = same[0] if len(same) == 1 else tf.add_n(same)
                else:
                    # Adding in float16 could overflow on finite values, so
                    # stack (no arithmetic) and cast once.
                    values = tf.cast(same[0] if len(same) == 1 else tf.stack(same),
                                     tf.float32)
                sums.append(tf.reduce_sum(values))
            total = sums[0] if len(sums) == 1 else tf.add_n(sums)
            return 1.0 - tf.cast(tf.is_finite(total), tf.float32)


    def clear_status(self):
        """Nothing to clear: there is no register. Returns a no-op."""
        return tf.no_op(name="clear_status")


class NpuFloatStatusBackend(object):
    """Reads Ascend's float-status register; clears it once per run, first.

    The register is the device's overflow status: tf_adapter's read op
    reports it and its clear op zeroes it (``NpuGetFloatStatus``,
    ``NpuClearFloatStatus``, ops/aicore/npu_mixed_precesion_ops.cc); no
    read resets it, so a read sees every overflow since the last clear. npu_bridge's ``NPULossScaleOptimizer`` reads
    after its gradients and clears right after its read, so two of them in
    one ``session.run`` race: one's clear can land between the other's
    overflow and its read (seed 003). This backend never clears after a
    read. Each graph has one clear (``clear_status``), and every op that
    a read follows is made to follow that clear (``order_after_clear``): the
    ops among the read's ancestors that take a graph input (a placeholder,
    a variable, a constant) get the clear as a control input, and the rest
    descend from those. So in a run that feeds only placeholders, the clear
    runs once, before any computation of any reading step, and nothing
    clears after it: a read sees every overflow of its own step, whatever
    else the run fetches. What it can also see is an overflow of another
    step of the same run that landed before it, which makes it skip
    (conservative), never apply. Reads are built at the top level of the
    graph only (``checks.require_top_level``).

    Uses the v2 ops (``npu_get_float_status_v2``/``npu_clear_float_status_v2``)
    when the installed npu_bridge has them, else the v1 ops
    (``npu_alloc_float_status``/``npu_get_float_status``/
    ``npu_clear_float_status``), as npu_bridge's optimizer chooses.

    Args:
      gen_ops: the module returned by ``npu_bridge.helper.helper.get_gen_ops()``.
    """

    name = "npu"
    #: One device-wide register: a read sees every overflow since the last
    #: clear, whichever group caused it.
    reads_register = True

    #: The register exists only on Ascend.
    on_npu = True

    def __init__(self, gen_ops):
        self._gen_ops = gen_ops
        self.uses_v2 = hasattr(gen_ops, "npu_get_float_status_v2")

    def overflow_flag(self, tensors, after=()):
        """Returns a float32 scalar: 0.0 if the register is clear, else 1.0.

        Orders the graph's clear before every op the read follows (see the
        class), then reads without clearing.

        Args:
          tensors: the step's gradients; the read follows all of them.
          after: more tensors the read must follow: the losses, so that a
            forward overflow whose value no gradient needs (TF may prune or
            fold that dependency) still lands before the read.

        Returns:
          A float32 scalar tensor.
        """
        _checks.require_top_level("A float-status read")
        gen = self._gen_ops
        deps = [dense_values(t) for t in list(tensors) + list(after)]
        order_after_clear(self.clear_status(), deps)
        with tf.name_scope("npu_float_status"):
            if self.uses_v2:
                with tf.control_dependencies(deps):
                    status = gen.npu_get_float_status_v2()
                overflow = tf.reduce_any(tf.not_equal(status, tf.zeros_like(status)))
            else:
                # The device writes the status into the allocated buffer, and
                # npu_bridge decides on the buffer (compared with
                # NpuClearFloatStatus's output, zeros: "The float element
                # tensor set to zero"), while the read's own output is
                # documented as "The one float status element tensor"
                # (tf_adapter ops/aicore/npu_mixed_precesion_ops.cc). Either
                # non-zero is an overflow; nothing is cleared.
                buffer = gen.npu_alloc_float_status()
                with tf.control_dependencies(deps):
                    status = gen.npu_get_float_status(buffer)
                with tf.control_dependencies([status]):
                    in_buffer = tf.reduce_any(tf.not_equal(buffer, tf.zeros_like(buffer)))
                overflow = tf.logical_or(
                    in_buffer, tf.reduce_any(tf.not_equal(status, tf.zeros_like(status))))
            return tf.cast(overflow, tf.float32)

    def clear_status(self):
        """The graph's one register clear (made on first use, then shared).

        Every register-reading step of the library runs it before its first
        op, so it need not be run by hand between steps or after an
        evaluation run. Run it alone to clear the register explicitly.

        Returns:
          An op named ``loss_scale/clear_status``.
        """
        graph = tf.get_default_graph()
        state = _graph_state.of(graph)
        if state.register_clear is None:
            gen = self._gen_ops
            # Outside any control context or dependency of the caller: the
            # clear must be free to run first.
            with graph.control_dependencies(None), graph.name_scope("loss_scale/"):
                with tf.name_scope("clear_status") as scope:
                    if self.uses_v2:
                        cleared = gen.npu_clear_float_status_v2()
                    else:
                        cleared = gen.npu_clear_float_status(gen.npu_alloc_float_status())
                    state.register_clear = tf.group(cleared, name=scope)
        return state.register_clear


class Reader(collections.namedtuple("Reader", ["owner", "what"])):
    """An object that reads the float-status register, and its description."""


def order_after_clear(clear, tensors):
    """Makes every op that ``tensors`` depend on run after ``clear``.

    Adds ``clear`` as a control input to each ancestor of ``tensors`` that
    takes an input (data or control) from a graph input: an op with no
    inputs of its own (placeholder, variable, constant, iterator) or a
    ``placeholder_with_default`` (a run that feeds it cuts it out, and its
    control inputs with it; it gets none, since a constant default cannot
    overflow). Every other ancestor depends on one of those. The consumers
    of an op that only passes a graph input on (a ref variable's ``read``
    Identity, a Reshape of a placeholder) get it too: grappler's arithmetic
    optimizer may move a following cast above such an op, away from its
    control inputs. Ops that already follow ``clear`` are left alone, and
    the walk does not pass through ``clear`` itself.

    Any other tensor fed in ``session.run`` cuts its producer out of the run
    the same way, so its consumers are not ordered: feed placeholders.

    Args:
      clear: an op.
      tensors: tensors (or operations).
    """
    state = _graph_state.of(clear.graph)
    passes = {}  # op -> whether it passes graph inputs on (_passes_on_input)
    seen, stack = set([clear]), [getattr(t, "op", t) for t in tensors]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        parents = [tensor.op for tensor in op.inputs] + list(op.control_inputs)
        # Not on a feedable op itself: grappler's dependency optimizer drops
        # a consumer's edge from the clear as implied by the feedable op's,
        # and feeding the op then cuts both out of the run. Not into a v1
        # loop's frame but at its Enter ops: every op in the loop follows
        # them, and an edge from outside into the frame is invalid.
        if (op.type not in _FEEDABLE_TYPES and clear not in parents
                and not _inside_loop(op)
                and any(_is_graph_input(parent) or _passes_on_input(parent, passes)
                        for parent in parents)):
            _graph_state.add_control_input(op, clear)
            state.register_ordered.append(op)
        stack.extend(parent for parent in parents if parent not in seen)


def _is_graph_input(op):
    return op.type in _FEEDABLE_TYPES or (
        len(op.inputs) == 0 and len(op.control_inputs) == 0)


def _passes_on_input(op, memo):
    """Whether ``op`` hands graph inputs on unchanged, through a chain of
    value-preserving ops (a ref variable's ``read``, a Reshape then a
    Transpose of a placeholder): grappler's arithmetic optimizer may move a
    following cast above the whole chain, out of reach of its control
    inputs, so the consumers of every op of the chain are ordered too.

    Iterative, and each op decided once per walk (``memo``), so long chains
    and ops that read the same input twice cost linear time.
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
    context = op._get_control_flow_context()  # pylint: disable=protected-access
    loop = context.GetWhileContext() if context is not None else None
    if loop is None:
        return False
    if op.type in ("Enter", "RefEnter"):
        outer = loop.outer_context
        return outer is not None and outer.GetWhileContext() is not None
    return True


#: Ops grappler may swap a cast with (tensorflow core/grappler/op_types.cc,
#: IsValueAndOrderAndShapePreserving / IsValueAndOrderPreserving /
#: IsValuePreserving). Not Enter: its consumers are in a loop's frame, which
#: a control edge from outside may not enter.
_VALUE_PRESERVING_TYPES = frozenset([
    "Identity", "RefIdentity", "Snapshot", "CheckNumerics", "PreventGradient",
    "StopGradient", "Print", "DebugGradientIdentity", "DeepCopy", "ExpandDims",
    "Reshape", "Squeeze", "Transpose"])

#: Ops that hand a data pipeline's next element to the step. With Ascend's
#: data offload (``enable_data_pre_proc``) tf_adapter places the iterator and
#: its get-next on the device, fused into ``AdpGetNext`` (tf_adapter
#: optimizers/om_partition_subgraphs_pass.cc; ``GetNext``, ``AdpGetNext``,
#: ``DynamicGetNextV2`` and ``GetNextFromQueue`` are registered in
#: ops/aicpu/npu_dataset_ops.cc), where it feeds the training loop from its
#: own queue: an edge from the clear into it would tie prefetching to the
#: step. They are graph inputs: their consumers take the edge instead.
DATA_INPUT_TYPES = frozenset([
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional", "GetNext",
    "AdpGetNext", "DynamicGetNextV2", "GetNextFromQueue"])

#: Ops with inputs that a run typically feeds instead of running, or that
#: deliver input data: they get no edge from the clear, their consumers do.
_FEEDABLE_TYPES = frozenset(["PlaceholderWithDefault"]) | DATA_INPUT_TYPES


def claim_register(owner, what):
    """Records that ``owner`` reads the float-status register in this graph,
    and warns when another object already does.

    The library's readers share one clear per run, so fetched together none
    misses an overflow; but each may then skip for the other's overflow, and
    the two managers lower their scales for it.

    Args:
      owner: the reading object (a builder or a ``LossScaleOptimizer``).
      what: a short description of it, for the message.
    """
    readers = _graph_state.of().register_readers
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


def _import_npu_gen_ops():
    from npu_bridge.helper import helper  # pylint: disable=import-outside-toplevel
    return helper.get_gen_ops()


def npu_available():
    """Returns True when ``npu_bridge`` imports (real, or shims/ on sys.path)."""
    try:
        _import_npu_gen_ops()
    except ImportError:
        return False
    return True


def inf_nan_mode_enabled():
    """Whether the Ascend device overflows to inf/nan (True) or saturates.

    Asked exactly as npu_bridge's own ``NPULossScaleOptimizer`` asks, through
    ``npu_plugin.is_inf_nan_enabled()`` (tf_adapter
    ``npu_bridge/estimator/npu/npu_plugin.py``), which queries the runtime's
    device overflow mode (``aclrtGetDeviceSatMode``). INF/NaN is the default on
    Atlas A2/A3 (910B/910C); Atlas training products (910A) only saturate. An
    adapter too old to have the function only knows saturation: False.
    """
    from npu_bridge.estimator.npu import npu_plugin  # pylint: disable=import-outside-toplevel
    query = getattr(npu_plugin, "is_inf_nan_enabled", None)
    return bool(query()) if query is not None else False


def _warn_if_saturating():
    """Warns when npu_bridge imports and the device saturates on overflow.

    In saturation mode an overflowing float16 result is +-65504, a finite
    number, so ``backend="is_finite"`` finds nothing and every overflowed
    step is applied. The mode is asked as ``inf_nan_mode_enabled`` asks it.
    """
    try:
        _import_npu_gen_ops()
    except ImportError:
        return
    if not inf_nan_mode_enabled():
        warnings.warn(
            "backend='is_finite' while npu_bridge reports the device in saturation "
            "mode: an overflow there gives +-65504 instead of inf, which is_finite "
            "cannot see, so overflowed steps would be applied and the loss scale "
            "never backs off. Pass backend='auto' (or 'npu'), which reads the "
            "float-status register in saturation mode, or, on Atlas A2/A3, switch "
            "the device to INF/NaN mode with npu_plugin.set_device_sat_mode(1) "
            "before building.",
            UserWarning, stacklevel=4)


def resolve_backend(backend, warn=True):
    """Turns a backend name into a backend object.

    On Ascend the check follows the device's overflow mode, as npu_bridge's
    ``NPULossScaleOptimizer`` does: in INF/NaN mode overflows are real inf/nan
    values and the float-status register is not relied on, so the gradients
    are checked with is_finite; in saturation mode (overflows become +-65504)
    the register is the only witness, so it is read.

    Args:
      backend: "auto" (the npu rule when npu_bridge imports, else
        is_finite), "npu" (the npu rule; npu_bridge required), "is_finite"
        (always check the gradients) or "float_status" (always read the
        register; npu_bridge required).
      warn: whether to warn (UserWarning) when ``backend="is_finite"`` is
        asked for while npu_bridge reports saturation mode: overflows then
        saturate to +-65504, which is_finite cannot see, so no step would be
        skipped. Build-time callers warn; a constructor only checks the name.

    Returns:
      An ``IsFiniteBackend`` or ``NpuFloatStatusBackend``.

    Raises:
      ValueError: for an unknown name, or an npu name without npu_bridge.
    """
    if backend not in BACKENDS:
        raise ValueError(
            "backend must be one of %r, got %r. Use 'is_finite' on CPU/GPU, 'npu' "
            "on Ascend (it follows the device's overflow mode), 'float_status' to "
            "always read Ascend's float-status register, or 'auto' to pick npu "
            "when npu_bridge imports." % (BACKENDS, backend))
    if backend == "is_finite":
        if warn:
            _warn_if_saturating()
        return IsFiniteBackend()
    try:
        gen_ops = _import_npu_gen_ops()
    except ImportError as error:
        if backend == "auto":
            return IsFiniteBackend()
        raise ValueError(
            "backend=%r needs Huawei's npu_bridge (the TF adapter shipped with "
            "the Ascend CANN toolkit), which failed to import: %s. Install the CANN "
            "toolkit and its tf_adapter (npu_bridge) package, put the shims/ folder "
            "of this repository on sys.path to emulate it on CPU, or pass "
            "backend='is_finite'." % (backend, error))
    if backend != "float_status" and inf_nan_mode_enabled():
        return IsFiniteBackend(on_npu=True)
    return NpuFloatStatusBackend(gen_ops)
