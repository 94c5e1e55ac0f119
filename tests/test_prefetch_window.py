"""The prefetch window: sized from what the step moved when unset, and
respected by restores from disk."""

import torch

import tiermem
import tiermem.testing
from tiermem.runtime.prefetch import AUTO_MAX_BYTES, AUTO_MIN_BYTES, auto_window_bytes


def test_auto_window_is_a_quarter_of_the_moved_bytes_within_bounds():
    assert auto_window_bytes(0) == AUTO_MIN_BYTES
    assert auto_window_bytes(400 << 20) == 100 << 20
    assert auto_window_bytes(10 << 30) == AUTO_MAX_BYTES


def _step(off, n_mib):
    x = torch.randn(n_mib * 2**18, requires_grad=True)   # n_mib MiB of fp32
    with off as ctx:
        y = x
        for _ in range(8):
            y = y.sin()          # saves its input: 8 tensors of n_mib MiB each
    y.sum().backward()
    return ctx


def test_unset_window_is_sized_when_backward_starts():
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    ctx = _step(off, 16)
    moved = off.stats.bytes_by_tier["cpu"]
    assert moved >= 7 * (16 << 20)   # x itself is a leaf: never moved
    assert ctx.prefetcher.budget_bytes == auto_window_bytes(moved) == moved // 4
    # Not everything was restored at once: the window is smaller than what moved.
    assert ctx.prefetcher.budget_bytes < moved
    off.close()


def test_set_window_is_used_as_given(monkeypatch):
    monkeypatch.setenv("TIERMEM_PREFETCH_BYTES", "3MiB")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    ctx = _step(off, 1)
    assert ctx.prefetcher.budget_bytes == 3 << 20
    off.close()


def test_nvme_restores_stay_within_the_window(tmp_path, monkeypatch, engine):
    """Reads from disk are started ahead of need, but never more than the
    window (plus the one tensor that crosses it) restored and not yet taken."""
    from tiermem.runtime.prefetch import Prefetcher

    monkeypatch.setenv("TIERMEM_PREFETCH_BYTES", "3MiB")
    peaks = []
    advance = Prefetcher.advance

    def recording(self, handle):
        advance(self, handle)
        peaks.append(self.inflight_bytes)

    monkeypatch.setattr(Prefetcher, "advance", recording)
    off = tiermem.Offloader(policy="nvme", min_offload_bytes=0, nvme_dir=str(tmp_path),
                            engine=engine)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    x = torch.randn(2**18, requires_grad=True)   # 1 MiB of fp32
    with off as ctx:
        y = x
        for _ in range(8):
            y = y.sin()
    store.drain()       # every write landed: nothing holds the cursor back
    y.sum().backward()
    assert torch.equal(x.grad, _sin_chain_grad(x.detach(), 8))
    s = off.stats
    assert s.bytes_by_tier["nvme"] == 7 << 20 and ctx.prefetcher.budget_bytes == 3 << 20
    assert peaks and max(peaks) <= (3 << 20) + (1 << 20), peaks
    # Restores ran ahead of need: more than one in flight at some point; each
    # tensor read back once, all but the first needed (read on demand) by the
    # prefetcher.
    assert max(peaks) >= 2 << 20
    assert s.prefetched_bytes == 6 << 20 and s.prefetch_hits + s.prefetch_misses == 7, s
    off.close()


def _sin_chain_grad(x, n):
    """d/dx of sin applied n times, computed without autograd."""
    ys = [x]
    for _ in range(n):
        ys.append(ys[-1].sin())
    g = torch.ones_like(x)
    for y in reversed(ys[:-1]):
        g = g * y.cos()
    return g
