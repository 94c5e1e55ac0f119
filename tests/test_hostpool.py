"""The host buffer pool: reuse by size class, jobs gating reuse, the budget,
and NOTE [Trimming pinned buffers]."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import tiermem.testing
from tiermem.memory.hostpool import HostPool

KiB = 1024


class _Job:
    def __init__(self, done):
        self._done = done
        self.waits = 0

    def done(self):
        return self._done

    def wait_host(self):
        self.waits += 1
        self._done = True


def test_a_released_buffer_is_reused_once_its_job_is_done():
    pool = HostPool(1 << 20)
    a = pool.acquire(100 * KiB, pinned=False)
    job = _Job(False)
    pool.release(a, job)
    b = pool.acquire(100 * KiB, pinned=False)
    assert b.data_ptr() != a.data_ptr() and pool.allocations == 2   # a's job runs
    job._done = True
    c = pool.acquire(100 * KiB, pinned=False)
    assert c.data_ptr() == a.data_ptr() and pool.allocations == 2
    assert pool.in_use_bytes == 200 * KiB and pool.free_bytes == 0


@pytest.fixture
def fake_pinned(monkeypatch):
    """CPU stand-in for pinned memory (no CUDA here): ``pin_memory`` ignored,
    and emptying torch's pinned cache recorded instead of done."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda n, dtype, pin_memory: real_empty(n, dtype=dtype))
    returns = []
    with tiermem.testing.pinned_cache_returns(lambda: returns.append(1)):
        yield returns


def test_pinned_requests_take_an_idle_buffer_of_the_next_class(fake_pinned):
    pool = HostPool(1 << 20)
    b128 = pool.acquire(128 * KiB, pinned=True)
    b512 = pool.acquire(512 * KiB, pinned=True)
    page = pool.acquire(128 * KiB, pinned=False)
    pool.release(b128, pinned=True)
    pool.release(b512, pinned=True)
    pool.release(page, pinned=False)
    assert pool.allocations == 3
    got = pool.acquire(50 * KiB, pinned=True)          # class 64 KiB: the 128 KiB one
    assert got.data_ptr() == b128.data_ptr() and pool.allocations == 3
    small = pool.acquire(100 * KiB, pinned=True)       # class 128 KiB: 512 is two up
    assert small.numel() == 128 * KiB and pool.allocations == 4
    pool.release(got, pinned=True)
    assert pool.in_use_bytes == 128 * KiB and pool.free_bytes == (128 + 512 + 128) * KiB
    big = pool.acquire(200 * KiB, pinned=True)         # class 256 KiB: the 512 one
    assert big.data_ptr() == b512.data_ptr() and pool.allocations == 4
    assert fake_pinned == []


def test_pageable_requests_take_their_own_size_only():
    pool = HostPool(1 << 20)
    big = pool.acquire(150 * KiB, pinned=False)
    pool.release(big)
    got = pool.acquire(100 * KiB, pinned=False)
    assert got.numel() == 100 * KiB and pool.allocations == 2


def test_a_larger_buffer_still_in_use_by_its_job_is_skipped(fake_pinned):
    pool = HostPool(1 << 20)
    b = pool.acquire(128 * KiB, pinned=True)
    job = _Job(False)
    pool.release(b, job, pinned=True)
    got = pool.acquire(64 * KiB, pinned=True)
    assert got.data_ptr() != b.data_ptr() and got.numel() == 64 * KiB
    job._done = True
    assert pool.acquire(64 * KiB, pinned=True).data_ptr() == b.data_ptr()


def test_a_pinned_request_is_never_served_by_pageable_memory(fake_pinned):
    pool = HostPool(1 << 20)
    page = pool.acquire(64 * KiB, pinned=False)
    pool.release(page, pinned=False)
    got = pool.acquire(64 * KiB, pinned=True)
    assert got.data_ptr() != page.data_ptr() and pool.allocations == 2


def test_full_budget_trims_idle_buffers_of_other_sizes_else_refuses():
    pool = HostPool(300 * KiB)
    a = pool.acquire(100 * KiB, pinned=False)
    b = pool.acquire(100 * KiB, pinned=False)
    pool.release(a)
    c = pool.acquire(250 * KiB, pinned=False)          # 100 + 250 > 300 even without
    assert c is None and pool.free_bytes == 100 * KiB  # `a`: a is not dropped for nothing
    d = pool.acquire(180 * KiB, pinned=False)          # trims `a`: 100 + 180 <= 300
    assert d is not None and pool.held_bytes == 280 * KiB and pool.free_bytes == 0
    pool.release(b, _Job(False))
    assert pool.acquire(30 * KiB, pinned=False) is None   # b's job still runs
    assert pool.pinned_returns == 0


