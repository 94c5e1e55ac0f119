"""A pipeline schedule in one process (tests/pipeline_driver.py), each stage
with its own Offloader: GPipe and 1F1B give the losses, gradients and
parameters of the same schedule without tiermem (``torch.equal``, two
optimizer steps) for every policy; each stage restores its micro-batches in
the order its backwards run (NOTE [Backward order] in
tiermem/runtime/schedule.py); ``expect_backward`` refuses what it cannot
follow; and ``policy="auto"`` keeps a stage with several micro-batches in
flight within its budget, one plan for all of them (NOTE [Budget across
micro-batches] in tiermem/planner/planning.py).
"""

from __future__ import annotations

import os

import pytest
import torch

import tiermem
import tiermem.testing
from helpers import offloader
from pipeline_driver import make_batches, make_stages, stage_ops, train
from tiermem.models import GPTConfig

CFG = GPTConfig(vocab=2, layers=1, width=32, heads=4, seq_len=16, dropout=0.1)
STAGES, MICRO_BATCHES, BATCH = 3, 4, 2
POLICIES = ["keep", "cpu", "nvme", "recompute", "recompute,nvme", "auto"]
SCHEDULES = ["gpipe", "1f1b"]


def test_the_driver_runs_1f1b_as_a_pipeline_does():
    ops = stage_ops("1f1b", 4, 6)
    text = [" ".join(f"{k}{i}" for k, i in stage) for stage in ops]
    assert text[0] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert text[3] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert stage_ops("gpipe", 2, 2) == [[("F", 0), ("F", 1), ("B", 0), ("B", 1)]] * 2


def _offloaders(policy, nvme_dir, stages=STAGES, **settings):
    offs = []
    for s in range(stages):
        kw = dict(settings)
        if "nvme" in policy:
            kw["nvme_dir"] = os.path.join(nvme_dir, f"stage{s}")
        if policy == "auto":
            kw.setdefault("device_budget", "50%")
        offs.append(offloader(policy, **kw))
    return offs


def _backward_numbers(kind, stage, steps):
    """The forward numbers (per stage, from 0) in the order the stage runs
    its backwards over ``steps`` optimizer steps."""
    order = [i for k, i in stage_ops(kind, STAGES, MICRO_BATCHES)[stage] if k == "B"]
    return [k * MICRO_BATCHES + i for k in range(steps) for i in order]


def _runs(seq):
    """``seq`` with each run of equal items collapsed to one."""
    return [x for j, x in enumerate(seq) if j == 0 or seq[j - 1] != x]


def _cases():
    """Every policy under 1F1B and cpu under GPipe by default; the rest slow."""
    for kind in SCHEDULES:
        for policy in POLICIES:
            fast = (kind == "1f1b" and policy != "recompute,nvme") or policy == "cpu"
            yield pytest.param(policy, kind, marks=() if fast else pytest.mark.slow,
                               id=f"{policy}-{kind}")


@pytest.mark.parametrize("policy,kind", list(_cases()))
def test_schedule_is_exact_and_restores_in_backward_order(policy, kind, nvme_dir):
    batches = make_batches(MICRO_BATCHES, BATCH, CFG)
    ref = train(make_stages(STAGES, CFG), batches, kind)
    offs = _offloaders(policy, nvme_dir)
    numbers = {}

    def on_op(s, op, ctx):
        if op[0] == "F":   # the forward numbers count per stage
            numbers.setdefault(s, []).append(tiermem.testing.step_number(ctx))

    stages = make_stages(STAGES, CFG)
    with tiermem.testing.record_restores(offs[0]) as r0, \
            tiermem.testing.record_restores(offs[1]) as r1, \
            tiermem.testing.record_restores(offs[2]) as r2:
        got = train(stages, batches, kind, contexts=[lambda o=o: o for o in offs],
                    on_op=on_op)
    for k, (a, b) in enumerate(zip(got, ref)):
        for i in range(MICRO_BATCHES):
            assert torch.equal(a["losses"][i], b["losses"][i]), (k, i)
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])), k
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), k
    assert numbers[0] == list(range(2 * MICRO_BATCHES))
    for s, seen in enumerate((r0, r1, r2)):
        if policy == "keep":
            assert seen == []
            continue
        assert seen, f"stage {s} restored nothing"
        steps = _runs([n for n, _ in seen])
        assert steps == _backward_numbers(kind, s, 2), (s, seen)
    for off in offs:
        off.close()


