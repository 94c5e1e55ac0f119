"""The C++ engine's CUDA chain (csrc/cuda_chain.cpp, NOTE [CUDA chain]).

The first tests run everywhere: which build of the engine was made and what it
reports. The rest are marked ``gpu`` (skipped without a CUDA device) and skip
as well when the engine was built without the chain (a CPU-only torch, or no
CUDA toolkit): they round-trip tensors through the chain, bit for bit, with
slowed streams to widen the races the chain must order, and check that the
forward pass of the nvme tier does not wait for the host on the chain.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import pytest
import torch

import tiermem
import tiermem.testing
from tiermem.runtime import jobs
from tiermem.io import ALIGN_BYTES, aligned_empty, engine_info, get_engine
from helpers import assert_same_step, forbid_host_waits, until

SLEEP_CYCLES = 50_000_000  # ~25 ms at ~2 GHz: far longer than any copy here


# -- everywhere ---------------------------------------------------------------------

def test_engine_reports_whether_it_has_the_cuda_chain():
    info = engine_info()
    assert isinstance(info["cuda"], bool)
    if info["engine"] != "cpp":
        assert info["cuda"] is False
        return
    assert ("with the CUDA chain" in info["reason"]) is info["cuda"]
    if torch.version.cuda is None:
        assert info["cuda"] is False and "CPU-only build" in info["reason"]
    eng = get_engine("cpp")
    assert eng.cuda_chain is info["cuda"]
    assert get_engine("python").cuda_chain is False


def test_cpu_only_build_has_no_chain_and_says_why(tmp_path):
    if torch.version.cuda is not None:
        pytest.skip("torch is a CUDA build")
    if engine_info()["engine"] != "cpp":
        pytest.skip("C++ engine unavailable")
    eng = get_engine("cpp")
    with eng.open(str(tmp_path / "f.bin"), ALIGN_BYTES) as f:
        with pytest.raises(tiermem.TierMemError, match="no CUDA chain.*CPU-only"):
            f.write_from_device(torch.zeros(4), torch.zeros(4), 0, None, None)


# -- on a GPU, with the chain -----------------------------------------------------------

@pytest.fixture
def eng():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    info = engine_info()
    if not info["cuda"]:
        pytest.skip(f"the C++ engine has no CUDA chain: {info['reason']}")
    return get_engine("cpp", 4)


@pytest.fixture
def streams():
    dev = torch.device("cuda")
    return torch.cuda.Stream(dev), torch.cuda.Stream(dev)   # d2h, h2d


def _pinned(nbytes):
    return aligned_empty(nbytes, pin_memory=True)


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _roundtrip(f, src, offset, streams):
    """Write ``src`` through the chain at ``offset``, read it back into a new
    device tensor, and return it (ordered on the current stream)."""
    d2h, h2d = streams
    compute = torch.cuda.current_stream()
    nbytes = src.numel() * src.element_size()
    out_staging = _pinned(nbytes).view(src.dtype)
    if not src.is_contiguous():
        out_staging = out_staging.view(src.shape)
    fut = f.write_from_device(src, out_staging, offset, d2h, compute)
    fut.wait()
    assert fut.done() and fut.is_write
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rfut = f.read_to_device(_pinned(nbytes), dst, offset, h2d, compute)
    rfut.stream_wait(compute.cuda_stream)
    return dst, rfut


@pytest.mark.gpu
def test_copied_says_when_a_write_no_longer_needs_its_device_tensor(eng, streams, tmp_path):
    """NOTE [Staged moves]: CudaFuture.copied() is true once the D2H copy has
    landed (the pwrite may still run), never for reads."""
    d2h, h2d = streams
    compute = torch.cuda.current_stream()
    src = torch.randn(1 << 20, device="cuda")
    with eng.open(str(tmp_path / "f.bin"), 8 << 20) as f:
        with torch.cuda.stream(d2h):
            torch.cuda._sleep(SLEEP_CYCLES)           # the copy waits behind this
        fut = f.write_from_device(src, _pinned(src.numel() * 4).view(torch.float32), 0, d2h,
                                  compute)
        assert not fut.copied()
        fut.wait()
        assert fut.copied() and fut.done()
        dst = torch.empty_like(src)
        rfut = f.read_to_device(_pinned(src.numel() * 4).view(torch.float32), dst, 0, h2d,
                                compute)
        rfut.synchronize()
        assert not rfut.copied()
        rfut.stream_wait(compute.cuda_stream)
        assert torch.equal(dst, src)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("numel", [1, 1023, 4096, (3 << 20) + 5, 9 << 20])
def test_roundtrip_is_bit_identical(eng, streams, tmp_path, dtype, numel):
    src = (torch.randn(numel, device="cuda") * 1000).to(dtype)
    with eng.open(str(tmp_path / "f.bin"), 0) as f:
        nbytes = numel * src.element_size()
        f.resize(ALIGN_BYTES + -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)
        dst, rfut = _roundtrip(f, src, ALIGN_BYTES, streams)
        assert torch.equal(dst, _bytes(src))    # ordered after the copy by stream_wait
        rfut.synchronize()
        assert rfut.done()


@pytest.mark.gpu
def test_gapped_conjugate_and_negative_views_are_resolved(eng, streams, tmp_path):
    base = torch.randn(64, 96, device="cuda")
    z = torch.randn(300, dtype=torch.complex64, device="cuda")
    cases = [base[:, ::3], z.conj(), torch.randn(257, device="cuda")._neg_view()]
    with eng.open(str(tmp_path / "f.bin"), 1 << 20) as f:
        for src in cases:
            dst, _ = _roundtrip(f, src, 0, streams)
            expected = src.resolve_conj().resolve_neg().contiguous()
            assert torch.equal(dst, _bytes(expected))


@pytest.mark.gpu
def test_conjugate_view_resolved_even_when_its_copy_lands_late(eng, streams, tmp_path):
    """Deterministic form of the case above: the D2H stream is held back, so a
    conj applied on the host right after queueing the copy (torch's D2H copy_
    of a conj view, pytorch#146286) would run before the bytes land."""
    z = torch.randn(4096, dtype=torch.complex64, device="cuda")
    with torch.cuda.stream(streams[0]):
        torch.cuda._sleep(SLEEP_CYCLES)
    with eng.open(str(tmp_path / "f.bin"), 1 << 20) as f:
        dst, _ = _roundtrip(f, z.conj(), 0, streams)
        assert torch.equal(dst, _bytes(z.conj().resolve_conj()))


@pytest.mark.gpu
def test_read_copy_waits_for_the_allocation_stream(eng, streams, tmp_path):
    """The H2D copy must run after work queued on the destination's allocation
    stream: a block freed there and reused for ``dst`` may still be written."""
    n = 1 << 20
    data = torch.arange(n, dtype=torch.float32)
    with eng.open(str(tmp_path / "f.bin"), 4 * n) as f:
        src = aligned_empty(4 * n).view(torch.float32)
        src.copy_(data)
        f.write(src, 0).wait()
        compute = torch.cuda.current_stream()
        x = torch.empty(n, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(7.0)                       # late write on the compute stream
        del x                              # its block goes back to the compute stream's pool
        dst = torch.empty(n, device="cuda")  # most likely the same block
        fut = f.read_to_device(_pinned(4 * n).view(torch.float32), dst, 0, streams[1], compute)
        fut.stream_wait(compute.cuda_stream)
        assert torch.equal(dst.cpu(), data)


@pytest.mark.gpu
def test_write_waits_for_the_producer_on_a_slow_compute_stream(eng, streams, tmp_path):
    n = 1 << 20
    x = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)          # the producer runs late
    x.fill_(7.0)
    staging = _pinned(4 * n).view(torch.float32)
    with eng.open(str(tmp_path / "f.bin"), 4 * n) as f:
        f.write_from_device(x, staging, 0, streams[0], torch.cuda.current_stream()).wait()
        back = aligned_empty(4 * n).view(torch.float32)
        f.read(back, 0).wait()
    assert bool((back == 7.0).all())


@pytest.mark.gpu
def test_source_dropped_at_once_is_held_until_copied(eng, streams, tmp_path):
    """The engine holds the source until its copy is done: a freed-too-early
    block would be overwritten by the scribble before the slowed copy runs."""
    n = 1 << 20
    d2h = streams[0]
    with eng.open(str(tmp_path / "f.bin"), 4 * n) as f:
        src = torch.randn(n, device="cuda")
        expected = src.cpu()
        with torch.cuda.stream(d2h):
            torch.cuda._sleep(SLEEP_CYCLES)
        fut = f.write_from_device(src, _pinned(4 * n).view(torch.float32), 0, d2h,
                                  torch.cuda.current_stream())
        del src
        scribble = [torch.full((n,), 7.0, device="cuda") for _ in range(8)]
        fut.wait()
        back = aligned_empty(4 * n).view(torch.float32)
        f.read(back, 0).wait()
    assert torch.equal(back, expected)
    del scribble


@pytest.mark.gpu
def test_destination_dropped_unconsumed_is_not_reused_while_copied(eng, streams, tmp_path):
    n = 1 << 20
    h2d = streams[1]
    data = torch.randn(n)
    with eng.open(str(tmp_path / "f.bin"), 4 * n) as f:
        f.write(data, 0).wait()
        with torch.cuda.stream(h2d):
            torch.cuda._sleep(SLEEP_CYCLES)   # the copy (issued later) runs late
        dst = torch.empty(n, device="cuda")
        fut = f.read_to_device(_pinned(4 * n).view(torch.float32), dst, 0, h2d,
                               torch.cuda.current_stream())
        fut.wait()                               # issued, not complete
        del dst, fut
        scribble = [torch.full((n,), 7.0, device="cuda") for _ in range(8)]
        torch.cuda.synchronize()
    assert all(bool((s == 7.0).all()) for s in scribble)


@pytest.mark.gpu
def test_consumer_waits_for_a_slow_copy_without_blocking_the_host(eng, streams, tmp_path):
    n = 1 << 20
    h2d = streams[1]
    data = torch.randn(n)
    with eng.open(str(tmp_path / "f.bin"), 4 * n) as f:
        f.write(data, 0).wait()
        with torch.cuda.stream(h2d):
            torch.cuda._sleep(4 * SLEEP_CYCLES)  # far longer than the read from disk
        dst = torch.empty(n, device="cuda")
        fut = f.read_to_device(_pinned(4 * n).view(torch.float32), dst, 0, h2d,
                               torch.cuda.current_stream())
        fut.stream_wait(torch.cuda.current_stream().cuda_stream)
        assert not fut.done()                    # the host did not wait for the copy
        total = dst.double().sum()               # queued on the consumer stream
        assert torch.equal(dst.cpu(), data)
        # The same reduction on the device (a CPU sum may round differently).
        assert total.item() == data.cuda().double().sum().item()


@pytest.mark.gpu
def test_consumed_read_lets_go_of_its_destination_at_once(eng, streams, tmp_path):
    """NOTE [CUDA chain lifetime]: once the consumer's stream waits on the
    copy, the chain lets go of the destination in that call, as the Python
    copier does, not when it later sees the (slowed) copy complete."""
    n = 4 << 20
    h2d = streams[1]
    data = torch.randn(n)
    with eng.open(str(tmp_path / "f.bin"), 4 * n) as f:
        f.write(data, 0).wait()
        with torch.cuda.stream(h2d):
            torch.cuda._sleep(4 * SLEEP_CYCLES)   # the copy completes ~100 ms from now
        compute = torch.cuda.current_stream()
        dst = torch.empty(n, device="cuda")
        fut = f.read_to_device(_pinned(4 * n).view(torch.float32), dst, 0, h2d, compute)
        fut.stream_wait(compute.cuda_stream)
        check = dst.double().sum()                 # the consumer, ordered after the copy
        copy_pending = not fut.done()
        before = torch.cuda.memory_allocated()
        del dst
        freed = before - torch.cuda.memory_allocated()
        fut.synchronize()
    assert copy_pending
    assert freed >= 4 * n, f"the chain still held the consumed destination ({freed} B freed)"
    assert check.item() == data.cuda().double().sum().item()


@pytest.mark.gpu
def test_a_slow_read_does_not_hold_back_a_finished_one(streams, tmp_path):
    """NOTE [Reads in completion order]: read A waits on a busy disk queue
    (another engine's single worker, behind a 256 MiB read); read B, submitted
    after it, is read at once and its copy issued while A is still on the disk.
    The in thread used to wait on A first."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not engine_info()["cuda"]:
        pytest.skip("the C++ engine has no CUDA chain")
    from tiermem.io.cpp import CppEngine
    busy_engine, chain_engine = CppEngine(1), CppEngine(2)
    big = 256 << 20
    n = 1 << 16
    h2d = streams[1]
    compute = torch.cuda.current_stream()
    data = torch.randn(n)
    try:
        with busy_engine.open(str(tmp_path / "busy.bin"), big) as fa, \
                chain_engine.open(str(tmp_path / "b.bin"), 4 * n) as fb:
            fa.write(aligned_empty(big), 0).wait()
            fa.write(data, 0).wait()
            fb.write(data, 0).wait()
            busy = fa.read(aligned_empty(big), 0)          # the worker is busy a while
            dst_a = torch.empty(n, device="cuda")
            dst_b = torch.empty(n, device="cuda")
            chain = tiermem.testing.cuda_chain_of(chain_engine)
            native_a, native_b = tiermem.testing.native_file(fa), tiermem.testing.native_file(fb)
            fut_a = chain.read_to_device(native_a, 0, _pinned(4 * n).view(torch.float32), dst_a,
                                         h2d.cuda_stream, compute.cuda_stream)
            fut_b = chain.read_to_device(native_b, 0, _pinned(4 * n).view(torch.float32), dst_b,
                                         h2d.cuda_stream, compute.cuda_stream)
            fut_b.wait()                                   # B read and its copy issued
            a_still_on_disk = not busy.done()
            a_issued, b_issued = fut_a.issued(), fut_b.issued()
            fut_b.stream_wait(compute.cuda_stream)
            fut_a.stream_wait(compute.cuda_stream)
            busy.wait()
            assert torch.equal(dst_a.cpu(), data) and torch.equal(dst_b.cpu(), data)
    finally:
        chain_engine.close()
        busy_engine.close()
    assert a_still_on_disk, "B's copy waited for A's read"
    assert b_issued and not a_issued   # EngineCudaJob.host_ready(): B yes, A not yet


@pytest.mark.gpu
def test_gapped_source_is_made_dense_in_the_compute_streams_pool(eng, streams, tmp_path):
    """NOTE [Temporaries on the compute stream] in runtime/copier.py, for the chain:
    once the write is done, the temporary's block serves the compute stream."""
    d2h = streams[0]
    compute = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    src = torch.randn(2048, 4096, device="cuda")[:, ::2]   # a 16 MiB temporary
    staging = _pinned(src.numel() * 4).view(torch.float32).view(src.shape)
    with eng.open(str(tmp_path / "f.bin"), src.numel() * 4) as f:
        fut = f.write_from_device(src, staging, 0, d2h, compute)
        fut.wait()                                # drains what the chain let go of
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        again = torch.empty(src.shape, device="cuda")
        assert torch.cuda.memory_reserved() == reserved, "the temporary's block was not reusable"
        back = aligned_empty(src.numel() * 4).view(torch.float32)
        f.read(back, 0).wait()
    assert torch.equal(back.view(src.shape), src.cpu())
    del again


@pytest.mark.gpu
def test_errors_name_the_file_and_offset(eng, streams, tmp_path):
    path = str(tmp_path / "f.bin")
    compute = torch.cuda.current_stream()
    f = eng.open(path, ALIGN_BYTES)
    dst = torch.empty(2 * ALIGN_BYTES, dtype=torch.uint8, device="cuda")
    fut = f.read_to_device(_pinned(2 * ALIGN_BYTES), dst, 0, streams[1], compute)
    with pytest.raises(OSError, match="short read") as e:
        fut.stream_wait(compute.cuda_stream)
    assert path in str(e.value) and "read of 8192 bytes at offset 0" in str(e.value)
    assert fut.done()
    f.close()
    fut = f.write_from_device(torch.ones(16, device="cuda"), _pinned(64).view(torch.float32),
                              0, streams[0], compute)
    with pytest.raises(OSError, match="closed") as e:
        fut.wait()
    assert path in str(e.value)
    with pytest.raises(ValueError, match="pinned"):
        f.read_to_device(torch.empty(64, dtype=torch.uint8), dst[:64], 0, streams[1], compute)


# -- the nvme tier on the chain ---------------------------------------------------------

def _model(layers=3, width=256):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                   torch.nn.Linear(4 * width, width), torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*blocks).cuda()


