"""The port's rules, one small source at a time (no TensorFlow: the rewrite
is source work).

Each refusal leaves the source exactly as it was and reports its rule at
the line docs/port.md's table describes; each rewrite variant writes what
the README's porting recipe writes. tests/test_port.py runs whole scripts.
"""

import pytest

from npu_lossscale.tools.port._report import BY_HAND, CHANGED, LEFT_ALONE
from npu_lossscale.tools.port._rewrite import port_source

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
     + "deps = [d_train]\nwith tf.control_dependencies(deps):\n    " + G_MIN + JOINT,
     [("fetch-unmapped", 7)]),
    ("compute-apply-gradients: a read of the pairs between", HEAD + D_OPT + G_OPT
     + "d_gv = d_opt.compute_gradients(d_loss, var_list=d_vars)\n"
     + "tf.summary.histogram('d_grad', d_gv[0][0])\n"
     + "d_train = d_opt.apply_gradients(d_gv)\n" + G_MIN + JOINT,
     [("compute-apply-gradients", 6)]),
    ("compute-apply-gradients: the pairs read again", HEAD + D_OPT + G_OPT
     + "d_gv = d_opt.compute_gradients(d_loss, var_list=d_vars)\n"
     + "d_train = d_opt.apply_gradients(d_gv)\n" + G_MIN + JOINT + "print(d_gv)\n",
     [("compute-apply-gradients", 6)]),
    ("train-op-dependency: a train op beside other dependencies", HEAD + D_OPT + G_OPT + D_MIN
     + "with tf.control_dependencies([d_train] + updates):\n    " + G_MIN + JOINT,
     [("train-op-dependency", 7)]),
    ("train-op-dependency: the loss built inside the block", HEAD + D_OPT + D_MIN
     + "with tf.control_dependencies([d_train]):\n    g_loss = make_loss()\n    " + G_OPT
     + "    " + G_MIN + "sess.run(g_train)\n", [("train-op-dependency", 7)]),
    ("train-op-dependency: a group run alone", HEAD + D_OPT + G_OPT + D_MIN
     + "with tf.control_dependencies([d_train]):\n    " + G_MIN + "sess.run(d_train)\n",
     [("train-op-dependency", 7)]),
    ("mixed-scaling", HEAD + D_OPT + G_OPT + D_MIN + G_MIN
     + "e_train = tf.train.AdamOptimizer().minimize(e_loss, var_list=e_vars)\n"
     + "sess.run([d_train, g_train, e_train])\n", [("mixed-scaling", 8)]),
    ("control-dependencies-mixed", HEAD + D_OPT + G_OPT + D_MIN
     + "with tf.control_dependencies(updates):\n    " + G_MIN + "    x = 1\n" + JOINT,
     [("control-dependencies-mixed", 9)]),
    ("constructor-unmovable: an argument that makes an op", HEAD
     + "with tf.control_dependencies(updates):\n    "
     + D_OPT.replace("AdamOptimizer()", "AdamOptimizer(tf.train.exponential_decay(lr, gs, 100, "
                     "0.9))") + "    " + G_OPT + "    " + D_MIN + "    " + G_MIN + JOINT,
     [("constructor-unmovable", 5)]),
    ("constructor-unmovable: a name read before it moves", HEAD
     + "with tf.control_dependencies(updates):\n    m = FixedLossScaleManager(8)\n"
     + "    d_train = NPULossScaleOptimizer(tf.train.AdamOptimizer(), m).minimize(d_loss, "
     "var_list=d_vars)\n    m = FixedLossScaleManager(16)\n"
     + "    g_train = NPULossScaleOptimizer(tf.train.AdamOptimizer(), m).minimize(g_loss, "
     "var_list=g_vars)\n" + JOINT, [("constructor-unmovable", 7)]),
    ("train-op-rebound: a read between the optimizer and the train op", HEAD
     + "d_optim = tf.train.AdamOptimizer()\nprint(d_optim)\n"
     + "d_optim = NPULossScaleOptimizer(d_optim, FixedLossScaleManager(8)).minimize(d_loss, "
     "var_list=d_vars)\n" + G_OPT + G_MIN + "sess.run([d_optim, g_train])\n",
     [("train-op-rebound", 5)]),
    ("blocks-differ", HEAD + D_OPT + D_MIN + "if FLAGS.train_g:\n    " + G_OPT + "    "
     + G_MIN + JOINT, [("blocks-differ", 5), ("blocks-differ", 8)]),
    ("unmovable", HEAD + D_OPT + G_OPT
     + "d_train = d_opt.minimize(d_loss, tf.train.get_global_step(), d_vars)\n"
     + "summary = make_summary()\n" + G_MIN + JOINT, [("unmovable", 6)]),
    ("distributed", HEAD
     + "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8),\n"
     + "                              is_distributed=FLAGS.distributed)\n" + G_OPT + D_MIN
     + G_MIN + JOINT, [("distributed", 5)]),
    ("distributed: the wrappers reduce in different ways", HEAD
     + "d_opt = npu_tf_optimizer(NPULossScaleOptimizer(tf.train.AdamOptimizer(), "
     "FixedLossScaleManager(8)))\n" + G_OPT + D_MIN + G_MIN + JOINT,
     [("distributed", 4), ("distributed", 5)]),
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
    ("var-list-missing: None spelled out", HEAD + D_OPT + G_OPT + D_MIN
     + "g_train = g_opt.minimize(g_loss, var_list=None)\n" + JOINT, [("var-list-missing", 7)]),
    ("train-op-unfetched: no session.run", HEAD + D_OPT + G_OPT + D_MIN + G_MIN,
     [("train-op-unfetched", 6), ("train-op-unfetched", 7)]),
    ("optimizer-unfollowed: a one-line if", HEAD
     + "d_opt = tf.train.AdamOptimizer()\n"
     + "if fp16: d_opt = NPULossScaleOptimizer(d_opt, FixedLossScaleManager(8))\n"
     + "g_opt = tf.train.AdamOptimizer()\n"
     + "if fp16: g_opt = NPULossScaleOptimizer(g_opt, FixedLossScaleManager(8))\n"
     + D_MIN + G_MIN + JOINT,
     [("wrapper-unfollowed", 5), ("wrapper-unfollowed", 7), ("optimizer-unfollowed", 8),
      ("optimizer-unfollowed", 9)]),
    ("built-in-loop: a function called from a loop", HEAD
     + "def train(loss, var_list):\n"
     + "    opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8))\n"
     + "    return opt.minimize(loss, var_list=var_list)\n"
     + "ops = []\nfor loss, var_list in pairs:\n    ops.append(train(loss, var_list))\n"
     + "sess.run(ops)\n", [("built-in-loop", 5), ("train-op-unfollowed", 6)]),
    ("optimizer-through-function: the drop-in's wrapper minimized in a helper", HEAD
     + "opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8))\n"
     + "def make(o, loss, v):\n    return o.minimize(loss, var_list=v)\n"
     + "d_train = make(opt, d_loss, d_vars)\ng_train = make(opt, g_loss, g_vars)\n" + JOINT,
     [("optimizer-through-function", 7), ("optimizer-through-function", 8)]),
    ("unmovable: a list changed between the blocks", HEAD + "ops = []\n" + D_OPT + G_OPT
     + "with tf.control_dependencies(ops):\n    " + D_MIN + "ops.extend(more)\n"
     + "with tf.control_dependencies(ops):\n    " + G_MIN + "sess.run(d_train)\n"
     + "sess.run(g_train)\n", [("unmovable", 7)]),
    ("optimizer-reused: one optimizer in two wrappers", HEAD + "adam = tf.train.AdamOptimizer()\n"
     + "d_opt = NPULossScaleOptimizer(adam, FixedLossScaleManager(8))\n"
     + "g_opt = NPULossScaleOptimizer(adam, FixedLossScaleManager(8))\n" + D_MIN + G_MIN + JOINT,
     [("optimizer-reused", 5), ("optimizer-reused", 6)]),
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
    # Fetched together, each wrapper updated it once a run; the builder once a step.
    message = [e.message for e in entries if e.rule == "manager-once-per-step"]
    assert message and "(2 updates a run)" in message[0]
    alternating = source.replace(JOINT, "sess.run(d_train)\nsess.run(g_train)\n")
    assert "manager-once-per-step" not in [e.rule for e in _port(alternating)[1]]


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