def test_a_backwards_end_starts_the_next_micro_batchs_restores(nvme_dir):
    # 1F1B on the first stage: each backward but the first finds its first
    # restores started before it began (at the end of the previous backward),
    # so none of its unpacks reads on demand.
    batches = make_batches(MICRO_BATCHES, BATCH, CFG)
    offs = _offloaders("cpu", nvme_dir)
    ctxs = {}

    def on_op(s, op, ctx):
        if s == 0 and op[0] == "F":
            ctxs[op[1]] = ctx
        if s == 0 and op[0] == "B" and op[1] + 1 in ctxs:
            nxt = ctxs[op[1] + 1]
            assert nxt.stats.prefetched_bytes > 0 and nxt.stats.prefetch_hits == 0, op

    train(make_stages(STAGES, CFG), batches, "1f1b", steps=1,
          contexts=[lambda o=o: o for o in offs], on_op=on_op)
    for i in range(1, MICRO_BATCHES):
        assert ctxs[i].stats.prefetch_misses == 0, (i, ctxs[i].stats)
    for off in offs:
        off.close()


def test_expect_backward_refuses_what_it_cannot_follow():
    off, other = offloader("cpu"), offloader("cpu")
    x = torch.randn(8, 8, requires_grad=True)
    with off as c0:
        y0 = x.exp().sum()
    with other as c_other:
        y_other = x.exp().sum()
    for bad in ("next", 1.0, None, True, 1, -2, c_other):
        with pytest.raises(tiermem.ConfigError, match="expect_backward"):
            off.expect_backward(bad)
    off.expect_backward(0)
    off.expect_backward(c0)
    y0.backward()
    with pytest.raises(tiermem.ConfigError, match="its backward has run"):
        off.expect_backward(c0)
    with pytest.raises(tiermem.ConfigError, match="out of range: 0 forwards"):
        off.expect_backward(0)
    y_other.backward()
    off.close()
    other.close()


def _stage0_kept(kind, stages, micro_batches, steps, **settings):
    """Run the schedule with stage 0 under one Offloader (``settings``): per
    optimizer step, the peak of bytes its forwards in flight keep at once,
    and the plans its forwards followed (``ctx.planning.plan``)."""
    cfg = GPTConfig(vocab=2, layers=1, width=32, heads=4, seq_len=32, dropout=0.1)
    batches = make_batches(micro_batches, BATCH, cfg)
    off = offloader(**settings)
    live, peaks, plans = {}, [], []

    def on_op(s, op, ctx):
        if s != 0:
            return
        if op[0] == "F":
            live[op[1]] = ctx.stats.bytes_by_tier["keep"]
            peaks[-1] = max(peaks[-1], sum(live.values()))
            plans[-1].append(None if ctx.planning is None else ctx.planning.plan)
        else:
            live.pop(op[1])

    stage_list = make_stages(stages, cfg)
    ctxs = [lambda: off] + [lambda: torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t)] * (stages - 1)
    for k in range(steps):
        peaks.append(0)
        plans.append([])
        train(stage_list, batches, kind, steps=1, contexts=ctxs, on_op=on_op)
    return off, peaks, plans


def test_auto_keeps_a_stage_within_its_budget_across_micro_batches():
    # 1F1B, 4 stages: the first stage has 4 micro-batches in flight. The
    # budget is 3/4 of what they keep at once without tiermem (within what
    # the tiers can free here); a plan made for one micro-batch at a time
    # would keep everything.
    kind, stages, n = "1f1b", 4, 6
    _, plain, _ = _stage0_kept(kind, stages, n, 1, policy="keep")
    budget = plain[0] * 3 // 4
    off, peaks, plans = _stage0_kept(kind, stages, n, 3, policy="auto",
                                     device_budget=budget)
    planner = tiermem.testing.planner_of(off)
    assert 0 < peaks[-1] <= budget * 1.05, (peaks, budget)
    assert off.plan.in_flight == stages
    # One plan for every micro-batch of the last step: none re-planned per
    # micro-batch, one profile in all.
    last = plans[-1]
    assert len(last) == n and all(p is last[0] for p in last) and last[0] is not None
    assert planner.profiles == 1 and len(planner.plans) == 1
    off.close()


def test_only_forwards_a_backward_may_follow_count_as_in_flight():
    # A forward under no_grad (nothing saved) and one whose graph was dropped
    # without a backward are not in flight, even while their contexts live.
    off = offloader("cpu")
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with torch.no_grad(), off as c_eval:
        lin(x)
    with off as c_dropped:
        y = lin(x).relu().sum()
    del y
    with off as c0:
        y0 = lin(x).relu().sum()
    assert tiermem.testing.peak_in_flight(off) == 1
    with off as c1:
        y1 = lin(x).relu().sum()
    assert tiermem.testing.peak_in_flight(off) == 2
    y0.backward()
    y1.backward()
    assert c_eval is not None and c_dropped is not None and c0 is not None and c1 is not None
    off.close()