def _step(model, x, ctx):
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _nvme(tmp_path, **kw):
    return tiermem.Offloader(policy="nvme", nvme_dir=str(tmp_path / "spill"), engine="cpp",
                             min_offload_bytes=0, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("verify", [False, True])   # True: the Python chain (checksums)
def test_nvme_tier_gradients_bit_identical_on_the_chain(eng, deterministic, tmp_path, verify):
    model = _model()
    x = torch.randn(8, 64, 256, device="cuda")
    ref = _step(model, x, contextlib.nullcontext())
    off = _nvme(tmp_path, verify=verify)
    for _ in range(3):
        assert_same_step(_step(model, x, off), ref)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    assert store.uses_engine_chain is (not verify)
    assert off.stats.count_by_tier["nvme"] > 0
    off.close()


@pytest.mark.gpu
def test_nvme_forward_on_the_chain_does_not_sync_the_host(eng, tmp_path):

    model = _model()
    x = torch.randn(8, 64, 256, device="cuda")
    off = _nvme(tmp_path)
    _step(model, x, off)                         # warm-up: pools, streams, the chain
    torch.cuda.synchronize()
    assert tiermem.testing.uses_engine_chain(off)

    with forbid_host_waits(jobs.EngineCudaJob), off:
        loss = model(x).square().mean()
    loss.backward()
    assert off.stats.count_by_tier["nvme"] > 0
    off.close()


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["write_from_device", "read_to_device"])
def test_nvme_tier_exact_with_slow_chain_copies(eng, deterministic, tmp_path, monkeypatch,
                                                which):
    """Every copy of the chain runs late (a sleep queued on its side stream
    first): consumers and reused blocks must still be ordered after it."""
    file_type = tiermem.testing.engine_file_type()
    original = getattr(file_type, which)

    def slowed(self, a, b, offset, stream, after):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES // 5)
        return original(self, a, b, offset, stream, after)

    model = _model(layers=2)
    x = torch.randn(4, 64, 256, device="cuda")
    ref = _step(model, x, contextlib.nullcontext())
    monkeypatch.setattr(file_type, which, slowed)
    off = _nvme(tmp_path, prefetch_bytes="1GiB")
    assert_same_step(_step(model, x, off), ref)
    assert tiermem.testing.uses_engine_chain(off)
    off.close()


