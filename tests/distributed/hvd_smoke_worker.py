"""Horovod + TF1 graph-mode smoke worker (Gloo, CPU, loopback only).

Not a pytest module (no ``test_`` prefix): it is the program each rank runs.
Launch it with 2 ranks on this machine, as root, without ssh or MPI:

    .venv-tf215/bin/horovodrun -np 2 -H localhost:2 --gloo \
        --network-interfaces lo \
        .venv-tf215/bin/python tests/distributed/hvd_smoke_worker.py

``-H localhost:2`` makes horovodrun treat every slot as local, so it forks the
ranks directly (no ssh).  ``--network-interfaces lo`` pins the Gloo rendezvous
and the ranks' Gloo transport to loopback (it sets HOROVOD_GLOO_IFACE=lo for
the workers) instead of letting horovodrun probe every interface.  Gloo has no
"--allow-run-as-root" check (that is Open MPI's mpirun), so root is fine.

Sketch of the pytest wrapper (the launcher test lives elsewhere; skip it when
horovod is not installed in the running interpreter):

    import os, shutil, subprocess, sys, pytest
    pytest.importorskip("horovod.tensorflow")
    def test_hvd_allreduce_2_ranks():
        bindir = os.path.dirname(sys.executable)
        hvdrun = os.path.join(bindir, "horovodrun")
        worker = os.path.join(os.path.dirname(__file__), "hvd_smoke_worker.py")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
        r = subprocess.run([hvdrun, "-np", "2", "-H", "localhost:2", "--gloo",
                            "--network-interfaces", "lo",
                            sys.executable, worker],
                           env=env, capture_output=True, text=True, timeout=180)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        assert out.count("HVD_SMOKE_OK") == 2, out

Every rank checks its own results and exits non-zero on a mismatch, so
horovodrun's exit code is the verdict; each rank also prints one
``HVD_SMOKE_OK rank=R size=S`` line.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_eager_execution()

import horovod.tensorflow as hvd  # noqa: E402


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    base = np.arange(4, dtype=np.float32)
    x = tf.constant(base + rank, name="x")  # rank-dependent tensor

    summed = hvd.allreduce(x, op=hvd.Sum, name="sum32")
    averaged = hvd.allreduce(x, op=hvd.Average, name="avg32")
    # float16 path: the library's gradients are fp16.
    summed16 = hvd.allreduce(tf.cast(x, tf.float16), op=hvd.Sum, name="sum16")
    # Cross-rank overflow flag, as a loss scaler needs: 1.0 on rank 0 only.
    flag = tf.constant([1.0 if rank == 0 else 0.0], dtype=tf.float32)
    any_overflow = hvd.allreduce(flag, op=hvd.Max, name="anyinf")
    # Graph-mode variable broadcast from rank 0.
    v = tf.get_variable("v", initializer=tf.constant(float(rank + 10)))
    bcast = hvd.broadcast_global_variables(0)

    config = tf.ConfigProto(intra_op_parallelism_threads=1,
                            inter_op_parallelism_threads=1)
    with tf.Session(config=config) as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(bcast)
        s, a, s16, anyinf, vv = sess.run(
            [summed, averaged, summed16, any_overflow, v])

    offset = size * (size - 1) / 2.0  # sum over ranks of `rank`
    exp_sum = size * base + offset
    exp_avg = exp_sum / size
    np.testing.assert_allclose(s, exp_sum)
    np.testing.assert_allclose(a, exp_avg)
    assert s16.dtype == np.float16, s16.dtype
    np.testing.assert_allclose(s16.astype(np.float32), exp_sum)
    np.testing.assert_allclose(anyinf, [1.0])
    assert vv == 10.0, vv  # rank 0's initial value everywhere

    print("HVD_SMOKE_OK rank=%d size=%d sum=%s avg=%s sum16=%s anyinf=%s v=%s"
          % (rank, size, s.tolist(), a.tolist(), s16.tolist(),
             anyinf.tolist(), vv), flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
