"""Step signatures: a plan's keys, the shapes of a resized plan (any size of
a rank, NOTE [Plans across sizes] in planner/lifecycle.py), and the requests
of signatures that ask for a profile."""

from __future__ import annotations

from typing import Optional

from .plan import Plan

__all__ = ["Request", "Rank", "END", "rank_of", "numel", "is_resized"]

#: A :class:`Request`'s key when the step ended there (a shorter step).
END = "end of step"


class Request:
    """A signature asking for a profile (state "requested" of planner/lifecycle.py):
    a step followed plan ``keys`` up to tensor ``index`` and there saved
    ``key`` ((shape, dtype, device)) or ended (``END``)."""

    __slots__ = ("keys", "index", "key", "attempts")

    def __init__(self, keys: tuple, index: int, key) -> None:
        self.keys, self.index, self.key, self.attempts = keys, index, key, 0

    def agrees(self, index: int, key) -> bool:
        """Whether a step whose tensor ``index`` is ``key`` may still be this one."""
        if index < self.index:
            return self.keys[index] == key
        return index > self.index or self.key == key

    def ended_at(self, count: int) -> bool:
        """A step that agreed with it to its end, after ``count`` tensors, is it."""
        return count == self.index if self.key is END else count > self.index

    def matches(self, keys: tuple) -> bool:
        """The signature ``keys`` is this one."""
        n = self.index
        if len(keys) < n or keys[:n] != self.keys[:n]:
            return False
        return len(keys) == n if self.key is END else len(keys) > n and keys[n] == self.key

    def __repr__(self) -> str:
        return f"<request: left a plan at tensor {self.index} with {self.key}>"


class Rank:
    """Equal to any shape of ``n`` dimensions with at most ``max_numel``
    elements (``None``: any size). NOTE [Plans across sizes] in
    planner/lifecycle.py."""

    __slots__ = ("n", "max_numel")

    def __init__(self, n: int, max_numel: Optional[int]) -> None:
        self.n, self.max_numel = n, max_numel

    def __eq__(self, other) -> bool:
        try:
            if len(other) != self.n:
                return False
        except TypeError:
            return NotImplemented
        return self.max_numel is None or numel(other) <= self.max_numel

    def __ne__(self, other) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None

    def __repr__(self) -> str:
        most = "" if self.max_numel is None else f", at most {self.max_numel} elements"
        return f"<a shape of rank {self.n}{most}>"

def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def rank_of(shape) -> int:
    """The number of dimensions of ``shape`` (a shape or a :class:`Rank`)."""
    return shape.n if type(shape) is Rank else len(shape)


def is_resized(plan: Plan) -> bool:
    """A resized view of another plan (NOTE [Plans across sizes] in planner/lifecycle.py)."""
    return getattr(plan, "source", None) is not None
