"""The ``cpu`` tier: saved tensors copied to host buffers, restored ahead of need.

Forward (``put``): take a pooled host buffer (pinned for CUDA tensors), start
the copy out on the copier (side stream / worker thread) and return at once.
The forward thread checks finished copies at every pack (``poll``) and then
drops the source: device memory is freed when the copy lands, not at backward.

Backward (``get``): the restore was usually started ahead of need by the
:class:`~tiermem.prefetch.Prefetcher`; ``get`` orders the consumer after it
and returns the rebuilt tensor.

# NOTE [Copy landed]
# A copied tensor must hold its pack-time values, never a torn mix of before
# and after an in-place write that raced the copy. PyTorch bumps a tensor's
# version on the host *after* issuing an in-place kernel (CPU: after running
# it). The forward thread, between two ops, checks ``job.done()`` and then the
# version: if the copy is complete and the version is unchanged, no in-place
# op was issued before the check, so none ran before the copy ended and the
# copy is clean; the source is dropped, and later in-place writes cannot
# affect the copy. If the version changed, the copy may be torn: the handle is
# marked and its unpack raises, as autograd would without hooks (see NOTE
# [In-place check] in keep.py). The check must run on the thread that issues
# the forward ops, never on the copy worker: a worker cannot tell a finished
# in-place kernel from one still running.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Optional

import torch

from ..copier import copier_for
from ..errors import TierMemError
from ..hostpool import HostPool
from ..policy import Tier
from .base import Layout, TierStore

__all__ = ["HostStore", "HostHandle"]


class HostHandle:
    """A saved tensor held in a host buffer. Owned by autograd; releasing it
    returns the buffer to the pool."""

    __slots__ = ("store", "step", "layout", "nbytes", "host", "host_view", "version",
                 "module", "src", "last_job", "restore", "gen", "tainted",
                 "order_pos", "__weakref__")

    def __del__(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store._release(self)


class HostStore(TierStore):
    """Host-memory tier for CUDA and CPU tensors, within ``budget_bytes``."""

    tier = Tier.CPU

    def __init__(self, budget_bytes: int) -> None:
        self.pool = HostPool(budget_bytes)
        self._copiers: dict = {}
        # (weakref to handle, copy-out job), in submission order. Weak: a handle
        # whose graph is dropped before its copy lands frees its buffer at once.
        self._pending: collections.deque = collections.deque()
        self._lock = threading.RLock()

    # -- accounting -------------------------------------------------------
    @property
    def in_use_bytes(self) -> int:
        """Host bytes held by live handles."""
        return self.pool.in_use_bytes

    @property
    def held_bytes(self) -> int:
        """Host bytes held, in use or pooled (what the budget bounds)."""
        return self.pool.held_bytes

    @staticmethod
    def can_store(t: torch.Tensor) -> bool:
        return t.device.type in ("cpu", "cuda")

    # -- forward ------------------------------------------------------------
    def put(self, t: torch.Tensor, step, module: str = "") -> Optional[HostHandle]:
        layout = Layout.of(t)
        nbytes = layout.nbytes
        buf = self.pool.acquire(nbytes, pinned=t.is_cuda)
        if buf is None:
            return None
        host_view = buf[:nbytes].view(layout.dtype)
        src = t.detach()
        copier = copier_for(t.device, self._copiers)
        h = HostHandle()
        h.layout, h.nbytes, h.host, h.host_view = layout, nbytes, buf, host_view
        h.version, h.module, h.src = t._version, module, src
        h.restore = None
        h.gen = -1
        h.tainted = False
        h.step = step
        job = h.last_job = copier.copy_out(layout.source(src), layout.dest_view(host_view))
        h.store = self
        with self._lock:
            self._pending.append((weakref.ref(h), job))
        step.prefetcher.add(h)
        stats = step.stats
        in_use = self.in_use_bytes
        if in_use > stats.peak_host_bytes:
            stats.peak_host_bytes = in_use
        return h

    def poll(self) -> None:
        """Finish every copy that has landed, in order. See NOTE [Copy landed]."""
        if not self._pending:
            return
        with self._lock:
            pending = self._pending
            while pending and pending[0][1].done():
                self._landed(pending.popleft()[0])

    @staticmethod
    def _landed(ref) -> None:
        h = ref()
        if h is None or h.src is None:   # died (see _release) or already landed
            return
        if h.src._version != h.version:
            h.tainted = True
        h.src = None

    def _land_first(self) -> None:
        ref, job = self._pending.popleft()
        job.wait_host()
        self._landed(ref)

    def drain(self) -> None:
        with self._lock:
            while self._pending:
                self._land_first()

    def _wait_landed(self, h: HostHandle) -> None:
        with self._lock:
            while h.src is not None:
                self._land_first()

    # -- backward -----------------------------------------------------------
    def _start_restore(self, h: HostHandle):
        layout = h.layout
        dev, job = copier_for(layout.device, self._copiers).restore(
            h.host_view, layout.pad, layout.dtype)
        h.last_job = job
        return dev, job

    def prefetch(self, h: HostHandle) -> bool:
        """Start restoring ``h`` unless it is on its way, still on the device, or
        already consumed in this backward pass (see Prefetcher.gen)."""
        if h.src is not None or h.tainted or h.restore is not None:
            return False
        if h.gen == h.step.prefetcher.gen:
            return False
        h.restore = self._start_restore(h)
        h.step.stats.prefetched_bytes += h.nbytes
        return True

    def get(self, h: HostHandle) -> torch.Tensor:
        step = h.step
        prefetcher = step.prefetcher
        with prefetcher.lock:
            self.poll()
            if h.src is not None:
                if h.src._version == h.version and not h.layout.compact:
                    # Copy not landed yet: the original is still here and unchanged.
                    # (A compact copy has other strides: wait for it, so that
                    # backward sees the same layout whatever the timing.)
                    prefetcher.advance(h)
                    return h.src
                self._wait_landed(h)
            if h.tainted:
                raise TierMemError(
                    f"tiermem: a tensor saved for backward (shape {list(h.layout.size)}, "
                    f"{h.layout.dtype}{' in module ' + h.module if h.module else ''}) was "
                    "modified by an in-place operation while tiermem was copying it to the "
                    "cpu tier; autograd would raise here too. Clone it before modifying it.")
            prefetcher.begin_get(h)
            if h.restore is None:
                step.stats.prefetch_misses += 1
                h.restore = self._start_restore(h)
            else:
                step.stats.prefetch_hits += 1
                prefetcher.consumed(h.nbytes)
            dev, job = h.restore
            h.restore = None
            prefetcher.advance(h)
        t0 = time.perf_counter()
        job.order_before_use(dev)
        step.stats.stall_seconds += time.perf_counter() - t0
        return h.layout.rebuild(dev)

    # -- release --------------------------------------------------------------
    def _release(self, h: HostHandle) -> None:
        if h.src is not None:      # died before its copy out landed (last_job is that copy)
            h.last_job.abandon(h.src)
            h.src = None
        if h.restore is not None:  # prefetched, never consumed
            dev, job = h.restore
            job.abandon(dev)
            h.step.prefetcher.consumed(h.nbytes)
            h.restore = None
        self.pool.release(h.host, h.last_job)

    def close(self) -> None:
        self.drain()
        self.pool.clear()
