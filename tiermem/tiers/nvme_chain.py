"""The Python chain of the nvme tier: requests that need Python between two steps.

A pool of ``io_threads`` threads carries the requests the I/O engine cannot
carry alone (module docstring of tiers/nvme.py): a write that must first wait
for a device-to-host copy into staging, a read followed by a host-to-device
copy, and every request with ``verify`` (the CRC32 is taken in Python between
the copy and the write, and checked after the read). Each request returns a
:class:`~tiermem.runtime.jobs.ChainJob`; an ``OSError`` becomes a
:class:`~tiermem.TierMemError` naming the request (``what``).
"""

from __future__ import annotations

import concurrent.futures
import threading
import zlib
from typing import Callable, List, Optional

import torch

from ..errors import TierMemError
from ..runtime.jobs import ChainJob, EventJob, Job, ReadCopyJob

__all__ = ["PythonChain", "ReadThenCopy", "crc32"]


def crc32(t: torch.Tensor) -> int:
    """CRC32 of a CPU tensor's bytes."""
    return zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _check(data: torch.Tensor, expected: Optional[int], what: str) -> None:
    if expected is not None and crc32(data) != expected:
        raise TierMemError(
            f"tiermem: checksum mismatch {what} (TIERMEM_VERIFY): the file was changed "
            "underneath tiermem or the disk returned bad data")


# NOTE [Waiting only for the read]
# A consumer waits on the host only for its own read, never for requests queued
# before it nor for a chain thread to issue the copy (ReadThenCopy):
# 1. a read no thread has started yet is read by the consumer itself, at once
#    (the chain thread that later picks it finds it taken);
# 2. a read in progress: the consumer waits for that read alone, on the host
#    (the bytes are not in memory yet; counted in StepStats.host_waits);
# 3. a read done: whichever thread comes first issues the copy (exactly once);
#    the consumer then waits for it on the device only (CUDA: its stream waits
#    on the copy's event).
# The staging buffer goes back to its pool once, right after the copy is issued
# (or the read failed), with the copy as its last use.


class ReadThenCopy:
    """A read, then a copy, each run exactly once by whichever thread comes
    first: NOTE [Waiting only for the read]. ``read()`` raises on failure;
    ``copy()`` returns what the consumer orders itself after (a CUDA event)
    or ``None``; ``release(done)`` is called once after the copy was issued
    (``done``: its result) or the read or copy failed (``None``)."""

    __slots__ = ("_read", "_copy", "_release", "_lock", "_claimed", "_issuing",
                 "_read_done", "_finished", "result", "error", "read_by")

    def __init__(self, read: Callable[[], None], copy: Callable[[], Optional[object]],
                 release: Optional[Callable[[Optional[object]], None]] = None) -> None:
        self._read, self._copy, self._release = read, copy, release
        self._lock = threading.Lock()
        self._claimed = False
        self._issuing = False
        self._read_done = threading.Event()
        self._finished = threading.Event()
        self.result: Optional[object] = None
        self.error: Optional[BaseException] = None
        #: The thread that ran the read (tests; stall diagnostics).
        self.read_by: Optional[str] = None

    def run(self) -> None:
        """Read (unless another thread has started), then issue the copy."""
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        self.read_by = threading.current_thread().name
        try:
            self._read()
        except BaseException as e:   # handed to the consumer, never lost
            self.error = e
        self._read_done.set()
        self._issue()

    def _issue(self) -> None:
        with self._lock:
            if self._issuing:
                return
            self._issuing = True
        try:
            if self.error is None:
                self.result = self._copy()
        except BaseException as e:
            self.error = e
        finally:
            try:
                if self._release is not None:
                    self._release(None if self.error is not None else self.result)
            finally:
                self._finished.set()

    def read_done(self) -> bool:
        """The read has finished (the copy may not be issued yet)."""
        return self._read_done.is_set()

    def finished(self) -> bool:
        """The copy is issued, or the task failed."""
        return self._finished.is_set()

    def wait(self):
        """For the consumer: read now if nobody has started, else wait for the
        read alone; issue the copy if nobody has; return its result (raise the
        task's error)."""
        self.run()
        self._read_done.wait()
        self._issue()
        self._finished.wait()   # the other thread is issuing the copy: no disk wait
        if self.error is not None:
            raise self.error
        return self.result


class PythonChain:
    """``io_threads`` threads running nvme requests in Python (module docstring)."""

    def __init__(self, io_threads: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix="tiermem-nvme")

    def _submit(self, fn: Callable[[], Optional[object]], what: str, **job_args) -> ChainJob:
        def run():
            try:
                return fn()
            except OSError as e:
                raise TierMemError(f"tiermem: {what} failed: {e}") from e
        return ChainJob(self._pool.submit(run), **job_args)

    def write(self, file, data: torch.Tensor, offset: int, what: str,
              crc: Optional[List[Optional[int]]], after: Optional[Job] = None,
              side=None) -> ChainJob:
        """Write ``data`` at ``offset`` once ``after`` (a copy into ``data``) is
        done; ``crc[0]`` gets its checksum first when ``crc`` is given."""
        def run():
            if after is not None:
                after.wait_host()
            if crc is not None:
                crc[0] = crc32(data)
            file.write(data, offset).wait()
        return self._submit(run, what, side=side)

    def read(self, file, dest: torch.Tensor, offset: int, what: str,
             expected: Optional[int]) -> ChainJob:
        """Read into ``dest`` (host memory) and check its checksum if ``expected``."""
        def run():
            file.read(dest, offset).wait()
            _check(dest, expected, what)
        return self._submit(run, what)

    def read_then(self, read: Callable[[], None], copy: Callable[[], Optional[object]],
                  what: str, release: Optional[Callable[[Optional[object]], None]] = None,
                  ) -> ReadThenCopy:
        """Queue ``read`` then ``copy`` (NOTE [Waiting only for the read]); an
        ``OSError`` of the read becomes a :class:`~tiermem.TierMemError` naming
        ``what``."""
        def checked_read():
            try:
                read()
            except OSError as e:
                raise TierMemError(f"tiermem: {what} failed: {e}") from e
        task = ReadThenCopy(checked_read, copy, release)
        self._pool.submit(task.run)
        return task

    def read_to_device(self, file, view: torch.Tensor, dest: torch.Tensor, offset: int,
                       what: str, expected: Optional[int], side, compute, allocated,
                       release_staging: Optional[Callable[[Optional[Job]], None]]
                       ) -> ReadCopyJob:
        """Read into the pinned ``view``, check it, then copy it into the CUDA
        tensor ``dest`` on the side stream ``side`` after the event
        ``allocated`` (recorded on ``compute``, the stream ``dest`` was
        allocated on, when it was made). The consumer waits on the host for
        the read only (NOTE [Waiting only for the read]).
        ``release_staging(job)`` gives the staging buffer back (``job``: the
        copy out of it, or ``None`` if the read failed)."""
        device = dest.device

        def read():
            file.read(view, offset).wait()
            _check(view, expected, what)

        def copy():
            with torch.cuda.device(device), torch.cuda.stream(side):
                side.wait_event(allocated)
                dest.copy_(view, non_blocking=True)
                done = torch.cuda.Event(blocking=True)   # host waits sleep
                done.record(side)
            dest.record_stream(side)
            return done

        release = None if release_staging is None else (
            lambda done: release_staging(None if done is None else EventJob(done)))
        task = self.read_then(read, copy, what, release)
        return ReadCopyJob(task, device=device, stream=compute, side=side)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

