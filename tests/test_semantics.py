"""The semantics every tier must keep (docs/guarantees.md), tested on the CPU.

Saved tensors are observed directly through ``models.SaveIt``, a Function whose
forward saves exactly the tensor it is given and whose backward hands back what
``ctx.saved_tensors`` unpacked, so values, sizes, strides and storage can be
compared with the original.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
import time

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

import tiermem
import tiermem.testing
from helpers import (assert_same_tensors, expect_compact, land_moves, moved_count, offloader,
                     reference_steps, run_step, same_bits, train_steps)
from models import MLP, SaveIt, make_case


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------
# Layouts: views, non-contiguous, stride 0, zero-size, 0-dim, dtypes
# ---------------------------------------------------------------------------

def _big():
    return torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256).sin()


LAYOUTS = {
    "contiguous": lambda: torch.randn(33, 17),
    "transpose": lambda: torch.randn(64, 48).t(),
    "step_slice_2": lambda: torch.randn(64, 64)[:, ::2],       # span == 2x numel: kept strided
    "step_slice_3": lambda: torch.randn(90, 64)[::3],          # span ~3x numel: compact copy
    "narrow_rows": lambda: _big().narrow(0, 10, 5),            # contiguous, storage offset
    "offset_by_one": lambda: torch.randn(1000)[1:],            # misaligned data pointer
    "narrow_cols": lambda: _big().narrow(1, 3, 4),             # gapped: compact copy
    "narrow_row_tail": lambda: _big()[200:, 250:],             # offset + gaps
    "expand_row": lambda: torch.randn(1, 64).expand(32, 64),   # stride (0, 1)
    "expand_scalar": lambda: torch.randn(()).expand(16, 16),   # stride (0, 0)
    "overlapping": lambda: torch.randn(100).as_strided((10, 10), (1, 1)),
    "channels_last": lambda: torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last),
    "permute_3d": lambda: torch.randn(4, 5, 6).permute(2, 0, 1),
    "zero_size": lambda: torch.randn(0, 5),
    "zero_size_view": lambda: torch.randn(4, 0, 3).transpose(0, 2),
    "zero_dim": lambda: torch.tensor(3.5),
    "zero_dim_view": lambda: torch.randn(10)[3],
    "int64": lambda: torch.randint(-2**40, 2**40, (7, 9), dtype=torch.int64).t(),
    "bool": lambda: torch.rand(50) > 0.5,
    "bfloat16": lambda: torch.randn(40, 3, dtype=torch.bfloat16)[:, 1],
    "complex_conj": lambda: torch.randn(8, 8, dtype=torch.complex64).conj(),
    "float64_nan_inf": lambda: torch.tensor([float("nan"), float("inf"), -0.0, 1e-310, 2.0],
                                            dtype=torch.float64),
}


@pytest.mark.parametrize("landed", [False, True], ids=["in_flight", "landed"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_roundtrip(name, storage_tier, landed, make_off):
    tier = storage_tier
    t = LAYOUTS[name]()
    expected = t.clone()
    sink: list = []
    w = torch.ones((), requires_grad=True)
    off = make_off(tier)
    with off:
        out = SaveIt.apply(t, w, sink)
    if landed:
        if tier == "cpu":
            off.close()      # waits for the copies in flight: backward restores from host memory
        else:
            land_moves(off)  # (closed, the nvme tier could not read back: it is left open)
    out.backward()
    (u,) = sink
    assert u.dtype == t.dtype and u.device == t.device
    assert u.shape == t.shape
    assert same_bits(u, expected), f"{name}/{tier}: values differ"
    stats = off.stats
    moved = t.numel() > 0 and tier != "keep"
    assert stats.count_by_tier[tier if moved else "keep"] == 1
    assert moved_count(stats) == (1 if moved else 0)
    if t.numel() == 0:
        assert stats.small_count == 1
    if tier == "keep":
        assert u.stride() == t.stride() and u.data_ptr() == t.data_ptr()
        return
    if not moved:
        return
    assert stats.bytes_by_tier[tier] == t.numel() * t.element_size()
    if tier == "cpu" and not landed and u.stride() == t.stride():
        pass  # backward came before the copy landed: the original itself may be used
    elif expect_compact(t):
        assert u.is_contiguous(), f"{name}: a compact copy should be dense, got {u.stride()}"
    else:
        assert u.stride() == t.stride(), f"{name}: strides {u.stride()} != {t.stride()}"
        # Same pointer alignment (vectorized kernels, hence reduction order, depend on it).
        assert u.data_ptr() % 64 == t.data_ptr() % 64, f"{name}: alignment changed"
    if landed:
        # Restored from the host copy or the disk, not the original storage.
        assert _storage_ptr(u) != _storage_ptr(t)
        assert stats.prefetch_hits + stats.prefetch_misses == 1


def test_restored_view_does_not_alias_neighbours():
    """A slice of a bigger tensor restored after its copy landed holds its
    pack-time values, whatever is written to the original (the slice itself
    and its neighbours) afterwards."""
    base = torch.arange(1000, dtype=torch.float32)
    t = base[100:200]
    expected = t.clone()
    sink: list = []
    w = torch.ones((), requires_grad=True)
    off = offloader("cpu")
    with off:
        out = SaveIt.apply(t, w, sink)
    off.close()
    # Writes through the base (neighbours and the slice itself) after the copy
    # landed: the restored tensor keeps the pack-time values.
    base[:100].zero_()
    base[200:].zero_()
    base[150] = -1.0
    out.backward()
    assert torch.equal(sink[0], expected)


# ---------------------------------------------------------------------------
# Dedup, parameters, small tensors
# ---------------------------------------------------------------------------

def test_dedup_one_tensor_saved_twice_is_stored_once():
    t = torch.randn(64, 64)
    sink: list = []
    w = torch.ones((), requires_grad=True)
    off = offloader("cpu")
    with off:
        o1 = SaveIt.apply(t, w, sink)
        o2 = SaveIt.apply(t, w, sink)
    (o1 + o2).backward()
    s = off.stats
    assert s.dedup_hits == 1
    assert s.count_by_tier["cpu"] == 1
    assert s.bytes_by_tier["cpu"] == t.numel() * 4
    assert len(sink) == 2 and all(torch.equal(u, t) for u in sink)
    assert torch.equal(w.grad, torch.tensor(2.0))


def test_dedup_distinguishes_views_and_real_ops():
    """Two different views of one storage are two tensors; a real activation
    consumed by two ops is stored once."""
    t = torch.randn(64, 64)
    sink: list = []
    w = torch.ones((), requires_grad=True)
    off = offloader("cpu")
    with off:
        o1 = SaveIt.apply(t, w, sink)
        o2 = SaveIt.apply(t.t(), w, sink)
        o3 = SaveIt.apply(t[1:], w, sink)
    (o1 + o2 + o3).backward()
    assert off.stats.dedup_hits == 0
    assert off.stats.count_by_tier["cpu"] == 3
    assert torch.equal(sink[0], t[1:]) and torch.equal(sink[1], t.t()) and torch.equal(sink[2], t)

    lin = nn.Linear(32, 32)
    x = torch.randn(16, 32)
    for ctx in (contextlib.nullcontext(), offloader("cpu")):
        lin.zero_grad()
        with ctx:
            h = lin(x)
            loss = (h.sin() * h.cos()).sum()   # sin and cos both save h
        loss.backward()
        if isinstance(ctx, tiermem.Offloader):
            assert ctx.stats.dedup_hits >= 1
            got = lin.weight.grad.clone()
        else:
            ref = lin.weight.grad.clone()
    assert torch.equal(got, ref)


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("scale", torch.randn(64, 64))

    def forward(self, x, w, sink):
        a = SaveIt.apply(self.lin.weight, w, sink)              # the parameter itself
        b = SaveIt.apply(self.lin.weight.t(), w, sink)          # a view of it
        c = SaveIt.apply(self.lin.weight.t()[2:, ::2], w, sink)  # a view of a view
        d = SaveIt.apply(self.scale, w, sink)                   # a buffer
        return a + b + c + d + self.lin(x).sum()


def test_parameters_and_buffers_never_moved():
    m = _WithBuffer()
    sink: list = []
    w = torch.ones((), requires_grad=True)
    infos = []
    off = offloader(lambda info: infos.append(info) or "cpu")
    with off:
        out = m(torch.randn(8, 64), w, sink)
    out.backward()
    weight_ptr = _storage_ptr(m.lin.weight)
    # Unpacked in reverse order: buffer, view of view, view, parameter.
    assert [_storage_ptr(u) for u in sink] == [_storage_ptr(m.scale)] + [weight_ptr] * 3
    assert sink[1].data_ptr() == m.lin.weight.t()[2:, ::2].data_ptr()
    assert off.stats.param_count >= 4
    assert all(not i.is_param for i in infos)
    param_shapes = {tuple(p.shape) for p in m.parameters()} | {(64, 64)}
    # Every policy call was for the Linear's input (8, 64) only.
    assert [tuple(i.shape) for i in infos] == [(8, 64)]
    assert not param_shapes & {tuple(i.shape) for i in infos}


def test_linear_weight_t_view_never_reaches_policy():
    """nn.Linear saves ``weight.t()`` (a view of a Parameter): it is counted as
    a parameter, and no tensor the policy sees has a transposed weight's shape."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(32, MLP.D_IN, requires_grad=False)
    infos = []
    off = offloader(lambda info: infos.append(info) or "cpu")
    with off:
        loss = model(x).square().mean()
    loss.backward()
    transposed = {tuple(m.weight.t().shape) for m in model if isinstance(m, nn.Linear)}
    assert off.stats.param_count == 2   # layers 2 and 3 save weight.t() (layer 1's input needs no grad)
    assert infos and not any(i.is_param for i in infos)
    assert not transposed & {tuple(i.shape) for i in infos}
    assert off.stats.count_by_tier["cpu"] == len(infos)


