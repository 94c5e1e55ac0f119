"""Per-tensor hints to the auto planner (issue 12 item 4; NOTE [Planner hints]
in tiermem/planner/hints.py): ``Offloader(policy="auto", hints=fn)``.

MUST_* answers are obeyed in every step (profile, planned, safe order) at
several budgets, with gradients bit-identical, and a budget they put out of
reach is said; PREFER_* answers and tier names are followed where the budget
needs bytes and overridden, with the reason, where it does not or where the
hinted tier frees nothing; the callable is never called in a step that
follows its plan; bad settings and bad answers are errors naming them.

On the CPU only recompute and nvme free RAM: the budgets below 100% run with
an nvme_dir (Python engine). models.Block's recomputable saves (measured in
its profile): the layer norms' outputs and statistics (op
``native_layer_norm``), attention's ``mul`` and the MLP's ``gelu``.
Runtime: about 10-20 s for the file on 2 shared cores (2026-12-01).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy as CP

import tiermem
import tiermem.testing
import tiermem.runtime.hooks
from helpers import compare_records, offloader, reference_steps, run_step, train_steps
from models import make_case
from tiermem.planner.lifecycle import KEPT_TOLERANCE
from tiermem.tiers.keep import Kept, KickKept, MarkedKept
from tiermem.tiers.recompute import RecomputeHandle

STEPS = 4
RECOMPUTABLE = ("native_layer_norm", "mul", "gelu")


def _tier_of(handle) -> str:
    if type(handle) in (Kept, KickKept, MarkedKept):   # NOTE [Restores start with backward]
        return "keep"
    if type(handle) is RecomputeHandle:
        return "recompute"
    return handle.store.tier.value


class _Spy:
    """Per step: how often the hints callable was asked, and where each tensor
    of a pack index went (``steps[i][index]``: the handle's tier). Read at the
    pack hook (``Packer.__call__``), so planned keeps, which never reach
    ``Placement.put``, are seen too: a tensor got index ``i`` when the step's
    index counter moved from ``i`` to ``i + 1``."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.steps = []
        self.asked = []
        self._step = None

    def hints(self, info):
        self.asked[-1] += 1
        return self.answer(info)

    def see(self, step) -> None:
        if step is not self._step:   # a new step
            self._step = step
            self.steps.append({})
            self.asked.append(0)

    def packed(self, step, before: int, handle) -> None:
        if step.index == before + 1:
            self.steps[-1][before] = _tier_of(handle)


@pytest.fixture
def spy_on(monkeypatch):
    """``spy_on(answer)``: a :class:`_Spy` watching every pack hook of the test."""
    spies = []
    orig = tiermem.runtime.hooks.Packer.__call__

    def call(self, t):
        before = self.step.index
        for spy in spies:
            spy.see(self.step)
        handle = orig(self, t)
        for spy in spies:
            spy.packed(self.step, before, handle)
        return handle

    monkeypatch.setattr(tiermem.runtime.hooks.Packer, "__call__", call)

    def make(answer):
        spies.append(_Spy(answer))
        return spies[-1]
    return make


def _hinted_run(spy, name="block", steps=STEPS, **settings):
    """``steps`` training steps of ``name`` under auto with ``spy``'s answers
    as hints; returns (offloader, records). Gradients are compared by the caller."""
    off = offloader("auto", hints=spy.hints, **settings)
    records = train_steps(make_case(name), lambda: off, steps=steps)
    return off, records


def _plan_tensors(plan, pred):
    return [p for p in plan.tensors if pred(p)]


# ---------------------------------------------------------------------------
# MUST answers: constraints
# ---------------------------------------------------------------------------

def _musts(info):
    if info.module == "Block.attn.proj" or info.op == "_safe_softmax":
        return CP.MUST_SAVE
    if info.op == "gelu":
        return CP.MUST_RECOMPUTE
    if info.module == "Block.mlp.1":
        return CP.MUST_CPU_OFFLOAD
    return None


_MUST_TIER = {CP.MUST_SAVE: "keep", CP.MUST_RECOMPUTE: "recompute", CP.MUST_CPU_OFFLOAD: "cpu"}


@pytest.mark.parametrize("budget", ["100%", "50%", "25%"])
def test_must_answers_are_obeyed_in_every_step_with_exact_gradients(budget, nvme_dir, spy_on):
    spy = spy_on(_musts)
    off, records = _hinted_run(spy, device_budget=budget, nvme_dir=nvme_dir)
    compare_records(records, reference_steps("block", steps=STEPS), "block")
    plan = off.plan
    musts = _plan_tensors(plan, lambda p: p.must)
    assert {p.hint for p in musts} == {"MUST_SAVE", "MUST_RECOMPUTE", "MUST_CPU_OFFLOAD"}
    for p in musts:   # the plan's tier and order obey the answer
        assert p.tier == _MUST_TIER[CP[p.hint]], p
        assert p.order[0] == p.tier and "a constraint" in p.reason, p
    # Every step, the profile included: the answered tensors went to their tier.
    want = {p.index: _MUST_TIER[CP[p.hint]] for p in musts}
    assert len(spy.steps) == STEPS
    for i, placed in enumerate(spy.steps):
        assert len(placed) == len(plan.tensors), (i, placed)
        assert {k: placed[k] for k in want} == want, (i, placed)
    if budget == "100%":   # everything fits: only the MUSTs move
        assert all(p.tier == "keep" for p in plan.tensors if not p.must)
        for placed in spy.steps[1:]:
            assert all(placed[p.index] == "keep" for p in plan.tensors if not p.must)
        assert not plan.notes
    off.close()


def test_must_answers_count_against_the_budget_and_a_budget_they_block_is_said(
        nvme_dir, spy_on):
    # 50%: reachable with the MUSTs counted (the cpu tier's CPU tensor as kept).
    off, _ = _hinted_run(spy_on(_musts), device_budget="50%", nvme_dir=nvme_dir)
    plan = off.plan
    assert not any(n.startswith("budget not reachable") for n in plan.notes), plan.notes
    assert plan.predicted_kept_bytes <= plan.budget_bytes
    assert sum(p.nbytes for p in plan.tensors if p.tier == "cpu") > 0
    # What stays in RAM (kept, and the cpu tier's copies: the same RAM) is in budget.
    by = off.stats.bytes_by_tier
    assert by["keep"] + by["cpu"] <= plan.budget_bytes * (1 + KEPT_TOLERANCE), by
    off.close()
    # 25%: the MUST_SAVE and MUST_CPU_OFFLOAD bytes alone exceed the budget.
    off, records = _hinted_run(spy_on(_musts), device_budget="25%",
                               nvme_dir=nvme_dir + "-25")
    compare_records(records, reference_steps("block", steps=STEPS), "block")
    plan = off.plan
    note = [n for n in plan.notes if n.startswith("budget not reachable")]
    assert note and "MUST answers of the hints keep" in note[0], plan.notes
    assert note[0].endswith("(constraints: without them it would be reachable)"), note
    must_kept = sum(p.nbytes for p in plan.tensors if p.must and p.tier != "recompute")
    assert must_kept > plan.budget_bytes
    off.close()


def test_must_recompute_of_an_unrecomputable_tensor_raises_in_the_forward():
    off = offloader("auto", device_budget="50%",
                    hints=lambda info: CP.MUST_RECOMPUTE if info.op == "addmm" else None)
    case = make_case("mlp")
    with pytest.raises(tiermem.TierMemError, match="addmm"):
        with off:
            case.loss()
    off.close()


# ---------------------------------------------------------------------------
# PREFER answers and tier names: hints
# ---------------------------------------------------------------------------

def test_prefer_recompute_is_followed_where_the_budget_needs_bytes(nvme_dir, tmp_path, spy_on):
    hinted_ops = ("native_layer_norm", "mul")
    # Without hints, at 50% with an nvme_dir, the planner moves some of them otherwise.
    off, _ = _hinted_run(spy_on(lambda info: None), device_budget="50%",
                         nvme_dir=str(tmp_path / "plain"))
    unhinted = off.plan
    off.close()
    assert any(p.tier != "recompute" for p in unhinted.tensors if p.op in hinted_ops)

    spy = spy_on(lambda info: CP.PREFER_RECOMPUTE if info.op in hinted_ops else None)
    off, records = _hinted_run(spy, device_budget="50%", nvme_dir=nvme_dir)
    compare_records(records, reference_steps("block", steps=STEPS), "block")
    plan = off.plan
    hinted = _plan_tensors(plan, lambda p: p.hint is not None)
    assert hinted and all(p.op in hinted_ops and p.hint == "PREFER_RECOMPUTE" for p in hinted)
    for p in hinted:
        assert p.tier == "recompute", plan.explain(p.index)
        assert p.reason.endswith("; hint PREFER_RECOMPUTE followed"), p.reason
    assert not any(p.must for p in plan.tensors)
    for placed in spy.steps[1:]:   # planned steps recompute them
        assert [placed[p.index] for p in hinted] == ["recompute"] * len(hinted)
    off.close()


def test_prefer_hints_are_not_followed_when_everything_fits(nvme_dir, spy_on):
    spy = spy_on(lambda info: CP.PREFER_RECOMPUTE if info.op in RECOMPUTABLE else "nvme")
    off, records = _hinted_run(spy, device_budget="100%", nvme_dir=nvme_dir)
    compare_records(records, reference_steps("block", steps=STEPS), "block")
    plan = off.plan
    assert all(p.tier == "keep" for p in plan.tensors)
    for p in plan.tensors:
        assert p.reason.startswith("kept: everything fits"), p.reason
        assert p.reason.endswith(f"; hint {p.hint} not followed: the budget is met without "
                                 "moving it"), p.reason
    assert {p.hint for p in plan.tensors} == {"PREFER_RECOMPUTE", "'nvme'"}
    for placed in spy.steps[1:]:
        assert set(placed.values()) == {"keep"}
    off.close()


def test_prefer_save_is_kept_unless_the_budget_needs_it(nvme_dir, tmp_path, spy_on):
    few = ("Block.mlp.1",)   # 16 KiB of a 100.5 KiB step
    off, records = _hinted_run(
        spy_on(lambda info: CP.PREFER_SAVE if info.module in few else None),
        device_budget="50%", nvme_dir=nvme_dir)
    compare_records(records, reference_steps("block", steps=STEPS), "block")
    plan = off.plan
    hinted = _plan_tensors(plan, lambda p: p.hint is not None)
    assert hinted and all(p.tier == "keep" and p.reason.endswith("; hint PREFER_SAVE followed")
                          for p in hinted), [p.reason for p in hinted]
    off.close()
    # Every tensor PREFER_SAVE at 25%: the budget can only be met by moving some.
    off, records = _hinted_run(spy_on(lambda info: CP.PREFER_SAVE), device_budget="25%",
                               nvme_dir=str(tmp_path / "all"))
    compare_records(records, reference_steps("block", steps=STEPS), "block")
    plan = off.plan
    moved = _plan_tensors(plan, lambda p: p.tier != "keep")
    assert moved and all("; hint PREFER_SAVE overridden: the budget was still" in p.reason
                         for p in moved), [p.reason for p in moved]
    assert plan.predicted_kept_bytes <= plan.budget_bytes
    assert plan.measured_kept_bytes <= plan.budget_bytes * (1 + KEPT_TOLERANCE)
    off.close()


def test_a_hinted_tier_that_frees_nothing_here_is_overridden_with_the_reason(nvme_dir, spy_on):
    # On the CPU the cpu tier holds a CPU tensor in the same RAM: it frees nothing.
    off, records = _hinted_run(spy_on(lambda info: CP.PREFER_CPU_OFFLOAD), name="mlp",
                               device_budget="25%", nvme_dir=nvme_dir)
    compare_records(records, reference_steps("mlp", steps=STEPS), "mlp")
    plan = off.plan
    why = "; hint PREFER_CPU_OFFLOAD overridden: the cpu tier would hold a CPU tensor in the " \
          "same RAM"
    for p in plan.tensors:
        assert p.tier != "cpu"
        assert p.reason.endswith(why) or p.reason.endswith(
            "; hint PREFER_CPU_OFFLOAD not followed: the budget is met without moving it"), \
            p.reason
    assert any(p.tier == "nvme" and p.reason.endswith(why) for p in plan.tensors)
    off.close()


# ---------------------------------------------------------------------------
# The hot path: asked off the plan only
# ---------------------------------------------------------------------------

def test_the_callable_is_asked_only_off_the_plan_and_musts_hold_in_a_safe_step(
        nvme_dir, spy_on):
    """Profile: asked per tensor; planned steps: never; a step of a new shape
    (no plan: the safe order) asks again and obeys its MUSTs."""
    spy = spy_on(_musts)
    off, _ = _hinted_run(spy, device_budget="50%", nvme_dir=nvme_dir)
    plan = off.plan
    n = len(plan.tensors)
    assert spy.asked == [n, 0, 0, 0], spy.asked
    case = make_case("block")
    run_step(case.model, (torch.randn(3, 16, 32),), off)   # another batch size
    assert spy.asked[-1] == n and tiermem.testing.planner_of(off).plans.get(plan.keys) is plan
    want = {p.index: _MUST_TIER[CP[p.hint]] for p in plan.tensors if p.must}
    assert {k: spy.steps[-1][k] for k in want} == want
    off.close()


# ---------------------------------------------------------------------------
# Explaining, settings, answers
# ---------------------------------------------------------------------------

def test_the_plan_names_each_hint(nvme_dir, spy_on):
    off, _ = _hinted_run(spy_on(
        lambda info: CP.MUST_SAVE if info.op == "_safe_softmax"
        else [CP.PREFER_RECOMPUTE, "nvme"] if info.op == "gelu" else None),
        device_budget="50%", nvme_dir=nvme_dir)
    plan = off.plan
    names = {p.hint for p in plan.tensors if p.hint}
    assert names == {"MUST_SAVE", "[PREFER_RECOMPUTE, 'nvme']"}
    for p in plan.tensors:
        if p.hint:
            assert p.hint in plan.explain(p.index)
    assert "hints: 2 tensors answered, 1 MUST (obeyed), 1 hints (1 followed" in str(plan)
    d = plan.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert {t["hint"] for t in d["tensors"]} == {None, "MUST_SAVE", "[PREFER_RECOMPUTE, 'nvme']"}
    off.close()


@pytest.mark.parametrize("policy", ["cpu", "keep", None, "recompute,cpu"])
def test_hints_without_the_auto_policy_is_a_config_error(policy):
    with pytest.raises(tiermem.ConfigError, match=r"hints=.*policy="):
        tiermem.Offloader(policy=policy, hints=lambda info: None)
    with pytest.raises(tiermem.ConfigError, match="hints="):
        tiermem.offload(policy=policy, hints=lambda info: None)


def test_hints_must_be_callable():
    with pytest.raises(tiermem.ConfigError, match="hints=.*MUST_SAVE.*not callable"):
        tiermem.Offloader(policy="auto", hints=CP.MUST_SAVE)


def test_hints_with_auto_from_the_environment(monkeypatch):
    monkeypatch.setenv("TIERMEM_POLICY", "auto")
    off = tiermem.Offloader(hints=lambda info: None, min_offload_bytes=0)
    assert off.hints is not None and tiermem.testing.planner_of(off).hints is not None
    off.close()
    a = tiermem.offload(hints=_musts)
    assert tiermem.offload(hints=_musts) is a and tiermem.offload() is not a


@pytest.mark.parametrize("bad", ["bogus", 3, [], [CP.PREFER_SAVE, CP.MUST_SAVE]])
def test_a_bad_answer_is_an_error_naming_it(bad):
    off = offloader("auto", hints=lambda info: bad)
    case = make_case("mlp")
    with pytest.raises(tiermem.TierMemError,
                       match=r"the hints callable returned .*asked for tensor #0"):
        with off:
            case.loss()
    off.close()


# ---------------------------------------------------------------------------
# CUDA: the cpu tier frees device memory (not run in CI: no GPU there)
# ---------------------------------------------------------------------------

def _cuda_case():
    case = make_case("block")
    case.model.cuda()
    case.inputs = tuple(x.cuda() for x in case.inputs)
    return case


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_cpu_offload_answers_on_cuda(spy_on):
    """MUST_CPU_OFFLOAD obeyed and PREFER_CPU_OFFLOAD followed (the budget
    needs more than they free) on CUDA tensors, every step, gradients exact."""
    import contextlib

    def answer(info):
        if info.module == "Block.mlp.1":
            return CP.MUST_CPU_OFFLOAD
        return CP.PREFER_CPU_OFFLOAD if info.op == "native_layer_norm" else None

    spy = spy_on(answer)
    off = offloader("auto", device_budget="50%", hints=spy.hints)
    records = train_steps(_cuda_case(), lambda: off, steps=STEPS)
    ref = train_steps(_cuda_case(), contextlib.nullcontext, steps=STEPS)
    compare_records(records, ref, "block on cuda")
    plan = off.plan
    must = [p for p in plan.tensors if p.must]
    prefer = [p for p in plan.tensors if p.hint == "PREFER_CPU_OFFLOAD"]
    assert must and all(p.tier == "cpu" and p.order[0] == "cpu" for p in must), must
    assert prefer and all(p.tier == "cpu" and p.reason.endswith("followed")
                          for p in prefer), [p.reason for p in prefer]
    for placed in spy.steps:
        assert {placed[p.index] for p in must} == {"cpu"}, placed
    for placed in spy.steps[1:]:
        assert {placed[p.index] for p in prefer} == {"cpu"}, placed
    off.close()
