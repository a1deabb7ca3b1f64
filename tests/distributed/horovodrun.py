"""``horovodrun``, told whether Horovod was built with Gloo.

On every launch, horovodrun asks whether Horovod was built with Gloo by
importing ``horovod.tensorflow``, and so TensorFlow, in a child process of
its own: 5 s of CPU on the test machines, before any rank starts. The tests
have imported Horovod already and ask it once (``hvd.gloo_built()``); this
wrapper hands that answer to horovodrun's own launcher, which then runs as
the ``horovodrun`` command does.

Usage: python horovodrun.py --gloo-built=1|0 [horovodrun's arguments]
"""

import sys

from horovod.common import util

if __name__ == "__main__":
    if not sys.argv[1:] or not sys.argv[1].startswith("--gloo-built="):
        raise SystemExit("usage: horovodrun.py --gloo-built=1|0 [horovodrun's arguments]")
    built = sys.argv.pop(1).split("=", 1)[1] == "1"
    # Before the launcher imports it by name.
    util.gloo_built = lambda verbose=False: built
    from horovod.runner.launch import run_commandline  # noqa: E402 pylint: disable=wrong-import-position
    sys.argv[0] = "horovodrun"
    sys.exit(run_commandline())
