"""The recompute tier: exact gradients, memory really freed, chains, views,
random ops, in-place safety, fallbacks, and what a policy sees (info.op)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import tiermem
import tiermem.testing
from helpers import (assert_same_tensors, compare_records, expect_compact, reference_steps,
                     train_steps)
from models import SaveIt, make_case

STEPS = 3


def _cheap_then_cpu(info: tiermem.TensorInfo):
    """A callable policy: recompute what a cheap op made, move the rest to cpu."""
    if info.op in ("gelu", "tanh", "native_layer_norm", "_softmax", "_safe_softmax"):
        return ["recompute", "cpu"]
    return "cpu"


# The named policies (recompute, recompute,cpu) over every model: the core
# matrix in test_gradients.py. Here: a callable answering by the producer op.
def test_callable_policy_by_op_bit_identical_over_adamw_steps(model_case, make_off):
    name = model_case.name
    ref = reference_steps(name, STEPS)
    off = make_off(_cheap_then_cpu)
    records = train_steps(model_case, lambda: off, STEPS)
    compare_records(records, ref, f"{name}/callable")
    s = off.stats
    assert s.count_by_tier["cpu"] > 0
    if name in ("mlp", "block", "mlp_bf16", "block_bf16"):
        # GELU/tanh/LayerNorm outputs have their inputs saved anyway: dropped.
        assert s.count_by_tier["recompute"] > 0, s
        assert s.recompute_count > 0, s
        assert s.recompute_seconds > 0
    off.close()
    assert off.host_bytes_in_use == 0


def test_recompute_with_nvme_next(make_off):
    ref = reference_steps("block", STEPS)
    off = make_off("recompute,nvme")
    records = train_steps(make_case("block"), lambda: off, STEPS)
    compare_records(records, ref, "block/recompute,nvme")
    assert off.stats.count_by_tier["recompute"] > 0 and off.stats.count_by_tier["nvme"] > 0
    off.close()


# ---------------------------------------------------------------------------
# Chains, views, random ops
# ---------------------------------------------------------------------------

class Chain(nn.Module):
    """tanh saves its output u; v = u * 3 + 1 and its view are saved by nobody
    until lin2 saves the view: a chain of three recomputable ops on u."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x):
        u = torch.tanh(self.lin1(x))
        w = (u * 3.0 + 1.0).view(-1, 64)
        return self.lin2(w)


def _grads(model, x, off=None, seed=5):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if off is None:
        loss = model(x).square().mean()
    else:
        with off:
            loss = model(x).square().mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_chain_of_recomputed_ops_is_exact():
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(8, 4, 16)
    ref = _grads(model, x)
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    got = _grads(model, x, off)
    assert_same_tensors(got, ref, "chain")
    # lin2's input (a view of u*3+1) was rebuilt from u through mul, add, view.
    assert off.stats.count_by_tier["recompute"] >= 1
    assert off.stats.recompute_input_bytes == 0, "u is saved by tanh anyway"


@pytest.mark.parametrize("view", ["t", "slice", "expand", "select"])
def test_views_of_recomputed_tensors_keep_layout(view):
    """A saved view of a recomputed tensor comes back with the same sizes,
    strides, storage offset alignment and values."""
    torch.manual_seed(0)
    h = torch.randn(12, 10, requires_grad=True)
    w = torch.ones(3, requires_grad=True)
    make = {"t": lambda g: g.t(), "slice": lambda g: g[2:9, 1::2],
            "expand": lambda g: g[:1].expand(5, 10), "select": lambda g: g[3]}[view]
    sink = []
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    with off:
        g = F.gelu(h)            # gelu saves h: g is free to recompute
        saved = make(g)
        expected = saved.detach().clone()
        meta = (saved.size(), saved.stride(), saved.storage_offset())
        out = SaveIt.apply(saved, w, sink)
    del g, saved
    out.sum().backward()
    (back,) = sink
    assert off.stats.count_by_tier["recompute"] >= 1
    assert (back.size(), back.stride(), back.storage_offset()) == meta
    assert torch.equal(back, expected)


def test_random_op_replays_generator_state_exactly():
    """native_dropout on a recomputable input: regenerated bit-exactly from the
    captured generator state, and the global RNG stream is not disturbed."""
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin1, self.lin2 = nn.Linear(16, 64), nn.Linear(64, 4)

        def forward(self, x):
            g = F.gelu(self.lin1(x))
            d, _ = torch.native_dropout(g, 0.3, True)
            return self.lin2(d)

    torch.manual_seed(0)
    model = Drop()
    x = torch.randn(32, 16)
    ref = _grads(model, x)
    after_ref = torch.rand(3)
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    got = _grads(model, x, off)
    after = torch.rand(3)
    assert_same_tensors(got, ref, "dropout")
    assert torch.equal(after, after_ref), "recompute must not move the RNG stream"
    assert off.stats.recompute_count >= 1


