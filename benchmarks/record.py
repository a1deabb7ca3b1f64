"""A measurement's result files: the machine it ran on, then JSON and Markdown.

``first_scale.py`` and ``listening.py`` each write ``STEM.json`` (the
figures, with the machine and the load average at the start and the end)
and ``STEM.md`` (their table), and print the table.
"""

from __future__ import absolute_import, division, print_function

import json
import os
import platform
import time

import numpy as np


def machine(tensorflow_version):
    """The head of a result: the date, the machine, its cores, TensorFlow's
    version and the 1-minute load average at the start."""
    return {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
            "cpus": "%d cores" % os.cpu_count(), "tensorflow": tensorflow_version,
            "load_average": "%.1f" % os.getloadavg()[0]}


def write(result, out, stem, markdown):
    """Adds the load average at the end to ``result``, writes
    ``out/STEM.json`` and ``out/STEM.md`` (``markdown(result)``) and prints
    the Markdown."""
    result["load_average_end"] = "%.1f" % os.getloadavg()[0]
    with open(os.path.join(out, stem + ".json"), "w") as handle:
        json.dump(result, handle, indent=2, sort_keys=True)
        handle.write("\n")
    text = markdown(result)
    with open(os.path.join(out, stem + ".md"), "w") as handle:
        handle.write(text)
    print(text)


def power_of_two(value):
    """A loss scale as the tables show it: ``2**k``, ``1``, or the number
    when it is no power of two."""
    exponent = np.log2(value)
    if exponent != int(exponent):
        return "%g" % value
    return "2**%d" % exponent if exponent else "1"
