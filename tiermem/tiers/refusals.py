"""The recompute tier's refusals, remembered from one forward to the next
(NOTE [Refusals remembered])."""

# NOTE [Refusals remembered]
# Planning a recipe only to refuse it (no recorded producer, an input freed, inputs
# as large as the tensor, a chain too deep) is most of the recompute tier's pack
# time, and a forward like the last one of its kind (NOTE [Records learned by
# position], 4) refuses the same tensors for the same reasons. So a refusal is
# kept under its key (its position among the forward's candidates, the ops run
# before its pack, op name, bytes, module), and the next forward of that kind
# refuses the key with the same reason without planning; a key answered so
# MAX_AGE times in a row is planned again (a refusal for a passing reason does
# not stick). Exact either way: a refused tensor goes to its order's next tier.
# Another forward (other shapes, ops or modules) has other keys and is planned.
# MUST_RECOMPUTE is always planned (it must raise with the reason of now).

from __future__ import annotations

import weakref
from typing import Any, Optional

__all__ = ["Refusals", "Kinds", "MAX_AGE", "MAX_KINDS"]

#: Forwards of its kind in a row a remembered refusal is answered before it is
#: planned again.
MAX_AGE = 8

#: Kinds of forward the recompute tier keeps what it learned of (the least
#: recently seen dropped first).
MAX_KINDS = 8


class _Kind:
    """What the recompute tier keeps of one kind of forward: its learned
    positions (``learned``: see RecordPositions), the steps that may still
    follow them, and the refusals of its last forward (key -> (reason, age))."""

    __slots__ = ("learned", "following_left", "refusals")

    def __init__(self) -> None:
        self.learned: Optional[tuple] = None
        self.following_left = 0
        self.refusals: dict = {}


class Kinds:
    """The last MAX_KINDS kinds of forward (``ProducerMode.kind``) whose
    tensors one recompute tier was offered, shared by its refusals and its
    learned positions, so that both keep the same kinds."""

    __slots__ = ("_kinds",)

    def __init__(self) -> None:
        self._kinds: dict = {}   # kind -> _Kind, least recently seen first

    def seen(self, kind: Any) -> _Kind:
        """The entry of ``kind``, made if new, now the most recently seen."""
        kinds = self._kinds
        entry = kinds.pop(kind, None)
        if entry is None:
            entry = _Kind()
            while len(kinds) >= MAX_KINDS:
                del kinds[next(iter(kinds))]
        kinds[kind] = entry
        return entry

    def get(self, kind: Any) -> Optional[_Kind]:
        """The entry of ``kind`` if kept, left where it is in the order."""
        return self._kinds.get(kind)

    def __len__(self) -> int:
        return len(self._kinds)


class Refusals:
    """The refusals of the last forward of each kind and of this one (one
    Offloader, one thread: its steps' forwards run one at a time)."""

    __slots__ = ("_step", "_position", "_entry", "_before", "_now", "kinds")

    def __init__(self, kinds: Kinds) -> None:
        self._step: Optional[weakref.ref] = None   # the step whose forward counts now
        self._position = 0
        self._entry: Optional[_Kind] = None   # its kind's, once known
        self._before: dict = {}   # key -> (reason, age) from the last forward of its kind
        self._now: dict = {}      # the same, this forward
        self.kinds = kinds

    def key(self, step: Any, kind: Any, op: Optional[str], nbytes: int, module: str,
            ops_before: int) -> tuple:
        """The key of the next candidate of ``step``'s forward (counted in
        order); ``kind``: the forward's (``ProducerMode.kind``: ``None`` until
        its first tracked op, or if untracked); ``ops_before``: the ops its
        producer mode saw before this pack (an unrecorded tensor saved at
        another point is another candidate)."""
        if self._step is None or self._step() is not step:
            if self._entry is not None:
                self._entry.refusals = self._now   # the last forward's
            self._step, self._position, self._now = weakref.ref(step), 0, {}
            self._entry = None
            self._before = {}
        if kind is not None and self._entry is None:
            # Kind None (saved before the first tracked op: a compiled part, say;
            # such a tensor has no record, refused at once) remembers nothing.
            self._entry = self.kinds.seen(kind)
            self._before = self._entry.refusals
            self._position = 0   # its keys: ops_before >= 1, unlike those before it
        position = self._position
        self._position = position + 1
        return (position, ops_before, op, nbytes, module)

    def known(self, key: tuple, due_too: bool = False) -> Optional[str]:
        """The reason the last forward refused ``key`` for, if it is to be
        answered without planning (``None``: plan it); ``due_too``: also one
        due to be planned again (a step that cannot plan it: NOTE [Records
        learned by position] in tiers/positions.py)."""
        hit = self._before.get(key)
        if hit is None or (hit[1] >= MAX_AGE and not due_too):
            return None
        self._now[key] = (hit[0], hit[1] + 1)
        return hit[0]

    def refused(self, key: tuple, reason: str) -> None:
        """``key`` was planned and refused for ``reason``."""
        self._now[key] = (reason, 1)

    def planned(self) -> int:
        """Keys of this forward refused after planning (for tests)."""
        return sum(1 for _, age in self._now.values() if age == 1)