@pytest.mark.gpu
def test_roundtrip_on_a_non_default_compute_stream_with_a_third_consumer(eng, streams,
                                                                          tmp_path):
    """Everything above runs with the default stream as the compute stream;
    here the producer and the consumer run on streams of their own."""
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    n = 1 << 20
    with eng.open(str(tmp_path / "f.bin"), 4 * n) as f:
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SLEEP_CYCLES)
            src = torch.arange(n, device="cuda", dtype=torch.float32)
            fut = f.write_from_device(src, _pinned(4 * n).view(torch.float32), 0,
                                      streams[0], producer)
        fut.wait()
        with torch.cuda.stream(consumer):
            dst = torch.empty(n, device="cuda")
            rfut = f.read_to_device(_pinned(4 * n).view(torch.float32), dst, 0, streams[1],
                                    consumer)
            rfut.stream_wait(consumer.cuda_stream)
            total = dst.double().sum()   # exact: integers below 2**53 (float32 would round)
        consumer.synchronize()
    assert total.item() == float(n * (n - 1) // 2)


@pytest.mark.gpu
def test_engine_closed_with_slow_copies_in_flight(streams, tmp_path):
    """Closing the engine while chained copies are still queued runs them to
    their end (``CppEngine.close``: the chain first, whose queued writes go to
    the engine's pool, then the pool, which finishes its queue): no crash, no
    hang, every write done, and the written data is intact on disk."""
    if not engine_info()["cuda"]:
        pytest.skip("the C++ engine has no CUDA chain")
    eng = get_engine("cpp", 3)   # a thread count no other test uses: closed below
    n = 1 << 18
    values = [float(i + 1) for i in range(4)]   # no zeros: an unwritten extent reads 0.0
    srcs = [torch.full((n,), v, device="cuda") for v in values]
    staging = [_pinned(4 * n).view(torch.float32) for _ in srcs]
    path = tmp_path / "f.bin"
    f = eng.open(str(path), 4 * n * len(srcs))
    with torch.cuda.stream(streams[0]):
        torch.cuda._sleep(SLEEP_CYCLES)         # the copies are still queued at close
    futs = [f.write_from_device(s, buf, 4 * n * i, streams[0], torch.cuda.current_stream())
            for i, (s, buf) in enumerate(zip(srcs, staging))]
    del staging                                 # the chain holds them until written
    eng.close()
    assert eng.closed
    errors = []
    for i, fut in enumerate(futs):
        assert fut.done(), f"write {i} not done after the engine closed"
        try:
            fut.wait()
        except OSError as e:    # a write refused at close would say so here
            errors.append((i, str(e)))
    assert errors == [], errors
    torch.cuda.synchronize()
    f.close()
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)
    assert data.numel() == n * len(srcs)
    for i, v in enumerate(values):
        assert torch.equal(data[i * n:(i + 1) * n], torch.full((n,), v)), f"write {i} is not intact"


