"""The order of a script's statements: which names a piece of code reads and
binds, and which assignment a read of a name gets.

libcst's scope analysis says which assignments a name *can* read; the plan
also needs the one it *does* read where the order of statements proves it
(``loss_scale_manager = ...`` bound twice, each wrapper reading the one
above it), and whether the lines between two places may change what an
expression means.
"""

from __future__ import absolute_import, division, print_function

import libcst as cst

class _Collect(cst.CSTVisitor):
    """Names read, names bound, and calls made in a piece of code."""

    def __init__(self):
        super(_Collect, self).__init__()
        self.read, self.bound, self.calls = set(), set(), 0

    def visit_Call(self, node):
        self.calls += 1

    def visit_Attribute(self, node):
        node.value.visit(self)
        return False  # the attribute's own name is not a variable

    def visit_Arg(self, node):
        node.value.visit(self)
        return False  # nor is a keyword

    def visit_Name(self, node):
        self.read.add(node.value)

    def _bind(self, target):
        for name in _target_names(target):
            self.bound.add(name)

    def visit_AssignTarget(self, node):
        self._bind(node.target)

    def visit_AugAssign(self, node):
        self._bind(node.target)

    def visit_AnnAssign(self, node):
        self._bind(node.target)

    def visit_For(self, node):
        self._bind(node.target)

    def visit_WithItem(self, node):
        if node.asname is not None:
            self._bind(node.asname.name)

    def visit_ImportAlias(self, node):
        name = node.asname.name if node.asname is not None else node.name
        self._bind(name if isinstance(name, cst.Name) else _root(name))

    def visit_FunctionDef(self, node):
        self.bound.add(node.name.value)

    def visit_ClassDef(self, node):
        self.bound.add(node.name.value)


def _root(node):
    while isinstance(node, cst.Attribute):
        node = node.value
    return node


def _target_names(target):
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        names = []
        for element in target.elements:
            names.extend(_target_names(element.value))
        return names
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    return []


def _collect(node):
    collector = _Collect()
    node.visit(collector)
    return collector


def calls(expr):
    """True when ``expr`` makes a call."""
    return _collect(expr).calls > 0


def read_names(expr):
    """The names ``expr`` reads (not attributes' or keywords' names)."""
    return _collect(expr).read


def assigned(statement):
    """The names ``statement`` binds, in any of its blocks."""
    return _collect(statement).bound


#: Statements whose blocks a binding inside them may or may not run: a read
#: after one cannot tell which value it gets.
_LOOPS = (cst.For, cst.While)


def reaching_assignment(scanner, name):
    """The assignment a read of ``name`` gets, where the order of statements
    proves it, or None.

    The assignment is the only one the name can read (libcst's scope), or
    else the last statement before the read, in its block or a block around
    it (up to its function), that binds the name, when that statement is a
    plain ``name = value`` (``a = b = value`` too). None when no statement
    proves it: a binding inside a branch, a loop around the read, a read in
    a function of a name bound more than once outside it.

    Args:
      scanner: the ``_find.Scanner`` (its metadata live).
      name: a ``cst.Name`` that is read.

    Returns:
      A libcst ``Assignment``, or None.
    """
    assignments = scanner.assignments(name)
    if not assignments:
        return None
    if len(assignments) == 1:
        return assignments[0]
    targets = dict((id(a.node), a) for a in assignments)
    node = scanner.statement(name)
    if isinstance(node, cst.BaseCompoundStatement) and name.value in assigned(node):
        return None  # read in a header or a one-line suite that binds it too
    while node is not None:
        holder = scanner.parent(node)
        while holder is not None and not isinstance(holder, (cst.Module, cst.IndentedBlock)):
            node, holder = holder, scanner.parent(holder)  # an elif, an else, a handler
            if isinstance(node, cst.Try) and name.value in assigned(node):
                return None  # a handler or a finally after a binding in the try
        if holder is None:
            return None
        body = list(holder.body)
        index = [i for i, statement in enumerate(body) if statement is node]
        for statement in reversed(body[:index[0]] if index else []):
            if name.value not in assigned(statement):
                continue
            return _plain_binding(statement, name.value, targets)
        owner = None if isinstance(holder, cst.Module) else scanner.parent(holder)
        if owner is None or isinstance(owner, (cst.FunctionDef, cst.ClassDef) + _LOOPS):
            return None
        node = owner
    return None


def _plain_binding(statement, name, targets):
    """The ``Assignment`` of ``name`` when ``statement`` binds it last with a
    plain ``name = value`` (or ``a = name = value``), else None."""
    if not isinstance(statement, cst.SimpleStatementLine):
        return None
    last = None
    for small in statement.body:
        if name in assigned(small):
            last = small
    if not isinstance(last, cst.Assign):
        return None
    found = None
    for target in last.targets:
        if not isinstance(target.target, cst.Name):
            if name in _target_names(target.target):
                return None
        elif target.target.value == name:
            found = targets.get(id(target.target))
    return found


def assigned_value(scanner, assignment):
    """The value of the ``a = value`` or ``a = b = value`` statement that
    makes ``assignment`` (each target a plain name), else None."""
    target = scanner.parent(assignment.node)
    assign = scanner.parent(target)
    if not (isinstance(target, cst.AssignTarget) and isinstance(assign, cst.Assign)
            and all(isinstance(t.target, cst.Name) for t in assign.targets)):
        return None
    return assign.value


def inside(scanner, node, ancestor):
    """True when ``node`` is ``ancestor`` or inside it."""
    while node is not None:
        if node is ancestor:
            return True
        node = scanner.parent(node)
    return False


def is_number(node):
    """True for a number literal, or arithmetic on number literals only."""
    if isinstance(node, (cst.Integer, cst.Float)):
        return True
    if isinstance(node, cst.UnaryOperation):
        return is_number(node.expression)
    if isinstance(node, cst.BinaryOperation):
        return is_number(node.left) and is_number(node.right)
    return False