def test_small_tensors_stay():
    small = torch.randn(100)          # 400 B
    exact = torch.randn(1024)         # 4096 B == threshold: moved
    big = torch.randn(4096)           # 16 KiB
    sink: list = []
    w = torch.ones((), requires_grad=True)
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=4096)
    with off:
        outs = [SaveIt.apply(t, w, sink) for t in (small, exact, big)]
    off.close()
    sum(outs).backward()
    s = off.stats
    assert s.small_count == 1
    assert s.count_by_tier["cpu"] == 2 and s.bytes_by_tier["cpu"] == 4096 + 16384
    assert s.count_by_tier["keep"] == 1 and s.bytes_by_tier["keep"] == 400
    big_u, exact_u, small_u = sink
    assert small_u.data_ptr() == small.data_ptr()
    assert _storage_ptr(big_u) != _storage_ptr(big) and torch.equal(big_u, big)
    assert _storage_ptr(exact_u) != _storage_ptr(exact) and torch.equal(exact_u, exact)


# ---------------------------------------------------------------------------
# Autograd entry points: grad, retain_graph, create_graph, checkpoint
# ---------------------------------------------------------------------------

def _expect_tier_used(stats, tier) -> None:
    """The run with policy ``tier`` really put tensors there (not a vacuous pass)."""
    if tier == "keep":
        assert moved_count(stats) == 0, stats
        return
    for t in ("cpu", "nvme", "recompute"):
        if t in tier.split(","):
            assert stats.count_by_tier[t] > 0, f"nothing went to {t}: {stats}"


