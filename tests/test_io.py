"""The asynchronous file I/O engines (tiermem.io): one suite, run for both engines.

The ``cpp`` cases are skipped only when the C++ extension cannot be built, with
the reason. Filesystem cases that need a mount (ramfs without O_DIRECT, a full
or read-only tmpfs) are skipped with the reason when ``mount`` is refused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import gc
import logging
import mmap
import os
import shutil
import subprocess
import sys
import time
import weakref

import pytest
import torch

import tiermem
import tiermem.testing
import tiermem.io as tio
from tiermem.io import ALIGN_BYTES, IOEngine, IOFile, IOFuture, aligned_empty, get_engine
from helpers import cpp_engine_unavailable, mounted

MiB = 1 << 20
SIZES = [1, 4095, 4096, 4097, MiB + 3, 5 * MiB]
# Every dtype this torch has (the float8 and unsigned ones where they exist).
DTYPES = [getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if isinstance(getattr(torch, name, None), torch.dtype)]


# ``kind`` and ``engine`` here are this suite's own: the engine's name, and an
# IOEngine object of that kind (conftest's ``engine`` fixture, a name, is
# shadowed in this file).
@pytest.fixture(params=["python", "cpp"])
def kind(request) -> str:
    if request.param == "cpp":
        reason = cpp_engine_unavailable()
        if reason:
            pytest.skip(f"the C++ extension cannot be built: {reason}")
    return request.param


@pytest.fixture
def make_engine(kind):
    """``make_engine(threads=4)``: a new engine of ``kind``, closed after the test."""
    made = []

    def make(threads: int = 4) -> IOEngine:
        eng = tiermem.testing.new_engine(kind, threads)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


@pytest.fixture
def engine(make_engine) -> IOEngine:
    return make_engine(4)


def _random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _random(shape, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    return torch.randint(-2**40, 2**40, shape, dtype=dtype, generator=g) if dtype == torch.int64 \
        else torch.randint(0, 256, shape, dtype=dtype, generator=g)


def _round_up(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _fs_takes_o_direct(directory) -> bool:
    """True if an aligned O_DIRECT write works in ``directory``."""
    path = os.path.join(directory, ".odirect-probe")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        if os.path.exists(path):
            os.unlink(path)
        return False
    try:
        os.pwrite(fd, mmap.mmap(-1, ALIGN_BYTES), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


# ------------------------------------------------------------------ round trips

@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip_of_random_bytes(make_engine, tmp_path, nbytes, threads):
    f = make_engine(threads).open(str(tmp_path / "data"))
    src = _random_bytes(nbytes, seed=nbytes)
    f.write(src, 0).wait()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    f.read(dst, 0).wait()
    assert torch.equal(dst, src)
    f.close()


@pytest.mark.parametrize("nbytes", [1, 4097, MiB + 3])
def test_partial_last_block_is_padded_with_zeros(engine, tmp_path, nbytes):
    f = engine.open(str(tmp_path / "data"))
    f.write(torch.full((_round_up(nbytes),), 0xFF, dtype=torch.uint8), 0).wait()
    src = _random_bytes(nbytes)
    f.write(src, 0).wait()
    assert f.size() == _round_up(nbytes)
    whole = torch.empty(_round_up(nbytes), dtype=torch.uint8)
    f.read(whole, 0).wait()
    assert torch.equal(whole[:nbytes], src)
    assert not whole[nbytes:].any()
    f.close()


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_of_every_dtype(engine, tmp_path, dtype):
    f = engine.open(str(tmp_path / "data"))
    if dtype == torch.bool:
        src = _random((3, 333), dtype, seed=7)
    else:   # any bit pattern (NaNs included): compared as bytes
        src = _random_bytes(3 * 333 * dtype.itemsize, seed=7).view(dtype).view(3, 333)
    f.write(src, 4 * ALIGN_BYTES).wait()
    dst = torch.empty_like(src)
    f.read(dst, 4 * ALIGN_BYTES).wait()
    assert dst.dtype == dtype
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    f.close()


@pytest.mark.parametrize("nbytes", [4095, 4097, 5 * MiB + 7])
def test_unaligned_buffer_addresses_round_trip(engine, tmp_path, nbytes):
    f = engine.open(str(tmp_path / "data"))
    big = torch.zeros(nbytes + 1, dtype=torch.uint8)
    src = big[1:]  # address one byte past torch's (64-byte aligned) allocation
    src.copy_(_random_bytes(nbytes, seed=3))
    assert src.data_ptr() % ALIGN_BYTES != 0
    f.write(src, 0).wait()
    back = torch.zeros(nbytes + 1, dtype=torch.uint8)[1:]
    f.read(back, 0).wait()
    assert torch.equal(back, src)
    f.close()


def test_read_into_aligned_buffer(engine, tmp_path):
    f = engine.open(str(tmp_path / "data"))
    src = aligned_empty(3 * MiB + 5)
    assert src.data_ptr() % ALIGN_BYTES == 0
    src.copy_(_random_bytes(src.numel(), seed=5))
    f.write(src, 0).wait()
    dst = aligned_empty(src.numel()).view(torch.uint8)
    f.read(dst, 0).wait()
    assert dst.data_ptr() % ALIGN_BYTES == 0 and torch.equal(dst, src)
    f.close()


def test_zero_byte_request_is_done_at_once(engine, tmp_path):
    f = engine.open(str(tmp_path / "data"))
    fut = f.write(torch.empty(0), 0)
    assert fut.done()
    fut.wait()
    f.read(torch.empty(0, dtype=torch.int64), 0).wait()
    assert f.size() == 0
    f.close()


@pytest.mark.parametrize("threads", [1, 4])
def test_many_outstanding_futures(make_engine, tmp_path, threads):
    engine = make_engine(threads)
    f = engine.open(str(tmp_path / "data"))
    n_ops, slot = 200, 4 * ALIGN_BYTES
    srcs = [_random_bytes(1 + (i * 997) % slot, seed=i) for i in range(n_ops)]
    writes = [f.write(s, i * slot) for i, s in enumerate(srcs)]
    for w in writes:
        w.wait()
    assert all(w.done() for w in writes)
    dsts = [torch.empty_like(s) for s in srcs]
    reads = [f.read(d, i * slot) for i, d in enumerate(dsts)]
    for r in reversed(reads):  # completion order does not matter
        r.wait()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    f.close()


def test_future_keeps_the_buffer_alive(engine, tmp_path):
    f = engine.open(str(tmp_path / "data"))
    futs = [f.write(torch.full((MiB + 1,), i, dtype=torch.uint8), i * 2 * MiB) for i in range(8)]
    gc.collect()  # the tensors have no other owner than the futures now
    for fut in futs:
        fut.wait()
    for i in range(8):
        back = torch.empty(MiB + 1, dtype=torch.uint8)
        f.read(back, i * 2 * MiB).wait()
        assert bool((back == i).all())
    f.close()


@pytest.mark.slow
def test_done_means_the_engine_let_go_of_the_buffer(engine, tmp_path):
    """Once done() (or wait()) says a request finished, the engine holds its
    buffer no more: memory is given back as the tiers count it."""
    f = engine.open(str(tmp_path / "data"))
    bufs = [torch.full((64 * 1024,), i, dtype=torch.uint8) for i in range(8)]
    refs = [weakref.ref(b) for b in bufs]
    futs = [f.write(b, i * 64 * 1024) for i, b in enumerate(bufs)]
    del bufs
    for i, fut in enumerate(futs):
        if i % 2:
            fut.wait()
        else:
            while not fut.done():
                time.sleep(0.0005)
        gc.collect()
        assert refs[i]() is None, f"request {i} is done but its buffer is still held"
    f.close()


def test_cpp_requests_finish_while_python_holds_the_gil(tmp_path):
    """NOTE [Dropping tensors off the GIL]: the C++ workers complete requests,
    and let go of their buffers, while a Python thread holds the GIL. They used
    to wait for the GIL to drop each buffer: up to a switch interval per
    request while a training thread ran Python. The switch interval is made
    huge so that a worker that needs the GIL cannot get it during the test."""
    reason = cpp_engine_unavailable()
    if reason:
        pytest.skip(f"the C++ extension cannot be built: {reason}")
    from tiermem.io.cpp import CppEngine
    libc = ctypes.PyDLL(ctypes.util.find_library("c"))   # calls keep the GIL
    engine = CppEngine(2)
    f = engine.open(str(tmp_path / "data"))
    n = 64 * 1024
    bufs = [torch.full((n,), i, dtype=torch.uint8) for i in range(6)]
    refs = [weakref.ref(b) for b in bufs]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        futs = [f.write(b, i * n) for i, b in enumerate(bufs)]
        del bufs   # the engine holds the only references now
        libc.usleep(500_000)   # the GIL stays with this thread
        done = [fut.done() for fut in futs]   # (done() destroys what workers let go of)
        alive = [r() is not None for r in refs]
    finally:
        sys.setswitchinterval(interval)
    for fut in futs:
        fut.wait()
    f.close()
    engine.close()
    assert all(done), done
    assert not any(alive), f"buffers still held by workers waiting for the GIL: {alive}"


def test_cpp_buffers_come_back_without_another_engine_call(tmp_path):
    """A buffer the C++ workers let go of off the GIL is destroyed by a drain
    the main thread runs at its next bytecode boundary, not only at the next
    engine call (the last restores of a backward pass have none after them)."""
    reason = cpp_engine_unavailable()
    if reason:
        pytest.skip(f"the C++ extension cannot be built: {reason}")
    from tiermem.io.cpp import CppEngine
    engine = CppEngine(2)
    f = engine.open(str(tmp_path / "data"))
    buf = torch.full((64 * 1024,), 1, dtype=torch.uint8)
    ref = weakref.ref(buf)
    fut = f.write(buf, 0)
    del buf
    deadline = time.monotonic() + 10.0
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.001)   # no engine call here
    released = ref() is None
    fut.wait()
    f.close()
    engine.close()
    assert released, "the buffer was held until the next engine call"


def test_objects_implement_the_interface(engine, tmp_path):
    f = engine.open(str(tmp_path / "data"))
    fut = f.write(torch.ones(3), 0)
    assert isinstance(engine, IOEngine) and isinstance(f, IOFile) and isinstance(fut, IOFuture)
    assert engine.name in ("cpp", "python") and engine.threads == 4
    assert f.path == str(tmp_path / "data")
    fut.wait()
    f.close()


# ------------------------------------------------------------------ files

def test_direct_io_on_a_disk_directory(engine, tmp_path):
    if not _fs_takes_o_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} rejects O_DIRECT")
    f = engine.open(str(tmp_path / "data"))
    assert f.direct is True
    src = _random_bytes(2 * MiB + 1)
    f.write(src, 0).wait()
    dst = torch.empty_like(src)
    f.read(dst, 0).wait()
    assert torch.equal(dst, src)
    f.close()


def test_dev_shm_round_trips(engine):
    # tmpfs rejected O_DIRECT before Linux 6.6 and takes it since: either way it works.
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/tiermem-test-{os.getpid()}-{engine.name}"
    f = engine.open(path)
    try:
        assert f.direct == _fs_takes_o_direct("/dev/shm")
        src = _random_bytes(MiB + 3)
        f.write(src, 0).wait()
        dst = torch.empty_like(src)
        f.read(dst, 0).wait()
        assert torch.equal(dst, src)
    finally:
        f.close()
        os.unlink(path)


def test_o_direct_fallback_on_ramfs_logs_once(make_engine, tmp_path, caplog):
    with mounted(tmp_path / "mnt-ramfs", "ramfs", "mode=0700") as where:
        engine = make_engine(2)
        with caplog.at_level(logging.WARNING, logger="tiermem"):
            files = [engine.open(str(where / f"f{i}"), 3 * ALIGN_BYTES) for i in range(2)]
        assert [f.direct for f in files] == [False, False]
        notes = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
        assert len(notes) == 1 and notes[0].levelno == logging.WARNING, \
            [r.getMessage() for r in caplog.records]
        src = _random_bytes(MiB + 5)
        files[0].write(src, ALIGN_BYTES).wait()
        dst = torch.zeros(MiB + 6, dtype=torch.uint8)[1:]
        files[0].read(dst, ALIGN_BYTES).wait()
        assert torch.equal(dst, src)
        assert files[1].size() == 3 * ALIGN_BYTES
        for f in files:
            f.close()


def test_resize_grows_and_shrinks(engine, tmp_path):
    f = engine.open(str(tmp_path / "data"), MiB)
    assert f.size() == MiB
    f.resize(3 * MiB)
    assert f.size() == 3 * MiB
    f.resize(ALIGN_BYTES)
    assert f.size() == ALIGN_BYTES
    f.close()


def test_open_refuses_an_existing_path_or_symlink(engine, tmp_path):
    (tmp_path / "there").write_bytes(b"x")
    os.symlink(tmp_path / "nowhere", tmp_path / "link")
    for name in ("there", "link"):
        with pytest.raises(OSError) as e:
            engine.open(str(tmp_path / name))
        assert e.value.errno == errno.EEXIST and str(tmp_path / name) in str(e.value)
    assert not (tmp_path / "nowhere").exists()


def test_open_in_a_missing_directory_raises_enoent(engine, tmp_path):
    path = str(tmp_path / "missing" / "data")
    with pytest.raises(OSError) as e:
        engine.open(path)
    assert e.value.errno == errno.ENOENT
    assert f"tiermem: open of {path} failed" in str(e.value)


def test_close_waits_and_is_idempotent(engine, tmp_path):
    f = engine.open(str(tmp_path / "data"))
    futs = [f.write(_random_bytes(MiB, seed=i), i * MiB) for i in range(16)]
    f.close()
    assert all(fut.done() for fut in futs)
    f.close()
    with pytest.raises(OSError) as e:
        f.write(torch.ones(1), 0)
    assert e.value.errno == errno.EBADF
    assert os.path.getsize(tmp_path / "data") == 16 * MiB


def test_engine_close_runs_queued_requests(make_engine, tmp_path):
    engine = make_engine(2)
    f = engine.open(str(tmp_path / "data"))
    futs = [f.write(_random_bytes(MiB), i * MiB) for i in range(8)]
    engine.close()
    engine.close()
    assert engine.closed and all(fut.done() for fut in futs)
    for fut in futs:
        fut.wait()
    f.close()


# ------------------------------------------------------------------ errors

@pytest.mark.parametrize("offset", [1, 4095, 4097, -4096])
def test_misaligned_offset_raises_value_error(engine, tmp_path, offset):
    f = engine.open(str(tmp_path / "data"))
    for op in (f.write, f.read):
        with pytest.raises(ValueError, match=str(offset)):
            op(torch.ones(4), offset)
    f.close()


def test_non_contiguous_tensor_raises_value_error(engine, tmp_path):
    f = engine.open(str(tmp_path / "data"))
    with pytest.raises(ValueError, match="contiguous"):
        f.write(torch.ones(4, 4).t(), 0)
    f.close()


def test_short_read_raises_oserror(engine, tmp_path):
    f = engine.open(str(tmp_path / "data"))
    f.write(_random_bytes(ALIGN_BYTES), 0).wait()
    for nbytes in (ALIGN_BYTES + 1, 3 * MiB):
        fut = f.read(torch.empty(nbytes, dtype=torch.uint8), 0)
        with pytest.raises(OSError) as e:
            fut.wait()
        assert e.value.errno == errno.EIO
        msg = str(e.value)
        assert f"tiermem: read of {nbytes} bytes at offset 0 in {f.path} failed" in msg
        assert "short read" in msg
    f.close()


def test_full_disk_raises_enospc_with_path_op_and_offset(engine, tmp_path):
    with mounted(tmp_path / "mnt-tmpfs", "tmpfs", "size=1m,mode=0700") as where:
        f = engine.open(str(where / "data"))
        fut = f.write(_random_bytes(2 * MiB), 8 * ALIGN_BYTES)
        with pytest.raises(OSError) as e:
            fut.wait()
        assert e.value.errno == errno.ENOSPC
        assert (f"tiermem: write of {2 * MiB} bytes at offset {8 * ALIGN_BYTES} in {f.path} "
                f"failed: {os.strerror(errno.ENOSPC)}") in str(e.value)
        f.close()
        os.unlink(f.path)
        # Growing past the free space fails at once, and open leaves nothing behind.
        with pytest.raises(OSError) as e:
            engine.open(str(where / "big"), 4 * MiB)
        assert e.value.errno == errno.ENOSPC and "big" in str(e.value)
        assert not (where / "big").exists()


def test_read_only_filesystem_raises_erofs(engine, tmp_path):
    with mounted(tmp_path / "mnt-tmpfs", "tmpfs", "size=1m,ro") as where:
        with pytest.raises(OSError) as e:
            engine.open(str(where / "data"))
        assert e.value.errno == errno.EROFS and str(where / "data") in str(e.value)


def test_dropped_futures_complete_before_close(engine, tmp_path):
    f = engine.open(str(tmp_path / "data"))
    for i in range(24):  # neither the future nor the tensor is kept by the caller
        f.write(torch.full((MiB + 7,), i, dtype=torch.uint8), i * 2 * MiB)
    gc.collect()
    f.close()
    with open(tmp_path / "data", "rb") as raw:
        for i in range(24):
            raw.seek(i * 2 * MiB)
            assert raw.read(MiB + 7) == bytes([i]) * (MiB + 7)


def test_submits_from_several_python_threads(engine, tmp_path):
    import threading

    f = engine.open(str(tmp_path / "data"))
    errors = []

    def worker(t):
        try:
            srcs = [_random_bytes(4097 * (i + 1), seed=100 * t + i) for i in range(20)]
            futs = [f.write(s, (t * 20 + i) * 128 * ALIGN_BYTES) for i, s in enumerate(srcs)]
            for fut in futs:
                fut.wait()
            for i, s in enumerate(srcs):
                d = torch.empty_like(s)
                f.read(d, (t * 20 + i) * 128 * ALIGN_BYTES).wait()
                assert torch.equal(d, s)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    f.close()


@pytest.mark.slow
def test_cpp_core_is_race_free_under_thread_sanitizer(tmp_path):
    """csrc/io_engine.cpp driven by csrc/tests/stress_io.cpp, built with -fsanitize=thread."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on PATH")
    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    exe = str(tmp_path / "stress_io")
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-g", "-fsanitize=thread", f"-I{csrc}",
         os.path.join(csrc, "tests", "stress_io.cpp"), os.path.join(csrc, "io_engine.cpp"),
         "-o", exe, "-pthread"], capture_output=True, text=True, timeout=120)
    if build.returncode != 0:
        pytest.skip(f"cannot build with -fsanitize=thread: {build.stderr.strip()[-500:]}")
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    run = subprocess.run([exe, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=env)
    if "unexpected memory mapping" in run.stderr:
        pytest.skip(f"ThreadSanitizer cannot run on this kernel: {run.stderr.strip()[:300]}")
    assert run.returncode == 0, run.stderr[-4000:]
    assert "stress_io: ok" in run.stdout and "ThreadSanitizer" not in run.stderr


# ------------------------------------------------------------------ selection

def test_unknown_kind_or_threads_raise_value_error():
    with pytest.raises(ValueError, match="rust"):
        get_engine("rust")
    with pytest.raises(ValueError, match="threads"):
        get_engine("python", 0)


def test_engines_are_cached_per_kind_and_threads():
    a = get_engine("python", 3)
    assert get_engine("python", 3) is a and get_engine("python", 2) is not a
    assert a.name == "python" and a.threads == 3


def test_engine_info_says_which_engine_and_why():
    info = tio.engine_info()
    assert set(info) == {"engine", "reason", "extension_path", "cuda"}
    assert info["engine"] in ("cpp", "python") and info["reason"]
    assert isinstance(info["cuda"], bool)
    if info["engine"] == "cpp":
        assert os.path.isfile(info["extension_path"])
        assert get_engine("auto").name == "cpp"


def test_engine_info_follows_tiermem_engine(monkeypatch):
    monkeypatch.setenv("TIERMEM_ENGINE", " Python ")
    info = tio.engine_info()
    assert info["engine"] == "python" and "TIERMEM_ENGINE is 'python'" in info["reason"]
    assert info["extension_path"] is None and info["cuda"] is False
    monkeypatch.setenv("TIERMEM_ENGINE", "rust")
    with pytest.raises(tiermem.ConfigError, match="TIERMEM_ENGINE='rust'"):
        tio.engine_info()
    assert tio.engine_info("python")["engine"] == "python"   # an argument wins
    with pytest.raises(ValueError, match="'rust'"):
        tio.engine_info("rust")


@pytest.fixture
def broken_build(monkeypatch, tmp_path):
    """No engine at hand (none installed, an empty build cache) and a compiler that fails."""
    from tiermem.io import buildkey
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("Error building extension 'tiermem_C': bindings.cpp:1: error: boom")

    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setattr(buildkey, "PREBUILT_MODULE", "tiermem_not_installed")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    with tiermem.testing.fresh_engines():
        yield


def test_auto_falls_back_to_python_with_one_warning(broken_build, caplog):
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        engines = [get_engine("auto", 2), get_engine("auto", 3)]
    assert [e.name for e in engines] == ["python", "python"]
    from tiermem.io.build import BUILD_MESSAGE
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                and not r.getMessage().startswith(BUILD_MESSAGE)]   # the build's own line
    assert len(warnings) == 1 and "error: boom" in warnings[0]
    assert tio.engine_info()["engine"] == "python"
    assert "error: boom" in tio.engine_info()["reason"]
    for e in engines:
        e.close()


