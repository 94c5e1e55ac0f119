"""The tail hold (NOTE [Tail hold] in tiermem/runtime/tailhold.py): under fixed and
callable policies the sources of the last moved tensors, up to
``tail_hold_bytes``, stay held, and backward's first unpacks take them
without a read. Counted from the step's stats (restores read on demand are
``prefetch_misses``), never from wall time.

conftest pins ``TIERMEM_TAIL_HOLD_BYTES=0`` for the rest of the suite; the
tests here pass ``tail_hold_bytes`` or clear the variable (the default).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

import tiermem
import tiermem.testing
from tiermem.models import GPTConfig, TinyGPT
from tiermem.runtime.tailhold import TailHold

from helpers import compare_records, land_moves, offloader, reference_steps, train_steps
from models import MODEL_NAMES, make_case

KiB, MiB = 1 << 10, 1 << 20
GPT = GPTConfig(vocab=512, layers=2, width=64, heads=4, seq_len=64, dropout=0.1)
BATCH = 4
#: The log-softmax output of the GPT's loss: batch x seq x vocab float32.
LOGPROBS_BYTES = BATCH * GPT.seq_len * GPT.vocab * 4
#: Policies that move the loss's tensors: its log-softmax output (nvme,
#: cpu) or the logits its recipe needs (recompute,*).
POLICIES = ("nvme", "cpu", "recompute,nvme", "recompute,cpu")


@pytest.fixture
def default_hold(monkeypatch):
    """The setting unset: the default bound (the prefetch window)."""
    monkeypatch.delenv("TIERMEM_TAIL_HOLD_BYTES")


def _gpt():
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    tokens = torch.randint(0, GPT.vocab, (BATCH, GPT.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    return model, tokens


def _gpt_step(model, tokens, ctx, land=None, seed=3):
    """Forward (the cross-entropy loss inside ``ctx``), ``land(ctx)`` if given,
    then backward; returns the loss and the gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with ctx:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    if land is not None:
        land()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _off(policy, nvme_dir, **settings):
    """An Offloader for the GPT: tensors under 64 KiB kept (the default), so
    that the loss's first unpack is its log-softmax output (or the logits),
    not its small target."""
    settings.setdefault("min_offload_bytes", 64 * KiB)
    return offloader(policy, nvme_dir=nvme_dir if "nvme" in policy else None, **settings)


# -- backward's first unpack ----------------------------------------------------------

@pytest.mark.parametrize("policy", ("nvme", "recompute,nvme"))
def test_the_losss_first_unpack_is_not_read_on_demand(policy, nvme_dir):
    # Every move landed before backward (the sources dropped as soon as they
    # could be): without the hold the first unpack (the log-softmax output,
    # or the logits its recipe needs) is read on demand; with it, no unpack is.
    model, tokens = _gpt()
    ref = _gpt_step(model, tokens, contextlib.nullcontext())
    for hold in (2 * LOGPROBS_BYTES, 0):
        off = _off(policy, nvme_dir + str(hold), tail_hold_bytes=hold)
        got = _gpt_step(model, tokens, off, land=lambda: land_moves(off))
        s = off.stats
        assert _same(got, ref), (policy, hold)
        if hold:
            assert s.prefetch_misses == 0, s
            assert s.tail_hits >= 1 and s.prefetch_hits > 0, s   # held, and restored ones
            assert 0 < s.peak_tail_hold_bytes <= hold
            assert f"tail hold {s.tail_hits} taken" in str(s)
        else:
            assert s.prefetch_misses == 1 and s.tail_hits == 0, s
            assert s.peak_tail_hold_bytes == 0
        assert tiermem.testing.tail_held_bytes(off) == 0
        off.close()


def test_the_default_bound_is_the_prefetch_window(nvme_dir, default_hold):
    model, tokens = _gpt()
    ref = _gpt_step(model, tokens, contextlib.nullcontext())
    off = _off("nvme", nvme_dir)
    assert off.config.tail_hold_bytes is None
    with off as ctx:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    held = tiermem.testing.tail_held_bytes(off)
    land_moves(off)
    loss.backward()
    s = ctx.stats
    # The prefetcher sizes its window from the bytes moved (16 MiB at least):
    # every move of this small model is within it.
    assert ctx.prefetcher.budget_bytes == 16 * MiB
    assert 0 < s.peak_tail_hold_bytes <= ctx.prefetcher.budget_bytes
    assert held == s.peak_tail_hold_bytes
    assert s.prefetch_misses == 0 and s.tail_hits > 0
    assert [p.grad for p in model.parameters()][0] is not None
    off.close()
    # An explicit prefetch window bounds it too.
    off = _off("nvme", nvme_dir + "2", prefetch_bytes=LOGPROBS_BYTES + 64 * KiB)
    got = _gpt_step(model, tokens, off)
    assert _same(got, ref)
    assert 0 < off.stats.peak_tail_hold_bytes <= LOGPROBS_BYTES + 64 * KiB
    off.close()