def test_autograd_grad(tier, make_off):
    results = []
    for ctx in (contextlib.nullcontext(), make_off(tier)):
        case = make_case("block")
        params = list(case.model.parameters())
        torch.manual_seed(5)
        with ctx:
            loss = case.loss()
        grads = torch.autograd.grad(loss, params)
        assert all(p.grad is None for p in params)
        results.append((loss.detach(), grads))
    (rl, rg), (l, g) = results
    assert torch.equal(l, rl)
    assert all(torch.equal(a, b) for a, b in zip(g, rg))
    _expect_tier_used(ctx.stats, tier)


def test_retain_graph_two_backwards(tier, make_off):
    results = []
    for ctx in (contextlib.nullcontext(), make_off(tier)):
        case = make_case("block")
        torch.manual_seed(5)
        with ctx:
            loss = case.loss()
        if isinstance(ctx, tiermem.Offloader):
            land_moves(ctx)   # every move has landed: the restore counts below are exact
        loss.backward(retain_graph=True)
        g1 = {n: p.grad.clone() for n, p in case.model.named_parameters()}
        case.model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=True)
        g2 = {n: p.grad.clone() for n, p in case.model.named_parameters()}
        case.model.zero_grad(set_to_none=True)
        loss.backward()
        g3 = {n: p.grad.clone() for n, p in case.model.named_parameters()}
        assert_same_tensors(g1, g2, f"{tier}: backward 1 vs 2")
        assert_same_tensors(g1, g3, f"{tier}: backward 1 vs 3")
        results.append(g1)
    assert_same_tensors(results[1], results[0], f"{tier} vs reference")
    s = ctx.stats
    _expect_tier_used(s, tier)
    # Three passes restore every moved tensor, and regenerate every dropped
    # one, each time.
    moved = s.count_by_tier["cpu"] + s.count_by_tier["nvme"]
    assert s.prefetch_hits + s.prefetch_misses == 3 * moved, s
    assert s.recompute_count == 3 * s.count_by_tier["recompute"], s


