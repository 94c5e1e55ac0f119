"""The Python chain of the nvme tier: requests that need Python between two steps.

A pool of ``io_threads`` threads carries the requests the I/O engine cannot
carry alone (module docstring of tiers/nvme.py): a write that must first wait
for a device-to-host copy into staging, a read followed by a host-to-device
copy, and every request with ``verify`` (the CRC32 is taken in Python between
the copy and the write, and checked after the read). Each request returns a
:class:`~tiermem.jobs.ChainJob`; an ``OSError`` becomes a
:class:`~tiermem.TierMemError` naming the request (``what``).
"""

from __future__ import annotations

import concurrent.futures
import zlib
from typing import Callable, List, Optional

import torch

from ..errors import TierMemError
from ..jobs import ChainJob, EventJob, Job

__all__ = ["PythonChain", "crc32"]


def crc32(t: torch.Tensor) -> int:
    """CRC32 of a CPU tensor's bytes."""
    return zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _check(data: torch.Tensor, expected: Optional[int], what: str) -> None:
    if expected is not None and crc32(data) != expected:
        raise TierMemError(
            f"tiermem: checksum mismatch {what} (TIERMEM_VERIFY): the file was changed "
            "underneath tiermem or the disk returned bad data")


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

    def read_to_device(self, file, view: torch.Tensor, dest: torch.Tensor, offset: int,
                       what: str, expected: Optional[int], side, compute, allocated,
                       release_staging: Optional[Callable[[Optional[Job]], None]]) -> ChainJob:
        """Read into the pinned ``view``, check it, then copy it into the CUDA
        tensor ``dest`` on the side stream ``side`` after the event
        ``allocated`` (recorded on ``compute``, the stream ``dest`` was
        allocated on, when it was made).
        ``release_staging(job)`` gives the staging buffer back (``job``: the
        copy out of it, or ``None`` if the read failed)."""
        device = dest.device

        def run():
            done = None
            try:
                file.read(view, offset).wait()
                _check(view, expected, what)
                with torch.cuda.device(device), torch.cuda.stream(side):
                    side.wait_event(allocated)
                    dest.copy_(view, non_blocking=True)
                    done = torch.cuda.Event(blocking=True)   # host waits sleep
                    done.record(side)
                dest.record_stream(side)
                return done
            finally:   # also when the read or the check failed: back to the pool
                if release_staging is not None:
                    release_staging(None if done is None else EventJob(done))
        return self._submit(run, what, device=device, stream=compute,
                            side=side)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

