"""The interface every I/O engine implements, and the helpers they share.

Both engines (``cpp`` and ``python``) give the same classes the same contract:

- ``IOFile.write(buf, offset)`` / ``IOFile.read(buf, offset)`` take a dense,
  contiguous CPU tensor of any dtype (its ``numel() * element_size()`` bytes
  are moved; pinned or not; any address) and an ``offset`` that is a multiple
  of :data:`ALIGN_BYTES` (else ``ValueError``), and return an :class:`IOFuture`
  at once. The tensor must not be resized or freed before the future is done;
  the engine keeps a reference to it until then.
- A write whose length is not a multiple of :data:`ALIGN_BYTES` writes zeros to
  the rest of its last block: reserve extents rounded up to ``ALIGN_BYTES``.
- A read fills exactly the tensor's bytes; a file shorter than
  ``offset + nbytes`` fails with ``OSError(EIO)`` ("short read").
- Requests on one file may run concurrently and complete in any order; large
  requests are split over the worker threads.
- Every failure is an ``OSError`` with ``errno`` set and the message
  ``tiermem: <op> of <n> bytes at offset <off> in <path> failed: <reason>``.
"""

from __future__ import annotations

import abc
import errno as _errno
import os

import torch

__all__ = ["ALIGN_BYTES", "IOEngine", "IOFile", "IOFuture", "MIN_CHUNK_BYTES",
           "MAX_CHUNK_BYTES", "check_request", "chunk_bytes", "io_error", "aligned_empty"]

#: Offsets, and the blocks written under O_DIRECT, are multiples of this.
ALIGN_BYTES = 4096
#: A request is split in chunks of MIN_CHUNK_BYTES..MAX_CHUNK_BYTES over the
#: threads (same numbers as csrc/io_engine.h).
MIN_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 8 << 20


class IOFuture(abc.ABC):
    """Completion of one write or read."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the request has completed (the GIL is released while
        waiting); raise its ``OSError`` if it failed."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the request has completed, successfully or not. Never blocks."""


class IOFile(abc.ABC):
    """A file created by :meth:`IOEngine.open`. ``path``: its path; ``direct``:
    True when O_DIRECT is in use (False after the buffered fallback)."""

    path: str
    direct: bool

    @abc.abstractmethod
    def write(self, buf: torch.Tensor, offset: int) -> IOFuture:
        """Write ``buf``'s bytes at ``offset`` (a multiple of ALIGN_BYTES)."""

    @abc.abstractmethod
    def read(self, buf: torch.Tensor, offset: int) -> IOFuture:
        """Fill ``buf``'s bytes from ``offset`` (a multiple of ALIGN_BYTES)."""

    @abc.abstractmethod
    def resize(self, size_bytes: int) -> None:
        """Set the file length. Growing allocates the blocks (``fallocate``, so
        that ENOSPC shows now; ``ftruncate`` where it is unsupported)."""

    @abc.abstractmethod
    def size(self) -> int:
        """The file length in bytes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for this file's outstanding requests, then close it. Idempotent.
        The file itself stays on disk: removing it is the caller's job."""

    def __enter__(self) -> "IOFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path!r} direct={self.direct}>"


class IOEngine(abc.ABC):
    """A pool of ``threads`` workers. ``name``: ``"cpp"`` or ``"python"``.

    ``cuda_chain``: True when the engine moves CUDA tensors itself (the CUDA
    build of the C++ engine: its files have ``write_from_device`` and
    ``read_to_device``, see :mod:`tiermem.io.cpp`); False otherwise, and callers
    then copy between the device and host buffers themselves."""

    name: str
    threads: int
    cuda_chain: bool = False

    @abc.abstractmethod
    def open(self, path: str, size_bytes: int = 0) -> IOFile:
        """Create ``path`` (it must not exist: ``O_CREAT|O_EXCL|O_NOFOLLOW``,
        mode 0600), with O_DIRECT when the filesystem takes it, and size it to
        ``size_bytes``. On failure (``OSError`` with errno) nothing is left."""

    @abc.abstractmethod
    def close(self) -> None:
        """Run the queued requests, then stop the workers. Idempotent."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True after :meth:`close`."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} threads={self.threads}>"


def io_error(err: int, op: str, path: str, nbytes: int, offset: int,
             detail: str | None = None) -> OSError:
    """The OSError of a failed request, worded like the C++ engine's."""
    reason = detail or os.strerror(err)
    if op == "open":
        return OSError(err, f"tiermem: open of {path} failed: {reason}")
    return OSError(err, f"tiermem: {op} of {nbytes} bytes at offset {offset} in {path} "
                        f"failed: {reason}")


def short_read_detail(fd: int, want_end: int) -> str:
    """The reason of a read that found the end of the file before ``want_end``."""
    try:
        size = f" is {os.fstat(fd).st_size} bytes long, it"
    except OSError:
        size = ""
    return f"short read: the file{size} ends before byte {want_end} ({os.strerror(_errno.EIO)})"


def check_request(buf: torch.Tensor, offset: int, op: str) -> int:
    """Validate a write/read; return its byte count. Raises ValueError."""
    if not isinstance(offset, int) or offset < 0 or offset % ALIGN_BYTES:
        raise ValueError(f"tiermem: {op} offset {offset!r} is not a non-negative multiple "
                         f"of ALIGN_BYTES ({ALIGN_BYTES})")
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"tiermem: {op} needs a torch.Tensor, got {type(buf).__name__}")
    if buf.layout != torch.strided or buf.device.type != "cpu":
        raise ValueError(f"tiermem: {op} needs a dense CPU tensor, got layout {buf.layout} "
                         f"on device {buf.device}")
    if not buf.is_contiguous():
        raise ValueError(f"tiermem: {op} needs a contiguous tensor, got sizes "
                         f"{tuple(buf.shape)} and strides {buf.stride()} (call .contiguous())")
    return buf.numel() * buf.element_size()


def chunk_bytes(nbytes: int, threads: int) -> int:
    """Chunk size for a request of ``nbytes`` over ``threads`` workers."""
    per_thread = -(-nbytes // max(1, threads))
    aligned = -(-per_thread // ALIGN_BYTES) * ALIGN_BYTES
    return min(max(aligned, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)


_HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def _advise_huge_pages(addr: int, nbytes: int) -> None:
    """madvise(MADV_HUGEPAGE) on [addr, addr + nbytes); best effort."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def aligned_empty(nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose address is a multiple of ALIGN_BYTES.

    The fastest path of both engines: whole blocks of an aligned buffer go
    straight to the disk under O_DIRECT, with no copy through a bounce buffer.
    Torch's CPU allocations are only 64-byte aligned, so this over-allocates and
    returns an aligned view (``.view(dtype)`` it as needed; the base stays alive
    through the view). Unpinned buffers of 2 MiB or more are aligned to 2 MiB
    and advised to use transparent huge pages (before their pages are touched):
    direct I/O pins and maps fewer pages; measured here, direct reads into
    4 KiB-page memory ran at about 0.6x of reads into huge-page memory.
    """
    if nbytes < 0:
        raise ValueError(f"tiermem: aligned_empty nbytes must be >= 0, got {nbytes}")
    align = ALIGN_BYTES
    if nbytes >= _HUGE_PAGE_BYTES and not pin_memory:
        align = _HUGE_PAGE_BYTES
    base = torch.empty(nbytes + align - 1, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -base.data_ptr() % align
    if align == _HUGE_PAGE_BYTES:
        _advise_huge_pages(base.data_ptr() + skip, nbytes // align * align)
    return base[skip:skip + nbytes]
