"""The ``nvme`` tier: saved tensors written to an arena file, read back ahead of need.

Data path:

- CPU tensors: the engine writes straight from the tensor's memory and reads
  straight into the restored tensor.
- CUDA tensors: device -> pooled pinned staging buffer on the D2H side stream,
  then the write once that copy has completed. The device memory is freed once
  the copy has landed, the staging buffer once the write has (until then it is
  the tensor's copy: NOTE [Staged moves] in moving.py). Backward reverses it:
  read into staging, then the H2D copy. The forward thread and the compute
  stream never wait for the disk. Two implementations, same ordering: the
  engine's CUDA chain (NOTE [CUDA chain] in csrc/cuda_chain.cpp), else (Python
  engine, CPU-only build, or ``verify``) a Python chain thread. A request the
  engine's chain refuses at submit goes through the Python chain, and so does
  every later one unless the refusal was about the arguments; one warning,
  kept in :attr:`NvmeStore.engine_chain_error`.

Landing, in-place safety, prefetch and release are :class:`~.moving.MovingStore`'s.
An extent goes back to the arena only once the last I/O on it is done.

A full disk: ENOSPC at the arena's fallocate stops its growth (later tensors go
to the next tier); at a write (no fallocate) that tensor stays on its device
(``budget_fallbacks``) and the store takes no new tensor (``disk_full``), one
warning. Any other error at submit also leaves the tensor on its device: it is
too late to choose another tier (NOTE [Launch after the saving op] in moving.py).

With ``verify``, a CRC32 of each tensor's bytes is checked after the read; a
mismatch or short read raises :class:`~tiermem.TierMemError`.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import weakref
from typing import Optional

import torch

from ..errors import TierMemError
from ..io import aligned_empty, release_engine
from ..memory.arena import Arena
from ..memory.hostpool import HostPool
from ..memory.malloc import return_freed_memory_to_the_os
from ..memory.spilldir import PrivateDir, default_nvme_budget_bytes, remove_stale_dirs
from ..policy import Tier
from ..runtime.copier import copier_for
from ..runtime.jobs import EngineCudaJob, FutureJob, StagedJob
from ..runtime.leases import StagingLease
from .base import Layout
from .moving import MovedHandle, MovingStore, _where_kept
from .nvme_chain import PythonChain

__all__ = ["NvmeStore"]

_log = logging.getLogger("tiermem")


def _describe(layout: Layout, module: Optional[str] = None) -> str:
    where = f" saved in module {module}" if module else ""
    return f"tensor of shape {list(layout.size)} ({layout.dtype}){where}"


_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _os_errno(error: Optional[BaseException]) -> Optional[int]:
    """The errno of the first OSError in ``error``'s cause chain, if any."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno is not None:
            return error.errno
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


