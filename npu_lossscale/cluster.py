"""The launch this process is part of, as its environment names it: the
Ascend launcher's device count, a Horovod or MPI launcher's process count, a
TF_CONFIG cluster. Read by the engines' checks (``distributed``) and by the
core's check of what an engine reduces (``core.hooks.check_reduced``)."""

from __future__ import absolute_import, division, print_function

import collections
import json
import os

#: tf_adapter reads RANK_SIZE, else CM_WORKER_SIZE, and refuses both at once
#: (``get_ranksize()`` in tf_adapter npu_bridge/estimator/npu/util.py).
RANK_SIZE_VARIABLES = ("RANK_SIZE", "CM_WORKER_SIZE")


def rank_size_from_environment(environ=None):
    """The number of devices an Ascend launcher started, from the environment.

    Read as tf_adapter reads it: ``RANK_SIZE``, else ``CM_WORKER_SIZE``; both
    set at once is an error; neither means one device.

    Args:
      environ: a mapping to read instead of ``os.environ`` (for tests).

    Returns:
      An int >= 1.

    Raises:
      ValueError: if both are set, or the value is not a positive int.
    """
    environ = os.environ if environ is None else environ
    present = [name for name in RANK_SIZE_VARIABLES if environ.get(name)]
    if len(present) > 1:
        raise ValueError(
            "both RANK_SIZE=%r and CM_WORKER_SIZE=%r are set; tf_adapter refuses "
            "that, as the device count would be ambiguous. Unset one of them."
            % (environ["RANK_SIZE"], environ["CM_WORKER_SIZE"]))
    if not present:
        return 1
    name = present[0]
    value = environ[name]
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(
            "%s must be the number of devices, a positive int, got %r. Set it as "
            "Ascend's launch scripts do (e.g. %s=8), or unset it on one device."
            % (name, value, name))
    return count


#: Launchers' variables holding the number of processes of a Horovod or MPI
#: job: horovodrun's own (Gloo and MPI), Open MPI's, MPICH's and Intel MPI's
#: (PMI), MVAPICH2's.
HOROVOD_SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                          "MV2_COMM_WORLD_SIZE")
#: TF_CONFIG's task types that train (parameter servers and evaluators do not).
_TRAINING_TASKS = ("chief", "master", "worker")


class Cluster(collections.namedtuple("Cluster", ["kind", "workers", "source"])):
    """A multi-worker launch, as this process's environment names it.

    Attributes:
      kind: "ascend" (RANK_SIZE), "horovod" (a Horovod or MPI launcher) or
        "tf_config" (a TF_CONFIG cluster: parameter servers, or TF's
        multi-worker strategies).
      workers: the number of training processes, > 1.
      source: the environment variable that says so, for messages.
    """


def cluster_from_environment(environ=None):
    """The multi-worker launch the environment names, or None for one worker.

    Args:
      environ: a mapping to read instead of ``os.environ`` (for tests).

    Returns:
      A ``Cluster``, or None.

    Raises:
      ValueError: for a bad RANK_SIZE/CM_WORKER_SIZE
        (``rank_size_from_environment``), or a TF_CONFIG that is not JSON
        with a "cluster" dict.
    """
    environ = os.environ if environ is None else environ
    ranks = rank_size_from_environment(environ)
    if ranks > 1:
        return Cluster("ascend", ranks, "RANK_SIZE/CM_WORKER_SIZE")
    for name in HOROVOD_SIZE_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return Cluster("horovod", int(value), name)
    if environ.get("TF_CONFIG"):
        try:
            cluster = json.loads(environ["TF_CONFIG"]).get("cluster") or {}
            workers = sum(len(cluster.get(kind) or ()) for kind in _TRAINING_TASKS)
        except (ValueError, AttributeError, TypeError):
            raise ValueError(
                "TF_CONFIG must be JSON with a 'cluster' dict, as tf.distribute reads it, "
                "got %r. Fix it, or unset it on one worker." % (environ["TF_CONFIG"],))
        if workers > 1:
            return Cluster("tf_config", workers, "TF_CONFIG")
    return None
