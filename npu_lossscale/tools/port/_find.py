"""Finding the patterns: the loss-scale wrappers, managers, ``minimize`` and
``session.run`` calls of one module, and the questions the plan asks about
them (where a node sits, what a name is bound to, who reads it).

``Scanner`` walks the module once with libcst's metadata (positions, parents,
scopes, qualified names) and records the calls the port cares about. Its
query methods answer from the same metadata, so they work only while the
walk's metadata is live: the plan runs from ``Scanner.leave_Module``.
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst
from libcst.metadata import (ParentNodeProvider, PositionProvider, QualifiedNameProvider,
                             ScopeProvider)

from npu_lossscale.tools.port import _names

#: A per-optimizer loss-scale wrapper: ``NPULossScaleOptimizer(opt, manager)``
#: and its kin.
#:
#: Attributes:
#:   call: the ``cst.Call``.
#:   kind: one of ``_names.NPU_BRIDGE``, ``CONTRIB``, ``TF_MIXED_PRECISION``,
#:     ``GRAPH_REWRITE``.
#:   optimizer: the wrapped optimizer's expression, or None if missing.
#:   scale: the manager (npu_bridge, contrib) or ``loss_scale`` (TF)
#:     expression, or None when not given.
#:   distributed: npu_bridge's ``is_distributed`` expression, or None.
#:   others: arguments the port does not know (``cst.Arg``s).
Wrapper = collections.namedtuple("Wrapper", ["call", "kind", "optimizer", "scale",
                                             "distributed", "others"])

#: An ``X.minimize(...)`` call, or the two calls that are one:
#: ``gv = X.compute_gradients(loss, ...)`` then, on the next line,
#: ``train = X.apply_gradients(gv, ...)`` with ``gv`` read nowhere else.
#:
#: Attributes:
#:   call: the ``cst.Call`` (``apply_gradients``'s for a pair).
#:   receiver: ``X``, the optimizer expression.
#:   loss, global_step, var_list, name: the argument expressions, or None.
#:   others: the arguments ``MultiOptimizerLossScale.add`` has no place for
#:     (``gate_gradients``, ``grad_loss``, ...), as ``cst.Arg``s.
#:   compute: the ``compute_gradients`` statement of a pair, or None.
Minimize = collections.namedtuple("Minimize", ["call", "receiver", "loss", "global_step",
                                               "var_list", "name", "others", "compute"])

_MINIMIZE_PARAMS = ("loss", "global_step", "var_list", "gate_gradients", "aggregation_method",
                    "colocate_gradients_with_ops", "name", "grad_loss")
_COMPUTE_PARAMS = ("loss", "var_list", "gate_gradients", "aggregation_method",
                   "colocate_gradients_with_ops", "grad_loss")
_APPLY_PARAMS = ("grads_and_vars", "global_step", "name")
_UNKNOWN_PARAMS = ("gate_gradients", "aggregation_method", "colocate_gradients_with_ops",
                   "grad_loss")
_WRAPPER_PARAMS = {
    _names.NPU_BRIDGE: ("opt", "loss_scale_manager", "is_distributed"),
    _names.CONTRIB: ("opt", "loss_scale_manager"),
    _names.TF_MIXED_PRECISION: ("opt", "loss_scale"),
    _names.GRAPH_REWRITE: ("opt", "loss_scale"),
}
_LOOPS = (cst.For, cst.While, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp,
          cst.Lambda)
_GRADIENT_METHODS = ("compute_gradients", "apply_gradients")


def bind_args(call, params):
    """Matches a call's arguments to parameter names.

    Args:
      call: a ``cst.Call``.
      params: the parameter names, in positional order.

    Returns:
      ``(bound, others)``: a dict from parameter name to its ``cst.Arg``, and
      the list of ``cst.Arg``s that match no parameter (``*args``,
      ``**kwargs``, unknown keywords, extra positionals).
    """
    bound, others = {}, []
    position = 0
    for arg in call.args:
        if arg.star:
            others.append(arg)
        elif arg.keyword is None:
            if position < len(params):
                bound[params[position]] = arg
            else:
                others.append(arg)
            position += 1
        elif arg.keyword.value in params and arg.keyword.value not in bound:
            bound[arg.keyword.value] = arg
        else:
            others.append(arg)
    return bound, others


def last_name(call):
    """The name a call is made by, its last part (``f`` for ``f()`` and
    ``self.f()``), or None (a call of a call, a subscript...)."""
    if isinstance(call.func, cst.Name):
        return call.func.value
    if isinstance(call.func, cst.Attribute):
        return call.func.attr.value
    return None


def _value(bound, name):
    """The value of argument ``name``, or None when it is not passed or is
    the literal ``None`` (a default spelled out)."""
    arg = bound.get(name)
    if arg is None or (isinstance(arg.value, cst.Name) and arg.value.value == "None"):
        return None
    return arg.value


class Scanner(cst.CSTVisitor):
    """Records the calls the port reads, then hands itself to ``on_done``.

    Args:
      on_done: called with the scanner from ``leave_Module``, while the
        metadata is live.

    Attributes:
      wrappers: the ``Wrapper``s, in source order.
      managers: dict from manager-constructor ``cst.Call`` to its
        ``_names.ManagerMap``.
      minimizes: the ``Minimize``s, in source order (the pairs of
        ``compute_gradients`` and ``apply_gradients`` that are one
        ``minimize`` among them).
      gradient_calls: the other ``compute_gradients``/``apply_gradients``
        calls (``cst.Call``s).
      star_npu: the ``from npu_bridge.npu_init import *`` statement, or None.
      library_import: the first statement importing npu_lossscale, or None.
      names: every identifier the module uses (for picking fresh names).
      strings: how often each string literal's value occurs.
      functions: the names of the functions the module defines.
      call_sites: dict from each function or method name to its calls
        (``cst.Call``s, by the last name: ``f()`` and ``self.f()`` both count
        for ``f``).
      module: the ``cst.Module``.
    """

    METADATA_DEPENDENCIES = (ParentNodeProvider, PositionProvider, QualifiedNameProvider,
                             ScopeProvider)

    def __init__(self, on_done):
        super(Scanner, self).__init__()
        self._on_done = on_done
        self.wrappers, self.managers, self.minimizes, self.gradient_calls = [], {}, [], []
        self.star_npu = self.library_import = self.module = None
        self.names = set()
        self.strings = collections.Counter()
        self.call_sites = collections.defaultdict(list)
        self.functions = set()
        self.resolver = None

    # -- the walk ---------------------------------------------------------------

    def visit_Module(self, node):
        self.module = node
        for statement in _import_statements(node.body):
            for small in statement.body:
                if (isinstance(small, cst.ImportFrom) and isinstance(small.names, cst.ImportStar)
                        and _module_name(small) in _names.NPU_STAR_MODULES):
                    self.star_npu = statement
        self.resolver = _names.Resolver(self, self.star_npu is not None)

    def visit_Import(self, node):
        for alias in node.names:
            if _names.is_library_module(_dotted_name(alias.name)):
                self._library(node)

    def visit_ImportFrom(self, node):
        module = _module_name(node)
        if module == _names.LIBRARY and not isinstance(node.names, cst.ImportStar):
            if any(_names.is_library_module(module + "." + _dotted_name(alias.name))
                   for alias in node.names):
                self._library(node)
        elif _names.is_library_module(module):
            self._library(node)

    def _library(self, node):
        if self.library_import is None:
            self.library_import = node

    def visit_Name(self, node):
        parent = self.parent(node)
        if isinstance(parent, cst.Attribute) and parent.attr is node:
            return
        if isinstance(parent, cst.Arg) and parent.keyword is node:
            return
        self.names.add(node.value)

    def visit_FunctionDef(self, node):
        self.functions.add(node.name.value)

    def visit_SimpleString(self, node):
        try:
            self.strings[node.evaluated_value] += 1
        except Exception:  # pylint: disable=broad-except
            pass  # a string libcst cannot evaluate (an odd prefix): not a name

    def visit_Call(self, node):
        if last_name(node) is not None:
            self.call_sites[last_name(node)].append(node)
        name = self.qualified(node.func)
        if name in _names.WRAPPERS:
            kind = _names.WRAPPERS[name]
            bound, others = bind_args(node, _WRAPPER_PARAMS[kind])
            scale = _value(bound, "loss_scale_manager" if kind in (
                _names.NPU_BRIDGE, _names.CONTRIB) else "loss_scale")
            self.wrappers.append(Wrapper(node, kind, _value(bound, "opt"), scale,
                                         _value(bound, "is_distributed"), others))
        elif name in _names.MANAGERS:
            self.managers[node] = _names.MANAGERS[name]
        elif isinstance(node.func, cst.Attribute) and node.func.attr.value == "minimize":
            bound, others = bind_args(node, _MINIMIZE_PARAMS)
            unknown = [bound[p] for p in _UNKNOWN_PARAMS if p in bound]
            self.minimizes.append(Minimize(
                node, node.func.value, _value(bound, "loss"), _value(bound, "global_step"),
                _value(bound, "var_list"), _value(bound, "name"), unknown + others, None))
        elif isinstance(node.func, cst.Attribute) and node.func.attr.value in _GRADIENT_METHODS:
            self.gradient_calls.append(node)

    def leave_Module(self, original_node):
        for apply_call in list(self.gradient_calls):
            pair = self._pair(apply_call)
            if pair is not None:
                self.gradient_calls = [c for c in self.gradient_calls
                                       if c is not apply_call and c is not pair.compute.body[0]
                                       .value]
                self.minimizes.append(pair)
        self.minimizes.sort(key=lambda x: (self.line(x.call), self.column(x.call)))
        self._on_done(self)

    def _pair(self, apply_call):
        """The ``Minimize`` that ``apply_call`` and the ``compute_gradients``
        just before it make, or None: the statement before is ``gv =
        X.compute_gradients(...)`` in the same block, on the same name ``X``,
        and ``gv`` (bound there alone) is read only as ``apply_call``'s
        first argument. Anything that reads or edits ``gv`` in between (a
        clip, a summary) leaves the two calls as they are, refused."""
        if not (apply_call.func.attr.value == "apply_gradients"
                and isinstance(apply_call.func.value, cst.Name)):
            return None
        bound, others = bind_args(apply_call, _APPLY_PARAMS)
        gv = bound.get("grads_and_vars")
        if gv is None or not isinstance(gv.value, cst.Name):
            return None
        assignments = self.assignments(gv.value) or []
        if len(assignments) != 1 or [r for r in self.references(assignments)] != [gv.value]:
            return None
        compute_call = self.assigned_value(assignments[0])
        statement = self.statement(apply_call)
        compute = self.statement(assignments[0].node)
        if not (isinstance(compute_call, cst.Call) and compute_call in self.gradient_calls
                and compute_call.func.attr.value == "compute_gradients"
                and isinstance(compute_call.func.value, cst.Name)
                and compute_call.func.value.value == apply_call.func.value.value
                and isinstance(compute, cst.SimpleStatementLine) and len(compute.body) == 1
                and self.parent(compute) is self.parent(statement)):
            return None
        body = list(self.parent(statement).body)
        at = [i for i, st in enumerate(body) if st is statement]
        if not at or at[0] == 0 or body[at[0] - 1] is not compute:
            return None
        computed, extra = bind_args(compute_call, _COMPUTE_PARAMS)
        unknown = [computed[p] for p in _UNKNOWN_PARAMS if p in computed]
        return Minimize(apply_call, apply_call.func.value, _value(computed, "loss"),
                        _value(bound, "global_step"), _value(computed, "var_list"),
                        _value(bound, "name"), unknown + extra + others, compute)

    # -- queries (while the metadata is live) -------------------------------------

    def qualified(self, node):
        """The normalised qualified name of a Name/Attribute, or None."""
        if not isinstance(node, (cst.Name, cst.Attribute)):
            return None
        return self.resolver.name_of(node)

    def call_name(self, node):
        """The qualified name of the function a ``cst.Call`` calls, or None."""
        return self.qualified(node.func) if isinstance(node, cst.Call) else None

    def line(self, node):
        """The 1-based line where ``node`` starts."""
        return self.get_metadata(PositionProvider, node).start.line

    def column(self, node):
        """The 0-based column where ``node`` starts."""
        return self.get_metadata(PositionProvider, node).start.column

    def _place(self, access):
        """Where a libcst ``Assignment``'s or ``Access``'s node starts, as
        ``(line, column)``: libcst keeps them in sets, whose order changes
        from one run to the next."""
        node = getattr(access, "node", None)
        if not isinstance(node, cst.CSTNode):
            return (0, 0)
        start = self.get_metadata(PositionProvider, node).start
        return (start.line, start.column)

    def parent(self, node):
        return self.get_metadata(ParentNodeProvider, node, None)

    def code(self, node):
        """The source text of ``node``."""
        return self.module.code_for_node(node)

    def statement(self, node):
        """The statement holding ``node``: a ``SimpleStatementLine`` or a
        compound statement (``node`` itself if it is one)."""
        while node is not None and not isinstance(
                node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            node = self.parent(node)
        return node

    def block(self, statement):
        """The ``IndentedBlock`` or ``Module`` whose body holds ``statement``."""
        return self.parent(statement)

    def owner(self, block):
        """The compound statement a block belongs to (None for the module)."""
        return None if isinstance(block, cst.Module) else self.parent(block)

    def loop_around(self, node):
        """The innermost loop, comprehension or lambda around ``node`` in its
        function, or None."""
        node = self.parent(node)
        while node is not None and not isinstance(node, cst.FunctionDef):
            if isinstance(node, _LOOPS):
                return node
            node = self.parent(node)
        return None

    def function_of(self, node):
        """The innermost ``FunctionDef`` around ``node``, or None."""
        node = self.parent(node)
        while node is not None and not isinstance(node, cst.FunctionDef):
            node = self.parent(node)
        return node

    def assignments(self, name):
        """The assignments a ``cst.Name`` can read, as libcst ``Assignment``s
        in the order they stand in the source (imports and builtins
        excluded); None if some binding is not a plain assignment (an
        import, a parameter, a global)."""
        scope = self.get_metadata(ScopeProvider, name, None)
        if scope is None:
            return None
        found = []
        for assignment in sorted(scope[name.value], key=self._place):
            node = getattr(assignment, "node", None)
            if not isinstance(node, cst.Name):
                return None
            found.append(assignment)
        return found

    def assigned_value(self, assignment):
        """The value of a plain ``NAME = value`` statement that makes
        ``assignment``, or None for any other binding (a tuple target, a
        ``for`` target, several targets, augmented assignment...)."""
        target = self.parent(assignment.node)
        assign = self.parent(target)
        if not (isinstance(target, cst.AssignTarget) and isinstance(assign, cst.Assign)
                and len(assign.targets) == 1 and assign.targets[0].target is assignment.node):
            return None
        return assign.value

    def references(self, assignments):
        """The ``cst.Name`` nodes that read any of ``assignments``, in the
        order of ``assignments``, then of the source."""
        seen, found = set(), []
        for assignment in assignments:
            for access in sorted(assignment.references, key=self._place):
                if id(access.node) not in seen:
                    seen.add(id(access.node))
                    found.append(access.node)
        return found

    def fetch_site(self, node):
        """The ``X.run(...)`` call whose fetches hold ``node`` (directly, or
        inside list, tuple and dict literals), or the npu_bridge device loop's
        ``set_iteration_per_loop(sess, train_op, n)`` whose ``train_op`` does
        (the op it returns runs it: a fetch of its own), or None."""
        while True:
            parent = self.parent(node)
            if isinstance(parent, cst.Element) and isinstance(self.parent(parent),
                                                              (cst.List, cst.Tuple)):
                node = self.parent(parent)
            elif isinstance(parent, cst.DictElement) and parent.value is node:
                node = self.parent(parent)
            else:
                break
        if not isinstance(parent, cst.Arg) or parent.star:
            return None
        call = self.parent(parent)
        if isinstance(call, cst.Call) and last_name(call) == "set_iteration_per_loop":
            bound = bind_args(call, ("sess", "train_op", "iterations_per_loop"))[0]
            return call if bound.get("train_op") is parent else None
        if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
                and call.func.attr.value == "run"):
            return None
        if parent.keyword is not None:
            return call if parent.keyword.value == "fetches" else None
        return call if call.args[0] is parent else None


def _import_statements(body):
    """The simple statements of a module's body, and those of its top-level
    ``try:`` blocks (``try: from npu_bridge.npu_init import *`` with a
    fallback for machines without it), where its imports are."""
    found = []
    for statement in body:
        if isinstance(statement, cst.SimpleStatementLine):
            found.append(statement)
        elif isinstance(statement, cst.Try):
            found.extend(_import_statements(statement.body.body))
    return found


def _dotted_name(node):
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return _dotted_name(node.value) + "." + node.attr.value
    return ""


def _module_name(import_from):
    if import_from.relative:
        return ""
    return _dotted_name(import_from.module) if import_from.module is not None else ""
