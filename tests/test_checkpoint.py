"""Checkpoints: a restore in a new process, and a SIGKILL mid-run, lose nothing.

The worker (tests/checkpoint_worker.py) trains a float16 two-optimizer GAN
with two loss-scale managers, overflow injections on both sides of every save
point, and feeds keyed by the run index; it runs without and with gradient
accumulation (accumulation_steps=4), in lockstep when both share a process.
Everything is compared bit for bit (``tobytes``): weights, Adam slots and beta
powers, global step, both managers' state, the accumulators and the run
counter.

One module fixture does the work, in three processes, so that TensorFlow is
imported twice rather than once per check:

1. a worker that saves every EVERY runs starts (and imports TensorFlow) while
   2. this process runs the references: from scratch, saving at N and
      continuing to 2N in one process; the worker is SIGKILLed by a reader
      thread once KILL_AFTER saves are announced;
3. a new process restores each reference's checkpoint at N and each killed
   run's latest checkpoint, and runs all of them to 2N.
"""

import os
import signal
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import checkpoint_worker as worker
import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "checkpoint_worker.py")
ACCUMULATIONS = (1, 4)
N = 50           # the save point: 50 % 4 == 2, mid-window with accumulation=4
END = 2 * N
EVERY = 7        # periodic saves of the killed run: mostly mid-window too
KEEP = 2         # the killed run's Saver max_to_keep: the first save is deleted
KILL_AFTER = 3   # saves announced (by either job) before the SIGKILL
TIMEOUT = 300


def _worker_env():
    env = dict(os.environ)
    env.setdefault("NPU_LOSSSCALE_GRAPH_MODE", "v2")
    env["TF_DETERMINISTIC_OPS"] = "1"
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def _popen(args, stderr=subprocess.PIPE):
    return warm_python.Popen([sys.executable, WORKER] + [str(a) for a in args],
                            env=_worker_env(), stdout=subprocess.PIPE,
                            stderr=stderr, text=True)


