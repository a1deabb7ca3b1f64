"""The Makefile's legs name every test file, so each file's legs are chosen.

``make test-fast`` runs every tests/test_*.py on TF 2.21; the Makefile's
V1_TESTS run again under v1 behaviour, TF215_TESTS again on TF 2.15.1, and
FAST_ONLY_TESTS nowhere else (the Makefile says why for each list). Plain
text checks: no TensorFlow.
"""

import glob
import os
import re

from conftest import REPO

LISTS = ("V1_TESTS", "TF215_TESTS", "FAST_ONLY_TESTS")


def _lists():
    """The Makefile's lists, by name: their entries (``tests/x.py`` or
    ``tests/x.py::test_name``), in order."""
    with open(os.path.join(REPO, "Makefile")) as handle:
        text = handle.read().replace("\\\n", " ")
    found = {}
    for name in LISTS:
        match = re.search(r"^%s\s*:=(.*)$" % name, text, re.M)
        assert match, "the Makefile lost %s" % name
        found[name] = match.group(1).split()
    return found


def _file(entry):
    return entry.split("::")[0]


def test_every_test_file_is_in_a_list():
    lists = _lists()
    named = set(_file(entry) for entries in lists.values() for entry in entries)
    files = set(os.path.relpath(path, REPO)
                for path in glob.glob(os.path.join(REPO, "tests", "test_*.py")))
    unnamed, missing = sorted(files - named), sorted(named - files)
    assert not unnamed, (
        "%s: name each in the Makefile's V1_TESTS and/or TF215_TESTS (the legs that run "
        "it again), or in FAST_ONLY_TESTS" % ", ".join(unnamed))
    assert not missing, "the Makefile names test files that do not exist: %s" % ", ".join(
        missing)


def test_fast_only_files_are_in_no_other_list():
    lists = _lists()
    others = set(_file(e) for e in lists["V1_TESTS"] + lists["TF215_TESTS"])
    assert sorted(others & set(lists["FAST_ONLY_TESTS"])) == []
    for name, entries in lists.items():
        assert len(entries) == len(set(entries)), "%s names an entry twice" % name


def test_named_tests_exist():
    """An entry ``tests/x.py::test_name`` names a test function of that file
    (pytest itself also stops the leg on a node it cannot find)."""
    for entries in _lists().values():
        for entry in entries:
            if "::" in entry:
                path, test = entry.split("::")
                with open(os.path.join(REPO, path)) as handle:
                    assert re.search(r"^def %s\(" % re.escape(test), handle.read(), re.M), entry
