"""The pure-Python I/O engine: the fallback when the C++ extension cannot be built.

Same interface and semantics as the C++ engine (see :mod:`tiermem.io.base`):
a pool of worker threads doing ``os.pwrite`` / ``os.preadv`` (both release the
GIL) on an O_DIRECT file descriptor, with a per-thread page-aligned bounce
buffer (anonymous ``mmap``) for unaligned buffers and partial last blocks.

A plain thread pool was measured against an aiofiles-based variant (asyncio
loop + ``aiofiles.os.wrap`` executors) in ``benchmarks/bench_io.py`` and kept
as the faster; see ``benchmarks/results/2026-11-29-cpu-io.json``.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import logging
import mmap
import os
import queue
import threading
from typing import Callable, Optional

import torch

from .base import (ALIGN_BYTES, IOEngine, IOFile, IOFuture, check_request, chunk_bytes,
                   io_error, short_read_detail)

__all__ = ["PythonEngine"]

_log = logging.getLogger("tiermem")

_BOUNCE_BYTES = 4 << 20
_ZEROS = bytes(ALIGN_BYTES)
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_O_DIRECT = getattr(os, "O_DIRECT", 0)

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _fallocate.restype = ctypes.c_int


class _Failure(Exception):
    """A failed step of a chunk: errno and an optional detail."""

    def __init__(self, err: int, detail: Optional[str] = None):
        super().__init__(err, detail)
        self.err = err
        self.detail = detail


class _Future(IOFuture):
    __slots__ = ("_cond", "_left", "_err", "_detail", "_buf", "_op", "_path", "_nbytes",
                 "_offset", "_on_done")

    def __init__(self, op: str, path: str, nbytes: int, offset: int, buf, chunks: int,
                 on_done: Optional[Callable[[], None]]):
        self._cond = threading.Condition(threading.Lock())
        self._left = chunks
        self._err = 0
        self._detail: Optional[str] = None
        self._buf = buf  # keeps the tensor alive until done
        self._op, self._path, self._nbytes, self._offset = op, path, nbytes, offset
        self._on_done = on_done

    def _chunk_done(self, failure: Optional[_Failure]) -> None:
        with self._cond:
            if failure is not None and not self._err:
                self._err, self._detail = failure.err, failure.detail
            self._left -= 1
            last = self._left == 0
            if last:
                self._buf = None
                self._cond.notify_all()
        if last and self._on_done is not None:
            self._on_done()

    def _failed(self) -> bool:
        return bool(self._err)

    def wait(self) -> None:
        with self._cond:
            while self._left:
                self._cond.wait()
            if self._err:
                raise io_error(self._err, self._op, self._path, self._nbytes, self._offset,
                               self._detail)

    def done(self) -> bool:
        return self._left == 0


def _pwrite_full(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, off)
        if n == 0:
            raise _Failure(_errno.EIO, "the write made no progress")
        mv, off = mv[n:], off + n


def _pread_full(fd: int, mv: memoryview, off: int) -> int:
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], off + got)
        if n == 0:
            break
        got += n
    return got


class _Bounce(threading.local):
    """Each worker thread's page-aligned staging buffer (anonymous mmap)."""

    def get(self, nbytes: int) -> memoryview:
        mv = getattr(self, "mv", None)
        if mv is None or len(mv) < nbytes:
            size = -(-max(nbytes, ALIGN_BYTES) // ALIGN_BYTES) * ALIGN_BYTES
            m = mmap.mmap(-1, size)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer pages to pin per direct I/O
                m.madvise(mmap.MADV_HUGEPAGE)
            self.mv = mv = memoryview(m)
        return mv


_bounce = _Bounce()


class _PyFile(IOFile):
    def __init__(self, engine: "PythonEngine", path: str, fd: int, direct: bool):
        self._engine = engine
        self.path = path
        self._fd = fd
        self.direct = direct
        self._cond = threading.Condition(threading.Lock())
        self._inflight = 0
        self._closed = False

    # -- requests

    def write(self, buf: torch.Tensor, offset: int) -> IOFuture:
        return self._submit(True, buf, offset)

    def read(self, buf: torch.Tensor, offset: int) -> IOFuture:
        return self._submit(False, buf, offset)

    def _submit(self, is_write: bool, buf: torch.Tensor, offset: int) -> IOFuture:
        op = "write" if is_write else "read"
        nbytes = check_request(buf, offset, op)
        if nbytes == 0:
            return _Future(op, self.path, 0, offset, None, 0, None)
        chunk = chunk_bytes(nbytes, self._engine.threads)
        n_chunks = -(-nbytes // chunk)
        with self._cond:
            if self._closed:
                raise io_error(_errno.EBADF, op, self.path, nbytes, offset, "the file is closed")
            self._inflight += 1
        fut = _Future(op, self.path, nbytes, offset, buf, n_chunks, self._request_done)
        addr = buf.data_ptr()
        mv = memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B")
        run = self._write_chunk if is_write else self._read_chunk
        try:
            self._engine._dispatch([
                (run, fut, mv[s:s + chunk], (addr + s) % ALIGN_BYTES == 0, offset + s,
                 offset + nbytes)
                for s in range(0, nbytes, chunk)])
        except BaseException:
            self._request_done()
            raise
        return fut

    def _request_done(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def _write_chunk(self, mv: memoryview, aligned: bool, off: int, end: int) -> None:
        fd, n = self._fd, len(mv)
        tail = n % ALIGN_BYTES
        if not self.direct:
            _pwrite_full(fd, mv, off)
            if tail:
                _pwrite_full(fd, memoryview(_ZEROS)[tail:], off + n)
            return
        body = n - tail
        if body and aligned:
            _pwrite_full(fd, mv[:body], off)
        elif body:
            b = _bounce.get(min(body, _BOUNCE_BYTES))
            for s in range(0, body, _BOUNCE_BYTES):
                k = min(body - s, _BOUNCE_BYTES)
                b[:k] = mv[s:s + k]
                _pwrite_full(fd, b[:k], off + s)
        if tail:
            b = _bounce.get(ALIGN_BYTES)
            b[:tail] = mv[body:]
            b[tail:ALIGN_BYTES] = _ZEROS[tail:]
            _pwrite_full(fd, b[:ALIGN_BYTES], off + body)

    def _read_chunk(self, mv: memoryview, aligned: bool, off: int, end: int) -> None:
        fd, n = self._fd, len(mv)
        if not self.direct:
            got = _pread_full(fd, mv, off)
            if got < n:
                raise _Failure(_errno.EIO, short_read_detail(fd, end))
            return
        tail = n % ALIGN_BYTES
        body = n - tail
        if body and aligned:
            got = _pread_full(fd, mv[:body], off)
            if got < body:
                raise _Failure(_errno.EIO, short_read_detail(fd, end))
        elif body:
            b = _bounce.get(min(body, _BOUNCE_BYTES))
            for s in range(0, body, _BOUNCE_BYTES):
                k = min(body - s, _BOUNCE_BYTES)
                got = _pread_full(fd, b[:k], off + s)
                if got < k:
                    raise _Failure(_errno.EIO, short_read_detail(fd, end))
                mv[s:s + k] = b[:k]
        if tail:
            b = _bounce.get(ALIGN_BYTES)
            got = _pread_full(fd, b[:ALIGN_BYTES], off + body)
            if got < tail:
                raise _Failure(_errno.EIO, short_read_detail(fd, end))
            mv[body:] = b[:tail]

    # -- file

    def resize(self, size_bytes: int) -> None:
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise ValueError(f"tiermem: resize size_bytes must be an int >= 0, got {size_bytes!r}")
        with self._cond:
            if self._closed:
                raise io_error(_errno.EBADF, "resize", self.path, size_bytes, 0,
                               "the file is closed")
            _resize_fd(self._fd, self.path, size_bytes)

    def size(self) -> int:
        with self._cond:
            if self._closed:
                raise io_error(_errno.EBADF, "size", self.path, 0, 0, "the file is closed")
            return os.fstat(self._fd).st_size

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._inflight:
                self._cond.wait()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __del__(self):
        fd = getattr(self, "_fd", -1)
        if fd >= 0 and not getattr(self, "_inflight", 0):
            os.close(fd)


def _resize_fd(fd: int, path: str, size_bytes: int) -> None:
    cur = os.fstat(fd).st_size
    if size_bytes > cur:
        err = _errno.EOPNOTSUPP
        if _fallocate is not None:
            while True:
                if _fallocate(fd, 0, cur, size_bytes - cur) == 0:
                    return
                err = ctypes.get_errno()
                if err != _errno.EINTR:
                    break
        if err not in (_errno.EOPNOTSUPP, _errno.ENOSYS):
            raise io_error(err, "resize", path, size_bytes - cur, cur)
    if size_bytes != cur:
        try:
            os.ftruncate(fd, size_bytes)
        except OSError as e:
            raise io_error(e.errno, "resize", path, size_bytes, 0) from None


def _run(item) -> None:
    """Run one chunk ``(run, future, memoryview, aligned, offset, request_end)``."""
    run, fut, mv, aligned, off, end = item
    failure = None
    if not fut._failed():
        try:
            run(mv, aligned, off, end)
        except _Failure as f:
            failure = f
        except OSError as e:
            failure = _Failure(e.errno or _errno.EIO, None if e.errno else str(e))
        except BaseException as e:  # a bug: report it on the future, not in a thread
            failure = _Failure(_errno.EIO, f"internal error (this is a bug): {e!r}")
    fut._chunk_done(failure)


class PythonEngine(IOEngine):
    """Thread pool of ``threads`` workers; see the module docstring."""

    name = "python"

    def __init__(self, threads: int = 4):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"tiermem: threads must be an int >= 1, got {threads!r}")
        self.threads = threads
        self._lock = threading.Lock()
        self._closed = False
        self._logged_fallback = False
        self._start_workers()

    # The worker pool. A subclass may run the chunks elsewhere by overriding
    # _start_workers, _enqueue and _stop_workers (benchmarks/bench_io.py does,
    # to measure an aiofiles-based variant); each chunk is run by _run(item).

    def _start_workers(self) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._worker, name=f"tiermem-io-{i}",
                                          daemon=True) for i in range(self.threads)]
        for t in self._workers:
            t.start()

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _run(item)

    def _enqueue(self, items) -> None:
        for item in items:
            self._queue.put(item)

    def _stop_workers(self) -> None:
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join()

    def _dispatch(self, items) -> None:
        with self._lock:
            if self._closed:
                _, fut, *_ = items[0]
                raise io_error(_errno.EBADF, fut._op, fut._path, fut._nbytes, fut._offset,
                               "the I/O engine is closed")
            self._enqueue(items)

    @property
    def closed(self) -> bool:
        return self._closed

    def open(self, path: str, size_bytes: int = 0) -> IOFile:
        path = os.fspath(path)
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise ValueError(f"tiermem: open size_bytes must be an int >= 0, got {size_bytes!r}")
        if self._closed:
            raise io_error(_errno.EBADF, "open", path, 0, 0, "the I/O engine is closed")
        try:
            fd = os.open(path, _OPEN_FLAGS, 0o600)
        except OSError as e:
            raise io_error(e.errno, "open", path, 0, 0) from None
        try:
            direct = _enable_direct(fd)
            _resize_fd(fd, path, 0)  # undo the probe's block
            if size_bytes:
                _resize_fd(fd, path, size_bytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        if not direct:
            self._note_fallback(path)
        return _PyFile(self, path, fd, direct)

    def _note_fallback(self, path: str) -> None:
        if not self._logged_fallback:
            self._logged_fallback = True
            _log.warning("tiermem: O_DIRECT is not supported for %s; the python I/O engine uses "
                         "buffered I/O for such files (the page cache holds what it writes; "
                         "logged once per engine)", path)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_workers()


def _enable_direct(fd: int) -> bool:
    """Set O_DIRECT on a new, empty file; True if one aligned write works."""
    if not _O_DIRECT:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError:
        return False
    probe = mmap.mmap(-1, ALIGN_BYTES)
    try:
        os.pwrite(fd, probe, 0)
    except OSError as e:
        if e.errno != _errno.EINVAL:
            return True  # e.g. ENOSPC: O_DIRECT works; later writes report the error
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return False
    finally:
        probe.close()
    return True