def test_a_call_between_the_minimize_calls_is_a_point_to_decide():
    """A Saver made between the minimize calls saw D's Adam slots; after the
    port build() makes them after it: ported, and listed BY HAND. A list of
    trainable variables there reads nothing a minimize makes: no entry."""
    saver = HEAD + D_OPT + G_OPT + D_MIN + "saver = tf.train.Saver()\n" + G_MIN + JOINT
    new, entries = _port(saver)
    assert new != saver and "scaler.build()" in new
    assert _rules(entries, BY_HAND) == [("between-minimizes", 7)]
    message = [e.message for e in entries if e.rule == "between-minimizes"][0]
    assert "(lines 6 and 8)" in message and "move it after line 8" in message
    listed = (HEAD + D_OPT + G_OPT + D_MIN + "g_vars = tf.trainable_variables('g')\n" + G_MIN
              + JOINT)
    assert _rules(_port(listed)[1], BY_HAND) == []


def test_global_step_none_on_each_minimize_is_no_global_step():
    source = (HEAD + D_OPT + G_OPT
              + "d_train = d_opt.minimize(d_loss, global_step=None, var_list=d_vars)\n"
              + "g_train = g_opt.minimize(g_loss, None, g_vars)\n" + JOINT)
    new, entries = _port(source)
    assert _rules(entries, BY_HAND) == []
    assert "train = scaler.build()\n" in new


def test_a_train_op_named_with_a_leading_underscore_names_its_group_without_it():
    """A group's name is a TF name scope, which cannot start with "_"."""
    source = (HEAD + D_OPT + G_OPT + "_d_train = d_opt.minimize(d_loss, var_list=d_vars)\n"
              + "_g_train = g_opt.minimize(g_loss, var_list=g_vars)\n"
              + "sess.run(_d_train)\nsess.run(_g_train)\n")
    new, _ = _port(source)
    assert 'name="d_train")' in new and '_d_train = train.per_group["d_train"]' in new


def test_tfs_fixed_scale_says_the_builder_skips_what_tf_applied():
    """TF's FixedLossScale applies non-finite gradients; the builder's fixed
    manager skips those steps: the report says so, and how to keep TF's way."""
    wrap = "tf.train.experimental.MixedPrecisionLossScaleOptimizer(tf.train.AdamOptimizer(), 128)"
    source = ("import tensorflow.compat.v1 as tf\n\nd_opt = %s\ng_opt = %s\n" % (wrap, wrap)
              + D_MIN + G_MIN + JOINT)
    new, entries = _port(source)
    assert "nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(128))" in new
    messages = [e.message for e in entries if e.rule == "loss-scale-mapped"]
    assert len(messages) == 2
    assert all("applies every step, non-finite gradients included" in m
               and "enable_overflow_check=False" in m for m in messages)


def test_an_unparsable_file_is_named_at_the_line_pythons_parser_names():
    source = "import tensorflow as tf\ndef f(:\n    pass\n"
    new, entries = port_source(source, "t.py")
    assert new == source
    assert [(e.rule, e.line) for e in entries] == [("unparsable", 2)]
    assert "invalid syntax at line 2" in entries[0].message


