"""Every ``NOTE [name]`` pointer in the repository resolves to one written note,
and a pointer that names a file ("NOTE [x] in tiers/moving.py") names the file
that holds it."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEF = re.compile(r"^\s*(?:#|//|\*)?\s*NOTE \[\s*([^\]]+?)\s*\]\s*$")
_REF = re.compile(r"NOTE \[\s*([^\]]+?)\s*\](?:\s+in\s+([\w/.]+\.(?:py|cpp|h)))?")


def _files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [f for f in out if f.endswith((".py", ".cpp", ".h", ".md", ".sh"))
            and os.path.exists(os.path.join(ROOT, f)) and f != "tests/test_notes.py"]


def test_every_note_pointer_resolves():
    defs, refs = {}, []
    for f in _files():
        with open(os.path.join(ROOT, f), errors="replace") as fh:
            for i, line in enumerate(fh, 1):
                m = _DEF.match(line)
                if m:
                    defs.setdefault(m.group(1), []).append(f)
                refs += [(f, i, m.group(1), m.group(2)) for m in _REF.finditer(line)]
    assert len(defs) >= 20, "the notes were not found: is the pattern still right?"
    bad = [f"{f}:{i}: NOTE [{name}]" + (f" in {where}" if where else "")
           for f, i, name, where in refs
           if name not in defs or (where and not any(d.endswith(where) for d in defs[name]))]
    assert not bad, "dangling note pointers:\n" + "\n".join(bad)


def test_a_note_is_written_once():
    defs = {}
    for f in _files():
        with open(os.path.join(ROOT, f), errors="replace") as fh:
            for line in fh:
                m = _DEF.match(line)
                if m:
                    defs.setdefault(m.group(1), []).append(f)
    twice = {name: where for name, where in defs.items() if len(where) > 1}
    assert not twice, twice


# -- length of a note --------------------------------------------------------------------

MAX_NOTE_LINES = 15

# Notes still over MAX_NOTE_LINES, in files being changed elsewhere at the time of
# writing. This list may only shrink: condense a note, then take it off.
LONG_NOTES: set = set()


def _note_lengths():
    """``{(path, name): lines}`` for every note written in tiermem/. A ``# NOTE [x]``
    note runs from that line to the last consecutive comment line (or to the next
    note); a bare ``NOTE [x]`` line in a docstring runs to the next blank line."""
    lengths = {}
    for f in _files():
        if not (f.startswith("tiermem/") and f.endswith(".py")):
            continue
        with open(os.path.join(ROOT, f), errors="replace") as fh:
            lines = fh.read().splitlines()
        for i, line in enumerate(lines):
            m = _DEF.match(line)
            if not m:
                continue
            comment = line.lstrip().startswith("#")
            j = i + 1
            while j < len(lines) and not _DEF.match(lines[j]) and (
                    lines[j].lstrip().startswith("#") if comment else lines[j].strip()):
                j += 1
            lengths[(f, m.group(1))] = j - i
    return lengths


def test_a_note_is_at_most_15_lines():
    lengths = _note_lengths()
    assert len(lengths) >= 20, "the notes were not found: is the pattern still right?"
    long = {key: n for key, n in lengths.items() if n > MAX_NOTE_LINES and key not in LONG_NOTES}
    assert not long, (f"notes over {MAX_NOTE_LINES} lines (state one invariant and why; "
                      f"measurements and history go to CHANGELOG.md): {long}")


def test_long_notes_allowlist_is_current():
    lengths = _note_lengths()
    gone = sorted(key for key in LONG_NOTES if key not in lengths)
    short = sorted(key for key in LONG_NOTES if lengths.get(key, 0) <= MAX_NOTE_LINES
                   and key in lengths)
    assert not gone, f"LONG_NOTES names notes that no longer exist: {gone}"
    assert not short, f"LONG_NOTES names notes now within {MAX_NOTE_LINES} lines: take them off: {short}"


# -- public docstrings -------------------------------------------------------------------

# Public docstrings that still point into the source, in files being changed elsewhere at
# the time of writing. This list may only shrink.
DOCSTRINGS_WITH_NOTES: set = set()


def _public_docstrings():
    """``{qualified name: docstring}`` of the names in ``tiermem.__all__`` and of the
    public methods and properties their classes define."""
    import inspect

    import tiermem

    docs = {}
    for name in tiermem.__all__:
        obj = getattr(tiermem, name)
        docs[name] = inspect.getdoc(obj) if callable(obj) else None
        if not inspect.isclass(obj):
            continue
        for attr, value in vars(obj).items():
            if attr.startswith("_"):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property) or inspect.isfunction(value):
                docs[f"{name}.{attr}"] = value.__doc__
    return docs


def test_public_docstrings_point_into_no_note():
    docs = _public_docstrings()
    bad = sorted(q for q, d in docs.items() if d and "NOTE [" in d
                 and q not in DOCSTRINGS_WITH_NOTES)
    assert not bad, f"public docstrings that point into the source (NOTE [...]): {bad}"


def test_docstrings_with_notes_allowlist_is_current():
    docs = _public_docstrings()
    stale = sorted(q for q in DOCSTRINGS_WITH_NOTES if not (docs.get(q) and "NOTE [" in docs[q]))
    assert not stale, f"DOCSTRINGS_WITH_NOTES names docstrings without a note pointer: {stale}"