def _gradient_penalty_step(ctx, grad_inside: bool):
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, MLP.D_IN, generator=g).requires_grad_()
    with ctx:
        out = model(x)
        loss = out.square().mean()
        if grad_inside:
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    if not grad_inside:
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    total = loss + 10.0 * gx.square().sum()
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["x"] = x.grad.clone()
    return total.detach(), grads


@pytest.mark.parametrize("grad_inside", [False, True], ids=["grad_outside", "grad_inside"])
def test_create_graph_double_backward(tier, grad_inside, make_off):
    rtotal, rgrads = _gradient_penalty_step(contextlib.nullcontext(), grad_inside)
    off = make_off(tier)
    total, grads = _gradient_penalty_step(off, grad_inside)
    assert torch.equal(total, rtotal)
    assert_same_tensors(grads, rgrads, f"double backward {tier}")
    # The penalty really depends on second derivatives through saved activations.
    assert rgrads["0.weight"].abs().sum() > 0
    _expect_tier_used(off.stats, tier)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_inside_offloader(reentrant):
    from torch.utils.checkpoint import checkpoint

    def step(ctx):
        case = make_case("block")
        torch.manual_seed(3)
        x = case.inputs[0].clone().requires_grad_()   # reentrant needs an input with grad
        with ctx:
            h = checkpoint(case.model, x, use_reentrant=reentrant)
            loss = h.square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in case.model.named_parameters()}
        grads["x"] = x.grad.clone()
        return loss.detach(), grads

    rl, rg = step(contextlib.nullcontext())
    off = offloader("cpu")
    l, g = step(off)
    assert torch.equal(l, rl)
    assert_same_tensors(g, rg, "checkpoint")


# ---------------------------------------------------------------------------
# Failures, reuse, lifetime of host buffers
# ---------------------------------------------------------------------------

class _Boom(nn.Module):
    def forward(self, x):
        raise ValueError("boom inside forward")


def test_exception_mid_forward_frees_everything_and_offloader_is_reusable():
    case = make_case("mlp")
    off = offloader("cpu")
    in_use_before_raise = []

    def forward():
        h = case.model(*case.inputs)
        h2 = h.exp() * 2
        in_use_before_raise.append(off.host_bytes_in_use)
        return _Boom()(h2)

    try:
        with off:
            forward()
    except ValueError as e:
        assert "boom" in str(e)
    else:
        raise AssertionError("the forward should have raised")
    gc.collect()
    assert in_use_before_raise[0] > 0, "nothing moved before the exception: vacuous"
    assert off.host_bytes_in_use == 0
    # Reusable: the next step runs, modules are named afresh (no stale "_Boom"),
    # and gradients are exact.
    infos = []
    off2 = offloader(lambda i: infos.append(i) or "cpu")
    for o in (off, off2):
        loss, grads = run_step(case.model, case.inputs, o, loss_fn=case.loss_fn)
        rloss, rgrads = run_step(make_case("mlp").model, case.inputs, contextlib.nullcontext(),
                                 loss_fn=case.loss_fn)
        assert torch.equal(loss, rloss)
        assert_same_tensors(grads, rgrads, "after an exception")
    assert off.stats.count_by_tier["cpu"] > 0
    assert [i.module for i in infos] == ["MLP.0", "MLP.1", "MLP.2", "MLP.3", ""]


def _copies_done() -> None:
    """Wait until the CPU copy threads have run every copy queued so far."""
    tiermem.testing.wait_cpu_copies()


@pytest.mark.slow
def test_host_buffers_freed_with_graph_when_copies_land_late():
    """Once a step's graph is freed and its copies have landed, the host buffers
    are free (``host_bytes_in_use`` docstring: "0 when their graphs are freed")
    and the saved tensor's own storage is released, with no further tiermem call
    needed, even when backward ran before the copy to host landed. A big tensor
    and a fresh Offloader (fresh, unfaulted buffers) make the copy slower than
    the tiny backward."""
    for attempt in range(5):
        off = offloader("cpu")
        t = torch.randn(8 * 1024 * 1024)     # 32 MiB
        sink: list = []
        w = torch.ones((), requires_grad=True)
        with off:
            saved = t * 1
            out = SaveIt.apply(saved, w, sink)
        storage = StorageWeakRef(saved.untyped_storage())
        del saved
        out.backward()
        assert torch.equal(sink[0], t)
        del out, sink
        # The copy has landed once the copy thread ran a job queued after it
        # (FIFO): no wall-clock deadline, which heavy load can outlast.
        _copies_done()
        gc.collect()
        state = (off.host_bytes_in_use, not storage.expired())
        assert state == (0, False), (
            f"attempt {attempt}: after the graph was freed and the copy landed, "
            f"(host bytes in use, saved tensor's storage alive) = {state}")
        off.close()