def test_no_comment_of_a_rewritten_call_is_dropped():
    """Comments after a wrapper's or a minimize's arguments go above the
    statement that replaces them; a byte-order mark stays at the start."""
    source = ("\ufeff" + HEAD
              + "d_opt = NPULossScaleOptimizer(  # discriminator\n"
              + "    tf.train.AdamOptimizer(),  # inner optimizer\n"
              + "    FixedLossScaleManager(8))  # fixed scale\n" + G_OPT
              + "d_train = d_opt.minimize(\n    d_loss,  # the D loss\n    var_list=d_vars)\n"
              + G_MIN + JOINT)
    new, _ = port_source(source, "t.py")
    assert new.startswith("\ufeffimport tensorflow.compat.v1 as tf\n")
    compile(new[1:], "t.py", "exec")  # as Python reads the file: the mark is no character
    for comment in ("# discriminator", "# inner optimizer", "# fixed scale", "# the D loss"):
        assert new.count(comment) == 1, comment
    assert ("# discriminator\n# inner optimizer\n"
            "d_opt = tf.train.AdamOptimizer()  # fixed scale\n") in new


@pytest.mark.parametrize("indent", ["", "    "])
def test_a_wrapped_drop_in_lines_up_under_its_parenthesis(indent):
    source = ("import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n\n"
              + ("def main():\n" if indent else "")
              + indent + "opt = NPULossScaleOptimizer("
              + "NPUDistributedOptimizer(tf.train.AdamOptimizer(1e-3)),\n"
              + indent + " " * 28 + "FixedLossScaleManager(1024), is_distributed=True)\n"
              + indent + "train = opt.minimize(loss)\n" + indent + "sess.run(train)\n")
    new, entries = _port(source)
    assert [e.rule for e in entries if e.rule == "drop-in"] == ["drop-in"]
    lines = new.splitlines()
    first = [i for i, line in enumerate(lines) if "nl.LossScaleOptimizer(" in line][0]
    column = lines[first].index("nl.LossScaleOptimizer(") + len("nl.LossScaleOptimizer(")
    assert lines[first + 1].index("nl.FixedLossScaleManager") == column


def test_a_call_too_long_under_its_parenthesis_takes_a_hanging_indent():
    """An argument that passes 99 columns under the open parenthesis goes on
    the next line, four columns in."""
    manager = "ExponentialUpdateLossScaleManager(init_loss_scale=2 ** 15, incr_every_n_steps=100)"
    source = (HEAD + "def main():\n    m = %s\n" % manager
              + "    d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), m)\n"
              + "    g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), m)\n"
              + "    " + D_MIN + "    " + G_MIN + "    sess.run(d_train)\n    sess.run(g_train)\n")
    source = source.replace("    m = %s\n" % manager, "")
    source = source.replace(", m)", ", %s)" % manager)
    new, _ = _port(source)
    assert ("    scaler = nl.MultiOptimizerLossScale(\n        nl.%s)\n" % manager) in new
    assert all(len(line) <= 99 for line in new.splitlines() if "scaler = " in line)


MANAGER = "ExponentialUpdateLossScaleManager(2 ** 15, 1000)"


@pytest.mark.parametrize("wrapped", ["inline", "named"])
def test_a_manager_name_bound_again_keeps_one_manager_per_wrapper(wrapped):
    """Pix2Pix's authors bind `loss_scale_manager` again before G's wrapper:
    two managers under one name. Each group keeps the one its wrapper read
    (the scaler D's, G's add() the second), and both are mapped."""
    if wrapped == "inline":
        wrappers = ("d_train = NPULossScaleOptimizer(tf.train.AdamOptimizer(), "
                    "loss_scale_manager).minimize(d_loss, var_list=d_vars)\n",
                    "g_train = NPULossScaleOptimizer(tf.train.AdamOptimizer(), "
                    "loss_scale_manager).minimize(g_loss, var_list=g_vars)\n")
    else:
        wrappers = ("d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), "
                    "loss_scale_manager)\n" + D_MIN,
                    "g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), "
                    "loss_scale_manager)\n" + G_MIN)
    source = (HEAD + "loss_scale_manager = %s\n" % MANAGER + wrappers[0]
              + "loss_scale_manager = %s\n" % MANAGER + wrappers[1]
              + "sess.run(d_train)\nsess.run(g_train)\n")
    new, entries = _port(source)
    d_add = 'scaler.add(d_loss, %s, var_list=d_vars, name="d_train")\n' % (
        "tf.train.AdamOptimizer()" if wrapped == "inline" else "d_opt")
    g_add = ('scaler.add(g_loss, %s, var_list=g_vars, name="g_train",\n'
             '           loss_scale_manager=loss_scale_manager)\n' % (
                 "tf.train.AdamOptimizer()" if wrapped == "inline" else "g_opt"))
    if wrapped == "named":
        g_add = g_add.replace(",\n           loss", ", loss")
    assert ("loss_scale_manager = nl.%s\n" % MANAGER + ("" if wrapped == "inline" else
                                                         "d_opt = tf.train.AdamOptimizer()\n")
            + "scaler = nl.MultiOptimizerLossScale(loss_scale_manager)\n" + d_add
            + "loss_scale_manager = nl.%s\n" % MANAGER + ("" if wrapped == "inline" else
                                                         "g_opt = tf.train.AdamOptimizer()\n")
            + g_add) in new
    rules = [e.rule for e in entries]
    assert "manager-per-group" in rules and "manager-once-per-step" not in rules
    assert _rules(entries, CHANGED).count(("manager-mapped", 4)) == 1
    assert ("manager-mapped", 6 if wrapped == "inline" else 7) in _rules(entries, CHANGED)
    assert "manager-unused" not in rules and "manager-kept" not in rules


def test_a_manager_name_bound_again_before_the_minimize_names_the_edit():
    """D's wrapper reads the first manager, but the name holds the second
    where the builder would read it: refused, with the edit to make."""
    source = (HEAD + "loss_scale_manager = %s\n" % MANAGER
              + "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), loss_scale_manager)\n"
              + "loss_scale_manager = %s\n" % MANAGER
              + "g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), loss_scale_manager)\n"
              + D_MIN + G_MIN + JOINT)
    new, entries = _port(source)
    assert new == source
    [entry] = [e for e in entries if e.kind == BY_HAND]
    assert (entry.rule, entry.line) == ("unmovable", 5)
    assert "line 6 binds again" in entry.message and "d_manager = ..." in entry.message


