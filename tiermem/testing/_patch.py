"""``patched``: set an attribute for the duration of a ``with`` block."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

_MISSING = object()


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``owner.name`` to ``value`` while inside, then put back exactly what
    was there (an attribute ``owner`` only inherited is deleted again)."""
    before = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    setattr(owner, name, value)
    try:
        yield
    finally:
        if before is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, before)
