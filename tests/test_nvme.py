"""The nvme tier on the CPU: exact gradients, disk full, killed processes,
no files left, a bounded arena, bad directories, checksums."""

from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import tiermem
import tiermem.testing
from helpers import (SlowFuture, compare_records, mounted, offloader, reference_steps,
                     train_steps, until)
from models import SaveIt, make_case


def _off(nvme_dir, **settings):
    """An Offloader of policy nvme (unless ``settings`` say otherwise) spilling
    to ``nvme_dir`` (``helpers.offloader``: every tensor, the Python engine)."""
    settings.setdefault("policy", "nvme")
    return offloader(nvme_dir=nvme_dir, **settings)


# Every model through the nvme tier, and a callable mixing keep, cpu and nvme:
# the core matrix in test_gradients.py. Here: each engine, with and without
# checksums.
@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_nvme_gradients_bit_identical_per_engine(engine, verify, nvme_dir):
    ref = reference_steps("block", 3)
    off = _off(nvme_dir, engine=engine, verify=verify)
    compare_records(train_steps(make_case("block"), lambda: off, 3), ref, f"block/{engine}")
    assert off.stats.count_by_tier["nvme"] > 0
    off.close()


def test_default_policy_on_cpu_with_nvme_dir_is_nvme(nvme_dir):
    off = tiermem.Offloader(nvme_dir=nvme_dir, min_offload_bytes=0, engine="python")
    x = torch.randn(256, 256, requires_grad=True)
    with off:
        (x * 2).sin().sum().backward()
    assert off.stats.count_by_tier["nvme"] == 1
    off.close()


def test_saved_tensor_memory_is_freed_once_written(nvme_dir):
    off = _off(nvme_dir)
    x = torch.randn(1 << 18, requires_grad=True)
    with off:
        y = x * 2
        ref = StorageWeakRef(y.untyped_storage())
        z = y.sin()
        del y
    tiermem.testing.store_of(off, tiermem.Tier.NVME).drain()
    tiermem.testing.poll(off)
    gc.collect()
    assert ref.expired(), "the saved tensor is still alive after its write landed"
    z.sum().backward()
    assert torch.equal(x.grad, (x.detach() * 2).cos() * 2)
    off.close()


@pytest.mark.parametrize("settle", [True, False], ids=["settled", "free-running"])
def test_no_files_left_after_close_and_arena_stable_over_50_steps(nvme_dir, settle):
    """Same-shaped steps reuse the arena's extents. The file is grown by
    exactly what is missing (the default 64 MiB steps would hide a leak).

    settled: every write lands before backward (so backward reads from the
    disk) and every I/O has finished between steps, so any growth after the
    first step is a leaked extent. free-running: an extent is reused once its
    last I/O is done, so a handle freed while its write is in flight can make
    a step grow the file (timing, and the fragmentation it leaves): bounded,
    where a leak of even one extent every few steps makes it grow again and
    again (measured: 32 of 50 steps, 3.6x, leaking one free in 29)."""
    case = make_case("block")
    off = _off(nvme_dir)
    opt = torch.optim.SGD(case.model.parameters(), lr=1e-3)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    store.arena.grow_bytes = store.arena.align
    sizes = []
    for _ in range(50):
        with off:
            loss = case.loss_fn(case.model(*case.inputs))
        if settle:
            store.drain()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if settle:
            store.settle()
        sizes.append((store.arena.size_bytes, os.path.getsize(store.path)))
    assert sizes[0][0] > 0 and all(a == f for a, f in sizes)
    grew = [i for i in range(1, 50) if sizes[i] != sizes[i - 1]]
    detail = f"arena grew at steps {grew}: {sizes[0][0]} -> {sizes[-1][0]} bytes"
    if settle:
        assert grew == [], detail
        assert store.arena.used_bytes == 0
        assert off.stats.prefetch_hits + off.stats.prefetch_misses > 0   # reads ran
    else:
        assert len(grew) <= 10 and sizes[-1][0] <= 2 * sizes[0][0], detail
    assert len(os.listdir(nvme_dir)) == 1
    off.close()
    assert os.listdir(nvme_dir) == []