def test_zero_restores_todays_behaviour(nvme_dir, default_hold):
    # tail_hold_bytes=0: no source held after landing; the first unpack reads.
    model, tokens = _gpt()
    off = _off("nvme", nvme_dir, tail_hold_bytes=0)
    calls = []
    original = TailHold.add
    TailHold.add = lambda self, *a: calls.append(a) or original(self, *a)
    try:
        _gpt_step(model, tokens, off, land=lambda: land_moves(off))
    finally:
        TailHold.add = original
    s = off.stats
    assert calls == [] and s.tail_hits == 0 and s.peak_tail_hold_bytes == 0
    assert s.prefetch_misses == 1
    off.close()


def test_a_bad_bound_is_a_config_error():
    with pytest.raises(tiermem.ConfigError, match="tail_hold_bytes"):
        tiermem.Offloader(policy="cpu", tail_hold_bytes=-1)
    with pytest.raises(tiermem.ConfigError, match="tail_hold_bytes"):
        tiermem.Offloader(policy="cpu", tail_hold_bytes="lots")


# -- exactness ------------------------------------------------------------------------

@pytest.mark.parametrize("hold", (64 * KiB, 16 * MiB))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_gradients_stay_exact(name, policy, hold, nvme_dir):
    # A bound that holds part of the moves, and one that holds every move.
    ref = reference_steps(name)
    case = make_case(name)
    off = _off(policy, nvme_dir, tail_hold_bytes=hold, min_offload_bytes=0)
    records = train_steps(case, lambda: off)
    compare_records(records, ref, f"{name}/{policy}/{hold}")
    assert off.stats.peak_tail_hold_bytes <= hold
    assert off.stats.tail_hits > 0, off.stats
    if hold == 16 * MiB:   # every move held: nothing restored, nothing counted as one
        assert off.stats.prefetched_bytes == 0 and off.stats.prefetch_hits == 0, off.stats
        assert off.stats.prefetch_misses == 0
    off.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_gpt_with_dropout_stays_exact_over_steps(policy, nvme_dir, default_hold):
    model, tokens = _gpt()
    model2, _ = _gpt()
    off = _off(policy, nvme_dir)
    opt, opt2 = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, model2))
    for i in range(3):
        got = _gpt_step(model, tokens, off, seed=10 + i)
        ref = _gpt_step(model2, tokens, contextlib.nullcontext(), seed=10 + i)
        assert _same(got, ref), (policy, i)
        assert off.stats.tail_hits > 0 and off.stats.prefetch_misses == 0, off.stats
        opt.step()
        opt2.step()
    off.close()


def test_a_callable_policy_holds_too(nvme_dir):
    model, tokens = _gpt()
    ref = _gpt_step(model, tokens, contextlib.nullcontext())
    off = offloader(lambda info: "nvme" if info.module.startswith("TinyGPT.blocks") else
                    "keep", nvme_dir=nvme_dir, tail_hold_bytes=256 * KiB)
    got = _gpt_step(model, tokens, off, land=lambda: land_moves(off))
    assert _same(got, ref)
    assert off.stats.tail_hits > 0 and off.stats.prefetch_misses == 0, off.stats
    off.close()


def test_a_held_tensor_saved_twice_is_taken_by_both_uses(nvme_dir):
    # x * x saves x twice (one handle, dedup): both uses take the held source.
    x = torch.randn(256, 256, requires_grad=True)
    w = torch.randn(256, 256)
    off = offloader("nvme", nvme_dir=nvme_dir, tail_hold_bytes=1 * MiB)
    with off:
        h = x @ w
        y = (h * h).sum()
    land_moves(off)
    y.backward()
    s = off.stats
    assert s.dedup_hits >= 1
    assert s.tail_hits >= 2 and s.prefetch_misses == 0, s
    x2 = x.detach().clone().requires_grad_()
    ((x2 @ w) * (x2 @ w)).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    off.close()


