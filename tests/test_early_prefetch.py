"""A step that follows an auto plan starts its restores when backward starts
(NOTE [Restores start with backward] in tiermem/hooks.py): the kept tensor
backward unpacks first starts the prefetcher, so the first moved tensor
backward needs is already on its way (a prefetch hit, not a read on demand);
its own backward only, with several forwards before their backwards; and the
cost model predicts it (NOTE [Planner cost model], 4, in planner/solver.py)."""

import pytest
import torch

import tiermem
import tiermem.testing
from tiermem.planner.profile import Profile, TensorRecord
from tiermem.planner.rates import Rates
from tiermem.planner.solver import make_plan
from tiermem.policy import Tier
from tiermem.tiers.keep import KickKept

MB = 1_000_000
LAYERS = 6


def _model():
    torch.manual_seed(0)
    return [torch.nn.Linear(256, 256) for _ in range(LAYERS)], torch.randn(1024, 256)


def _forward(off, lins, x):
    with off as ctx:
        y = x
        for lin in lins:
            y = lin(y).relu()
        loss = y.sum()
    # Every write landed: a restore is never held back by its move out.
    tiermem.testing.store_of(off, Tier.NVME).drain()
    return ctx, loss


def _planned(nvme_dir, lins, x):
    """An Offloader whose plan keeps what backward needs first and moves the rest."""
    off = tiermem.Offloader(policy="auto", device_budget="40%", nvme_dir=nvme_dir,
                            min_offload_bytes=0, engine="python")
    for _ in range(3):   # profile, plan, (maybe) one correction
        _, loss = _forward(off, lins, x)
        loss.backward()
    plan = off.plan
    assert plan.bytes_by_tier()["nvme"] > 0 and plan.bytes_by_tier()["keep"] > 0, str(plan)
    assert plan.kick_index is not None
    assert plan.tensors[plan.kick_index].tier == Tier.KEEP.value
    return off


def _grads(lins):
    return [p.grad.clone() for lin in lins for p in lin.parameters()]


def _zero(lins):
    for lin in lins:
        for p in lin.parameters():
            p.grad = None


def _plain_grads(lins, x):
    _zero(lins)
    y = x
    for lin in lins:
        y = lin(y).relu()
    y.sum().backward()
    return _grads(lins)


def test_the_first_moved_restore_is_prefetched_in_a_planned_step(nvme_dir):
    lins, x = _model()
    off = _planned(nvme_dir, lins, x)
    expected = _plain_grads(lins, x)
    _zero(lins)
    ctx, loss = _forward(off, lins, x)
    assert ctx.planning.plan is off.plan, "the step followed the plan"
    loss.backward()
    s = ctx.stats
    moved = s.count_by_tier["nvme"]
    assert moved > 0
    # Every restore, the first one backward needs included, started ahead of
    # its unpack.
    assert (s.prefetch_hits, s.prefetch_misses) == (moved, 0), s
    assert all(torch.equal(a, b) for a, b in zip(_grads(lins), expected))
    off.close()


def test_without_the_kick_the_first_moved_restore_is_read_on_demand(nvme_dir):
    # The counterpart: the same step with the plan's kick removed misses once.
    lins, x = _model()
    off = _planned(nvme_dir, lins, x)
    off.plan.kick_index = None
    ctx, loss = _forward(off, lins, x)
    loss.backward()
    s = ctx.stats
    assert (s.prefetch_hits, s.prefetch_misses) == (s.count_by_tier["nvme"] - 1, 1), s
    off.close()


def test_a_kick_starts_only_its_own_steps_restores(nvme_dir):
    # Two forwards before their backwards (gradient accumulation): the second
    # step's backward restores nothing of the first's.
    lins, x = _model()
    off = _planned(nvme_dir, lins, x)
    x2 = x.flip(0)
    # Plain autograd, backwards in the same order (x2's, then x's), accumulated.
    expected = [a + b for a, b in zip(_plain_grads(lins, x2), _plain_grads(lins, x))]
    _zero(lins)
    ctx1, loss1 = _forward(off, lins, x)
    ctx2, loss2 = _forward(off, lins, x2)
    assert ctx1.planning.plan is ctx2.planning.plan is off.plan
    loss2.backward()
    assert ctx1.stats.prefetched_bytes == 0 and ctx1.stats.prefetch_hits == 0
    assert ctx2.stats.prefetch_misses == 0 and ctx2.stats.prefetch_hits > 0
    loss1.backward()
    assert ctx1.stats.prefetch_misses == 0 and ctx1.stats.prefetch_hits > 0
    assert all(torch.equal(a, b) for a, b in zip(_grads(lins), expected))
    off.close()


def test_only_autograd_holds_the_kick_handle(nvme_dir):
    # The dedup table holds the plain kept handle (rule 1 of the NOTE).
    lins, x = _model()
    off = _planned(nvme_dir, lins, x)
    ctx, loss = _forward(off, lins, x)
    handles = [h() for _, h in ctx.step.dedup.values()]
    assert not any(type(h) is KickKept for h in handles)
    loss.backward()
    off.close()


def _rec(index, nbytes, pack_s, use_s):
    return TensorRecord(index, f"m{index}", None, (nbytes // 4,), "float32", "cpu", nbytes,
                        pack_s, first_use_s=use_s)


def _plan(records, bwd_start, budget):
    keys = tuple(((r.nbytes // 4,), torch.float32, torch.device("cpu")) for r in records)
    profile = Profile(records, keys, 0, bwd_start, bwd_start, bwd_start + 1.0,
                      sum(r.nbytes for r in records))
    rates = Rates(host_copy=1e10, pointwise=1e9, disk_write=1e9, disk_read=1e9,
                  disk_engine="fake", disk_read_latency_s=0.001)
    return make_plan(profile, rates, budget, "test", has_nvme=True, cpu_budget_bytes=0,
                     nvme_budget_bytes=None)


def test_the_prediction_starts_restores_at_the_kick():
    # Tensor 1 is kept and needed first (at 1.0 s); tensor 0 is moved and
    # needed 5 ms later: its 11 ms read starts at the kick, so it waits 6 ms
    # rather than its whole read.
    recs = [_rec(0, 10 * MB, 0.0, 1.005), _rec(1, 10 * MB, 0.1, 1.0)]
    plan = _plan(recs, 1.0, 10 * MB)
    assert [t.tier for t in plan.tensors] == ["nvme", "keep"]
    assert plan.kick_index == 1
    read = 0.001 + 10 * MB / 1e9
    assert plan.predicted_stall_s == pytest.approx(read - 0.005)


def test_no_kick_when_backward_needs_a_moved_tensor_first():
    # Tensor 1, saved just before backward, would stall longer: it is kept,
    # and tensor 0, moved, is needed before it. No kept tensor comes first:
    # no kick, and tensor 0 waits its whole read.
    recs = [_rec(0, 10 * MB, 0.0, 1.0), _rec(1, 10 * MB, 0.999, 1.003)]
    plan = _plan(recs, 1.0, 10 * MB)
    assert [t.tier for t in plan.tensors] == ["nvme", "keep"]
    assert plan.kick_index is None
    assert plan.predicted_stall_s == pytest.approx(0.001 + 10 * MB / 1e9)