class _Steps:
    """``off`` as a context that records each step's stats."""

    def __init__(self, off) -> None:
        self.off, self.stats = off, []

    def __enter__(self):
        ctx = self.off.__enter__()
        self.stats.append(ctx.stats)
        return ctx

    def __exit__(self, *exc):
        return self.off.__exit__(*exc)


def test_tiny_nvme_budget_falls_back_to_cpu_exactly(nvme_dir, caplog, engine):
    """Every step places its tensors alike, whatever the I/O timing: extents
    whose writes of the last step still run (backward took the originals
    before the writes landed) are waited for, not refused (NOTE [Buffers of
    earlier steps] in memory/hostpool.py; before, under load, a step found the tiny
    arena full and sent everything to cpu)."""
    ref = reference_steps("mlp", 3)
    off = _off(nvme_dir, nvme_budget=4096 * 4, engine=engine)
    steps = _Steps(off)
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        compare_records(train_steps(make_case("mlp"), lambda: steps, 3), ref, "mlp")
    for s in steps.stats:
        assert s.budget_fallbacks > 0 and s.count_by_tier["cpu"] > 0
        assert s.count_by_tier["nvme"] > 0
        assert s.count_by_tier == steps.stats[0].count_by_tier, [x.count_by_tier
                                                                 for x in steps.stats]
    assert tiermem.testing.store_of(off, tiermem.Tier.NVME).arena.size_bytes <= 4096 * 4
    assert len([r for r in caplog.records if "nvme tier is full" in r.getMessage()]) == 1
    off.close()


class _SlowWriteFile:
    """The store's file; each write completes ``delay`` seconds after it was
    submitted at the earliest (a disk behind the training loop)."""

    def __init__(self, f, delay: float) -> None:
        self._f, self.delay = f, delay

    def __getattr__(self, name):
        return getattr(self._f, name)

    def write(self, buf, offset):
        return SlowFuture(self._f.write(buf, offset), time.monotonic() + self.delay)


def test_extents_of_writes_still_running_from_the_last_step_are_waited_for(nvme_dir):
    """The deterministic form of the tiny-budget flake: every write lands 1 s
    late, so backward takes the originals and the writes still run when the
    next step starts. That step waits for them and places its tensors as the
    first did (NOTE [Buffers of earlier steps] in memory/hostpool.py); it found the
    arena full before (nvme 0)."""
    ref = reference_steps("mlp", 3)
    off = _off(nvme_dir, nvme_budget=4096 * 4)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    store.file = _SlowWriteFile(store.file, 1.0)
    steps = _Steps(off)
    compare_records(train_steps(make_case("mlp"), lambda: steps, 3), ref, "mlp")
    counts = [s.count_by_tier for s in steps.stats]
    assert counts[0]["nvme"] > 0 and counts[1:] == [counts[0]] * 2, counts
    assert store.earlier_waits > 0
    off.close()


def test_disk_full_on_a_small_tmpfs_falls_back(tmp_path):
    with mounted(tmp_path / "small", "tmpfs", "size=32k") as mnt:
        ref = reference_steps("block", 2)
        off = _off(str(mnt), nvme_budget="1GiB")
        try:
            compare_records(train_steps(make_case("block"), lambda: off, 2), ref, "block")
            s = off.stats
            assert s.budget_fallbacks > 0 and s.count_by_tier["cpu"] > 0
            assert tiermem.testing.store_of(off, tiermem.Tier.NVME).arena.disk_full
        finally:
            off.close()


class _FailedFuture:
    def __init__(self, error: OSError) -> None:
        self.error = error

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        raise self.error


class _FullDiskFile:
    """The store's file, with every write failing with ENOSPC: at submit
    (``when="submit"``) or when the write runs (``"write"``), as on a
    filesystem without fallocate whose disk filled up after the arena grew."""

    def __init__(self, f, when: str) -> None:
        self._f, self.when, self.writes = f, when, 0

    def __getattr__(self, name):
        return getattr(self._f, name)

    def write(self, buf, offset):
        self.writes += 1
        error = OSError(errno.ENOSPC, "No space left on device (injected)")
        if self.when == "submit":
            raise error
        return _FailedFuture(error)