def test_device_memory_freed_when_copy_lands():
    """The point of offloading: the saved tensor's own storage is released once
    its copy has landed (seen at the next pack), long before backward."""
    x = torch.randn(1 << 20, requires_grad=True)
    off = offloader("cpu")
    with off:
        y = x.exp()                                  # saves y (4 MiB)
        storage = StorageWeakRef(y.untyped_storage())
        loss = y.sum()
        del y
        deadline = time.monotonic() + 5.0
        while not storage.expired() and time.monotonic() < deadline:
            time.sleep(0.005)
            (x * 1).sin()                            # a pack: tiermem checks landed copies
        freed_in_forward = storage.expired()
    assert freed_in_forward, "the source of a landed copy is still alive"
    assert off.stats.count_by_tier["cpu"] >= 1
    loss.backward()
    assert torch.equal(x.grad, x.detach().exp())


class _GraphConv(nn.Module):
    """``torch.sparse.mm(adj, lin(x))``: saves the sparse adjacency for backward."""

    def __init__(self, adj=None):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        if adj is not None:
            self.register_buffer("adj", adj)

    def forward(self, x, adj=None):
        return torch.sparse.mm(self.adj if adj is None else adj, self.lin(x))


@pytest.mark.parametrize("as_buffer", [False, True], ids=["sparse_input", "sparse_buffer"])
def test_sparse_tensor_saved_inside_module_stays(storage_tier, as_buffer, make_off):
    """Sparse tensors cannot be moved: they stay (``unsupported_count``) and
    gradients are exact, also when a module runs (parameters are being looked
    up) and when the sparse tensor is a module buffer."""
    g = torch.Generator().manual_seed(0)
    adj = (torch.rand(10, 10, generator=g) < 0.3).float().to_sparse()
    x = torch.randn(10, 16, generator=g)
    torch.manual_seed(0)
    model = _GraphConv(adj if as_buffer else None)
    grads = []
    for ctx in (contextlib.nullcontext(), make_off(storage_tier)):
        model.zero_grad(set_to_none=True)
        with ctx:
            out = model(x) if as_buffer else model(x, adj)
            loss = out.square().sum()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert_same_tensors(grads[1], grads[0], "sparse")
    if storage_tier != "keep":
        s = ctx.stats
        if as_buffer:   # a buffer: never moved, as a parameter or as unmovable
            assert s.unsupported_count + s.param_count >= 1
        else:
            assert s.unsupported_count == 1


# ---------------------------------------------------------------------------
# Nesting and threads
# ---------------------------------------------------------------------------

def test_no_offload_inside_offloader_keeps_tensors():
    def step(ctx, quiet: bool):
        case = make_case("block")
        torch.manual_seed(4)
        with ctx:
            x = case.model.ln1(case.inputs[0])
            if quiet:
                with tiermem.no_offload():
                    a = case.model.attn(x)
            else:
                a = case.model.attn(x)
            loss = (x + a).square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in case.model.named_parameters()
                               if p.grad is not None}

    ref = step(contextlib.nullcontext(), False)
    full, quiet = offloader("cpu"), offloader("cpu")
    r_full, r_quiet = step(full, False), step(quiet, True)
    for r in (r_full, r_quiet):
        assert torch.equal(r[0], ref[0])
        assert_same_tensors(r[1], ref[1], "no_offload")
    assert quiet.stats.count_by_tier["cpu"] > 0
    assert quiet.stats.count_by_tier["cpu"] < full.stats.count_by_tier["cpu"]
    assert quiet.stats.bytes_by_tier["cpu"] < full.stats.bytes_by_tier["cpu"]


def test_no_offload_keeps_inplace_check():
    x = torch.randn(1000, requires_grad=True)
    with pytest.raises(tiermem.TierMemError):
        with offloader("cpu"):
            with tiermem.no_offload():
                y = x.exp()
            y.add_(1)
            y.sum().backward()


@pytest.mark.parametrize("outer_tier,inner_tier", [("cpu", "keep"), ("keep", "cpu"),
                                                   ("cpu", "cpu")])
