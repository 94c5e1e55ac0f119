"""How long ``policy="auto"`` takes to plan, on deep models (issue 12's bar:
at most 1 s for a 100-layer model's profile).

For each depth, a small-width TinyGPT trains ``--steps`` steps under
``Offloader(policy="auto", device_budget=...)`` with an NVMe dir; the first
step is the profile, the plan is made when the second step starts. Reported
per depth (medians over ``--repeats`` fresh Offloaders): the solver's own
time (``Plan.planning_seconds``), the wall time of the call that settles the
profile into a plan (profile finishing + rates, measured once per process,
+ solver), the number of saved tensors planned, and the profile step's and a
planned step's wall time.

Run: ``python benchmarks/bench_planning.py [--layers 25,50,100] [--out x.json]``.
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


def one_run(layers: int, width: int, seq_len: int, batch: int, budget: str, steps: int,
            auto_blocks: int = 0) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, layers=layers, width=width, heads=4, seq_len=seq_len)
    model = TinyGPT(cfg)
    if auto_blocks:   # every (layers // auto_blocks)-th block an auto block
        every = max(1, layers // auto_blocks)
        tiermem.wrap_blocks(model, lambda n, m: isinstance(m, Block)
                            and int(n.rsplit('.', 1)[-1]) % every == 0, checkpoint='auto')
    tokens = torch.randint(0, cfg.vocab, (batch, seq_len + 1))
    with tempfile.TemporaryDirectory(prefix="bench-planning-") as d:
        off = tiermem.Offloader(policy="auto", device_budget=budget, nvme_dir=d,
                                engine="python")
        planner = tiermem.testing.planner_of(off)
        step_s, settle_s = [], None
        for step in range(steps):
            if step == 1:   # the profile's backward ran: plan now, timed
                t0 = time.perf_counter()
                planner.settle()
                settle_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            with off:
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            model.zero_grad(set_to_none=True)
            step_s.append(time.perf_counter() - t0)
        plan = off.plan
        out = {"layers": layers, "tensors": len(plan.tensors),
               "solver_seconds": plan.planning_seconds, "settle_seconds": settle_s,
               "profile_step_seconds": step_s[0], "planned_step_seconds": step_s[-1],
               "profiles": planner.profiles}
        off.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="25,50,100")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--auto-blocks", default="0",
                    help="comma list: auto blocks per model (0: none), each run per depth")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for layers, blocks in ((int(x), int(b)) for x in args.layers.split(",")
                           for b in args.auto_blocks.split(",")):
        runs = [one_run(layers, args.width, args.seq_len, args.batch, args.budget, args.steps,
                        blocks) for _ in range(args.repeats)]
        row = {"layers": layers, "auto_blocks": blocks, "tensors": runs[0]["tensors"],
               "runs": runs}
        for key in ("solver_seconds", "settle_seconds", "profile_step_seconds",
                    "planned_step_seconds"):
            row[f"median_{key}"] = statistics.median(r[key] for r in runs)
        rows.append(row)
    emit({"benchmark": "planning time of policy=auto", "machine": machine(),
          "settings": vars(args), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
