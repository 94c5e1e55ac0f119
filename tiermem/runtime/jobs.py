"""Asynchronous completion: one :class:`Job` protocol for every copy and I/O in flight.

A job is a move out or a restore that is still running somewhere else: a
CUDA side stream, a copy worker thread, the I/O engine, a Python chain thread.
Tiers and pools see only the protocol:

- ``done()``: finished (successfully or not); never blocks;
- ``failed()``: the error of a finished job, else ``None``;
- ``wait_host()``: block the host until finished (re-raises the error);
- ``order_before_use(tensor)``: make the current consumer (the host thread,
  or the current CUDA stream) see what the job wrote into ``tensor``;
- ``host_ready()``: ``order_before_use`` would not block the host (at most a
  GPU-side wait); never blocks;
- ``abandon(tensor)``: ``tensor`` (source or destination) is dropped while
  the job may still run.

On CUDA, ordering a consumer after a copy is always the same two steps, done
by :func:`use_after_event`: the consumer's stream waits on the copy's event
(no host wait), and a tensor consumed on another stream than the one it was
allocated on is ``record_stream``-ed there (NOTE [Stream lifetime] in runtime/copier.py).

Kinds: :class:`ThreadJob` (a worker thread's copy), :class:`CudaJob` (a copy on
a side stream, its event), :class:`FutureJob` (an engine future, CPU tensors),
:class:`ChainJob` (a Python chain thread), :class:`ReadCopyJob` (a
read then a CUDA copy, NOTE [Waiting only for the read] in tiers/nvme_chain.py),
:class:`EngineCudaJob` (the C++ engine's CUDA chain), :class:`EventJob` (one
event), :class:`AllDone` (a job and events, all complete), :class:`StagedJob`
(a move through a staging buffer, NOTE [Staged moves] in tiers/moving.py).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from ..errors import TierMemError

__all__ = ["Job", "use_after_event", "ThreadJob", "CudaJob", "FutureJob", "ChainJob",
           "ReadCopyJob", "EngineCudaJob", "EventJob", "AllDone", "StagedJob"]


class Job:
    """A copy or I/O in flight (see the module docstring)."""

    def done(self) -> bool:
        raise NotImplementedError

    def failed(self) -> Optional[BaseException]:
        """The exception the finished job raised, else ``None``."""
        return None

    def wait_host(self) -> None:
        """Block the host until the job is complete (re-raises its error)."""
        raise NotImplementedError

    def order_before_use(self, tensor=None) -> None:
        """Make the current consumer see the job's writes (default: a host wait)."""
        self.wait_host()

    def host_ready(self) -> bool:
        """``order_before_use`` would not block the host (default: done)."""
        return self.done()

    def abandon(self, tensor) -> None:
        """``tensor`` is dropped while the job may still run (default: nothing,
        for jobs whose runner holds what it uses until it is done)."""

    def order_after_copy(self) -> bool:
        """For a move out: order every later use of the source's memory after
        the copy out of it, without a host wait, and return ``True``; or do
        nothing and return ``False`` when this job cannot (the default). See
        NOTE [In-flight window] in tiers/moving.py."""
        return False


def use_after_event(event, device: torch.device, alloc_stream, tensor=None) -> None:
    """Order the current CUDA stream after ``event``; ``tensor`` (allocated on
    ``alloc_stream``) is ``record_stream``-ed if consumed on another stream."""
    current = torch.cuda.current_stream(device)
    current.wait_event(event)
    if tensor is not None and current != alloc_stream:
        tensor.record_stream(current)


class ThreadJob(Job):
    """A function run by a worker thread (``finish`` is called by the worker)."""

    __slots__ = ("_event", "error")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: Optional[BaseException] = None

    def finish(self, error: Optional[BaseException]) -> None:
        self.error = error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait_host(self) -> None:
        self._event.wait()
        if self.error is not None:
            raise self.error

    def failed(self):
        return self.error if self._event.is_set() else None


