"""The in-flight window of the moving tiers (NOTE [In-flight window] in
tiers/moving.py), on the CPU: with copies or writes far slower than compute,
the forward holds at most the window's sources of moves not landed, so the
memory of the saved tensors falls during the forward instead of piling up to
the end of it; gradients stay bit-identical.

The copies are slowed with :func:`tiermem.testing.slow_copies` (cpu tier) or a
file whose writes complete late (nvme tier). The CUDA analogue (compute stream
waiting on the copy's event, peak device memory) is in tests/test_gpu.py.
"""

import contextlib
import time

import pytest
import torch
from torch import nn

import tiermem
import tiermem.testing
from helpers import SlowFuture, offloader

COPY_DELAY_SECONDS = 0.02
ROWS, WIDTH, LAYERS = 64, 256, 12       # each saved tensor: 64 KiB
SAVED_BYTES = ROWS * WIDTH * 4


class _SlowWriteFile:
    """The nvme tier's file; each write completes ``delay`` after the one
    before it at the earliest (one slow disk)."""

    def __init__(self, f, delay: float) -> None:
        self._f, self.delay, self._last = f, delay, 0.0

    def __getattr__(self, name):
        return getattr(self._f, name)

    def write(self, buf, offset):
        self._last = max(self._last, time.monotonic()) + self.delay
        return SlowFuture(self._f.write(buf, offset), self._last)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _run(model, x, ctx, watch=None):
    """One step; ``watch()`` is called after each module's forward."""
    hooks = [] if watch is None else [m.register_forward_hook(lambda *a: watch())
                                      for m in model]
    model.zero_grad(set_to_none=True)
    try:
        with ctx:
            loss = model(x).square().mean()
    finally:
        for h in hooks:
            h.remove()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def slow_tier(request, tmp_path):
    """``(off, tier, slowed context)`` for the cpu tier (slow copies), the
    nvme tier (slow writes of CPU tensors, straight from memory) or the nvme
    tier through staging (slow copies into staging: NOTE [Staged moves])."""
    if request.param == "cpu":
        yield offloader("cpu"), tiermem.Tier.CPU, tiermem.testing.slow_copies(COPY_DELAY_SECONDS)
        return
    off = offloader("nvme", nvme_dir=str(tmp_path))
    if request.param == "nvme-staged":   # through staging as CUDA tensors go
        tiermem.testing.stage_cpu_tensors(off)
        yield off, tiermem.Tier.NVME, tiermem.testing.slow_copies(COPY_DELAY_SECONDS)
        off.close()
        return
    f = tiermem.testing.nvme_file(off)
    tiermem.testing.set_nvme_file(off, _SlowWriteFile(f, COPY_DELAY_SECONDS))
    yield off, tiermem.Tier.NVME, contextlib.nullcontext()
    off.close()


@pytest.mark.parametrize("slow_tier", ["cpu", "nvme", "nvme-staged"], indirect=True)
@pytest.mark.parametrize("window", [(2, None), (None, 3 * SAVED_BYTES)],
                         ids=["tensors", "bytes"])
def test_sources_in_flight_never_exceed_the_window(slow_tier, window):
    """Fails without the window: every source stays alive until its slow copy
    lands, i.e. nearly all of them to the end of the forward."""
    off, tier, slowed = slow_tier
    tensors, nbytes = window
    tiermem.testing.set_move_window(off, tensors, nbytes)
    model = _model()
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    ref = _run(model, x, contextlib.nullcontext())
    seen = []
    with slowed:
        got = _run(model, x, off,
                   watch=lambda: seen.append(tiermem.testing.sources_in_flight(off, tier)))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    moved = off.stats.count_by_tier[tier.value]
    assert moved >= LAYERS, off.stats.count_by_tier   # dedup: one per Linear+Tanh
    most_count = max(c for c, _ in seen)
    most_bytes = max(b for _, b in seen)
    if tensors is not None:
        assert most_count <= tensors, seen
    if nbytes is not None:
        assert most_bytes <= nbytes, seen
    # Memory falls during the forward: at its last op, far more bytes were
    # moved than the sources still held (the rest were freed before its end).
    assert moved * SAVED_BYTES >= 4 * seen[-1][1], seen
    assert moved * SAVED_BYTES >= 4 * most_bytes, seen


def test_window_defaults_are_stated():
    """The defaults are what NOTE [In-flight window] says (a change is a
    decision: update the note and the GPU measurement that backs it)."""
    from tiermem.tiers import moving
    assert moving.DEFAULT_WINDOW_TENSORS == 5
    assert moving.DEFAULT_WINDOW_BYTES == 256 * 1024 ** 2
