"""Several forwards under one Offloader before their backwards: gradient
accumulation and pipeline schedules (1F1B).

Each ``with off:`` is one step with its own saved tensors, stats and prefetch
schedule, so k forwards may run before any backward, and the backwards may
come in the same order, in reverse, or interleaved with further forwards
(F0 F1 B0 F2 B1 B2). For every tier the gradients accumulated after each
backward are bit-identical (``torch.equal``) to plain autograd run in the same
order with the same RNG seeds (the transformer block has attention and
residual dropout). Each forward's stats are its own; ``off.stats`` is the most
recent forward's. A backward restores its own micro-batch's tensors and, at its
end, starts those of the one expected next (the oldest pending forward), and
once every backward has run (and the graphs are gone) the pools are idle.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

import tiermem
import tiermem.testing
from helpers import cpp_engine_unavailable, land_moves, moved_count
from models import make_case

#: (policy, nvme engine or None).
POLICIES = [("keep", None), ("cpu", None), ("nvme", "python"), ("nvme", "cpp"),
            ("recompute", None), ("recompute,cpu", None)]

#: Name -> schedule: ``Fi`` runs micro-batch i's forward, ``Bi`` its backward.
SCHEDULES = {
    "in_order": "F0 F1 F2 B0 B1 B2",
    "reversed": "F0 F1 F2 B2 B1 B0",
    "one_f_one_b": "F0 F1 B0 F2 B1 B2",
}
MICRO_BATCHES = 3


def _policy_id(p):
    return p[0] if p[1] is None else f"{p[0]}-{p[1]}"


def _make(make_off, policy, engine, **settings):
    if engine == "cpp":
        reason = cpp_engine_unavailable()
        if reason:
            pytest.skip(f"C++ engine unavailable: {reason}")
    if engine is not None:
        settings["engine"] = engine
    return make_off(policy, **settings)


def _inputs():
    g = torch.Generator().manual_seed(5)
    return [torch.randn(2, 16, 32, generator=g) for _ in range(MICRO_BATCHES)]


def _run(schedule: str, ctx_factory, before_backward=None, on_backward=None):
    """Run ``schedule`` on a fresh transformer block (same initialisation every
    call). Returns the losses, a copy of every gradient after each backward (in
    schedule order) and each forward's context object (``with ... as``)."""
    case = make_case("block")
    xs = _inputs()
    losses, ctxs, grads = {}, {}, []
    for op in schedule.split():
        i = int(op[1:])
        if op[0] == "F":
            torch.manual_seed(100 + i)          # micro-batch i's dropout masks
            with ctx_factory() as ctx:
                losses[i] = case.model(xs[i]).square().mean()
            ctxs[i] = ctx
        else:
            if before_backward is not None:
                before_backward(i)
            losses[i].backward()
            if on_backward is not None:
                on_backward(i)
            grads.append({n: p.grad.clone() for n, p in case.model.named_parameters()})
    return {i: l.detach() for i, l in losses.items()}, grads, ctxs


def _assert_idle(off):
    """No graph of ``off`` is alive and its pools and file hold nothing."""
    gc.collect()   # a step's objects form cycles: the collector frees them
    assert not off.in_use, "a step of the Offloader is still alive"
    assert off.host_bytes_in_use == 0 and off.disk_bytes_in_use == 0
    for tier, s in off.store_stats().items():
        assert s.get("host_in_use_bytes", 0) == 0, (tier, s)
        assert s.get("staging_in_use_bytes", 0) == 0, (tier, s)
        assert s.get("disk_used_bytes", 0) == 0, (tier, s)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("policy", POLICIES, ids=_policy_id)
