"""Checkpoints written with other layouts restore after convert_checkpoint.

* npu_lossscale 0.1 (before issue 16): float32 ``<scope>/loss_scale``, int32
  ``good_steps``, ``bad_steps``, ``overflows_at_floor`` and bool
  ``floor_warned`` under ``dynamic_loss_scale/`` and ``exponential_loss_scale/``.
* npu_bridge / contrib: ``loss_scale`` float32, ``good_steps`` and
  ``bad_steps`` int32 in the current name scope
  (tf_adapter/python/npu_bridge/estimator/npu/npu_loss_scale_manager.py).
Both layouts are built by hand here, saved, converted and restored into the
current managers; the npu_bridge one is also converted back.
"""

import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale.managers import convert_checkpoint


def _save(build, path):
    """Builds variables with ``build()`` in a fresh graph and saves them."""
    with tf.Graph().as_default():
        build()
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            return tf.train.Saver().save(sess, path)


def _old_layout():
    """The variables npu_lossscale 0.1's managers made, by hand."""
    def scope(name, scale, good, bad, streak, warned):
        with tf.name_scope(name):
            tf.Variable(scale, dtype=tf.float32, trainable=False, name="loss_scale")
            tf.Variable(good, dtype=tf.int32, trainable=False, name="good_steps")
            tf.Variable(bad, dtype=tf.int32, trainable=False, name="bad_steps")
            tf.Variable(streak, dtype=tf.int32, trainable=False, name="overflows_at_floor")
            tf.Variable(warned, dtype=tf.bool, trainable=False, name="floor_warned")
    scope("dynamic_loss_scale", 512.0, 7, 0, 2, True)
    scope("exponential_loss_scale", 2048.0, 3, 1, 0, False)
    tf.Variable([1.5, -2.0], name="w")


def _new_managers():
    dynamic = nl.DynamicLossScaleManager(initial_scale=2.0 ** 15, growth_steps=8)
    exponential = nl.ExponentialUpdateLossScaleManager(2.0 ** 15, 4, decr_ratio=0.5)
    w = tf.Variable([0.0, 0.0], name="w")
    return dynamic, exponential, w


def test_old_layout_restores_after_conversion(tmp_path):
    old = _save(_old_layout, str(tmp_path / "old"))
    new = str(tmp_path / "new")
    converted = convert_checkpoint(old, new)
    assert converted == ["dynamic_loss_scale/state", "exponential_loss_scale/state"]
    with tf.Graph().as_default():
        dynamic, exponential, w = _new_managers()
        finite = tf.placeholder(tf.bool, [])
        updates = [dynamic.update_loss_scale(finite), exponential.update_loss_scale(finite)]
        with tf.Session() as sess:
            with pytest.raises((tf.errors.NotFoundError, tf.errors.InvalidArgumentError)):
                tf.train.Saver().restore(sess, old)  # the old layout alone does not
            tf.train.Saver().restore(sess, new)
            assert sess.run(dynamic.state).tolist() == [512.0, 7.0, 0.0, 2.0]
            assert sess.run(exponential.state).tolist() == [2048.0, 3.0, 1.0, 0.0]
            assert sess.run(w).tolist() == [1.5, -2.0]
            # The rules go on from the restored counters: dynamic, 8th finite
            # step grows; exponential (period 4), 4th finite step grows.
            sess.run(updates, {finite: True})
            assert sess.run(dynamic.state).tolist() == [1024.0, 0.0, 0.0, 0.0]
            assert sess.run(exponential.state).tolist() == [4096.0, 0.0, 0.0, 0.0]


def _npu_bridge_layout(scale, good, bad):
    def build():
        # npu_loss_scale_manager.py: variable_scope.variable(name="loss_scale",
        # dtype=float32), "good_steps" and "bad_steps" with dtype int32.
        tf.Variable(scale, dtype=tf.float32, trainable=False, name="loss_scale")
        tf.Variable(good, dtype=tf.int32, trainable=False, name="good_steps")
        tf.Variable(bad, dtype=tf.int32, trainable=False, name="bad_steps")
        tf.Variable([1.5, -2.0], name="w")
    return build