def test_engine_info_for_cpp_when_it_cannot_build_says_none(broken_build):
    info = tio.engine_info("cpp")
    assert info["engine"] == "none" and "error: boom" in info["reason"]
    assert "'cpp'" in info["reason"]


def test_cpp_kind_raises_with_the_compiler_output(broken_build):
    with pytest.raises(tiermem.TierMemError, match="error: boom"):
        get_engine("cpp")


def test_stale_build_lock_is_removed_only_where_its_existence_is_the_lock(tmp_path,
                                                                         monkeypatch):
    """torch <= 2.13 (FileBaton): an old lock file is a killed build's, removed;
    torch >= 2.14 (FileLock, an OS lock on a file that stays): left alone."""
    import types

    lock = tmp_path / "lock"
    old = time.time() - 3600
    for torch_kind, kept in ((types.SimpleNamespace(), False),
                             (types.SimpleNamespace(FileLock=object), True)):
        lock.write_text("")
        os.utime(lock, (old, old))
        tiermem.testing.clear_stale_build_lock(torch_kind, str(tmp_path))
        assert lock.exists() is kept


def test_a_fresh_lock_of_a_killed_build_does_not_hang_the_next_build(tmp_path, monkeypatch,
                                                                      caplog):
    """A build killed mid-compile leaves torch's (<= 2.13) lock file, however
    young; the next build must not wait on it forever: it is gone before
    torch's loader runs (NOTE [Build lock] in tiermem/io/build.py)."""
    import types

    from tiermem.io import build, buildkey

    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    name = buildkey.build_name(torch.__version__, False, buildkey.variant_sha256(csrc, False))
    lock = tmp_path / name / "lock"
    lock.parent.mkdir()
    lock.write_text("")   # just made: the age rule alone would wait on it
    seen = []

    def load(name, build_directory, **kwargs):   # torch's loader would wait on the lock
        seen.append(os.path.exists(os.path.join(build_directory, "lock")))
        return types.SimpleNamespace(__file__=os.path.join(build_directory, name + ".so"))

    torch_like = types.SimpleNamespace(load=load, CUDA_HOME=None,
                                       get_default_build_root=lambda: str(tmp_path))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        build.build_and_import(torch_like, csrc, False, False)
    assert seen == [False]
    assert any("left by a build of the C++ engine that was killed" in r.getMessage()
               for r in caplog.records)