class _KilledRun(object):
    """A worker that a reader thread SIGKILLs after KILL_AFTER saves."""

    def __init__(self, directories):
        args = ["--until", END, "--save-every", EVERY, "--max-to-keep", KEEP,
                "--step-sleep", 0.05]
        for directory, accumulation in directories:
            args += ["--job", directory, accumulation, "none", "-"]
        # stderr goes to a file: a pipe nobody reads could fill and block it.
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = _popen(args, stderr=self._stderr)
        self.lines = []
        self._thread = threading.Thread(target=self._read)
        self._thread.start()

    def _read(self):
        count = {}
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append(line)
            directory, _, what = line.partition(" ")
            if what.startswith("saved "):
                count[directory] = count.get(directory, 0) + 1
                if count[directory] == KILL_AFTER:
                    os.kill(self.proc.pid, signal.SIGKILL)

    def wait(self):
        try:
            self.proc.wait(timeout=TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._thread.join()
            self.proc.stdout.close()
            self._stderr.seek(0)
            self.stderr = self._stderr.read()
            self._stderr.close()

    def saved(self, directory):
        """The run counts of the saves the job announced."""
        return [int(line.split()[2]) for line in self.lines
                if line.startswith(directory + " saved ")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("checkpoints")
    killed_dirs = dict((a, str(base / ("killed%d" % a))) for a in ACCUMULATIONS)
    killed = _KilledRun([(killed_dirs[a], a) for a in ACCUMULATIONS])
    try:
        references = {}
        for a in ACCUMULATIONS:
            references[a] = worker.run(str(base / ("reference%d" % a)), a, END,
                                       save_at=(N,), snapshot_at=range(END + 1))
    finally:
        killed.wait()
    assert killed.proc.returncode == -signal.SIGKILL, "".join(killed.lines) + killed.stderr

    outputs = dict((a, (str(base / ("restored%d.npz" % a)), str(base / ("resumed%d.npz" % a))))
                   for a in ACCUMULATIONS)
    args = ["--until", END]
    for a in ACCUMULATIONS:
        args += ["--job", str(base / ("reference%d" % a)), a,
                 dict(references[a].saved)[N], outputs[a][0]]
        args += ["--job", killed_dirs[a], a, "latest", outputs[a][1]]
    restorer = _popen(args)
    try:
        stdout, stderr = restorer.communicate(timeout=TIMEOUT)
    finally:
        if restorer.poll() is None:
            restorer.kill()
            restorer.communicate()
    assert restorer.returncode == 0, stdout + stderr
    return dict(references=references, killed=killed, killed_dirs=killed_dirs,
                restored=dict((a, worker.Result(outputs[a][0])) for a in ACCUMULATIONS),
                resumed=dict((a, worker.Result(outputs[a][1])) for a in ACCUMULATIONS),
                restorer_stdout=stdout)


def _assert_bit_identical(ours, ref):
    ours = dict((k, np.asarray(v)) for k, v in ours.items())
    ref = dict((k, np.asarray(v)) for k, v in ref.items())
    assert sorted(ours) == sorted(ref)
    different = [name for name in ref
                 if ours[name].dtype != ref[name].dtype
                 or ours[name].tobytes() != ref[name].tobytes()]
    assert not different, different


# The managers' state is one float32 vector [scale, good, bad, streak].
_FIELDS = {"loss_scale": 0, "good_steps": 1, "bad_steps": 2}


def _manager(values, kind, field):
    prefix = {"d": "exponential_loss_scale/", "g": "dynamic_loss_scale/"}[kind]
    return values[prefix + "state"][_FIELDS[field]]


@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_reference_run_is_non_trivial(runs, accumulation):
    """Overflows on both sides of N, and a loss-scale state worth restoring."""
    reference = runs["references"][accumulation]
    log = reference.log
    assert [row[0] for row in log] == list(range(END))
    assert sum(not row[1] for row in log if row[0] < N) >= 5
    assert sum(not row[1] for row in log if row[0] >= N) >= 5
    assert sum(row[2] for row in log) >= (8 if accumulation > 1 else 60)
    at_n = reference.snapshots[N]
    assert _manager(at_n, "d", "loss_scale") != 2.0 ** 10 or _manager(at_n, "d", "bad_steps")
    assert _manager(at_n, "g", "loss_scale") != 2.0 ** 12
    # The two managers moved independently (generator-only injections).
    assert len(set(row[4] for row in log)) >= 2 and len(set(row[5] for row in log)) >= 2
    assert any(row[4] != row[5] for row in log)
    if accumulation == 1:
        assert _manager(at_n, "d", "bad_steps") == 1  # run 49 overflowed: a back-off is due
        assert at_n["global_step"] == sum(row[2] for row in log if row[0] < N)
    else:
        assert at_n["loss_scale/accumulate/micro_step"] == N % 4 == 2  # mid-window
        assert at_n["loss_scale/accumulate/window_flags"].any()  # run 49 overflowed
        assert any(np.any(value != 0) for name, value in at_n.items()
                   if name.startswith("loss_scale/accumulate/")
                   and not name.endswith(("micro_step", "window_flags")))
    # The checkpoint holds exactly the state at N.
    reader = tf.train.load_checkpoint(dict(reference.saved)[N])
    _assert_bit_identical(dict((name, reader.get_tensor(name)) for name in at_n), at_n)


@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_restore_at_n_in_a_new_process_is_bit_identical(runs, accumulation):
    reference = runs["references"][accumulation]
    restored = runs["restored"][accumulation]
    assert restored.restored == N
    # The new process starts from the same bits as the saving one had at N...
    _assert_bit_identical(restored.restored_state, reference.snapshots[N])
    # ...makes the same decisions with the same scales, run by run...
    assert restored.log == [row for row in reference.log if row[0] >= N]
    # ...and ends with the same bits in every variable at 2N.
    _assert_bit_identical(restored.state, reference.state)
    assert restored.state["runs"] == END


@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_sigkill_mid_run_then_resume_loses_only_the_steps_since_the_checkpoint(
        runs, accumulation):
    killed, directory = runs["killed"], runs["killed_dirs"][accumulation]
    assert not [line for line in killed.lines if line.split()[1] == "done"], "not killed"
    saved = killed.saved(directory)
    assert len(saved) >= KILL_AFTER - 1  # the other job may have reached KILL_AFTER first
    assert saved == [EVERY * (i + 1) for i in range(len(saved))]

    # The state file points to a complete checkpoint: the last announced one,
    # or one save later if the kill fell between a save and its announcement.
    state = tf.train.get_checkpoint_state(directory)
    latest = state.model_checkpoint_path
    step = int(latest.rsplit("-", 1)[1])
    assert step in (saved[-1], saved[-1] + EVERY) and step < END, (step, killed.lines)
    assert state.all_model_checkpoint_paths[-1] == latest
    kept = [int(p.rsplit("-", 1)[1]) for p in state.all_model_checkpoint_paths]
    assert kept == list(range(EVERY, step + 1, EVERY))[-KEEP:]

    def on_disk(count):
        return os.path.exists(os.path.join(directory, "ckpt-%d.index" % count))

    assert all(on_disk(count) for count in kept)
    # max_to_keep deleted the older ones (the Saver deletes after updating the
    # state file, so a kill in between may leave the last one it dropped).
    assert [c for c in range(EVERY, kept[0], EVERY) if on_disk(c)] in ([], [kept[0] - EVERY])
    reader = tf.train.load_checkpoint(latest)
    assert reader.get_tensor("runs") == step
    if accumulation > 1:
        assert reader.get_tensor("loss_scale/accumulate/micro_step") == step % accumulation

    # The new process resumed from the state file's checkpoint: the killed
    # process's later runs are lost, nothing else. The same runs follow and
    # the same bits come out at 2N as from the uninterrupted reference.
    reference = runs["references"][accumulation]
    resumed = runs["resumed"][accumulation]
    assert resumed.restored == step
    assert "%s restored %d" % (directory, step) in runs["restorer_stdout"]
    _assert_bit_identical(resumed.restored_state, reference.snapshots[step])
    assert resumed.log == [row for row in reference.log if row[0] >= step]
    _assert_bit_identical(resumed.state, reference.state)
