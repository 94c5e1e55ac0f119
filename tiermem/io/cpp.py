"""The C++ I/O engine (``csrc/``), built just in time with torch's extension loader.

:func:`load_extension` compiles :data:`SOURCES` (``csrc/io_engine.cpp``,
``csrc/tensor_release.cpp`` and ``csrc/bindings.cpp``) into the module
``tiermem_C`` on first use (about 30 s on 2 cores) and caches it in torch's
extension directory (``TORCH_EXTENSIONS_DIR``, default
``<tmp>/torch_extensions``); later processes only check that it is up to date.
Never built with pip build isolation, which would pull a different torch.

# NOTE [CUDA build of the engine]
# With a CUDA build of torch (``torch.version.cuda`` set: the build is chosen
# from torch, never from the environment or from whether a GPU is present),
# the extension is built as ``tiermem_C_cuda`` (its own cache entry, so CPU and
# CUDA builds never overwrite each other) with ``with_cuda=True`` (CUDA headers
# from ``CUDA_HOME``, linked against cudart), ``-DTIERMEM_WITH_CUDA`` and
# :data:`CUDA_SOURCES`, which add ``csrc/cuda_chain.cpp`` (the chain) and
# ``csrc/cuda_bindings.cpp`` (its Python classes): the engine then moves CUDA
# tensors itself (``CudaChain``, see NOTE [CUDA chain] in cuda_chain.cpp) and
# :attr:`CppEngine.cuda_chain` is True. Building it needs a CUDA toolkit of
# torch's major version (``CUDA_HOME``, or ``nvcc`` on PATH, or
# /usr/local/cuda), no GPU. If that build fails (no toolkit, say), the
# CPU-only ``tiermem_C`` is built instead, with one warning: the nvme tier
# then copies CUDA tensors from Python.
# :func:`cuda_status` says which, and why.
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
SOURCES = [os.path.join(_CSRC, name)
           for name in ("io_engine.cpp", "tensor_release.cpp", "bindings.cpp")]
#: ... and in its CUDA build. See NOTE [CUDA build of the engine].
CUDA_SOURCES = SOURCES + [os.path.join(_CSRC, name)
                          for name in ("cuda_chain.cpp", "cuda_bindings.cpp")]
_HEADERS = [os.path.join(_CSRC, name) for name in ("io_engine.h", "tensor_release.h", "checks.h",
                                                   "ready_queue.h")]
_CUDA_HEADERS = [os.path.join(_CSRC, name) for name in ("cuda_chain.h", "cuda_bindings.h")]
_NAME = "tiermem_C"
_CUDA_NAME = "tiermem_C_cuda"

_lock = threading.Lock()
_module = None
_error: Optional[TierMemError] = None
_cuda_reason = "the C++ engine is not loaded"


def load_extension(verbose: bool = False):
    """The compiled extension module, built if needed (cached per process):
    ``tiermem_C_cuda`` with a CUDA build of torch, else (or if that build
    fails) ``tiermem_C``. See NOTE [CUDA build of the engine].

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
        from torch.utils import cpp_extension

        _find_ninja()
        cuda_failed = False
        if torch.version.cuda is None:
            _cuda_reason = "torch is a CPU-only build"
        else:
            try:
                _module = _build(cpp_extension, True, verbose)
                _cuda_reason = f"built with CUDA {torch.version.cuda}"
                _error = None
                return _module
            except Exception as e:  # no toolkit, compile error, bad import...
                cuda_failed = True
                _cuda_reason = (f"the CUDA build failed ({type(e).__name__}): "
                                f"{_first_lines(str(e))}")
        try:
            _module = _build(cpp_extension, False, verbose)
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


