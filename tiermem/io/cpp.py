"""The C++ I/O engine (``csrc/``): the module built at install, else built just in time.

:func:`load_extension` uses the module an install compiled (``tiermem._C``,
see setup.py) when it was built for this torch and these sources; otherwise it
compiles the sources with torch's extension loader on first use (about a
minute on 2 cores, announced by one warning before it starts) into a directory
of torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) named after the torch version and a hash of the
sources (NOTE [Engine build identity] in buildkey.py), which later processes
import without compiling. Never built with pip build isolation, which would
pull a different torch.

# NOTE [CUDA build of the engine]
# With a CUDA build of torch (``torch.version.cuda`` set: the build is chosen
# from torch, never from the environment or from whether a GPU is present),
# the extension is built as ``tiermem_C_cuda_*`` (its own cache entry, so CPU and
# CUDA builds never overwrite each other) with ``with_cuda=True`` (CUDA headers
# from ``CUDA_HOME``, linked against cudart), ``-DTIERMEM_WITH_CUDA`` and
# :data:`CUDA_SOURCES`, which add ``csrc/cuda_chain.cpp`` (the chain) and
# ``csrc/cuda_bindings.cpp`` (its Python classes): the engine then moves CUDA
# tensors itself (``CudaChain``, see NOTE [CUDA chain] in cuda_chain.cpp) and
# :attr:`CppEngine.cuda_chain` is True. Building it needs a CUDA toolkit of
# torch's major version (``CUDA_HOME``, or ``nvcc`` on PATH, or
# /usr/local/cuda), no GPU. If that build fails (no toolkit, say), the
# CPU-only ``tiermem_C_*`` is built instead, with one warning: the nvme tier
# then copies CUDA tensors from Python.
# :func:`cuda_status` says which, and why.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

import torch  # before the extension: it links against torch's libraries

from ..errors import TierMemError
from . import build as _build
from . import buildkey
from .base import IOEngine, IOFile, IOFuture, check_request

__all__ = ["CppEngine", "load_extension", "extension_path", "cuda_status", "SOURCES",
           "CUDA_SOURCES"]

_log = logging.getLogger("tiermem")

def _find_csrc() -> str:
    """csrc/ of a source checkout (editable install), else the copy a wheel
    installs as ``tiermem/_csrc`` (see pyproject.toml)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkout = os.path.join(os.path.dirname(package), "csrc")
    if os.path.isfile(os.path.join(checkout, "io_engine.cpp")):
        return checkout
    return os.path.join(package, "_csrc")


_CSRC = _find_csrc()
#: The sources compiled into the extension, in build order.
SOURCES = buildkey.variant(_CSRC, False)[0]
#: ... and in its CUDA build. See NOTE [CUDA build of the engine].
CUDA_SOURCES = buildkey.variant(_CSRC, True)[0]
_HEADERS = buildkey.variant(_CSRC, False)[1]

_lock = threading.Lock()
_module = None
_error: Optional[TierMemError] = None
_cuda_reason = "the C++ engine is not loaded"


def load_extension(verbose: bool = False):
    """The compiled extension module (cached per process): the one built at
    install when it fits this torch and these sources, else a run-time build,
    ``tiermem_C_cuda_*`` with a CUDA build of torch, else (or if that build
    fails) ``tiermem_C_*`` (NOTE [CUDA build of the engine]), compiled first if
    no complete build of it is cached (announced by one warning).

    Raises :class:`tiermem.TierMemError` carrying the compiler's output when it
    cannot be built or loaded; the failure is remembered for this process.
    """
    global _module, _error, _cuda_reason
    with _lock:
        if _module is not None:
            return _module
        if _error is not None and not verbose:
            raise _error
        missing = [p for p in SOURCES + _HEADERS if not os.path.isfile(p)]
        if missing:
            _error = TierMemError(
                f"tiermem: the C++ engine's sources are missing: {', '.join(missing)} "
                f"(a source checkout has csrc/, a wheel tiermem/_csrc; reinstall tiermem, "
                f"or use TIERMEM_ENGINE=python)")
            raise _error
        _module, note = _build.prebuilt(_CSRC)
        if _module is not None:
            _cuda_reason = note
            return _module
        from torch.utils import cpp_extension

        _build.find_ninja()
        cuda_failed = False
        if torch.version.cuda is None:
            _cuda_reason = "torch is a CPU-only build"
        else:
            try:
                _module = _build.build_and_import(cpp_extension, _CSRC, True, verbose, note)
                _cuda_reason = f"built with CUDA {torch.version.cuda}"
                _error = None
                return _module
            except Exception as e:  # no toolkit, compile error, bad import...
                cuda_failed = True
                _cuda_reason = (f"the CUDA build failed ({type(e).__name__}): "
                                f"{_first_lines(str(e))}")
        try:
            _module = _build.build_and_import(cpp_extension, _CSRC, False, verbose, note)
        except Exception as e:  # compiler missing, compile error, bad import...
            also = f"; before that, {_cuda_reason}" if cuda_failed else ""
            _error = TierMemError(
                f"tiermem: the C++ I/O engine could not be built or loaded "
                f"({type(e).__name__}): {e}{also}")
            raise _error from e
        if cuda_failed:   # one warning; a failure of both builds is one error instead
            _log.warning("tiermem: could not build the C++ I/O engine with CUDA, built it "
                         "CPU-only (the nvme tier then copies CUDA tensors from Python): %s",
                         _cuda_reason)
        _error = None
        return _module


