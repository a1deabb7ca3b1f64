"""The audit's command line: ``python -m npu_lossscale.audit model.meta``.

It reads a ``.meta`` file (``load_meta_graph``), audits it with the fetches
given (``audit``) and prints the findings, as text or JSON. The audit itself
is ``npu_lossscale.audit``; ``npu_lossscale/audit/__main__.py`` runs this.
"""

from __future__ import absolute_import, division, print_function

import argparse
import json
import sys

from npu_lossscale.audit import audit, load_meta_graph


def _format(finding):
    ops = ", ".join(finding.ops[:8]) + (", ..." if len(finding.ops) > 8 else "")
    return "%s %s: %s%s" % (finding.code, finding.severity, finding.message,
                            "\n    ops: %s" % ops if ops else "")


def main(argv=None):
    """The command line: ``python -m npu_lossscale.audit model.meta [--fetch NAME ...] [--json]``.

    Args:
      argv: the arguments (without the program name); ``sys.argv[1:]`` if None.

    Returns:
      The exit status: 1 when there is an error finding, 2 on a usage error
      (a bad file or fetch included),
      else 0.
    """
    parser = argparse.ArgumentParser(
        prog="python -m npu_lossscale.audit",
        description="Audit a TF1 MetaGraphDef for loss-scaling hazards.")
    parser.add_argument("meta", help="a .meta file (tf.train.export_meta_graph / Saver)")
    parser.add_argument("--fetch", action="append", default=None, metavar="NAME",
                        help="an op or tensor run in the same session.run (repeat)")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list of {code, severity, message, ops}")
    args = parser.parse_args(argv)
    try:
        findings = audit(load_meta_graph(args.meta), fetches=args.fetch)
    except (IOError, OSError) as error:
        sys.stderr.write("npu_lossscale.audit: cannot read %s (%s). Pass the path of a "
                         ".meta file.\n" % (args.meta, error.strerror or error))
        return 2
    except (ValueError, TypeError) as error:
        sys.stderr.write("npu_lossscale.audit: %s\n" % (error,))
        return 2
    if args.json:
        print(json.dumps([dict(code=f.code, severity=f.severity, message=f.message,
                               ops=list(f.ops)) for f in findings], indent=2))
    else:
        for finding in findings:
            print(_format(finding))
        if not findings:
            print("no findings")
    return 1 if any(f.severity == "error" for f in findings) else 0
