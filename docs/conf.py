"""Sphinx configuration of tiermem's documentation site.

Build (what CI runs, warnings are errors)::

    python -m sphinx -W --keep-going -b html docs /tmp/tiermem-docs

Guide pages are Markdown (MyST); the API reference is generated from the
docstrings of ``tiermem.__all__`` (autodoc), and the settings table from
``tiermem.Config`` when the build starts (``_generated/``, not committed).
"""

import os
import re
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(DOCS))        # document this checkout's tiermem

import tiermem  # noqa: E402

project = "tiermem"
author = "the tiermem authors"
copyright = "2026, the tiermem authors"
release = tiermem.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_generated/*.md"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = f"tiermem {release}"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
# tiermem's docstrings are reST prose, not Google or NumPy sections: napoleon
# would read a line such as "``policy="auto"``: the plan ..." as a type.

# Docstrings serve readers of the code too, and there they may point at a
# note in the source (a note's name in brackets after NOTE, maybe "in" a file). The site
# never shows such a pointer: the forms below are dropped, and any other
# left in a docstring fails the build (a warning, and warnings are errors).
_PATH = r"(?::\w+:)?`?[\w/]+(?:\.\w+)*`?"
_POINTER = r"(?:see\s+)?NOTE\s+\[[^\]]+\](?:\s+in\s+" + _PATH + r")?(?:,\s+rule\s+\d+)?"
_DROP = [
    (re.compile(r"\s*\(" + _POINTER + r"\)", re.I), ""),                 # a pointer in parentheses
    (re.compile(r"\s*See\s+" + _POINTER + r"\.(?=\s|$)"), ""),          # a sentence "See" + pointer
    (re.compile(r"[;:,]\s*" + _POINTER + r"(?=[).;,])", re.I), ""),      # a pointer after ; : or ,
    (re.compile(r"\(" + _POINTER + r";\s*", re.I), "("),                  # a pointer opening parentheses
]
_INLINE = {
    # a pointer that is part of a sentence: the guide page that says the same
    "CheckpointPolicy answers": "the table under :doc:`checkpointing`",
}
_LEFT = re.compile(r"NOTE\s+\[([^\]]+)\](?:\s+in\s+" + _PATH + r")?")


def strip_note_pointers(text: str) -> str:
    """``text`` without pointers to notes in the source (see above)."""
    for pattern, repl in _DROP:
        text = pattern.sub(repl, text)
    return _LEFT.sub(lambda m: _INLINE.get(m.group(1), m.group(0)), text)


def _process_docstring(app, what, name, obj, options, lines):
    text = strip_note_pointers("\n".join(lines))
    if _LEFT.search(text):
        from sphinx.util import logging
        logging.getLogger(__name__).warning(
            "docstring of %s points at a note in the source: %s", name,
            _LEFT.search(text).group(0))
    lines[:] = text.split("\n")


def _write_generated(app):
    """Write the settings table from ``tiermem.Config`` (included by settings.md)."""
    out = os.path.join(DOCS, "_generated")
    os.makedirs(out, exist_ok=True)
    table = strip_note_pointers(tiermem.env_table_markdown())
    with open(os.path.join(out, "settings_table.md"), "w") as f:
        f.write(table + "\n")


def setup(app):
    app.connect("builder-inited", _write_generated)
    app.connect("autodoc-process-docstring", _process_docstring)
