"""``python -m npu_lossscale.audit model.meta [--fetch NAME ...] [--json]``."""

from __future__ import absolute_import, division, print_function

import sys

from npu_lossscale.tools.audit_cli import main

if __name__ == "__main__":
    sys.exit(main())