def test_rand_like_mask_is_reproduced():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 32), nn.Linear(32, 2)

    def step(off):
        for p in (*lin1.parameters(), *lin2.parameters()):
            p.grad = None
        torch.manual_seed(3)
        with off if off is not None else torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t):
            g = torch.sigmoid(lin1(torch.randn(16, 8)))
            y = lin2(g * (torch.rand_like(g) > 0.5))
        y.sum().backward()
        return lin1.weight.grad.clone(), lin2.weight.grad.clone()

    ref = step(None)
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    got = step(off)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert off.stats.count_by_tier["recompute"] >= 1


# ---------------------------------------------------------------------------
# Memory is really freed (measured as storages alive, not from stats)
# ---------------------------------------------------------------------------

class _Census(TorchDispatchMode):
    """Weak references to the storage of every tensor an op makes."""

    def __init__(self, *before):
        super().__init__()
        self.storages = {}
        #: Storages made before the census (inputs, parameters): an alias of
        #: one (a pack hook's ``detach``) is not a new tensor.
        self.before = {t.untyped_storage().data_ptr() for t in before}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and o.layout == torch.strided:
                s = o.untyped_storage()
                if s.data_ptr() not in self.before:
                    self.storages.setdefault(s.data_ptr(), (StorageWeakRef(s), s.nbytes()))
        return out

    def live_bytes(self):
        gc.collect()
        return sum(n for ref, n in self.storages.values() if not ref.expired())


class Wide(nn.Module):
    """Saves LayerNorm and GELU outputs (recomputable from saved inputs)."""

    def __init__(self, d=64, h=256):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.ln(x))))


def _bytes_held(policy):
    torch.manual_seed(0)
    model = Wide()
    x = torch.randn(64, 64, requires_grad=True)
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    census = _Census(x, *model.parameters())
    with off:
        with census:
            loss = model(x).sum()
    held = census.live_bytes() - loss.untyped_storage().nbytes()
    loss.backward()
    return held, off.stats


def test_recompute_frees_the_dropped_bytes():
    keep_held, _ = _bytes_held("keep")
    rec_held, stats = _bytes_held("recompute")
    dropped = stats.bytes_by_tier["recompute"]
    # LayerNorm output (64x64 fp32) and GELU output (64x256 fp32) at least.
    assert dropped >= (64 * 64 + 64 * 256) * 4
    assert stats.recompute_input_bytes == 0
    assert keep_held - rec_held >= dropped, (keep_held, rec_held, dropped)


# ---------------------------------------------------------------------------
# In-place safety, fallbacks, stats, what a policy sees
# ---------------------------------------------------------------------------

def test_inplace_after_save_raises_like_autograd():
    lin = nn.Linear(8, 8)
    h = torch.randn(4, 8, requires_grad=True)
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    with off:
        g = F.gelu(h)
        y = lin(g)
        g.add_(1)       # g was saved by lin: autograd raises at backward
    assert off.stats.count_by_tier["recompute"] >= 1
    with pytest.raises(tiermem.TierMemError, match="in-place"):
        y.sum().backward()
    # Without tiermem autograd raises too (the behaviour we keep).
    g2 = F.gelu(h)
    y2 = lin(g2)
    g2.add_(1)
    with pytest.raises(RuntimeError, match="inplace"):
        y2.sum().backward()


def test_inplace_on_an_input_only_the_recipe_needs_is_not_an_error():
    """x is not saved by autograd, so the program may modify it after the cast;
    the recipe holds its own copy: gradients stay exact."""
    lin = nn.Linear(16, 4)
    base = torch.randn(64, 16, requires_grad=True)
    proj = torch.randn(16, 16)

    def step(off):
        lin.zero_grad(set_to_none=True)
        base.grad = None
        with off:
            x = (base @ proj).to(torch.bfloat16)   # not saved by anyone; mm: not cheap
            y = lin(x.float())                   # saves x.float(): 2x the bytes of x
            x.mul_(3)
        y.square().sum().backward()
        return lin.weight.grad.clone(), base.grad.clone()

    ref = step(tiermem.Offloader(policy="keep"))
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    got = step(off)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert off.stats.count_by_tier["recompute"] >= 1
    assert off.stats.recompute_input_bytes == 64 * 16 * 2   # the bf16 input, half the size


