"""The NVMe tier's directories: checking ``TIERMEM_NVME_DIR``, one private
directory per process, removal at close and at exit, and removal of the
directories of processes that were killed.

A private directory is named ``tiermem-<pid>-<start>-<random>`` where
``<start>`` is the owner's process start time (ms since the epoch, from
psutil), followed by ``-rank<RANK>`` under a distributed launch (ranks of one
node share one NVMe dir; the name tells whose is whose, and the pid, start time,
random part and exclusive creation keep two ranks from ever sharing one), and
holds ``owner.lock``, on which the owner keeps an exclusive
``flock`` for its whole life (the kernel lets go of it when the process
dies, however it dies). A directory is stale when nobody holds its lock and
no process with that pid exists, or one does but started at another time
(the pid was reused; this process's own pid too, which a restarted
container's trainer often gets again). The lock keeps a live owner's
directory even where its pid means nothing to us (another PID namespace:
containers sharing a disk, or another host on NFS). A directory changed in
the last :data:`YOUNG_SECONDS` is left alone whatever its pid says (its owner
may be between creating it and locking it), and this process never probes
its own live directories. (NFS mounted with ``nolock`` or
``local_lock=flock`` keeps locks to one host.) Stale directories are removed
at the next start; live owners' are left alone.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import secrets
import shutil
import signal
import stat
import threading
import time
from typing import Optional

import psutil

from ..errors import ConfigError
from .ranks import per_rank_share
from .ranks import rank as _rank

__all__ = ["check_nvme_dir", "PrivateDir", "remove_stale_dirs"]

_log = logging.getLogger("tiermem")
_PREFIX = "tiermem-"


def _start_ms(pid: int) -> Optional[int]:
    try:
        return int(psutil.Process(pid).create_time() * 1000)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def check_nvme_dir(path: str, setting: str = "TIERMEM_NVME_DIR") -> str:
    """Create ``path`` like ``mkdir -p`` and check that it is a writable
    directory on a writable filesystem; :class:`ConfigError` names the setting,
    the value and what is wrong. ``setting``: the name the user gave it under
    (``nvme_dir``, ``TIERMEM_NVME_DIR``, ``--dir``;
    NOTE [Setting names in messages] in config.py)."""
    where = f"tiermem: {setting}={path!r}"
    if "\x00" in path:   # os.* would raise a bare ValueError
        raise ConfigError(f"{where} contains a null byte, which no path may")
    if os.path.islink(path) and not os.path.exists(path):
        raise ConfigError(f"{where} is a symbolic link to {os.readlink(path)!r}, "
                          "which does not exist")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{where} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{where} cannot be created: {e.strerror}") from None
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            raise ConfigError(f"{where} is on a read-only filesystem")
    except OSError as e:
        raise ConfigError(f"{where} cannot be inspected: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable by this user")
    # Pseudo-filesystems (/proc, /sys) pass the checks above and still refuse
    # new entries: try one.
    probe = os.path.join(path, f".tiermem-probe-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(probe, 0o700)
        os.rmdir(probe)
    except OSError as e:
        raise ConfigError(f"{where}: cannot create files there: "
                          f"{e.strerror or e}") from None
    return path


def _parse(name: str):
    """``tiermem-<pid>-<start>-<random>[-rank<N>]`` -> (pid, start) or None."""
    parts = name.split("-")
    if len(parts) == 5 and parts[4].startswith("rank") and parts[4][4:].isdigit():
        parts = parts[:4]
    if len(parts) != 4 or parts[0] != "tiermem":
        return None
    try:
        return int(parts[1]), int(parts[2])
    except ValueError:
        return None


_LOCK_NAME = "owner.lock"


def _lock_held(directory: str) -> bool:
    """True if some process holds the owner lock of ``directory``, or if the
    lock file is not a regular file of this user (then nothing here is ours to
    judge). Never blocks: a FIFO or device put there by anyone is opened
    non-blocking and refused by type."""
    try:
        fd = os.open(os.path.join(directory, _LOCK_NAME),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False   # no lock file (not yet made, or an older tiermem)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return True

        # Shared: it conflicts with the owner's exclusive lock, and unlike an
        # exclusive one it needs no write access (NFS emulates flock with
        # POSIX locks, where it would). Any other failure (no locking here):
        # unknown, the pid check decides.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)   # also lets go of the lock if we took it
    return False


#: A directory changed less than this long ago is never removed as stale: its
#: owner may be between creating it and taking its lock (a pid we cannot see,
#: in another PID namespace, proves nothing then).
YOUNG_SECONDS = 30.0

#: Paths of this process's live private directories: never probed nor removed
#: here (probing our own lock could even release it where flock is emulated
#: with per-process POSIX locks, as on NFS). Guarded by PrivateDir._lock.
_LIVE_PATHS: set = set()


def default_nvme_budget_bytes(path: str) -> int:
    """80% of the free space of ``path`` now, divided among the node's ranks
    (``LOCAL_WORLD_SIZE``; NOTE [Per-rank budgets] in memory/ranks.py): checkpoints
    and logs often share the disk, and ENOSPC is caught anyway (the arena then
    stops growing). Measured after :func:`remove_stale_dirs`, so that a killed
    run's arena does not shrink the budget of the next."""
    return per_rank_share(int(psutil.disk_usage(path).free * 0.8))


