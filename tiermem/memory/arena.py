"""Extents of one preallocated file, reused across steps through a free list.

No file is created or deleted per tensor: the NVMe tier reserves aligned
extents of an arena file, and frees them when autograd drops the tensor. The
file grows (in steps of at least ``grow_bytes``) only when no free extent is
large enough, and never beyond ``budget_bytes``. Free extents are kept sorted
and coalesced with their neighbours, and allocation is best-fit, so a training
loop whose steps save the same shapes reuses the same extents every step and
the file stops growing after the first step.
"""

# NOTE [Interrupted updates]
# The arena's invariants (free extents sorted, disjoint, coalesced, within the
# file; ``used_bytes == size_bytes`` - their bytes) hold at every bytecode
# boundary, so an asynchronous exception (KeyboardInterrupt from a signal
# handler) cannot corrupt them. Why:
# 1. The whole state is one immutable ``_State``: an update builds the new one
#    aside and publishes it with one assignment, its last act, so an interrupted
#    ``alloc`` or ``free`` happened entirely or not at all. Readers read one state
#    without the lock.
# 2. Growth resizes the file before publishing the larger size: interrupted in
#    between, the file is merely larger than ``size_bytes``.
# 3. What can still be lost lies with the caller: an offset never stored leaks. A
#    free overlapping free bytes is a repeat: ignored, counted in ``repeated_frees``
#    (applying it would hand bytes out twice). So a caller drops its record of an
#    extent before giving the extent back, never after.

from __future__ import annotations

import bisect
import errno
import logging
import threading
from typing import Callable, NamedTuple, Optional

from ..errors import TierMemError

__all__ = ["Arena", "round_up"]

_log = logging.getLogger("tiermem")


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class _State(NamedTuple):
    """One published state of an arena (NOTE [Interrupted updates], rule 1)."""
    free: tuple        # ((offset, nbytes), ...): sorted, disjoint, coalesced
    used_bytes: int
    size_bytes: int


class Arena:
    """Byte extents of a file of ``size_bytes`` (grown through ``resize``).

    ``resize(new_size)`` is the file's resize (raises ``OSError``). ENOSPC
    while growing (after a retry with just the missing bytes) makes the arena
    full at its current size for the rest of its life (``disk_full``: it no
    longer grows; ``alloc`` still hands out freed extents and returns ``None``
    for what they cannot hold) rather than failing. Thread-safe, and left
    consistent by a KeyboardInterrupt wherever it lands (NOTE [Interrupted
    updates]).
    """

    def __init__(self, resize: Callable[[int], None], budget_bytes: int, align: int = 4096,
                 grow_bytes: int = 64 << 20) -> None:
        self._resize = resize
        self.align = align
        self.budget_bytes = budget_bytes // align * align
        self.grow_bytes = round_up(max(grow_bytes, align), align)
        self.disk_full = False
        #: Extents given back that overlapped free bytes, ignored (NOTE
        #: [Interrupted updates], rule 3).
        self.repeated_frees = 0
        self._state = _State((), 0, 0)
        self._lock = threading.Lock()

    @property
    def size_bytes(self) -> int:
        """Bytes of the file the arena has grown to."""
        return self._state.size_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the extents handed out and not given back."""
        return self._state.used_bytes

    @property
    def free_extents(self) -> int:
        """Number of free extents (coalesced: adjacent free bytes are one extent)."""
        return len(self._state.free)

    @property
    def free_list(self) -> tuple:
        """The free extents, ``((offset, nbytes), ...)`` in offset order."""
        return self._state.free

    def alloc(self, nbytes: int) -> Optional[int]:
        """Offset of a free extent of ``round_up(nbytes, align)`` bytes, or ``None``."""
        need = round_up(max(nbytes, 1), self.align)
        with self._lock:
            state = self._state
            i = _best_fit(state.free, need)
            if i is None:
                state = self._grown(state, need)
                if state is None:
                    return None
                i = len(state.free) - 1   # growth extended (or created) the last extent
            free = state.free
            start, length = free[i]
            rest = ((start + need, length - need),) if length > need else ()
            # Published at once: NOTE [Interrupted updates], rule 1.
            self._state = _State(free[:i] + rest + free[i + 1:], state.used_bytes + need,
                                 state.size_bytes)
            return start

    def free(self, offset: int, nbytes: int) -> None:
        """Give back the extent ``alloc`` returned for ``nbytes``. One that
        overlaps free bytes is ignored (NOTE [Interrupted updates], rule 3)."""
        length = round_up(max(nbytes, 1), self.align)
        end = offset + length
        with self._lock:
            state = self._state
            free = state.free
            if offset < 0 or end > state.size_bytes or offset % self.align:
                raise TierMemError(
                    f"tiermem: an extent [{offset}, {end}) was given back to an arena of "
                    f"{state.size_bytes} bytes (alignment {self.align}); this is a bug")
            i = bisect.bisect_left(free, (offset,))   # extents before i start below offset
            left = free[i - 1] if i > 0 else None
            right = free[i] if i < len(free) else None
            if (left is not None and sum(left) > offset) or (right is not None
                                                             and right[0] < end):
                self._repeated(offset, end)
                return
            lo, hi, start = i, i, offset
            if left is not None and sum(left) == offset:    # merge left
                lo, start = i - 1, left[0]
            if right is not None and right[0] == end:       # merge right
                hi, end = i + 1, sum(right)
            # Published at once: NOTE [Interrupted updates], rule 1.
            self._state = _State(free[:lo] + ((start, end - start),) + free[hi:],
                                 state.used_bytes - length, state.size_bytes)

    def _repeated(self, offset: int, end: int) -> None:
        """NOTE [Interrupted updates], rule 3 (caller holds the lock)."""
        self.repeated_frees += 1
        if self.repeated_frees == 1:
            _log.warning("tiermem: the arena extent [%d, %d) was given back while free "
                         "(a release repeated after an interruption?); ignored (shown once; "
                         "Arena.repeated_frees)", offset, end)

    def _grown(self, state: _State, need: int) -> Optional[_State]:
        """``state`` with the file extended (now) so that its last free extent
        holds ``need`` bytes; ``None`` if it cannot grow (NOTE [Interrupted
        updates], rule 2: the caller publishes it)."""
        if self.disk_full:
            return None
        free, size = state.free, state.size_bytes
        tail_free = free[-1][1] if free and sum(free[-1]) == size else 0
        missing = need - tail_free
        new_size = min(size + max(missing, self.grow_bytes), self.budget_bytes)
        if new_size - size < missing:
            return None
        for candidate in dict.fromkeys((new_size, size + missing)):
            try:
                self._resize(candidate)
                new_size = candidate
                break
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
        else:  # the disk is full even for this request: stay at the current size
            self.disk_full = True
            try:
                self._resize(size)
            except OSError:
                pass
            return None
        if tail_free:
            last = free[-1][0]
            free = free[:-1] + ((last, new_size - last),)
        else:
            free = free + ((size, new_size - size),)
        return _State(free, state.used_bytes, new_size)


def _best_fit(free: tuple, need: int) -> Optional[int]:
    """Index of the smallest free extent of at least ``need`` bytes (the first
    of them), or ``None``."""
    best = None
    best_len = 0
    for i, (_, length) in enumerate(free):
        if length >= need and (best is None or length < best_len):
            best, best_len = i, length
            if length == need:
                break
    return best
