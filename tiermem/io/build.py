"""Building the C++ I/O engine: the module built at install, or a build at run time.

:func:`prebuilt` finds the module an install compiled (``tiermem._C``, see
setup.py) and takes it only when its stamp fits this torch and these sources;
:func:`build_and_import` compiles the sources with torch's extension loader
into a cache directory named after them (NOTE [Engine build identity] in
buildkey.py), announcing the build with one warning before it starts, or
imports a complete earlier build from there. :func:`build` is
``python -m tiermem build``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import shutil
import time

import torch

from ..errors import TierMemError
from . import buildkey

__all__ = ["build", "prebuilt", "build_and_import", "find_ninja", "BUILD_MESSAGE"]

_log = logging.getLogger("tiermem")

#: The line logged (WARNING) before a build at run time, once per process.
BUILD_MESSAGE = ("tiermem: building the C++ I/O engine (about a minute, once per torch "
                 "version and source)")
_announced = False


def build(verbose: bool = True) -> str:
    """Compile (or find up to date) the C++ extension, or take the one built at
    install; return its path.

    Raises :class:`tiermem.TierMemError` with the compiler's output on failure.
    """
    from . import cpp
    cpp.load_extension(verbose=verbose)
    path = cpp.extension_path()
    if path is None:
        raise TierMemError("tiermem: the C++ extension loaded without a file path (this is a bug)")
    return path


def prebuilt(csrc: str):
    """``(module, note)``: the module built at install and why it has CUDA or not,
    when its stamp fits this torch and the sources in ``csrc``; else ``(None,
    why it was not used)``, ``why`` empty when there is none."""
    try:
        spec = importlib.util.find_spec(buildkey.PREBUILT_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return None, ""
    stamp = buildkey.read_stamp(os.path.join(os.path.dirname(spec.origin),
                                             buildkey.PREBUILT_STAMP))
    why = buildkey.stamp_mismatch(stamp, torch.__version__, buildkey.variant_sha256(
        csrc, bool(stamp and stamp.get("cuda"))))
    if why is None:
        try:
            mod = importlib.import_module(buildkey.PREBUILT_MODULE)
        except ImportError as e:
            why = f"it does not import ({e})"
        else:
            return mod, f"built at install: {stamp.get('note') or 'no note'}"
    return None, f"the engine built at install ({spec.origin}) is not used: {why}"


def build_and_import(cpp_extension, csrc: str, cuda: bool, verbose: bool, why: str = ""):
    """Import the CPU-only or the CUDA extension built for this torch and these
    sources, building it first if no complete build is cached (NOTE [Engine
    build identity] in buildkey.py); the build is announced by one warning,
    :data:`BUILD_MESSAGE` followed by ``why`` (why there is no build to use)."""
    sources, headers, cflags = buildkey.variant(csrc, cuda)
    missing = [p for p in sources + headers if not os.path.isfile(p)]
    if missing:
        raise TierMemError(f"tiermem: missing source files: {', '.join(missing)}")
    if cuda and cpp_extension.CUDA_HOME is None:
        raise TierMemError("no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)")
    sha = buildkey.variant_sha256(csrc, cuda)
    name = buildkey.build_name(torch.__version__, cuda, sha)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = os.path.join(root, name)
    os.makedirs(build_dir, exist_ok=True)
    stamp_path = os.path.join(build_dir, buildkey.STAMP_NAME)
    if buildkey.read_stamp(stamp_path) is not None:
        return _import_built(name, build_dir)
    with _build_lock(cpp_extension, build_dir), _arch_list(cuda):
        if buildkey.read_stamp(stamp_path) is not None:
            return _import_built(name, build_dir)   # built by another process meanwhile
        staged = _stage(sources + headers, os.path.join(build_dir, "src"))
        _announce(why)
        mod = cpp_extension.load(
            name=name, sources=staged[:len(sources)], extra_cflags=cflags,
            extra_include_paths=[os.path.dirname(staged[0])], build_directory=build_dir,
            with_cuda=cuda, verbose=verbose)
        buildkey.write_stamp(stamp_path, buildkey.make_stamp(torch.__version__, cuda, sha))
        return mod


def _announce(why: str) -> None:
    global _announced
    if not _announced:
        _announced = True
        _log.warning(BUILD_MESSAGE + (f"; {why}" if why else ""))


def _import_built(name: str, build_dir: str):
    """Import the module a complete run-time build left in ``build_dir``."""
    path = os.path.join(build_dir, name + (".pyd" if os.name == "nt" else ".so"))  # torch's
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or not os.path.isfile(path):
        raise TierMemError(f"tiermem: the cached build of the C++ engine in {build_dir} has "
                           f"no module {os.path.basename(path)}; remove that directory")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stage(paths: list, dest: str) -> list:
    """Copies of ``paths`` in ``dest`` (written only where missing or different,
    so that an up-to-date build stays up to date); returns their paths."""
    os.makedirs(dest, exist_ok=True)
    out = []
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        target = os.path.join(dest, os.path.basename(path))
        try:
            with open(target, "rb") as f:
                same = f.read() == data
        except OSError:
            same = False
        if not same:
            tmp = f"{target}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        out.append(target)
    return out


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


def find_ninja() -> None:
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
def _build_lock(cpp_extension, build_dir: str):
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
        fd = os.open(os.path.join(build_dir, "tiermem-build.flock"), os.O_RDWR | os.O_CREAT,
                     0o644)
    except (ImportError, AttributeError, OSError, TypeError):
        _clear_stale_lock(cpp_extension, build_dir)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # waits while another tiermem process builds here
        lock = os.path.join(build_dir, "lock")
        if os.path.exists(lock):
            _log.warning("tiermem: removing the build lock %s left by a build of the C++ "
                         "engine that was killed", lock)
            with contextlib.suppress(OSError):
                os.unlink(lock)
        yield
    finally:
        os.close(fd)   # releases the flock


def _clear_stale_lock(cpp_extension, build_dir: str) -> None:
    """Remove the build lock of a killed build: torch (up to 2.13: a lock file
    whose existence is the lock, ``FileBaton``) waits on it forever. Newer
    torch holds an OS lock on a file that stays (``FileLock``): never stale,
    and removing that file under a running build would let a second one in."""
    if getattr(cpp_extension, "FileLock", None) is not None:
        return
    try:
        lock = os.path.join(build_dir, "lock")
        age = time.time() - os.path.getmtime(lock)
    except (AttributeError, OSError, TypeError):
        return
    if age > _STALE_LOCK_SECONDS:
        _log.warning("tiermem: removing the build lock %s left %.0f s ago by an interrupted "
                     "build of the C++ engine", lock, age)
        with contextlib.suppress(OSError):
            os.unlink(lock)