def test_not_eligible_tensors_fall_back_and_are_counted():
    lin1, lin2 = nn.Linear(8, 32), nn.Linear(32, 4)
    x = torch.randn(16, 8, requires_grad=True)
    off = tiermem.Offloader(policy="recompute,cpu", min_offload_bytes=0)
    with off:
        y = lin2(lin1(x))          # lin2 saves lin1's output: made by addmm, not cheap
    y.sum().backward()
    s = off.stats
    assert s.recompute_fallbacks >= 1
    assert any("not recomputable" in r for r in s.recompute_fallback_reasons), s.recompute_fallback_reasons
    assert s.count_by_tier["cpu"] >= 1
    assert sum(s.recompute_fallback_reasons.values()) == s.recompute_fallbacks


def test_policy_sees_producer_ops_through_views():
    seen = []

    def policy(info):
        seen.append((info.op, tuple(info.shape)))
        return "keep"

    torch.manual_seed(0)
    model = Wide()
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    with off:
        model(torch.randn(8, 64, requires_grad=True)).sum()
    ops = [op for op, _ in seen]
    assert "native_layer_norm" in ops   # fc1's input: the LayerNorm output
    assert "gelu" in ops                # fc2's input
    assert "addmm" in ops               # gelu's input: fc1's output


def test_retain_graph_second_backward_recomputes_again():
    torch.manual_seed(0)
    model = Wide()
    x = torch.randn(16, 64, requires_grad=True)
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    with off:
        loss = model(x).sum()
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    n1 = off.stats.recompute_count
    model.zero_grad(set_to_none=True)
    loss.backward()
    second = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_same_tensors(first, second, "second backward")
    assert off.stats.recompute_count == 2 * n1 > 0


def test_create_graph_double_backward_is_exact():
    torch.manual_seed(0)
    model = Wide(16, 32)
    x = torch.randn(8, 16, requires_grad=True)

    def penalty(off):
        model.zero_grad(set_to_none=True)
        with off:
            out = model(x).square().sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        gx.square().sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = penalty(tiermem.Offloader(policy="keep"))
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    assert_same_tensors(penalty(off), ref, "double backward")
    assert off.stats.recompute_count > 0


def test_forward_exception_leaves_nothing_behind():
    model = Wide()
    off = tiermem.Offloader(policy="recompute,cpu", min_offload_bytes=0)
    with pytest.raises(ValueError):
        with off:
            model(torch.randn(4, 64, requires_grad=True))
            raise ValueError("boom")
    # The dispatch mode is gone: ops after the context are not recorded.
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    assert _get_current_dispatch_mode() is None
    gc.collect()
    off.close()
    assert off.host_bytes_in_use == 0


def test_fixed_non_recompute_policies_do_not_track_ops():
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    with tiermem.Offloader(policy="cpu") as ctx:
        assert ctx.producers is None and _get_current_dispatch_mode() is None
    with tiermem.Offloader(policy="recompute") as ctx:
        assert ctx.producers is not None and _get_current_dispatch_mode() is ctx.producers


def test_autocast_casts_are_recomputed_exactly():
    """Under CPU autocast, the bf16 casts feeding matmuls are saved; they are
    recomputable from the fp32 tensors saved anyway, and gradients stay exact."""
    def step(off):
        torch.manual_seed(0)
        model = Wide(32, 64)
        x = torch.randn(16, 32, requires_grad=True)
        with off, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, off.stats

    ref, _ = step(tiermem.Offloader(policy="keep"))
    got, stats = step(tiermem.Offloader(policy="recompute", min_offload_bytes=0))
    assert_same_tensors(got, ref, "autocast")
    assert stats.count_by_tier["recompute"] > 0


def test_layernorm_softmax_gelu_chain_through_recomputed_handles():
    """gelu -> layer_norm -> softmax: each output is recomputable from the one
    before, which is itself dropped (recipes whose inputs are recompute handles)."""
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin1, self.ln, self.lin2 = nn.Linear(16, 48), nn.LayerNorm(48), nn.Linear(48, 4)

        def forward(self, x):
            return self.lin2(torch.softmax(self.ln(F.gelu(self.lin1(x))), dim=-1))

    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(32, 16)
    ref = _grads(model, x)
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    got = _grads(model, x, off)
    assert_same_tensors(got, ref, "gelu/layer_norm/softmax")
    s = off.stats
    # gelu output (saved by layer_norm), softmax output (saved by softmax and lin2)
    assert s.count_by_tier["recompute"] >= 2, s
    assert s.recompute_input_bytes == 0


