"""Error messages stay short: one plain sentence plus the fix.

Each message names the argument, shows the value and says the fix; longer
explanations belong in the docs (docs/errors.md, "Bad input"). The constant text of
every ``raise ValueError(...)``/``raise TypeError(...)`` in the library is
measured from the source (the formatted values are not counted). Issue 25
measured a median of 127 and a maximum of 439 characters before the
messages were cut; these bounds keep them from growing back.
"""

import ast
import os
import statistics

from conftest import REPO

#: Limits on the constant text of one message, in characters.
MEDIAN_LIMIT = 110
MAX_LIMIT = 300


def _messages():
    """(length, "path:line") of every raise's message in npu_lossscale/."""
    found = []
    root = os.path.join(REPO, "npu_lossscale")
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as source:
                tree = ast.parse(source.read())
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                        and node.exc.args):
                    continue
                text = "".join(part.value for part in ast.walk(node.exc.args[0])
                               if isinstance(part, ast.Constant)
                               and isinstance(part.value, str))
                if text:
                    where = "%s:%d" % (os.path.relpath(path, REPO), node.lineno)
                    found.append((len(text), where))
    return found


def test_messages_are_short():
    messages = _messages()
    assert len(messages) > 50  # the library's checks were found
    lengths = [length for length, _ in messages]
    assert statistics.median(lengths) <= MEDIAN_LIMIT, statistics.median(lengths)
    too_long = [(length, where) for length, where in messages if length > MAX_LIMIT]
    assert not too_long, too_long