@pytest.mark.gpu
@pytest.mark.parametrize("error", [RuntimeError, ValueError])
@pytest.mark.parametrize("which", ["write_from_device", "read_to_device"])
def test_refused_chain_submit_falls_back_to_the_python_chain(eng, deterministic, tmp_path,
                                                             monkeypatch, caplog, which, error):
    """A request the engine's chain refuses at submit goes through the Python
    chain; after a CUDA error (RuntimeError) every later one does too, after a
    rejected argument (ValueError) only that one; one warning; gradients exact;
    nothing raised into the training step."""

    model = _model()
    x = torch.randn(8, 64, 256, device="cuda")
    ref = _step(model, x, contextlib.nullcontext())
    calls = []

    def refuse(self, *args, **kwargs):
        calls.append(which)
        raise error("refusal injected by the test")
    monkeypatch.setattr(tiermem.testing.engine_file_type(), which, refuse)
    off = _nvme(tmp_path)
    with caplog.at_level("WARNING", logger="tiermem"):
        for _ in range(2):
            assert_same_step(_step(model, x, off), ref)
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    if error is RuntimeError:
        assert len(calls) == 1, calls       # given up after the first refusal
        assert not store.uses_engine_chain
    else:
        assert len(calls) > 1, calls        # refused per tensor, chain kept
        assert store.uses_engine_chain
    assert "injected by the test" in store.engine_chain_error
    assert sum("CUDA chain refused" in r.getMessage() for r in caplog.records) == 1
    assert off.stats.count_by_tier["nvme"] > 0
    off.close()


