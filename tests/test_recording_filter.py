"""Recording only what recipes use (NOTE [Recording only what recipes use] in
tiermem/tracking/producers.py): a step following an auto plan records no op that is
not recomputable, and per module only the ops its plan's recipes ran there;
it trains bit-identically, recomputes the same tensors with the same stored
inputs as a step that records every op in its scope, and a filter missing an
op of a recipe's chain changes what is recomputed (so the comparison can
fail) but never the values.

Runtime: ~20 s on 2 shared cores (measured 2026-12-01).
"""

import contextlib

import pytest
import torch
import torch.nn as nn

import tiermem
import tiermem.offloader
import tiermem.testing
import tiermem.planner.tracking_cost as runtime
from helpers import assert_same_step, compare_records, offloader, reference_steps, run_step
from models import make_case
from tiermem.tracking.producers import ProducerMode


class _Made(ProducerMode):
    """ProducerMode that keeps every instance made (class attribute ``made``)
    and the number of records it held when the step cleared them."""

    made: list = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorded = 0
        type(self).made.append(self)

    def clear(self) -> None:
        self.recorded = max(self.recorded, tiermem.testing.records_held(self))
        super().clear()


@pytest.fixture
def made(monkeypatch):
    monkeypatch.setattr(_Made, "made", [])
    with tiermem.testing.step_producer_mode(_Made):
        yield _Made


def _stats(off) -> tuple:
    s = off.stats
    return (dict(s.count_by_tier), dict(s.bytes_by_tier), s.recompute_input_bytes,
            s.recompute_fallbacks)


def _train(name: str, steps: int, made):
    """``steps`` AdamW steps of case ``name`` under an auto Offloader at 25%:
    per step its stats and the number of records its mode made."""
    off = offloader("auto", device_budget="25%")
    case = make_case(name)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    records, per_step = [], []
    for i in range(steps):
        made.made = []
        loss, grads = run_step(case.model, case.inputs, off, seed=10 + i, loss_fn=case.loss_fn)
        opt.step()
        params = {n: p.detach().clone() for n, p in case.model.named_parameters()}
        records.append((loss, grads, params))
        held = sum(max(m.recorded, tiermem.testing.records_held(m)) for m in made.made)
        per_step.append((_stats(off), held, [m.names for m in made.made]))
    plan = off.plan
    off.close()
    return records, per_step, plan


@pytest.mark.parametrize("name", ["mlp", "block", "embed_gather", "block_bf16"])
def test_planned_steps_record_less_and_recompute_as_recording_everything_would(
        name, made, monkeypatch):
    ref = reference_steps(name, steps=4)
    with monkeypatch.context() as mp:   # every recomputable op in the scope recorded
        mp.setattr(runtime, "tracking_ops", lambda plan, profile: None)
        every, every_steps, every_plan = _train(name, 4, made)
    got, got_steps, plan = _train(name, 4, made)
    compare_records(every, ref, name + " (every op recorded)")
    compare_records(got, ref, name)
    assert plan.recomputes and plan.tracking_ops, name
    assert set(plan.tracking_ops) == set(plan.tracking_scope), "one op set per module of the scope"
    assert every_plan.tracking_ops is None
    # Steps 0-1 profile and plan (op names recorded); 2-3 follow the plan.
    for step in (2, 3):
        stats, records, names = got_steps[step]
        every_stats, every_records, _ = every_steps[step]
        assert stats == every_stats, f"{name} step {step}: {stats} != {every_stats}"
        assert stats[0]["recompute"] > 0 and stats[3] == 0, stats
        assert names == [False], names
        # Fewer, or as many where the scope runs no recomputable op the
        # recipes do not use (mlp, embed_gather: their scopes run only their
        # recipes' ops; the pack hook's own detaches are recorded by neither:
        # NOTE [The pack hook runs untracked] in tracking/dispatch.py).
        assert 0 < records <= every_records, (records, every_records)
        if name.startswith("block"):   # attention's other ops: recorded only by "every"
            assert records < every_records, (records, every_records)
    assert got_steps[0][2] == [True], "the profile records op names"


