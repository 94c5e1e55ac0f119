"""Backward-order prefetch within a byte budget.

Backward consumes saved tensors in roughly the reverse of their packing order.
Each unpack of a moved tensor advances a cursor backwards through the packing
order and starts restores ahead of need until ``budget_bytes`` are restored but
not yet consumed. :meth:`Prefetcher.kick` starts the cursor from the top when
backward unpacks a kept tensor before any moved one (NOTE [Restores start with
backward] in runtime/hooks.py). An unpack that goes *up* in packing order, or
lands at or below the cursor, restarts the cursor just below it: prefetch
follows whatever backward does. A handle whose move out has not landed yet
stops the cursor (retried at the next unpack, not skipped).

A *pass* is one backward over the step's graph. Per handle, an :class:`Entry`
(written by the prefetcher alone) holds the pass that last consumed it
(``gen``) and how many of its saves took it (``taken`` of ``uses``); a handle
consumed more often than saved starts a new pass (``retain_graph=True``).

Calls run one way: the unpack hook calls :meth:`Prefetcher.begin_use`, the
handle's tier, then :meth:`Prefetcher.advance`, which asks tiers to start
restores. Nothing calls the prefetcher from a tier or a finalizer: a restore
whose handle dies unconsumed is noticed through a weak reference whose callback
only appends to a deque, drained at the next ``advance`` (O(1) per handle).

The window: ``budget_bytes`` when set (``TIERMEM_PREFETCH_BYTES``); unset, a
quarter of what the step moved, between :data:`AUTO_MIN_BYTES` and
:data:`AUTO_MAX_BYTES`: a window as large as everything moved would restore it
all at backward's start and give back the memory offloading saved.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Optional

__all__ = ["Prefetcher", "Entry", "AUTO_MIN_BYTES", "AUTO_MAX_BYTES", "auto_window_bytes",
           "HELD", "fill_window", "cursor_after_use"]

AUTO_MIN_BYTES = 16 << 20
AUTO_MAX_BYTES = 256 << 20


#: What ``store.prefetch(handle)`` answers for a tensor still in memory, held
#: for its unpack (NOTE [Tail hold] in runtime/tailhold.py): no restore to start, but
#: counted in the window until taken, like a restore in flight (not in
#: ``stats.prefetched_bytes``).
HELD = 2


def auto_window_bytes(moved_bytes: int) -> int:
    """The default prefetch window for a step that moved ``moved_bytes``."""
    return min(AUTO_MAX_BYTES, max(AUTO_MIN_BYTES, moved_bytes // 4))


def cursor_after_use(pos: int, last_pos: int, cursor: int) -> int:
    """The cursor after the moved tensor at packing position ``pos`` is
    unpacked (``last_pos``: the previous such unpack's): just below it when
    it went up in packing order or landed at or below the cursor, else
    unchanged (module docstring). The planner's timeline (planner/timeline.py)
    walks the same rules."""
    return pos - 1 if pos > last_pos or pos <= cursor else cursor


def fill_window(cursor: int, inflight_bytes: int, window_bytes: int, start) -> tuple:
    """Top the window up from ``cursor`` down, while ``inflight_bytes`` are
    below ``window_bytes``: ``start(pos)`` starts the restore at packing
    position ``pos`` and answers the bytes it adds to the window (0: none to
    count), or None: its move out has not landed, and the walk stops there
    (retried at the next unpack). Returns ``(cursor, inflight_bytes)``. The
    one implementation of the window, for :class:`Prefetcher` and for the
    planner's timeline."""
    while cursor >= 0 and inflight_bytes < window_bytes:
        added = start(cursor)
        if added is None:
            break
        inflight_bytes += added
        cursor -= 1
    return cursor, inflight_bytes


class Entry(weakref.ref):
    """The prefetcher's record of one handle, and a weak reference to it
    (``entry()``); written by the prefetcher only.

    ``pos``: packing order among the handles it may prefetch (``None``: never
    prefetched, e.g. a recompute handle, counted for its uses only). A
    prefetchable entry's callback queues it when its handle dies, so that a
    restore in flight for it is given back to the window (module docstring).
    """

    __slots__ = ("pos", "nbytes", "gen", "taken", "uses", "inflight")

    def __new__(cls, handle, callback, pos: Optional[int], nbytes: int):
        return super().__new__(cls, handle, callback)

    def __init__(self, handle, callback, pos: Optional[int], nbytes: int) -> None:
        super().__init__(handle, callback)
        self.pos = pos
        self.nbytes = nbytes
        self.gen = -1
        self.taken = 0
        self.uses = 1        # saves of this tensor in the step (dedup hits add one)
        self.inflight = False


class Prefetcher:
    """Prefetch state of one step. A prefetched handle provides ``nbytes`` and
    ``store.prefetch(handle)`` (``True``: restore started, ``False``: none
    needed, ``None``: not ready, :data:`HELD`: in memory, held for its unpack)."""

    def __init__(self, budget_bytes, moved_bytes=None, stats=None) -> None:
        #: ``None`` until backward starts when unset (see the module docstring).
        self.budget_bytes = budget_bytes
        self._moved_bytes = moved_bytes
        self._stats = stats
        self.inflight_bytes = 0
        # Entries whose handles died (appended by their weakref callbacks,
        # drained by advance).
        self._dead: collections.deque = collections.deque()
        self._order: list = []
        self._cursor = -1
        self._last_pos = -1
        self.gen = 0
        # Re-entrant: a recipe run by one unpack unpacks its inputs.
        self.lock = threading.RLock()

    def add(self, handle, nbytes: int, prefetchable: bool = True) -> Entry:
        """Register ``handle`` (forward thread), in packing order when it may be
        prefetched; returns its entry, which the handle carries for its unpacks."""
        if not prefetchable:
            return Entry(handle, None, None, nbytes)
        entry = Entry(handle, self._dead.append, len(self._order), nbytes)
        self._order.append(entry)
        return entry

    @property
    def scheduled(self) -> int:
        """How many handles of this step may be prefetched so far (tensors
        moved): the packing position of the next one."""
        return len(self._order)

    @property
    def started(self) -> bool:
        """Whether restores have started: a kick, or a moved tensor's unpack
        (read without the lock: :meth:`kick` checks again under it)."""
        return self._last_pos >= 0

    @staticmethod
    def share(entry: Entry) -> None:
        """One more save of the same tensor in this step (a dedup hit)."""
        entry.uses += 1

    def begin_use(self, entry: Entry) -> int:
        """Count one use of the entry's handle in this pass (under ``lock``);
        returns how many uses of it this pass still has to come (a tier keeps
        its restore for them)."""
        if entry.gen == self.gen and entry.taken >= entry.uses:
            self.gen += 1
        if entry.gen != self.gen:
            entry.gen = self.gen
            entry.taken = 0
        entry.taken += 1
        if entry.inflight:        # its prefetched restore is taken now
            entry.inflight = False
            self.inflight_bytes -= entry.nbytes
        return entry.uses - entry.taken

    def _forget_dead(self) -> None:
        """Give back the window bytes of restores dropped with their handle."""
        dead = self._dead
        while dead:
            entry = dead.popleft()
            if entry.inflight:
                entry.inflight = False
                self.inflight_bytes -= entry.nbytes

    def advance(self, entry: Entry) -> None:
        """Called (under ``lock``) when the entry's handle is unpacked: top the window up."""
        pos = entry.pos
        if pos is None:
            return
        if self.budget_bytes is None:
            moved = self._moved_bytes() if self._moved_bytes is not None else 0
            self.budget_bytes = auto_window_bytes(moved)
        if self._dead:
            self._forget_dead()
        self._cursor = cursor_after_use(pos, self._last_pos, self._cursor)
        self._last_pos = pos
        self._fill()

    def kick(self, top: Optional[int] = None) -> None:
        """Backward has started (under ``lock``): start restores from the top of
        the packing order, the last packed moved tensor down (or from the
        moved tensors packed before position ``top`` down), within the window,
        as an unpack just above them would (NOTE [Restores start with backward]
        in runtime/hooks.py). Called from a kept tensor's unpack; does nothing once
        restores have started (a kick, or a moved tensor's unpack)."""
        if self.budget_bytes is None:
            moved = self._moved_bytes() if self._moved_bytes is not None else 0
            self.budget_bytes = auto_window_bytes(moved)
        if self._dead:
            self._forget_dead()
        if self._last_pos < 0:   # no moved tensor unpacked yet: else advance leads
            if top is None:
                top = len(self._order)
            self._cursor = top - 1
            self._last_pos = top
            self._fill()

    def _fill(self) -> None:
        """Top the window up from the cursor down (:func:`fill_window`)."""
        self._cursor, self.inflight_bytes = fill_window(
            self._cursor, self.inflight_bytes, self.budget_bytes, self._start)

    def _start(self, pos: int) -> Optional[int]:
        """Start the restore of the handle at packing position ``pos``: the
        bytes it adds to the window, or None (not ready: see :func:`fill_window`)."""
        e = self._order[pos]
        h = e()
        if h is None or e.gen == self.gen:   # dead, or consumed in this pass already
            return 0
        started = h.store.prefetch(h)
        if started is None:
            return None   # its move out has not landed yet: retry at the next unpack
        if not started:
            return 0
        e.inflight = True
        if self._stats is not None and started is True:
            self._stats.prefetched_bytes += e.nbytes
        return e.nbytes
