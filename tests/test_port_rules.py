"""The port's rules, one small source at a time (no TensorFlow: the rewrite
is source work).

Each refusal leaves the source exactly as it was and reports its rule at
the line docs/port.md's table describes; each rewrite variant writes what
the README's porting recipe writes. tests/test_port.py runs whole scripts.
"""

import pytest

from npu_lossscale.port._report import BY_HAND, CHANGED, LEFT_ALONE
from npu_lossscale.port._rewrite import port_source

HEAD = "import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n\n"
D_OPT = "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8))\n"
G_OPT = "g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8))\n"
D_MIN = "d_train = d_opt.minimize(d_loss, var_list=d_vars)\n"
G_MIN = "g_train = g_opt.minimize(g_loss, var_list=g_vars)\n"
JOINT = "sess.run([d_train, g_train])\n"


def _port(source):
    new, entries = port_source(source, "t.py")
    compile(new, "t.py", "exec")
    return new, entries


def _rules(entries, kind):
    return sorted((e.rule, e.line) for e in entries if e.kind == kind)


REFUSALS = [
    ("var-list-missing", HEAD + D_OPT + G_OPT + D_MIN
     + "g_train = g_opt.minimize(g_loss)\n" + JOINT, [("var-list-missing", 7)]),
    ("global-step-twice", HEAD + D_OPT + G_OPT
     + "d_train = d_opt.minimize(d_loss, gs, d_vars)\n"
     + "g_train = g_opt.minimize(g_loss, global_step=gs, var_list=g_vars)\n" + JOINT,
     [("global-step-twice", 6), ("global-step-twice", 7)]),
    ("minimize-arguments", HEAD + D_OPT + G_OPT + D_MIN
     + "g_train = g_opt.minimize(g_loss, var_list=g_vars, gate_gradients=0)\n" + JOINT,
     [("minimize-arguments", 7)]),
    ("op-name-used", HEAD + D_OPT + G_OPT + D_MIN
     + "g_train = g_opt.minimize(g_loss, var_list=g_vars, name='g_step')\n" + JOINT
     + "op = graph.get_operation_by_name('g_step')\n", [("op-name-used", 7)]),
    ("train-op-rebound", HEAD + D_OPT + G_OPT + D_MIN + G_MIN + "d_train = tf.no_op()\n"
     + JOINT, [("train-op-rebound", 6)]),
    ("fetch-mixed", HEAD + D_OPT + G_OPT + D_MIN + G_MIN + JOINT + "sess.run(d_train)\n",
     [("fetch-mixed", 8), ("fetch-mixed", 9)]),
    ("fetch-unmapped: two of three", HEAD + D_OPT + G_OPT
     + "e_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8))\n"
     + D_MIN + G_MIN + "e_train = e_opt.minimize(e_loss, var_list=e_vars)\n" + JOINT
     + "sess.run(e_train)\n", [("fetch-unmapped", 10)]),
    ("fetch-unmapped: control dependency", HEAD + D_OPT + G_OPT + D_MIN
     + "with tf.control_dependencies([d_train]):\n    " + G_MIN + JOINT,
     [("fetch-unmapped", 7)]),
    ("mixed-scaling", HEAD + D_OPT + G_OPT + D_MIN + G_MIN
     + "e_train = tf.train.AdamOptimizer().minimize(e_loss, var_list=e_vars)\n"
     + "sess.run([d_train, g_train, e_train])\n", [("mixed-scaling", 8)]),
    ("control-dependencies-mixed", HEAD + D_OPT + G_OPT + D_MIN
     + "with tf.control_dependencies(updates):\n    " + G_MIN + "    x = 1\n" + JOINT,
     [("control-dependencies-mixed", 9)]),
    ("blocks-differ", HEAD + D_OPT + D_MIN + "if FLAGS.train_g:\n    " + G_OPT + "    "
     + G_MIN + JOINT, [("blocks-differ", 5), ("blocks-differ", 8)]),
    ("unmovable", HEAD + D_OPT + G_OPT
     + "d_train = d_opt.minimize(d_loss, tf.train.get_global_step(), d_vars)\n"
     + "summary = make_summary()\n" + G_MIN + JOINT, [("unmovable", 6)]),
    ("distributed", HEAD
     + "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8),\n"
     + "                              is_distributed=True)\n" + G_OPT + D_MIN + G_MIN + JOINT,
     [("distributed", 5)]),
    ("distributed: the wrapped optimizer", HEAD
     + "d_opt = NPULossScaleOptimizer(NPUDistributedOptimizer(tf.train.AdamOptimizer()),\n"
     + "                              FixedLossScaleManager(8))\n" + G_OPT + D_MIN + G_MIN
     + JOINT, [("distributed", 4)]),
    ("distributed: a SyncReplicasOptimizer", HEAD
     + "d_opt = NPULossScaleOptimizer(tf.train.SyncReplicasOptimizer(tf.train.AdamOptimizer(), 2),"
     + "\n                              FixedLossScaleManager(8))\n" + G_OPT + D_MIN + G_MIN
     + JOINT, [("distributed", 4)]),
    ("wrapper-arguments", HEAD + "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer())\n"
     + G_OPT + D_MIN + G_MIN + JOINT, [("wrapper-arguments", 4)]),
    ("manager-arguments", HEAD
     + "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8, x=1))\n"
     + G_OPT + D_MIN + G_MIN + JOINT, [("manager-arguments", 4)]),
    ("manager-unfollowed", HEAD
     + "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), make_manager())\n"
     + G_OPT + D_MIN + G_MIN + JOINT, [("manager-unfollowed", 4)]),
    ("loss-scale-argument", "import tensorflow.compat.v1 as tf\n\n"
     + "d_opt = tf.train.experimental.MixedPrecisionLossScaleOptimizer(tf.train.AdamOptimizer(),"
     + " scale)\ng_opt = tf.train.experimental.MixedPrecisionLossScaleOptimizer("
     + "tf.train.AdamOptimizer(), 'dynamic')\n" + D_MIN + G_MIN + JOINT,
     [("loss-scale-argument", 3)]),
    ("optimizer-used-elsewhere", HEAD + D_OPT + G_OPT + D_MIN + G_MIN + JOINT
     + "slot = d_opt.get_slot(w, 'm')\n", [("optimizer-used-elsewhere", 9)]),
    ("already-ported-mixed", HEAD + "import npu_lossscale as nl\n" + D_OPT + D_MIN
     + "sess.run(d_train)\n", [("already-ported-mixed", 5)]),
    ("wrapper-unfollowed: result dropped", "import tensorflow.compat.v1 as tf\n\n"
     + "tf.train.experimental.enable_mixed_precision_graph_rewrite(opt)\n",
     [("wrapper-unfollowed", 3)]),
]


