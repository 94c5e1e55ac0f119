"""Asynchronous file I/O for the NVMe tier: engines, files, futures.

>>> eng = get_engine()                      # "auto": C++ if it builds, else Python
>>> f = eng.open("/mnt/nvme/arena", 1 << 30)
>>> fut = f.write(tensor, offset=0)         # returns at once; offset % ALIGN_BYTES == 0
>>> fut.wait()                              # raises OSError(errno, "tiermem: ...")

See :mod:`tiermem.io.base` for the full contract (alignment, padding of the
last block, short reads, errors). The fastest path is a buffer whose address is
a multiple of :data:`ALIGN_BYTES` (:func:`aligned_empty`): whole blocks then go
straight to the disk under O_DIRECT without a bounce copy.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Dict, Optional, Tuple

from ..config import MAX_IO_THREADS
from ..errors import TierMemError
from .base import ALIGN_BYTES, IOEngine, IOFile, IOFuture, aligned_empty

__all__ = ["acquire_engine", "release_engine", "ALIGN_BYTES", "IOEngine", "IOFile", "IOFuture", "aligned_empty", "engine_info",
           "get_engine"]

_log = logging.getLogger("tiermem")

_KINDS = ("auto", "cpp", "python")
_lock = threading.Lock()
_engines: Dict[Tuple[str, int], IOEngine] = {}
_users: Dict[Tuple[str, int], int] = {}    # stores holding each engine (acquire_engine)
_shared: set = set()                        # engines handed out by get_engine: kept
_warned_auto = False


def _check(kind: str, threads: int) -> None:
    if kind not in _KINDS:
        raise ValueError(f"tiermem: engine kind {kind!r} is not one of {', '.join(_KINDS)}")
    if (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
            or threads > MAX_IO_THREADS):
        raise ValueError(f"tiermem: I/O threads must be an int from 1 to {MAX_IO_THREADS}, "
                         f"got {threads!r}")


def _new(kind: str, threads: int) -> IOEngine:
    if kind == "cpp":
        from .cpp import CppEngine
        return CppEngine(threads)
    from .pyengine import PythonEngine
    return PythonEngine(threads)


def _cached(kind: str, threads: int) -> IOEngine:
    eng = _engines.get((kind, threads))
    if eng is None or eng.closed:
        eng = _engines[(kind, threads)] = _new(kind, threads)
        _users.pop((kind, threads), None)
    return eng


def acquire_engine(kind: str = "auto", threads: int = 4) -> IOEngine:
    """Like :func:`get_engine`, for a user that gives it back with
    :func:`release_engine` (the nvme store): an engine no store holds any
    more, and never handed out by :func:`get_engine`, is closed and its
    threads end."""
    eng = _get(kind, threads, shared=False)
    with _lock:
        key = _key_of(eng)
        _users[key] = _users.get(key, 0) + 1
    return eng


def release_engine(eng: IOEngine) -> None:
    """Give back an engine of :func:`acquire_engine` (see there)."""
    with _lock:
        key = _key_of(eng)
        if key is None:
            return
        left = _users.get(key, 0) - 1
        if left > 0:
            _users[key] = left
            return
        _users.pop(key, None)
        if key in _shared:
            return
        _engines.pop(key, None)
    eng.close()   # outside the lock: it waits for the engine's queued work


def _key_of(eng: IOEngine):
    for key, cached in _engines.items():
        if cached is eng:
            return key
    return None


def get_engine(kind: str = "auto", threads: int = 4) -> IOEngine:
    """The engine of ``kind`` with ``threads`` workers, cached per (kind, threads).

    - ``"auto"``: the C++ engine; if it cannot be built or loaded, the Python
      engine, with one warning (logger ``tiermem``) giving the reason.
    - ``"cpp"``: the C++ engine, or :class:`tiermem.TierMemError` carrying the
      compiler's output.
    - ``"python"``: the pure-Python engine.

    Any other kind raises ``ValueError``. An engine closed by its user is
    replaced by a new one on the next call. Engines handed out here stay open
    (until closed by their user, or at exit).
    """
    return _get(kind, threads, shared=True)


def _get(kind: str, threads: int, shared: bool) -> IOEngine:
    global _warned_auto
    _check(kind, threads)
    with _lock:
        if kind == "auto":
            try:
                eng = _cached("cpp", threads)
            except TierMemError as e:
                if not _warned_auto:
                    _warned_auto = True
                    _log.warning("tiermem: using the Python I/O engine, the C++ engine is "
                                 "unavailable: %s", _first_lines(str(e)))
                eng = _cached("python", threads)
        else:
            eng = _cached(kind, threads)
        if shared:
            _shared.add(_key_of(eng))
        return eng


def engine_info(kind: Optional[str] = None) -> dict:
    """Which engine the setting ``kind`` gives, and why (builds the extension if needed).

    ``kind``: ``"auto"``, ``"cpp"`` or ``"python"``; by default the
    ``TIERMEM_ENGINE`` setting (else ``"auto"``), i.e. what an Offloader
    configured from the environment uses (a bad value raises ConfigError).

    ``{"engine": "cpp" | "python" | "none", "reason": str, "extension_path":
    str | None, "cuda": bool}``. ``"none"``: ``cpp`` was asked for and the
    C++ engine is unavailable (an Offloader with that setting raises; the
    reason carries the compiler's output). ``cuda``: the engine moves CUDA
    tensors itself (the C++ engine built with CUDA); ``reason`` then also
    says why it does or does not.
    """
    from . import cpp

    if kind is None:
        from ..config import Config
        kind, source = Config.from_env({k: v for k, v in os.environ.items()
                                        if k == "TIERMEM_ENGINE"}).engine, "TIERMEM_ENGINE"
    else:
        _check(kind, 1)
        source = "the engine setting"
    if kind == "python":
        return {"engine": "python", "reason": f"{source} is 'python': the Python engine",
                "extension_path": None, "cuda": False}
    try:
        cpp.load_extension()
    except TierMemError as e:
        if kind == "cpp":
            return {"engine": "none", "extension_path": None, "cuda": False,
                    "reason": f"{source} is 'cpp', and the C++ engine is unavailable: {e}"}
        return {"engine": "python", "reason": f"the C++ engine is unavailable: {e}",
                "extension_path": None, "cuda": False}
    cuda, why = cpp.cuda_status()
    chain = "with the CUDA chain" if cuda else "without the CUDA chain"
    return {"engine": "cpp",
            "reason": f"the C++ extension is built and loaded, {chain} ({why})",
            "extension_path": cpp.extension_path(), "cuda": cuda}


def _first_lines(text: str, limit: int = 2000) -> str:
    """The message, shortened for a log line (the exception keeps all of it)."""
    return text if len(text) <= limit else text[:limit] + " ... (truncated)"


#: Engines of the parent process, after a fork: their threads do not exist
#: here, so they are neither used nor destroyed (a destructor would join them).
_left_by_fork: list = []


def _after_fork_in_child() -> None:
    """NOTE [Fork] in offloader.py: the child starts with no engine."""
    global _lock
    _left_by_fork.extend(_engines.values())
    _engines.clear()
    _users.clear()
    _shared.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_engines() -> None:
    # Let queued writes finish before the interpreter goes away.
    for eng in list(_engines.values()):
        try:
            eng.close()
        except Exception:  # pragma: no cover - best effort at exit
            pass
