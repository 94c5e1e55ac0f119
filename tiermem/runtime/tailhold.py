"""The tail hold: the sources of the last moved tensors stay in memory for
backward's first unpacks (NOTE [Tail hold]).

# NOTE [Tail hold]
# Backward starts with the tensors the forward saved last. Under a fixed or
# callable policy (a step that follows no plan) on a model whose loss is
# computed in the forward, backward's very first unpack is often a *moved*
# tensor (cross-entropy: NllLossBackward0 unpacks the log-softmax output, or,
# with recompute,nvme, its recipe unpacks the logits): nothing of the step's
# graph runs before it to start a restore (NOTE [Restores start with
# backward] in runtime/hooks.py, rule 5), so it was read on demand in almost every
# step, and on a GPU it is the model's largest tensor (batch x seq x vocab).
# The rules:
# 1. Which: an Offloader has one :class:`TailHold`. Each move out of a step
#    that follows no plan enters it in packing order, with its bytes; the
#    entries are the last moves whose bytes add up to at most ``W``
#    (``tail_hold_bytes``; unset: the step's prefetch window,
#    ``prefetch_bytes``, else ``auto_window_bytes`` of the bytes moved so
#    far; 0: off). A move that pushes an entry out of those ``W`` bytes
#    releases its source. A tensor larger than ``W`` alone is not held and
#    releases every entry. Several forwards before one backward share the
#    one tail: the last ``W`` bytes moved, whichever step moved them (with
#    1F1B's forward, forward, backward, the second forward's moves push the
#    first's out: the bound holds for the Offloader, not per step). Entries
#    released (rule 5) are forgotten from the oldest on, so that the bytes
#    counted stay those held.
# 2. What: an entry's handle keeps a second reference to its source
#    (``MovedHandle.tail``, the very ``h.src`` object), beside the store's
#    own, which the store drops as before (landing, the in-flight window,
#    staging: NOTE [Copy landed], [In-flight window], [Staged moves]). So the
#    move, its landing and the memory ordering of the copy are unchanged;
#    the held reference only delays the free. Bytes counted: the source's
#    storage if larger than the tensor (a view holds its whole storage), so
#    the memory held by the tail never exceeds ``W``.
# 3. Unpack: a held source whose version is unchanged is returned as it is
#    (or as a dense copy when its layout is compact, as an unlanded source
#    is: NOTE [Layout of a moved tensor]): the tensor autograd would have
#    kept, bit for bit, with no read; counted in ``stats.tail_hits``, neither
#    a prefetch hit nor a miss. It is released at the pass's last use of the
#    handle (dedup: every save of it takes it). A source modified in place
#    since it was saved is released and the copy is restored, which holds
#    the pack-time values (NOTE [Copy landed]): exactly what the unpack gives
#    without the hold.
# 4. Prefetch: a held source needs no restore; the prefetcher counts it as
#    in flight in its window until it is taken, so restores of the tensors
#    below it start where they would have and the memory at backward's start
#    is that of the window, as without the hold.
# 5. Release: a source is released when it is taken (3), pushed out (1), at
#    the end of the backward that took one of the step's held sources
#    (an autograd engine callback: a backward over part of the graph, or
#    one with ``retain_graph=True``, leaves none held), when its handle dies
#    (its graph is freed), when the forward raises (``Offloader._exit``) and
#    at ``close()``. Nothing else refers to a held source: no leak outlives
#    the handle.
# 6. Not held: steps that follow an auto plan (the plan keeps what backward
#    needs first, and its prefetch window is sized for its moves; the planner
#    reads the step's memory), and steps whose parameters may be freed
#    (FSDP2, NOTE [Sharded parameters] in runtime/hooks.py): a moved tensor may alias
#    an unsharded parameter, whose storage FSDP2 frees and refills.
# 7. CUDA: the held tensor was made on the forward's stream and is consumed
#    by backward as a kept one would be; the D2H copy only reads it. The
#    store's reference still orders its free after the copy (it is dropped
#    only once landed or ordered: NOTE [In-flight window]); when the held
#    reference goes last, that order was already made. So no record_stream.
# Memory contract: from the forward to backward's first unpacks, memory (the
# device's for CUDA tensors, RAM for CPU ones) is higher by at most ``W``
# bytes than without the hold; at backward's start the held sources take the
# place of restores the prefetcher would have started.
"""

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
