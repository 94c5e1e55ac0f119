"""Several forwards under one Offloader before their backwards: gradient
accumulation and pipeline schedules (1F1B).

Each ``with off:`` is one step with its own saved tensors, stats and prefetch
schedule, so k forwards may run before any backward, and the backwards may
come in the same order, in reverse, or interleaved with further forwards
(F0 F1 B0 F2 B1 B2). For every tier the gradients accumulated after each
backward are bit-identical (``torch.equal``) to plain autograd run in the same
order with the same RNG seeds (the transformer block has attention and
residual dropout). Each forward's stats are its own; ``off.stats`` is the most
recent forward's. A backward restores only its own micro-batch's tensors, and
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


@pytest.mark.parametrize("window", [None, "16KiB"], ids=["auto_window", "small_window"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("policy", [("cpu", None), ("nvme", "python"), ("nvme", "cpp")],
                         ids=_policy_id)
def test_backward_restores_only_its_own_micro_batch(policy, schedule, window, make_off):
    """A backward prefetches its own step's tensors, each once, none of another
    micro-batch's; a later micro-batch's backward finds its own tensors still
    saved and restores them then; no restore is left in flight, and the pools
    are idle at the end."""
    tier, engine = policy
    off = _make(make_off, tier, engine, prefetch_bytes=window)
    started = _prefetch_spy(off, [tiermem.Tier(tier)])
    ctxs = {}
    log = []

    def before_backward(i):
        land_moves(off)   # every move landed: each restore comes from host or disk
        started.clear()

    def on_backward(i):
        step = ctxs[i].step
        mine = [s for s in started if s is step]
        log.append((i, len(mine), len(started)))
        assert len(mine) == len(started), f"backward {i} prefetched another micro-batch's tensors"
        for j, ctx in ctxs.items():
            assert ctx.prefetcher.inflight_bytes == 0, f"after backward {i}: step {j} in flight"

    class _Recording:
        def __enter__(self):
            ctx = off.__enter__()
            ctxs[len(ctxs)] = ctx
            return ctx

        def __exit__(self, *exc):
            return off.__exit__(*exc)

    _run(SCHEDULES[schedule], _Recording, before_backward, on_backward)
    for i, n_mine, _ in log:
        s = ctxs[i].stats
        moved = s.count_by_tier[tier]
        assert moved > 0
        # Every moved tensor restored exactly once in its own backward; all but
        # the first unpacked were prefetched (the first had nothing before it).
        assert s.prefetch_hits + s.prefetch_misses == moved, s
        assert s.prefetch_misses <= 1 and n_mine == moved - s.prefetch_misses, (s, n_mine)
        assert s.prefetched_bytes <= s.bytes_by_tier[tier]
    if window is not None:
        assert ctxs[0].prefetcher.budget_bytes == 16 << 10
    del ctxs
    started.clear()   # it holds steps
    _assert_idle(off)