def test_npu_bridge_checkpoint_round_trip(tmp_path):
    theirs = _save(_npu_bridge_layout(2.0 ** 32, 5, 1), str(tmp_path / "npu"))
    ours = str(tmp_path / "ours")
    assert convert_checkpoint(theirs, ours) == ["exponential_loss_scale/state"]
    saved = str(tmp_path / "ours_after")
    with tf.Graph().as_default():
        exponential = nl.ExponentialUpdateLossScaleManager(2.0 ** 15, 4, decr_ratio=0.5)
        tf.Variable([0.0, 0.0], name="w")
        update = exponential.update_loss_scale(tf.constant(False))
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, ours)
            assert sess.run(exponential.state).tolist() == [2.0 ** 32, 5.0, 1.0, 0.0]
            sess.run(update)  # bad + 1 == 2: back off by 0.5, reset
            assert sess.run(exponential.state).tolist() == [2.0 ** 31, 0.0, 0.0, 1.0]
            sess.run(update)
            sess.run(exponential.update_loss_scale(tf.constant(True)))  # good 1, bad 1 kept
            tf.train.Saver().save(sess, saved)
    back = str(tmp_path / "back")
    assert convert_checkpoint(saved, back, to="npu_bridge") == [
        "bad_steps", "good_steps", "loss_scale"]
    reader = tf.train.load_checkpoint(back)
    dtypes = reader.get_variable_to_dtype_map()
    assert dtypes["loss_scale"] == tf.float32
    assert dtypes["good_steps"] == tf.int32 and dtypes["bad_steps"] == tf.int32
    assert not any(name.startswith("exponential_loss_scale") for name in dtypes)
    # Restores into npu_bridge's variables (built by hand, as the class does).
    with tf.Graph().as_default():
        _npu_bridge_layout(0.0, 0, 0)()
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, back)
            values = dict((v.op.name, sess.run(v)) for v in tf.global_variables())
    assert values["loss_scale"] == 2.0 ** 31
    assert values["good_steps"] == 1 and values["bad_steps"] == 1
    assert values["w"].tolist() == [1.5, -2.0]


def test_shim_manager_checkpoint_restores_into_ours(tmp_path, npu_shim):
    """The shim's faithful npu_bridge manager, trained a few steps, saved."""
    from npu_bridge.estimator.npu import npu_loss_scale_manager as npu
    path = str(tmp_path / "shim")
    with tf.Graph().as_default():
        theirs = npu.ExponentialUpdateLossScaleManager(2 ** 20, 3, decr_ratio=0.5)
        finite = tf.placeholder(tf.bool, [])
        update = theirs.update_loss_scale(finite)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for value in [True, False, True, True, False, True]:
                sess.run(update, {finite: value})
            expected = [float(sess.run(tf.convert_to_tensor(theirs.get_loss_scale()))),
                        float(sess.run(theirs._num_good_steps)),  # pylint: disable=protected-access
                        float(sess.run(theirs._num_bad_steps))]  # pylint: disable=protected-access
            tf.train.Saver().save(sess, path)
    converted = str(tmp_path / "converted")
    convert_checkpoint(path, converted)
    with tf.Graph().as_default():
        ours = nl.ExponentialUpdateLossScaleManager(2 ** 20, 3, decr_ratio=0.5)
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, converted)
            assert sess.run(ours.state).tolist()[:3] == expected
    # By hand (N=3, M=2): T g1; F g0 b1; T g1 b1; T g2 b1; F back-off to 2**19,
    # reset; T g1.
    assert expected == [2.0 ** 19, 1.0, 0.0]


def test_conversion_is_idempotent_and_rejects_bad_arguments(tmp_path):
    old = _save(_old_layout, str(tmp_path / "old"))
    once, twice = str(tmp_path / "once"), str(tmp_path / "twice")
    convert_checkpoint(old, once)
    assert convert_checkpoint(once, twice) == []
    a, b = tf.train.load_checkpoint(once), tf.train.load_checkpoint(twice)
    names = sorted(a.get_variable_to_shape_map())
    assert names == sorted(b.get_variable_to_shape_map())
    for name in names:
        assert np.array_equal(a.get_tensor(name), b.get_tensor(name))
    with pytest.raises(ValueError, match=r"to must be one of .*'keras'"):
        convert_checkpoint(old, once, to="keras")
    with pytest.raises(ValueError, match="source must be a checkpoint prefix"):
        convert_checkpoint(str(tmp_path / "missing"), once)