def test_trimming_pinned_buffers_returns_them_and_is_counted(fake_pinned):
    """The pinned cache is emptied (a device sync on CUDA) only when pinned
    buffers were really dropped, and the dropped buffers are gone by then."""
    pool = HostPool(256 * KiB)
    a = pool.acquire(64 * KiB, pinned=True)
    b = pool.acquire(64 * KiB, pinned=True)
    pool.release(a, pinned=True)
    pool.release(b, pinned=True)
    # Class 128 KiB: nothing idle of that class or the next: a new buffer,
    # 128 + 128 <= 256.
    c = pool.acquire(100 * KiB, pinned=True)
    assert c.numel() == 128 * KiB and fake_pinned == [] and pool.pinned_returns == 0
    pool.release(c, pinned=True)
    # Class 32 KiB: an idle 64 KiB buffer (the next class) serves it.
    d = pool.acquire(20 * KiB, pinned=True)
    assert d.numel() == 64 * KiB and fake_pinned == [] and pool.pinned_returns == 0
    # Class 256 KiB while d is in use: even trimming every idle buffer would
    # leave no room, so nothing is dropped (and the device is not synced).
    assert pool.acquire(200 * KiB, pinned=True) is None
    assert pool.free_bytes == 192 * KiB and pool.pinned_returns == 0 and fake_pinned == []
    refs = [StorageWeakRef(t.untyped_storage()) for t in (a, b, c)]
    pool.release(d, pinned=True)
    del a, b, c, d
    # Mid-step: refused, nothing trimmed (NOTE [Trimming pinned buffers]).
    assert pool.acquire(200 * KiB, pinned=True) is None
    assert pool.pinned_returns == 0 and fake_pinned == []
    assert pool.trim_when_idle()                       # between steps: all go
    f = pool.acquire(200 * KiB, pinned=True)
    assert f.numel() == 256 * KiB and pool.free_bytes == 0
    assert pool.pinned_returns == 1 and fake_pinned == [1]
    assert all(r.expired() for r in refs)              # really freed, not just forgotten
    assert pool.idle_buffers() == []
    pool.clear()
    assert len(fake_pinned) == 2