@pytest.mark.parametrize("when", ["submit", "write"])
def test_enospc_at_a_write_falls_back_exactly_and_stops_the_tier(nvme_dir, caplog, when,
                                                                 engine):
    ref = reference_steps("mlp", 3)
    off = _off(nvme_dir, engine=engine)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    store.file = _FullDiskFile(store.file, when)
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        compare_records(train_steps(make_case("mlp"), lambda: off, 3), ref, "mlp")
    s = off.stats
    assert store.disk_full
    assert store.file.writes == 1, "the tier kept writing to a full disk"
    assert s.budget_fallbacks > 0 and s.count_by_tier["cpu"] > 0
    full = [r for r in caplog.records if "the disk is full" in r.getMessage()]
    assert len(full) == 1 and "No space left on device" in full[0].getMessage()
    assert str(store.path) in full[0].getMessage()
    off.close()
    assert os.listdir(nvme_dir) == []


_CHILD = textwrap.dedent("""
    import sys, time, torch, tiermem
    off = tiermem.Offloader(policy="nvme", nvme_dir=sys.argv[1], min_offload_bytes=0,
                            engine="python")
    x = torch.randn(1 << 16, requires_grad=True)
    with off:
        y = (x * 2).sin()
    print("ready", flush=True)
    time.sleep(60)
""")


def _age(path):
    """Make a directory look older than spilldir.YOUNG_SECONDS (a directory
    changed more recently is never removed as stale)."""
    from tiermem.memory.spilldir import YOUNG_SECONDS
    old = time.time() - YOUNG_SECONDS - 5
    os.utime(path, (old, old))


