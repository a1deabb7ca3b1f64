"""``python -m npu_lossscale.port INPUT -o OUTPUT [--check COMMAND]``."""

from __future__ import absolute_import, division, print_function

import sys

from npu_lossscale.port import main

if __name__ == "__main__":
    sys.exit(main())
