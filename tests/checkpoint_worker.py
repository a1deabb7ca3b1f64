"""Training worker for tests/test_checkpoint.py: train, save, restore, resume.

Imported by the test (``run``) and run as a script in fresh processes::

  python tests/checkpoint_worker.py --until 100 --job DIR ACCUMULATION RESUME OUT \
      [--job ...] [--save-at 50] [--save-every 7] [--max-to-keep 3]

where RESUME is none, latest or a checkpoint path and OUT an .npz or "-".
Several jobs (e.g. with and without accumulation) run in lockstep in one
process, so one TensorFlow import serves them all.

The model is ``models.two_group_gan`` in float16 (float32 master weights),
trained by two Adam optimizers through one ``MultiOptimizerLossScale``: the
discriminator on the builder's ExponentialUpdateLossScaleManager, the
generator on its own DynamicLossScaleManager, so the checkpoint holds two
managers' state. A ``runs`` variable counts runs of the update op (micro-steps
with accumulation); it names the checkpoints (``ckpt-<runs>``).

Everything a run computes is a function of the run index alone: the batch
comes from ``numpy.random.RandomState(1000 + run)`` and the overflow
injections from ``injection(run)``. The graph holds no random op. A resumed
process therefore feeds exactly the batches and injections the uninterrupted
process fed. Sessions use one intra-op and one inter-op thread.

Lines printed (flushed), each prefixed with the job's directory:
``restored <runs>``, ``saved <runs> <path>`` after each save returns,
``done <runs>`` at the end.
"""

from __future__ import absolute_import, division, print_function

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (HERE, REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

if __name__ == "__main__":
    # Only as a script: importing the module must not change the importing
    # process's environment. (The tests also pass both to the subprocesses.)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import tensorflow.compat.v1 as tf  # noqa: E402

import npu_lossscale as nl  # noqa: E402
from graph_mode import set_graph_mode  # noqa: E402
from models import two_group_gan  # noqa: E402

BATCH, DIM = 8, 4
# Forced injections (run index -> kind), on both sides of the save points the
# tests use (50, and every 7), on top of the seeded random ones.
FORCED = {5: "x", 6: "g", 19: "g", 33: "x", 48: "g", 49: "x", 53: "x", 54: "x",
          70: "g", 71: "x", 88: "g"}
BAD_VALUES = (np.inf, np.nan, -np.inf)

LOG_FIELDS = ("run", "finite", "applied", "window_end", "d_scale", "g_scale")


def injection(run):
    """What run ``run`` injects: None, "x" (the input: both groups overflow)
    or "g" (the generator's loss only), and the bad value."""
    rng = np.random.RandomState(10 ** 6 + run)
    kind = FORCED.get(run)
    if kind is None and rng.rand() < 0.08:
        kind = "x" if rng.rand() < 0.5 else "g"
    return kind, BAD_VALUES[rng.randint(len(BAD_VALUES))]


def batch(run):
    """The input batch of run ``run``."""
    return np.random.RandomState(1000 + run).normal(0.0, 1.0, [BATCH, DIM]).astype(np.float32)


def build(accumulation):
    """The training graph in the default graph; returns a dict of handles."""
    model = two_group_gan(compute_dtype=tf.float16, batch=BATCH, dim=DIM, seed=1)
    d_manager = nl.ExponentialUpdateLossScaleManager(
        2.0 ** 10, incr_every_n_steps=3, decr_every_n_nan_or_inf=2, decr_ratio=0.5)
    g_manager = nl.DynamicLossScaleManager(2.0 ** 12, growth_steps=4)
    global_step = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(d_manager, backend="is_finite")
    scaler.add(model.d_loss, tf.train.AdamOptimizer(0.01), var_list=model.d_vars,
               name="discriminator")
    scaler.add(model.g_loss, tf.train.AdamOptimizer(0.02, beta1=0.5),
               var_list=model.g_vars, name="generator", loss_scale_manager=g_manager)
    train = scaler.build(global_step=global_step, accumulation_steps=accumulation)
    runs = tf.Variable(0, dtype=tf.int64, trainable=False, name="runs")
    with tf.control_dependencies([train.update_op]):
        step = tf.assign_add(runs, 1)
    fetches = [step, train.is_finite, train.applied, train.window_end,
               train.groups["discriminator"].loss_scale, train.groups["generator"].loss_scale]
    return dict(model=model, train=train, runs=runs, fetches=fetches,
                managers=(d_manager, g_manager), global_step=global_step)


def session_config():
    return tf.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)


