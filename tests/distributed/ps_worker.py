"""One task of a localhost parameter-server cluster (launched by
tests/test_sync_replicas.py): ``ps`` serves the variables, each ``worker``
trains through ``MonitoredTrainingSession``.

The model is ``loss = sum(w * x)``: its gradient is the batch ``x``, the same
on both workers, so each applied step (whichever pushes it averages) moves
``w`` by exactly ``-LEARNING_RATE * X`` and the end state can be computed by
hand. Worker 1's batch is ``[inf, ...]`` at its run ``POISON_STEP``.

Modes:
  builder   a builder group whose optimizer is a SyncReplicasOptimizer
  outside   LossScaleOptimizer(SyncReplicasOptimizer(opt))
  inside    SyncReplicasOptimizer(LossScaleOptimizer(opt))
  async     no SyncReplicas: each worker applies its own gradients
            (distributed=False) with its own manager (one per worker, all
            declared in every worker's graph so that the chief initialises
            them; worker i uses the i-th)

Each worker writes ``<out>/worker<i>.json``: per run, its own decision
(``is_finite``, and ``applied`` in async mode); at the end, once both workers
have finished (a counter on the parameter server), the shared state: global
step, weights, every manager's scale, the builder's ``skipped_steps``.
``<out>/worker<i>.progress`` gets a line per run, so a hang can name where.

Usage: ps_worker.py OUT PORTS ROLE TASK MODE   (PORTS: ps,worker0,worker1)
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

from graph_mode import set_graph_mode  # noqa: E402

set_graph_mode()

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

import npu_lossscale as nl  # noqa: E402

WORKERS, STEPS, POISON_WORKER, POISON_STEP = 2, 6, 1, 2
W0, X = [1.0, 2.0], [0.25, 0.5]
LEARNING_RATE = 1.0
WAIT_SECONDS = 60


def _sgd():
    # use_locking: asynchronous workers' applies to one variable must not race.
    return tf.train.GradientDescentOptimizer(LEARNING_RATE, use_locking=True)


def _manager():
    return nl.DynamicLossScaleManager(initial_scale=1024, growth_steps=1000)


def build(mode, task, loss, w, gs):
    """Returns (train op, this worker's is_finite or None, applied or None,
    the sync optimizer or None, dict of reads of the shared state)."""
    reads = {"global_step": gs, "w": w}
    if mode == "builder":
        manager = _manager()
        sync = nl.SyncReplicasOptimizer(_sgd(), replicas_to_aggregate=WORKERS,
                                        total_num_replicas=WORKERS)
        scaler = nl.MultiOptimizerLossScale(manager)
        scaler.add(loss, sync, var_list=[w], name="model")
        train = scaler.build(global_step=gs, count_skipped_steps=True)
        reads.update(scales=[manager.get_loss_scale()], skipped_steps=train.skipped_steps)
        return train.update_op, train.is_finite, None, sync, reads
    if mode == "outside":
        manager = _manager()
        sync = nl.SyncReplicasOptimizer(_sgd(), replicas_to_aggregate=WORKERS,
                                        total_num_replicas=WORKERS)
        opt = nl.LossScaleOptimizer(sync, manager, count_skipped_steps=True)
        reads.update(scales=[manager.get_loss_scale()])
        return opt.minimize(loss, global_step=gs), None, None, sync, reads
    if mode == "inside":
        manager = _manager()
        sync = tf.train.SyncReplicasOptimizer(
            nl.LossScaleOptimizer(_sgd(), manager, count_skipped_steps=True),
            replicas_to_aggregate=WORKERS, total_num_replicas=WORKERS)
        reads.update(scales=[manager.get_loss_scale()])
        return sync.minimize(loss, global_step=gs), None, None, sync, reads
    if mode == "async":
        managers = []
        for index in range(WORKERS):
            with tf.name_scope("worker_%d" % index):
                managers.append(_manager())
        scaler = nl.MultiOptimizerLossScale(managers[task], distributed=False)
        scaler.add(loss, _sgd(), var_list=[w], name="model")
        train = scaler.build(global_step=gs)
        reads.update(scales=[m.get_loss_scale() for m in managers],
                     skipped_steps=train.skipped_steps)
        return train.update_op, train.is_finite, train.applied, None, reads
    raise SystemExit("unknown mode %r" % mode)


def _wait(what, ready):
    start = time.time()
    while not ready():
        if time.time() - start > WAIT_SECONDS:
            raise SystemExit("waited %ds for %s" % (WAIT_SECONDS, what))
        time.sleep(0.1)


def worker(out, cluster, task, mode):
    server = tf.train.Server(cluster, job_name="worker", task_index=task, config=tf.ConfigProto(
        device_filters=["/job:ps", "/job:worker/task:%d" % task]))
    progress = open(os.path.join(out, "worker%d.progress" % task), "w")
    chief = task == 0
    with tf.device(tf.train.replica_device_setter(
            worker_device="/job:worker/task:%d" % task, cluster=cluster)):
        gs = tf.train.get_or_create_global_step()
        x = tf.placeholder(tf.float32, [2], name="x")
        w = tf.Variable(W0, name="w")
        loss = tf.reduce_sum(w * x)
        train, is_finite, applied, sync, reads = build(mode, task, loss, w, gs)
        done = tf.Variable(0, name="workers_done", trainable=False)
        finish = tf.assign_add(done, 1)
    hooks = [] if sync is None else [sync.make_session_run_hook(chief, num_tokens=0)]
    if not chief:
        # The chief initialises; a worker's MonitoredTrainingSession checks
        # readiness only every 30 s, so wait here first.
        uninitialized = tf.report_uninitialized_variables(tf.global_variables())
        with tf.Session(server.target) as probe:
            _wait("the chief's initialisation", lambda: probe.run(uninitialized).size == 0)
    fetches = {"train": train}
    if is_finite is not None:
        fetches["is_finite"] = is_finite
    if applied is not None:
        fetches["applied"] = applied
    records = []
    with tf.train.MonitoredTrainingSession(master=server.target, is_chief=chief, hooks=hooks,
                                           stop_grace_period_secs=1,
                                           save_checkpoint_secs=None,
                                           save_summaries_steps=None) as session:
        for step in range(STEPS):
            poisoned = task == POISON_WORKER and step == POISON_STEP
            out_values = session.run(fetches, {x: [np.inf, X[1]] if poisoned else X})
            records.append(dict((key, bool(value)) for key, value in out_values.items()
                                if key != "train"))
            progress.write("run %d\n" % step)
            progress.flush()
        with tf.Session(server.target) as plain:
            plain.run(finish)
            _wait("the other workers", lambda: plain.run(done) == WORKERS)
            state = plain.run(reads)
    result = {"task": task, "records": records,
              "state": dict((key, np.asarray(value).tolist()) for key, value in state.items())}
    with open(os.path.join(out, "worker%d.json" % task), "w") as handle:
        json.dump(result, handle)


def main():
    out, ports, role, task, mode = sys.argv[1:6]
    ports = ports.split(",")
    cluster = tf.train.ClusterSpec({
        "ps": ["127.0.0.1:%s" % ports[0]],
        "worker": ["127.0.0.1:%s" % port for port in ports[1:]]})
    if role == "ps":
        tf.train.Server(cluster, job_name="ps", task_index=0).join()
        return
    worker(out, cluster, int(task), mode)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the in-process server has no clean shutdown


if __name__ == "__main__":
    main()
