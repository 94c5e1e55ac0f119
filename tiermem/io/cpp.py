"""The C++ I/O engine (``csrc/``), built just in time with torch's extension loader.

:func:`load_extension` compiles ``csrc/io_engine.cpp`` and ``csrc/bindings.cpp``
into the module ``tiermem_C`` on first use (about 30 s on 2 cores) and caches it
in torch's extension directory (``TORCH_EXTENSIONS_DIR``, default
``<tmp>/torch_extensions``); later processes only check that it is up to date.
Never built with pip build isolation, which would pull a different torch.

CUDA: built CPU-only (``with_cuda=False``) even with a CUDA build of torch, so
the engine moves host buffers only and ``engine_info()["cuda"]`` is False. The
engine-side device<->pinned copy chain (cudaMemcpyAsync on a given stream,
waited on by the worker) is a later step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from typing import Optional

import torch  # before the extension: it links against torch's libraries

from ..errors import TierMemError
from .base import IOEngine, IOFile, IOFuture, check_request

__all__ = ["CppEngine", "load_extension", "extension_path", "SOURCES"]

_log = logging.getLogger("tiermem")

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "csrc")
#: The sources compiled into the extension, in build order.
SOURCES = [os.path.join(_CSRC, "io_engine.cpp"), os.path.join(_CSRC, "bindings.cpp")]
_HEADERS = [os.path.join(_CSRC, "io_engine.h")]
_NAME = "tiermem_C"

_lock = threading.Lock()
_module = None
_error: Optional[TierMemError] = None


def load_extension(verbose: bool = False):
    """The compiled ``tiermem_C`` module, built if needed (cached per process).

    Raises :class:`tiermem.TierMemError` carrying the compiler's output when it
    cannot be built or loaded; the failure is remembered for this process.
    """
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None and not verbose:
            raise _error
        missing = [p for p in SOURCES + _HEADERS if not os.path.isfile(p)]
        if missing:
            _error = TierMemError(
                f"tiermem: the C++ engine's sources are missing: {', '.join(missing)} "
                f"(csrc/ ships with a source checkout; use TIERMEM_ENGINE=python otherwise)")
            raise _error
        from torch.utils import cpp_extension

        _find_ninja()
        _clear_stale_lock(cpp_extension)
        # -std is left to torch: its headers need the standard it passes (C++20
        # for torch 2.13); io_engine.cpp itself is plain C++17.
        try:
            _module = cpp_extension.load(
                name=_NAME, sources=SOURCES, extra_cflags=["-O3"],
                extra_include_paths=[_CSRC], with_cuda=False, verbose=verbose)
        except Exception as e:  # compiler missing, compile error, bad import...
            _error = TierMemError(
                f"tiermem: the C++ I/O engine could not be built or loaded "
                f"({type(e).__name__}): {e}")
            raise _error from e
        _error = None
        return _module


def _find_ninja() -> None:
    """Put the ``ninja`` of the pip package on PATH if none is there (torch's
    loader runs ``ninja`` by name; a venv's bin/ is on PATH only when activated)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return  # torch's loader then fails, and says that ninja is missing
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


#: A build lock older than this was left by a killed build (a build takes ~30 s).
_STALE_LOCK_SECONDS = 600


def _clear_stale_lock(cpp_extension) -> None:
    """Remove the build lock of a killed build: torch waits on it forever."""
    try:
        build_dir = cpp_extension._get_build_directory(_NAME, False)  # private API
        lock = os.path.join(build_dir, "lock")
        age = time.time() - os.path.getmtime(lock)
    except (AttributeError, OSError, TypeError):
        return
    if age > _STALE_LOCK_SECONDS:
        _log.warning("tiermem: removing the build lock %s left %.0f s ago by an interrupted "
                     "build of the C++ engine", lock, age)
        with contextlib.suppress(OSError):
            os.unlink(lock)


def extension_path() -> Optional[str]:
    """Path of the loaded shared library, or None if not loaded."""
    return getattr(_module, "__file__", None)


# The C++ future needs no wrapper: it *is* an IOFuture.
def _register_future(mod) -> None:
    if not issubclass(mod.Future, IOFuture):
        IOFuture.register(mod.Future)


class _CppFile(IOFile):
    __slots__ = ("_f", "path", "direct")

    def __init__(self, f):
        self._f = f
        self.path = f.path
        self.direct = f.direct

    def write(self, buf: torch.Tensor, offset: int) -> IOFuture:
        if not isinstance(buf, torch.Tensor):
            check_request(buf, offset, "write")  # raises the same TypeError as python
        return self._f.write(buf, offset)

    def read(self, buf: torch.Tensor, offset: int) -> IOFuture:
        if not isinstance(buf, torch.Tensor):
            check_request(buf, offset, "read")
        return self._f.read(buf, offset)

    def resize(self, size_bytes: int) -> None:
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise ValueError(f"tiermem: resize size_bytes must be an int >= 0, got {size_bytes!r}")
        self._f.resize(size_bytes)

    def size(self) -> int:
        return self._f.size()

    def close(self) -> None:
        self._f.close()


class CppEngine(IOEngine):
    """The C++ thread pool (see csrc/io_engine.h). Raises TierMemError if the
    extension cannot be built."""

    name = "cpp"

    def __init__(self, threads: int = 4):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"tiermem: threads must be an int >= 1, got {threads!r}")
        mod = load_extension()
        _register_future(mod)
        self.threads = threads
        self._engine = mod.Engine(threads)
        self._logged_fallback = False

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def open(self, path: str, size_bytes: int = 0) -> IOFile:
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise ValueError(f"tiermem: open size_bytes must be an int >= 0, got {size_bytes!r}")
        f = _CppFile(self._engine.open(os.fspath(path), size_bytes))
        if not f.direct and not self._logged_fallback:
            self._logged_fallback = True
            _log.info("tiermem: O_DIRECT is not supported for %s; the cpp I/O engine uses "
                      "buffered I/O for such files (logged once per engine)", f.path)
        return f

    def close(self) -> None:
        self._engine.close()
