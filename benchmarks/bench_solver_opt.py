"""The auto planner's choice (the HiGHS model with the greedy as floor and
fallback) on measured profiles and against brute force.

1. ``collect``: profile TinyGPTs under ``policy="auto"`` once and pickle the
   profiles (with their rates and tier rooms) to ``--profiles-file``: the
   suite's ``cpu`` TinyGPT (4 layers, width 256, seq 256, batch 4, vocab
   2048) plain and with ``wrap_blocks(..., checkpoint="auto")`` (``--suite``
   profiles each), and deep TinyGPTs (width 64, seq 32, batch 2; ``--deep``
   layers) plain and with every third block an auto block.
2. ``plans``: ``make_plan`` on every pickled profile at each of ``--budgets``
   (shares of the plain step's bytes; 0 is unreachable), ``--repeats``
   times: median planning seconds, predicted step cost, priced cost, kept
   bytes, whether the budget was met. Run it with the tree to measure on
   ``PYTHONPATH``, so that two trees are compared on the same profiles.
   ``--baseline x.json`` adds the baseline's figures per row.
3. ``brute``: the seeded random instances of tests/test_solver_opt.py: the
   plan's priced cost against brute force.

Run: ``python benchmarks/bench_solver_opt.py collect|plans|brute [...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
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


def _profiled(cfg: GPTConfig, batch: int, nvme_dir: str, blocks):
    """One profiled step of a TinyGPT under auto: (profile, rates, rooms)."""
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1))
    off = tiermem.Offloader(policy="auto", device_budget="50%", nvme_dir=nvme_dir,
                            engine="python")
    wrapping = tiermem.wrap_blocks(model, blocks, checkpoint="auto") if blocks else None
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


def _every_third(name: str, module) -> bool:
    return isinstance(module, Block) and int(name.rsplit(".", 1)[-1]) % 3 == 0


def collect(args) -> None:
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-solver-opt-") as d:
        suite = GPTConfig(vocab=2048, layers=4, width=256, heads=4, seq_len=256)
        for k in range(args.suite):
            for blocks in (None, Block):
                name = f"suite-cpu{'+auto-blocks' if blocks else ''}#{k}"
                out.append((name,) + _profiled(suite, 4, d, blocks))
        for layers in [int(x) for x in args.deep.split(",") if x]:
            cfg = GPTConfig(vocab=256, layers=layers, width=64, heads=4, seq_len=32)
            for blocks in (None, _every_third):
                name = f"deep-{layers}{'+auto-blocks' if blocks else ''}"
                out.append((name,) + _profiled(cfg, 2, d, blocks))
    with open(args.profiles_file, "wb") as f:
        pickle.dump(out, f)
    print(json.dumps([(n, len(p.records), len(p.blocks)) for n, p, _, _ in out]))


def plans(args) -> None:
    with open(args.profiles_file, "rb") as f:
        profiles = pickle.load(f)
    base = {}
    if args.baseline:
        with open(args.baseline) as f:
            base = {(r["profile"], r["budget"]): r for r in json.load(f)["plans"]}
    rows = []
    for name, profile, rates, rooms in profiles:
        for share in [float(x) for x in args.budgets.split(",")]:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                plan = make_plan(profile, rates, int(share * profile.baseline_bytes),
                                 f"{share:.0%}", has_nvme=True, **rooms)
                times.append(time.perf_counter() - t0)
            row = {"profile": name, "budget": f"{share:.0%}", "tensors": len(profile.records),
                   "blocks": len(profile.blocks), "seconds": times,
                   "median_seconds": statistics.median(times),
                   "predicted_step_cost_s": plan.predicted_step_cost_s,
                   "priced_cost_s": plan.priced_cost_s,
                   "predicted_kept_bytes": plan.predicted_kept_bytes,
                   "budget_bytes": plan.budget_bytes,
                   "met": not any(n.startswith("budget not reachable") for n in plan.notes),
                   "notes": [n for n in plan.notes if n.startswith(("choice", "solver"))]}
            b = base.get((name, row["budget"]))
            if b is not None:
                row["baseline_predicted_step_cost_s"] = b["predicted_step_cost_s"]
                row["baseline_priced_cost_s"] = b["priced_cost_s"]
                row["baseline_met"] = b["met"]
                row["baseline_median_seconds"] = b["median_seconds"]
            rows.append(row)
            print(name, row["budget"], f"{row['median_seconds']:.3f}s",
                  row["predicted_step_cost_s"], b and b["predicted_step_cost_s"], flush=True)
    emit({"benchmark": "auto planner choice on measured profiles", "machine": machine(),
          "settings": vars(args), "plans": rows}, args.out)


def brute(args) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "tests"))
    import random
    import test_solver_opt as t
    rows = []
    for seed in [int(x) for x in args.brute_seeds.split(",")]:
        rng = random.Random(seed)
        row = dict(seed=seed, instances=args.brute_count, reachable=0, met=0, optimal=0,
                   cost=0.0, best_cost=0.0, worst_ratio=1.0)
        for _ in range(args.brute_count):
            case = t.random_case(rng)
            best, _ = t.brute_force(case)
            if best is None:
                continue
            cost, freed, _ = t.plan_price(case, case.plan())
            row["reachable"] += 1
            if freed >= case.need():
                row["met"] += 1
                row["optimal"] += cost <= best[0] + 1e-9
                row["cost"] += cost
                row["best_cost"] += best[0]
                if best[0] > 0:
                    row["worst_ratio"] = max(row["worst_ratio"], cost / best[0])
        rows.append(row)
    emit({"benchmark": "auto planner choice against brute force", "machine": machine(),
          "settings": vars(args), "brute_force": rows}, args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["collect", "plans", "brute"])
    ap.add_argument("--profiles-file", default="/tmp/tiermem-solver-profiles.pkl")
    ap.add_argument("--suite", type=int, default=3)
    ap.add_argument("--deep", default="25,100,300")
    ap.add_argument("--budgets", default="0.5,0.25,0.1,0")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--brute-seeds", default="12,1,2")
    ap.add_argument("--brute-count", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    {"collect": collect, "plans": plans, "brute": brute}[args.what](args)


if __name__ == "__main__":
    main()
