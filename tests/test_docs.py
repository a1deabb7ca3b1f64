"""Every code block of README.md and docs/*.md runs, or says why it cannot.

The markers are described in readme_blocks.py: a named block is run by the
test file that names it, a ``setup:`` block here after its set-up
(docs_setups.py) and that set-up's checks, an unmarked one here as it is;
a ``not run:`` block states its reason. The links between the pages resolve
to files and headings that exist.
"""

import glob
import os
import re

import pytest

from conftest import REPO
from docs_setups import SETUPS
from readme_blocks import CODE, PYTHON, blocks, pages, run_blocks

ALL = blocks()
RUN_HERE = [b for b in ALL if b.is_code and not b.not_run and not b.name]

#: What a fence must name: code, or what it holds.
LANGUAGES = set(CODE) | {"text", "diff", "json"}


def _test_sources():
    found = {}
    for path in sorted(glob.glob(os.path.join(REPO, "tests", "test_*.py"))):
        with open(path) as handle:
            found[os.path.relpath(path, REPO)] = handle.read()
    return found


def test_every_code_block_is_run_or_says_why_not():
    assert len(ALL) > 30 and "README.md" in pages() and "docs/porting.md" in pages()
    unnamed = [b.id for b in ALL if b.language not in LANGUAGES]
    assert unnamed == [], "name each fence's language (one of %s)" % sorted(LANGUAGES)
    code = [b for b in ALL if b.is_code]
    for found in code:
        markers = [m for m in (found.name, found.setup, found.not_run is not None) if m]
        assert len(markers) <= 1, "%s: a name, a set-up or a not-run reason, not two" % found.id
        if found.not_run is not None:
            # A reason is a phrase: what it needs, and where it is run instead.
            assert len(found.not_run.split()) >= 4, "%s: say why it is not run" % found.id
        if found.setup:
            assert found.setup in SETUPS, "%s: no set-up %r in docs_setups.py" % (
                found.id, found.setup)
    not_code = [b.id for b in ALL if not b.is_code and (b.setup or b.not_run)]
    assert not_code == [], "only code blocks take run markers"
    # Every set-up serves a block.
    assert sorted(set(b.setup for b in code if b.setup)) == sorted(SETUPS)


def test_named_blocks_are_run_by_the_test_that_names_them():
    sources = _test_sources()
    named = [b for b in ALL if b.is_code and b.name]
    assert len(named) >= 7
    for found in named:
        assert found.language in CODE, found.id
        calls = (r"""(block|run_example)\(\s*["']%s["']""" % re.escape(found.name))
        runners = [path for path, text in sources.items() if re.search(calls, text)]
        assert runners, "%s (%r): no test runs it by name" % (found.id, found.name)


def test_shown_outputs_belong_to_named_blocks():
    names = set(b.name for b in ALL if b.is_code and b.name)
    outputs = [b for b in ALL if b.name and b.name.endswith("-output")]
    assert outputs, "the docs lost their shown outputs"
    for found in outputs:
        assert found.language == "text" and found.name[:-len("-output")] in names, found.id


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_blocks(RUN_HERE, SETUPS, tmp_path_factory.mktemp("docs_blocks"))


@pytest.mark.parametrize("block", RUN_HERE, ids=lambda b: b.id)
def test_block_runs(block, results):
    result = results[block.id]
    assert result.ok, "%s (line %d) failed:\n%s\n%s" % (block.id, block.line, result.stdout,
                                                       result.error)


def _anchors(text):
    """GitHub's anchors of a page's headings."""
    found, seen, inside = set(), {}, False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        heading = not inside and re.match(r"^#{1,6} (.*)$", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else "%s-%d" % (anchor, count))
    return found


#: Pages that another branch of issue 31 writes (the port command's).
PENDING = set()


def test_links_resolve_to_files_and_headings():
    broken, checked = [], 0
    for page in pages():
        with open(os.path.join(REPO, page)) as handle:
            prose = re.sub(r"```.*?```", "", handle.read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"\w+:", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            checked += 1
            if full.replace(os.sep, "/") in PENDING:
                continue
            if not os.path.exists(os.path.join(REPO, full)):
                broken.append("%s: %s (no such file)" % (page, target))
            elif anchor and full.endswith(".md"):
                with open(os.path.join(REPO, full)) as handle:
                    if anchor not in _anchors(handle.read()):
                        broken.append("%s: %s (no such heading)" % (page, target))
    assert checked > 50 and broken == []
