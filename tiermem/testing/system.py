"""Seams into what the runtime stands on: the I/O engines and their build,
the host pool, spill directories, the memory cgroup, settings warnings, the
one-shot cache and the doctor's probes. Those that patch the process do so
for the duration of a ``with`` block and put everything back on exit."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Optional, Set

from ._patch import patched

__all__ = [
    "new_engine",
    "fresh_engines",
    "clear_stale_build_lock",
    "engine_source_dir",
    "new_ready_queue",
    "cuda_chain_of",
    "native_file",
    "engine_file_type",
    "run_on_chain_thread",
    "before_python_engine_chunks",
    "stale_dir_probes",
    "live_dirs",
    "cgroup_root",
    "fresh_env_warnings",
    "oneshot_cache_size",
    "o_direct_answer",
    "pinned_cache_returns",
    "arena_locked",
]


def new_engine(kind: str, threads: int = 4):
    """A new I/O engine of ``kind`` (``"cpp"`` or ``"python"``), never one
    :func:`~tiermem.io.get_engine` hands out; its user closes it."""
    from ..io import _new
    return _new(kind, threads)


@contextlib.contextmanager
def fresh_engines() -> Iterator[None]:
    """While inside, the I/O engines start as in a new process: no C++
    extension loaded nor its failure remembered, no engine made, the
    fallback to the Python engine not warned about yet."""
    from .. import io as tio
    from ..io import cpp
    with patched(cpp, "_module", None), patched(cpp, "_error", None), \
            patched(tio, "_engines", {}), patched(tio, "_warned_auto", False):
        yield


def clear_stale_build_lock(cpp_extension, build_dir: str) -> None:
    """Remove the lock file of a killed build of the C++ engine from
    ``build_dir`` if it is stale for ``cpp_extension`` (torch's module: one
    with ``FileLock`` never leaves a stale one)."""
    from ..io.build import _clear_stale_lock
    _clear_stale_lock(cpp_extension, build_dir)


def engine_source_dir() -> str:
    """The directory of the C++ engine's sources the build uses."""
    from ..io import cpp
    return cpp._CSRC


def new_ready_queue():
    """A new read queue of the CUDA chain over int tickets (csrc/ready_queue.h),
    as the CPU build of the C++ extension binds it (which must load)."""
    from ..io import cpp
    return cpp.load_extension()._ReadyQueue()


def cuda_chain_of(engine):
    """The CUDA chain of a C++ engine (started on first use); its
    ``read_to_device``/``write_from_device`` take :func:`native_file`\\ s."""
    return engine._cuda()


def native_file(f):
    """The extension's own file object under a C++ engine's file ``f``."""
    return f._f


def engine_file_type() -> type:
    """The class of the files the C++ engine opens (to wrap one of its
    methods in a test, e.g. ``write_from_device``)."""
    from ..io.cpp import _CppFile
    return _CppFile


def run_on_chain_thread(chain, fn: Callable[[], Any]):
    """Queue ``fn`` on the threads of a Python nvme chain (behind the work
    queued there already); returns its ``concurrent.futures.Future``."""
    return chain._pool.submit(fn)


@contextlib.contextmanager
def before_python_engine_chunks(fn: Callable[[], Any]) -> Iterator[None]:
    """While inside, ``fn()`` runs on the worker before each chunk of I/O the
    Python engine runs (e.g. one that waits on an event holds writes back).
    Process-wide."""
    from ..io import pyengine
    run = pyengine._run

    def before(item):
        fn()
        run(item)

    with patched(pyengine, "_run", before):
        yield


@contextlib.contextmanager
def stale_dir_probes(start_ms: Callable[[int], Optional[int]],
                     lock_held: Callable[[str], bool]) -> Iterator[None]:
    """While inside, the sweep of stale spill directories reads a process's
    start time as ``start_ms(pid)`` and whether a directory's lock is held
    as ``lock_held(path)``. Process-wide."""
    from ..memory import spilldir
    with patched(spilldir, "_start_ms", start_ms), patched(spilldir, "_lock_held", lock_held):
        yield


def live_dirs() -> Set[str]:
    """Absolute paths of the spill directories this process's Offloaders own
    now (a copy)."""
    from ..memory import spilldir
    return set(spilldir._LIVE_PATHS)


@contextlib.contextmanager
def cgroup_root(path: str) -> Iterator[None]:
    """While inside, the memory cgroup's files (``memory.max``,
    ``memory.current``) are read from ``path`` instead of /sys/fs/cgroup;
    none there: no limit. Process-wide."""
    from ..memory import cgroup
    with patched(cgroup, "_CGROUP_ROOT", os.fspath(path)):
        yield


@contextlib.contextmanager
def fresh_env_warnings() -> Iterator[None]:
    """While inside, misspelt ``TIERMEM_*`` variables warn again, each once,
    as in a new process."""
    from .. import config
    with patched(config, "_warned_unknown", set()):
        yield


def oneshot_cache_size() -> int:
    """How many Offloaders :func:`tiermem.offload` keeps per thread."""
    from .. import oneshot
    return oneshot._CACHE_SIZE


def o_direct_answer(path: str) -> str:
    """The doctor's answer on O_DIRECT in directory ``path``: ``"yes"`` or
    ``"no (reason)"`` (its probe file removed)."""
    from .. import doctor
    return doctor._o_direct(path)


@contextlib.contextmanager
def pinned_cache_returns(fn: Callable[[], Any]) -> Iterator[None]:
    """While inside, handing torch's cached pinned blocks back to the OS
    (what a host pool does after dropping pinned buffers) calls ``fn()``
    instead. Process-wide."""
    from ..memory import hostpool
    with patched(hostpool, "_return_pinned_cache", fn):
        yield


def arena_locked(arena) -> bool:
    """Whether the lock of an :class:`~tiermem.memory.arena.Arena` is held now."""
    return arena._lock.locked()