# -- issue 20: only the managers' own variables are converted ---------------------

def _tensors(path):
    """{name: numpy value} of a checkpoint, with the dtype kept in the value."""
    reader = tf.train.load_checkpoint(path)
    return dict((name, np.asarray(reader.get_tensor(name)))
                for name in reader.get_variable_to_dtype_map())


def _assert_same_bytes(before, after, names):
    for name in names:
        assert after[name].dtype == before[name].dtype, name
        assert after[name].shape == before[name].shape, name
        assert after[name].tobytes() == before[name].tobytes(), name


def _user_variables():
    """A user's own variables that happen to carry the managers' field names.

    Each differs from every manager layout in one way: its siblings' dtypes
    (TF's DynamicLossScale counts good_steps in int64), a missing sibling, or
    a state name that a real manager already holds (below).
    """
    with tf.name_scope("model"):
        tf.Variable(3.0, trainable=False, name="loss_scale")
        tf.Variable(7, dtype=tf.int64, trainable=False, name="good_steps")
        tf.Variable(2, dtype=tf.int64, trainable=False, name="bad_steps")
    with tf.name_scope("user/dynamic_loss_scale"):
        tf.Variable(5.0, trainable=False, name="loss_scale")  # no counters
    tf.Variable([1.0, 2.0, 3.0], name="good_steps")
    return ["model/loss_scale", "model/good_steps", "model/bad_steps",
            "user/dynamic_loss_scale/loss_scale", "good_steps"]


def test_user_variables_named_like_manager_fields_are_copied_byte_identical(tmp_path):
    names = []

    def build():
        _old_layout()
        names.extend(_user_variables())

    old = _save(build, str(tmp_path / "old"))
    new = str(tmp_path / "new")
    converted = convert_checkpoint(old, new)
    assert converted == ["dynamic_loss_scale/state", "exponential_loss_scale/state"]
    before, after = _tensors(old), _tensors(new)
    _assert_same_bytes(before, after, names + ["w"])
    assert after["dynamic_loss_scale/state"].tolist() == [512.0, 7.0, 0.0, 2.0]
    assert sorted(after) == sorted(names + ["w"] + converted)
    # Back to npu_bridge's layout: the state takes "loss_scale", "good_steps",
    # "bad_steps" at the root, and the user's "good_steps" holds that name.
    with pytest.raises(ValueError) as error:
        convert_checkpoint(new, str(tmp_path / "back"), to="npu_bridge")
    for fragment in ['to="npu_bridge"', "'exponential_loss_scale/state'", "good_steps",
                     "float32[3]", "Rename that variable"]:
        assert fragment in str(error.value), (fragment, str(error.value))
    assert not tf.io.gfile.glob(str(tmp_path / "back") + "*")  # nothing written


def test_user_triple_beside_this_versions_state_is_left_alone(tmp_path):
    """A user's float32/int32/int32 ``loss_scale``/``good_steps``/``bad_steps``
    beside a real manager's state: the state is this version's already, so
    the triple is not npu_bridge's and must not overwrite it."""
    def build():
        manager = nl.ExponentialUpdateLossScaleManager(2.0 ** 10, 4)
        tf.Variable(1.0, trainable=False, name="loss_scale")
        tf.Variable(11, dtype=tf.int32, trainable=False, name="good_steps")
        tf.Variable(12, dtype=tf.int32, trainable=False, name="bad_steps")
        assert manager.state.op.name == "exponential_loss_scale/state"

    saved = _save(build, str(tmp_path / "saved"))
    converted = str(tmp_path / "converted")
    assert convert_checkpoint(saved, converted) == []
    before, after = _tensors(saved), _tensors(converted)
    assert sorted(after) == sorted(before)
    _assert_same_bytes(before, after, sorted(before))
    assert after["exponential_loss_scale/state"].tolist() == [1024.0, 0.0, 0.0, 0.0]


