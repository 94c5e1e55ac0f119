"""The host buffer pool: reuse by size class, jobs gating reuse, the budget,
and NOTE [Trimming pinned buffers]."""

import pytest
import torch

from tiermem import hostpool
from tiermem.hostpool import HostPool

KiB = 1024


class _Job:
    def __init__(self, done):
        self._done = done

    def done(self):
        return self._done


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


def test_an_idle_buffer_up_to_twice_the_size_serves_a_request():
    pool = HostPool(1 << 20)
    big = pool.acquire(150 * KiB, pinned=False)
    huge = pool.acquire(400 * KiB, pinned=False)
    pool.release(big)
    pool.release(huge)
    got = pool.acquire(100 * KiB, pinned=False)        # 150 <= 2 * 100: reused
    assert got.data_ptr() == big.data_ptr() and got.numel() == 150 * KiB
    assert pool.allocations == 2
    assert pool.in_use_bytes == 150 * KiB and pool.free_bytes == 400 * KiB
    small = pool.acquire(100 * KiB, pinned=False)      # 400 > 2 * 100: a new one
    assert small.numel() == 100 * KiB and pool.allocations == 3
    pool.release(got)
    assert pool.in_use_bytes == 100 * KiB and pool.free_bytes == 550 * KiB


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


def test_trimming_pinned_buffers_returns_them_and_is_counted(monkeypatch):
    """CPU stand-in for pinned memory: the pool's bookkeeping, and that the
    pinned cache is emptied (a device sync on CUDA) only when pinned buffers
    were really dropped, outside the lock."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda n, dtype, pin_memory: real_empty(n, dtype=dtype))
    returns = []

    def returned():
        assert not pool._lock.locked()
        returns.append(pool.free_bytes)
    monkeypatch.setattr(hostpool, "_return_pinned_cache", returned)
    pool = HostPool(256 * KiB)
    a = pool.acquire(64 * KiB, pinned=True)
    b = pool.acquire(64 * KiB, pinned=True)
    pool.release(a, pinned=True)
    pool.release(b, pinned=True)
    # A class twice as large is served by a fresh buffer: 128 + 128 <= 256.
    c = pool.acquire(100 * KiB, pinned=True)
    assert c.numel() == 128 * KiB and returns == [] and pool.pinned_returns == 0
    pool.release(c, pinned=True)
    # Class 32 KiB: an idle 64 KiB buffer (<= 2x) serves it, nothing trimmed.
    d = pool.acquire(20 * KiB, pinned=True)
    assert d.numel() == 64 * KiB and returns == [] and pool.pinned_returns == 0
    # Class 256 KiB while d is in use: even trimming every idle buffer would
    # leave no room, so nothing is dropped (and the device is not synced).
    assert pool.acquire(200 * KiB, pinned=True) is None
    assert pool.free_bytes == 192 * KiB and pool.pinned_returns == 0 and returns == []
    pool.release(d, pinned=True)
    f = pool.acquire(200 * KiB, pinned=True)           # trimming all makes room now
    assert f.numel() == 256 * KiB and pool.free_bytes == 0
    assert pool.pinned_returns == 1 and returns == [0]
    pool.clear()
    assert len(returns) == 2


@pytest.mark.parametrize("pinned", [False, True])
def test_class_sizes(pinned):
    assert HostPool.class_bytes(5000, pinned) == (8192 if pinned else 5000)
