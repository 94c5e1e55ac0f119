"""The auto planner's improvement pass (NOTE [Planner choice] in
tiermem/planner/improve.py) against the greedy choice alone: planning time
and what the pass changes.

1. Planning time: bench_planning's deep TinyGPTs (width 64, seq 32, batch 2,
   an nvme dir, Python engine; ``--layers``), plain and with
   ``wrap_blocks(..., checkpoint="auto")``: one profiled step each, then
   ``make_plan`` on that profile at each of ``--budgets`` with
   ``improve=False`` and ``improve=True``, ``--repeats`` times each,
   interleaved; medians.
2. Choice: the suite's ``cpu`` TinyGPT (4 layers, width 256, seq 256, batch 4,
   vocab 2048), plain and with ``wrap_blocks(..., checkpoint="auto")``: one
   profile each, then plans at ``--budgets`` both ways: whether the pass
   changed the plan, the priced cost (sum of lone prices) of each, and the
   predicted step cost (after the channel simulation) of each.
3. Against brute force: the seeded random instances of
   tests/test_solver_opt.py (at most 8 tensors, tier budgets, a block), with
   the local search alone (``EXACT_STATES = 0``, what large instances get)
   and as shipped (the exact pass on them): how often each is optimal, and
   the summed priced cost against the summed optimum.

Run: ``python benchmarks/bench_solver_opt.py [--out x.json]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiermem  # noqa: E402
import tiermem.testing  # noqa: E402
from common import emit, machine  # noqa: E402
from tiermem.models import Block, GPTConfig, TinyGPT  # noqa: E402
from tiermem.planner.solver import make_plan  # noqa: E402
from tiermem.policy import Tier  # noqa: E402


def _profiled(cfg: GPTConfig, batch: int, nvme_dir: str, blocks: bool):
    """One profiled step of a TinyGPT under auto: (profile, rates, rooms)."""
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1))
    off = tiermem.Offloader(policy="auto", device_budget="50%", nvme_dir=nvme_dir,
                            engine="python")
    wrapping = tiermem.wrap_blocks(model, Block, checkpoint="auto") if blocks else None
    with off:
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 tokens[:, 1:].flatten())
    loss.backward()
    planner = tiermem.testing.planner_of(off)
    planner.settle()
    profile = next(iter(planner._profiles.values()))
    nvme = off._placement.stores.get(Tier.NVME)
    rooms = dict(cpu_budget_bytes=off._placement.cpu_budget_bytes,
                 nvme_budget_bytes=None if nvme is None else nvme.arena.budget_bytes)
    out = profile, planner.rates, rooms
    if wrapping is not None:
        wrapping.unwrap()
    off.close()
    return out


def _plan(profile, rates, rooms, share: float, improve: bool):
    return make_plan(profile, rates, int(share * profile.baseline_bytes), f"{share:.0%}",
                     has_nvme=True, improve=improve, **rooms)


def timing(layers: int, repeats: int, budgets, nvme_dir: str) -> list:
    cfg = GPTConfig(vocab=256, layers=layers, width=64, heads=4, seq_len=32)
    rows = []
    for blocks in (False, True):
        profile, rates, rooms = _profiled(cfg, 2, nvme_dir, blocks=blocks)
        for share in budgets:
            times = {False: [], True: []}
            for _ in range(repeats):
                for improve in (False, True):
                    t0 = time.perf_counter()
                    plan = _plan(profile, rates, rooms, share, improve)
                    times[improve].append(time.perf_counter() - t0)
            rows.append({
                "layers": layers, "blocks": len(profile.blocks), "budget": f"{share:.0%}",
                "tensors": len(profile.records),
                "greedy_seconds": times[False], "improved_seconds": times[True],
                "median_greedy_seconds": statistics.median(times[False]),
                "median_improved_seconds": statistics.median(times[True]),
                "changed": any(n.startswith("choice: the improvement") for n in plan.notes),
                "greedy_priced_cost_s": plan.greedy_priced_cost_s,
                "priced_cost_s": plan.priced_cost_s})
    return rows


def choices(budgets, nvme_dir: str) -> list:
    cfg = GPTConfig(vocab=2048, layers=4, width=256, heads=4, seq_len=256)
    rows = []
    for blocks in (False, True):
        profile, rates, rooms = _profiled(cfg, 4, nvme_dir, blocks)
        for share in budgets:
            g, p = (_plan(profile, rates, rooms, share, improve) for improve in (False, True))
            rows.append({
                "model": "TinyGPT suite cpu" + (" + wrap_blocks(auto)" if blocks else ""),
                "budget": f"{share:.0%}", "tensors": len(profile.records),
                "blocks": len(profile.blocks),
                "changed": [a.tier for a in g.tensors] != [b.tier for b in p.tensors]
                or [a.checkpoint for a in g.blocks] != [b.checkpoint for b in p.blocks],
                "tensors_changed": sum(a.tier != b.tier for a, b in zip(g.tensors, p.tensors)),
                "greedy_priced_cost_s": g.priced_cost_s, "priced_cost_s": p.priced_cost_s,
                "greedy_predicted_step_cost_s": g.predicted_step_cost_s,
                "predicted_step_cost_s": p.predicted_step_cost_s,
                "greedy_predicted_kept_bytes": g.predicted_kept_bytes,
                "predicted_kept_bytes": p.predicted_kept_bytes,
                "budget_bytes": g.budget_bytes, "notes": p.notes})
    return rows


def brute(seeds, count: int) -> list:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "tests"))
    import random
    import test_solver_opt as t
    from tiermem.planner import improve
    rows = []
    for exact in (False, True):
        saved = improve.EXACT_STATES
        if not exact:
            improve.EXACT_STATES = 0
        for seed in seeds:
            rng = random.Random(seed)
            row = dict(exact=exact, seed=seed, instances=count, reachable=0, met=0,
                       greedy_met=0, optimal=0, greedy_optimal=0, cost=0.0, best_cost=0.0,
                       worst_ratio=1.0, greedy_cost_where_met=0.0, best_cost_where_greedy_met=0.0)
            for _ in range(count):
                case = t._random_case(rng)
                best, _ = t.brute_force(case)
                if best is None:
                    continue
                g_cost, g_freed, _ = t.plan_price(case, case.plan(improve=False))
                cost, freed, _ = t.plan_price(case, case.plan())
                row["reachable"] += 1
                row["greedy_met"] += g_freed >= case.need()
                row["greedy_optimal"] += g_freed >= case.need() and g_cost <= best[0] + 1e-12
                if g_freed >= case.need():
                    row["greedy_cost_where_met"] += g_cost
                    row["best_cost_where_greedy_met"] += best[0]
                if freed >= case.need():
                    row["met"] += 1
                    row["optimal"] += cost <= best[0] + 1e-12
                    row["cost"] += cost
                    row["best_cost"] += best[0]
                    if best[0] > 0:
                        row["worst_ratio"] = max(row["worst_ratio"], cost / best[0])
            rows.append(row)
        improve.EXACT_STATES = saved
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="25,50,100")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budgets", default="0.5,0.25,0.1")
    ap.add_argument("--profiles", type=int, default=3,
                    help="profiles of the suite's TinyGPT per variant (their prices vary)")
    ap.add_argument("--brute-seeds", default="12,1,2")
    ap.add_argument("--brute-count", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    budgets = [float(x) for x in args.budgets.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-solver-opt-") as d:
        rows = [r for n in args.layers.split(",") for r in timing(int(n), args.repeats, budgets, d)]
        picks = [dict(r, profile=k) for k in range(args.profiles) for r in choices(budgets, d)]
    exact = brute([int(x) for x in args.brute_seeds.split(",")], args.brute_count)
    emit({"benchmark": "improvement pass of policy=auto's choice", "machine": machine(),
          "settings": vars(args), "timing": rows, "choices": picks, "brute_force": exact},
         args.out)


if __name__ == "__main__":
    main()