def cuda_status() -> tuple:
    """``(has_chain, reason)`` for the loaded extension: whether it moves CUDA
    tensors itself (``CudaChain``) and why (not). Does not build anything."""
    mod = _module
    if mod is None:
        return False, _cuda_reason
    return bool(getattr(mod, "WITH_CUDA", False)), _cuda_reason


def _first_lines(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[:limit] + " ... (truncated)"


def extension_path() -> Optional[str]:
    """Path of the loaded shared library, or None if not loaded."""
    return getattr(_module, "__file__", None)


# The C++ future needs no wrapper: it *is* an IOFuture.
def _register_future(mod) -> None:
    if not issubclass(mod.Future, IOFuture):
        IOFuture.register(mod.Future)


class _CppFile(IOFile):
    __slots__ = ("_f", "_engine", "path", "direct")

    def __init__(self, f, engine: "CppEngine"):
        self._f = f
        self._engine = engine
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

    # -- the CUDA chain (CppEngine.cuda_chain only; see NOTE [CUDA chain]) ------------
    def write_from_device(self, src: torch.Tensor, staging: torch.Tensor, offset: int,
                          stream: "torch.cuda.Stream", after: "torch.cuda.Stream"):
        """Copy ``src`` (CUDA) into ``staging`` (pinned, same bytes; same sizes and
        dtype if ``src`` is not contiguous) on ``stream`` once ``after`` (the stream
        that produced ``src``) has reached this point, then write ``staging`` at
        ``offset``. Returns a ``CudaFuture`` at once (``wait()``: on disk;
        ``done()``; ``synchronize()``). The engine holds ``src`` until its copy is
        complete and ``staging`` until the write is done."""
        return self._engine._cuda().write_from_device(
            self._f, offset, src, staging, stream.cuda_stream, after.cuda_stream)

    def read_to_device(self, staging: torch.Tensor, dst: torch.Tensor, offset: int,
                       stream: "torch.cuda.Stream", after: "torch.cuda.Stream"):
        """Read ``staging``'s bytes (pinned) at ``offset``, then copy them into
        ``dst`` (CUDA, contiguous, same bytes) on ``stream`` once ``after`` (the
        stream ``dst`` was allocated on) has reached this call. Returns a
        ``CudaFuture`` at once: ``stream_wait(s.cuda_stream)`` makes stream ``s``
        wait for the copy (the host waits only for the read), ``synchronize()``
        makes the host wait, ``done()`` never blocks. The engine holds ``staging``
        and ``dst`` until the copy is complete, except that ``dst`` is let go of
        once ``stream_wait`` has ordered a consumer after the copy (NOTE [CUDA
        chain lifetime] in csrc/cuda_chain.cpp)."""
        return self._engine._cuda().read_to_device(
            self._f, offset, staging, dst, stream.cuda_stream, after.cuda_stream)

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
    extension cannot be built.

    ``cuda_chain`` is True when the extension was built with CUDA: its files
    then also have ``write_from_device`` / ``read_to_device`` (two C++ threads
    per engine, started on first use, carry the requests; see NOTE [CUDA chain]
    in csrc/cuda_chain.cpp)."""

    name = "cpp"

    def __init__(self, threads: int = 4):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"tiermem: threads must be an int >= 1, got {threads!r}")
        mod = load_extension()
        _register_future(mod)
        self._mod = mod
        self.threads = threads
        self.cuda_chain = bool(getattr(mod, "WITH_CUDA", False))
        self._engine = mod.Engine(threads)
        self._chain = None
        self._chain_lock = threading.Lock()
        self._logged_fallback = False

    def _cuda(self):
        """The engine's CudaChain, started on first use."""
        chain = self._chain
        if chain is None:
            if not self.cuda_chain:
                raise TierMemError("tiermem: this build of the C++ engine has no CUDA chain "
                                   f"({cuda_status()[1]})")
            with self._chain_lock:
                if self._chain is None:
                    self._chain = self._mod.CudaChain()
                chain = self._chain
        return chain

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def open(self, path: str, size_bytes: int = 0) -> IOFile:
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise ValueError(f"tiermem: open size_bytes must be an int >= 0, got {size_bytes!r}")
        f = _CppFile(self._engine.open(os.fspath(path), size_bytes), self)
        if not f.direct and not self._logged_fallback:
            self._logged_fallback = True
            _log.warning("tiermem: O_DIRECT is not supported for %s; the cpp I/O engine uses "
                         "buffered I/O for such files (the page cache holds what it writes; "
                         "logged once per engine)", f.path)
        return f

    def close(self) -> None:
        # The chain first: its queued writes go to the engine's pool.
        with self._chain_lock:
            chain = self._chain
        if chain is not None:
            chain.close()
        self._engine.close()
