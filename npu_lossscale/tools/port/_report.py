"""The port's report: three lists, and the check's findings.

As Huawei's ``convert_tf2npu`` does, the report has three lists: what the
port changed, what it recognised but left alone (and why), and what a person
must do by hand (and which section of the docs to read). Each entry names the
input file and line, and a rule. ``--check`` adds a fourth part: the command
it ran and the audit's findings on the graph the rewritten script built.
"""

from __future__ import absolute_import, division, print_function

import collections

CHANGED, LEFT_ALONE, BY_HAND = "changed", "left alone", "by hand"
KINDS = (CHANGED, LEFT_ALONE, BY_HAND)
_TITLES = {CHANGED: "CHANGED", LEFT_ALONE: "RECOGNISED, LEFT ALONE", BY_HAND: "BY HAND"}

#: One item of the report.
#:
#: Attributes:
#:   kind: CHANGED, LEFT_ALONE or BY_HAND.
#:   path: the input file, relative to INPUT's folder.
#:   line: the line in the input file (1-based), or 0 for the whole file.
#:   rule: the rule's short name (docs/port.md lists them).
#:   message: one or two sentences: what, and why or what to do.
#:   section: the docs section to read, e.g. 'README "Porting a TF1 script"'.
Entry = collections.namedtuple("Entry", ["kind", "path", "line", "rule", "message", "section"])

#: One ``session.run`` the check audited.
#:
#: Attributes:
#:   fetches: the names of the ops and tensors it fetched.
#:   findings: ``(code, severity, message)`` of each audit finding.
AuditedRun = collections.namedtuple("AuditedRun", ["fetches", "findings"])

#: What ``--check`` saw.
#:
#: Attributes:
#:   command: the command as given.
#:   returncode: its exit status (None when it could not start or timed out).
#:   runs: the ``AuditedRun``s, one per distinct training ``session.run``.
#:   output_tail: the last lines of its output when it failed, else "".
CheckResult = collections.namedtuple("CheckResult",
                                     ["command", "returncode", "runs", "output_tail"])


class Report(object):
    """The entries of one port, in the order they were found.

    Attributes:
      entries: the ``Entry``s.
      check: the ``CheckResult``, or None without ``--check``.
      files: the input files read, relative to INPUT's folder.
    """

    def __init__(self):
        self.entries = []
        self.check = None
        self.files = []

    def add(self, kind, path, line, rule, message, section=""):
        """Appends an ``Entry``; returns it."""
        entry = Entry(kind, path, line, rule, message, section)
        self.entries.append(entry)
        return entry

    def extend(self, entries):
        self.entries.extend(entries)

    def of_kind(self, kind):
        """The entries of one kind, by file and line."""
        return sorted((e for e in self.entries if e.kind == kind),
                      key=lambda e: (e.path, e.line))

    def check_failed(self):
        """True when ``--check`` ran and its command failed or the audit
        found an error."""
        if self.check is None:
            return False
        return self.check.returncode != 0 or any(
            severity == "error" for run in self.check.runs for _, severity, _ in run.findings)

    def format(self):
        """The report as text: a summary line, then each list."""
        counts = dict((kind, len(self.of_kind(kind))) for kind in KINDS)
        lines = ["npu_lossscale.port: %d file%s read, %d changed, %d left alone, %d by hand"
                 % (len(self.files), "" if len(self.files) == 1 else "s",
                    counts[CHANGED], counts[LEFT_ALONE], counts[BY_HAND])]
        for kind in KINDS:
            lines.append("")
            lines.append("%s (%d)" % (_TITLES[kind], counts[kind]))
            for entry in self.of_kind(kind):
                lines.append("  %s:%d  [%s] %s" % (entry.path, entry.line, entry.rule,
                                                   entry.message))
                if entry.section:
                    lines.append("      read: %s" % entry.section)
            if not counts[kind]:
                lines.append("  (none)")
        if self.check is not None:
            lines.append("")
            lines.extend(_format_check(self.check))
        return "\n".join(lines) + "\n"


#: The audit findings that mean a skipped run is not atomic: a write beside
#: the gate (batch-norm statistics), a race that hides an overflow, scales
#: that let one network apply while another skips, an ungated accumulation.
NOT_ATOMIC = ("NLS001", "NLS005", "NLS008", "NLS009")


def _atomic_line(run):
    """Whether the audit saw anything that makes a skipped run of ``run``
    change state."""
    found = sorted(set(code.split("-")[0] for code, _, _ in run.findings
                       if code.split("-")[0] in NOT_ATOMIC))
    if found:
        return "    skips: NOT atomic (%s): a skipped run still changes state" % ", ".join(found)
    return ("    skips: atomic as far as the audit sees (no %s finding: batch-norm statistics "
            "and every group held)" % "/".join(NOT_ATOMIC))


def _format_check(check):
    lines = ["CHECK: %s" % check.command]
    if check.returncode is None:
        lines.append("  the command did not finish")
    else:
        lines.append("  exit status %d" % check.returncode)
    if check.output_tail:
        lines.extend("  | " + line for line in check.output_tail.splitlines())
    if not check.runs:
        lines.append("  no training session.run was audited")
    for number, run in enumerate(check.runs, 1):
        fetches = ", ".join(run.fetches[:6]) + (", ..." if len(run.fetches) > 6 else "")
        lines.append("  run %d fetched %s:" % (number, fetches))
        for code, severity, message in run.findings:
            lines.append("    %s %s: %s" % (code, severity, message))
        if not run.findings:
            lines.append("    no findings")
        lines.append(_atomic_line(run))
    lines.append("  read: docs/audit.md for each code")
    return lines