@pytest.mark.gpu
@pytest.mark.parametrize("verify", [False, True])   # True: the Python chain
def test_device_memory_is_freed_once_copied_to_staging(eng, deterministic, tmp_path, verify):
    """NOTE [Staged moves]: a saved tensor's device memory goes once its copy
    to pinned staging has landed, before its write; with the Python chain the
    writes are held back to show it, and backward then runs from staging."""
    import threading

    model = _model()
    x = torch.randn(8, 64, 256, device="cuda")
    ref = _step(model, x, contextlib.nullcontext())
    off = _nvme(tmp_path, verify=verify)
    _step(model, x, off)   # warm-up: pools, streams
    store = tiermem.testing.store_of(off, tiermem.Tier.NVME)
    gate = threading.Event()
    if verify:
        inner = store.file

        class Gated:
            def __getattr__(self, name):
                return getattr(inner, name)

            def write(self, buf, offset):
                assert gate.wait(30)
                return inner.write(buf, offset)
        store.file = Gated()
    else:
        gate.set()
    model.zero_grad(set_to_none=True)
    with off:
        loss = model(x).square().mean()
    handles = [r() for r, _ in store.pending_moves()]
    assert handles
    torch.cuda.synchronize()

    def sources_dropped():
        tiermem.testing.poll(off)
        return all(h is None or h.src is None for h in handles)
    until(sources_dropped, "sources kept after their copies landed")
    if verify:
        assert all(h.host is not None for h in handles)   # writes held back
    loss.backward()
    gate.set()
    assert torch.equal(loss.detach(), ref[0])
    for p, r in zip(model.parameters(), ref[1]):
        assert torch.equal(p.grad, r)
    off.close()
