"""The tail hold: the sources of the last moved tensors stay in memory for
backward's first unpacks (NOTE [Tail hold])."""

# NOTE [Tail hold]
# Invariant: from the forward to backward's first unpacks, memory is higher by at
# most ``W`` bytes (``tail_hold_bytes``; unset: the prefetch window) than without
# the hold, and every unpack returns the values saved at pack time. Why:
# 1. Moves of the step whose backward is next (NOTE [Backward order] in runtime/
#    schedule.py) enter the tail in packing order; one pushing it past ``W`` releases
#    the oldest sources (counted as whole storages); a tensor over ``W`` is not held.
# 2. The handle keeps a second reference to its source: only the free is delayed.
# 3. An unpack of a held, unmodified source returns it (no read); a source changed
#    in place is released and the copy, holding the pack-time values, is restored.
# 4. The prefetcher counts a held source as in flight until taken.
# 5. Released when taken, pushed out, at the end of the backward, when its handle
#    dies, when the forward raises and at ``close()``: nothing outlives the handle.
# 6. Not under an auto plan, nor when parameters may be freed (FSDP2). 7. CUDA: the
#    store's reference already orders the free after the copy (no record_stream).

from __future__ import annotations

import collections
import threading
import weakref

__all__ = ["TailHold"]


class TailHold:
    """The tail of an Offloader's moves whose sources stay held (NOTE [Tail
    hold]). ``add`` runs on the forward thread; ``release_step`` and
    ``release_all`` on any thread (never from a finalizer: they take a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (weak ref to handle, bytes counted), in packing order; their sum:
        self._tail: collections.deque = collections.deque()
        self._bytes = 0

    @property
    def window_bytes(self) -> int:
        """Bytes of the moves in the tail now: an upper bound on the bytes
        held (entries released are forgotten from the oldest on, at ``add``)."""
        return self._bytes

    def add(self, handle, nbytes: int, limit_bytes: int) -> bool:
        """``handle`` (a moved tensor's, its source in ``handle.src``) was
        packed; ``nbytes``: the memory its source holds. Push out what falls
        outside the last ``limit_bytes``; return whether ``handle`` is held
        (its store then holds its source)."""
        pushed = []
        with self._lock:
            tail = self._tail
            while tail:   # released (taken, its step's backward over) or dead: forgotten
                h = tail[0][0]()
                if h is not None and h.tail is not None:
                    break
                self._bytes -= tail.popleft()[1]
            held = 0 < nbytes <= limit_bytes
            if held:
                tail.append((weakref.ref(handle), nbytes))
                self._bytes += nbytes
            else:
                limit_bytes = 0
            while tail and self._bytes > limit_bytes:
                ref, n = tail.popleft()
                self._bytes -= n
                pushed.append(ref)
        for ref in pushed:
            h = ref()
            if h is not None:
                h.store.release_source(h)
        return held

    def held_bytes(self) -> int:
        """Bytes of the sources held now (the tests' check of the bound)."""
        with self._lock:
            refs = list(self._tail)
        total = 0
        for ref, n in refs:
            h = ref()
            if h is not None and h.tail is not None:
                total += n
        return total

    def release_step(self, step) -> None:
        """Release every source held for ``step``'s handles."""
        with self._lock:
            refs = [ref for ref, _ in self._tail]
        for ref in refs:
            h = ref()
            if h is not None and h.step is step:
                h.store.release_source(h)

    def release_all(self) -> None:
        """Release every source held, and forget the tail."""
        with self._lock:
            refs = [ref for ref, _ in self._tail]
            self._tail.clear()
            self._bytes = 0
        for ref in refs:
            h = ref()
            if h is not None:
                h.store.release_source(h)