def test_a_held_source_written_in_place_gives_the_copys_values(nvme_dir):
    # Written after its move landed: the copy holds the pack-time values, as
    # without the hold (NOTE [Copy landed]); the source is not taken.
    results = []
    for hold in (0, 1 * MiB):
        x = torch.randn(128, 128, generator=torch.Generator().manual_seed(0),
                        requires_grad=True)
        off = offloader("nvme", nvme_dir=f"{nvme_dir}{hold}", tail_hold_bytes=hold)
        with off:
            h = x.exp()
            y = h.sin().sum()
        land_moves(off)
        with torch.no_grad():
            h.add_(1.0)
        y.backward()
        results.append((x.grad.clone(), off.stats.tail_hits))
        off.close()
    (g0, hits0), (g1, hits1) = results
    assert torch.equal(g0, g1)
    assert hits0 == 0 and hits1 == 0


# -- the bound -------------------------------------------------------------------------

def test_bytes_held_never_exceed_the_bound(nvme_dir, monkeypatch):
    hold = LOGPROBS_BYTES + 256 * KiB
    seen = []
    original = TailHold.add

    def add(self, handle, nbytes, limit):
        held = original(self, handle, nbytes, limit)
        seen.append((self.held_bytes(), limit, held))
        return held
    monkeypatch.setattr(TailHold, "add", add)
    model, tokens = _gpt()
    off = offloader("cpu", tail_hold_bytes=hold)
    with off:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert len(seen) == off.stats.count_by_tier["cpu"]
    assert all(b <= hold and limit == hold for b, limit, _ in seen), seen
    assert all(held for *_, held in seen[-3:])   # the loss's tensors are held
    # The step moved far more than the bound: most moves were pushed out.
    assert off.stats.bytes_by_tier["cpu"] > 4 * hold
    assert 0 < tiermem.testing.tail_held_bytes(off) <= hold
    loss.backward()
    assert tiermem.testing.tail_held_bytes(off) == 0
    off.close()


def test_backward_starts_with_no_more_in_memory_than_the_window(nvme_dir):
    # Held sources count in the prefetch window (NOTE [Tail hold], 4): at the
    # first unpack, restores started ahead plus sources held are no more than,
    # without the hold, the restores started ahead plus the log-softmax
    # output read on demand (a miss, not counted in prefetched_bytes).
    window = 2 * LOGPROBS_BYTES
    first = {}

    def filled(stats):
        first.setdefault("bytes", stats.prefetched_bytes + held())
    model, tokens = _gpt()
    in_memory = {}
    for hold in (0, window):
        off = _off("nvme", f"{nvme_dir}{hold}", tail_hold_bytes=hold, prefetch_bytes=window)
        held = lambda: tiermem.testing.tail_held_bytes(off)   # noqa: E731
        first.clear()
        with tiermem.testing.after_prefetch_fills(filled):
            _gpt_step(model, tokens, off, land=lambda: land_moves(off))
        assert off.stats.bytes_by_tier["nvme"] > 2 * window   # the window is a part
        in_memory[hold] = first["bytes"]
        off.close()
    assert in_memory[window] <= in_memory[0] + LOGPROBS_BYTES, in_memory
    assert in_memory[0] > 0


def test_a_tensor_larger_than_the_bound_is_not_held_and_pushes_out_the_rest(nvme_dir):
    off = offloader("cpu", tail_hold_bytes=100 * KiB)
    x = torch.randn(64, 64, requires_grad=True)   # 16 KiB
    with off:
        a = x.exp()                   # saves its 16 KiB output: held
        held_small = tiermem.testing.tail_held_bytes(off)
        big = x.repeat(16, 16)        # 4 MiB
        b = big.sin()                 # saves its 4 MiB input: not held; a pushed out
        held_after = tiermem.testing.tail_held_bytes(off)
        loss = a.sum() + b.sum()
    assert held_small == 16 * KiB and held_after == 0
    loss.backward()
    off.close()


# -- release ---------------------------------------------------------------------------