# ---------------------------------------------------------------------------
# Regressions found in review: aliasing and layout of recipe inputs
# ---------------------------------------------------------------------------

def _same_as_plain(fn, policy, **settings):
    """Run ``fn(ctx)`` plainly and under an Offloader; gradients must match."""
    import contextlib
    torch.manual_seed(0)
    ref = fn(contextlib.nullcontext())
    off = tiermem.Offloader(policy=policy, **settings)
    torch.manual_seed(0)
    got = fn(off)
    assert_same_tensors(got, ref, f"policy {policy}")
    return off.stats


@pytest.mark.parametrize("policy", ["cpu", "recompute", None])
def test_conj_view_is_not_deduplicated_with_its_base(policy):
    a = torch.randn(32, 32, dtype=torch.complex64, requires_grad=True)
    b = torch.randn(32, 32, dtype=torch.complex64, requires_grad=True)
    m = torch.randn(32, 32, dtype=torch.complex64)

    def fn(ctx):
        a.grad = b.grad = None
        with ctx:
            c = m @ m
            out = ((a * c).abs() + (b * c.conj()).abs()).sum()   # c and c.conj() saved
        out.backward()
        return {"a": a.grad.clone(), "b": b.grad.clone()}

    stats = _same_as_plain(fn, policy, min_offload_bytes=0)
    # Four tensors saved, four stored (or dropped): c, c.conj() (same storage,
    # sizes and strides; only the conjugate bit differs) and the two products
    # abs() saves. Deduplicating the view with its base would make it a hit and
    # leave three.
    assert stats.dedup_hits == 0, stats
    assert sum(stats.count_by_tier.values()) == 4, stats


def test_as_strided_is_named_but_never_replayed():
    a = torch.randn(64, requires_grad=True)
    w = torch.randn(4000, 8, requires_grad=True)

    def fn(ctx):
        a.grad = w.grad = None
        with ctx:
            s = a.exp()[2:12]                          # a small view at offset 2
            y = s.as_strided((4000, 8), (0, 1), 2)     # absolute offset
            out = (y * w).sum()
            del s, y
        out.backward()
        return {"a": a.grad.clone(), "w": w.grad.clone()}

    stats = _same_as_plain(fn, "recompute")
    assert stats.count_by_tier["recompute"] == 0


def test_small_gapped_input_of_an_expand_keeps_its_strides():
    a = torch.randn(64, requires_grad=True)
    w = torch.randn(4000, 16, requires_grad=True)

    def fn(ctx):
        a.grad = w.grad = None
        with ctx:
            x = a.exp()
            y = x[::4].expand(4000, 16)     # small, strided input; stride-0 output
            out = (y * w).sum()
            del x, y
        out.backward()
        return {"a": a.grad.clone(), "w": w.grad.clone()}

    stats = _same_as_plain(fn, "recompute", min_offload_bytes=1024)
    assert stats.count_by_tier["recompute"] == 1


def test_views_of_a_compactly_moved_input_are_not_recomputed_from_it():
    torch.manual_seed(0)
    a = torch.randn(64, 64, requires_grad=True)
    b = torch.randn(64, 64)
    w1 = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(64, 50, 16, requires_grad=True)
    gapped = []

    def fn(ctx):
        a.grad = w.grad = w1.grad = None
        with ctx:
            s = (a @ b)[:, ::4]                    # gapped: the cpu tier moves a dense copy
            gapped.append(expect_compact(s))
            z = (s * w1).sum()
            y = s[:, None, :].expand(64, 50, 16)
            out = (y * w).sum() + z
            del s, y
        out.backward()
        return {"a": a.grad.clone(), "w": w.grad.clone(), "w1": w1.grad.clone()}

    stats = _same_as_plain(fn, "recompute,cpu", min_offload_bytes=0)
    assert gapped == [True, True], "s must be moved as a dense copy for this test"
    # y (a view of s, made by view ops the tier could replay) is not dropped:
    # replayed on the dense copy of s it would get other strides. Nothing is
    # recomputed; b, s and y all went to the next choice, cpu.
    assert stats.count_by_tier["recompute"] == 0 and stats.recompute_count == 0, stats
    assert stats.count_by_tier["cpu"] == 3 and stats.recompute_fallbacks == 3, stats


