"""Writes the object checkpoints in tests/data/prev_release_checkpoint/.

They were written by the release before commit c050077 (its parent,
602a61a), whose ``LossScaleOptimizer`` tracked the wrapped optimizer as the
child ``base_optimizer``: keys ``optimizer/base_optimizer/beta1_power``
instead of today's ``optimizer/beta1_power``. tests/test_checkpoint.py
restores them with today's code.

That release could only checkpoint the optimizer without the variables it
trains: ``tf.train.Checkpoint(optimizer=opt, w=w)`` raised
NotImplementedError ("A slot variable was re-used as a dependency"), each
Adam slot being reached through both optimizers. So these checkpoints hold
what such a checkpoint could hold: Adam's beta powers, the manager's state,
the global step and the save counter; the script checks that the variant
with ``w`` still fails there.

Run from the repository root, once per graph mode::

  git worktree add /tmp/prev c050077^
  PYTHONPATH=/tmp/prev .venv/bin/python tests/data/make_prev_release_checkpoint.py v1
  PYTHONPATH=/tmp/prev .venv/bin/python tests/data/make_prev_release_checkpoint.py v2
  git worktree remove /tmp/prev

The model, data and steps are ``build_and_train`` below; the test builds the
same graph with today's code.
"""

from __future__ import absolute_import, division, print_function

import os
import sys
import tempfile

import numpy as np
import tensorflow.compat.v1 as tf

HERE = os.path.dirname(os.path.abspath(__file__))
#: Per graph mode: ref variables (v1) and resource variables (v2).
OUT = os.path.join(HERE, "prev_release_checkpoint")
#: The poison fed on each of the four steps: the third overflows.
POISONS = (1.0, 1.0, np.inf, 1.0)


def build_and_train_graph(nl):
    """The model and its LossScaleOptimizer step, built in the default graph.

    Args:
      nl: the ``npu_lossscale`` module to build with.

    Returns:
      (train op, poison placeholder, optimizer, manager, w, global step).
    """
    w = tf.get_variable("w", initializer=np.arange(6, dtype=np.float32).reshape(3, 2) / 8)
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3) / 4)
    poison = tf.placeholder_with_default(tf.constant(1.0), [], name="poison")
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0)) * poison
    global_step = tf.train.get_or_create_global_step()
    manager = nl.DynamicLossScaleManager(1024.0, growth_steps=2)
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.1), manager, backend="is_finite")
    train = opt.minimize(loss, global_step=global_step, var_list=[w])
    return train, poison, opt, manager, w, global_step


def main(mode):
    if mode == "v1":
        tf.disable_v2_behavior()
    elif mode == "v2":
        tf.disable_eager_execution()
    else:
        raise SystemExit("usage: make_prev_release_checkpoint.py v1|v2")
    import npu_lossscale as nl  # pylint: disable=import-outside-toplevel
    print("npu_lossscale from", os.path.dirname(nl.__file__))
    train, poison, opt, _, w, global_step = build_and_train_graph(nl)
    with_w = tf.train.Checkpoint(optimizer=opt, w=w)
    checkpoint = tf.train.Checkpoint(optimizer=opt, step=global_step)
    out = os.path.join(OUT, mode)
    if not os.path.isdir(out):
        os.makedirs(out)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        try:
            with_w.save(os.path.join(tempfile.mkdtemp(), "ckpt"), session=sess)
        except NotImplementedError as error:
            print("with w, as expected:", error)
        else:
            raise SystemExit("this is not the previous release: it saves w with the optimizer")
        for value in POISONS:
            sess.run(train, {poison: value})
        path = checkpoint.save(os.path.join(out, "ckpt"), session=sess)
    os.remove(os.path.join(out, "checkpoint"))  # the test names the file itself
    print("wrote", path)
    for name, shape in tf.train.list_variables(path):
        print("  %s %s %r" % (name, shape, tf.train.load_variable(path, name)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
