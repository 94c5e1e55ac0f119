"""Asynchronous copies between a tensor's device and host buffers.

Two engines with one interface, ``copy_out(src, dst) -> Job`` and
``restore(host, pad, dtype) -> (tensor, Job)`` (allocate ``pad`` + the host
buffer's elements on the device and copy in after the pad):

- :class:`CudaCopier`: one device-to-host and one host-to-device side stream
  per device; copies wait on the compute stream with an event, never on the
  host. Its jobs (:class:`~tiermem.runtime.jobs.CudaJob`) are done when the event is;
  a consumer orders itself after the copy with ``order_before_use()``
  (``current_stream.wait_event``).
- :class:`ThreadCopier`: for CPU tensors (and CPU-only machines), two worker
  threads (out, in) run ``dst.copy_(src)`` in FIFO order; torch releases the
  GIL inside the copy. ``Job.order_before_use()`` blocks until the copy is done.
  At exit they finish their queue first (NOTE [Copy threads at exit]).
  This runs the same wait/free ordering as CUDA in CI.
"""

# NOTE [Stream lifetime]
# No block is reused while a copy on a side stream may still read or write it:
# 1. Copy out: the D2H stream waits for the compute stream (event recorded at
#    pack), so it reads the tensor after its producer wrote it. The handle holds
#    the source until the forward thread sees the copy done, so the allocator may
#    hand the block to the compute stream at once: no ``record_stream``.
# 2. Copy in: the destination is allocated with the compute stream current (its
#    pool); the H2D stream waits on the compute stream (the block may be one that
#    queued kernels still read), copies, and the consumer waits on the copy's
#    event; a consumer on another stream ``record_stream``-s it. A restore dropped
#    unconsumed, or a source whose handle died before its copy landed, is
#    ``record_stream``-ed on the side stream first.
# 3. Pinned buffers: a buffer goes back to the pool with the job that last used
#    it and is handed out again only once that job is done (``HostPool.acquire``).

# NOTE [Temporaries on the compute stream]
# A dense device temporary (for a source that cannot be copied as raw bytes: a
# gapped view, a lazy conjugate or negative view) comes from the compute
# stream's pool and goes back there, so no device memory is stranded in a side
# stream's pool. It is made on the compute stream before the side stream is
# ordered after it; the job holds it (``CudaJob.temp``) until the copy is
# ordered before any reuse (seen done, or ``order_after_copy``), and an abandoned
# one is ``record_stream``-ed on the side stream first. The C++ chain does the
# same (write_from_device's ``resolved``, csrc/cuda_chain.cpp).

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from typing import Callable, Optional

import torch

from .jobs import CudaJob, Job, ThreadJob

__all__ = ["ThreadCopier", "CudaCopier", "copier_for"]

_log = logging.getLogger("tiermem")


class _Worker:
    """One daemon thread running copy jobs in FIFO order. See NOTE [Copy
    threads at exit]."""

    def __init__(self, name: str) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> ThreadJob:
        job = ThreadJob()
        with self._lock:
            if not self._stopped:
                self._queue.put((fn, job))
                return job
        _run_job(fn, job)   # stopped (the interpreter is exiting): here, at once
        return job

    def stop(self, timeout_s: float) -> bool:
        """Run what is queued, then end the thread; later submits run on the
        caller. True if the thread ended within ``timeout_s``."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _run_job(*item)
            del item


def _run_job(fn: Callable[[], None], job: ThreadJob) -> None:
    error = None
    try:
        fn()
    except BaseException as e:  # handed to the waiter, never lost
        error = e
    job.finish(error)


class ThreadCopier:
    """Copies on two process-wide worker threads (see module docstring)."""

    _lock = threading.Lock()
    _workers: Optional[tuple] = None

    def __init__(self) -> None:
        with ThreadCopier._lock:
            if ThreadCopier._workers is None:
                ThreadCopier._workers = (_Worker("tiermem-copy-out"), _Worker("tiermem-copy-in"))
        self._out, self._in = ThreadCopier._workers

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> Job:
        return self._out.submit(lambda: dst.copy_(src))

    def restore(self, src: torch.Tensor, pad: int, dtype: torch.dtype):
        dst = torch.empty(pad + src.numel(), dtype=dtype)
        return dst, self._in.submit(lambda: dst[pad:].copy_(src))


class CudaCopier:
    """Copies on two side streams of one CUDA device. See NOTE [Stream lifetime]."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def _copy(self, stream, src: torch.Tensor, dst: torch.Tensor) -> Job:
        compute = torch.cuda.current_stream(self.device)
        temp = None
        if src.is_cuda:
            # On the compute stream: NOTE [Temporaries on the compute stream].
            # Conj/neg views resolved on the device: a D2H copy_ of such a view
            # applies them on the host before the bytes land (pytorch#146286).
            dense = src.resolve_conj().resolve_neg().contiguous()
            if dense.data_ptr() != src.data_ptr():   # a new tensor: gathered or resolved
                src = temp = dense
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            # blocking: a host wait on it (a worker thread of the nvme tier,
            # drain) sleeps instead of spinning a CPU core.
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        return CudaJob(event, self.device, compute, stream, temp)

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> Job:
        return self._copy(self.d2h, src, dst)

    def restore(self, src: torch.Tensor, pad: int, dtype: torch.dtype):
        # Allocated while the compute stream is current: see NOTE [Stream lifetime] 2.
        dst = torch.empty(pad + src.numel(), dtype=dtype, device=self.device)
        return dst, self._copy(self.h2d, src, dst[pad:])


def _after_fork_in_child() -> None:
    """The workers did not survive the fork: the next ThreadCopier starts new
    ones (NOTE [Fork] in offloader.py)."""
    ThreadCopier._workers = None
    ThreadCopier._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: How long the exit hook waits for the copy threads' queued copies.
_EXIT_JOIN_SECONDS = 60.0


# NOTE [Copy threads at exit]
# ThreadCopier's workers are daemon threads, and a copy runs inside torch with
# the GIL released. When the interpreter finalizes (after atexit), a daemon
# thread that takes the GIL back is ended by CPython with pthread_exit, whose
# forced unwinding through pybind11's noexcept ``~gil_scoped_release`` calls
# std::terminate: the process dies with SIGABRT and "terminate called without
# an active exception". A copy is in flight at exit whenever a program ends
# with a forward's copies queued (no backward, no close) or with a prefetched
# restore nobody consumed (close does not wait for those). So an atexit hook
# (it runs before finalization) stops the workers: they run what is queued and
# end; copies submitted after it (an atexit hook that ran later) run on the
# submitting thread. tests/test_exit.py runs such programs in subprocesses.
@atexit.register
def _stop_workers_at_exit() -> None:
    with ThreadCopier._lock:
        workers = ThreadCopier._workers or ()
    for w in workers:
        if not w.stop(_EXIT_JOIN_SECONDS):   # pragma: no cover - a copy that never ends
            _log.warning("tiermem: a copy thread (%s) still runs %.0f s after exit began; "
                         "the interpreter may abort when it finalizes",
                         w._thread.name, _EXIT_JOIN_SECONDS)


def copier_for(device: torch.device, cache: dict):
    """The copier for tensors on ``device`` (cached in ``cache``)."""
    key = (device.type, device.index)
    c = cache.get(key)
    if c is None:
        c = cache[key] = CudaCopier(device) if device.type == "cuda" else ThreadCopier()
    return c