class _Copy:
    """A fake copy job (a stand-in for a CUDA event): done when told."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


def test_pinned_buffers_are_never_trimmed_mid_step_and_the_budget_holds(fake_pinned):
    """With copies queued, a pinned request of a new size is refused rather
    than trimmed for (no device sync mid-step, nothing pinned over budget);
    between steps the idle buffers it needs room from are returned once.
    Fails before: the request trimmed the idle, ready buffers at once
    (``pinned_returns`` 1 mid-step)."""
    budget = 384 * KiB
    pool = HostPool(budget)
    copies = [_Copy() for _ in range(4)]
    bufs = [pool.acquire(64 * KiB, pinned=True) for _ in range(4)]
    for buf, job in zip(bufs, copies):
        pool.release(buf, job, pinned=True)
    copies[0].finished = copies[1].finished = True      # two landed, two queued
    held = [pool.held_bytes]
    for _ in range(3):                                   # a new size, mid-step
        assert pool.acquire(200 * KiB, pinned=True) is None   # class 256 KiB
        held.append(pool.held_bytes)
    assert max(held) <= budget
    assert pool.pinned_returns == 0 and fake_pinned == []
    for job in copies:
        job.finished = True                              # the step is over
    assert pool.trim_when_idle()
    assert pool.pinned_returns == 1 and fake_pinned == [1]
    got = pool.acquire(200 * KiB, pinned=True)
    assert got is not None and pool.held_bytes <= budget
    assert not pool.trim_when_idle()                     # nothing asked for since
    assert pool.pinned_returns == 1


@pytest.mark.parametrize("pinned", [False, True])
def test_class_sizes(pinned):
    assert HostPool.class_bytes(5000, pinned) == (8192 if pinned else 5000)


# Buffers of earlier steps: see NOTE [Buffers of earlier steps] in tiermem/memory/hostpool.py.
def test_a_buffer_of_an_earlier_step_is_waited_for_rather_than_allocating_anew():
    """A copy of the last step still running at this step's start (backward
    took the original before it landed): acquire waits for it and reuses its
    buffer, so the pool does not grow with the load."""
    pool = HostPool(1 << 20)
    a = pool.acquire(100 * KiB, pinned=False)
    late = _Job(False)
    pool.release(a, late)
    pool.start_step()
    b = pool.acquire(100 * KiB, pinned=False)
    assert b.data_ptr() == a.data_ptr() and pool.allocations == 1
    assert late.waits == 1 and pool.earlier_waits == 1


class _Event:
    """A CUDA event stand-in: complete once synchronised."""

    def __init__(self) -> None:
        self.synced = False

    def query(self) -> bool:
        return self.synced

    def synchronize(self) -> None:
        self.synced = True


def test_a_staging_buffer_of_an_earlier_step_is_waited_for_through_its_lease():
    """A staged nvme move's buffer comes back through its lease as an
    ``AllDone`` of the move and the copies out of the buffer: the next step
    waits for all of them and reuses it (``AllDone.wait_host`` was once
    missing, and the pool's wait silently did nothing)."""
    from tiermem.runtime.leases import StagingLease
    pool = HostPool(1 << 20)
    buf = pool.acquire(100 * KiB, pinned=False)
    lease = StagingLease(pool, buf, pinned=False)
    move = _Job(False)
    lease.job = move
    out = _Event()
    lease.events.append(out)
    lease.release()
    pool.start_step()
    again = pool.acquire(100 * KiB, pinned=False)
    assert again.data_ptr() == buf.data_ptr() and pool.allocations == 1
    assert move.waits == 1 and out.synced and pool.earlier_waits == 1


def test_every_job_class_can_wait_on_the_host_and_a_pool_says_when_one_cannot():
    import inspect
    from tiermem.runtime import jobs
    classes = [c for _, c in inspect.getmembers(jobs, inspect.isclass)
               if issubclass(c, jobs.Job) and c is not jobs.Job]
    assert len(classes) >= 8
    missing = [c.__name__ for c in classes if c.wait_host is jobs.Job.wait_host]
    assert not missing, f"no wait_host: {missing}"

    class _Failed(_Job):
        def wait_host(self):
            self._done = True
            raise OSError("the copy failed")

    pool = HostPool(1 << 20)
    a = pool.acquire(100 * KiB, pinned=False)
    pool.release(a, _Failed(False))
    pool.start_step()
    assert pool.acquire(100 * KiB, pinned=False).data_ptr() == a.data_ptr(), \
        "a failed copy leaves its buffer free"
    class _CannotWait(jobs.Job):
        def done(self):
            return False

    b = pool.acquire(100 * KiB, pinned=False)
    pool.release(b, _CannotWait())
    pool.start_step()
    with pytest.raises(NotImplementedError):
        pool.acquire(100 * KiB, pinned=False)


def test_a_buffer_given_back_in_this_step_is_not_waited_for():
    pool = HostPool(1 << 20)
    pool.start_step()
    a = pool.acquire(100 * KiB, pinned=False)
    running = _Job(False)
    pool.release(a, running)
    b = pool.acquire(100 * KiB, pinned=False)
    assert b.data_ptr() != a.data_ptr() and pool.allocations == 2 and running.waits == 0


def test_a_full_pinned_pool_waits_for_an_earlier_step_rather_than_refuse(fake_pinned):
    pool = HostPool(128 * KiB)
    a = pool.acquire(128 * KiB, pinned=True)
    late = _Job(False)
    pool.release(a, late, pinned=True)
    pool.start_step()
    got = pool.acquire(64 * KiB, pinned=True)          # the next class up, once its copy is done
    assert got is not None and got.data_ptr() == a.data_ptr() and late.waits == 1
    assert pool.allocations == 1 and fake_pinned == []


def test_no_wait_when_a_ready_buffer_fits():
    pool = HostPool(1 << 20)
    a = pool.acquire(100 * KiB, pinned=False)
    b = pool.acquire(100 * KiB, pinned=False)
    late = _Job(False)
    pool.release(a, late)
    pool.release(b, None)
    pool.start_step()
    assert pool.acquire(100 * KiB, pinned=False).data_ptr() == b.data_ptr()
    assert late.waits == 0 and pool.earlier_waits == 0


def test_clear_waits_for_idle_buffers_copies_then_frees_them_and_the_pinned_cache(fake_pinned):
    """What Offloader.close() does with pinned memory: idle buffers whose last
    copy still runs are waited for and dropped too (a buffer kept would stay
    pinned in torch's cache after the Offloader), then the cache is emptied."""
    pool = HostPool(1 << 20)
    a = pool.acquire(64 * KiB, pinned=True)
    b = pool.acquire(64 * KiB, pinned=True)
    running = _Job(False)
    pool.release(a, running, pinned=True)
    refs = [StorageWeakRef(a.untyped_storage())]
    del a
    pool.clear()
    assert running.waits == 1 and pool.free_bytes == 0 and pool.idle_buffers() == []
    assert all(r.expired() for r in refs) and fake_pinned == [1]
    assert pool.in_use_bytes == 64 * KiB   # b, still in use, is unaffected
    pool.release(b, pinned=True)
