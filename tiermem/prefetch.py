"""Backward-order prefetch within a byte budget.

Backward consumes saved tensors in roughly the reverse of their packing order.
Each unpack of a moved tensor advances a cursor backwards through the packing
order and starts restores ahead of need until ``budget_bytes`` are restored but
not yet consumed. A restore is "consumed" when its handle's ``get`` takes it,
and given back if the handle dies first.

If an unpack goes *up* in packing order (a second backward with
``retain_graph=True``, or one node unpacking its tensors in packing order), or
lands at or below the cursor, the cursor restarts just below it: prefetch
follows whatever backward does. Handles already on their way, or already
consumed in this pass, are skipped cheaply.

A *pass* is one backward over the step's graph. Each handle records the pass
that last consumed it (``handle.gen``) and how many of its consumers took it
in that pass (``taken``, out of ``uses``: the saves of that tensor, dedup
included); a handle consumed more often than it was saved starts a new pass
(``retain_graph=True``): everything becomes eligible again.

The window: ``budget_bytes`` when set (``TIERMEM_PREFETCH_BYTES``); unset, it
is sized when backward starts from what the step moved: a quarter of it,
between :data:`AUTO_MIN_BYTES` and :data:`AUTO_MAX_BYTES`. A fixed window as
large as everything moved would restore it all at the start of backward and
give back the memory offloading saved (measured on a 4-layer GPT on the CPU:
a 256 MiB window over 131 MiB moved left peak RSS where it was without
tiermem).

A handle whose move out has not landed yet stops the cursor: it is retried at
the next unpack rather than skipped (skipping it would make it a miss later,
while the window fills with tensors needed last).
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["Prefetcher", "AUTO_MIN_BYTES", "AUTO_MAX_BYTES", "auto_window_bytes"]

AUTO_MIN_BYTES = 16 << 20
AUTO_MAX_BYTES = 256 << 20


def auto_window_bytes(moved_bytes: int) -> int:
    """The default prefetch window for a step that moved ``moved_bytes``."""
    return min(AUTO_MAX_BYTES, max(AUTO_MIN_BYTES, moved_bytes // 4))


class Prefetcher:
    """Prefetch state of one step. Handles must provide ``order_pos``,
    ``nbytes``, ``gen``, ``taken``, ``uses`` and ``store.prefetch(handle)``
    (``True``: restore started, ``False``: none needed, ``None``: not ready)."""

    def __init__(self, budget_bytes, moved_bytes=None) -> None:
        #: ``None`` until backward starts when unset (see the module docstring).
        self.budget_bytes = budget_bytes
        self._moved_bytes = moved_bytes
        self.inflight_bytes = 0
        self._order: list = []
        self._cursor = -1
        self._last_pos = -1
        self.gen = 0
        self.lock = threading.RLock()  # RLock: a handle may die (and call consumed) under it

    def add(self, handle) -> None:
        """Register a handle in packing order (forward thread)."""
        handle.order_pos = len(self._order)
        self._order.append(weakref.ref(handle))

    def begin_get(self, handle) -> None:
        """Called (under ``lock``) when ``handle`` is about to be consumed: counts
        its consumers in this pass (``taken``, out of ``uses`` saves)."""
        if handle.gen == self.gen and handle.taken >= handle.uses:
            self.gen += 1
        if handle.gen != self.gen:
            handle.gen = self.gen
            handle.taken = 0
        handle.taken += 1

    def advance(self, handle) -> None:
        """Called (under ``lock``) when ``handle`` is unpacked: top the window up."""
        if self.budget_bytes is None:
            moved = self._moved_bytes() if self._moved_bytes is not None else 0
            self.budget_bytes = auto_window_bytes(moved)
        pos = handle.order_pos
        if pos > self._last_pos or pos <= self._cursor:
            self._cursor = pos - 1
        self._last_pos = pos
        order = self._order
        while self._cursor >= 0 and self.inflight_bytes < self.budget_bytes:
            h = order[self._cursor]()
            started = None if h is None else h.store.prefetch(h)
            if h is not None and started is None:
                break   # its move out has not landed yet: retry at the next unpack
            self._cursor -= 1
            if started:
                self.inflight_bytes += h.nbytes

    def consumed(self, nbytes: int) -> None:
        """A prefetched restore was taken by ``get`` or dropped with its handle."""
        with self.lock:
            self.inflight_bytes -= nbytes
