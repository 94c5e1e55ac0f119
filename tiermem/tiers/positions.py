"""Which ops a step of a named policy records: in full, those whose records the
recipes of the last fully tracked forward used; by name, those that made its
other candidates; no others (NOTE [Records learned by position])."""

# NOTE [Records learned by position]
# A recipe uses few records (those of its own ops), and a forward like the last
# one builds its recipes from the ops at the same positions (the n-th op the mode
# saw). So after a *learning* step of a named policy (every op recorded), the
# *following* steps record in full only the positions its recipes used, by name
# those that made its other candidates (a remembered refusal's key holds the op
# name), and no others. Exact either way: a record is full or absent. The choice:
# 1. each recorded position's op must match (name, argument signature); from the
#    first that differs, the mode records every op as a learning step does;
# 2. while it follows, a candidate without a full record that no remembered
#    refusal answers gets one due for planning, else NOT_RECORDED (not kept);
# 3. after 1 or 2, a failed forward, or one of another length, the next step
#    learns, and at most MAX_AGE - 1 steps follow in a row (so refusals are
#    planned again, in a learning step, when due).

from __future__ import annotations

from typing import Optional

from .refusals import MAX_AGE

__all__ = ["RecordPositions", "MAX_FOLLOWING", "NOT_RECORDED"]

#: Following steps in a row before a learning step (rule 3).
MAX_FOLLOWING = MAX_AGE - 1

#: The refusal of rule 2.
NOT_RECORDED = ("its op was not recorded in full (the forward differs from the one whose "
                "recipes chose the ops to record; the next step records them all)")


class RecordPositions:
    """The learned positions of one Offloader's recompute tier (its steps'
    forwards run one at a time, in one thread).

    A step that may follow (a named policy tracking the whole forward:
    ``ProducerMode.follows``) calls :meth:`begin` as it starts and :meth:`end` when its forward is over; in
    between, the tier calls :meth:`candidate` for each tensor it is offered
    and :meth:`used` for each recipe it builds (a learning step), and
    :meth:`missed` for rule 2 (a following step)."""

    __slots__ = ("_learned", "_ops", "_following_left", "_full", "_named", "_active",
                 "_following", "_missed", "enabled")

    def __init__(self) -> None:
        #: Learned: position -> (op name, its arguments' signature, in full).
        self._learned: Optional[dict] = None
        self._ops = 0                # ops the learning forward ran
        self._following_left = 0
        self._full: dict = {}        # this learning step's recipes: position -> op name
        self._named: dict = {}       # its candidates' producers: the same
        self._active = False
        self._following = False
        self._missed = False
        #: Off: every step learns (tiermem.testing.follow_learned_positions).
        self.enabled = True

    def begin(self, mode) -> None:
        """A step starts with producer mode ``mode``: set what it records
        (``learned``, or ``shapes`` to learn: see ProducerMode)."""
        self._active = True
        self._full, self._named = {}, {}
        self._missed = False
        self._following = (self.enabled and self._learned is not None
                           and self._following_left > 0)
        if self._following:
            self._following_left -= 1
            mode.learned = self._learned
        else:
            mode.shapes = {}

    @property
    def learning(self) -> bool:
        """Whether a learning step is under way."""
        return self._active and not self._following

    @property
    def following(self) -> bool:
        """Whether a following step is under way."""
        return self._active and self._following

    def candidate(self, rec) -> None:
        """The tier is offered a tensor made by ``rec`` (``None``: unrecorded)."""
        if rec is not None and rec.position >= 0:
            self._named[rec.position] = rec.name

    def used(self, ops) -> None:
        """A recipe was built from ``ops`` (``(module, name, call, Record)`` each)."""
        if self.learning:
            full = self._full
            for _, name, _, rec in ops:
                if rec.position >= 0:
                    full[rec.position] = name

    def missed(self) -> None:
        """Rule 2: the next step learns."""
        self._missed = True

    def end(self, mode, failed: bool) -> None:
        """The step's forward is over (``mode``: its producer mode)."""
        if not self._active:
            return
        self._active = False
        if failed:
            self._learned = None
        elif not self._following:
            shapes = mode.shapes or {}
            learned = {p: (name, shapes.get(p), False) for p, name in self._named.items()}
            for p, name in self._full.items():
                learned[p] = (name, shapes.get(p), True)
            self._learned, self._ops = learned, mode.position
            self._following_left = MAX_FOLLOWING
        elif self._missed or mode.diverged or mode.position != self._ops:
            self._following_left = 0
        self._full, self._named = {}, {}