@pytest.mark.parametrize("binding", [
    "d_manager = g_manager = %s\n" % MANAGER,
    "d_manager = %s\ng_manager = d_manager\n" % MANAGER])
def test_one_manager_under_two_names_is_one_shared_manager(binding):
    """Issue 44, 13: two names for one manager object are one scale, updated
    once a step by the builder (it was taken for two, kept as unknown)."""
    source = (HEAD + binding
              + "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), d_manager)\n"
              + "g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), g_manager)\n"
              + D_MIN + G_MIN + JOINT)
    new, entries = _port(source)
    assert "nl.%s\n" % MANAGER in new and "loss_scale_manager=" not in new
    assert 'scaler.add(g_loss, g_opt, var_list=g_vars, name="g_train")\n' in new
    rules = [e.rule for e in entries]
    assert "manager-per-group" not in rules and "manager-kept" not in rules
    assert "manager-once-per-step" in rules


def test_a_manager_bound_in_a_branch_is_named_at_each_add():
    """Which assignment a read gets is not provable through an if: each
    group names its manager (right whether they are one object or two)."""
    source = (HEAD + "m = %s\nif shared:\n    m = FixedLossScaleManager(8)\n" % MANAGER
              + "d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), m)\n"
              + "g_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), m)\n"
              + D_MIN + G_MIN + JOINT)
    new, entries = _port(source)
    assert ('scaler = nl.MultiOptimizerLossScale(m)\n' in new
            and 'name="g_train", loss_scale_manager=m)\n' in new)
    assert "manager-once-per-step" not in [e.rule for e in entries]


def test_update_ops_left_around_the_builder_are_a_by_hand_item():
    """A tf.control_dependencies block that holds the minimize calls through
    an if stays around build(): its updates run on skipped steps too. The
    report says the skip is not atomic, and the builder entry says so."""
    source = (HEAD + "with tf.control_dependencies(update_ops):\n    if FLAGS.train:\n"
              + "".join("        " + line for line in (D_OPT, G_OPT, D_MIN, G_MIN)) + JOINT)
    new, entries = _port(source)
    assert "with tf.control_dependencies(update_ops):\n    if FLAGS.train:\n" in new
    assert "        train = scaler.build()\n" in new
    assert _rules(entries, BY_HAND) == [("update-ops-not-atomic", 4)]
    message = [e.message for e in entries if e.rule == "update-ops-not-atomic"][0]
    assert "skip is not atomic" in message and "batch-norm statistics" in message
    builder = [e.message for e in entries if e.rule == "builder"][0]
    assert "run on skipped steps too" in builder and "line 4" in builder


def test_optimizers_made_in_the_update_ops_block_move_above_it():
    """TF's batch-norm idiom and ModelZoo's DCGAN: the optimizers, the
    manager and the wrappers made inside the UPDATE_OPS block, each name
    rebound from its optimizer to its train op. Making them makes no op the
    block orders: they move above it, the block's ops become build()'s
    update_ops, and each name is its group's op."""
    manager = ("    loss_scale_manager = ExponentialUpdateLossScaleManager("
               "init_loss_scale=2**32,\n" + " " * 59 + "incr_every_n_steps=1000)  # shared\n")
    source = (HEAD + "update_ops = tf.get_collection(tf.GraphKeys.UPDATE_OPS)\n"
              "with tf.control_dependencies(update_ops):  # batch norm\n"
              "    d_optim = tf.train.AdamOptimizer(lr, beta1=0.5)\n" + manager
              + "    d_optim = NPULossScaleOptimizer(d_optim, loss_scale_manager).minimize(\n"
              "        d_loss, var_list=d_vars)\n"
              "    # the generator\n    g_optim = tf.train.AdamOptimizer(lr, beta1=0.5)\n"
              "    g_optim = NPULossScaleOptimizer(g_optim, loss_scale_manager).minimize(\n"
              "        g_loss, var_list=g_vars)\n"
              "for step in range(steps):\n    sess.run([d_optim, d_sum])\n"
              "    sess.run([g_optim, g_sum])\n")
    new, entries = _port(source)
    assert new == (
        "import tensorflow.compat.v1 as tf\nfrom npu_bridge.npu_init import *\n"
        "import npu_lossscale as nl\n\n"
        "update_ops = tf.get_collection(tf.GraphKeys.UPDATE_OPS)\n"
        "# batch norm\n"
        "d_optim = tf.train.AdamOptimizer(lr, beta1=0.5)\n"
        "loss_scale_manager = nl.ExponentialUpdateLossScaleManager(init_loss_scale=2**32,\n"
        "                                                          incr_every_n_steps=1000)"
        "  # shared\n"
        "# the generator\ng_optim = tf.train.AdamOptimizer(lr, beta1=0.5)\n"
        "scaler = nl.MultiOptimizerLossScale(loss_scale_manager)\n"
        'scaler.add(d_loss, d_optim, var_list=d_vars, name="d_optim")\n'
        'scaler.add(g_loss, g_optim, var_list=g_vars, name="g_optim")\n'
        'train = scaler.build(per_group_ops=True, update_ops={"d_optim": update_ops, '
        '"g_optim": update_ops})\n'
        'd_optim = train.per_group["d_optim"]\ng_optim = train.per_group["g_optim"]\n'
        "for step in range(steps):\n    sess.run([d_optim, d_sum])\n"
        "    sess.run([g_optim, g_sum])\n")
    # Both runs ran the block's ops: each group's step runs them when it applies.
    assert _rules(entries, BY_HAND) == []
    message = [e.message for e in entries if e.rule == "update-ops-each-group"][0]
    assert "each of their per-group steps now runs it when it applies" in message
    assert [line for rule, line in _rules(entries, CHANGED) if rule == "constructor-moved"] == [
        6, 7, 12]
    moved = [e.message for e in entries if e.rule == "constructor-moved"]
    assert "initializers no longer wait for the block's updates" in moved[1]
    assert "makes no op that the block orders" in moved[0]
    gated = [e.message for e in entries if e.rule == "update-ops-gated"]
    assert gated and "ran on skipped steps too" in gated[0]