def test_holds_not_used_are_released_at_the_end_of_backward(nvme_dir):
    # Two branches; backward of one leaves the other's held sources unused:
    # released when that backward ends, though their graph is still alive.
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    off = offloader("nvme", nvme_dir=nvme_dir, tail_hold_bytes=4 * MiB)
    with off as ctx:
        other = x.exp().exp()         # moved earlier, held
        used = (x * 2).sin().cos().sum()
    assert tiermem.testing.tail_held_bytes(off) > 0
    used.backward()
    assert ctx.stats.tail_hits > 0
    assert tiermem.testing.tail_held_bytes(off) == 0
    g_used = x.grad.clone()
    x.grad = None
    other.sum().backward()           # restored from disk, exact
    x2 = x.detach().clone().requires_grad_()
    x2.exp().exp().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    x2.grad = None
    (x2 * 2).sin().cos().sum().backward()
    assert torch.equal(g_used, x2.grad)
    off.close()


def test_holds_die_with_their_graph(nvme_dir):
    # Nothing but the graph's handles refers to a held source: dropping the
    # graph frees its memory (no backward ran).
    x = torch.randn(128, 128, requires_grad=True)
    off = offloader("nvme", nvme_dir=nvme_dir, tail_hold_bytes=4 * MiB)
    with off:
        h = x.exp()
        y = h.sin()
    land_moves(off)
    storage = StorageWeakRef(h.untyped_storage())
    del h
    assert not storage.expired() and tiermem.testing.tail_held_bytes(off) > 0
    del y
    gc.collect()
    assert storage.expired()
    assert tiermem.testing.tail_held_bytes(off) == 0
    off.close()


def test_steps_whose_graphs_are_dropped_leave_nothing_held(nvme_dir, default_hold):
    # Many steps, some backwarded, some dropped unused: the held bytes and
    # the stores' host and disk bytes go back to zero.
    model, tokens = _gpt()
    off = _off("nvme", nvme_dir)
    for i in range(6):
        with off:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        assert tiermem.testing.tail_held_bytes(off) > 0
        if i % 2:
            loss.backward()
        del logits, loss
        gc.collect()
        assert tiermem.testing.tail_held_bytes(off) == 0
    land_moves(off)
    assert off.host_bytes_in_use == 0 and off.disk_bytes_in_use == 0
    off.close()


def test_holds_are_released_when_the_forward_raises(nvme_dir):
    x = torch.randn(128, 128, requires_grad=True)
    off = offloader("nvme", nvme_dir=nvme_dir, tail_hold_bytes=4 * MiB)
    partial = []
    with pytest.raises(ValueError):
        with off:
            h = x.exp()
            partial.append(h.sin())   # the partial graph outlives the error
            raise ValueError("boom")
    assert tiermem.testing.tail_held_bytes(off) == 0
    partial[0].sum().backward()      # restored from disk, exact
    assert torch.equal(x.grad, x.detach().exp().cos() * x.detach().exp())
    off.close()


def test_close_releases_holds(nvme_dir):
    x = torch.randn(128, 128, requires_grad=True)
    off = offloader("cpu", tail_hold_bytes=4 * MiB)
    with off:
        y = x.exp().sin()
    assert tiermem.testing.tail_held_bytes(off) > 0
    off.close()
    assert tiermem.testing.tail_held_bytes(off) == 0
    del y


def _two_forwards(off, model, tokens):
    """Two forwards (the second on flipped tokens): their losses and stats."""
    losses, stats = [], []
    for t in (tokens, tokens.flip(0)):
        with off as ctx:
            logits = model(t[:, :-1])
            losses.append(F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten()))
        stats.append(ctx.stats)
    return losses, stats


def _assert_grads_of(model, got, order, tokens):
    model.zero_grad(set_to_none=True)
    toks = (tokens, tokens.flip(0))
    for i in order:
        t = toks[i]
        F.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()).backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, model.parameters()))


def test_several_forwards_hold_the_next_backwards_tail(nvme_dir):
    # Forward, forward, then the backwards in forward order (accumulation,
    # GPipe): the hold keeps the first forward's end, whose backward comes
    # next, not the second's (NOTE [Backward order] in runtime/schedule.py);
    # the end of the first backward starts the second's restores.
    model, tokens = _gpt()
    model.eval()   # no dropout: the reference draws nothing
    hold = 2 * LOGPROBS_BYTES
    off = _off("nvme", nvme_dir, tail_hold_bytes=hold)
    losses, stats = _two_forwards(off, model, tokens)
    assert 0 < tiermem.testing.tail_held_bytes(off) <= hold
    assert stats[0].peak_tail_hold_bytes > 0 and stats[1].peak_tail_hold_bytes == 0
    land_moves(off)
    losses[0].backward()
    assert stats[0].tail_hits > 0 and stats[0].prefetch_misses == 0
    assert tiermem.testing.tail_held_bytes(off) == 0
    losses[1].backward()   # nothing held for it, but restored ahead
    assert stats[1].tail_hits == 0 and stats[1].prefetch_misses == 0
    got = [p.grad.clone() for p in model.parameters()]
    _assert_grads_of(model, got, (0, 1), tokens)
    off.close()


