"""Pool of reusable host buffers under a byte budget.

Activations repeat their sizes every step, so buffers are kept in free lists by
size class and handed out again in the next step: after the first step the cpu
tier allocates nothing.

- Pinned buffers (for CUDA tensors) come from ``torch.empty(pin_memory=True)``,
  i.e. torch's caching host allocator, which rounds every request up to a power
  of two. Our size classes use the same rounding, so the bytes we count against
  the budget are the bytes really pinned (up to 2x the tensor; activation sizes
  are mostly powers of two times small factors).
- Pageable buffers (CPU tensors, CPU-only machines) use exact sizes.

A returned buffer carries the :class:`~tiermem.runtime.jobs.Job` that last used it;
it is handed out again only once that job is done. See NOTE [Stream lifetime].

The pool is thread-safe: buffers come back from whichever thread autograd frees
a handle on.
"""

# NOTE [Trimming pinned buffers]
# The budget bounds the pinned memory really held at every moment, yet pinned
# buffers are never trimmed mid-step. Torch's caching host allocator keeps freed
# pinned blocks pinned, so a dropped buffer must be handed back to the OS
# (``torch._C._host_emptyCache``), which synchronizes the whole device and frees
# only blocks whose copies are seen complete: mid-step it frees little and stalls
# the forward. So a pinned request is served by an idle buffer of its class, else
# of the next class up, else a new buffer if the budget has room, else refused
# (the tensor goes to the next tier) and the shortfall remembered.
# :meth:`HostPool.trim_when_idle`, between steps, drops idle ready pinned buffers,
# largest first, up to the shortfall, and returns them to the OS once
# (``pinned_returns``), outside the pool's lock.

# NOTE [Idle pageable buffers]
# Idle pageable bytes never exceed the most pageable bytes ever in use at once
# (what one step moves): pageable buffers have exact sizes, so under varying
# shapes few are reused and idle ones would pile up to the budget. Beyond the cap
# the least recently used classes are dropped, at no cost (no device sync; glibc
# returns the pages: NOTE [Freed memory and RSS] in memory/malloc.py). Pinned
# buffers come in power-of-two classes, reused across shapes: NOTE [Trimming
# pinned buffers].

# NOTE [Buffers of earlier steps]
# Where a tensor goes does not depend on a copy of an earlier step still running.
# A buffer may come back while its last copy still runs (backward took the
# original before the copy out landed). :meth:`HostPool.start_step` (between
# steps) marks idle buffers whose job is not done; when ``acquire`` finds no ready
# buffer of the class, it waits for the job of such a marked buffer (a copy nobody
# needs any more) and takes it, before it allocates or refuses. Buffers given back
# during the current step are never waited for; the wait is on the host (CUDA:
# the copy's event), only where the pool would otherwise grow or refuse.

# NOTE [Releases from finalizers]
# Nothing that runs from ``__del__`` or a weakref callback takes a lock that code
# allocating Python objects may hold: the cyclic collector may run a finalizer at
# any allocation, on a thread inside that lock (``acquire`` allocates under it),
# and a release taking the lock would wait for itself forever. So ``release``
# appends to a deque (atomic), and every method that reads or changes the pool's
# state drains it first, under the lock. The same rule holds for every release
# path of tiermem (NvmeStore's extents, the prefetcher's window).


from __future__ import annotations

import collections
import logging
import threading
from typing import Optional

import torch

_log = logging.getLogger("tiermem")

__all__ = ["HostPool"]

_PROGRAMMING_ERRORS = (NotImplementedError, AssertionError, AttributeError, TypeError)


def _wait_for_copy(job) -> None:
    """Wait on the host for the last copy that used a buffer. A copy that
    failed leaves its buffer free all the same (its error reaches the one who
    reads that tensor); a job that cannot wait at all is a bug and raises (a
    ``wait_host`` missing from a job class once made every such wait a silent
    no-op, and with it NOTE [Buffers of earlier steps])."""
    try:
        job.wait_host()
    except _PROGRAMMING_ERRORS:
        raise
    except Exception:
        pass


_MIN_PINNED_CLASS_BYTES = 4096


def _pinned_class(nbytes: int) -> int:
    n = max(nbytes, _MIN_PINNED_CLASS_BYTES)
    return 1 << (n - 1).bit_length()


