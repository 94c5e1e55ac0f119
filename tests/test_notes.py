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
