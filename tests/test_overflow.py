"""Phase 2 of the step, the overflow check (npu_lossscale/core/overflow.py): a
manager that disables the check gets no flag, and every step applies."""

import numpy as np
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from models import build_gan_step as _build


def test_disabled_overflow_check_applies_every_step(gan):
    train, gs = _build(gan, nl.FixedLossScaleManager(1, enable_overflow_check=False))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        feed = dict(gan.feed)
        feed[gan.poison_g] = np.inf
        assert sess.run([train.is_finite, train.update_op], feed)[0]
        assert sess.run(gs) == 1
        assert np.isnan(sess.run(gan.g_vars[0])).any()  # unguarded, as asked