def test_a_group_of_every_train_op_is_the_joint_step():
    """`training_op = tf.group(D_solver, G_solver)` fetched in one run: the
    group of every train op is update_op (it was fetch-unmapped)."""
    source = (HEAD + D_OPT + G_OPT + D_MIN + G_MIN
              + "training_op = tf.group(d_train, g_train)\nsess.run(training_op)\n")
    new, entries = _port(source)
    assert ("train = scaler.build()\nd_train = train.update_op\ng_train = train.update_op\n"
            "training_op = tf.group(d_train, g_train)\n") in new
    assert _rules(entries, BY_HAND) == []
    mixed = source + "sess.run(d_train)\n"
    assert new != mixed and ("fetch-mixed", 10) in _rules(_port(mixed)[1], BY_HAND)


def _scoped(name, manager_line, extra=""):
    return ("loss_scale_manager = %s\n" % manager_line
            + "with tf.name_scope(\"%s_train\"):\n" % name
            + "    %s_tvars = [v for v in tf.trainable_variables() if v.name.startswith(\"%s\")]\n"
            % (name, name)
            + "    %s_optim = tf.train.AdamOptimizer(lr, beta1)\n" % name
            + "    %s_optim = NPULossScaleOptimizer(%s_optim, loss_scale_manager)\n" % (name, name)
            + "    %s_train = %s_optim.minimize(%s_loss, var_list=%s_tvars)\n" % ((name,) * 4)
            + extra)


def test_wrappers_in_name_scopes_are_followed():
    """Pix2Pix: each network's optimizer, wrapper and minimize in its own
    tf.name_scope, a manager bound to one name before each. The scopes stay
    (test_port.py: a checkpoint of the original restores); build() goes after the last one."""
    source = (HEAD + _scoped("discrim", MANAGER) + _scoped("gen", MANAGER)
              + "sess.run([discrim_train, gen_train])\n")
    new, entries = _port(source)
    assert ('with tf.name_scope("discrim_train"):\n'
            '    discrim_tvars = [v for v in tf.trainable_variables() if v.name.startswith('
            '"discrim")]\n'
            "    discrim_optim = tf.train.AdamOptimizer(lr, beta1)\n"
            "    scaler = nl.MultiOptimizerLossScale(loss_scale_manager)\n"
            '    scaler.add(discrim_loss, discrim_optim, var_list=discrim_tvars, '
            'name="discrim_train")\n'
            "loss_scale_manager = nl.%s\n" % MANAGER) in new
    assert ('    scaler.add(gen_loss, gen_optim, var_list=gen_tvars, name="gen_train",\n'
            "               loss_scale_manager=loss_scale_manager)\n"
            "train = scaler.build()\ndiscrim_train = train.update_op\n"
            "gen_train = train.update_op\nsess.run([discrim_train, gen_train])\n") in new
    assert _rules(entries, BY_HAND) == []
    assert "manager-per-group" in [e.rule for e in entries]


def test_a_train_op_read_inside_its_name_scope_is_refused():
    """A read there would run before build(), which goes after the block."""
    source = (HEAD + _scoped("discrim", MANAGER)
              + _scoped("gen", MANAGER, "    tf.summary.scalar('x', tf.size(gen_train))\n")
              + "sess.run([discrim_train, gen_train])\n")
    new, entries = _port(source)
    assert new == source
    assert ("fetch-unmapped", 16) in _rules(entries, BY_HAND)


PRECISION = ("if FLAGS.precision_mode == 'allow_mix_precision':\n"
             "    d_train = NPULossScaleOptimizer(d_opt, FixedLossScaleManager(8)).minimize(\n"
             "        d_loss, var_list=d_vars)\n"
             "    g_train = NPULossScaleOptimizer(g_opt, FixedLossScaleManager(8)).minimize(\n"
             "        g_loss, var_list=g_vars)\n"
             "else:\n"
             "    d_train = d_opt.minimize(d_loss, var_list=d_vars)\n"
             "    g_train = g_opt.minimize(g_loss, var_list=g_vars)\n")


def test_a_precision_if_else_is_ported_in_its_loss_scaled_branch():
    """fp16 wrappers in one branch, plain minimize calls in the other (it was
    mixed-scaling): the loss-scaled branch gets the builder, the other
    stays, the condition too."""
    source = (HEAD + "d_opt = tf.train.AdamOptimizer()\ng_opt = tf.train.AdamOptimizer()\n"
              + PRECISION + "sess.run(d_train)\nsess.run(g_train)\n")
    new, entries = _port(source)
    assert new.endswith(
        "if FLAGS.precision_mode == 'allow_mix_precision':\n"
        "    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8))\n"
        '    scaler.add(d_loss, d_opt, var_list=d_vars, name="d_train")\n'
        '    scaler.add(g_loss, g_opt, var_list=g_vars, name="g_train",\n'
        "               loss_scale_manager=nl.FixedLossScaleManager(8))\n"
        "    train = scaler.build(per_group_ops=True)\n"
        '    d_train = train.per_group["d_train"]\n    g_train = train.per_group["g_train"]\n'
        "else:\n" + PRECISION.split("else:\n")[1] + "sess.run(d_train)\nsess.run(g_train)\n")
    assert ("branch-unscaled", 12) in _rules(entries, LEFT_ALONE)
    assert _rules(entries, BY_HAND) == []
    assert new.count("import npu_lossscale as nl\n") == 1


def test_a_precision_branch_the_tool_cannot_prove_leaves_the_file_as_it_was():
    """One branch refused: the whole file stays (a partial port would mix a
    builder's step and a wrapper's)."""
    source = (HEAD + "d_opt = tf.train.AdamOptimizer()\ng_opt = tf.train.AdamOptimizer()\n"
              + PRECISION.replace("var_list=g_vars)\nelse", "var_list=g_vars, gate_gradients=0)"
                                  "\nelse") + "sess.run(d_train)\nsess.run(g_train)\n")
    new, entries = _port(source)
    assert new == source
    assert _rules(entries, BY_HAND) == [("minimize-arguments", 9)]