class CudaJob(Job):
    """A copy on side stream ``side``, complete when ``event`` is; its
    destination was allocated on ``stream`` (a copy out: the stream it was
    ordered after). ``temp``: a dense temporary made on ``stream`` that the
    copy reads, held until the copy is ordered before its reuse (NOTE
    [Temporaries on the compute stream] in runtime/copier.py)."""

    __slots__ = ("event", "device", "stream", "side", "temp")

    def __init__(self, event, device: torch.device, stream, side, temp=None) -> None:
        self.event = event
        self.device = device
        self.stream = stream
        self.side = side
        self.temp = temp

    def done(self) -> bool:
        if not self.event.query():
            return False
        self.temp = None
        return True

    def order_before_use(self, tensor=None) -> None:
        use_after_event(self.event, self.device, self.stream, tensor)

    def host_ready(self) -> bool:
        return True   # a GPU-side wait

    def abandon(self, tensor) -> None:
        tensor.record_stream(self.side)
        temp, self.temp = self.temp, None
        if temp is not None:
            temp.record_stream(self.side)

    def order_after_copy(self) -> bool:
        """The stream the copy was ordered after (the source's producer) and
        the current stream wait on the copy's event: a GPU-side wait."""
        self.stream.wait_event(self.event)
        current = torch.cuda.current_stream(self.device)
        if current != self.stream:
            current.wait_event(self.event)
        self.temp = None   # made on ``stream``: its reuse there is ordered now
        return True

    def wait_host(self) -> None:
        self.event.synchronize()
        self.temp = None


class EventJob(Job):
    """Complete when ``event`` (a CUDA event) is."""

    __slots__ = ("event",)

    def __init__(self, event) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait_host(self) -> None:
        self.event.synchronize()


class FutureJob(Job):
    """An engine future (CPU tensors). Once done, it lets go of the future, and
    with it of the buffer the future holds (a landed write must free the saved
    tensor's memory). ``what`` names the request in errors."""

    __slots__ = ("fut", "what", "error")

    def __init__(self, fut, what: str) -> None:
        self.fut = fut
        self.what = what
        self.error = None

    def done(self) -> bool:
        if self.fut is None:
            return True
        if not self.fut.done():
            return False
        self._finish()
        return True

    def _finish(self) -> None:
        fut, self.fut = self.fut, None
        try:
            fut.wait()
        except OSError as e:
            self.error = TierMemError(f"tiermem: {self.what} failed: {e}")
            self.error.__cause__ = e

    def wait_host(self) -> None:
        if self.fut is not None:
            self._finish()
        if self.error is not None:
            raise self.error

    def failed(self):
        return self.error if self.done() else None


class ChainJob(Job):
    """Work on a Python chain thread (a ``concurrent.futures.Future`` whose
    result is ``None`` or the event of a CUDA copy it issued on ``side``)."""

    __slots__ = ("cf", "device", "stream", "side")

    def __init__(self, cf, device=None, stream=None, side=None) -> None:
        self.cf = cf
        self.device = device
        self.stream = stream    # stream the destination was allocated on
        self.side = side        # side stream of the CUDA copy

    def done(self) -> bool:
        if not self.cf.done():
            return False
        if self.cf.exception() is not None:
            return True
        event = self.cf.result()
        return event is None or event.query()

    def wait_host(self) -> None:
        event = self.cf.result()   # re-raises the chain's error
        if event is not None:
            event.synchronize()

    def failed(self):
        return self.cf.exception() if self.cf.done() else None

    def order_before_use(self, tensor=None) -> None:
        event = self.cf.result()   # the host waits for the chain's work (a read)
        if event is not None:
            use_after_event(event, self.device, self.stream, tensor)

    def abandon(self, tensor) -> None:
        if self.side is not None:
            tensor.record_stream(self.side)


class ReadCopyJob(Job):
    """A read then a copy (:class:`~tiermem.tiers.nvme_chain.ReadThenCopy`):
    the consumer waits on the host for the read only, and on the device for
    the copy (NOTE [Waiting only for the read] in tiers/nvme_chain.py).
    ``stream``: the stream the destination was allocated on; ``side``: the
    copy's stream (``None``: the copy's result is not a CUDA event)."""

    __slots__ = ("task", "device", "stream", "side")

    def __init__(self, task, device=None, stream=None, side=None) -> None:
        self.task = task
        self.device = device
        self.stream = stream
        self.side = side

    def done(self) -> bool:
        task = self.task
        if not task.finished():
            return False
        return task.error is not None or task.result is None or task.result.query()

    def failed(self):
        return self.task.error if self.task.finished() else None

    def host_ready(self) -> bool:
        return self.task.read_done()

    def wait_host(self) -> None:
        event = self.task.wait()
        if event is not None:
            event.synchronize()

    def order_before_use(self, tensor=None) -> None:
        event = self.task.wait()   # the host waits for the read only
        if event is not None:
            use_after_event(event, self.device, self.stream, tensor)

    def abandon(self, tensor) -> None:
        if self.side is not None:
            tensor.record_stream(self.side)


