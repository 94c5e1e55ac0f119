"""The default prefetch window is sized from what the step moved."""

import pytest
import torch

import tiermem
from tiermem.prefetch import AUTO_MAX_BYTES, AUTO_MIN_BYTES, auto_window_bytes

pytestmark = pytest.mark.usefixtures("clean_env")


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