@pytest.mark.parametrize("form", ["named", "inline", "around"])
def test_a_sync_replicas_drop_in_takes_ours_and_counts_skipped_steps(form):
    """TF's SyncReplicasOptimizer inside the one wrapper becomes
    nl.SyncReplicasOptimizer (TF's own is refused there with a TypeError);
    around it, it stays. Either way count_skipped_steps=True, without which a
    skip stalls every worker (NLS012)."""
    sync = "tf.train.SyncReplicasOptimizer(tf.train.AdamOptimizer(), replicas_to_aggregate=2)"
    manager = "FixedLossScaleManager(8)"
    if form == "named":
        lines = "sync = %s\nopt = NPULossScaleOptimizer(sync, %s)\n" % (sync, manager)
    elif form == "inline":
        lines = "opt = NPULossScaleOptimizer(%s, %s)\n" % (sync, manager)
    else:
        lines = ("opt = tf.train.SyncReplicasOptimizer(NPULossScaleOptimizer("
                 "tf.train.AdamOptimizer(), %s), 2)\n" % manager)
    source = HEAD + "gs = tf.train.get_or_create_global_step()\n" + lines + (
        "train = opt.minimize(loss, gs)\nsess.run(train)\n")
    new, entries = _port(source)
    assert "count_skipped_steps=True" in new
    assert ("nl.SyncReplicasOptimizer(" in new) == (form != "around")
    assert ("tf.train.SyncReplicasOptimizer(" in new) == (form == "around")
    assert "sync-replicas-mapped" in [e.rule for e in entries if e.kind == CHANGED]


def test_a_manager_bound_again_inside_a_name_scope_before_its_minimize_is_refused():
    scope = _scoped("gen", MANAGER).replace(
        "    gen_train =", "    loss_scale_manager = FixedLossScaleManager(8)\n    gen_train =")
    source = HEAD + _scoped("discrim", MANAGER) + scope + "sess.run([discrim_train, gen_train])\n"
    new, entries = _port(source)
    assert new == source
    assert [rule for rule, _ in _rules(entries, BY_HAND)] == ["unmovable"]



@pytest.mark.parametrize("layer,engine", [
    ("npu_tf_optimizer(%s)", 'distributed="hccl")'),
    ("%s", 'distributed="hccl",\n                                    allreduce_gradients=False)'),
    ("npu_distributed_optimizer_wrapper(%s)", 'distributed="hccl",\n'
     '                                    allreduce_gradients=False)')])
def test_npu_bridges_distributed_layers_map_to_the_builders_engine(layer, engine):
    """npu_tf_optimizer around the wrapper averaged the gradients (it is
    NPUDistributedOptimizer): distributed="hccl". is_distributed=True alone
    summed the overflow decision only: allreduce_gradients=False too.
    npu_distributed_optimizer_wrapper, inert on one device, stays around the
    optimizer."""
    wrapper = ("NPULossScaleOptimizer(tf.train.AdamOptimizer(), FixedLossScaleManager(8), "
               "is_distributed=True)")
    lines = "".join("%s_opt = %s\n" % (n, layer % wrapper) for n in ("d", "g"))
    new, entries = _port(HEAD + lines + D_MIN + G_MIN + JOINT)
    assert "scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), " + engine in new
    kept = "npu_distributed_optimizer_wrapper" in layer
    assert ("d_opt = npu_distributed_optimizer_wrapper(tf.train.AdamOptimizer())\n" in new) == kept
    assert "npu_tf_optimizer" not in new and "NPULossScaleOptimizer" not in new
    assert "distributed-mapped" in [e.rule for e in entries if e.kind == CHANGED]
    assert _rules(entries, BY_HAND) == []


