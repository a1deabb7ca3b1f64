"""``python -m npu_lossscale.port``: the port's documented entry point.

The port itself is a tool, in ``npu_lossscale/tools/port/`` (docs/port.md);
this package hands its public names on.
"""

from __future__ import absolute_import, division, print_function

from npu_lossscale.tools.port import REPORT_SUFFIX, main, port

__all__ = ["port", "main", "REPORT_SUFFIX"]