class HostPool:
    """Host buffers (flat ``uint8`` tensors), pinned or pageable, by size class,
    all within one ``budget_bytes``.

    ``held_bytes`` (in use + free) never exceeds the budget: a pageable
    ``acquire`` first frees idle pageable buffers of other classes, then
    returns ``None`` if the request still does not fit; a pinned one that does
    not fit returns ``None`` at once, and :meth:`trim_when_idle` makes room
    between steps (NOTE [Trimming pinned buffers]).
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._free: dict[tuple, list] = {}   # (pinned, class) -> [(buffer, job or None)]
        self._in_use_bytes = 0
        self._free_bytes = 0
        # See NOTE [Idle pageable buffers].
        self._pageable_in_use_bytes = 0
        self._pageable_idle_bytes = 0
        self.pageable_peak_bytes = 0   # most pageable bytes in use at once: the idle cap
        # (buffer, job, pinned) given back and not yet filed: NOTE [Releases from finalizers].
        self._returned: collections.deque = collections.deque()
        self.allocations = 0                  # buffers ever allocated (reuse check)
        #: Times acquire() handed trimmed pinned memory back to the OS: on CUDA
        #: each is a device-wide sync (NOTE [Trimming pinned buffers]).
        self.pinned_returns = 0
        # Most pinned bytes a refused request lacked since the last trim.
        self._pinned_shortfall_bytes = 0
        self._warned_alloc = False
        # ids of idle buffers whose job ran past the step they were given back
        # in: NOTE [Buffers of earlier steps].
        self._earlier: set = set()
        #: Times acquire() waited for a copy of an earlier step to reuse its buffer.
        self.earlier_waits = 0

    def _drain(self) -> None:
        """File the buffers given back since (caller holds the lock)."""
        returned = self._returned
        while returned:
            buf, job, pinned = returned.popleft()
            cls = buf.numel()
            self._in_use_bytes -= cls
            self._free_bytes += cls
            if not pinned:
                self._pageable_in_use_bytes -= cls
                self._pageable_idle_bytes += cls
            self._free.setdefault((pinned, cls), []).append((buf, job))
        over = self._pageable_idle_bytes - self.pageable_peak_bytes
        if over > 0:
            self._trim_pageable(over)

    def _in_use(self, cls: int, pinned: bool) -> None:
        """Count a buffer of ``cls`` bytes handed out (caller holds the lock)."""
        self._in_use_bytes += cls
        if not pinned:
            self._pageable_in_use_bytes += cls
            if self._pageable_in_use_bytes > self.pageable_peak_bytes:
                self.pageable_peak_bytes = self._pageable_in_use_bytes

    def _trim_pageable(self, want_bytes: int) -> None:
        """Drop idle pageable buffers, least recently used classes first, until
        ``want_bytes`` are gone (NOTE [Idle pageable buffers])."""
        for key in list(self._free):
            if want_bytes <= 0:
                return
            if key[0]:
                continue
            entries = self._free[key]
            while entries and want_bytes > 0:
                job = entries[0][1]
                if job is not None and not job.done():
                    break
                entries.pop(0)
                want_bytes -= key[1]
                self._free_bytes -= key[1]
                self._pageable_idle_bytes -= key[1]
            if not entries:
                del self._free[key]

    @property
    def in_use_bytes(self) -> int:
        """Bytes of buffers handed out and not given back."""
        with self._lock:
            self._drain()
            return self._in_use_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes of idle buffers kept for reuse."""
        with self._lock:
            self._drain()
            return self._free_bytes

    @property
    def held_bytes(self) -> int:
        """In use + idle: what the budget bounds."""
        with self._lock:
            self._drain()
            return self._in_use_bytes + self._free_bytes

    def idle_buffers(self) -> list:
        """The buffers the pool holds for reuse now (not in use), for inspection."""
        with self._lock:
            self._drain()
            return [buf for entries in self._free.values() for buf, _ in entries]

    @staticmethod
    def class_bytes(nbytes: int, pinned: bool) -> int:
        return _pinned_class(nbytes) if pinned else nbytes

    def start_step(self) -> None:
        """Between steps: mark the idle buffers whose last job still runs, so
        that ``acquire`` may wait for them (NOTE [Buffers of earlier steps])."""
        with self._lock:
            self._drain()
            self._earlier = {id(buf) for entries in self._free.values()
                             for buf, job in entries if job is not None and not job.done()}

    def acquire(self, nbytes: int, pinned: bool) -> Optional[torch.Tensor]:
        """A buffer of at least ``nbytes`` (its length is its class size: the
        request's class or, pinned, twice it when such an idle buffer is ready;
        callers slice it), or ``None`` when the budget has no room.
        See NOTE [Trimming pinned buffers] and NOTE [Buffers of earlier steps]."""
        cls = self.class_bytes(nbytes, pinned)
        while True:
            with self._lock:
                self._drain()
                buf = self._take_ready(pinned, cls)
                if buf is not None:
                    self._free_bytes -= buf.numel()
                    if not pinned:
                        self._pageable_idle_bytes -= buf.numel()
                    self._in_use(buf.numel(), pinned)
                    return buf
                job = self._earlier_job(pinned, cls)
                if job is None:
                    break
            self.earlier_waits += 1
            _wait_for_copy(job)   # outside the lock
        with self._lock:
            self._drain()
            over = self._in_use_bytes + self._free_bytes + cls - self.budget_bytes
            if over > 0:
                if pinned:   # never mid-step: NOTE [Trimming pinned buffers]
                    self._pinned_shortfall_bytes = max(self._pinned_shortfall_bytes, over)
                    return None
                if self._ready_idle_bytes(pinned=False) < over:
                    return None   # trimming would drop buffers and still not make room
                self._trim(over, pinned_too=False)
            self._in_use(cls, pinned)
            self.allocations += 1
        try:
            return torch.empty(cls, dtype=torch.uint8, pin_memory=pinned)
        except RuntimeError as e:   # torch.OutOfMemoryError included
            with self._lock:
                self._in_use_bytes -= cls
                if not pinned:
                    self._pageable_in_use_bytes -= cls
                self.allocations -= 1
            if not self._warned_alloc:
                self._warned_alloc = True
                _log.warning("tiermem: could not allocate %d %s host bytes (%s); the "
                             "tier counts as full (shown once)", cls,
                             "pinned" if pinned else "pageable", e)
            return None

    def release(self, buf: torch.Tensor, job=None, pinned: bool = False) -> None:
        """Give ``buf`` back (``pinned`` as it was acquired); it is reused once
        ``job`` (if any) is done. Takes no lock: NOTE [Releases from finalizers]."""
        self._returned.append((buf, job, pinned))

    def clear(self) -> None:
        """Drop every idle buffer, once the copy that last used it is done (in-use
        ones are unaffected), then hand torch's cached pinned blocks back to the
        OS: what ``Offloader.close()`` does, so that pinned memory does not
        outlive the Offloader in torch's cache (a benchmark matrix runs one
        configuration after another in one process). Waits on the host for
        those copies."""
        with self._lock:
            self._drain()
            running = [job for entries in self._free.values() for _, job in entries
                       if job is not None and not job.done()]
        for job in running:   # outside the lock
            _wait_for_copy(job)
        with self._lock:
            self._drain()
            self._trim(self._free_bytes)
            self._earlier.clear()
        # Also what torch's cache kept of pinned buffers dropped before
        # (transient staging outside the pool).
        _return_pinned_cache()

    def _take_ready(self, pinned: bool, cls: int) -> Optional[torch.Tensor]:
        """An idle buffer whose last job is done, of class ``cls``, or for
        pinned memory of the next class up (twice as large) rather than trim
        and pin anew (pageable buffers are dropped at no such cost)."""
        keys = [(pinned, cls), (pinned, 2 * cls)] if pinned else [(pinned, cls)]
        for key in keys:
            entries = self._free.get(key)
            if not entries:
                continue
            for i, (buf, job) in enumerate(entries):
                if job is None or job.done():
                    del entries[i]
                    if not entries:
                        del self._free[key]
                    return buf
        return None

    def _earlier_job(self, pinned: bool, cls: int):
        """The running job of a marked idle buffer of the classes ``acquire``
        may take (NOTE [Buffers of earlier steps]), unmarked; or ``None``."""
        if not self._earlier:
            return None
        keys = [(pinned, cls), (pinned, 2 * cls)] if pinned else [(pinned, cls)]
        for key in keys:
            for buf, job in self._free.get(key, ()):
                if id(buf) in self._earlier:
                    self._earlier.discard(id(buf))
                    if job is not None and not job.done():
                        return job
        return None

    def _ready_idle_bytes(self, pinned: bool) -> int:
        return sum(key[1] for key, entries in self._free.items() if key[0] == pinned
                   for _, job in entries if job is None or job.done())

    def trim_when_idle(self) -> bool:
        """Make room for the pinned requests refused since the last call:
        drop idle pinned buffers whose last job is done (largest first) up to
        the largest shortfall, and return them to the OS (a device-wide sync on
        CUDA: call it only where the copy streams are idle, between steps).
        Returns whether anything was returned. NOTE [Trimming pinned buffers]."""
        with self._lock:
            self._drain()
            want, self._pinned_shortfall_bytes = self._pinned_shortfall_bytes, 0
            trimmed = want > 0 and self._trim(want, pageable_too=False)
            if trimmed:
                self.pinned_returns += 1
        if trimmed:
            _return_pinned_cache()   # outside the lock: it waits for the device
        return trimmed

    def _trim(self, want_bytes: int, pinned_too: bool = True,
              pageable_too: bool = True) -> bool:
        """Drop idle buffers (largest classes first) until ``want_bytes`` are
        gone or none is idle and ready; True if pinned ones were dropped (the
        caller then returns them to the OS, outside the lock)."""
        trimmed_pinned = False
        for key in sorted(self._free, key=lambda k: k[1], reverse=True):
            if not (pinned_too if key[0] else pageable_too):
                continue
            cls = key[1]
            keep = []
            for entry in self._free[key]:
                job = entry[1]
                if want_bytes > 0 and (job is None or job.done()):
                    want_bytes -= cls
                    self._free_bytes -= cls
                    if not key[0]:
                        self._pageable_idle_bytes -= cls
                    trimmed_pinned |= key[0]
                else:
                    keep.append(entry)
            if keep:
                self._free[key] = keep
            else:
                del self._free[key]
        return trimmed_pinned


def _return_pinned_cache() -> None:
    """Hand freed pinned blocks back to the OS: torch's caching host allocator
    keeps them pinned otherwise, and the budget would no longer bound them."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_initialized():
        empty()
