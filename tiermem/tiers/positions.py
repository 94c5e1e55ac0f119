"""Which ops a step of a named policy records: in full, those whose records the
recipes of the last fully tracked forward used; by name, those that made its
other candidates; no others (NOTE [Records learned by position])."""

# NOTE [Records learned by position]
# A forward like an earlier one of its kind builds its recipes from the ops at
# the same positions (the n-th op the mode saw). So after a *learning* step of a
# named policy with recompute first (every op recorded; a tier before it would
# make the candidates depend on its state), the *following* steps of that kind
# record in full only the positions its recipes used, by name those that made
# its other candidates (a refusal's key holds the op name), no others. Exact: a
# record is full or absent.
# 1. each op must be the learned one, and at a recorded position have the same
#    argument signature; from the first that differs the mode records every op;
# 2. while it follows, a candidate without a full record that no remembered
#    refusal answers gets one due for planning, else NO_PRODUCER or NOT_RECORDED;
# 3. the kind learns next after a failed forward, a learning step with nothing to
#    learn, or (if it had candidates) 1, 2, another length or MAX_AGE - 1 following;
# 4. a kind is the first op with its signature; the last MAX_KINDS with candidates.

from __future__ import annotations

from .refusals import MAX_AGE, MAX_KINDS, Kinds

__all__ = ["RecordPositions", "MAX_FOLLOWING", "MAX_KINDS", "NO_PRODUCER", "NOT_RECORDED"]

#: Following steps of one kind in a row before a learning step (rule 3).
MAX_FOLLOWING = MAX_AGE - 1

#: The refusals of rule 2 (the first is the tier's own for a tensor without a record).
NO_PRODUCER = "no recorded producer"
NOT_RECORDED = ("its op was not recorded in full (the forward differs from the one whose "
                "recipes chose the ops to record; the next step records them all)")


class RecordPositions:
    """The learned positions of one Offloader's recompute tier, per kind of
    forward (its steps' forwards run one at a time, in one thread).

    A step that may follow (``ProducerMode.follows``: a named policy with
    recompute first, tracking the whole forward) calls :meth:`begin` as it
    starts and :meth:`end` when its forward is over; its mode calls
    :meth:`choose` at its first op, whose kind says which positions it
    follows, if any. In between, the tier calls :meth:`candidate` for each
    tensor it is offered and :meth:`used` for each recipe it builds (a
    learning step), and :meth:`missed` for rule 2 (a following step)."""

    __slots__ = ("kinds", "_kind", "_full", "_named", "_active", "_following",
                 "_missed", "_offered", "enabled")

    def __init__(self, kinds: Kinds) -> None:
        #: Per kind, shared with the tier's refusals: ``learned`` (each position's
        #: op, position -> (arguments' signature, in full)) or ``None``, and the
        #: steps that may still follow it.
        self.kinds = kinds
        self._kind = None            # this step's kind's entry, if kept, once its first op ran
        self._full: dict = {}        # this learning step's recipes: position -> op name
        self._named: dict = {}       # its candidates' producers: the same
        self._active = False
        self._following = False
        self._missed = False
        self._offered = False        # the tier was offered a tensor in this step
        #: Off: every step learns (tiermem.testing.follow_learned_positions).
        self.enabled = True

    def begin(self, mode) -> None:
        """A step starts with producer mode ``mode``: it learns (``mode.learning``)
        until its first op says otherwise (:meth:`choose`)."""
        self._active = True
        self._full, self._named = {}, {}
        self._missed = self._offered = self._following = False
        self._kind = None
        mode.learning = []
        mode.chooser = self

    def choose(self, mode) -> None:
        """``mode``'s first op ran (``mode.kind`` is set): it follows the
        positions learned for its kind (``mode.learned``), if any are due."""
        entry = self._kind = self.kinds.get(mode.kind)   # made at its first candidate
        if (self.enabled and entry is not None and entry.learned is not None
                and entry.following_left > 0):
            entry.following_left -= 1
            self._following = True
            mode.learning = None
            mode.learned = entry.learned

    @property
    def active(self) -> bool:
        """Whether a step that may follow is under way (begun, not ended)."""
        return self._active

    @property
    def learning(self) -> bool:
        """Whether a learning step is under way."""
        return self._active and not self._following

    @property
    def following(self) -> bool:
        """Whether a following step is under way (known from its first op)."""
        return self._active and self._following

    def candidate(self, rec) -> None:
        """The tier is offered a tensor made by ``rec`` (``None``: unrecorded)."""
        self._offered = True
        if rec is not None and rec.position >= 0 and not self._following:
            self._named[rec.position] = rec.name

    def used(self, ops) -> None:
        """A recipe was built from ``ops`` (``(module, name, call, Record)`` each)."""
        if self.learning:
            full = self._full
            for _, name, _, rec in ops:
                if rec.position >= 0:
                    full[rec.position] = name

    def missed(self) -> None:
        """Rule 2: the next step of this kind learns."""
        self._missed = True

    def end(self, mode, failed: bool) -> None:
        """The step's forward is over (``mode``: its producer mode)."""
        if not self._active:
            return
        self._active = False
        mode.chooser = None
        entry, self._kind = self._kind, None
        if mode.kind is None:
            pass   # no op ran: nothing learned, nothing followed
        elif failed:
            if entry is not None:
                entry.learned = None
        elif not self._offered:   # no candidate: nothing planned or aged (rule 3)
            if self._following:
                entry.following_left += 1
        elif not self._following:
            entry = self.kinds.seen(mode.kind)   # made by the refusals, or here
            seen = mode.learning or []
            marks = {p: (seen[p][1], p in self._full)
                     for p in set(self._named) | set(self._full)}
            # Nothing to learn from (no candidate with a record): learn again.
            entry.learned = ([info for info, _ in seen], marks) if marks else None
            entry.following_left = MAX_FOLLOWING
        elif self._missed or mode.diverged or mode.position != len(entry.learned[0]):
            entry.following_left = 0
        self._full, self._named = {}, {}
