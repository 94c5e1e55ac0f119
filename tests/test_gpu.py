"""CUDA behaviour of the cpu tier: exactness, no host syncs in forward, races, memory.

All marked ``gpu`` and skipped without a CUDA device. Race windows are widened
with ``torch.cuda._sleep`` on the side streams (see NOTE [Stream lifetime]).
"""

import contextlib
import copy
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tiermem
import tiermem.testing
from tiermem.runtime import copier, jobs
from helpers import assert_same_step, forbid_host_waits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic")]

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

DEV = torch.device("cuda")
SLEEP_CYCLES = 50_000_000  # ~25 ms at ~2 GHz: far longer than any copy here


# Bit-exact comparisons across runs need deterministic kernels (the
# ``deterministic`` fixture, for every test here): the fused attention
# backwards split work non-deterministically by default, so the test model uses
# the math SDPA backend, and cuBLAS a fixed workspace (CUBLAS_WORKSPACE_CONFIG).


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
        with sdpa_kernel(SDPBackend.MATH):
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


@pytest.mark.parametrize("policy", ["keep", "cpu", "recompute", "recompute,cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_bit_identical_on_cuda(policy, dtype):
    model = _model(dtype)
    x = torch.randn(4, 128, 256, device=DEV, dtype=dtype)
    ref = _step(model, x, contextlib.nullcontext())
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    for _ in range(3):
        assert_same_step(_step(model, x, off), ref)
    if "cpu" in policy:
        assert off.stats.count_by_tier["cpu"] > 0
        assert off.stats.prefetch_hits > 0
    if "recompute" in policy:
        # LayerNorm/GELU outputs and the attention probabilities after
        # native_dropout (its CUDA generator state replayed) are dropped.
        assert off.stats.count_by_tier["recompute"] > 0
        assert off.stats.recompute_count > 0


@pytest.mark.parametrize("policy", ["cpu", "recompute,cpu"])
def test_forward_does_not_sync_the_host(policy):
    model = _model()
    x = torch.randn(4, 128, 256, device=DEV)
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    _step(model, x, off)                       # warm-up: pools and streams exist
    torch.cuda.synchronize()
    allocations = tiermem.testing.store_of(off, tiermem.Tier.CPU).pool.allocations

    with forbid_host_waits(jobs.CudaJob), off:
        loss = model(x).square().mean()
    loss.backward()
    assert off.stats.count_by_tier["cpu"] > 0
    assert tiermem.testing.store_of(off, tiermem.Tier.CPU).pool.allocations == allocations  # no new pinning


@pytest.fixture
def slow_stream():
    """``slow_stream(which)``: until the test ends, delay every copy issued on
    the D2H ("out") or H2D ("in") side stream."""
    def slowed(which):
        def sleep(direction, stream):
            if direction == which:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(SLEEP_CYCLES)
        return tiermem.testing.before_cuda_copies(sleep)

    with contextlib.ExitStack() as stack:
        yield lambda which: stack.enter_context(slowed(which))


def _slow_compute(model, where):
    """Delay the compute stream before every Linear's forward (its producer
    work: a copy that does not wait for it reads unwritten memory) or before
    its backward (the readers of blocks a restore might overwrite)."""
    def sleep(*args):
        torch.cuda._sleep(SLEEP_CYCLES // 10)
    handles = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            if where == "forward":
                handles.append(m.register_forward_pre_hook(sleep))
            else:
                handles.append(m.register_full_backward_pre_hook(sleep))
    return handles


@pytest.mark.parametrize("which", ["out", "in"])
def test_slow_side_stream_still_gives_exact_gradients(slow_stream, which):
    model = _model(layers=2)
    x = torch.randn(2, 128, 256, device=DEV)
    ref = _step(model, x, contextlib.nullcontext())
    slow_stream(which)
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    assert_same_step(_step(model, x, off), ref)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_slow_compute_stream_still_gives_exact_gradients(where):
    model = _model(layers=2)
    x = torch.randn(2, 128, 256, device=DEV)
    handles = _slow_compute(model, where)
    try:
        ref = _step(model, x, contextlib.nullcontext())
        off = tiermem.Offloader(policy="cpu", min_offload_bytes=0, prefetch_bytes="1GiB")
        assert_same_step(_step(model, x, off), ref)
    finally:
        for h in handles:
            h.remove()


def test_source_is_not_reused_before_its_copy_lands(slow_stream):
    """Freed-too-early source memory would be overwritten by the scribble below."""
    slow_stream("out")
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


def test_in_place_write_racing_a_slow_copy_raises(slow_stream):
    slow_stream("out")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    x = torch.randn(1 << 20, device=DEV, requires_grad=True)
    with off:
        y = (x * 2).exp()
        y.add_(1)                # issued while the copy of y is still queued
    with pytest.raises(tiermem.TierMemError, match="in-place"):
        y.sum().backward()


def _peak_device_bytes(model, x, ctx) -> int:
    """Peak device memory of one step over what was allocated before it."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(1)
    with ctx:
        loss = model(x).square().mean()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_cpu_tier_cuts_peak_device_memory():
    model = _model(layers=6, width=512)
    x = torch.randn(8, 256, 512, device=DEV)
    # Compute slower than the copies, so that they land during the forward.
    handles = [b.register_forward_pre_hook(lambda *a: torch.cuda._sleep(SLEEP_CYCLES // 5))
               for b in model]

    def peak(ctx):
        return _peak_device_bytes(model, x, ctx)

    try:
        off = tiermem.Offloader(policy="cpu", prefetch_bytes="16MiB")
        peak(off)                                   # warm pools
        keep_peak = peak(contextlib.nullcontext())
        cpu_peak = peak(off)
    finally:
        for h in handles:
            h.remove()
    moved = off.stats.bytes_by_tier["cpu"]
    assert moved > 0
    assert keep_peak - cpu_peak >= 0.5 * moved, (keep_peak, cpu_peak, moved)


def test_window_frees_device_memory_while_copies_lag():
    """NOTE [In-flight window] in tiers/moving.py: every D2H copy is slowed far
    behind compute, so without the window the sources are all held to the end
    of the forward (peak near the baseline). With it the compute stream waits
    on the oldest copy (a GPU-side wait: the forward runs under
    ``set_sync_debug_mode("error")`` with host waits forbidden), drops it, and
    the peak falls well below the baseline; gradients stay exact. CPU
    analogue: tests/test_move_window.py."""
    model = _model(layers=6, width=512)
    x = torch.randn(8, 256, 512, device=DEV)
    off = tiermem.Offloader(policy="cpu", prefetch_bytes="16MiB")

    def step(ctx, guard):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.manual_seed(1)
        with guard:
            with ctx:
                loss = model(x).square().mean()
        loss.backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base,
                [p.grad.clone() for p in model.parameters()])

    step(off, contextlib.nullcontext())                      # warm pools
    keep_peak, ref = step(contextlib.nullcontext(), contextlib.nullcontext())
    def slowed(direction, stream):
        if direction == "out":
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES // 10)

    with tiermem.testing.before_cuda_copies(slowed):
        cpu_peak, got = step(off, forbid_host_waits(jobs.CudaJob))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    moved = off.stats.bytes_by_tier["cpu"]
    assert moved > 0
    assert keep_peak - cpu_peak >= 0.5 * moved, (keep_peak, cpu_peak, moved)


def test_two_devices_each_get_their_own_streams():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    model0 = _model(layers=1)
    model1 = copy.deepcopy(model0).to("cuda:1")
    x0 = torch.randn(2, 64, 256, device=DEV)
    x1 = x0.to("cuda:1")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)

    def both(ctx):
        for m in (model0, model1):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with ctx:
            loss = model0(x0).square().mean() + model1(x1).square().mean().to(DEV)
        loss.backward()
        return [p.grad.clone() for p in model0.parameters()], \
            [p.grad.clone() for p in model1.parameters()]
    a = both(off)
    b = both(contextlib.nullcontext())
    for ga, gb in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(ga, gb)


def test_recompute_cuts_peak_device_memory():
    model = _model(layers=6, width=512)
    x = torch.randn(8, 256, 512, device=DEV)

    def peak(ctx):
        return _peak_device_bytes(model, x, ctx)

    off = tiermem.Offloader(policy="recompute")
    peak(off)
    keep_peak = peak(contextlib.nullcontext())
    rec_peak = peak(off)
    dropped = off.stats.bytes_by_tier["recompute"]
    assert dropped > 0
    assert keep_peak - rec_peak >= 0.5 * dropped, (keep_peak, rec_peak, dropped)


def test_a_recomputed_tensor_read_on_two_streams_is_ordered_after_its_recipe():
    """``y`` is saved by ``sin`` on the default stream and by ``cos`` on a side
    stream; backward runs ``cos``'s backward first, on the side stream, which
    regenerates ``y`` there (slowed by a sleep queued before the recipe), then
    ``sin``'s on the default stream, which takes the kept copy: it must wait
    for the recipe (NOTE [Recomputed for consumers on several streams] in
    tiermem/tiers/recompute.py), else it reads unwritten memory."""
    streams = []

    def slowed():
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(SLEEP_CYCLES)

    torch.manual_seed(0)
    x0 = torch.randn(1024, 1024, device=DEV)
    side = torch.cuda.Stream()

    def step(ctx):
        x = x0.clone().requires_grad_()
        with ctx:
            y = x.exp()                    # 4 MiB, regenerated from the leaf x
            a = y.sin()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                b = y.cos()
            torch.cuda.current_stream().wait_stream(side)
            del y
            loss = a.sum() + b.sum()
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), [x.grad]

    ref = step(contextlib.nullcontext())
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=1 << 20)
    with tiermem.testing.before_replayed_ops(slowed):
        got = step(off)
    assert off.stats.recompute_count == 1, off.stats
    assert streams == [side], "the recipe did not run on the side stream"
    assert_same_step(got, ref, "recomputed tensor read on two streams")
    off.close()


def test_the_closed_loop_reads_the_stall_on_the_gpus_timeline(slow_stream):
    """NOTE [Stall on the GPU's timeline] in tiermem/planner/runtime.py: with
    every H2D copy delayed on its side stream, a cpu-tier restore makes the
    consumer's stream wait while the host goes on; the plan's first step
    measures that wait with CUDA timing events, not the host's few µs."""
    model = _model(layers=2)
    x = torch.randn(2, 128, 256, device=DEV)
    # The hint makes the cpu tier the first the planner tries for the bytes the
    # budget needs moved (recompute would otherwise be cheaper on a GPU).
    off = tiermem.Offloader(policy="auto", device_budget="10%", min_offload_bytes=0,
                            hints=lambda info: "cpu")
    _step(model, x, off)            # profiled
    plan = off.plan
    assert plan is not None and plan.bytes_by_tier()["cpu"] > 0, plan
    slow_stream("in")
    _step(model, x, off)            # the plan's first step: its restore waits are timed
    torch.cuda.synchronize()
    host_stall = off.stats.stall_seconds
    off.plan                        # the check runs (as at the next step's start)
    assert plan.measured_steps == 1
    assert plan.measured_stall_s >= 0.02, (plan.measured_stall_s, host_stall)
    assert host_stall < plan.measured_stall_s
    off.close()


def test_auto_plan_records_cuda_dropout_whole_and_stays_exact():
    """On CUDA F.dropout runs one op (native_dropout): a plan recomputing its
    output records the call whole, its generator state captured and replayed
    (NOTE [Calls recorded whole], rule 5, in tiermem/tracking/producers.py), and the
    step trains exactly as without tiermem."""
    from tiermem.models import GPTConfig, TinyGPT
    cfg = GPTConfig(vocab=64, layers=2, width=64, heads=4, seq_len=32, dropout=0.1)
    idx = torch.randint(0, cfg.vocab, (2, 32), device=DEV)

    def step(model, ctx, seed):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with sdpa_kernel(SDPBackend.MATH), ctx:
            loss = model(idx, idx)
        loss.backward()
        return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(0)
    model = TinyGPT(cfg).to(DEV)
    ref_model = copy.deepcopy(model)
    # Masks (4 KiB of bool) under min_offload_bytes: a plan recomputing the
    # mask, which F.dropout does not return, would keep the call under the mode.
    # cpu_budget=0: on the H200 the cpu tier hid every copy and the plan
    # recomputed nothing (2026-12-04); recompute is then the only tier that frees.
    off = tiermem.Offloader(policy="auto", device_budget="10%", min_offload_bytes=8192,
                            cpu_budget=0)
    for i in range(3):
        step(model, off, seed=i)
        step(ref_model, contextlib.nullcontext(), seed=i)
    assert off.plan.recomputes
    assert off.plan.tracking_direct.get("TinyGPT.drop") == {"dropout": "native_dropout"}, \
        off.plan.tracking_direct
    got = step(model, off, seed=9)
    ref = step(ref_model, contextlib.nullcontext(), seed=9)
    assert_same_step(got, ref, "auto with dropout recorded whole")
    off.close()


def test_conjugate_view_moved_to_cpu_tier_keeps_its_values(slow_stream):
    """A saved conj view whose D2H copy lands late comes back conjugated (torch's
    D2H copy_ of a conj view conjugates on the host too early, pytorch#146286;
    the copier resolves the view on the device first)."""
    slow_stream("out")
    z = torch.randn(64, 1024, dtype=torch.complex64, device=DEV, requires_grad=True)
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    with off:
        w = z * 1                          # not a leaf: conj views of a leaf are kept
        y = (w.conj() * w.conj()).real.sum()    # mul saves both conj views
    w2 = z * 1
    expected = torch.autograd.grad((w2.conj() * w2.conj()).real.sum(), z)[0]
    got = torch.autograd.grad(y, z)[0]
    assert off.stats.count_by_tier["cpu"] > 0
    assert torch.equal(got, expected)


def test_gapped_source_temporary_goes_back_to_the_compute_streams_pool():
    """NOTE [Temporaries on the compute stream]: the dense temporary of a gapped
    source is made on the compute stream, so once the copy has landed its block
    serves the compute stream's next allocation of that size (it used to be
    cached in the side stream's pool, and the compute stream reserved more)."""
    c = copier.CudaCopier(DEV)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    src = torch.randn(2048, 4096, device=DEV)[:, ::2]      # a 16 MiB temporary
    dst = torch.empty(src.shape, pin_memory=True)
    job = c.copy_out(src, dst)
    job.wait_host()
    assert job.temp is None
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    again = torch.empty(src.shape, device=DEV)
    assert torch.cuda.memory_reserved() == reserved, "the temporary's block was not reusable"
    assert torch.equal(dst, src.cpu())
    del again


def test_gapped_source_temporary_is_held_until_its_copy_lands():
    c = copier.CudaCopier(DEV)
    src = torch.randn(1024, 2048, device=DEV)[:, ::2]
    expected = src.cpu()
    dst = torch.empty(src.shape, pin_memory=True)
    with torch.cuda.stream(c.d2h):
        torch.cuda._sleep(SLEEP_CYCLES)                    # the copy runs late
    job = c.copy_out(src, dst)
    assert not job.done() and job.temp is not None
    scribble = [torch.full((1024, 1024), 7.0, device=DEV) for _ in range(8)]
    job.wait_host()
    assert torch.equal(dst, expected)
    del scribble


def _nvme_off(tmp_path, engine, **kw):
    return tiermem.Offloader(policy="nvme", nvme_dir=str(tmp_path / "spill"), engine=engine,
                             min_offload_bytes=0, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvme_gradients_bit_identical_on_cuda(tmp_path, engine, dtype):
    """The transformer block with dropout through the nvme tier: the Python
    engine's chain (D2H on the side stream, write on a worker) and the C++
    engine's (CUDA chain when built with it)."""
    model = _model(dtype)
    x = torch.randn(4, 128, 256, device=DEV, dtype=dtype)
    ref = _step(model, x, contextlib.nullcontext())
    off = _nvme_off(tmp_path, engine)
    for _ in range(3):
        assert_same_step(_step(model, x, off), ref)
    assert off.stats.count_by_tier["nvme"] > 0
    # Free-running, writes may still be in flight when backward starts (those
    # tensors come back from staging); settled, backward reads the disk ahead
    # of need.
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with off:
        loss = model(x).float().square().mean()
    tiermem.testing.store_of(off, tiermem.Tier.NVME).drain()
    loss.backward()
    assert_same_step((loss.detach(), [p.grad.clone() for p in model.parameters()]), ref)
    assert off.stats.prefetch_hits > 0
    off.close()
    assert os.listdir(tmp_path / "spill") == []


def test_nvme_forward_on_the_python_chain_does_not_sync_the_host(tmp_path):

    model = _model()
    x = torch.randn(4, 128, 256, device=DEV)
    off = _nvme_off(tmp_path, "python")
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    _step(model, x, off)                       # warm-up: pools, streams, the arena
    store.settle()                             # nothing in flight: no new staging
    torch.cuda.synchronize()
    allocations, arena_bytes = store.staging.allocations, store.arena.size_bytes
    kinds = (jobs.CudaJob, jobs.StagedJob, jobs.ChainJob, jobs.ReadCopyJob, jobs.EventJob,
             jobs.FutureJob)
    with forbid_host_waits(*kinds), off:
        loss = model(x).square().mean()
    # No new pinned staging (whose trimming could free pinned memory, an
    # implicit device sync) and no file growth in the measured forward. Read
    # before backward: on the H200 one more staging buffer appeared by the
    # end of the step (22 against 21), which this tells apart.
    forward_allocations = store.staging.allocations
    loss.backward()
    assert off.stats.count_by_tier["nvme"] > 0
    assert forward_allocations == allocations
    assert store.arena.size_bytes == arena_bytes
    off.close()


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_restored_views_keep_their_pointer_modulo_256(tmp_path, policy):
    """cuBLAS(Lt) chooses kernels by operand alignment up to 256 bytes: a
    restored view must sit at the same address modulo 256 as the original."""
    from models import SaveIt

    kw = {"nvme_dir": str(tmp_path / "spill"), "engine": "python"} if policy == "nvme" else {}
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0, **kw)
    for first in (0, 8, 16, 32, 48, 56):             # 0 to 224 bytes into the storage
        t = torch.randn(4096 + 64, device=DEV)[first:first + 4096]
        sink: list = []
        w = torch.ones((), device=DEV, requires_grad=True)
        with off:
            out = SaveIt.apply(t, w, sink)
        tiermem.testing.store_of(off, tiermem.Tier(policy)).drain()   # restored from the copy, not t
        out.backward()
        (u,) = sink
        assert torch.equal(u, t)
        assert u.data_ptr() != t.data_ptr() and u.data_ptr() % 256 == t.data_ptr() % 256
    assert off.stats.count_by_tier[policy] == 1
    off.close()


def test_nvme_restore_with_staging_full_pins_nothing_new(tmp_path, engine, monkeypatch):
    """NOTE [Restores past the staging budget] in tiers/nvme.py: with every
    staging buffer held, backward's restores read into pageable memory and
    pin nothing outside the budgets; gradients stay exact."""
    model = _model()
    x = torch.randn(4, 128, 256, device=DEV)
    ref = _step(model, x, contextlib.nullcontext())
    off = _nvme_off(tmp_path, engine)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with off:
        loss = model(x).float().square().mean()
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    store.drain()                                  # every write landed: staging idle
    pool = tiermem.testing.staging_pool(off)
    held, size = [], pool.budget_bytes
    while size >= 4096:                            # fill the pool, largest first
        buf = pool.acquire(size, pinned=True)
        if buf is None:
            size //= 2
        else:
            held.append(buf)
    real_empty = torch.empty
    pinned_asks = []

    def counting_empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            pinned_asks.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", counting_empty)
    loss.backward()
    monkeypatch.setattr(torch, "empty", real_empty)
    assert_same_step((loss.detach(), [p.grad.clone() for p in model.parameters()]), ref)
    assert store.unpinned_restores > 0 and pinned_asks == []
    for buf in held:
        pool.release(buf, None, True)
    off.close()
