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

__all__ = ["Refusals", "MAX_AGE", "MAX_KINDS"]

#: Forwards of its kind in a row a remembered refusal is answered before it is
#: planned again.
MAX_AGE = 8

#: Kinds of forward whose refusals are kept (the least recently seen dropped first).
MAX_KINDS = 8


class Refusals:
    """The refusals of the last forward of each kind and of this one (one
    Offloader, one thread: its steps' forwards run one at a time)."""

    __slots__ = ("_step", "_position", "_kind", "_before", "_now", "_kinds")

    def __init__(self) -> None:
        self._step: Optional[weakref.ref] = None   # the step whose forward counts now
        self._position = 0
        self._kind: Any = None    # its kind
        self._before: dict = {}   # key -> (reason, age) from the last forward of its kind
        self._now: dict = {}      # the same, this forward
        self._kinds: dict = {}    # kind -> its last forward's, least recently seen first

    def key(self, step: Any, kind: Any, op: Optional[str], nbytes: int, module: str,
            ops_before: int) -> tuple:
        """The key of the next candidate of ``step``'s forward (counted in
        order); ``kind``: the forward's (``ProducerMode.kind``, ``None`` if
        untracked); ``ops_before``: the ops its producer mode saw before this
        pack (an unrecorded tensor saved at another point is another candidate)."""
        if self._step is None or self._step() is not step:
            self._new_forward(step, kind)
        position = self._position
        self._position = position + 1
        return (position, ops_before, op, nbytes, module)

    def _new_forward(self, step: Any, kind: Any) -> None:
        kinds = self._kinds
        if self._step is not None:
            kinds.pop(self._kind, None)
            kinds[self._kind] = self._now   # the most recently seen last
            while len(kinds) > MAX_KINDS:
                del kinds[next(iter(kinds))]
        try:
            hash(kind)
        except TypeError:   # an argument's signature that cannot be hashed
            kind = (kind[0], None)
        self._step, self._kind, self._position = weakref.ref(step), kind, 0
        self._before, self._now = kinds.get(kind, {}), {}

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
