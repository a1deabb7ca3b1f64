"""Claims the README and docs/ make about TensorFlow and about porting, checked.

Each test finds the claim (or the snippet) in its page (the porting rules
are docs/porting.md, the module list docs/design.md's "Architecture") and
then shows, with TensorFlow itself as the reference, that it holds: the
Saver's default ``var_list``, ``tf.get_collection``'s scope matching, how a
per-group run's skip shows, how the examples are run, and which modules
there are.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import REPO, SKIPPED_STEPS
from readme_blocks import pages
from test_shim_npu_init import REAL_NAMES
import warm_python


def _page(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def _readme():
    return _page("README.md")


def _section(text, heading):
    """The section under ``heading`` (a ``## `` line), up to the next one."""
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _porting_section():
    """docs/porting.md, the porting rules: the whole page."""
    text = _page("docs/porting.md")
    assert text.startswith("# Porting a TF1 script\n")
    return text


def _bullet(section, title):
    """The text of the list item that starts with ``* **<title>``."""
    start = section.index("* **" + title)
    end = section.find("\n* **", start + 1)
    return section[start:] if end < 0 else section[start:end]


def _porting_diff():
    match = re.search(r"```diff\n(.*?)```", _porting_section(), re.S)
    assert match, "the porting section lost its diff"
    return match.group(1).splitlines()


def _two_groups():
    """Two networks, a fed knob that makes the D loss overflow (inf)."""
    x = tf.placeholder(tf.float32, [4, 3], name="x")
    poison = tf.placeholder_with_default(1.0, [], name="poison")
    with tf.variable_scope("generator"):
        g_w = tf.get_variable("w", [3, 1])
    with tf.variable_scope("discriminator"):
        d_w = tf.get_variable("w", [3, 1])
    d_loss = tf.reduce_mean(tf.matmul(x, d_w)) * poison
    g_loss = tf.reduce_mean(tf.square(tf.matmul(x, g_w)))
    return x, poison, d_w, g_w, d_loss, g_loss


# ---------------------------------------------------------------- Saver order
def test_saver_saves_the_scale_state_only_when_made_after_build(graph, tmp_path):
    # docs/porting.md says it, and its diff makes the Saver after build().
    checkpoints = _bullet(_porting_section(), "Checkpoints.")
    assert "created **after** `build()`" in checkpoints
    diff = _porting_diff()
    builds = [i for i, line in enumerate(diff) if "scaler.build(" in line]
    savers = [i for i, line in enumerate(diff) if line.startswith("+saver = tf.train.Saver(")]
    assert len(builds) == 2 and len(savers) == 2
    assert all(b < s for b, s in zip(builds, savers)), "a Saver before build() in the diff"

    # TensorFlow: a Saver without var_list takes the global variables that
    # exist when it is made (the checkpoint reader is the reference).
    x, _, d_w, g_w, d_loss, g_loss = _two_groups()
    saver_before_manager = tf.train.Saver()
    manager = nl.DynamicLossScaleManager()
    saver_before_build = tf.train.Saver()
    scaler = nl.MultiOptimizerLossScale(manager)
    scaler.add(d_loss, tf.train.AdamOptimizer(0.1), var_list=[d_w], name="d")
    scaler.add(g_loss, tf.train.AdamOptimizer(0.1), var_list=[g_w], name="g")
    scaler.build(global_step=tf.train.get_or_create_global_step())
    saver_after_build = tf.train.Saver()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        saved = {}
        for name, saver in (("before_manager", saver_before_manager),
                            ("before_build", saver_before_build),
                            ("after_build", saver_after_build)):
            prefix = saver.save(sess, str(tmp_path / name))
            saved[name] = set(n for n, _ in tf.train.list_variables(prefix))
    state = set(v.op.name for v in manager.variables)
    made_by_build = set(v.op.name for v in tf.global_variables()) - saved["before_build"]
    assert SKIPPED_STEPS in made_by_build and "global_step" in made_by_build
    assert any(n.endswith("/Adam") for n in made_by_build)          # optimizer slots
    assert state and not state & saved["before_manager"]
    assert state <= saved["before_build"]
    assert SKIPPED_STEPS not in saved["before_build"]
    assert state | {SKIPPED_STEPS} | made_by_build <= saved["after_build"]
    assert saved["after_build"] == set(v.op.name for v in tf.global_variables())


# ------------------------------------------------- UPDATE_OPS scope matching
def test_update_ops_scope_is_a_prefix_match_and_the_docs_use_the_slash(graph):
    # Every scoped get_collection(UPDATE_OPS, "...") in the README and docs/
    # ends its scope with "/", and docs/porting.md explains why.
    texts = dict((path, _page(path)) for path in pages())
    pattern = re.compile(r"get_collection\(\s*tf\.GraphKeys\.UPDATE_OPS\s*,\s*r?['\"]([^'\"]*)['\"]")
    scopes = [(where, scope) for where, text in texts.items() for scope in pattern.findall(text)]
    assert scopes, "the porting diff lost its scoped UPDATE_OPS"
    assert [(w, s) for w, s in scopes if not s.endswith("/")] == []
    update_ops = _bullet(_porting_section(), "`UPDATE_OPS`.")
    assert "discriminator_1/" in update_ops and '`"discriminator/"`' in update_ops
    assert '`r"discriminator(_\\d+)?/"`' in update_ops  # every call of the network

    # TensorFlow: the scope is re.match'ed against each op's name. The
    # generator called again with reuse=True gets the name scope generator_1.
    def generator_update():
        moving = tf.get_variable("moving_mean", [], trainable=False)
        op = tf.assign_add(moving, 1.0).op
        tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, op)
        return op

    with tf.variable_scope("generator"):
        train_update = generator_update()
    with tf.variable_scope("generator", reuse=True):
        sample_update = generator_update()
    with tf.variable_scope("generator_eval"):
        eval_update = generator_update()
    with tf.variable_scope("discriminator"):
        generator_update()
    assert sample_update.name.startswith("generator_1/")
    loose = tf.get_collection(tf.GraphKeys.UPDATE_OPS, "generator")
    exact = tf.get_collection(tf.GraphKeys.UPDATE_OPS, "generator/")
    assert loose == [train_update, sample_update, eval_update]
    assert exact == [train_update]
    every_call = tf.get_collection(tf.GraphKeys.UPDATE_OPS, r"generator(_\d+)?/")
    assert every_call == [train_update, sample_update]