class Trainer(object):
    """One training run in its own graph and session, stepped by the caller.

    Args:
      directory: the checkpoint directory (prefix ``ckpt``).
      accumulation: ``accumulation_steps`` for the builder.
      resume: None (start from the initial values), "latest" (the state file's
        checkpoint) or a checkpoint path.
      save_at: run counts at which to save.
      save_every: also save whenever the run count is a multiple of this.
      max_to_keep: the Saver's ``max_to_keep``.
      announce: callable for the progress lines, or None.
      snapshot_at: run counts at which to record every variable's value.

    Attributes (the result):
      done: the run count.
      log: one tuple of LOG_FIELDS per run executed here.
      restored: the run count restored, or None.
      restored_state: {name: value} right after the restore, or None.
      saved: list of (runs, path).
      snapshots: run count -> {name: value}.
      state: after ``close()``, the final {name: value}.
    """

    def __init__(self, directory, accumulation, resume=None, save_at=(), save_every=None,
                 max_to_keep=5, announce=None, snapshot_at=()):
        self.accumulation = accumulation
        self._directory = directory
        self._save_at = tuple(save_at)
        self._save_every = save_every
        self._snapshot_at = tuple(snapshot_at)
        self._announce = announce or (lambda line: None)
        self.log, self.saved, self.snapshots = [], [], {}
        self.restored = self.restored_state = self.state = None
        self._graph = tf.Graph()
        with self._graph.as_default():
            handles = build(accumulation)
            self._runs = handles["runs"]
            self._saver = tf.train.Saver(max_to_keep=max_to_keep)
            init = tf.global_variables_initializer()
            self._variables = tf.global_variables()
        self._graph.finalize()
        self._sess = tf.Session(graph=self._graph, config=session_config())
        if resume is None:
            self._sess.run(init)
        else:
            path = tf.train.latest_checkpoint(directory) if resume == "latest" else resume
            if path is None:
                raise RuntimeError("no checkpoint to resume from in %r" % directory)
            self._saver.restore(self._sess, path)
            self.restored = int(self._sess.run(self._runs))
            self.restored_state = self.variables()
            self._announce("restored %d" % self.restored)
        model = handles["model"]
        self._step = self._sess.make_callable(handles["fetches"],
                                              feed_list=[model.x, model.poison_g])
        self.done = int(self._sess.run(self._runs))
        self._after_run(save=resume is None)  # no re-save of the restored checkpoint

    def variables(self):
        """Every global variable's value, by name."""
        return dict(zip([v.op.name for v in self._variables],
                        self._sess.run(self._variables)))

    def _after_run(self, save=True):
        count = self.done
        if count in self._snapshot_at:
            self.snapshots[count] = self.variables()
        if save and (count in self._save_at or (self._save_every and count
                                                and count % self._save_every == 0)):
            path = self._saver.save(self._sess, os.path.join(self._directory, "ckpt"),
                                    global_step=count)
            self.saved.append((count, path))
            self._announce("saved %d %s" % (count, path))

    def step(self):
        """Runs run number ``done`` with its batch and injection."""
        run = self.done
        x, poison = batch(run), 1.0
        kind, value = injection(run)
        if kind == "x":
            x[run % BATCH, run % DIM] = value
        elif kind == "g":
            poison = value
        out = self._step(x, poison)
        if int(out[0]) != run + 1:
            raise RuntimeError("runs is %d after run %d" % (out[0], run))
        self.log.append((run,) + tuple(
            bool(v) if isinstance(v, (bool, np.bool_)) else float(v) for v in out[1:]))
        self.done += 1
        self._after_run()

    def close(self):
        """Records the final state and closes the session."""
        self.state = self.variables()
        self._sess.close()
        self._announce("done %d" % self.done)


def run_lockstep(trainers, until, step_sleep=0.0):
    """Steps every trainer to ``until`` runs, one run each in turn, then
    closes them. ``step_sleep`` seconds pass after each round (a killer's
    window)."""
    while any(t.done < until for t in trainers):
        for trainer in trainers:
            if trainer.done < until:
                trainer.step()
        if step_sleep:
            time.sleep(step_sleep)
    for trainer in trainers:
        trainer.close()
    return trainers


def run(directory, accumulation, until, **kwargs):
    """One ``Trainer(directory, accumulation, **kwargs)`` run to ``until``."""
    return run_lockstep([Trainer(directory, accumulation, **kwargs)], until)[0]


def save_result(trainer, path):
    """Writes a finished trainer's result to ``path`` (.npz)."""
    arrays = dict(("var/" + name, np.asarray(value)) for name, value in trainer.state.items())
    for name, value in (trainer.restored_state or {}).items():
        arrays["restored_var/" + name] = np.asarray(value)
    arrays["log"] = np.array(trainer.log, dtype=np.float64).reshape(-1, len(LOG_FIELDS))
    arrays["restored"] = np.array(-1 if trainer.restored is None else trainer.restored)
    np.savez(path, **arrays)


class Result(object):
    """What ``save_result`` wrote, with a finished Trainer's attribute names:
    ``state``, ``log``, ``restored``, ``restored_state``."""

    def __init__(self, path):
        with np.load(path) as data:
            def variables(prefix):
                return dict((key[len(prefix):], data[key]) for key in data.files
                            if key.startswith(prefix))
            self.state = variables("var/")
            self.restored_state = variables("restored_var/") or None
            self.log = [tuple([int(row[0])] + [bool(v) for v in row[1:4]]
                              + [float(v) for v in row[4:]]) for row in data["log"]]
            restored = int(data["restored"])
        self.restored = None if restored < 0 else restored


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--job", nargs=4, action="append", required=True,
        metavar=("DIR", "ACCUMULATION", "RESUME", "OUT"),
        help="a run: checkpoint dir, accumulation_steps, 'none'/'latest'/a "
             "checkpoint path, and an .npz for its result or '-'. Several jobs "
             "run in lockstep in this process; lines are prefixed with DIR.")
    parser.add_argument("--until", type=int, required=True)
    parser.add_argument("--save-at", type=int, nargs="*", default=())
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--max-to-keep", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args(argv)
    set_graph_mode()
    trainers = []
    for directory, accumulation, resume, _ in args.job:
        def announce(line, directory=directory):
            print("%s %s" % (directory, line), flush=True)
        trainers.append(Trainer(
            directory, int(accumulation), resume=None if resume == "none" else resume,
            save_at=args.save_at, save_every=args.save_every,
            max_to_keep=args.max_to_keep, announce=announce))
    run_lockstep(trainers, args.until, step_sleep=args.step_sleep)
    for trainer, (_, _, _, out) in zip(trainers, args.job):
        if out != "-":
            save_result(trainer, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
