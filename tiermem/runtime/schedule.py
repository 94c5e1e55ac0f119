"""The order in which an Offloader's steps run their backwards (NOTE
[Backward order]): which step's backward comes next, for the tail hold and
for the restores started when a backward ends, and how many steps are in
flight (forward over, backward not), for whoever plans their budgets."""

# NOTE [Backward order]
# Invariant: restores and the tail hold serve the step whose backward comes
# next, and the order only decides *when* a restore starts, never what it
# returns (exact whatever the real order). Why:
# 1. Steps enter in forward order, *pending* until the end of the first backward
#    pass that unpacked one of their handles (moved, dropped, kick, or the marker
#    of a first kept pack); *in flight* from the forward's end while the first
#    handle lives. Freed graphs, dead steps and forwards that raised drop out.
# 2. Next: the step named by ``Offloader.expect_backward`` while pending, else
#    the oldest pending step that has restores to make (FIFO: GPipe, 1F1B and
#    gradient accumulation run their backwards in forward order).
# 3. Only the next step's moves enter the tail hold (NOTE [Tail hold] in
#    runtime/tailhold.py); naming another step releases the others' sources.
# 4. When a backward ends, the next step whose forward is over is kicked
#    (``Prefetcher.kick``): its restores start within its own window.

from __future__ import annotations

import threading
import weakref
from typing import Any, List, Optional

from ..errors import ConfigError

__all__ = ["BackwardOrder"]


class BackwardOrder:
    """The pending steps of one Offloader in forward order (NOTE [Backward
    order]). ``tail``: the Offloader's :class:`~tiermem.runtime.tailhold.TailHold`.
    Methods run on the forward thread or at the end of a backward (autograd's
    callback); none from a finalizer."""

    def __init__(self, tail) -> None:
        self._lock = threading.Lock()
        self._tail = tail
        self._pending: List[weakref.ref] = []
        self._named: Optional[weakref.ref] = None
        self._count = 0
        #: The most steps in flight (forward over, backward not) seen at once.
        self.peak_in_flight = 0

    # -- entering and leaving ----------------------------------------------------------
    def add(self, step) -> int:
        """``step``'s forward begins: pending, last; returns its number (the
        Offloader's forwards counted from 0)."""
        with self._lock:
            self._pending.append(weakref.ref(step))
            self._count += 1
            return self._count - 1

    def forward_ended(self, step, failed: bool) -> None:
        """``step``'s forward is over (``failed``: it raised, dropped: rule 1)."""
        if failed:
            self._tail.release_step(step)
            self._remove(step)
            return
        live = self._live()
        gone = [s for s in live if s.forward_over and not s.in_flight]
        for s in gone:   # graph freed without a backward, or nothing saved
            self._remove(s)
        n = sum(1 for s in live if s.in_flight)
        if n > self.peak_in_flight:
            self.peak_in_flight = n

    def backward_over(self, step) -> None:
        """A backward pass that unpacked ``step``'s handles ended (autograd's
        callback): ``step`` is done; the next one's restores start (rule 4)."""
        self._remove(step)
        self._tail.release_step(step)
        nxt = self.next_step()
        if nxt is not None and nxt.forward_over:
            nxt.start_restores()

    def _remove(self, step) -> None:
        with self._lock:
            self._pending = [r for r in self._pending if r() is not None and r() is not step]
            if self._named is not None and self._named() is step:
                self._named = None

    def _live(self) -> List[Any]:
        with self._lock:
            steps = [r() for r in self._pending]
            if None in steps:
                self._pending = [r for r in self._pending if r() is not None]
        return [s for s in steps if s is not None]

    # -- which comes next --------------------------------------------------------------
    def next_step(self):
        """The step whose backward comes next (rule 2), or ``None``."""
        named = self._named() if self._named is not None else None
        if named is not None and named.in_flight:
            return named
        for s in self._live():
            if not s.forward_over or (s.has_restores and s.in_flight):
                return s
        return None

    def is_next(self, step) -> bool:
        """Whether ``step``'s backward comes next (its moves may be held)."""
        return self.next_step() is step

    def name_next(self, which, owner) -> None:
        """``Offloader.expect_backward``: see its contract. ``owner``: the
        Offloader (a context of another one is refused)."""
        live = [s for s in self._live() if s.in_flight]
        if isinstance(which, bool) or not isinstance(which, int):
            ctx_step = getattr(which, "step", None)
            if getattr(which, "_off", None) is not owner or ctx_step is None:
                raise ConfigError(
                    f"tiermem: expect_backward({which!r}): expected a context of this "
                    "Offloader (what 'with off as ctx' gives) or an int, the position "
                    "among the forwards whose backward has not run (0: the oldest, -1: "
                    "the latest)")
            if ctx_step not in live:
                raise ConfigError(
                    f"tiermem: expect_backward(ctx) for forward number {ctx_step.number}: "
                    "its backward has run already, its forward raised or has not ended; "
                    f"pending forwards: {[s.number for s in live]}")
            step = ctx_step
        else:
            if not -len(live) <= which < len(live):
                raise ConfigError(
                    f"tiermem: expect_backward({which}) is out of range: {len(live)} "
                    "forwards have not run their backward (use 0 for the oldest, -1 for "
                    "the latest)")
            step = live[which]
        with self._lock:
            self._named = weakref.ref(step)
        for other in live:   # rule 3
            if other is not step:
                self._tail.release_step(other)
        step.start_restores()