def test_micro_batches_bit_identical(policy, schedule, make_off):
    tier, engine = policy
    order = SCHEDULES[schedule]
    ref_losses, ref_grads, _ = _run(order, contextlib.nullcontext)
    off = _make(make_off, tier, engine)
    losses, grads, ctxs = _run(order, lambda: off)

    for i in range(MICRO_BATCHES):
        assert torch.equal(losses[i], ref_losses[i]), f"micro-batch {i}: loss differs"
    assert len(grads) == len(ref_grads) == MICRO_BATCHES
    for k, (got, ref) in enumerate(zip(grads, ref_grads)):
        for n in ref:
            assert torch.equal(got[n], ref[n]), f"{schedule}/{tier}: after backward {k}: {n}"
    # The dropout masks differ between micro-batches (the check is not vacuous).
    assert not torch.equal(ref_grads[0]["attn.qkv.weight"], ref_grads[1]["attn.qkv.weight"])

    # Each forward is one step with stats of its own; off.stats is the last one's.
    stats = [ctxs[i].stats for i in range(MICRO_BATCHES)]
    assert len({id(s) for s in stats}) == MICRO_BATCHES
    last_forward = int([op for op in order.split() if op[0] == "F"][-1][1:])
    assert off.stats is ctxs[last_forward].stats
    for s in stats:   # the same model and shapes: the same placements per step
        assert s.count_by_tier == stats[0].count_by_tier, (s, stats[0])
        if tier == "keep":
            assert moved_count(s) == 0
        else:
            assert s.count_by_tier[tier.split(",")[0]] > 0, s
    del losses, ctxs, stats
    _assert_idle(off)


def _prefetch_spy(off, tiers):
    """Record the step of every handle whose restore a store starts."""
    started = []
    for t in tiers:
        store = tiermem.testing.store_of(off, t)
        original = store.prefetch

        def spy(h, original=original):
            out = original(h)
            if out:
                started.append(h.step)
            return out
        store.prefetch = spy
    return started


def _next_in_fifo(order: str, done: int) -> int:
    """The micro-batch whose backward FIFO expects after ``done``'s backward
    in ``order``: the oldest forward so far whose backward has not run, or -1."""
    ops = order.split()
    ran = ops[:ops.index(f"B{done}") + 1]
    pending = [int(o[1:]) for o in ran if o[0] == "F" and f"B{o[1:]}" not in ran]
    return pending[0] if pending else -1


@pytest.mark.parametrize("window", [None, "16KiB"], ids=["auto_window", "small_window"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("policy", [("cpu", None), ("nvme", "python"), ("nvme", "cpp")],
                         ids=_policy_id)
def test_backward_restores_only_its_own_micro_batch(policy, schedule, window, make_off):
    """A backward prefetches its own step's tensors, each once, and at its end
    the first window of the step whose backward FIFO expects next (NOTE
    [Backward order] in tiermem/runtime/schedule.py), none of any other
    micro-batch's; every moved tensor is restored once, in its own backward or
    ahead of it; no restore but the next step's is left in flight, and the
    pools are idle at the end."""
    tier, engine = policy
    order = SCHEDULES[schedule]
    off = _make(make_off, tier, engine, prefetch_bytes=window)
    started = _prefetch_spy(off, [tiermem.Tier(tier)])
    ctxs = {}
    restores = {}   # micro-batch -> restores started for it

    def before_backward(i):
        land_moves(off)   # every move landed: each restore comes from host or disk

    def on_backward(i):
        step, nxt = ctxs[i].step, _next_in_fifo(order, i)
        allowed = {step} | ({ctxs[nxt].step} if nxt >= 0 else set())
        assert all(s in allowed for s in started), \
            f"backward {i} prefetched a micro-batch's tensors other than {i} and {nxt}"
        for j, ctx in ctxs.items():
            restores[j] = restores.get(j, 0) + sum(s is ctx.step for s in started)
            if j != nxt:
                assert ctx.prefetcher.inflight_bytes == 0, f"after backward {i}: step {j}"
        if nxt >= 0:   # its restores started (the window fills as at a kick)
            assert ctxs[nxt].prefetcher.inflight_bytes > 0
        started.clear()

    class _Recording:
        def __enter__(self):
            ctx = off.__enter__()
            ctxs[len(ctxs)] = ctx
            return ctx

        def __exit__(self, *exc):
            return off.__exit__(*exc)

    _run(order, _Recording, before_backward, on_backward)
    for i in range(MICRO_BATCHES):
        s = ctxs[i].stats
        moved = s.count_by_tier[tier]
        assert moved > 0
        # Every moved tensor restored exactly once; all but the first unpacked
        # were prefetched (the first had nothing before it).
        assert s.prefetch_hits + s.prefetch_misses == moved, s
        assert s.prefetch_misses <= 1 and restores[i] == moved - s.prefetch_misses, (s, restores)
        assert s.prefetched_bytes <= s.bytes_by_tier[tier]
    if window is not None:
        assert ctxs[0].prefetcher.budget_bytes == 16 << 10
    del ctxs
    started.clear()   # it holds steps
    _assert_idle(off)