def test_back_to_npu_bridge_leaves_other_scopes_byte_identical(tmp_path):
    names = []

    def build():
        nl.ExponentialUpdateLossScaleManager(2.0 ** 10, 4)
        with tf.name_scope("model"):
            tf.Variable(3.0, trainable=False, name="loss_scale")
            tf.Variable(7, dtype=tf.int64, trainable=False, name="good_steps")
        tf.Variable([0.5], name="exponential_loss_scale_7/state")  # not float32[4]
        names.extend(["model/loss_scale", "model/good_steps",
                      "exponential_loss_scale_7/state"])

    saved = _save(build, str(tmp_path / "saved"))
    back = str(tmp_path / "back")
    assert convert_checkpoint(saved, back, to="npu_bridge") == [
        "bad_steps", "good_steps", "loss_scale"]
    before, after = _tensors(saved), _tensors(back)
    _assert_same_bytes(before, after, names)
    assert after["loss_scale"] == 1024.0 and after["loss_scale"].dtype == np.float32
    assert after["good_steps"].dtype == np.int32 and after["bad_steps"] == 0


# -- issue 20: arguments that are not paths --------------------------------------

@pytest.mark.parametrize("source, target, to, error, fragments", [
    (None, "dst", "npu_lossscale", TypeError, ["source", "None", "checkpoint prefix",
                                                "Saver.save"]),
    (3, "dst", "npu_lossscale", TypeError, ["source", "3", "(int)"]),
    ("", "dst", "npu_lossscale", ValueError, ["source", "''"]),
    ("SRC", None, "npu_lossscale", TypeError, ["target", "None", "prefix to write"]),
    ("SRC", ["dst"], "npu_lossscale", TypeError, ["target", "['dst']"]),
    ("SRC", "no_such_dir/dst", "npu_lossscale", ValueError,
     ["target", "no_such_dir", "does not exist", "os.makedirs"]),
    ("SRC", "dst", None, TypeError, ["to must be a str", "None", "'npu_bridge'"]),
    ("SRC", "dst", "keras", ValueError, ["to must be one of", "'keras'"]),
])
def test_bad_arguments_name_the_argument_and_write_nothing(tmp_path, source, target, to,
                                                            error, fragments):
    saved = _save(_old_layout, str(tmp_path / "old"))
    if source == "SRC":
        source = saved
    if isinstance(target, str):
        target = str(tmp_path / target)
    with pytest.raises(error) as raised:
        convert_checkpoint(source, target, to=to)
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))
    assert not tf.io.gfile.glob(str(tmp_path / "dst") + "*")


def test_path_like_arguments_are_accepted(tmp_path):
    saved = _save(_old_layout, str(tmp_path / "old"))
    assert convert_checkpoint(tmp_path / "old", tmp_path / "new") == [
        "dynamic_loss_scale/state", "exponential_loss_scale/state"]
    _assert_same_bytes(_tensors(saved), _tensors(str(tmp_path / "new")), ["w"])


# -- issue 24: the training directory's state file; targets that cannot be written --

def test_conversion_into_the_training_directory_leaves_its_state_file(tmp_path):
    """Before: the converted checkpoint became ``latest_checkpoint`` and the
    list of the user's checkpoints was lost. Now only the converted data and
    index files are added; the state file keeps its bytes."""
    with tf.Graph().as_default():
        _old_layout()
        saver = tf.train.Saver(max_to_keep=5)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            first = saver.save(sess, str(tmp_path / "model"), global_step=1000)
            second = saver.save(sess, str(tmp_path / "model"), global_step=2000)
    state_file = tmp_path / "checkpoint"
    state_before = state_file.read_bytes()
    files_before = set(p.name for p in tmp_path.iterdir())
    assert convert_checkpoint(first, str(tmp_path / "converted-1000")) == [
        "dynamic_loss_scale/state", "exponential_loss_scale/state"]
    assert state_file.read_bytes() == state_before
    assert tf.train.latest_checkpoint(str(tmp_path)) == second
    assert list(tf.train.get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths) == [
        first, second]
    # The converted files, and nothing else (the write check leaves no file).
    assert set(p.name for p in tmp_path.iterdir()) - files_before == {
        "converted-1000.index", "converted-1000.data-00000-of-00001"}
    with tf.Graph().as_default():
        dynamic, _, _ = _new_managers()
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, str(tmp_path / "converted-1000"))
            assert sess.run(dynamic.variables[0]).tolist() == [512.0, 7.0, 0.0, 2.0]


