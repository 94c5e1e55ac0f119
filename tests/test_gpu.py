"""CUDA behaviour of the cpu tier: exactness, no host syncs in forward, races, memory.

All marked ``gpu`` and skipped without a CUDA device. Race windows are widened
with ``torch.cuda._sleep`` on the side streams (see NOTE [Stream lifetime]).
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import tiermem
from tiermem import copier

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

DEV = torch.device("cuda")
SLEEP_CYCLES = 50_000_000  # ~25 ms at ~2 GHz: far longer than any copy here


class Block(torch.nn.Module):
    def __init__(self, width=256, heads=4, p=0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.out = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, w // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           dropout_p=self.p if self.training else 0.0)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, w)), self.p, self.training)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _model(dtype=torch.float32, layers=4, width=256):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(width) for _ in range(layers)]).to(DEV, dtype)


def _step(model, x, ctx, seed=1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with ctx:
        loss = model(x).float().square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_same(a, b):
    assert torch.equal(a[0], b[0])
    for ga, gb in zip(a[1], b[1]):
        assert torch.equal(ga, gb)


@pytest.mark.parametrize("policy", ["keep", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_bit_identical_on_cuda(policy, dtype):
    model = _model(dtype)
    x = torch.randn(4, 128, 256, device=DEV, dtype=dtype)
    import contextlib
    ref = _step(model, x, contextlib.nullcontext())
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    for _ in range(3):
        _assert_same(_step(model, x, off), ref)
    if policy == "cpu":
        assert off.stats.count_by_tier["cpu"] > 0
        assert off.stats.prefetch_hits > 0


def test_forward_does_not_sync_the_host():
    model = _model()
    x = torch.randn(4, 128, 256, device=DEV)
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    _step(model, x, off)                       # warm-up: pools and streams exist
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with off:
            loss = model(x).square().mean()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    loss.backward()
    assert off.stats.count_by_tier["cpu"] > 0


def _slow_stream(monkeypatch, which):
    """Delay every copy issued on the D2H ("out") or H2D ("in") side stream."""
    original = copier.CudaCopier._copy

    def slowed(self, stream, src, dst):
        if stream is (self.d2h if which == "out" else self.h2d):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)
        return original(self, stream, src, dst)

    monkeypatch.setattr(copier.CudaCopier, "_copy", slowed)


@pytest.mark.parametrize("which", ["out", "in"])
def test_slow_side_stream_still_gives_exact_gradients(monkeypatch, which):
    import contextlib
    model = _model(layers=2)
    x = torch.randn(2, 128, 256, device=DEV)
    ref = _step(model, x, contextlib.nullcontext())
    _slow_stream(monkeypatch, which)
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    _assert_same(_step(model, x, off), ref)


def test_source_is_not_reused_before_its_copy_lands(monkeypatch):
    """Freed-too-early source memory would be overwritten by the scribble below."""
    _slow_stream(monkeypatch, "out")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    x = torch.randn(1 << 20, device=DEV, requires_grad=True)
    with off:
        y = x * 2                # intermediate: the saved graph holds the only reference
        z = y.sin()              # saves y; its copy out is delayed by the sleep
        del y
    # Same-size allocations on the compute stream reuse y's block if it was freed.
    scribble = [torch.full((1 << 20,), 7.0, device=DEV) for _ in range(8)]
    torch.cuda.synchronize()     # copies land; backward restores from host
    z.sum().backward()
    assert torch.equal(x.grad, (x.detach() * 2).cos() * 2)
    del scribble


def test_in_place_write_racing_a_slow_copy_raises(monkeypatch):
    _slow_stream(monkeypatch, "out")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    x = torch.randn(1 << 20, device=DEV, requires_grad=True)
    with off:
        y = (x * 2).exp()
        y.add_(1)                # issued while the copy of y is still queued
    with pytest.raises(tiermem.TierMemError, match="in-place"):
        y.sum().backward()


def test_cpu_tier_cuts_peak_device_memory():
    import contextlib
    model = _model(layers=6, width=512)
    x = torch.randn(8, 256, 512, device=DEV)

    def peak(ctx):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(model, x, ctx)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    off = tiermem.Offloader(policy="cpu")
    peak(off)                                   # warm pools
    keep_peak = peak(contextlib.nullcontext())
    cpu_peak = peak(off)
    assert cpu_peak < 0.6 * keep_peak, (cpu_peak, keep_peak)


def test_deepcopy_model_on_two_devices_streams_stay_per_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    import contextlib
    model = _model(layers=1)
    other = copy.deepcopy(model).to("cuda:1")
    x = torch.randn(2, 64, 256, device=DEV)
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    _assert_same(_step(other, x.to("cuda:1"), off), _step(other, x.to("cuda:1"),
                                                           contextlib.nullcontext()))
