"""Extents of one preallocated file, reused across steps through a free list.

No file is created or deleted per tensor: the NVMe tier reserves aligned
extents of an arena file, and frees them when autograd drops the tensor. The
file grows (in steps of at least ``grow_bytes``) only when no free extent is
large enough, and never beyond ``budget_bytes``. Free extents are kept sorted
and coalesced with their neighbours, and allocation is best-fit, so a training
loop whose steps save the same shapes reuses the same extents every step and
the file stops growing after the first step.
"""

from __future__ import annotations

import bisect
import errno
import threading
from typing import Callable, Optional

__all__ = ["Arena", "round_up"]


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class Arena:
    """Byte extents of a file of ``size_bytes`` (grown through ``resize``).

    ``resize(new_size)`` is the file's resize (raises ``OSError``). ENOSPC
    while growing (after a retry with just the missing bytes) makes the arena
    full at its current size for the rest of its life (``disk_full``: it no
    longer grows; ``alloc`` still hands out freed extents and returns ``None``
    for what they cannot hold) rather than failing. Thread-safe.
    """

    def __init__(self, resize: Callable[[int], None], budget_bytes: int, align: int = 4096,
                 grow_bytes: int = 64 << 20) -> None:
        self._resize = resize
        self.align = align
        self.budget_bytes = budget_bytes // align * align
        self.grow_bytes = round_up(max(grow_bytes, align), align)
        self.size_bytes = 0
        self.used_bytes = 0
        self.disk_full = False
        self._starts: list = []   # sorted offsets of free extents
        self._lengths: dict = {}  # offset -> length
        self._lock = threading.Lock()

    @property
    def free_extents(self) -> int:
        """Number of free extents (coalesced: adjacent free bytes are one extent)."""
        return len(self._starts)

    def alloc(self, nbytes: int) -> Optional[int]:
        """Offset of a free extent of ``round_up(nbytes, align)`` bytes, or ``None``."""
        need = round_up(max(nbytes, 1), self.align)
        with self._lock:
            best = None
            for start in self._starts:
                length = self._lengths[start]
                if length >= need and (best is None or length < self._lengths[best]):
                    best = start
                    if length == need:
                        break
            if best is None and not self._grow(need):
                return None
            if best is None:
                best = self._starts[-1]   # growth extended (or created) the last extent
            self._take(best, need)
            self.used_bytes += need
            return best

    def free(self, offset: int, nbytes: int) -> None:
        """Give back the extent ``alloc`` returned for ``nbytes``."""
        length = round_up(max(nbytes, 1), self.align)
        with self._lock:
            self.used_bytes -= length
            self._insert(offset, length)

    def _take(self, start: int, need: int) -> None:
        length = self._lengths.pop(start)
        del self._starts[bisect.bisect_left(self._starts, start)]
        if length > need:
            self._insert(start + need, length - need)

    def _insert(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and start + length == self._starts[i]:  # merge right
            length += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if i > 0:
            left = self._starts[i - 1]
            if left + self._lengths[left] == start:                      # merge left
                self._lengths[left] += length
                return
        self._starts.insert(i, start)
        self._lengths[start] = length

    def _grow(self, need: int) -> bool:
        """Extend the file so that its last free extent holds ``need`` bytes."""
        if self.disk_full:
            return False
        tail_free = 0
        if self._starts:
            last = self._starts[-1]
            if last + self._lengths[last] == self.size_bytes:
                tail_free = self._lengths[last]
        missing = need - tail_free
        new_size = self.size_bytes + max(missing, self.grow_bytes)
        new_size = min(new_size, self.budget_bytes)
        if new_size - self.size_bytes < missing:
            return False
        for size in dict.fromkeys((new_size, self.size_bytes + missing)):
            try:
                self._resize(size)
                new_size = size
                break
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
        else:  # the disk is full even for this request: stay at the current size
            self.disk_full = True
            try:
                self._resize(self.size_bytes)
            except OSError:
                pass
            return False
        old = self.size_bytes
        self.size_bytes = new_size
        self._insert(old, new_size - old)
        return True