def test_buffer_updated_in_place_after_use_is_not_an_error():
    class RunNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)
            self.register_buffer("mean", torch.zeros(64))

        def forward(self, x):
            h = (x - self.mean).tanh()
            self.mean.lerp_(x.detach().mean(0), 0.1)   # running statistics
            return self.lin(h)

    torch.manual_seed(0)
    m = RunNorm()
    x = torch.randn(32, 64, requires_grad=True)

    def fn(ctx):
        m.zero_grad()
        x.grad = None
        m.mean.zero_()
        with ctx:
            out = m(x).square().sum()
        out.backward()
        return {"x": x.grad.clone(), "w": m.lin.weight.grad.clone()}

    _same_as_plain(fn, "recompute", min_offload_bytes=0)


@pytest.mark.parametrize("policy", ["recompute", "recompute,cpu"])
def test_recipe_only_input_modified_right_after_is_exact(policy):
    lin = nn.Linear(16, 4)
    base = torch.randn(64, 16, requires_grad=True)
    proj = torch.randn(16, 16)

    def fn(ctx):
        lin.zero_grad(set_to_none=True)
        base.grad = None
        with ctx:
            x = (base @ proj).to(torch.bfloat16)
            y = lin(x.float())
            x.mul_(3)                  # before any copy of x could land
        y.square().sum().backward()
        return {"w": lin.weight.grad.clone(), "base": base.grad.clone()}

    stats = _same_as_plain(fn, policy, min_offload_bytes=0)
    assert stats.count_by_tier["recompute"] >= 1


def test_inference_tensors_sparse_and_subclasses_under_tracking():
    lin = nn.Linear(8, 8)
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    with off, torch.inference_mode():
        lin(torch.randn(4, 8)).relu()                      # an eval pass inside
    with torch.inference_mode():
        const = torch.randn(4, 8)
    x = torch.randn(4, 8, requires_grad=True)
    sp = torch.randn(4, 8).to_sparse()
    with off:
        y = (x + const).tanh() + (sp * 2.0).to_dense() * x
    y.sum().backward()
    assert x.grad is not None


def test_default_policy_does_not_track_producers():
    with tiermem.Offloader() as ctx:
        assert ctx.producers is None
    with tiermem.Offloader(policy=lambda info: "keep") as ctx:
        assert ctx.producers is not None      # a callable may read info.op


def test_write_to_a_dropped_tensor_no_longer_referenced_still_raises():
    """The saved tensor is modified in place and then let go of before
    backward: autograd raises; so does the recompute tier (the mode saw the
    write: NOTE [Writes to dropped tensors])."""
    a = torch.randn(64, 64, requires_grad=True)
    lin = nn.Linear(64, 64)
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    with off:
        y = a.tanh() * 2
        z = lin(y)            # saves y, dropped (recomputable)
        y.add_(1)
        out = (z + y).sum()
        del y
    assert off.stats.count_by_tier["recompute"] >= 1
    with pytest.raises(tiermem.TierMemError, match="in-place"):
        out.backward()


def test_writes_to_other_storages_do_not_taint():
    torch.manual_seed(0)
    model = Wide()
    x = torch.randn(16, 64, requires_grad=True)

    def fn(ctx):
        model.zero_grad(set_to_none=True)
        x.grad = None
        with ctx:
            out = model(x)
            buf = torch.zeros_like(out)
            buf.add_(1)                     # in-place writes elsewhere
            loss = (out * buf).sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    stats = _same_as_plain(fn, "recompute", min_offload_bytes=0)
    assert stats.count_by_tier["recompute"] > 0


class LlamaMLPBlock(nn.Module):
    """RMSNorm written out as Hugging Face's LLaMA does (pow/mean/rsqrt/mul and
    casts) followed by a SwiGLU MLP: the pattern of today's LLMs."""

    def __init__(self, d=64, h=172):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.gate, self.up, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)

    def norm(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + 1e-6)
        return self.weight * x.to(dtype)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_style_rmsnorm_and_swiglu_recomputed_exactly(dtype):
    torch.manual_seed(0)
    model = LlamaMLPBlock().to(dtype)
    x = torch.randn(8, 32, 64, dtype=dtype, requires_grad=True)

    def fn(ctx):
        model.zero_grad(set_to_none=True)
        x.grad = None
        with ctx:
            out = model(model(x)).float().square().mean()
        out.backward()
        return {**{n: p.grad.clone() for n, p in model.named_parameters()}, "x": x.grad.clone()}

    stats = _same_as_plain(fn, "recompute,cpu", min_offload_bytes=0)
    # The RMSNorm output, its casts, silu(gate) and the SwiGLU product are dropped.
    assert stats.count_by_tier["recompute"] >= 6, stats
    # In bf16 the fp32 upcast of the second block's input is dropped by
    # storing its bf16 input (half the bytes): stored < dropped.
    assert stats.recompute_input_bytes < stats.bytes_by_tier["recompute"] / 4