@pytest.mark.parametrize("source,expected", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_refusals_leave_the_source_as_it_was(source, expected):
    new, entries = _port(source)
    assert new == source
    assert not [e for e in entries if e.kind == CHANGED]
    assert _rules(entries, BY_HAND) == sorted(expected)


def test_a_sync_replicas_refusal_names_the_builders_class():
    source = dict((r[0], r[1]) for r in REFUSALS)["distributed: a SyncReplicasOptimizer"]
    _, entries = _port(source)
    [entry] = [e for e in entries if e.rule == "distributed"]
    for fragment in ("tf.train.SyncReplicasOptimizer", "npu_lossscale.SyncReplicasOptimizer "
                     "(the same arguments)", "count_skipped_steps=True", "by hand"):
        assert fragment in entry.message, entry.message


def test_an_unused_op_name_is_dropped_and_said():
    new, entries = _port(HEAD + D_OPT + G_OPT + D_MIN
                         + "g_train = g_opt.minimize(g_loss, var_list=g_vars, name='g_step')\n"
                         + JOINT)
    assert "g_step" not in new
    assert ("op-name-dropped", 7) in _rules(entries, CHANGED)


def test_one_shared_manager_stays_one():
    """Wrappers that shared a manager share it in the builder: no
    loss_scale_manager= and no per-group note."""
    source = (HEAD + "manager = ExponentialUpdateLossScaleManager(2 ** 10, 1000)\n"
              "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), manager)\n"
              "g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), manager)\n"
              + D_MIN + G_MIN + JOINT)
    new, entries = _port(source)
    assert new == (
        "import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n"
        "import npu_lossscale as nl\n\n"
        "manager = nl.ExponentialUpdateLossScaleManager(2 ** 10, 1000)\n"
        "d_opt = tf.train.AdamOptimizer()\n"
        "g_opt = tf.train.AdamOptimizer()\n"
        "scaler = nl.MultiOptimizerLossScale(manager)\n"
        'scaler.add(d_loss, d_opt, var_list=d_vars, name="d_train")\n'
        'scaler.add(g_loss, g_opt, var_list=g_vars, name="g_train")\n'
        "train = scaler.build()\n"
        "d_train = train.update_op\n"
        "g_train = train.update_op\n"
        "sess.run([d_train, g_train])\n")
    assert "manager-per-group" not in [e.rule for e in entries]
    assert [e.rule for e in entries if e.rule == "manager-mapped"] == ["manager-mapped"]


def test_taken_names_are_not_reused():
    """`nl`, `scaler` and `train` already mean something in the script."""
    source = (HEAD + "nl = 3\nscaler = None\n\ndef train():\n    pass\n\n" + D_OPT + G_OPT
              + D_MIN + G_MIN + JOINT)
    new, _ = _port(source)
    assert "\nimport npu_lossscale\n" in new
    assert "scaler_1 = npu_lossscale.MultiOptimizerLossScale(" in new
    assert "train_1 = scaler_1.build()\nd_train = train_1.update_op\n" in new


def test_update_ops_of_two_blocks_join_in_one_list():
    source = (HEAD + D_OPT + G_OPT + "with tf.control_dependencies(d_updates):\n    " + D_MIN
              + "with tf.control_dependencies(g_updates):  # the generator's\n    " + G_MIN
              + JOINT)
    new, entries = _port(source)
    assert ("train = scaler.build(update_ops=list(d_updates) + list(g_updates))\n" in new)
    assert "# the generator's\n" in new and "control_dependencies" not in new
    assert _rules(entries, CHANGED).count(("update-ops-gated", 6)) == 1


def test_a_single_unscaled_minimize_is_left_alone():
    source = "import tensorflow.compat.v1 as tf\n\ntrain = tf.train.AdamOptimizer().minimize(l)\n"
    new, entries = _port(source)
    assert new == source
    assert _rules(entries, LEFT_ALONE) == [("unscaled-single", 3)]


def test_a_removed_line_hands_its_comments_on():
    source = ("import tensorflow.compat.v1 as tf\n\n"
              "d_opt = tf.train.AdamOptimizer()\n"
              "# loss scaling for D\n"
              "d_opt = tf.train.experimental.enable_mixed_precision_graph_rewrite(d_opt)  # TF 1.14\n"
              "g_opt = tf.train.experimental.enable_mixed_precision_graph_rewrite(\n"
              "    tf.train.AdamOptimizer(), loss_scale=tf.train.experimental.DynamicLossScale(\n"
              "        initial_loss_scale=2 ** 12, increment_period=100))\n"
              + D_MIN + G_MIN + "sess.run(d_train)\nsess.run(g_train)\n")
    new, entries = _port(source)
    assert ("d_opt = tf.train.AdamOptimizer()\n# loss scaling for D\n# TF 1.14\n"
            "g_opt = tf.train.AdamOptimizer()\n") in new
    assert ("loss_scale_manager=nl.DynamicLossScaleManager(initial_scale=2 ** 12, "
            "growth_steps=100))\n") in new
    assert "scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager())\n" in new
    assert "train = scaler.build(per_group_ops=True)\n" in new
    assert _rules(entries, BY_HAND) == [("graph-rewrite-session-config", 5)]


def test_an_inline_wrapper_moves_into_the_add():
    source = (HEAD + "d_train = NPULossScaleOptimizer(tf.train.AdamOptimizer(),\n"
              "                                FixedLossScaleManager(8)).minimize(d_loss, "
              "var_list=d_vars)\n"
              "g_train = NPULossScaleOptimizer(tf.train.AdamOptimizer(),\n"
              "                                FixedLossScaleManager(16)).minimize(g_loss, "
              "var_list=g_vars)\n" + JOINT)
    new, entries = _port(source)
    assert new.endswith(
        "scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8))\n"
        'scaler.add(d_loss, tf.train.AdamOptimizer(), var_list=d_vars, name="d_train")\n'
        'scaler.add(g_loss, tf.train.AdamOptimizer(), var_list=g_vars, name="g_train",\n'
        "           loss_scale_manager=nl.FixedLossScaleManager(16))\n"
        "train = scaler.build()\nd_train = train.update_op\ng_train = train.update_op\n"
        + JOINT)
    assert _rules(entries, CHANGED).count(("manager-mapped", 5)) == 1


def test_one_wrapper_beside_a_plain_minimize_is_the_drop_in():
    source = (HEAD + D_OPT + D_MIN
              + "g_train = tf.train.AdamOptimizer().minimize(g_loss, var_list=g_vars)\n" + JOINT)
    new, entries = _port(source)
    assert ("d_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), "
            "nl.FixedLossScaleManager(8))\n") in new
    assert _rules(entries, LEFT_ALONE) == [("npu-init-import", 2), ("unscaled-beside", 6)]


def test_the_modelzoo_dcgan_is_left_by_hand():
    """tests/data/modelzoo_dcgan.py, the ModelZoo-style script the shim tests
    run: its optimizers come out of make_optimizer(), called once per
    network, which the tool does not follow."""
    import os  # pylint: disable=import-outside-toplevel

    from conftest import REPO  # pylint: disable=import-outside-toplevel
    with open(os.path.join(REPO, "tests", "data", "modelzoo_dcgan.py")) as handle:
        source = handle.read()
    new, entries = _port(source)
    assert new == source
    assert _rules(entries, BY_HAND) == [("optimizer-through-function", 72),
                                        ("optimizer-unfollowed", 95),
                                        ("optimizer-unfollowed", 96)]
