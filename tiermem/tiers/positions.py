"""Which ops a step of a named policy records: in full, those whose records the
recipes of the last fully tracked forward used; by name, those that made its
other candidates; no others (NOTE [Records learned by position])."""

# NOTE [Records learned by position]
# A forward like the last one builds its recipes from the ops at the same
# positions (the n-th op the mode saw). So after a *learning* step of a named
# policy with recompute first (every op recorded; a tier before it would make
# the candidates depend on its state), *following* steps record in full only the
# positions its recipes used, by name those that made its other candidates (a
# refusal's key holds the op name), no others. Exact: a record is full or absent.
# 1. each op must be the learned one, and at a recorded position have the same
#    argument signature; from the first that differs the mode records every op;
# 2. while it follows, a candidate without a full record that no remembered
#    refusal answers gets one due for planning, else NO_PRODUCER (no record:
#    inputs are saved before their op's check) or NOT_RECORDED (not kept);
# 3. after 1 or 2, a failed forward, one of another length or a learning step
#    without candidates, the next step learns; at most MAX_AGE - 1 steps follow
#    in a row (so refusals are planned again, in a learning step, when due).

from __future__ import annotations

from typing import Optional

from .refusals import MAX_AGE

__all__ = ["RecordPositions", "MAX_FOLLOWING", "NO_PRODUCER", "NOT_RECORDED"]

#: Following steps in a row before a learning step (rule 3).
MAX_FOLLOWING = MAX_AGE - 1

#: The refusals of rule 2 (the first is the tier's own for a tensor without a record).
NO_PRODUCER = "no recorded producer"
NOT_RECORDED = ("its op was not recorded in full (the forward differs from the one whose "
                "recipes chose the ops to record; the next step records them all)")


class RecordPositions:
    """The learned positions of one Offloader's recompute tier (its steps'
    forwards run one at a time, in one thread).

    A step that may follow (``ProducerMode.follows``: a named policy with
    recompute first, tracking the whole forward) calls :meth:`begin` as it
    starts and :meth:`end` when its forward is over; in between, the tier
    calls :meth:`candidate` for each tensor it is offered and :meth:`used` for
    each recipe it builds (a learning step), and :meth:`missed` for rule 2 (a
    following step)."""

    __slots__ = ("_learned", "_following_left", "_full", "_named", "_active",
                 "_following", "_missed", "enabled")

    def __init__(self) -> None:
        #: Learned: (each position's op, position -> (arguments' signature, in full)).
        self._learned: Optional[tuple] = None
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
        (``learned``, or ``learning`` to learn: see ProducerMode)."""
        self._active = True
        self._full, self._named = {}, {}
        self._missed = False
        self._following = (self.enabled and self._learned is not None
                           and self._following_left > 0)
        if self._following:
            self._following_left -= 1
            mode.learned = self._learned
        else:
            mode.learning = []

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
        if failed or (not self._following and not self._named):
            self._learned = None   # failed, or nothing to learn from (no candidate)
        elif not self._following:
            seen = mode.learning or []
            marks = {p: (seen[p][1], p in self._full)
                     for p in set(self._named) | set(self._full)}
            self._learned = ([info for info, _ in seen], marks)
            self._following_left = MAX_FOLLOWING
        elif self._missed or mode.diverged or mode.position != len(self._learned[0]):
            self._following_left = 0
        self._full, self._named = {}, {}