class NvmeStore(MovingStore):
    """Disk tier within ``budget_bytes`` of one arena file in a private directory.

    ``slot`` of a handle: ``(offset, [crc])``; the crc (``None`` without
    ``verify``) is filled in by the write's chain thread.
    """

    tier = Tier.NVME

    def __init__(self, root: str, engine, budget_bytes: Optional[int], staging_bytes: int,
                 verify: bool, io_threads: int) -> None:
        super().__init__()
        return_freed_memory_to_the_os()
        remove_stale_dirs(root)
        if budget_bytes is None:   # measured now that a killed run's arena is gone
            budget_bytes = default_nvme_budget_bytes(root)
        self._dir = PrivateDir(root)
        self._finalizer = weakref.finalize(self, self._dir.remove)
        self.path = self._dir.file("arena-0.bin")
        self.engine = engine
        #: CUDA tensors go through the engine's own chain (module docstring).
        self.uses_engine_chain = bool(getattr(engine, "cuda_chain", False)) and not verify
        #: Why the engine's CUDA chain refused a request (None: it never did).
        self.engine_chain_error: Optional[str] = None
        self._chain_error_lock = threading.Lock()   # forward and autograd threads
        #: The disk was found full at a write: no new tensor is taken (module docstring).
        self.disk_full = False
        #: Tests (tiermem.testing.stage_cpu_tensors): CPU tensors through staging
        #: and the Python chain as CUDA ones go (NOTE [Staged moves] runs in CI),
        #: instead of straight from memory.
        self.stage_cpu = False
        #: Restores that found the staging pool full (NOTE [Restores past the staging budget]).
        self.unpinned_restores = 0
        #: This store warned why it refuses tensors (the Offloader then need not).
        self.explained_refusals = False
        try:
            self.file = engine.open(self.path, 0)
        except BaseException:
            self._finalizer()   # no half-made store keeps its directory
            raise
        self.arena = Arena(self.file.resize, budget_bytes, align=4096)
        self.verify = verify
        self.staging = HostPool(staging_bytes)
        self._copiers: dict = {}
        self._chain = PythonChain(io_threads)
        self._deferred: list = []   # (job, offset, nbytes): extents freed after their I/O
        self._released: collections.deque = collections.deque()   # from finalizers, unfiled
        self._deferred_lock = threading.Lock()
        # I/O of extents given back before this step began (trim_idle).
        self._earlier_io: list = []
        #: Times a full arena waited for such I/O rather than refuse a tensor.
        self.earlier_waits = 0
        self.closed = False

    # -- accounting -------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes of the arena in use (extents of released handles whose I/O is
        done are given back first)."""
        self._free_finished()
        return self.arena.used_bytes

    def _held_bytes(self) -> int:
        return self.arena.used_bytes

    def trim_idle(self) -> None:
        self.staging.trim_when_idle()
        self.staging.start_step()
        # Extents given back with their I/O still running (NOTE [Buffers of
        # earlier steps] in memory/hostpool.py, applied to the arena): a step that
        # finds the arena full waits for those before it refuses a tensor.
        self._free_finished()
        with self._deferred_lock:
            self._earlier_io = [job for job, _, _ in self._deferred if job is not None]

    def _alloc_after_earlier_io(self, nbytes: int) -> Optional[int]:
        """An extent for ``nbytes`` once the arena, full now, has taken back
        the extents of earlier steps whose I/O was still running at this
        step's start (waited for one by one, oldest first); ``None`` if
        still full."""
        self._free_finished()
        offset = self.arena.alloc(nbytes)
        while offset is None and self._earlier_io:
            job = self._earlier_io.pop(0)
            self.earlier_waits += 1
            try:
                job.wait_host()
            except Exception:
                pass   # a failed write/read: the extent is free all the same
            self._free_finished()
            offset = self.arena.alloc(nbytes)
        return offset

    # -- move out -----------------------------------------------------------------
    def _reserve(self, layout: Layout, t: torch.Tensor):
        """``(staging buffer or None, arena offset)``, or ``None``: full (or the
        disk was found full)."""
        if self.disk_full:
            return None
        nbytes = layout.nbytes
        staging = None
        if t.is_cuda or self.stage_cpu:
            staging = self.staging.acquire(nbytes, pinned=t.is_cuda)
            if staging is None:
                return None
        offset = self.arena.alloc(nbytes)
        if offset is None and self._earlier_io:
            offset = self._alloc_after_earlier_io(nbytes)
        if offset is None:
            if staging is not None:
                self.staging.release(staging, None, t.is_cuda)
            return None
        return staging, offset

    def _unreserve(self, reservation, layout: Layout) -> None:
        # From a finalizer too: no lock (NOTE [Releases from finalizers] in memory/hostpool.py).
        staging, offset = reservation
        if staging is not None:
            self.staging.release(staging, None, layout.device.type == "cuda")
        self._released.append((None, offset, layout.nbytes))   # no I/O on it

    def _launch(self, src: torch.Tensor, layout: Layout, reservation):
        """Start the write (through staging for CUDA tensors); a write refused
        at submit (closed file, full disk...) raises, the tensor staying on its
        device (counted as a failed move)."""
        staging, offset = reservation
        nbytes, cuda = layout.nbytes, src.is_cuda
        what = f"writing a {_describe(layout)} to {self.path} at offset {offset}"
        if self.disk_full:   # found full by an earlier launch: no write is tried
            self._unreserve(reservation, layout)
            raise TierMemError(f"tiermem: {what} not tried: the disk is full") from OSError(
                errno.ENOSPC, os.strerror(errno.ENOSPC))
        if staging is None:
            # The engine writes memory as it is: ``source`` gives a conj/neg
            # view's memory without its bit (put back at rebuild, Layout).
            data = layout.source(src)
            data = (data.contiguous() if layout.compact else data).reshape(-1)
            try:
                if not self.verify:
                    return (offset, [None]), FutureJob(self.file.write(data, offset), what)
                crc = [None]
                return (offset, crc), self._chain.write(self.file, data, offset, what, crc)
            except BaseException as e:
                self.arena.free(offset, nbytes)
                if isinstance(e, OSError):
                    raise TierMemError(f"tiermem: {what} failed: {e}") from e
                raise
        view = staging[:nbytes].view(layout.dtype)
        if self.uses_engine_chain and cuda:
            out = self._launch_engine(src, layout, staging, view, offset, what)
            if out is not None:
                return out
        try:
            d2h = copier_for(src.device, self._copiers).copy_out(layout.source(src),
                                                                  layout.dest_view(view))
        except BaseException:
            self.staging.release(staging, None, cuda)
            self.arena.free(offset, nbytes)
            raise
        crc = [None]
        chain = self._chain.write(self.file, view, offset, what,
                                  crc if self.verify else None, after=d2h,
                                  side=getattr(d2h, "side", None))
        # Back to the pool through the lease: NOTE [Staged moves] in moving.py.
        job = StagedJob(chain, lambda: d2h.done() and d2h.failed() is None, view,
                        StagingLease(self.staging, staging, cuda), copy_job=d2h)
        return (offset, crc), job

    def _note_disk_full(self, error: BaseException, this: str) -> None:
        if self.disk_full:
            return
        self.disk_full = self.explained_refusals = True
        _log.warning("%s: the disk is full; %s, and the nvme tier takes no new tensors from "
                     "now on (they go to the policy's next tier; counted in "
                     "stats.budget_fallbacks; shown once)", error, this)

    def _on_failure(self, h: MovedHandle, error: BaseException) -> None:
        if _os_errno(error) in _DISK_FULL_ERRNOS:
            h.step.move_failed()
            self._note_disk_full(error, f"this tensor stays {_where_kept(h)}")
            return
        super()._on_failure(h, error)

    def _give_up_engine_chain(self, what: str, e: BaseException) -> None:
        """The chain refused a request: this one goes through the Python chain,
        and later ones too unless ``e`` is about the arguments (see the module
        docstring). Warns once per store."""
        permanent = not isinstance(e, (ValueError, TypeError))
        with self._chain_error_lock:
            # Warned at the first refusal, and again when the chain is given up.
            first = self.engine_chain_error is None or (permanent and self.uses_engine_chain)
            if permanent:
                self.uses_engine_chain = False
            self.engine_chain_error = f"{type(e).__name__}: {e}"
        if first:
            _log.warning("tiermem: the C++ engine's CUDA chain refused %s (%s); %s through "
                         "the Python chain (shown once; NvmeStore.engine_chain_error)", what,
                         self.engine_chain_error,
                         "this tensor and later ones go" if permanent else "this tensor goes")

    def _launch_engine(self, src, layout, staging, view, offset, what):
        """The engine's CUDA chain: D2H on the copier's side stream after the
        compute stream, then the write, all issued and carried by the engine.
        ``None`` if the chain refused it: the caller goes on with the Python
        chain (same staging buffer and extent)."""
        copier = copier_for(src.device, self._copiers)
        try:
            fut = self.file.write_from_device(
                layout.source(src), layout.dest_view(view), offset, copier.d2h,
                torch.cuda.current_stream(src.device))
        except Exception as e:   # CUDA error, closed chain, rejected argument
            self._give_up_engine_chain(what, e)
            return None
        # Back to the pool through the lease (the engine holds it until the write
        # is done): NOTE [Staged moves] in moving.py.
        job = StagedJob(EngineCudaJob(fut, what), fut.copied, view,
                        StagingLease(self.staging, staging, True))
        return (offset, [None]), job

    # -- restore ------------------------------------------------------------------
    def _start_restore(self, h: MovedHandle):
        if self.closed:
            raise TierMemError(
                f"tiermem: the Offloader holding a {_describe(h.layout, h.module)} on NVMe was "
                "closed before backward used it; close() only after backward")
        layout = h.layout
        offset, expected = h.slot[0], h.slot[1][0]
        what = f"reading a {_describe(layout, h.module)} from {self.path} at offset {offset}"
        if layout.device.type != "cuda":
            # Page-aligned: the engine reads whole blocks straight into it (no bounce).
            itemsize = layout.dtype.itemsize
            dev = aligned_empty((layout.pad + layout.numel) * itemsize).view(layout.dtype)
            dest = dev[layout.pad:]
            if expected is None:
                return dev, FutureJob(self.file.read(dest, offset), what)
            return dev, self._chain.read(self.file, dest, offset, what, expected)
        return self._start_restore_cuda(h, offset, expected, what)

    # NOTE [Restores past the staging budget]
    # A restore that finds the staging pool full (writes in flight, staged
    # copies held: NOTE [Staged moves] in moving.py) neither pins fresh memory
    # outside every budget (what it did before: a transient pinned buffer, a
    # cudaHostAlloc and, dropped, a block torch's host cache keeps pinned) nor
    # waits for a pooled buffer (those held by staged copies of failed writes
    # never come back: a wait could hang backward). It reads into a page-aligned
    # pageable buffer and copies from it through the Python chain: CUDA stages
    # a pageable H2D copy itself and returns once the bytes are staged, so the
    # chain thread (never the backward thread) blocks for the copy, and the
    # buffer may be dropped after it. Counted in ``unpinned_restores``.
    def _start_restore_cuda(self, h, offset, expected, what):
        layout = h.layout
        device = layout.device
        copier = copier_for(device, self._copiers)
        compute = torch.cuda.current_stream(device)
        # Allocated on the compute stream: see NOTE [Stream lifetime] 2 in runtime/copier.py.
        dev = torch.empty(layout.pad + layout.numel, dtype=layout.dtype, device=device)
        staging = self.staging.acquire(layout.nbytes, pinned=True)
        pooled = staging is not None
        if not pooled:
            # Pageable: see NOTE [Restores past the staging budget].
            staging = aligned_empty(layout.nbytes)
            self.unpinned_restores += 1
        view = staging[:layout.nbytes].view(layout.dtype)
        side = copier.h2d
        if self.uses_engine_chain and pooled:   # the engine's chain takes pinned staging only
            # The engine records the compute stream's point now (nothing was
            # queued on it since `dev` was allocated) and copies after it.
            try:
                fut = self.file.read_to_device(view, dev[layout.pad:], offset, side, compute)
            except Exception as e:   # CUDA error, closed chain, rejected argument
                self._give_up_engine_chain(what, e)
            else:
                job = EngineCudaJob(fut, what, device, compute)
                if pooled:   # handed out again once the copy is complete
                    self.staging.release(staging, job, True)
                return dev, job
        allocated = torch.cuda.Event()
        allocated.record(compute)
        staging_pool = self.staging
        release = None if not pooled else (
            lambda job: staging_pool.release(staging, job, True))
        job = self._chain.read_to_device(self.file, view, dev[layout.pad:], offset, what,
                                         expected, side, compute, allocated, release)
        return dev, job

    # -- release --------------------------------------------------------------------
    def _free(self, h: MovedHandle) -> None:
        # From the handle's finalizer: no lock (NOTE [Releases from finalizers]
        # in memory/hostpool.py); filed by the next poll, settle or close.
        self._released.append((h.last_job, h.slot[0], h.nbytes))

    def _free_finished(self) -> None:
        with self._deferred_lock:
            released = self._released
            while released:
                self._deferred.append(released.popleft())
            deferred = self._deferred
            i = 0
            while i < len(deferred):
                job, offset, nbytes = deferred[i]
                if job is None or job.done():   # None: reserved, never written
                    # Off the list before it is freed: an interrupt between the
                    # two leaks the extent, never frees it twice (NOTE
                    # [Interrupted updates] in memory/arena.py, rule 3).
                    del deferred[i]
                    self.arena.free(offset, nbytes)
                else:
                    i += 1

    def poll(self) -> None:
        super().poll()
        if self._deferred or self._released:
            self._free_finished()

    def remove_dir(self) -> None:
        """Remove the private directory now (what the finalizer does at exit)."""
        self._dir.remove()

    def settle(self) -> None:
        """Wait for every I/O in flight: writes land, and the extents of handles
        released while their I/O was in flight go back to the arena."""
        self.drain()
        self._free_finished()
        with self._deferred_lock:
            deferred = list(self._deferred)
        for job, _, _ in deferred:
            if job is None:
                continue
            try:
                job.wait_host()
            except Exception:
                pass   # a failed write/read: the extent is free all the same
        self._free_finished()

    def close(self) -> None:
        """Wait for I/O in flight, close the file and remove the directory."""
        if self.closed:
            return
        try:
            self.settle()
        finally:
            self.closed = True
            self._chain.shutdown()
            self.file.close()
            self._finalizer()
            self.staging.clear()
            release_engine(self.engine)   # its threads end if no other store holds it


