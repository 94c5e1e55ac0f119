"""policy="auto" over steps that vary: the planner never raises from a hook,
converges when signatures take turns, lets a profile that is never
backwarded expire, obeys shape-dependent MUST hints on resized plans, names
a failed disk probe in the plan and retries it, and names the value of every
budget it warns about (issue 29)."""

import logging
import os

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import tiermem
import tiermem.testing
from helpers import offloader


class Branchy(torch.nn.Module):
    """Two tanh layers, or (``wide``) a wider detour in their place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 96)
        self.d = torch.nn.Linear(96, 32)

    def forward(self, x, wide=False):
        h = torch.tanh(self.a(x))
        h = self.d(torch.tanh(self.c(h))) if wide else torch.tanh(self.b(h))
        h = torch.tanh(self.b(h))
        return h.square().mean()


def _step(off, model, rows, wide=False, backward=True):
    with off:
        loss = model(torch.randn(rows, 16), wide=wide)
    if backward:
        loss.backward()
    return loss


def test_a_step_leaving_a_resized_plan_for_another_branch_runs(nvme_dir):
    model = Branchy()
    off = offloader("auto", device_budget="2KiB", nvme_dir=nvme_dir)
    for rows in (40, 40, 30, 30, 20, 20, 25, 25):   # 25 follows a resized plan
        _step(off, model, rows)
    assert "other sizes" in str(off.plan)
    _step(off, model, 25, wide=True)
    off.close()


@pytest.mark.parametrize("turns", [2, 3])
def test_signatures_taking_turns_each_get_a_plan_within_three_of_their_steps(nvme_dir, turns):
    model = Branchy()
    off = offloader("auto", device_budget="50%", nvme_dir=nvme_dir)
    planner = tiermem.testing.planner_of(off)
    rows = [8, 12, 16][:turns]
    for _ in range(3):
        for r in rows:
            _step(off, model, r)
    off.plan   # settles the last profile
    assert len(planner.plans) == turns, planner.plans.keys()
    assert planner.profiles == turns
    off.close()


def test_two_models_trained_in_turn_under_one_offloader_each_get_a_plan(nvme_dir):
    first, second = Branchy(), Branchy()
    off = offloader("auto", device_budget="50%", nvme_dir=nvme_dir)
    planner = tiermem.testing.planner_of(off)
    for _ in range(3):
        _step(off, first, 8)
        _step(off, second, 8, wide=True)
    off.plan
    assert len(planner.plans) == 2 and planner.profiles == 2
    off.close()


def test_a_profile_never_backwarded_expires_and_a_later_step_profiles(nvme_dir):
    from tiermem.planner.lifecycle import PROFILE_EXPIRY_STEPS
    model = Branchy()
    off = offloader("auto", device_budget="50%", nvme_dir=nvme_dir)
    kept = _step(off, model, 8, backward=False)   # held, never backwarded
    for _ in range(PROFILE_EXPIRY_STEPS + 2):
        _step(off, model, 8)
    assert off.plan is not None
    del kept
    off.close()


def test_a_shape_dependent_must_save_hint_is_obeyed_on_resized_plans(nvme_dir):
    """Hints answer MUST_SAVE for batches above 30 rows: every such step keeps
    all it saves, also a 35-row step that follows a plan made for other sizes."""
    def hints(info):
        return CheckpointPolicy.MUST_SAVE if info.shape[0] > 30 else None

    model = Branchy()
    off = offloader("auto", device_budget="25%", nvme_dir=nvme_dir, hints=hints)
    for rows in (10, 10, 20, 20, 28, 28, 24, 24):   # 24 follows a resized plan
        _step(off, model, rows)
    assert off.stats.count_by_tier["nvme"] + off.stats.count_by_tier["recompute"] > 0
    _step(off, model, 35)
    by = off.stats.count_by_tier
    assert by["nvme"] == by["cpu"] == by["recompute"] == 0, by
    off.close()


def test_a_failed_disk_probe_is_named_in_the_plan_and_retried_at_the_next_profile(nvme_dir):
    model = Branchy()
    off = offloader("auto", device_budget="25%", nvme_dir=nvme_dir)
    _step(off, model, 8)
    private_dir = os.path.dirname(tiermem.testing.store_of(off, tiermem.Tier.NVME).path)
    tiermem.testing.remove_private_dir(off)   # the probe's file cannot be made
    text = str(off.plan)
    assert "nvme: disk probe failed:" in text and f"MiB needed in {private_dir}" in text, text
    os.makedirs(private_dir)
    _step(off, model, 16)   # another signature: profiled
    _step(off, model, 16)
    assert "disk probe failed" not in str(off.plan)
    assert off.stats.count_by_tier["nvme"] > 0
    off.close()


def test_a_size_budget_out_of_reach_warns_with_its_value(caplog):
    model = Branchy()
    off = offloader("auto", device_budget=64)   # no nvme tier: out of reach
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        _step(off, model, 8)
        off.plan
    warned = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    assert warned and all("64 bytes" in w for w in warned), warned
    off.close()


# -- one test per transition of the state table (planner/lifecycle.py) ---------------

def test_the_first_step_is_profiled_and_its_backward_makes_the_plan(nvme_dir):
    model = Branchy()
    off = offloader("auto", device_budget="50%", nvme_dir=nvme_dir)
    planner = tiermem.testing.planner_of(off)
    _step(off, model, 8)
    assert planner.profiles == 1 and off.plan is not None
    off.close()


def test_a_step_leaving_every_plan_asks_for_a_profile_and_is_safe_ordered_alone(nvme_dir):
    model = Branchy()
    off = offloader("auto", device_budget="50%", nvme_dir=nvme_dir)
    planner = tiermem.testing.planner_of(off)
    _step(off, model, 8)
    plan = off.plan
    _step(off, model, 8, wide=True)
    assert len(planner.requests) == 1 and planner.profiles == 1
    _step(off, model, 8)   # its own plan again, no profile
    assert off.plan is plan and planner.profiles == 1
    off.close()


def test_a_requested_signature_is_profiled_at_its_next_step(nvme_dir):
    model = Branchy()
    off = offloader("auto", device_budget="50%", nvme_dir=nvme_dir)
    planner = tiermem.testing.planner_of(off)
    _step(off, model, 8)
    _step(off, model, 8, wide=True)
    _step(off, model, 8, wide=True)
    off.plan
    assert planner.profiles == 2 and len(planner.plans) == 2 and not planner.requests
    off.close()


def test_a_request_passed_over_too_often_is_forgotten(nvme_dir):
    from tiermem.planner.lifecycle import REQUEST_ATTEMPTS
    model = Branchy()
    off = offloader("auto", device_budget="50%", nvme_dir=nvme_dir)
    planner = tiermem.testing.planner_of(off)
    _step(off, model, 8)
    _step(off, model, 8, wide=True)   # once only
    for _ in range(REQUEST_ATTEMPTS):
        _step(off, model, 8)
    assert not planner.requests and planner.profiles == 1
    off.close()


def test_a_profiled_forward_that_raises_is_profiled_again(nvme_dir):
    model = Branchy()
    off = offloader("auto", device_budget="50%", nvme_dir=nvme_dir)
    planner = tiermem.testing.planner_of(off)
    with pytest.raises(ValueError):
        with off:
            model(torch.randn(8, 16))
            raise ValueError("a bad batch")
    assert planner.profiles == 0
    _step(off, model, 8)
    assert planner.profiles == 1 and off.plan is not None
    off.close()


def test_a_planned_signature_that_returns_reuses_its_plan(nvme_dir):
    model = Branchy()
    off = offloader("auto", device_budget="50%", nvme_dir=nvme_dir)
    planner = tiermem.testing.planner_of(off)
    for _ in range(2):
        _step(off, model, 8)
        _step(off, model, 8, wide=True)
    off.plan   # settles the second profile
    first, second = (p.signature for p in planner.plans.values())
    for _ in range(3):
        _step(off, model, 8)
        assert off.plan.signature == first
        _step(off, model, 8, wide=True)
        assert off.plan.signature == second
    assert planner.profiles == 2
    off.close()


# -- fuzzed step sequences --------------------------------------------------------------

class _Boom(Exception):
    pass


def _fuzz(steps, nvme_dir, seed):
    import copy
    import random
    rng = random.Random(seed)
    model = Branchy()
    ref = copy.deepcopy(model)
    off = offloader("auto", device_budget=rng.choice(["50%", "25%", "4KiB"]),
                    nvme_dir=nvme_dir)
    planner = tiermem.testing.planner_of(off)
    kinds = [(rows, wide) for rows in (8, 12, 20) for wide in (False, True)]
    kinds = rng.sample(kinds, rng.randint(2, 4))
    seen, held = set(), []
    for i in range(steps):
        rows, wide = rng.choice(kinds) if rng.random() < 0.7 else kinds[i % len(kinds)]
        x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(i))
        fate = rng.random()
        if fate < 0.05:   # an exception in forward
            with pytest.raises(_Boom):
                with off:
                    model(x, wide=wide)
                    raise _Boom()
            continue
        seen.add((rows, wide))
        with off:
            loss = model(x, wide=wide)
        if fate < 0.12:   # discarded, or held for a while, never backwarded
            if rng.random() < 0.5:
                held.append(loss)
            del held[:-3]
            continue
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss.backward()
        expected = ref(x, wide=wide)
        expected.backward()
        assert torch.equal(loss, expected), i
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), (i, name)
            assert p.grad is None or torch.equal(p.grad, q.grad), (i, name)
    off.plan
    replans = sum(p.replans for p in planner.plans.values())
    assert planner.profiles - planner.profiles_dropped <= len(seen) + replans, (
        planner.profiles, planner.profiles_dropped, len(seen), replans)
    off.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzzed_step_sequences_never_raise_from_a_hook_and_stay_exact(nvme_dir, seed):
    _fuzz(200, nvme_dir, seed)


@pytest.mark.slow
def test_a_long_fuzzed_step_sequence_never_raises_and_stays_exact(nvme_dir):
    _fuzz(1000, nvme_dir, 7)