class _Chain(nn.Module):
    """``w = neg(sigmoid(lin(x))) * 3`` saved by ``sin``: its recipe is
    ``mul(neg(u), 3)`` with ``u`` the saved sigmoid output (no bytes); ``neg``'s
    output is a temporary, gone by the time ``w`` is saved."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.out = nn.Linear(64, 64)

    def forward(self, x):
        u = torch.sigmoid(self.lin(x))
        w = torch.neg(u) * 3.0
        return self.out(torch.sin(w))


def _chain_steps(ctx_factory, steps: int = 4):
    torch.manual_seed(0)
    model = _Chain()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    out = []
    for i in range(steps):
        ctx = ctx_factory()
        out.append((run_step(model, (x,), ctx, seed=i),
                    None if ctx is None or not hasattr(ctx, "stats") else _stats(ctx)))
    return out


def test_a_filter_missing_an_op_of_a_recipe_chain_changes_what_is_recomputed_not_values(
        monkeypatch):
    """The plan's recipe for ``w`` runs ``mul`` and ``neg`` in ``_Chain``; a
    planned step recording them recomputes what the profile did. Without
    ``neg`` recorded, ``w``'s recipe cannot be built (its input is gone): it
    falls back to the next tier (the stats differ), and the gradients are
    still those of a run without tiermem."""
    ref = _chain_steps(contextlib.nullcontext)
    off = offloader("auto", device_budget="10%")
    got = _chain_steps(lambda: off)
    for (g, _), (r, _) in zip(got, ref):
        assert_same_step(g, r)
    ops = off.plan.tracking_ops
    assert {"mul", "neg"} <= ops["_Chain"], ops
    planned = got[3][1]
    assert planned[0]["recompute"] >= 2 and planned[3] == 0, planned

    def without_neg(plan, profile):
        ops = runtime_tracking_ops(plan, profile)
        return {m: n - {"neg"} for m, n in ops.items()}

    runtime_tracking_ops = runtime.tracking_ops
    monkeypatch.setattr(runtime, "tracking_ops", without_neg)
    # Calls recorded whole (NOTE [Calls recorded whole] in tracking/producers.py) are
    # not filtered by op: every call goes through the mode here.
    monkeypatch.setattr(runtime, "tracking_direct", lambda plan, calls, profile: None)
    off2 = offloader("auto", device_budget="10%")
    got2 = _chain_steps(lambda: off2)
    for (g, _), (r, _) in zip(got2, ref):
        assert_same_step(g, r)
    assert "neg" not in off2.plan.tracking_ops["_Chain"]
    too_few = got2[3][1]
    assert too_few != planned, "a recipe op left out must show in the stats"
    assert too_few[0]["recompute"] < planned[0]["recompute"] and too_few[3] >= 1, too_few
    off.close()
    off2.close()


def test_an_unrecorded_write_still_taints_a_dropped_tensor():
    """NOTE [Writes to dropped tensors] holds for ops the mode does not record:
    an in-place op (never recomputable) on a watched storage taints it."""

    class Handle:
        tainted = False

    mode = ProducerMode(names=False)
    mode.wanted = frozenset()
    t = torch.randn(8)
    h = Handle()
    mode.watch(t, h)
    with mode:
        v = t.view(2, 4)
        s = torch.sin(t)
        v.mul_(2.0)
    assert h.tainted
    assert mode.record_of(v) is None and mode.record_of(s) is None, "nothing wanted: no record"


def test_names_false_records_recomputable_ops_only():
    mode = ProducerMode(names=False)
    a = torch.randn(4, 4)
    with mode:
        b = torch.mm(a, a)      # not recomputable: no record
        c = torch.sin(b)        # recomputable: a full record
        d = c.view(16)          # a view of it
    assert mode.record_of(b) is None and mode.op_name(b) is None
    assert mode.record_of(c).func is torch.ops.aten.sin.default
    assert mode.record_of(d).name == "view"
    named = ProducerMode()
    with named:
        b = torch.mm(a, a)
        d = torch.sin(b).view(16)
    assert named.op_name(b) == "mm" and named.record_of(b).func is None
    assert named.op_name(d) == "sin", "views looked through"


def test_only_steps_following_a_plan_drop_op_names(made):
    """Op names are recorded where something reads them: a fixed recompute
    policy (fallback reasons), a callable policy, an auto profile, an auto
    Offloader with hints; not in a step following a plan."""
    case = make_case("mlp")
    for policy, kw in (("recompute,keep", {}), (lambda info: "recompute", {}),
                       ("auto", {"device_budget": "25%", "hints": lambda info: None})):
        off = offloader(policy, **kw)
        for _ in range(3):
            made.made = []
            with off:
                loss = case.loss()
            loss.backward()
            assert made.made and all(m.names for m in made.made), policy
        off.close()
    off = offloader("auto", device_budget="25%")
    seen = []
    for _ in range(3):
        made.made = []
        with off as ctx:
            loss = case.loss()
        loss.backward()
        seen.append(([m.names for m in made.made], ctx.tracking))
    assert seen[0][0] == [True] and seen[2][0] == [False], seen
    assert seen[2][1].ops == off.plan.tracking_ops
    off.close()