# ------------------------------------------------- did a per-group run skip?
def test_per_group_skip_shows_in_skipped_steps_as_the_readme_shows(graph):
    bullet = _bullet(_porting_section(), "Did a run skip?")
    snippet = re.search(r"```python\n(.*?)```", bullet, re.S)
    assert snippet, "docs/porting.md lost its skipped_steps snippet"
    code = "\n".join(line[2:] if line.startswith("  ") else line
                     for line in snippet.group(1).splitlines())

    x, poison, d_w, g_w, d_loss, g_loss = _two_groups()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0))
    scaler.add(d_loss, tf.train.GradientDescentOptimizer(0.1), var_list=[d_w], name="d")
    scaler.add(g_loss, tf.train.GradientDescentOptimizer(0.1), var_list=[g_w], name="g")
    train = scaler.build(global_step=tf.train.get_or_create_global_step(),
                         per_group_ops=True)
    rng = np.random.RandomState(0)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for iteration in range(4):
            d_feed = {x: rng.randn(4, 3)}
            if iteration == 2:
                d_feed[poison] = np.inf
            g_feed = {x: rng.randn(4, 3)}
            d_before = sess.run(d_w)
            namespace = dict(sess=sess, train=train, d_feed=d_feed, g_feed=g_feed,
                             d_train=train.per_group["d"], g_train=train.per_group["g"])
            exec(code, namespace)  # noqa: S102
            # The reference: the D run skipped exactly when D's weights did not move.
            d_moved = not np.array_equal(sess.run(d_w), d_before)
            assert namespace["d_skipped"] == (not d_moved) == (iteration == 2)
            assert not namespace["g_skipped"]
        assert sess.run(train.skipped_steps) == 1
        # applied belongs to the joint step: with a per-group op it is worked
        # out for the run's batch, and the joint step applies nothing.
        g_before = sess.run(g_w)
        sess.run([train.per_group["d"], train.applied], {x: rng.randn(4, 3)})
        np.testing.assert_array_equal(sess.run(g_w), g_before)