@pytest.mark.parametrize("source", [r[1] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_every_refusal_says_the_edit_that_lifts_it(source):
    """Issue 46, point 4: the loop "edit, run again" converges only if each
    by-hand item says what to change (or that the port is the user's)."""
    _, entries = _port(source)
    for entry in entries:
        if entry.kind == BY_HAND:
            assert "run the tool again" in entry.message or "by hand" in entry.message, entry


def _spelled(name, test="int(os.getenv('RANK_SIZE', '1')) > 1", other=None):
    return ("%s_opt = tf.train.AdamOptimizer()\n" % name
            + "if %s:\n" % test
            + "    %s_opt = npu_tf_optimizer(NPULossScaleOptimizer(%s_opt, "
            "FixedLossScaleManager(8), is_distributed=True))\n" % (name, name)
            + "else:\n"
            + "    %s_opt = NPULossScaleOptimizer(%s, FixedLossScaleManager(8))\n"
            % (name, other or name + "_opt"))


def test_a_rank_size_if_between_wrapper_spellings_becomes_the_builders_engine():
    """Pix2Pix's RANK_SIZE test: npu_tf_optimizer around the wrapper on
    several devices, the wrapper alone on one. The if goes; its test picks
    the builder's engine (it was wrapper-unfollowed)."""
    source = (HEAD.replace("import tensorflow", "import os\nimport tensorflow") + _spelled("d")
              + D_MIN + _spelled("g") + G_MIN + JOINT)
    new, entries = _port(source)
    assert ("d_opt = tf.train.AdamOptimizer()\n"
            "scaler = nl.MultiOptimizerLossScale(\n"
            "    nl.FixedLossScaleManager(8),\n"
            "    distributed=\"hccl\" if int(os.getenv('RANK_SIZE', '1')) > 1 else None)\n"
            'scaler.add(d_loss, d_opt, var_list=d_vars, name="d_train")\n'
            "g_opt = tf.train.AdamOptimizer()\n") in new
    assert "npu_tf_optimizer" not in new and "if int(" not in new.split("scaler =")[0]
    assert _rules(entries, BY_HAND) == []
    assert "distributed-mapped" in [e.rule for e in entries if e.kind == CHANGED]


@pytest.mark.parametrize("variant,rule", [
    ("rebound", "unmovable"), ("another optimizer", "optimizer-unfollowed")])
def test_a_rank_size_if_the_tool_cannot_prove_is_refused(variant, rule):
    """The test's name bound again before the builder reads it; branches
    that wrap different optimizers."""
    head = HEAD.replace("import tensorflow", "import os\nimport tensorflow")
    if variant == "rebound":
        source = (head + "rank_size = int(os.getenv('RANK_SIZE', '1'))\n"
                  + _spelled("d", "rank_size > 1") + D_MIN + "rank_size = 2\n"
                  + _spelled("g", "rank_size > 1") + G_MIN + JOINT)
    else:
        source = (head + _spelled("d", other="tf.train.GradientDescentOptimizer(0.1)") + D_MIN
                  + _spelled("g") + G_MIN + JOINT)
    new, entries = _port(source)
    assert new == source
    assert rule in [r for r, _ in _rules(entries, BY_HAND)]


def test_a_group_of_a_train_op_made_before_the_last_minimize_is_refused():
    """build() makes the train ops after the last minimize: a tf.group of
    the first one between them would read no op there."""
    source = (HEAD + D_OPT + G_OPT + D_MIN + "d_group = tf.group(d_train)\n" + G_MIN
              + "sess.run(d_group)\nsess.run(g_train)\n")
    new, entries = _port(source)
    assert new == source
    assert ("fetch-unmapped", 7) in _rules(entries, BY_HAND)


def test_an_optimizer_bound_in_a_precision_branch_names_the_edit_that_ports_it():
    """Wrappers bound in an if, the minimize calls after it: the message
    says to move the minimize calls into the branches, and once moved the
    file ports (test_a_precision_if_else_is_ported_in_its_loss_scaled_branch)."""
    source = (HEAD + "if fp16:\n    d_opt = NPULossScaleOptimizer(tf.train.AdamOptimizer(), "
              "FixedLossScaleManager(8))\n    g_opt = NPULossScaleOptimizer("
              "tf.train.AdamOptimizer(), FixedLossScaleManager(8))\nelse:\n"
              "    d_opt = tf.train.AdamOptimizer()\n    g_opt = tf.train.AdamOptimizer()\n"
              + D_MIN + G_MIN + JOINT)
    new, entries = _port(source)
    assert new == source
    messages = [e.message for e in entries if e.rule == "optimizer-unfollowed"]
    assert len(messages) == 2 and all("move the minimize calls into each branch" in m
                                      for m in messages)


def test_update_ops_around_a_precision_if_are_lifted_into_the_scaled_branch():
    """Issue 46, point 0: the block around the if goes from the branch that
    scales (its build(update_ops=...) gates them); the plain branch keeps it
    around its lines, as before."""
    source = (HEAD + "with tf.control_dependencies(update_ops):  # batch norm\n"
              + "".join("    " + line for line in PRECISION.splitlines(True)) + JOINT)
    new, entries = _port(source)
    assert new.endswith(
        "# batch norm\nif FLAGS.precision_mode == 'allow_mix_precision':\n"
        "    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8))\n"
        '    scaler.add(d_loss, d_opt, var_list=d_vars, name="d_train")\n'
        '    scaler.add(g_loss, g_opt, var_list=g_vars, name="g_train",\n'
        "               loss_scale_manager=nl.FixedLossScaleManager(8))\n"
        "    train = scaler.build(update_ops=update_ops)\n"
        "    d_train = train.update_op\n    g_train = train.update_op\n"
        "else:\n    with tf.control_dependencies(update_ops):\n"
        "        d_train = d_opt.minimize(d_loss, var_list=d_vars)\n"
        "        g_train = g_opt.minimize(g_loss, var_list=g_vars)\n" + JOINT)
    assert _rules(entries, BY_HAND) == []
    assert ("update-ops-lifted", 4) in _rules(entries, CHANGED)
    builder = [e.message for e in entries if e.rule == "builder"][0]
    assert "run on skipped steps too" not in builder
    unliftable = source.replace("update_ops):", "tf.get_collection('u')):")
    assert ("update-ops-not-atomic", 4) in _rules(_port(unliftable)[1], BY_HAND)


def test_an_alternating_loop_under_a_device_loop_is_told_of_sequences():
    """Only the op named IterationOp loops on Ascend: an alternating loop in a
    script that asks for a device loop is ported as per_group ops, and the
    report says how to loop it (loss callables, build(sequence=[...]));
    without a device loop it says nothing of it (issue 47)."""
    alternating = HEAD + D_OPT + G_OPT + D_MIN + G_MIN + "sess.run(d_train)\nsess.run(g_train)\n"
    looped = alternating + 'custom_op.parameter_map["iterations_per_loop"].i = 10\n'
    new, entries = _port(looped)
    assert "per_group_ops=True" in new
    told = [e for e in entries if e.rule == "alternating-device-loop"]
    assert [e.kind for e in told] == [LEFT_ALONE]
    assert "build(sequence=[...])" in told[0].message and "IterationOp" in told[0].message
    assert "alternating-device-loop" not in [e.rule for e in _port(alternating)[1]]
    joint = HEAD + D_OPT + G_OPT + D_MIN + G_MIN + JOINT + "# iterations_per_loop=10\n"
    assert "alternating-device-loop" not in [e.rule for e in _port(joint)[1]]


def test_a_wrapper_spelled_under_an_if_ports_the_same_on_every_run():
    """libcst keeps a name's assignments and reads in sets, whose order
    changes from one run to the next: the port reads them in the order of
    the source, so the same script gets the same rewrite and report (the
    if's branch first)."""
    def spelled(net):
        return ("%s_opt = tf.train.AdamOptimizer()\n"
                "if int(os.getenv('RANK_SIZE', '1')) > 1:\n"
                "    %s_opt = npu_tf_optimizer(NPULossScaleOptimizer(%s_opt, "
                "FixedLossScaleManager(8), is_distributed=True))\n"
                "else:\n"
                "    %s_opt = NPULossScaleOptimizer(%s_opt, FixedLossScaleManager(8))\n"
                % ((net,) * 5))
    source = "import os\n" + HEAD + spelled("d") + D_MIN + spelled("g") + G_MIN + JOINT
    runs = [_port(source) for _ in range(8)]
    assert all(run == runs[0] for run in runs)
    assert [e.line for e in runs[0][1] if e.rule == "manager-mapped"] == [7, 13]


def test_compute_then_apply_on_the_next_line_is_a_minimize():
    """Issue 46: ``gv = opt.compute_gradients(...)`` then ``opt.apply_gradients(gv)``,
    ``gv`` read nowhere else, is one add(); apply's global_step moves to build()."""
    source = (HEAD + D_OPT + G_OPT
              + "d_gv = d_opt.compute_gradients(d_loss, var_list=d_vars)  # D's pairs\n"
              + "d_train = d_opt.apply_gradients(d_gv, global_step=gs)\n" + G_MIN + JOINT)
    new, entries = _port(source)
    assert "compute_gradients" not in new and "apply_gradients" not in new
    assert "# D's pairs\n" in new
    assert 'scaler.add(d_loss, d_opt, var_list=d_vars, name="d_train")\n' in new
    assert "train = scaler.build(global_step=gs)\n" in new
    assert "d_train = train.update_op\n" in new
    changed = _rules(entries, CHANGED)
    assert ("compute-apply-to-add", 6) in changed and ("global-step-to-build", 7) in changed
    assert _rules(entries, BY_HAND) == []


def test_a_group_built_after_another_groups_train_op_is_the_joint_step():
    """Issue 46: Pix2Pix's ``with tf.control_dependencies([d_train]):`` around the
    generator's lines, its var_list read inside, the last op fetched: the block
    goes, one joint step, and the report says what that changes."""
    source = (HEAD + D_OPT + D_MIN + "with tf.control_dependencies([d_train]):\n"
              + "    g_vars = [v for v in tf.trainable_variables() if v.name.startswith('g')]\n"
              + "    " + G_OPT + "    g_gv = g_opt.compute_gradients(g_loss, var_list=g_vars)\n"
              + "    g_train = g_opt.apply_gradients(g_gv)\n"
              + "train_op = tf.group(g_train, ema_op)\nsess.run(train_op)\n")
    new, entries = _port(source)
    assert "control_dependencies" not in new
    assert ("g_vars = [v for v in tf.trainable_variables() if v.name.startswith('g')]\n"
            "g_opt = tf.train.AdamOptimizer()\n"
            'scaler.add(g_loss, g_opt, var_list=g_vars, name="g_train",') in new
    assert "d_train = train.update_op\ng_train = train.update_op\n" in new
    chained = [e for e in entries if e.rule == "train-ops-chained"]
    assert [(e.kind, e.line) for e in chained] == [(CHANGED, 6)]
    assert "same forward pass" in chained[0].message and "skips as one" in chained[0].message
    assert _rules(entries, BY_HAND) == []


def test_a_train_op_handed_to_the_device_loop_is_fetched_there():
    """Issue 46: ``util.set_iteration_per_loop(sess, train_op, n)`` returns the op
    that runs ``train_op`` in the device loop: it maps like a session.run fetch
    (the joint op, or per-group ops with the device loop's sequence advice)."""
    joint = (HEAD + D_OPT + G_OPT + D_MIN + "with tf.control_dependencies([d_train]):\n    "
             + G_MIN + "loop_op = util.set_iteration_per_loop(sess, g_train, 10)\n"
             + "sess.run(loop_op)\n")
    new, entries = _port(joint)
    assert "g_train = train.update_op\n" in new
    assert _rules(entries, BY_HAND) == []
    alternating = (HEAD + D_OPT + G_OPT + D_MIN + G_MIN
                   + "d_loop = util.set_iteration_per_loop(sess, d_train, 10)\n"
                   + "g_loop = util.set_iteration_per_loop(sess, train_op=g_train,"
                   " iterations_per_loop=10)\n")
    new, entries = _port(alternating)
    assert 'd_train = train.per_group["d_train"]\n' in new
    assert "alternating-device-loop" in [e.rule for e in entries if e.kind == LEFT_ALONE]
    assert _rules(entries, BY_HAND) == []
    read = HEAD + D_OPT + G_OPT + D_MIN + G_MIN + "util.set_iteration_per_loop(d_train, 10)\n"
    assert ("fetch-unmapped", 8) in _rules(_port(read)[1], BY_HAND)


def test_a_one_line_if_wrapper_names_the_if_else_that_ports():
    """Issue 46: ``if fp16: opt = Wrapper(opt, m)`` with no else stays refused
    (which optimizer each minimize gets depends on the test, and one builder
    cannot follow it); the message names the edit, and the if/else it names
    ports: the scaled branch gets the builder, the plain branch stays, one
    Adam made above both."""
    source = [r[1] for r in REFUSALS if r[0] == "optimizer-unfollowed: a one-line if"][0]
    unfollowed = [e for e in _port(source)[1] if e.rule == "optimizer-unfollowed"]
    assert [e.line for e in unfollowed] == [8, 9]
    assert "bound in a branch of an if (line 5)" in unfollowed[0].message
    assert "move the minimize calls into each branch" in unfollowed[0].message
    edited = (HEAD + "d_opt = tf.train.AdamOptimizer()\ng_opt = tf.train.AdamOptimizer()\n"
              + "if fp16:\n"
              + "    d_opt = NPULossScaleOptimizer(d_opt, FixedLossScaleManager(8))\n"
              + "    g_opt = NPULossScaleOptimizer(g_opt, FixedLossScaleManager(8))\n"
              + "    " + D_MIN + "    " + G_MIN + "else:\n    " + D_MIN + "    " + G_MIN + JOINT)
    new, entries = _port(edited)
    assert _rules(entries, BY_HAND) == []
    assert "NPULossScaleOptimizer" not in new
    assert ("    train = scaler.build()\n    d_train = train.update_op\n"
            "    g_train = train.update_op\nelse:\n    " + D_MIN + "    " + G_MIN) in new
