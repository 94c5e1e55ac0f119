"""Shared logic of the tiers that move a tensor away and bring it back (cpu, nvme).

A moving store implements three steps; this base class does the rest (the
landing check, in-place safety, prefetch, release):

- ``_store_out(src, layout, t) -> (slot, job)`` or ``None`` when full: start
  moving the tensor's bytes out; ``slot`` is the store's record of where they
  go (host buffer, disk extent), ``job`` a :class:`~tiermem.copier.Job`;
- ``_start_restore(handle) -> (tensor, job)``: allocate on the device and
  start bringing the bytes back (``handle.layout.pad`` elements first);
- ``_free(handle)``: give the slot back once ``handle.last_job`` is done.

Forward (``put``): start moving out and return at once. The forward thread
checks finished jobs at every pack (``poll``) and then drops the source:
device memory is freed when the copy lands, not at backward. A store whose
move goes through a host staging buffer first (nvme, CUDA tensors) drops the
source earlier, once the bytes are in staging: see NOTE [Staged moves].

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

# NOTE [Staged moves]
# A job with a ``host_view`` (a tensor) moves the bytes through that host
# buffer: ``copied()`` says they are all in it, ``done()`` that the move as a
# whole (the disk write) is over. At ``poll`` (the forward thread, as in NOTE
# [Copy landed]) a copied move's source is dropped after the same version
# check, and ``h.host`` holds the staging view until the move lands:
# - until then the handle counts as not landed (no prefetch from the disk, which
#   may not hold the bytes yet); ``get`` copies the bytes back from ``h.host``
#   (on CUDA on the current stream, the lease holding the buffer until then);
# - if the move then fails, ``h.host`` stays as the tensor's only copy, and
#   ``get`` restores from it, so nothing is lost;
# - the staging buffer goes back to its pool through ``h.lease``: only when
#   ``h.lease.release()`` is called (the move landed without needing it, the
#   copy was torn, or the handle died), and the pool reuses it once the move
#   and every copy out of it are done. The pool never hands it out while a
#   handle may still read it, and counts it in use until then.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from typing import Optional

import torch

from ..copier import _CudaJob
from ..errors import TierMemError
from .base import Layout, TierStore
from .keep import check_version

_log = logging.getLogger("tiermem")

__all__ = ["MovingStore", "MovedHandle"]


class MovedHandle:
    """A saved tensor moved away by a :class:`MovingStore`. Owned by autograd;
    when autograd drops it, the store gets its slot back."""

    __slots__ = ("store", "step", "layout", "nbytes", "slot", "version", "module", "src",
                 "host", "lease", "last_job", "restore", "gen", "taken", "uses", "cached",
                 "tainted", "failed", "order_pos", "__weakref__")

    def __del__(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store._release(self)


def _where_kept(h: "MovedHandle") -> str:
    """Where a tensor whose move failed stays (NOTE [Staged moves])."""
    return "on its device" if h.host is None else "in its pinned staging buffer"


class MovingStore(TierStore):
    """Base of the cpu and nvme tiers; see the module docstring."""

    def __init__(self) -> None:
        # (weakref to handle, move-out job), in submission order. Weak: a handle
        # whose graph is dropped before its copy lands frees its slot at once.
        self._pending: collections.deque = collections.deque()
        # Staged moves whose copy to staging was not seen landed yet, in order.
        self._uncopied: collections.deque = collections.deque()
        self._lock = threading.RLock()
        self._warned_failure = False

    # -- subclass steps -------------------------------------------------------
    def _store_out(self, src: torch.Tensor, layout: Layout, t: torch.Tensor):
        raise NotImplementedError

    def _start_restore(self, h: MovedHandle):
        raise NotImplementedError

    def _free(self, h: MovedHandle) -> None:
        raise NotImplementedError

    def _note_put(self, stats) -> None:
        """Update per-step stats after a put (e.g. peak bytes held)."""

    # -- forward ------------------------------------------------------------
    def put(self, t: torch.Tensor, step, module: str = "") -> Optional[MovedHandle]:
        layout = Layout.of(t)
        src = t.detach()
        out = self._store_out(src, layout, t)
        if out is None:
            return None
        h = MovedHandle()
        h.slot, job = out
        h.layout, h.nbytes = layout, layout.nbytes
        h.version, h.module, h.src = t._version, module, src
        h.host = None
        h.lease = getattr(job, "lease", None)
        h.restore = h.cached = None
        h.gen = -1
        h.taken = 0
        h.uses = 1           # saves of this tensor in the step (dedup hits add one)
        h.tainted = h.failed = False
        h.step = step
        h.last_job = job
        h.store = self
        with self._lock:
            ref = weakref.ref(h)
            self._pending.append((ref, job))
            if getattr(job, "host_view", None) is not None:
                self._uncopied.append((ref, job))
        step.prefetcher.add(h)
        self._note_put(step.stats)
        return h

    def poll(self) -> None:
        """Finish every move that has landed, in order. See NOTE [Copy landed]."""
        if not self._pending:
            if self._uncopied:
                self._uncopied.clear()   # all landed
            return
        with self._lock:
            pending = self._pending
            while pending and pending[0][1].done():
                self._landed(*pending.popleft())
            if self._uncopied:
                self._drop_copied_sources()

    def _drop_copied_sources(self) -> None:
        """NOTE [Staged moves]: drop the sources already copied to staging (in
        order: one side stream completes its copies in order)."""
        uncopied = self._uncopied
        while uncopied:
            ref, job = uncopied[0]
            h = ref()
            copied = False
            if h is not None and h.src is not None and not h.failed:
                copied = job.copied()
                if not copied and not job.done():
                    return   # not copied yet
            uncopied.popleft()
            # Gone, landed, failed with its source kept, or over without a copy:
            # landing decides. A copied move that is over but not landed yet
            # (writes finish out of order) drops its source here all the same.
            if h is None or h.src is None or h.failed or not copied:
                continue
            if h.src._version != h.version:
                # Torn copy: backward raises; the staging is not needed.
                h.tainted = True
                if h.lease is not None:
                    h.lease.release()
            else:
                h.host = job.host_view
            h.src = None

    def _landed(self, ref, job) -> None:
        h = ref()
        if h is None or (h.src is None and h.host is None):   # died, or already landed
            return
        error = job.failed()
        if error is not None:
            # The move failed (e.g. EIO): the source is still here, so the
            # tensor simply stays on its device, as if kept; or only its staged
            # copy is (NOTE [Staged moves]), and stays with the handle.
            h.failed = True
            if h.host is None and h.lease is not None:
                h.lease.release()
            self._on_failure(h, error)
            return
        if h.src is not None:
            if h.src._version != h.version:
                h.tainted = True
            h.src = None
        h.host = None
        if h.lease is not None:
            h.lease.release()

    def _on_failure(self, h: MovedHandle, error: BaseException) -> None:
        h.step.stats.budget_fallbacks += 1
        if not self._warned_failure:
            self._warned_failure = True
            _log.warning("%s; the tensor stays %s (counted in stats.budget_fallbacks; "
                         "shown once)", error, _where_kept(h))

    def _land_first(self) -> None:
        ref, job = self._pending.popleft()
        try:
            job.wait_host()
        except Exception:
            pass   # reported through job.failed() in _landed
        self._landed(ref, job)

    def drain(self) -> None:
        with self._lock:
            while self._pending:
                self._land_first()
            self._uncopied.clear()

    def _wait_landed(self, h: MovedHandle) -> None:
        with self._lock:
            while h.src is not None and not h.failed and self._pending:
                self._land_first()

    @staticmethod
    def _from_host(h: MovedHandle, host: torch.Tensor) -> tuple:
        """The tensor rebuilt from its staged copy ``host`` (NOTE [Staged moves]).
        On CUDA the copy is queued on the current stream (where the tensor is
        allocated and consumed), and the staging buffer's lease holds it back
        from its pool until that copy is done."""
        layout = h.layout
        dev = torch.empty(layout.pad + layout.numel, dtype=layout.dtype, device=layout.device)
        if not dev.is_cuda:
            dev[layout.pad:].copy_(host)
            return layout.rebuild(dev), None
        stream = torch.cuda.current_stream(layout.device)
        dev[layout.pad:].copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        h.lease.hold_until(done)
        # For the other consumers of this pass (the first is on ``stream``).
        return layout.rebuild(dev), _CudaJob(done, layout.device, stream, stream)

    # -- backward -----------------------------------------------------------
    def prefetch(self, h: MovedHandle) -> Optional[bool]:
        """Start restoring ``h``: ``True`` if started; ``False`` if it needs none
        (on its way, failed or tainted, or already consumed in this backward pass,
        see Prefetcher.gen); ``None`` if its move out has not landed yet (the
        prefetcher waits there rather than skipping it)."""
        if h.failed or h.tainted or h.restore is not None or h.cached is not None:
            return False
        if h.src is not None or h.host is not None:
            return None
        if h.gen == h.step.prefetcher.gen:
            return False
        h.restore = self._restore(h)
        h.step.stats.prefetched_bytes += h.nbytes
        return True

    def _restore(self, h: MovedHandle):
        dev, job = self._start_restore(h)
        h.last_job = job
        return dev, job

    def get(self, h: MovedHandle) -> torch.Tensor:
        step = h.step
        prefetcher = step.prefetcher
        with prefetcher.lock:
            self.poll()
            # Every use of this pass counts, whichever way it is served.
            prefetcher.begin_get(h)
            if h.src is not None and not h.failed:
                if h.src._version == h.version:
                    # Not landed yet: the original is still here and unchanged.
                    # A compact copy is dense: give a dense copy of the original,
                    # so that backward sees the same layout whatever the timing.
                    prefetcher.advance(h)
                    return h.src.contiguous() if h.layout.compact else h.src
                self._wait_landed(h)
            if h.failed and h.src is not None:
                check_version(h.src, h.version, h.module)
                return h.src
            if h.tainted:
                raise TierMemError(
                    f"tiermem: a tensor saved for backward (shape {list(h.layout.size)}, "
                    f"{h.layout.dtype}{' in module ' + h.module if h.module else ''}) was "
                    "modified by an in-place operation while tiermem was moving it to the "
                    f"{self.tier.value} tier; autograd would raise here too. Clone it "
                    "before modifying it.")
            cached = h.cached
            if cached is not None:   # a tensor saved by several ops: restored once
                if h.taken >= h.uses:
                    h.cached = None
            elif h.host is not None:
                with self._lock:   # no landing may give the buffer back meanwhile
                    host = h.host
                    cached = None if host is None else self._from_host(h, host)
                if cached is not None:
                    # Staged, and its move failed or has not landed: NOTE [Staged moves].
                    prefetcher.advance(h)
                    if h.taken < h.uses:
                        h.cached = cached
            if cached is None:
                if h.restore is None:
                    step.stats.prefetch_misses += 1
                    h.restore = self._restore(h)
                else:
                    step.stats.prefetch_hits += 1
                    prefetcher.consumed(h.nbytes)
                dev, job = h.restore
                h.restore = None
                prefetcher.advance(h)
                out = h.layout.rebuild(dev)
                if h.taken < h.uses:
                    # For the other consumers of this pass, set under the lock
                    # (each orders itself after the copy, below).
                    h.cached = (out, job)
        if cached is not None:
            # Each consumer is ordered after the copy, on its own stream (the
            # consumers of one tensor may run on different streams).
            out, job = cached
            if job is not None:
                job.order_before_use(out)
            return out
        if not job.done():
            step.stats.late_restores += 1
        t0 = time.perf_counter()
        job.order_before_use(dev)
        step.stats.stall_seconds += time.perf_counter() - t0
        return out

    # -- release --------------------------------------------------------------
    def _release(self, h: MovedHandle) -> None:
        if h.src is not None:      # died before its move out landed (last_job is that move)
            h.last_job.abandon(h.src)
            h.src = None
        h.host = None
        if h.lease is not None:    # the pool may reuse it once the move is over
            h.lease.release()
        h.cached = None
        if h.restore is not None:  # prefetched, never consumed
            dev, job = h.restore
            job.abandon(dev)
            h.step.prefetcher.consumed(h.nbytes)
            h.restore = None
        self._free(h)