# ----------------------------------------------- what the star import gave
def test_readme_names_only_what_npu_init_really_exports():
    # The porting page's list of names a script got from
    # `from npu_bridge.npu_init import *` are all names of tf_adapter's
    # npu_init.py (REAL_NAMES, taken from the file: see test_shim_npu_init.py),
    # and it says the import patches Session (the file's last two lines:
    # session.Session.__init__ = decorator_tf_session(...), and InteractiveSession).
    bullet = _bullet(_porting_section(), "`from npu_bridge.npu_init import *`.")
    assert "patches `tf.Session` and `tf.InteractiveSession`" in bullet
    listed = bullet[bullet.index("may well use some"):bullet.index("All of that")]
    listed = re.sub(r"\([^()]*\)", "", " ".join(listed.split()))   # drop the remarks
    names = re.findall(r"`(\w+)`", listed)
    for expected in ("npu_ops", "RewriterConfig", "npu_plugin", "tf", "npu_config_proto"):
        assert expected in names
    assert sorted(set(names) - REAL_NAMES) == []


# ------------------------------------------------------ example commands
_COMMAND = re.compile(r"^\s*(?:\$\s+)?(?P<cmd>\S*python\S*)\s+(?P<arg>examples/\S+\.py|-m\s+npu_lossscale\S*)",
                      re.M)


def test_readme_runs_examples_with_the_venv_python():
    # Every command line in the README and docs/ that runs an example or one
    # of the package's command lines names the project's interpreter, never
    # a bare `python`; the README says which.
    text = "\n".join(_page(path) for path in pages())
    blocks, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
            if inside:
                blocks.append("")
        elif inside:
            blocks[-1] += line + "\n"
    commands = [(m.group("cmd"), m.group("arg")) for block in blocks
                for m in _COMMAND.finditer(block)]
    inline = re.findall(r"`([^\s`]*python[^\s`]*) (examples/[^\s`]+\.py)[^`]*`", text)
    assert len(commands) >= 3 and inline
    bad = [c for c in commands + inline if c[0] not in (".venv/bin/python", ".venv-tf215/bin/python")]
    assert bad == []
    assert "`.venv` interpreter" in _readme()


def test_example_scripts_start_with_the_venv_python_and_no_pythonpath():
    # What those commands rely on: the interpreter that runs the tests (the
    # venv's, where `make venv` installs this package in editable mode)
    # starts each example named with .venv/bin/python, from the repository
    # root, without PYTHONPATH.
    text = "\n".join(_page(path) for path in pages())
    scripts = sorted(set(re.findall(r"\.venv/bin/python (examples/\S+\.py)", text)))
    assert scripts
    env = dict((k, v) for k, v in os.environ.items() if k != "PYTHONPATH")
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    for script in scripts:
        assert os.path.isfile(os.path.join(REPO, script)), script
        proc = warm_python.run([sys.executable, script, "--help"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=240)
        assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]


def test_readme_architecture_lists_every_module_once_and_the_phases_in_order():
    # The "Architecture" section's blocks (docs/design.md): one row per
    # module of npu_lossscale/ (subpackages included), none that is not
    # there, and the numbered phases in the order the step runs them.
    section = _section(_page("docs/design.md"), "## Architecture")
    rows = [line.split() for block in re.findall(r"```text\n(.*?)```", section, re.S)
            for line in block.splitlines() if line.strip()]
    package = os.path.join(REPO, "npu_lossscale")
    files = sorted(os.path.relpath(os.path.join(root, name), package).replace(os.sep, "/")
                   for root, _, names in os.walk(package) for name in names
                   if name.endswith(".py"))
    listed = [row[0] for row in rows]
    assert sorted(listed) == files and len(set(listed)) == len(listed)
    # Each phase module's docstring opens with "Phase N of the step".
    stated = []
    for name in files:
        with open(os.path.join(package, name)) as f:
            found = re.match(r'"""Phase (\d) of the step', f.read())
        if found:
            stated.append((name, int(found.group(1))))
    phases = [(row[0], int(row[1])) for row in rows if row[1].isdigit()]
    assert phases == sorted(stated, key=lambda item: item[1])
    assert [name for name, _ in phases] == ["core/plan.py", "core/gradients.py",
                                            "core/overflow.py", "core/window.py",
                                            "core/close.py"]