class EngineCudaJob(Job):
    """A request of the engine's CUDA chain (a ``CudaFuture``, see NOTE [CUDA
    chain] in csrc/cuda_chain.cpp). ``stream``: for a read, the stream the
    destination was allocated on; ``None`` for a write.

    ``done()`` is true once everything has completed (a read: its H2D copy
    too). The engine holds the device tensor and the staging buffer until its
    copy is complete, so ``abandon`` has nothing to do (no ``record_stream``);
    a consumed read's device tensor it lets go of as soon as a stream is
    ordered after the copy (NOTE [CUDA chain lifetime] in csrc/cuda_chain.cpp)."""

    __slots__ = ("fut", "what", "device", "stream", "error")

    def __init__(self, fut, what: str, device=None, stream=None) -> None:
        self.fut = fut
        self.what = what
        self.device = device
        self.stream = stream
        self.error = None

    def _failure(self, e: OSError) -> TierMemError:
        if self.error is None:
            self.error = TierMemError(f"tiermem: {self.what} failed: {e}")
            self.error.__cause__ = e
        return self.error

    def done(self) -> bool:
        return self.fut.done()

    def wait_host(self) -> None:
        try:
            self.fut.synchronize()
        except OSError as e:
            raise self._failure(e) from e

    def failed(self):
        if not self.fut.done():
            return None
        try:
            self.fut.wait()   # done: returns at once, or raises the request's error
        except OSError as e:
            return self._failure(e)
        return None

    def host_ready(self) -> bool:
        # A read: its pread is done and its copy issued, so stream_wait() does
        # not block the host. A write: done.
        return self.fut.issued() if self.stream is not None else self.done()

    def order_before_use(self, tensor=None) -> None:
        if self.stream is None:
            self.wait_host()
            return
        current = torch.cuda.current_stream(self.device)
        try:
            # The host waits for the read only; the stream waits for the copy.
            self.fut.stream_wait(current.cuda_stream)
        except OSError as e:
            raise self._failure(e) from e
        if tensor is not None and current != self.stream:
            tensor.record_stream(current)


class AllDone(Job):
    """Done when ``job`` is (if any) and every CUDA event of ``events`` has
    completed (a staging buffer's last uses, for its pool)."""

    __slots__ = ("job", "events")

    def __init__(self, job, events: list) -> None:
        self.job, self.events = job, events

    def done(self) -> bool:
        return ((self.job is None or self.job.done())
                and all(e.query() for e in self.events))

    def wait_host(self) -> None:
        """Block the host until ``job`` (re-raising its error) and every event
        are complete. ``events`` is the lease's list, which its
        ``hold_until`` may still change: a copy is walked."""
        if self.job is not None:
            self.job.wait_host()
        for e in list(self.events):
            e.synchronize()


class StagedJob(Job):
    """A move through a staging buffer (NOTE [Staged moves] in tiers/moving.py):
    ``job`` is the whole move; ``copied()`` is true once the bytes are in
    ``host_view``; ``lease`` gives the buffer back to its pool. ``copy_job``:
    the copy into staging as a job of its own, when there is one (the Python
    chain; ``None`` for the engine's chain, which keeps it inside)."""

    __slots__ = ("job", "copied", "host_view", "lease", "copy_job")

    def __init__(self, job: Job, copied, host_view: torch.Tensor, lease,
                 copy_job: Optional[Job] = None) -> None:
        self.job = job
        self.copied = copied
        self.host_view = host_view
        self.lease = lease
        self.copy_job = copy_job
        lease.job = self

    def order_after_copy(self) -> bool:
        return self.copy_job is not None and self.copy_job.order_after_copy()

    def wait_copied(self) -> None:
        """Block the host until the bytes are in staging (or the move is over)."""
        if self.copy_job is not None:
            self.copy_job.wait_host()
        else:
            self.job.wait_host()

    def done(self) -> bool:
        return self.job.done()

    def wait_host(self) -> None:
        self.job.wait_host()

    def failed(self):
        return self.job.failed()

    def order_before_use(self, tensor=None) -> None:
        self.job.order_before_use(tensor)

    def host_ready(self) -> bool:
        return self.job.host_ready()

    def abandon(self, tensor) -> None:
        self.job.abandon(tensor)