def remove_stale_dirs(root: str) -> list:
    """Remove the private directories under ``root`` whose owner process is
    gone; return their paths. Only real directories owned by this user are
    touched (never through a symlink)."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        owner = _parse(entry.name)
        if owner is None:
            continue
        with PrivateDir._lock:
            if os.path.abspath(entry.path) in _LIVE_PATHS:
                continue
        pid, start = owner
        now_start = _start_ms(pid)
        if now_start is None and pid == os.getpid():
            continue  # our pid, and our start time is unknown: cannot tell
        if now_start is not None and abs(now_start - start) < 1000:
            continue  # alive (allow for clock rounding of the start time)
        # Our own pid with another start time is an earlier process that had
        # it (a container's trainer is often pid 1 at every restart).
        # Type, owner and age first: nothing in a directory that is not ours
        # is opened at all.
        try:
            st = os.lstat(entry.path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        if time.time() - st.st_mtime < YOUNG_SECONDS:
            continue  # its owner may not have locked it yet
        if _lock_held(entry.path):
            continue  # alive, though not as a pid we can see
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
        _log.info("tiermem: removed %s, left by process %d which is gone", entry.path, pid)
    return removed


class PrivateDir:
    """A directory only this process uses (mode 0700, created exclusively).

    Removed with everything in it by :meth:`remove`, which also runs at
    interpreter exit.
    """

    _lock = threading.Lock()

    def __init__(self, root: str) -> None:
        pid = os.getpid()
        start = _start_ms(pid) or 0
        name = f"{_PREFIX}{pid}-{start}-{secrets.token_hex(4)}"
        r = _rank()
        if r is not None:   # for people reading the dir; pid and lock decide ownership
            name += f"-rank{r}"
        self.path = os.path.join(root, name)
        with PrivateDir._lock:
            _LIVE_PATHS.add(os.path.abspath(self.path))
        try:
            self._make()
        except BaseException:
            with PrivateDir._lock:
                _LIVE_PATHS.discard(os.path.abspath(self.path))
            raise
        self._owner_pid = pid
        atexit.register(self.remove)
        _clean_up_on_signals()

    def _make(self) -> None:
        os.mkdir(self.path, 0o700)        # fails if anything exists there
        st = os.lstat(self.path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ConfigError(f"tiermem: {self.path} is not a private directory; this is a bug")
        self._removed = False
        # Held until remove() or death: see the module docstring.
        try:
            self._lock_fd = os.open(
                self.file(_LOCK_NAME),
                os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        try:
            # Blocking: a checker may hold a shared lock for an instant.
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        except OSError:   # no flock here: the pid check alone decides
            pass

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        """Delete the directory and its files (idempotent). In a process forked
        from the owner (whose exit runs the inherited atexit hooks) only its
        copy of the lock's fd is closed: the directory is the parent's."""
        with PrivateDir._lock:
            if self._removed:
                return
            self._removed = True
        if os.getpid() == self._owner_pid:
            shutil.rmtree(self.path, ignore_errors=True)
            with PrivateDir._lock:
                _LIVE_PATHS.discard(os.path.abspath(self.path))
        try:
            os.close(self._lock_fd)
        except OSError:
            pass
        atexit.unregister(self.remove)


# NOTE [Cleanup on SIGTERM]
# A scheduler stops a trainer with SIGTERM (SIGHUP when its terminal goes);
# their default action kills the process without atexit, which would leave the
# arena files behind until the next start removes them. So, once per process,
# from the main thread, tiermem installs a handler for each of them whose
# current disposition is the default or a Python handler: it removes this
# process's live private directories (no lock taken: the handler may have
# interrupted the main thread inside one), then chains: to the previous Python
# handler, or, for the default, restores it and sends the signal again, so the
# process ends exactly as it would have. A process forked from the owner (pid
# differs) removes nothing: the directories are the parent's. Signals that are
# ignored, or handled outside Python, are left alone.
_SIGNALS = ("SIGTERM", "SIGHUP")
_signals_installed = False


def _clean_up_on_signals() -> None:
    global _signals_installed
    if _signals_installed or threading.current_thread() is not threading.main_thread():
        return
    _signals_installed = True
    owner = os.getpid()
    for name in _SIGNALS:
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            previous = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if previous is None or previous == signal.SIG_IGN:
            continue   # handled outside Python, or ignored: not ours to change
        try:
            signal.signal(sig, _handler(owner, previous))
        except (ValueError, OSError):
            continue


def _handler(owner: int, previous):
    def on_signal(signum, frame):
        if os.getpid() == owner:
            for path in list(_LIVE_PATHS):
                shutil.rmtree(path, ignore_errors=True)
        if callable(previous):
            previous(signum, frame)
        else:   # the default action: end as the signal would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    return on_signal