def test_expect_backward_moves_the_restores_to_the_named_step(nvme_dir):
    # The backwards in reverse order, said with expect_backward(-1): the first
    # forward's held sources are released, the second's restores start at the
    # call; both backwards exact.
    model, tokens = _gpt()
    model.eval()
    off = _off("nvme", nvme_dir, tail_hold_bytes=2 * LOGPROBS_BYTES)
    losses, stats = _two_forwards(off, model, tokens)
    land_moves(off)
    assert tiermem.testing.tail_held_bytes(off) > 0
    off.expect_backward(-1)
    assert tiermem.testing.tail_held_bytes(off) == 0
    assert stats[1].prefetched_bytes > 0
    losses[1].backward()
    assert stats[1].prefetch_misses == 0
    losses[0].backward()   # its tail was released: read as without the hold
    assert stats[0].tail_hits == 0
    got = [p.grad.clone() for p in model.parameters()]
    _assert_grads_of(model, got, (1, 0), tokens)
    off.close()


# -- where it does not apply -----------------------------------------------------------

def test_an_auto_plans_steps_hold_nothing(nvme_dir, default_hold):
    case = make_case("block")
    off = tiermem.Offloader(policy="auto", device_budget="50%", nvme_dir=nvme_dir,
                            engine="python", min_offload_bytes=0)
    seen = []
    original = TailHold.add
    TailHold.add = lambda self, *a: seen.append(a) or original(self, *a)
    try:
        ref = reference_steps("block", steps=4)
        records = train_steps(case, lambda: off, steps=4)
    finally:
        TailHold.add = original
    compare_records(records, ref, "block/auto")
    assert seen == []
    assert off.stats.tail_hits == 0 and off.stats.peak_tail_hold_bytes == 0
    assert off.stats.offloaded_bytes > 0   # the plan moved something
    off.close()


def test_nothing_is_held_when_parameters_may_be_freed(nvme_dir, monkeypatch):
    # FSDP2 (NOTE [Sharded parameters] in runtime/hooks.py): a moved tensor may alias
    # an unsharded parameter whose storage FSDP2 frees; never held.
    import tiermem.runtime.hooks
    original = tiermem.runtime.hooks.Packer.note_root

    def note_root(self, module):
        original(self, module)
        self.step.params_may_be_freed = True
    monkeypatch.setattr(tiermem.runtime.hooks.Packer, "note_root", note_root)
    ref = reference_steps("block")
    off = offloader("nvme", nvme_dir=nvme_dir, tail_hold_bytes=16 * MiB)
    records = train_steps(make_case("block"), lambda: off)
    compare_records(records, ref, "block/params_may_be_freed")
    assert off.stats.tail_hits == 0 and off.stats.peak_tail_hold_bytes == 0
    off.close()


# -- CUDA --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("policy", ("cpu", "nvme", "recompute,nvme"))
def test_cuda_the_losss_first_unpack_takes_the_held_source(policy, nvme_dir, deterministic):
    # On the GPU the held tensor is the one autograd would keep (no
    # record_stream: NOTE [Tail hold], 7).
    dev = torch.device("cuda")
    model, tokens = _gpt()
    model, tokens = model.to(dev), tokens.to(dev)
    ref = _gpt_step(model, tokens, contextlib.nullcontext())
    off = _off(policy, nvme_dir, tail_hold_bytes=4 * LOGPROBS_BYTES,
               engine="auto" if "nvme" in policy else None)
    for i in range(3):
        got = _gpt_step(model, tokens, off, land=lambda: land_moves(off))
        assert _same(got, ref), (policy, i)
        s = off.stats
        assert s.tail_hits >= 1 and s.prefetch_misses == 0, s
        assert tiermem.testing.tail_held_bytes(off) == 0
    torch.cuda.synchronize()
    off.close()
