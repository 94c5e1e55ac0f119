"""A step that follows an auto plan starts its restores when backward starts
(NOTE [Restores start with backward] in tiermem/runtime/hooks.py): the kept tensor
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
from tiermem.tiers.keep import Kept, KickKept
from helpers import compare_records, reference_steps, train_steps
from models import make_case

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
    # step's backward takes nothing of the first's.
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
    # Nothing of the first step's taken; at the end of the second's backward
    # the first one's window was started, being next (NOTE [Backward order]).
    assert ctx1.stats.prefetch_hits == 0
    assert ctx1.stats.prefetched_bytes > 0
    assert ctx2.stats.prefetch_misses == 0 and ctx2.stats.prefetch_hits > 0
    loss1.backward()
    assert ctx1.stats.prefetch_misses == 0 and ctx1.stats.prefetch_hits > 0
    assert all(torch.equal(a, b) for a, b in zip(_grads(lins), expected))
    off.close()


def test_only_autograd_holds_the_kick_handle(nvme_dir):
    # The dedup table holds the plain kept handle (rule 1 of the NOTE).
    lins, x = _model()
    off = _planned(nvme_dir, lins, x)
    with off as ctx:
        y = x
        for lin in lins:
            y = lin(y).relu()
        loss = y.sum()
        # Read before the forward ends: end_forward clears the table.
        handles = [h() for _, h in ctx.step.dedup.values()]
    assert ctx.planning.plan is off.plan
    assert any(type(h) is Kept for h in handles)
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


# -- fixed policies (NOTE [Restores start with backward], 5) ---------------------------
# No profile and no plan: once a step has moved a tensor, every later kept
# pack is a KickKept, so whichever kept tensor backward unpacks first starts
# the restores.

def _forward_fixed(off, lins, x, kept_head):
    """The chain of ``_model``; ``kept_head``: the loss ends in ops that save
    only a small tensor (kept: under min_offload_bytes), which backward
    unpacks before any moved one; else backward first needs a moved tensor."""
    with off as ctx:
        y = x
        for lin in lins:
            y = lin(y).relu()
        if kept_head:
            z = y.sum(1)              # (1024,): 4 KiB, kept
            loss = (z * z).sum()      # MulBackward0 unpacks z first
        else:
            loss = y.sum()            # ReluBackward0 unpacks a moved tensor first
    tiermem.testing.store_of(off, Tier.NVME).drain()
    return ctx, loss


def _plain_fixed(lins, x, kept_head):
    _zero(lins)
    y = x
    for lin in lins:
        y = lin(y).relu()
    loss = (y.sum(1) * y.sum(1)).sum() if kept_head else y.sum()
    loss.backward()
    return _grads(lins)


class _CountingKickKept(KickKept):
    """KickKept, counted (the pack hook makes them through tiermem.runtime.hooks.KickKept)."""

    made = 0

    def __init__(self, kept, step, top=None) -> None:
        super().__init__(kept, step, top)
        type(self).made += 1


@pytest.fixture
def counted_kicks(monkeypatch):
    import tiermem.runtime.hooks
    _CountingKickKept.made = 0
    monkeypatch.setattr(tiermem.runtime.hooks, "KickKept", _CountingKickKept)
    return _CountingKickKept


def _fixed(nvme_dir, policy="nvme"):
    return tiermem.Offloader(policy=policy, nvme_dir=nvme_dir, engine="python",
                             min_offload_bytes=64 << 10)


def test_a_fixed_nvme_step_kicks_at_its_first_kept_unpack(nvme_dir, counted_kicks):
    # Every restore, the first one backward needs included, is a prefetch hit.
    lins, x = _model()
    expected = _plain_fixed(lins, x, kept_head=True)
    _zero(lins)
    off = _fixed(nvme_dir)
    ctx, loss = _forward_fixed(off, lins, x, kept_head=True)
    assert counted_kicks.made > 0
    loss.backward()
    s = ctx.stats
    moved = s.count_by_tier["nvme"]
    assert moved == LAYERS + 1   # each Linear's input and the last ReLU's output
    assert (s.prefetch_hits, s.prefetch_misses) == (moved, 0), s
    assert all(torch.equal(a, b) for a, b in zip(_grads(lins), expected))
    off.close()


def test_a_fixed_step_without_its_kick_reads_the_first_restore_on_demand(
        nvme_dir, monkeypatch):
    # The counterpart: the same step with plain Kept handles misses once.
    import tiermem.runtime.hooks
    monkeypatch.setattr(tiermem.runtime.hooks, "KickKept", lambda kept, step, top=None: kept)
    lins, x = _model()
    off = _fixed(nvme_dir)
    ctx, loss = _forward_fixed(off, lins, x, kept_head=True)
    loss.backward()
    s = ctx.stats
    assert (s.prefetch_hits, s.prefetch_misses) == (s.count_by_tier["nvme"] - 1, 1), s
    off.close()


def test_when_a_moved_tensor_is_needed_first_its_unpack_leads(nvme_dir, counted_kicks):
    # Nothing kept is unpacked before it: that restore is read on demand, and
    # its unpack starts every other (the KickKepts of the weights do nothing).
    lins, x = _model()
    expected = _plain_fixed(lins, x, kept_head=False)
    _zero(lins)
    off = _fixed(nvme_dir)
    ctx, loss = _forward_fixed(off, lins, x, kept_head=False)
    assert counted_kicks.made > 0   # the weights saved after the first move
    loss.backward()
    s = ctx.stats
    assert (s.prefetch_hits, s.prefetch_misses) == (s.count_by_tier["nvme"] - 1, 1), s
    assert all(torch.equal(a, b) for a, b in zip(_grads(lins), expected))
    off.close()


def test_a_fixed_kick_starts_only_its_own_steps_restores(nvme_dir):
    # Two forwards before their backwards, backwards in reverse order.
    lins, x = _model()
    x2 = x.flip(0)
    expected = [a + b for a, b in zip(_plain_fixed(lins, x2, True),
                                      _plain_fixed(lins, x, True))]
    _zero(lins)
    off = _fixed(nvme_dir)
    ctx1, loss1 = _forward_fixed(off, lins, x, kept_head=True)
    ctx2, loss2 = _forward_fixed(off, lins, x2, kept_head=True)
    loss2.backward()
    # Nothing of the first step's taken; at the end of the second's backward
    # the first one's window was started, being next (NOTE [Backward order]).
    assert ctx1.stats.prefetch_hits == 0
    assert ctx1.stats.prefetched_bytes > 0
    moved = ctx2.stats.count_by_tier["nvme"]
    assert (ctx2.stats.prefetch_hits, ctx2.stats.prefetch_misses) == (moved, 0)
    loss1.backward()
    assert (ctx1.stats.prefetch_hits, ctx1.stats.prefetch_misses) == (moved, 0)
    assert all(torch.equal(a, b) for a, b in zip(_grads(lins), expected))
    off.close()


def test_a_fixed_step_keeps_no_kick_handle_in_dedup(nvme_dir, counted_kicks):
    # Rule 1: with producer tracking on (here for a callable policy), kept
    # tensors are in the dedup table, which recipes read: the plain Kept,
    # never the KickKept.
    lins, x = _model()
    off = _fixed(nvme_dir, lambda info: "nvme" if info.index % 2 == 0 else "keep")
    with off as ctx:
        y = x
        for lin in lins:
            y = lin(y).relu()
        z = y.sum(1)
        loss = (z * z).sum()
        handles = [h() for _, h in ctx.step.dedup.values()]   # before end_forward clears it
    assert counted_kicks.made > 0
    assert any(type(h) is Kept for h in handles)
    assert not any(isinstance(h, KickKept) for h in handles)
    loss.backward()
    off.close()


def test_a_planned_step_makes_only_its_plans_kick_handle(nvme_dir, counted_kicks):
    # A step that follows a plan has the plan's one KickKept, none of rule 5's.
    lins, x = _model()
    off = _planned(nvme_dir, lins, x)
    counted_kicks.made = 0
    ctx, loss = _forward(off, lins, x)
    assert ctx.planning.plan is off.plan
    assert counted_kicks.made == 1
    loss.backward()
    off.close()


@pytest.mark.parametrize("policy", ["nvme", "cpu", "recompute,nvme"])
@pytest.mark.parametrize("name", ["mlp", "block", "convnet"])
def test_fixed_kicks_keep_gradients_exact(name, policy, nvme_dir, counted_kicks):
    ref = reference_steps(name, steps=2)
    case = make_case(name)
    off = tiermem.Offloader(policy=policy, nvme_dir=nvme_dir, engine="python",
                            min_offload_bytes=0)
    records = train_steps(case, lambda: off, steps=2)
    assert counted_kicks.made > 0
    compare_records(records, ref, f"{name}/{policy}")
    off.close()


def test_a_fixed_kick_restores_from_where_its_tensor_was_packed(nvme_dir):
    # A backward that starts mid-graph (a loss taken after layer 3 of 6) is
    # kicked by the small tensor packed there: it restores the moved tensors
    # packed before it, each a prefetch hit, and none of the later ones.
    lins, x = _model()
    off = _fixed(nvme_dir)
    with off as ctx:
        y = x
        for lin in lins[:3]:
            y = lin(y).relu()
        z = y.sum(1)                  # kept (4 KiB), packed after 3 moved inputs
        mid = (z * z).sum()
        for lin in lins[3:]:
            y = lin(y).relu()
        end = y.sum()
    tiermem.testing.store_of(off, Tier.NVME).drain()
    _zero(lins)
    mid.backward()
    s = ctx.stats
    one = 1024 * 256 * 4
    # Layers 0-2: each Linear's input (x, then ReLU outputs); y of layer 2 is
    # saved by ReLU and by the next Linear (one handle, restored once).
    assert (s.prefetch_hits, s.prefetch_misses) == (4, 0), s
    assert s.prefetched_bytes == 4 * one, s
    expected_mid = _grads(lins[:3])
    del end
    off.close()
    # Same gradients as plain autograd.
    _zero(lins)
    y = x
    for lin in lins[:3]:
        y = lin(y).relu()
    z = y.sum(1)
    (z * z).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(expected_mid, _grads(lins[:3])))