def _build(cpp_extension, cuda: bool, verbose: bool):
    """Build (or find up to date) and import the CPU-only or the CUDA extension."""
    name = _CUDA_NAME if cuda else _NAME
    sources = CUDA_SOURCES if cuda else SOURCES
    missing = [p for p in sources + (_CUDA_HEADERS if cuda else []) if not os.path.isfile(p)]
    if missing:
        raise TierMemError(f"tiermem: missing source files: {', '.join(missing)}")
    if cuda and cpp_extension.CUDA_HOME is None:
        raise TierMemError("no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)")
    # -std is left to torch: its headers need the standard it passes (C++20
    # for torch 2.13); io_engine.cpp itself is plain C++17.
    cflags = ["-O3"] + (["-DTIERMEM_WITH_CUDA"] if cuda else [])
    with _build_lock(cpp_extension, name), _arch_list(cuda):
        return cpp_extension.load(
            name=name, sources=sources, extra_cflags=cflags, extra_include_paths=[_CSRC],
            with_cuda=cuda, verbose=verbose)


#: TORCH_CUDA_ARCH_LIST for the CUDA build when the user set none. The sources
#: are all .cpp (no device code is compiled), so the value changes nothing in
#: the library; it only spares torch's loader from asking the GPUs for their
#: architecture, which fails on a machine without one (an IndexError).
_ARCH_LIST_PLACEHOLDER = "9.0"


@contextlib.contextmanager
def _arch_list(cuda: bool):
    if not cuda or os.environ.get("TORCH_CUDA_ARCH_LIST"):
        yield
        return
    os.environ["TORCH_CUDA_ARCH_LIST"] = _ARCH_LIST_PLACEHOLDER
    try:
        yield
    finally:
        os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


def cuda_status() -> tuple:
    """``(has_chain, reason)`` for the loaded extension: whether it moves CUDA
    tensors itself (``CudaChain``) and why (not). Does not build anything."""
    mod = _module
    if mod is None:
        return False, _cuda_reason
    return bool(getattr(mod, "WITH_CUDA", False)), _cuda_reason


def _first_lines(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[:limit] + " ... (truncated)"


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


@contextlib.contextmanager
def _build_lock(cpp_extension, name: str):
    """Held around ``cpp_extension.load``.

    # NOTE [Build lock]
    # torch up to 2.13 locks a build directory with a file whose existence is
    # the lock (``FileBaton``): a build killed while compiling leaves it, and
    # every later build waits on it forever. tiermem builds therefore also
    # hold an OS lock (``flock``, released by the kernel when its process
    # dies) on ``tiermem-build.flock`` in the same directory for the whole
    # load. Holding it, a ``lock`` file can only be a dead build's (any live
    # tiermem build holds the flock), so it is removed whatever its age.
    # Without the flock (no such file can be made), only a lock older than
    # _STALE_LOCK_SECONDS is taken for stale. torch >= 2.14 locks with an OS
    # lock itself (``FileLock``): nothing to do.
    """
    if getattr(cpp_extension, "FileLock", None) is not None:
        yield
        return
    try:
        import fcntl
        build_dir = cpp_extension._get_build_directory(name, False)  # private API
        fd = os.open(os.path.join(build_dir, "tiermem-build.flock"), os.O_RDWR | os.O_CREAT,
                     0o644)
    except (ImportError, AttributeError, OSError, TypeError):
        _clear_stale_lock(cpp_extension, name)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # waits while another tiermem process builds here
        lock = os.path.join(build_dir, "lock")
        if os.path.exists(lock):
            _log.warning("tiermem: removing the build lock %s left by a build of the C++ "
                         "engine that was killed (NOTE [Build lock])", lock)
            with contextlib.suppress(OSError):
                os.unlink(lock)
        yield
    finally:
        os.close(fd)   # releases the flock


def _clear_stale_lock(cpp_extension, name: str) -> None:
    """Remove the build lock of a killed build: torch (up to 2.13: a lock file
    whose existence is the lock, ``FileBaton``) waits on it forever. Newer
    torch holds an OS lock on a file that stays (``FileLock``): never stale,
    and removing that file under a running build would let a second one in."""
    if getattr(cpp_extension, "FileLock", None) is not None:
        return
    try:
        build_dir = cpp_extension._get_build_directory(name, False)  # private API
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