def test_callable_policy_sees_only_the_tensors_autograd_saves():
    """Private inputs of recipes are stored where the planned tensor's later
    choices say; the policy is not asked about them, so ``info.index`` counts
    saved tensors only, as with any other policy."""
    torch.manual_seed(0)
    base, proj = torch.randn(64, 8, requires_grad=True), torch.randn(8, 16)
    lin = nn.Linear(16, 4)

    def run(answer):
        seen = []

        def policy(info):
            seen.append(info.index)
            return answer
        off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
        with off:
            x = (base @ proj).to(torch.bfloat16)   # saved by no one: a private input
            y = lin(x.float())                    # saves x.float(), recomputed from x
        y.square().sum().backward()
        return seen, off.stats
    plain, _ = run("keep")
    seen, stats = run(["recompute", "cpu"])
    assert stats.count_by_tier["recompute"] >= 1
    assert stats.recompute_input_bytes == 64 * 16 * 2          # x, stored in cpu
    assert stats.bytes_by_tier["cpu"] >= 64 * 16 * 2
    assert seen == plain == list(range(len(plain)))


@pytest.mark.parametrize("policy", ["recompute", "recompute,cpu"])
def test_a_long_chain_of_recomputable_ops_is_exact_and_bounded(policy):
    """``y = y.sin()`` 300 times: each op saves its input, so every recipe would
    read the previous dropped tensor; backward used to recurse through the
    whole chain (RecursionError near 150). One tensor in MAX_RECIPE_DEPTH + 1
    is not recomputed (NOTE [Depth of recipe chains]); gradients stay exact."""
    from tiermem.tiers.recompute import MAX_RECIPE_DEPTH
    n = 300
    x = torch.randn(64, requires_grad=True)

    def run(ctx):
        with ctx:
            y = x * 1
            for _ in range(n):
                y = y.sin()
        (g,) = torch.autograd.grad(y.sum(), x)
        return g

    ref = run(contextlib.nullcontext())
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    got = run(off)
    assert torch.equal(got, ref)
    s = off.stats
    chained = s.recompute_fallback_reasons
    deep = sum(v for k, v in chained.items() if k.startswith("chain too deep"))
    assert deep == n // (MAX_RECIPE_DEPTH + 1), chained
    assert s.count_by_tier["recompute"] >= n - deep - 1
    off.close()


class _FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


class _FakeEvent:
    def __init__(self):
        self.on = None

    def record(self, stream):
        self.on = stream


class _FakeCudaTensor:
    """What ``_Cached`` reads of a CUDA tensor: ``is_cuda``, ``device`` and
    ``record_stream``."""
    is_cuda = True
    device = "cuda:0"

    def __init__(self):
        self.recorded_on = []

    def record_stream(self, stream):
        self.recorded_on.append(stream)


def test_a_kept_regenerated_tensor_is_ordered_for_a_consumer_on_another_stream(monkeypatch):
    """NOTE [Recomputed for consumers on several streams] in
    tiermem/tiers/recompute.py, its stream logic with fake CUDA objects (the
    real race is tests/test_gpu.py's
    test_a_recomputed_tensor_read_on_two_streams_is_ordered_after_its_recipe):
    an event is recorded after the recipe on the stream that ran it; a consumer
    on that stream takes the tensor as is, one on another stream waits for the
    event and records the tensor on its stream; a CPU tensor needs neither."""
    side, default = _FakeStream("side"), _FakeStream("default")
    current = [side]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    out = _FakeCudaTensor()
    kept = tiermem.testing.kept_recomputed(out)
    assert kept.event.on is side
    assert kept.for_current_stream() is out
    assert side.waited == [] and out.recorded_on == []
    current[0] = default
    assert kept.for_current_stream() is out
    assert default.waited == [kept.event] and out.recorded_on == [default]
    cpu = tiermem.testing.kept_recomputed(torch.ones(2))
    assert cpu.event is None and cpu.for_current_stream() is cpu.out
