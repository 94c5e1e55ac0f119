"""The README is a short guide: at most 200 lines, no pointers into the source,
every relative link resolving, and its test command the one CI runs. (The strict
build of the documentation site runs in .ci/run, not here.)"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _relative_links(text):
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue                      # http:, mailto:, an anchor in the same page
        yield target.split("#", 1)[0]


def test_readme_is_at_most_200_lines():
    n = len(_read(README).splitlines())
    assert n <= 200, f"README.md has {n} lines; the guide keeps to 200 (details go to docs/)"


#: The opening of a note pointer (spelt in two parts so this file holds none).
_NOTE = "NOTE " + "["


def test_readme_has_no_note_pointers():
    assert _NOTE not in _read(README)


def test_docs_pages_have_no_note_pointers():
    pages = [p for p in os.listdir(DOCS) if p.endswith(".md")]
    assert pages, "no documentation pages found"
    bad = [p for p in pages if _NOTE in _read(os.path.join(DOCS, p))]
    assert not bad, f"pages pointing at notes in the source: {bad}"


def test_every_relative_link_in_readme_resolves():
    links = list(_relative_links(_read(README)))
    assert links, "no relative links found: is the pattern still right?"
    missing = [t for t in links if not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, f"README.md links to missing files: {missing}"


def test_readme_test_command_is_the_one_ci_runs():
    ci = _read(os.path.join(ROOT, ".ci", "run"))
    commands = [line.strip() for line in ci.splitlines()
                if line.strip().startswith("python -m pytest")]
    assert commands, ".ci/run runs no pytest command"
    readme = _read(README)
    assert any(c in readme for c in commands), (
        f"the README does not show the test command .ci/run runs: {commands}")