def _spawn(nvme_dir):
    p = subprocess.Popen([sys.executable, "-c", _CHILD, nvme_dir], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.slow
def test_directory_of_a_killed_process_is_removed_at_next_start(nvme_dir):
    dead = _spawn(nvme_dir)
    alive = _spawn(nvme_dir)
    try:
        dirs = set(os.listdir(nvme_dir))
        assert len(dirs) == 2
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        dead_dir = [d for d in dirs if d.startswith(f"tiermem-{dead.pid}-")]
        assert dead_dir and os.path.isdir(os.path.join(nvme_dir, dead_dir[0]))
        for d in dirs:
            _age(os.path.join(nvme_dir, d))
        off = _off(nvme_dir)
        left = set(os.listdir(nvme_dir))
        assert dead_dir[0] not in left
        assert any(d.startswith(f"tiermem-{alive.pid}-") for d in left)
        off.close()
    finally:
        alive.kill()
        alive.wait()


_HOLD_LOCK = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(60)
""")


def test_directory_whose_lock_is_held_is_kept_whatever_its_pid(nvme_dir):
    """An owner in another PID namespace (or on another NFS host) has a pid we
    cannot see: its flock on owner.lock keeps its directory; once it is gone
    (the kernel drops the lock), the directory is removed."""
    from tiermem.memory.spilldir import remove_stale_dirs

    d = os.path.join(nvme_dir, "tiermem-999999999-1-abcdef01")   # no such pid here
    os.makedirs(d, 0o700)
    lock = os.path.join(d, "owner.lock")
    open(lock, "w").close()
    _age(d)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, lock], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert remove_stale_dirs(nvme_dir) == [] and os.path.isdir(d)
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale_dirs(nvme_dir) == [d] and not os.path.exists(d)


def test_directory_of_an_earlier_process_with_our_pid_is_removed(nvme_dir):
    """A restarted container's trainer often gets the same pid (pid 1) as the
    run that was killed: a directory with our pid but another start time, and
    nobody holding its lock, is stale. Our own live directory stays."""
    from tiermem.memory.spilldir import remove_stale_dirs

    off = _off(nvme_dir)
    try:
        (own,) = os.listdir(nvme_dir)
        d = os.path.join(nvme_dir, f"tiermem-{os.getpid()}-1000-deadbeef")
        os.makedirs(d, 0o700)
        open(os.path.join(d, "owner.lock"), "w").close()
        open(os.path.join(d, "arena-0.bin"), "wb").close()
        _age(d)
        assert remove_stale_dirs(nvme_dir) == [d]
        assert os.listdir(nvme_dir) == [own]
    finally:
        off.close()


def test_a_young_directory_is_kept_whatever_its_pid_says(nvme_dir):
    """Its owner may be between creating it and locking it, in a PID namespace
    where its pid means nothing to us."""
    from tiermem.memory.spilldir import remove_stale_dirs

    d = os.path.join(nvme_dir, "tiermem-999999999-1-abcdef02")   # no such pid here
    os.makedirs(d, 0o700)
    assert remove_stale_dirs(nvme_dir) == [] and os.path.isdir(d)
    _age(d)
    assert remove_stale_dirs(nvme_dir) == [d] and not os.path.exists(d)


def test_own_live_directory_is_never_removed_nor_probed(nvme_dir):
    """Even if our start time reads differently now (a stepped wall clock) and
    locks say nothing (no flock; or NFS, where probing our own lock would
    release it)."""
    from tiermem.memory import spilldir

    off = _off(nvme_dir)
    try:
        (own,) = os.listdir(nvme_dir)
        _age(os.path.join(nvme_dir, own))

        def probed(path):
            raise AssertionError(f"probed the lock of {path}")
        with tiermem.testing.stale_dir_probes(lambda pid: 12345, probed):
            assert spilldir.remove_stale_dirs(nvme_dir) == []
            assert os.listdir(nvme_dir) == [own]
            off.close()
            assert os.listdir(nvme_dir) == []
        assert os.path.abspath(os.path.join(nvme_dir, own)) not in tiermem.testing.live_dirs()
    finally:
        off.close()


def test_own_directory_holds_its_lock(nvme_dir):
    import fcntl

    off = _off(nvme_dir)
    (d,) = os.listdir(nvme_dir)
    fd = os.open(os.path.join(nvme_dir, d, "owner.lock"), os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    off.close()
    assert os.listdir(nvme_dir) == []


def test_forked_child_leaves_the_parents_directory(nvme_dir):
    """A child forked from the owner runs the inherited exit hooks when it
    exits normally: they must not remove the parent's live directory."""
    off = _off(nvme_dir)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    (d,) = os.listdir(nvme_dir)
    pid = os.fork()
    if pid == 0:   # the child: what its atexit hooks would do, then leave at once
        try:
            store.remove_dir()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.listdir(nvme_dir) == [d] and os.path.isfile(store.path)
    off.close()
    assert os.listdir(nvme_dir) == []


@pytest.mark.slow
def test_directory_removed_at_interpreter_exit(nvme_dir):
    code = _CHILD.replace("time.sleep(60)", "")
    assert code != _CHILD
    subprocess.run([sys.executable, "-c", code, nvme_dir], check=True)
    assert os.listdir(nvme_dir) == []


def test_private_directory_is_0700(nvme_dir):
    off = _off(nvme_dir)
    (d,) = os.listdir(nvme_dir)
    assert os.stat(os.path.join(nvme_dir, d)).st_mode & 0o777 == 0o700
    off.close()


def test_nvme_dir_that_is_a_file_is_a_config_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(tiermem.ConfigError, match=f"nvme_dir='{f}' is a file"):
        _off(str(f))


def test_missing_nvme_dir_is_created(tmp_path):
    d = tmp_path / "a" / "b"
    off = _off(str(d))
    assert d.is_dir()
    off.close()


def test_read_only_nvme_dir_is_a_config_error(tmp_path):
    with mounted(tmp_path / "ro", "tmpfs", "ro,size=64k") as path:
        mnt = str(path)
        with pytest.raises(tiermem.ConfigError, match="read-only") as e:
            _off(mnt)
        assert repr(mnt) in str(e.value)


def test_unwritable_nvme_dir_is_a_config_error(tmp_path):
    """Not writable even by root: an immutable directory (chattr +i)."""
    d = tmp_path / "immutable"
    d.mkdir()
    r = subprocess.run(["chattr", "+i", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot make a directory immutable here: {r.stderr.strip()}")
    try:
        with pytest.raises(tiermem.ConfigError, match="not writable") as e:
            _off(str(d))
        assert repr(str(d)) in str(e.value) and "nvme_dir=" in str(e.value)
    finally:
        subprocess.run(["chattr", "-i", str(d)], capture_output=True)


def test_private_dir_that_cannot_be_made_is_a_config_error(nvme_dir, monkeypatch):
    from tiermem.tiers import nvme

    def refuse(root):
        raise PermissionError(errno.EACCES, "Permission denied", root)
    monkeypatch.setattr(nvme, "PrivateDir", refuse)
    with pytest.raises(tiermem.ConfigError, match="Permission denied") as e:
        _off(nvme_dir)
    assert repr(nvme_dir) in str(e.value)


def test_policy_nvme_without_dir_is_a_config_error():
    with pytest.raises(tiermem.ConfigError, match="TIERMEM_NVME_DIR"):
        tiermem.Offloader(policy="nvme")


def _saved_to_disk(nvme_dir, verify, engine="python"):
    off = _off(nvme_dir, verify=verify, engine=engine)
    x = torch.randn(1 << 16, requires_grad=True)
    with off:
        z = (x * 2).sin()
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    store.drain()
    tiermem.testing.poll(off)
    return off, store, z


def test_verify_detects_a_file_changed_underneath(nvme_dir, engine):
    off, store, z = _saved_to_disk(nvme_dir, verify=True, engine=engine)
    with open(store.path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 64)
    with pytest.raises(tiermem.TierMemError, match="checksum") as err:
        z.sum().backward()
    assert store.path in str(err.value)
    off.close()


def test_read_errors_name_the_module_that_saved_the_tensor(nvme_dir):
    off = _off(nvme_dir, verify=True)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
    with off:
        z = model(torch.randn(64, 256))
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    store.drain()
    with open(store.path, "r+b") as f:
        f.write(b"\xff" * store.arena.size_bytes)
    with pytest.raises(tiermem.TierMemError, match="checksum") as err:
        z.sum().backward()
    assert "saved in module Sequential." in str(err.value), str(err.value)
    off.close()


def test_short_read_names_the_file(nvme_dir, engine):
    off, store, z = _saved_to_disk(nvme_dir, verify=False, engine=engine)
    os.truncate(store.path, 0)
    with pytest.raises(tiermem.TierMemError) as err:
        z.sum().backward()
    assert store.path in str(err.value) and "reading" in str(err.value)
    off.close()


def test_backward_after_close_raises_clearly(nvme_dir):
    off, store, z = _saved_to_disk(nvme_dir, verify=False)
    off.close()
    with pytest.raises(tiermem.TierMemError, match="closed"):
        z.sum().backward()


def test_exception_mid_forward_frees_disk_extents(nvme_dir):
    off = _off(nvme_dir)
    x = torch.randn(1 << 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="boom"):
        with off:
            y = (x * 2).sin()
            raise RuntimeError("boom")
    del y
    gc.collect()
    tiermem.testing.poll(off)
    assert off.disk_bytes_in_use == 0
    off.close()


# -- staged moves (NOTE [Staged moves] in tiermem/tiers/moving.py) -----------------
# CUDA tensors go device -> staging -> disk, and their device memory is freed
# once the bytes are in staging. Here CPU tensors take the same path
# (tiermem.testing.stage_cpu_tensors), so that its logic runs in CI.

def _staged(nvme_dir, **kw):
    off = _off(nvme_dir, **kw)
    tiermem.testing.stage_cpu_tensors(off)
    return off


def test_staged_writes_gradients_bit_identical(model_case, nvme_dir, engine):
    ref = reference_steps(model_case.name, 3)
    off = _staged(nvme_dir, engine=engine)
    compare_records(train_steps(model_case, lambda: off, 3), ref, model_case.name)
    assert off.stats.count_by_tier["nvme"] > 0
    off.close()
    assert os.listdir(nvme_dir) == []


class _GatedFile:
    """The store's file; writes wait for ``gate`` (or fail with EIO if ``fail``)."""

    def __init__(self, f, fail: bool = False) -> None:
        self._f, self.fail = f, fail
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self._f, name)

    def write(self, buf, offset):
        assert self.gate.wait(30), "the test never opened the gate"
        if self.fail:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return self._f.write(buf, offset)


def _chain(x):
    return (x * 2).sin().cos().exp()


def _until_staged(off, handles):
    """Poll until every handle's source is gone and its bytes are in staging."""
    def staged():
        tiermem.testing.poll(off)
        return all(h.host is not None and h.src is None for h in handles)
    until(staged, "the copies to staging never landed")


def test_staged_source_is_freed_once_copied_and_served_from_staging(nvme_dir):
    torch.manual_seed(0)
    x = torch.randn(1 << 16, requires_grad=True)
    _chain(x).sum().backward()
    ref, x.grad = x.grad.clone(), None

    off = _staged(nvme_dir)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    store.file = gated = _GatedFile(store.file)
    with off:
        a = x * 2
        b = a.sin()
        c = b.cos()
        out = c.exp()
    handles = [ref_() for ref_, _ in store.pending_moves()]
    assert len(handles) >= 3 and all(h is not None for h in handles)
    freed = StorageWeakRef(a.untyped_storage())
    del a, b, c
    gc.collect()

    _until_staged(off, handles)
    assert freed.expired(), "the source was kept after its copy to staging landed"
    assert not gated.gate.is_set() and all(not job.done() for _, job in store.pending_moves())
    out.sum().backward()                 # every write still held back: from staging
    assert torch.equal(x.grad, ref)
    gated.gate.set()
    off.close()
    assert os.listdir(nvme_dir) == []


def test_staged_write_failing_after_the_source_was_freed_loses_nothing(nvme_dir, caplog):
    """The bytes are then only in staging: the handle keeps that buffer (its
    pool does not hand it out again) and backward restores from it."""
    torch.manual_seed(0)
    xs = [torch.randn(1 << 15, requires_grad=True) for _ in range(2)]
    refs = []
    for x in xs:
        _chain(x).sum().backward()
        refs.append(x.grad.clone())
        x.grad = None
    off = _staged(nvme_dir)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    outs = []
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        for x in xs:   # the second step must not be handed the first one's buffers
            store.file = gated = _GatedFile(getattr(store.file, "_f", store.file),
                                             fail=True)
            with off:
                outs.append(_chain(x))
            handles = [r() for r, _ in store.pending_moves()]

            _until_staged(off, handles)
            gated.gate.set()             # now the writes fail, the sources are gone
            store.drain()
            assert all(h.failed and h.host is not None for h in handles)
    assert off.stats.budget_fallbacks > 0
    assert any("Input/output error" in r.getMessage() for r in caplog.records)
    for out, x, ref in zip(reversed(outs), reversed(xs), reversed(refs)):
        out.sum().backward()
        assert torch.equal(x.grad, ref)
    assert store.staging.in_use_bytes > 0   # the failed handles still hold theirs
    del outs
    handles.clear()
    gc.collect()
    assert store.staging.in_use_bytes == 0, "a staging buffer was never given back"
    off.close()


def test_staged_in_place_write_before_the_copy_landed_raises(nvme_dir):
    off = _staged(nvme_dir)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    store.file = gated = _GatedFile(store.file)
    x = torch.randn(1 << 16, requires_grad=True)
    with off:
        a = x * 2
        b = a.sin()                      # saves a
        a.add_(1)                        # before the forward thread saw its copy land
    gated.gate.set()
    with pytest.raises((tiermem.TierMemError, RuntimeError), match="in-place|inplace"):
        b.sum().backward()
    off.close()


def test_staged_tensor_saved_twice_retain_graph_from_staging(nvme_dir):
    """A tensor saved twice (dedup: one handle, two uses), two backward passes,
    while its write is held back: each pass restores it from staging once."""
    torch.manual_seed(0)
    x = torch.randn(1 << 15, requires_grad=True)

    def f(x):
        y = (x * 2).sin()
        return (y * y).sum()     # mul saves y twice
    f(x).backward()
    ref, x.grad = x.grad.clone(), None
    off = _staged(nvme_dir)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    store.file = gated = _GatedFile(store.file)
    with off:
        out = f(x)
    handles = [r() for r, _ in store.pending_moves()]
    assert any(h.entry.uses == 2 for h in handles)

    _until_staged(off, handles)
    for _ in range(2):
        out.backward(retain_graph=True)
        assert torch.equal(x.grad, ref)
        x.grad = None
        assert all(h.cached is None for h in handles), "a restored tensor outlived its pass"
    gated.gate.set()
    del out
    handles.clear()
    off.close()


def test_staged_sources_dropped_when_writes_finish_out_of_order(nvme_dir):
    """The first write is held back, the later ones finish: their sources go
    (at copy) although their moves cannot land before the first one."""
    off = _staged(nvme_dir, io_threads=4)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    inner = store.file
    first = threading.Event()
    calls = []

    class FirstHeld:
        def __getattr__(self, name):
            return getattr(inner, name)

        def write(self, buf, offset):
            calls.append(offset)
            if len(calls) == 1:
                assert first.wait(30)
            return inner.write(buf, offset)
    store.file = FirstHeld()
    x = torch.randn(1 << 15, requires_grad=True)
    with off:
        out = _chain(x)
    handles = [r() for r, _ in store.pending_moves()]
    assert len(handles) >= 3
    until(lambda: all(job.done() for _, job in list(store.pending_moves())[1:]),
           "the later writes never finished")

    def later_dropped():
        tiermem.testing.poll(off)
        return all(h.src is None for h in handles[1:])
    until(later_dropped, "sources kept behind a write still in flight")
    assert handles[0].host is not None or handles[0].src is not None   # not landed
    first.set()
    out.sum().backward()
    handles.clear()
    off.close()


@pytest.mark.parametrize("first", [0, 4, 8, 16, 24])
def test_restored_view_keeps_its_address_modulo_64_and_reads_direct(nvme_dir, first,
                                                                      monkeypatch):
    """A restored CPU view sits at its original address modulo 64 bytes (see
    NOTE [Layout of a moved tensor]); a tensor whose data is 64-aligned is
    read straight into page-aligned memory (the engine's direct path), even
    where torch placed it at a page plus 64 bytes."""
    from tiermem.io import aligned_empty
    base = aligned_empty(4 * (4096 + 64) + 64)[64:].view(torch.float32)   # page + 64
    base.copy_(torch.randn(4096 + 64))
    t = base[first:first + 4096]
    sink: list = []
    w = torch.ones((), requires_grad=True)
    off = _off(nvme_dir)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    reads = []
    read = store.file.read

    def recording(dest, offset):
        reads.append(dest.data_ptr())
        return read(dest, offset)
    monkeypatch.setattr(store.file, "read", recording)
    with off:
        out = SaveIt.apply(t, w, sink)
    store.drain()
    out.backward()
    (u,) = sink
    assert torch.equal(u, t) and u.data_ptr() != t.data_ptr()
    assert u.data_ptr() % 64 == t.data_ptr() % 64
    assert len(reads) == 1
    assert (reads[0] % 4096 == 0) == (t.data_ptr() % 64 == 0)
    off.close()


def test_staging_given_back_keeps_no_view_alive(nvme_dir, engine):
    """Once a staged move has landed, its staging buffer is back in the pool and
    nothing else holds it: dropping it from the pool frees its memory (for
    pinned memory that is what the budget counts, see NOTE [Trimming pinned
    buffers])."""
    off = _staged(nvme_dir, engine=engine)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    x = torch.randn(1 << 16, requires_grad=True)
    with off:
        z = (x * 2).sin()
    store.drain()
    tiermem.testing.poll(off)
    pool = store.staging
    assert pool.in_use_bytes == 0 and pool.free_bytes > 0
    refs = [StorageWeakRef(buf.untyped_storage()) for buf in pool.idle_buffers()]
    assert refs
    pool.clear()
    gc.collect()
    assert all(r.expired() for r in refs), "a dropped staging buffer is still referenced"
    z.sum().backward()
    assert torch.equal(x.grad, (x.detach() * 2).cos() * 2)
    off.close()
