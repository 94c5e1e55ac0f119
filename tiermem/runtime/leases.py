"""Staging buffers lent to staged moves (NOTE [Staged moves] in tiers/moving.py)."""

from __future__ import annotations

import threading

import torch

from ..memory.hostpool import HostPool
from .jobs import AllDone

__all__ = ["StagingLease"]


class StagingLease:
    """A staging buffer lent to one staged move: given back to ``pool`` at
    :meth:`release` (once; counted in use until then), for reuse once the move
    (``job``, a :class:`~tiermem.runtime.jobs.StagedJob`) and every copy out of the
    buffer (:meth:`hold_until`) are done.

    ``release`` may run from a handle's finalizer: it takes only this class's
    own lock, around two assignments (nothing that allocates runs under it)."""

    __slots__ = ("pool", "buf", "pinned", "job", "events")
    _lock = threading.Lock()

    def __init__(self, pool: HostPool, buf: torch.Tensor, pinned: bool) -> None:
        self.pool, self.buf, self.pinned = pool, buf, pinned
        self.job = None      # the move (a StagedJob), set once it is submitted
        self.events: list = []

    def hold_until(self, event) -> None:
        """Not reused before ``event`` (a copy out of the buffer) has completed."""
        self.events[:] = [e for e in self.events if not e.query()]   # the list is shared
        self.events.append(event)

    def release(self) -> None:
        with StagingLease._lock:
            buf, self.buf = self.buf, None
        if buf is not None:
            staged = self.job
            if staged is not None:
                # The move's view of the buffer goes too: the pool may drop
                # the buffer (NOTE [Trimming pinned buffers] in memory/hostpool.py),
                # which must then free its memory.
                staged.host_view = None
            self.pool.release(buf, AllDone(staged, self.events), self.pinned)