def test_nested_offloaders_innermost_wins(outer_tier, inner_tier):
    ts = [torch.randn(256) for _ in range(3)]
    sink: list = []
    w = torch.ones((), requires_grad=True)
    outer, inner = offloader(outer_tier), offloader(inner_tier)
    with outer:
        a = SaveIt.apply(ts[0], w, sink)
        with inner:
            b = SaveIt.apply(ts[1], w, sink)
        c = SaveIt.apply(ts[2], w, sink)   # after the inner one exits, the outer one applies
    (a + b + c).backward()
    assert [torch.equal(u, t) for u, t in zip(sink, reversed(ts))] == [True] * 3
    assert outer.stats.count_by_tier[outer_tier] == 2
    assert sum(outer.stats.count_by_tier.values()) == 2
    assert inner.stats.count_by_tier[inner_tier] == 1
    assert sum(inner.stats.count_by_tier.values()) == 1


def test_same_offloader_nested_in_one_thread_raises():
    off = offloader("cpu")
    with off:
        with pytest.raises(tiermem.TierMemError):
            with off:
                pass
    with off:   # still usable
        pass


def test_threads_each_with_own_offloader_train_concurrently():
    names = ["mlp", "convnet", "embed_gather"]   # no dropout: the global RNG is shared
    refs = {n: reference_steps(n) for n in names}
    results, errors = {}, []
    barrier = threading.Barrier(len(names))
    # Built here: initialisation draws from the global RNG, which threads share.
    cases = {n: make_case(n) for n in names}

    def worker(name):
        try:
            off = offloader("cpu")
            barrier.wait()
            results[name] = (train_steps(cases[name], lambda: off), off.stats)
        except BaseException as e:  # reported below
            errors.append((name, e))

    threads = [threading.Thread(target=worker, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(results) == sorted(names)
    for n in names:
        records, stats = results[n]
        assert stats.count_by_tier["cpu"] > 0
        for (l, g, p), (rl, rg, rp) in zip(records, refs[n]):
            assert torch.equal(l, rl)
            assert_same_tensors(g, rg, f"thread {n} grads")
            assert_same_tensors(p, rp, f"thread {n} params")


def test_same_offloader_in_two_threads_raises():
    off = offloader("cpu")
    entered, release = threading.Event(), threading.Event()
    errors = []

    def holder():
        try:
            with off:
                entered.set()
                release.wait(10)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert entered.wait(10)
        with pytest.raises(tiermem.TierMemError, match="another thread"):
            with off:
                pass
    finally:
        release.set()
        t.join(10)
    assert not errors
    case = make_case("mlp")     # free again once the other thread left
    loss, _ = run_step(case.model, case.inputs, off, loss_fn=case.loss_fn)
    assert off.stats.count_by_tier["cpu"] > 0


# ---------------------------------------------------------------------------
# In-place modification of saved tensors
# ---------------------------------------------------------------------------

def test_inplace_after_save_raises_on_keep_tier():
    x = torch.randn(1000, requires_grad=True)
    # Without hooks, autograd itself refuses.
    with pytest.raises(RuntimeError, match="inplace"):
        y = x.exp()
        y.add_(1)
        y.sum().backward()
    with pytest.raises(tiermem.TierMemError, match="in-place"):
        with offloader("keep"):
            y = x.exp()
            y.add_(1)
            y.sum().backward()
    # Through a view of the saved tensor too.
    with pytest.raises(tiermem.TierMemError):
        with offloader("keep"):
            y = x.exp()
            y.view(10, 100)[3].mul_(2)
            y.sum().backward()


def _race_forward(x, pack_between):
    y = x.exp()                        # exp saves its result y
    z = (x * 2).sin() if pack_between else None   # another pack: tiermem sees landed copies
    return y, z


@pytest.mark.parametrize("pack_between", [False, True], ids=["direct", "pack_between"])
def test_inplace_race_on_cpu_tier_never_gives_wrong_gradient(pack_between):
    """The copy to host races the in-place write. Every run either raises
    TierMemError or gives the gradient of the pack-time values."""
    x = torch.randn(1 << 20, requires_grad=True)       # 4 MiB: the copy takes a while
    y, z = _race_forward(x, pack_between)              # reference: no hooks, no in-place
    (y.sum() + (z.sum() if pack_between else 0)).backward()
    expected = x.grad.clone()
    off = offloader("cpu")
    outcomes = {"raised": 0, "exact": 0}
    for _ in range(50):
        x.grad = None
        try:
            with off:
                y, z = _race_forward(x, pack_between)
                y.add_(1)
                loss = y.sum() + (z.sum() if pack_between else 0)
            loss.backward()
        except tiermem.TierMemError:
            outcomes["raised"] += 1
            continue
        assert torch.equal(x.grad, expected), "wrong gradient from a torn or modified copy"
        outcomes["exact"] += 1
    assert outcomes["raised"] + outcomes["exact"] == 50
    assert off.stats.count_by_tier["cpu"] > 0


def test_inplace_after_copy_landed_gives_pack_time_gradient():
    """A copied tensor holds its pack-time values: once the copy landed, later
    in-place writes to the original do not change the gradient."""
    x = torch.randn(4096, requires_grad=True)
    expected = x.detach().exp()
    off = offloader("cpu")
    with off:
        y = x.exp()
    off.close()           # waits for the copy to land
    y.add_(1)
    y.sum().backward()
    assert torch.equal(x.grad, expected)


# ---------------------------------------------------------------------------
# Stats, environment, budgets, pools, TensorInfo
# ---------------------------------------------------------------------------

def test_stats_fields_and_one_line_summary():
    case = make_case("block")
    off = offloader("cpu")
    with off as ctx:
        loss = case.loss()
    land_moves(off)   # backward restores from host memory: the prefetch counts are not 0
    loss.backward()
    s = off.stats
    assert ctx.stats is s
    tiers = {t.value for t in tiermem.Tier}
    assert set(s.bytes_by_tier) == tiers and set(s.count_by_tier) == tiers
    assert s.count_by_tier["cpu"] > 0 and s.bytes_by_tier["cpu"] > 0
    assert isinstance(s.dedup_hits, int) and s.dedup_hits >= 0
    assert isinstance(s.stall_seconds, float) and s.stall_seconds >= 0.0
    assert s.peak_host_bytes > 0
    assert s.prefetch_hits + s.prefetch_misses > 0
    text = str(s)
    assert "\n" not in text and text.startswith("tiermem")
    assert f"cpu {s.count_by_tier['cpu']}" in text
    json.dumps(s.as_dict())


def test_disable_env_makes_offloader_a_noop(monkeypatch):
    monkeypatch.setenv("TIERMEM_DISABLE", "1")
    case = make_case("block")
    ref = run_step(make_case("block").model, case.inputs, contextlib.nullcontext(), seed=7,
                   loss_fn=case.loss_fn)
    off = offloader("cpu")
    got = run_step(case.model, case.inputs, off, seed=7, loss_fn=case.loss_fn)
    assert torch.equal(got[0], ref[0])
    assert_same_tensors(got[1], ref[1], "disabled")
    s = off.stats
    assert sum(s.count_by_tier.values()) == 0 and sum(s.bytes_by_tier.values()) == 0
    assert s.dedup_hits == 0 and s.param_count == 0 and s.small_count == 0
    assert off.host_bytes_in_use == 0
    # No hooks at all: the in-place error is autograd's own, not tiermem's.
    x = torch.randn(100, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        with off:
            y = x.exp()
            y.add_(1)
        y.sum().backward()
    assert not isinstance(info.value, tiermem.TierMemError)


def test_cpu_budget_falls_back_to_device_with_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="tiermem")
    budget = 12 * 1024
    off = tiermem.Offloader(policy="cpu", cpu_budget=budget, min_offload_bytes=0)
    ref = reference_steps("mlp")
    case = make_case("mlp")
    in_use_after_forward = []
    step_stats = []

    def ctx():
        if step_stats:
            step_stats[-1] = off.stats
        step_stats.append(None)
        return _Probe(off, in_use_after_forward)

    records = train_steps(case, ctx)
    step_stats[-1] = off.stats
    for (l, g, p), (rl, rg, rp) in zip(records, ref):
        assert torch.equal(l, rl)
        assert_same_tensors(g, rg, "budget grads")
        assert_same_tensors(p, rp, "budget params")
    for s in step_stats:
        assert s.budget_fallbacks > 0
        assert s.count_by_tier["cpu"] > 0, "some tensors fit the budget"
        assert s.count_by_tier["keep"] >= s.budget_fallbacks
        assert s.peak_host_bytes <= budget
    assert max(in_use_after_forward) <= budget
    warnings = [r for r in caplog.records
                if r.name == "tiermem" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "cpu" in warnings[0].getMessage()


class _Probe:
    """Wraps an Offloader; records host bytes in use when the forward ends."""

    def __init__(self, off, sink):
        self.off, self.sink = off, sink

    def __enter__(self):
        return self.off.__enter__()

    def __exit__(self, *exc):
        self.sink.append(self.off.host_bytes_in_use)
        return self.off.__exit__(*exc)


def _host_pool(off):
    return tiermem.testing.store_of(off, tiermem.Tier.CPU).pool


def test_pooled_host_buffers_are_reused_across_steps():
    case = make_case("block")
    off = offloader("cpu")
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    allocations = []
    for step in range(5):
        run_step(case.model, case.inputs, off, seed=step, loss_fn=case.loss_fn)
        opt.step()
        allocations.append(_host_pool(off).allocations)
    assert allocations[0] > 0
    assert allocations[1:] == [allocations[0]] * 4, allocations


def test_pooled_host_buffers_are_reused_when_copies_land_after_backward():
    """The deterministic form of the test above under load: every copy lands
    late, after backward took the originals, so the last step's copies still
    run when the next step starts. That step waits for them and reuses their
    buffers (NOTE [Buffers of earlier steps] in memory/hostpool.py); it allocated new
    ones before, and the pool grew with the load."""
    case = make_case("mlp")
    off = offloader("cpu")
    allocations = []
    with tiermem.testing.slow_copies(0.05):
        for step in range(4):
            run_step(case.model, case.inputs, off, seed=step, loss_fn=case.loss_fn)
            allocations.append(_host_pool(off).allocations)
    assert allocations[0] > 0
    assert allocations[1:] == [allocations[0]] * 3, allocations
    assert _host_pool(off).earlier_waits > 0   # the copies did land late
    off.close()


def test_tensor_info_module_names_and_index():
    recorded = []

    def policy(info):
        recorded.append(info)
        return "cpu"

    off = offloader(policy)
    case = make_case("mlp")
    for step in range(2):
        recorded.clear()
        run_step(case.model, case.inputs, off, seed=step, loss_fn=case.loss_fn)
        # Linear 0 (input), GELU (input), Linear 2 (input), Tanh (output; Linear 4
        # saves the same tensor: a dedup hit), then the loss's square() outside
        # any module.
        assert [i.module for i in recorded] == ["MLP.0", "MLP.1", "MLP.2", "MLP.3", ""]
        assert [i.index for i in recorded] == list(range(5))
        assert off.stats.dedup_hits == 1
        for i in recorded:
            assert not i.is_param
            assert i.device == torch.device("cpu") and i.dtype == torch.float32
            assert i.nbytes == i.shape.numel() * 4

    recorded.clear()
    off = offloader(policy)
    case = make_case("block")
    run_step(case.model, case.inputs, off, seed=0, loss_fn=case.loss_fn)
    modules = [i.module for i in recorded]
    assert [i.index for i in recorded] == list(range(len(recorded)))
    assert {"Block.ln1", "Block.attn.qkv", "Block.attn", "Block.attn.proj", "Block.drop",
            "Block.ln2", "Block.mlp.0", "Block.mlp.1", "Block.mlp.2"} <= set(modules)
    assert all(m == "" or m == "Block" or m.startswith("Block.") for m in modules)
    assert not any(i.is_param for i in recorded)


@pytest.mark.parametrize("min_bytes", [0, 64 * 1024])
def test_small_parameters_are_counted_as_parameters_not_activations(min_bytes):
    lin = nn.Linear(4, 4)
    x = torch.randn(4, 4, requires_grad=True)
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=min_bytes)
    with off:
        lin(x * 2).sum().backward()
    assert off.stats.param_count == 1                      # weight.t()
    assert sum(off.stats.count_by_tier.values()) == 1      # x * 2 only


def test_tensor_saved_by_two_ops_is_restored_once_per_backward():
    torch.manual_seed(0)
    layers = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())])
    x = torch.randn(32, 64)
    ref = run_step(layers, [x], contextlib.nullcontext())
    off = offloader("cpu")
    for _ in range(2):
        layers.zero_grad(set_to_none=True)
        with off:
            loss = layers(x).square().mean()
        tiermem.testing.store_of(off, tiermem.Tier.CPU).drain()   # every tensor restored from host memory
        loss.backward()
        assert torch.equal(loss, ref[0])
        assert_same_tensors({n: p.grad for n, p in layers.named_parameters()}, ref[1], "grads")
        s = off.stats
        assert s.dedup_hits >= 3   # each tanh output: saved by TanhBackward and the next Linear
        assert s.prefetch_hits + s.prefetch_misses == s.count_by_tier["cpu"]


def test_retain_graph_second_backward_restores_again_and_matches():
    torch.manual_seed(0)
    layers = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 64), nn.Tanh())])
    x = torch.randn(32, 64)
    off = offloader("cpu")
    with off:
        loss = layers(x).square().mean()
    tiermem.testing.store_of(off, tiermem.Tier.CPU).drain()
    g1 = torch.autograd.grad(loss, list(layers.parameters()), retain_graph=True)
    first = off.stats.prefetch_hits + off.stats.prefetch_misses
    g2 = torch.autograd.grad(loss, list(layers.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert off.stats.prefetch_hits + off.stats.prefetch_misses == 2 * first