def test_a_target_whose_directory_is_a_file_says_so(tmp_path):
    """Was: the file "does not exist"."""
    saved = _save(_old_layout, str(tmp_path / "old"))
    (tmp_path / "notes.txt").write_text("not a directory")
    target = str(tmp_path / "notes.txt" / "converted")
    with pytest.raises(ValueError) as raised:
        convert_checkpoint(saved, target)
    message = str(raised.value)
    for fragment in ["target", repr(target), "is a file, not a directory",
                     repr(str(tmp_path / "converted"))]:
        assert fragment in message, (fragment, message)
    assert "does not exist" not in message


@pytest.mark.parametrize("where", ["read_only_directory", "sysfs"])
def test_an_unwritable_target_is_a_value_error_naming_it(tmp_path, where):
    """Was TF's raw NotFoundError/PermissionDeniedError from the Saver's
    SaveV2 op. A directory without write permission (not for root, whom the
    permission does not stop) and Linux's read-only /sys."""
    saved = _save(_old_layout, str(tmp_path / "old"))
    if where == "sysfs":
        if not os.path.isdir("/sys"):
            pytest.skip("no /sys on this system")
        target = "/sys/npu_lossscale_converted"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        target = str(locked / "converted")
    try:
        with pytest.raises(ValueError) as raised:
            convert_checkpoint(saved, target)
    finally:
        if where != "sysfs":
            locked.chmod(0o700)
    message = str(raised.value)
    for fragment in ["target must be a prefix in a writable directory", repr(target),
                     "Pass a prefix in a directory you can write to"]:
        assert fragment in message, (fragment, message)
    assert not tf.io.gfile.glob(target + "*")


# -- issue 32: npu_bridge's names alone are not a manager's -------------------------

def _scoped_user_triple_beside_a_manager():
    """npu_bridge's manager at the top scope (float32 ``loss_scale``, int32
    ``good_steps``, ``bad_steps``) and a user's own float32/int32/int32
    ``model/loss_scale``, ``model/good_steps``, ``model/bad_steps``."""
    _npu_bridge_layout(2.0 ** 20, 5, 1)()
    with tf.name_scope("model"):
        tf.Variable(3.0, trainable=False, name="loss_scale")
        tf.Variable(7, dtype=tf.int32, trainable=False, name="good_steps")
        tf.Variable(2, dtype=tf.int32, trainable=False, name="bad_steps")


def test_a_user_triple_under_a_scope_is_converted_only_when_named(tmp_path):
    """The user's ``model/`` triple has npu_bridge's exact layout; by default
    only the top scope's triple (npu_bridge's manager) converts, the user's
    is copied byte for byte, with a warning naming it. Named, it converts,
    and the unnamed top-scope triple is then left as it is."""
    saved = _save(_scoped_user_triple_beside_a_manager, str(tmp_path / "saved"))
    before = _tensors(saved)
    user = ["model/loss_scale", "model/good_steps", "model/bad_steps"]
    default = str(tmp_path / "default")
    with pytest.warns(UserWarning, match=r"model/loss_scale have npu_bridge's layout "
                                         r"under a name scope and were copied unchanged"):
        assert convert_checkpoint(saved, default) == ["exponential_loss_scale/state"]
    after = _tensors(default)
    _assert_same_bytes(before, after, user + ["w"])
    assert after["exponential_loss_scale/state"].tolist() == [2.0 ** 20, 5.0, 1.0, 0.0]
    assert "model/exponential_loss_scale/state" not in after
    named = str(tmp_path / "named")
    assert convert_checkpoint(saved, named, npu_bridge_names=["model/loss_scale"]) == [
        "model/exponential_loss_scale/state"]
    after = _tensors(named)
    assert after["model/exponential_loss_scale/state"].tolist() == [3.0, 7.0, 2.0, 0.0]
    _assert_same_bytes(before, after, ["loss_scale", "good_steps", "bad_steps", "w"])
    assert not any(name in after for name in user)
    none = str(tmp_path / "none")
    assert convert_checkpoint(saved, none, npu_bridge_names=[]) == []
    _assert_same_bytes(before, _tensors(none), sorted(before))


