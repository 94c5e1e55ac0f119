"""The auto planner's choice (the HiGHS model, NOTE [Planner choice] in
tiermem/planner/milp.py), checked against brute force over every option
assignment on small made-up profiles (deterministic prices): the optimum
where the greedy is strictly worse, never worse than the greedy, the budget
met whenever it is reachable, tier rooms respected, MUST answers obeyed."""

import itertools
import random

import pytest
import torch

import tiermem.testing
from tiermem.planner.profile import BlockInput, BlockRecord, Profile, TensorRecord
from tiermem.planner.rates import Rates
from tiermem.planner.costs import BlockOption, options_of
from tiermem.planner.solver import make_plan
from tiermem.policy import Tier

MB = 1_000_000

def _rec(index, nbytes, pack_s, use_s, *, recompute_s=None, device="cpu"):
    return TensorRecord(index, f"m{index}", None, (nbytes // 4,), "float32", device, nbytes,
                        pack_s, recomputable=recompute_s is not None, recompute_s=recompute_s,
                        first_use_s=use_s)


def _profile(records, bwd_start=1.0, blocks=()):
    keys = tuple(((r.nbytes // 4,), torch.float32, torch.device(r.device)) for r in records)
    return Profile(records, keys, 0, bwd_start, bwd_start, bwd_start + 1.0,
                   sum(r.nbytes for r in records), {}, tuple(range(len(records))),
                   tuple(blocks))


def _rates(**kw):
    base = dict(host_copy=1e10, pointwise=1e9, disk_write=1e9, disk_read=1e9,
                disk_engine="fake")
    base.update(kw)
    return Rates(**base)


class Case:
    """A made-up instance and what make_plan is called with."""

    def __init__(self, profile, rates, budget, *, has_nvme=True, cpu_budget=0,
                 nvme_budget=None):
        self.profile, self.rates, self.budget = profile, rates, budget
        self.has_nvme, self.cpu_budget, self.nvme_budget = has_nvme, cpu_budget, nvme_budget

    def plan(self, improve=True, **kw):
        return make_plan(self.profile, self.rates, self.budget, "test", has_nvme=self.has_nvme,
                         cpu_budget_bytes=self.cpu_budget,
                         nvme_budget_bytes=self.nvme_budget, improve=improve, **kw)

    def model(self):
        """The priced options, as the cost model gives them (lone prices)."""
        p = self.profile
        bwd = p.backward_start_s
        tiermem.testing.set_use_times(p)
        opts = {r.index: options_of(r, self.rates, self.has_nvme, bwd) for r in p.records}
        count = itertools.count(len(p.records))
        blocks = [BlockOption(b, p.records, set(), self.rates, self.has_nvme, bwd,
                         lambda: next(count)) for b in p.blocks]
        return opts, blocks

    def need(self):
        return self.profile.baseline_bytes - self.budget

    def room(self):
        return {Tier.CPU: self.cpu_budget,
                Tier.NVME: self.nvme_budget if self.nvme_budget is not None else 1 << 62}


def _price(case, tensor_opt, block_on, input_opt):
    """(priced cost, freed bytes, room used per tier) of an assignment."""
    opts, blocks = case.model()
    cost, freed, used = 0.0, 0, {Tier.CPU: 0, Tier.NVME: 0}
    for r in case.profile.records:
        o = tensor_opt.get(r.index)
        if o is None:
            continue
        cost += o.cost_s
        freed += o.freed
        if o.tier in used:
            used[o.tier] += r.nbytes
    for b, on in zip(blocks, block_on):
        if on:
            cost += b.cost_s
            freed += b.freed
    for (bi, arg), o in input_opt.items():
        cost += o.cost_s
        freed += o.freed
        used[o.tier] += o.freed
    return cost, freed, used


def brute_force(case):
    """The optimum over every assignment: (priced cost, freed) of the
    cheapest one meeting the budget within the tier rooms, or None; and the
    most bytes any assignment within the rooms frees."""
    opts, blocks = case.model()
    need, room = case.need(), case.room()
    best, most = None, 0
    for block_on in itertools.product((False, True), repeat=len(blocks)):
        if any(on and b.price == float("inf") for b, on in zip(blocks, block_on)):
            continue
        inside = {i for b, on in zip(blocks, block_on) if on
                  for i in range(b.rec.start, b.rec.end)}
        free = [r for r in case.profile.records if r.index not in inside]
        ins = [(bi, i) for bi, (b, on) in enumerate(zip(blocks, block_on)) if on for i in b.ins]
        for t_pick in itertools.product(*[[None] + opts[r.index] for r in free]):
            for i_pick in itertools.product(*[[None] + i.opts for _, i in ins]):
                t = {r.index: o for r, o in zip(free, t_pick)}
                i_opt = {(bi, i.x.arg): o for (bi, i), o in zip(ins, i_pick) if o is not None}
                cost, freed, used = _price(case, t, block_on, i_opt)
                if any(used[k] > room[k] for k in used):
                    continue
                most = max(most, freed)
                if freed >= need and (best is None or cost < best[0] - 1e-15):
                    best = (cost, freed)
    return best, most


def plan_price(case, plan):
    """(priced cost, freed, room used) of the assignment ``plan`` chose."""
    opts, blocks = case.model()
    t = {}
    for p in plan.tensors:
        if p.tier in ("recompute", "cpu", "nvme"):
            t[p.index] = next(o for o in opts[p.index] if o.tier.value == p.tier)
    block_on = [pb.checkpoint for pb in plan.blocks]
    i_opt = {}
    for bi, (b, pb) in enumerate(zip(blocks, plan.blocks)):
        for x in pb.inputs:
            if x.tier in ("cpu", "nvme"):
                i = next(i for i in b.ins if i.x.arg == x.arg)
                i_opt[(bi, x.arg)] = next(o for o in i.opts if o.tier.value == x.tier)
    return _price(case, t, block_on, i_opt)


def _check(case, reachable_met=True):
    """Improved and greedy plans against brute force; returns their costs
    (``reachable_met``: assert that a reachable budget is met)."""
    best, most = brute_force(case)
    greedy, improved = case.plan(improve=False), case.plan()
    g_cost, g_freed, _ = plan_price(case, greedy)
    cost, freed, used = plan_price(case, improved)
    room = case.room()
    assert not any("this is a bug" in n or "time limit" in n
                   for n in greedy.notes + improved.notes)
    assert greedy.greedy_priced_cost_s == greedy.priced_cost_s == pytest.approx(g_cost) \
        or greedy.priced_cost_s is None
    assert improved.priced_cost_s is None or improved.priced_cost_s == pytest.approx(cost)
    assert all(used[k] <= room[k] for k in used), (used, room)
    if most >= case.need() and reachable_met:
        assert freed >= case.need(), str(improved)
        assert not any(n.startswith("budget not reachable") for n in improved.notes)
    if g_freed >= case.need():
        assert freed >= case.need() and cost <= g_cost + 1e-12, (cost, g_cost, str(improved))
    return best, (g_cost, g_freed), (cost, freed), improved


# -- cases built so that the greedy is strictly worse ----------------------------------

def test_overshoot_a_cheap_per_byte_large_tensor_where_a_small_one_suffices():
    # A frees 100 MB for 10 ms (0.1 ms/MB), B 10 MB for 2 ms (0.2 ms/MB); 10 MB
    # are needed. The greedy takes A (10 ms); the optimum is B alone (2 ms).
    recs = [_rec(0, 100 * MB, 0.0, 1.5, recompute_s=0.010),
            _rec(1, 10 * MB, 0.1, 1.4, recompute_s=0.002)]
    case = Case(_profile(recs), _rates(), 100 * MB, has_nvme=False)
    best, (g_cost, _), (cost, _), plan = _check(case)
    assert g_cost == pytest.approx(0.010) and best[0] == pytest.approx(0.002)
    assert cost == pytest.approx(best[0]) and cost < g_cost
    assert [p.tier for p in plan.tensors] == ["keep", "recompute"]
    assert "the budget is met without moving it" in plan.tensors[0].reason
    assert plan.tensors[1].reason.startswith("recompute: ")
    assert any(n.startswith("choice: the solver's (HiGHS) over the greedy's: priced cost "
                            "10.00 -> 2.00 ms") for n in plan.notes)


def test_a_tier_budget_the_greedy_fills_with_the_wrong_tensor():
    # CUDA tensors, cpu room for one. X (needed 10.5 ms into backward) costs 0
    # on cpu, 0.5 ms on nvme; Y (needed at once) 1 ms on cpu, 11 ms on nvme.
    # The greedy gives the cpu room to X (price 0) and Y goes to nvme: 11 ms.
    # The optimum: X on nvme, Y on cpu: 1.5 ms.
    recs = [_rec(0, 10 * MB, 0.0, 1.0105, device="cuda:0"),
            _rec(1, 10 * MB, 0.1, 1.0, device="cuda:0")]
    case = Case(_profile(recs), _rates(d2h=1e10, h2d=1e10), 0, cpu_budget=10 * MB)
    best, (g_cost, _), (cost, _), plan = _check(case)
    assert g_cost == pytest.approx(0.011)
    assert cost == pytest.approx(best[0]) and cost == pytest.approx(0.0015)
    assert [p.tier for p in plan.tensors] == ["nvme", "cpu"]
    assert plan.tensors[0].reason.startswith("nvme: host budget full")


def test_a_block_checkpoint_where_one_tensor_suffices():
    # A block saves 4 x 10 MB (inputs 1 MB) and re-runs in 4 ms: 0.1 ms/MB;
    # a tensor outside frees 10 MB for 2 ms: 0.2 ms/MB. 10 MB are needed:
    # the greedy checkpoints the block (4 ms), the optimum recomputes the
    # tensor (2 ms), and the block's tensors stay kept.
    recs = [_rec(i, 10 * MB, 0.01 * i, 1.5 - 0.01 * i) for i in range(4)]
    recs.append(_rec(4, 10 * MB, 0.05, 1.2, recompute_s=0.002))
    block = BlockRecord(0, "blk", 0, 4, 0, 4, 0.004, MB)
    case = Case(_profile(recs, blocks=[block]), _rates(), 40 * MB, has_nvme=False)
    best, (g_cost, _), (cost, _), plan = _check(case)
    assert g_cost == pytest.approx(0.004)
    assert cost == pytest.approx(best[0]) and cost == pytest.approx(0.002)
    assert not plan.blocks[0].checkpoint
    assert [p.tier for p in plan.tensors] == ["keep"] * 4 + ["recompute"]
    assert "the budget is met by cheaper options" in plan.blocks[0].reason
    assert all(p.reason.startswith("kept: no tier frees its memory") for p in plan.tensors[:4])
    # Inside tensors that have options say that the pass undid the checkpoint.
    recs[0].recomputable, recs[0].recompute_s = True, 0.05
    plan = case.plan()
    assert [p.tier for p in plan.tensors] == ["keep"] * 4 + ["recompute"]
    assert plan.predicted_kept_bytes == 40 * MB
    assert case.plan(improve=False).blocks[0].checkpoint


def test_a_block_with_a_movable_input_against_brute_force():
    # The block's 10 MB input may go to nvme once it is checkpointed (rule 6);
    # tight budgets make the pass weigh it against the tensors outside.
    recs = [_rec(i, 10 * MB, 0.01 * i, 1.05 - 0.01 * i) for i in range(4)]
    recs += [_rec(4, 20 * MB, 0.05, 1.01, recompute_s=0.006),
             _rec(5, 5 * MB, 0.06, 1.0, recompute_s=0.004)]
    inp = BlockInput(0, (10 * MB // 4,), "float32", "cpu", 10 * MB, "movable")
    block = BlockRecord(0, "blk", 0, 4, 0, 4, 0.003, 10 * MB, start_s=0.0, inputs=(inp,))
    for budget in (25 * MB, 15 * MB, 5 * MB, 0):
        case = Case(_profile(recs, blocks=[block]), _rates(move_cpu=1e9, compute_threads=2.0),
                    budget)
        best, (g_cost, g_freed), (cost, freed), plan = _check(case)
        assert best is not None and cost == pytest.approx(best[0]), (budget, str(plan))


def test_a_large_instance_still_fixes_the_overshoot():
    # 600 tensors: 598 of 1 MB at 0.1 ms/MB, then 100 MB for 5 ms (0.05 ms/MB) and
    # 20 MB for 1.2 ms (0.06 ms/MB). 20 MB are needed: the greedy takes the
    # 100 MB one (5 ms); the optimum is the 20 MB one (1.2 ms; twenty 1 MB
    # ones would cost 2 ms).
    recs = [_rec(i, MB, 0.001 * i, 1.9 - 0.001 * i, recompute_s=0.0001) for i in range(598)]
    recs += [_rec(598, 100 * MB, 0.7, 1.2, recompute_s=0.005),
             _rec(599, 20 * MB, 0.8, 1.1, recompute_s=0.0012)]
    total = sum(r.nbytes for r in recs)
    case = Case(_profile(recs), _rates(), total - 20 * MB, has_nvme=False)
    greedy, plan = case.plan(improve=False), case.plan()
    assert greedy.tensors[598].tier == "recompute" and greedy.priced_cost_s == pytest.approx(0.005)
    assert plan.tensors[598].tier == "keep"
    assert plan.priced_cost_s == pytest.approx(0.0012)
    assert plan.tensors[599].tier == "recompute"
    assert plan.predicted_kept_bytes <= case.budget


# -- the pass leaves alone what it should -----------------------------------------------

def test_a_greedy_choice_that_is_optimal_is_unchanged():
    recs = [_rec(0, 10 * MB, 0.0, 1.5, recompute_s=0.001),
            _rec(1, 10 * MB, 0.1, 1.4, recompute_s=0.002)]
    case = Case(_profile(recs), _rates(), 10 * MB, has_nvme=False)
    greedy, improved = case.plan(improve=False), case.plan()
    assert [p.tier for p in improved.tensors] == [p.tier for p in greedy.tensors]
    assert [p.reason for p in improved.tensors] == [p.reason for p in greedy.tensors]
    assert improved.predicted_kept_bytes == greedy.predicted_kept_bytes
    assert not any(n.startswith("choice:") for n in improved.notes), improved.notes


def test_hinted_moves_come_first_and_the_solver_prices_among_them():
    # NOTE [Hints in the program]. Both large tensors are hinted PREFER_RECOMPUTE,
    # the small one is not and is by far the cheapest. 20 MB are needed: hinted
    # moves come first, so the unhinted one stays kept; among the hinted ones
    # the greedy takes the 100 MB one (cheaper per byte, 5 ms), the program the
    # 20 MB one (1.2 ms), which is enough.
    from torch.utils.checkpoint import CheckpointPolicy
    from tiermem.policy import TierOrder
    hint = (TierOrder([Tier.RECOMPUTE], hint=CheckpointPolicy.PREFER_RECOMPUTE),
            "PREFER_RECOMPUTE")
    recs = [_rec(0, 100 * MB, 0.0, 1.5, recompute_s=0.005),
            _rec(1, 20 * MB, 0.1, 1.4, recompute_s=0.0012),
            _rec(2, 30 * MB, 0.2, 1.3, recompute_s=0.0001)]
    recs[0].hint = recs[1].hint = hint
    case = Case(_profile(recs), _rates(), 130 * MB, has_nvme=False)
    greedy, plan = case.plan(improve=False), case.plan()
    assert [p.tier for p in greedy.tensors] == ["recompute", "keep", "keep"]
    assert [p.tier for p in plan.tensors] == ["keep", "recompute", "keep"]
    assert plan.priced_cost_s == pytest.approx(0.0012)
    assert "hint PREFER_RECOMPUTE followed" in plan.tensors[1].reason
    # Without the hints the unhinted one, cheapest, is taken alone.
    recs[0].hint = recs[1].hint = None
    assert [p.tier for p in case.plan().tensors] == ["keep", "keep", "recompute"]


# -- seeded random instances ---------------------------------------------------------

def random_case(rng: random.Random) -> Case:
    cuda = rng.random() < 0.6
    n = rng.randint(3, 7 if cuda else 8)
    recs = []
    for i in range(n):
        nbytes = rng.randint(1, 40) * MB
        pack = 0.9 * i / n
        use = 1.0 + rng.random() * 0.03
        s = rng.choice([None, rng.uniform(0.0005, 0.02)])
        recs.append(_rec(i, nbytes, pack, use, recompute_s=s,
                         device="cuda:0" if cuda else "cpu"))
    blocks = []
    if rng.random() < 0.5 and n >= 4:
        start = rng.randint(0, n - 3)
        end = rng.randint(start + 2, min(n, start + 3))
        inputs = ()
        if rng.random() < 0.5:
            nb = rng.randint(1, 10) * MB
            inputs = (BlockInput(0, (nb // 4,), "float32", recs[0].device, nb, "movable"),)
        blocks.append(BlockRecord(0, "blk", start, end, start, end, rng.uniform(0.001, 0.03),
                                  sum(x.nbytes for x in inputs) or MB,
                                  start_s=recs[start].pack_s, inputs=inputs))
    rates = _rates(d2h=rng.choice([2e9, 1e10]), h2d=rng.choice([2e9, 1e10]),
                   disk_read=rng.choice([1e9, 3e9]), move_cpu=1e9, compute_threads=2.0)
    total = sum(r.nbytes for r in recs)
    budget = int(total * rng.choice([0.0, 0.1, 0.3, 0.5, 0.7, 0.9]))
    cpu_budget = rng.choice([0, 20 * MB, 60 * MB, 1 << 40]) if cuda else 0
    nvme_budget = rng.choice([None, None, 30 * MB, 80 * MB])
    return Case(_profile(recs, blocks=blocks), rates, budget, cpu_budget=cpu_budget,
                nvme_budget=nvme_budget)


def test_random_instances_are_solved_to_the_optimum():
    # The optimum of brute force, the budget met whenever reachable (the
    # greedy misses some), never worse than the greedy, rooms respected.
    rng = random.Random(12)
    reachable = greedy_worse = greedy_missed = 0
    for _ in range(120):
        case = random_case(rng)
        best, (g_cost, g_freed), (cost, freed), _ = _check(case)
        if best is None:
            continue
        reachable += 1
        assert freed >= case.need() and cost == pytest.approx(best[0], abs=1e-12)
        greedy_missed += g_freed < case.need()
        greedy_worse += g_freed >= case.need() and g_cost > best[0] + 1e-12
    assert reachable >= 100 and greedy_worse >= 20 and greedy_missed >= 1, (
        reachable, greedy_worse, greedy_missed)


def test_the_choice_does_not_depend_on_the_wall_clock():
    # NOTE [Same plan on every rank]: the search is bounded by nodes, so a
    # generous or a tight-but-sufficient wall clock gives the same plan; a
    # clock that binds is said in the plan (ranks may then differ), and the
    # greedy's choice is still the floor.
    rng = random.Random(7)
    said = 0
    for _ in range(25):
        case = random_case(rng)
        tiers = lambda p: [t.tier for t in p.tensors]   # noqa: E731
        roomy, tight = case.plan(time_limit_s=100.0), case.plan(time_limit_s=1.0)
        assert tiers(roomy) == tiers(tight)
        assert not any("wall-clock" in n for n in roomy.notes), roomy.notes
        stopped, greedy = case.plan(time_limit_s=0.0), case.plan(improve=False)
        said += any("wall-clock limit" in n for n in stopped.notes)
        assert stopped.priced_cost_s <= greedy.priced_cost_s + 1e-12
    assert said >= 10, said


# -- real profiles -----------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0.5, 0.25, 0.1])
@pytest.mark.parametrize("name", ["mlp", "block", "convnet", "embed_gather"])
def test_real_profiles_count_alike_and_never_cost_more(name, budget, nvme_dir):
    # The test models' profiles (measured prices): the pass counts the
    # greedy's choice as the greedy does (no "this is a bug" note), never
    # raises its priced cost where the greedy met the budget, and meets every
    # budget the greedy met; every tensor keeps a reason naming its tier.
    import contextlib
    from helpers import offloader, train_steps
    from models import make_case
    off = offloader("auto", device_budget="50%", nvme_dir=nvme_dir)
    train_steps(make_case(name), contextlib.nullcontext, steps=1)   # warm-up, no hooks
    train_steps(make_case(name), lambda: off, steps=2)
    planner = tiermem.testing.planner_of(off)
    profile = tiermem.testing.kept_profiles(off)[off.plan.keys]
    kw = dict(has_nvme=True, cpu_budget_bytes=off.cpu_budget_bytes,
              nvme_budget_bytes=None)
    target = int(budget * profile.baseline_bytes)
    greedy = make_plan(profile, planner.rates, target, "t", improve=False, **kw)
    plan = make_plan(profile, planner.rates, target, "t", **kw)
    assert not any("this is a bug" in n for n in greedy.notes + plan.notes)
    unreached = lambda p: any(n.startswith("budget not reachable") for n in p.notes)  # noqa: E731
    if not unreached(greedy):
        assert not unreached(plan)
        assert plan.priced_cost_s <= greedy.priced_cost_s + 1e-12
    for p in plan.tensors:
        assert p.reason.split(":")[0].split()[0] in (p.tier, "kept"), p.reason
    off.close()


def test_random_instances_with_must_answers_obey_them_at_the_optimum():
    # A MUST answer per instance (recompute where it may, else keep): it is
    # obeyed, and the rest is the optimum of brute force over the others.
    from torch.utils.checkpoint import CheckpointPolicy
    from tiermem.policy import TierOrder
    rng = random.Random(5)
    checked = 0
    for _ in range(40):
        case = random_case(rng)
        r = case.profile.records[rng.randrange(len(case.profile.records))]
        want = Tier.RECOMPUTE if r.recomputable and r.nbytes > r.input_kept_bytes else Tier.KEEP
        name = "MUST_RECOMPUTE" if want is Tier.RECOMPUTE else "MUST_SAVE"
        r.hint = (TierOrder([want], must=True, hint=getattr(CheckpointPolicy, name)), name)
        plan = case.plan()
        assert plan.tensors[r.index].tier in (want.value, "checkpoint")
        assert plan.tensors[r.index].must
        assert not any(b.checkpoint and b.start <= r.index < b.end for b in plan.blocks)
        room = case.room()
        used = {t: sum(p.nbytes for p in plan.tensors if p.tier == t.value and not p.must)
                + sum(x.nbytes for b in plan.blocks for x in b.inputs if x.tier == t.value)
                for t in room}
        assert all(used[t] <= room[t] for t in room), (used, room)
        checked += 1
    assert checked == 40


def test_an_unreachable_budget_frees_the_most_bytes_at_the_least_cost():
    # Budget 0 with tight tier rooms: the choice frees the most bytes any
    # assignment within the rooms frees, and is the cheapest of those.
    rng = random.Random(7)
    checked = 0
    for _ in range(60):
        case = random_case(rng)
        case.budget, case.nvme_budget = 0, rng.choice([0, 10 * MB, 30 * MB])
        _, most = brute_force(case)
        if most >= case.need():
            continue
        cost, freed, _ = plan_price(case, case.plan())
        assert freed == most, (freed, most)
        at_most = Case(case.profile, case.rates, case.profile.baseline_bytes - most,
                       has_nvme=case.has_nvme, cpu_budget=case.cpu_budget,
                       nvme_budget=case.nvme_budget)
        assert cost == pytest.approx(brute_force(at_most)[0][0], abs=1e-12)
        checked += 1
    assert checked >= 20, checked


def test_the_greedys_choice_stands_when_the_solver_finds_none_in_its_time_limit():
    recs = [_rec(0, 100 * MB, 0.0, 1.5, recompute_s=0.010),
            _rec(1, 10 * MB, 0.1, 1.4, recompute_s=0.002)]
    case = Case(_profile(recs), _rates(), 100 * MB, has_nvme=False)
    import tiermem.testing
    with tiermem.testing.solver_finds_nothing():
        plan = case.plan()
    greedy = case.plan(improve=False)
    assert [p.tier for p in case.plan().tensors] == ["keep", "recompute"]
    assert [p.tier for p in plan.tensors] == [p.tier for p in greedy.tensors]
    assert any(n.startswith("choice: the greedy's: the solver found no choice within its "
                            "time limit") for n in plan.notes), plan.notes


def test_plan_text_never_points_into_the_source():
    # Cases where the solver changes the greedy's choice, with a block and a
    # hint: str(plan), every reason and note speak to users (no NOTE names,
    # no source files).
    from torch.utils.checkpoint import CheckpointPolicy
    from tiermem.policy import TierOrder
    recs = [_rec(i, 10 * MB, 0.01 * i, 1.5 - 0.01 * i) for i in range(4)]
    recs += [_rec(4, 10 * MB, 0.05, 1.2, recompute_s=0.002),
             _rec(5, 100 * MB, 0.06, 1.1, recompute_s=0.010)]
    recs[5].hint = (TierOrder([Tier.KEEP], hint=CheckpointPolicy.PREFER_SAVE), "PREFER_SAVE")
    block = BlockRecord(0, "blk", 0, 4, 0, 4, 0.004, MB)
    for budget in (150 * MB, 100 * MB, 0):
        plan = Case(_profile(recs, blocks=[block]), _rates(), budget, has_nvme=False).plan()
        texts = [str(plan)] + list(plan.reasons.values()) + plan.notes + [
            b.reason for b in plan.blocks]
        for text in texts:
            assert "NOTE [" not in text and ".py" not in text, text
