"""The managers in the port: which manager object a wrapper's name holds
where it reads it (two managers under one name, one manager under two),
and what each of npu_bridge's, contrib's and TF's becomes among ours.

``ManagerRules`` is a part of ``_plan._Planner``: its methods use the
planner's scanner, ``refuse``, ``changed``, ``left_alone`` and ``code``, its
edits (``replace``) and its ``mapped`` record.
"""

from __future__ import absolute_import, division, print_function

import collections

import libcst as cst

from npu_lossscale.tools.port import _emit, _flow, _names
from npu_lossscale.tools.port._find import bind_args as _bind
from npu_lossscale.tools.port._sections import SECTION_MANAGERS

#: The loss-scale manager a group uses.
#:
#: Attributes:
#:   code: the expression to write (a name, or a new manager).
#:   key: what makes two groups' managers the same object (the assignment of
#:     the name they share), or None for a manager of its own.
#:   origin: the statement the expression comes from when it must move (a
#:     manager built inside the wrapper), else None.
ManagerUse = collections.namedtuple("ManagerUse", ["code", "key", "origin"])

#: The manager a port without loss scaling adds (TF's DynamicLossScale defaults).
UNSCALED_MANAGER = "DynamicLossScaleManager()"


class ManagerRules(object):
    """The planner's rules for managers (see the module docstring)."""

    def manager_of(self, wrapper, statement):
        """The ``ManagerUse`` for a wrapper's loss scale, or None (refused).

        Args:
          wrapper: the ``_find.Wrapper``.
          statement: the statement binding the wrapper to a name (where the
            manager expression moves from), or None.
        """
        s = self.s
        expr = wrapper.scale
        if wrapper.kind in (_names.TF_MIXED_PRECISION, _names.GRAPH_REWRITE):
            return self.tf_loss_scale(wrapper, statement)
        if expr is None:
            self.refuse(wrapper.call, "wrapper-arguments",
                        "This %s call has no loss-scale manager: pass one as its second "
                        "argument (e.g. ExponentialUpdateLossScaleManager(2 ** 15, 1000)), "
                        "then run the tool again, or port it by hand."
                        % _names.WRAPPER_TITLES[wrapper.kind], SECTION_MANAGERS)
            return None
        if isinstance(expr, cst.Call) and expr in s.managers:
            text = self.mapped_manager(expr)
            return None if text is None else ManagerUse(text, None, statement)
        if isinstance(expr, cst.Name):
            value = self.manager_value(expr)
            if isinstance(value, cst.Call) and value in s.managers:
                if self.map_in_place(value) is None:
                    return None
            else:
                self.manager_kept(expr)
            return ManagerUse(expr.value, value, statement)
        self.manager_kept(expr)
        if statement is not None:
            self.refuse(expr, "manager-unfollowed",
                        "The manager %s is built inside the wrapper by a call the tool cannot "
                        "move: bind it to a name on the line above the wrapper (m = ...; "
                        "Wrapper(opt, m)), then run the tool again." % self.code(expr),
                        SECTION_MANAGERS)
            return None
        return ManagerUse(self.code(expr), None, None)

    def manager_value(self, name):
        """The expression a manager's name holds where the wrapper reads it:
        the value of the assignment that read gets, through aliases
        (``g_manager = d_manager``, ``d_manager = g_manager = Manager()``);
        None when the order of statements does not prove which one it is
        (then each group names its manager, and no two are taken for one).

        Two wrappers share a manager exactly when their values are the same
        node: a name bound twice (``loss_scale_manager = ...`` before each
        wrapper, as Pix2Pix has it) holds two managers."""
        s = self.s
        seen = []
        while isinstance(name, cst.Name) and not any(name is n for n in seen):
            seen.append(name)
            assignment = _flow.reaching_assignment(s, name)
            if assignment is None:
                return None
            value = _flow.assigned_value(s, assignment)
            if value is None:
                return None
            if not isinstance(value, cst.Name):
                return value
            name = value
        return None

    def manager_kept(self, expr):
        self.left_alone(expr, "manager-kept",
                        "The manager %s is not one the tool maps; it is kept as it is (the "
                        "library takes npu_bridge's and contrib's managers too)."
                        % self.code(expr), SECTION_MANAGERS)

    def tf_loss_scale(self, wrapper, statement):
        """TF's ``loss_scale`` argument as one of our managers."""
        expr = wrapper.scale
        alias = self.alias
        if expr is None or (isinstance(expr, cst.SimpleString)
                            and expr.evaluated_value == "dynamic"):
            text = "%s.%s" % (alias, UNSCALED_MANAGER)
            rule = "a dynamic scale: %s (TF's DynamicLossScale defaults: 2**15, x2 every " \
                   "2000 finite steps)" % text
        elif _flow.is_number(expr):
            text = "%s.FixedLossScaleManager(%s)" % (alias, self.code(expr))
            rule = "a fixed scale: %s" % text
        elif isinstance(expr, cst.Call) and expr in self.s.managers:
            text = self.mapped_manager(expr)
            if text is None:
                return None
            rule = text
        else:
            self.refuse(expr, "loss-scale-argument",
                        "The loss_scale %s is not a literal or a DynamicLossScale/"
                        "FixedLossScale call the tool can map: pass our manager by hand."
                        % self.code(expr), SECTION_MANAGERS)
            return None
        if "FixedLossScaleManager" in rule:
            rule += (". This changes one thing: TF's FixedLossScale applies every step, "
                     "non-finite gradients included, and the builder skips a step whose "
                     "gradients overflow (add enable_overflow_check=False to apply them as TF "
                     "did)")
        self.changed(expr if expr is not None else wrapper.call, "loss-scale-mapped",
                     "%s's loss_scale is %s." % (_names.WRAPPER_TITLES[wrapper.kind], rule),
                     SECTION_MANAGERS)
        return ManagerUse(text, None, statement)

    def mapped_manager(self, call):
        """The text of our manager for a recognised manager call, or None
        (refused: an argument we do not know)."""
        mapping = self.s.managers[call]
        known = [theirs for theirs, _ in mapping.keywords]
        ours = dict(mapping.keywords)
        bound, others = _bind(call, known)
        if others:
            self.refuse(call, "manager-arguments",
                        "This %s manager has arguments the tool does not know (%s): the tool "
                        "maps %s. Drop the others if they are defaults, then run the tool "
                        "again, or pass our manager by hand."
                        % (mapping.origin, self.code(call), ", ".join(
                            theirs for theirs, _ in mapping.keywords)), SECTION_MANAGERS)
            return None
        args = []
        for theirs in known:
            arg = bound.get(theirs)
            if arg is None:
                continue
            value = self.code(arg.value)
            args.append(value if arg.keyword is None else "%s=%s" % (ours[theirs], value))
        self.mapped.add(call)
        if mapping.origin != "tensorflow":
            self.changed(call, "manager-mapped",
                         "%s's %s is %s.%s, same arguments."
                         % (mapping.origin, mapping.ours, self.alias, mapping.ours),
                         SECTION_MANAGERS)
        return "%s.%s(%s)" % (self.alias, mapping.ours, ", ".join(args))

    def map_in_place(self, call):
        """Maps a manager call where it stands (its function only: npu_bridge's
        and contrib's arguments are ours). Returns the call, or None."""
        if call in self.mapped:
            return call
        mapping = self.s.managers[call]
        _, others = _bind(call, [theirs for theirs, _ in mapping.keywords])
        if others or mapping.origin == "tensorflow":
            self.refuse(call, "manager-arguments",
                        "This %s manager has arguments the tool does not know (%s): the tool "
                        "maps %s. Drop the others if they are defaults, then run the tool "
                        "again, or pass our manager by hand."
                        % (mapping.origin, self.code(call), ", ".join(
                            theirs for theirs, _ in mapping.keywords)), SECTION_MANAGERS)
            return None
        func = cst.parse_expression("%s.%s" % (self.alias, mapping.ours))
        shift = len(self.code(func)) - len(self.code(call.func))
        if isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
            shift = 0  # a hanging indent stays where it is
        self.replace[call] = call.with_changes(func=func, args=_emit.shift(call.args, shift))
        self.mapped.add(call)
        self.changed(call, "manager-mapped",
                     "%s's %s is %s.%s, same arguments."
                     % (mapping.origin, mapping.ours, self.alias, mapping.ours), SECTION_MANAGERS)
        return call

    def refuse_unmovable_manager(self, group, body, start, target):
        """A wrapper's manager that would not mean the same where the builder
        reads it: the edit that lets the tool go on."""
        scale = group.wrapper.scale
        if isinstance(scale, cst.Name) and start is not None:
            again = [st for st in body[start + 1:target] if scale.value in _flow.assigned(st)]
            if again:
                self.refuse(group.wrapper.call, "unmovable",
                            "This wrapper reads the manager %s, which line %d binds again "
                            "before %s's minimize, where the builder reads it: give each "
                            "manager a name of its own (e.g. %s_manager = ... and this wrapper "
                            "reading it), then run the tool again."
                            % (scale.value, self.s.line(again[0]), group.name,
                               group.name.lstrip("_").split("_")[0]), SECTION_MANAGERS)
                return
        self.refuse(group.wrapper.call, "unmovable",
                    "This wrapper's manager moves to the builder, past lines that may change "
                    "its arguments: bind the manager to a name above the first minimize (m = "
                    "Manager(...)), then run the tool again.", SECTION_MANAGERS)