def test_a_user_loss_scale_numbered_apart_from_the_manager_is_refused_or_named(tmp_path):
    """A user's top-scope ``loss_scale`` made before npu_bridge's manager:
    TF names the manager's ``loss_scale_1``, ``good_steps``, ``bad_steps``.
    By default the user's ``loss_scale`` would pair with the manager's
    counters; the conversion refuses instead, and the tuple naming the
    manager converts it, leaving the user's variable as it is."""
    def build():
        tf.Variable(0.25, trainable=False, name="loss_scale")  # the user's
        _npu_bridge_layout(2.0 ** 15, 3, 0)()
    saved = _save(build, str(tmp_path / "saved"))
    before = _tensors(saved)
    assert sorted(before) == ["bad_steps", "good_steps", "loss_scale", "loss_scale_1", "w"]
    with pytest.raises(ValueError) as error:
        convert_checkpoint(saved, str(tmp_path / "default"))
    for fragment in ["npu_bridge_names is None", "['loss_scale_1']", "['loss_scale']",
                     "Pass npu_bridge_names=[(loss_scale, good_steps, bad_steps)]"]:
        assert fragment in str(error.value), (fragment, str(error.value))
    assert not tf.io.gfile.glob(str(tmp_path / "default") + "*")
    named = str(tmp_path / "named")
    assert convert_checkpoint(saved, named, npu_bridge_names=[
        ("loss_scale_1", "good_steps", "bad_steps")]) == ["exponential_loss_scale/state"]
    after = _tensors(named)
    _assert_same_bytes(before, after, ["loss_scale", "w"])
    assert sorted(after) == ["exponential_loss_scale/state", "loss_scale", "w"]
    # It restores into the user's variable and this version's manager.
    with tf.Graph().as_default():
        mine = tf.Variable(0.0, trainable=False, name="loss_scale")
        ours = nl.ExponentialUpdateLossScaleManager(2.0 ** 10, 4)
        tf.Variable([0.0, 0.0], name="w")
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, named)
            assert sess.run(mine) == 0.25
            assert sess.run(ours.state).tolist() == [2.0 ** 15, 3.0, 0.0, 0.0]


@pytest.mark.parametrize("names, error, fragments", [
    ("loss_scale", TypeError, ["npu_bridge_names must be a list", "'loss_scale'", "(str)"]),
    ([3], TypeError, ["entries must be a str or a (loss_scale, good_steps, bad_steps) tuple",
                      "got 3"]),
    ([("loss_scale", "good_steps")], TypeError, ["got ('loss_scale', 'good_steps')"]),
    (["good_steps"], ValueError, ["entry 'good_steps' names no loss_scale variable"]),
    (["model/loss_scale"], ValueError, ["entry 'model/loss_scale' is not an npu_bridge "
                                        "manager here", "model/loss_scale missing",
                                        "tf.train.list_variables(source)"]),
    (["dynamic_loss_scale/loss_scale"], ValueError, [
        "converts to 'dynamic_loss_scale/exponential_loss_scale/state'",
        "the 0.1 layout uses", "Leave that entry out"]),
])
def test_bad_npu_bridge_names_say_which_and_write_nothing(tmp_path, names, error, fragments):
    saved = _save(_old_layout, str(tmp_path / "old"))
    with pytest.raises(error) as raised:
        convert_checkpoint(saved, str(tmp_path / "dst"), npu_bridge_names=names)
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))
    assert not tf.io.gfile.glob(str(tmp_path / "dst") + "*")
