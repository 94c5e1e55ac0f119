"""Cost of ``check_params`` (NOTE [Parameters changed before backward]) on the
recompute tier: TinyGPT training steps under ``policy="recompute"`` with the
check on and off, interleaved step by step, one intra-op thread.

Reports per configuration the median and minimum step time, both wall and
process CPU time (``time.process_time``: on a shared machine the CPU time the
step itself used is steadier than its wall time), and, for the check, the
fingerprints taken per step and the CPU time spent in them (measured by
wrapping ``tiermem.tracking.params.fingerprint``).

Run: ``python benchmarks/check_params_cost.py [--steps 40] [--out x.json]``. Prints JSON.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import tiermem
import tiermem.tracking.params as paramcheck
from common import emit, machine
from tiermem.models import GPTConfig, TinyGPT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig()
    base = TinyGPT(cfg)
    runs = {}
    for name, check in (("check_params=on", True), ("check_params=off", False)):
        model = copy.deepcopy(base)
        runs[name] = {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3),
                      "off": tiermem.Offloader(policy="recompute", check_params=check),
                      "wall": [], "cpu": [], "fp_count": [], "fp_cpu": []}
    fp_stats = {"count": 0, "cpu": 0.0}
    inner = paramcheck.fingerprint

    def timed(t):
        t0 = time.process_time()
        try:
            return inner(t)
        finally:
            fp_stats["count"] += 1
            fp_stats["cpu"] += time.process_time() - t0

    paramcheck.fingerprint = timed
    g = torch.Generator().manual_seed(1)
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=g)
        y = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=g)
        for r in runs.values():
            fp_stats["count"], fp_stats["cpu"] = 0, 0.0
            torch.manual_seed(i)
            w0, c0 = time.perf_counter(), time.process_time()
            r["opt"].zero_grad(set_to_none=True)
            with r["off"]:
                loss = r["model"](x, y)
            loss.backward()
            r["opt"].step()
            w1, c1 = time.perf_counter(), time.process_time()
            if i >= args.warmup:
                r["wall"].append(w1 - w0)
                r["cpu"].append(c1 - c0)
                r["fp_count"].append(fp_stats["count"])
                r["fp_cpu"].append(fp_stats["cpu"])
    out = {}
    for name, r in runs.items():
        out[name] = {
            "wall_median_s": statistics.median(r["wall"]), "wall_min_s": min(r["wall"]),
            "cpu_median_s": statistics.median(r["cpu"]), "cpu_min_s": min(r["cpu"]),
            "fingerprints_per_step": statistics.median(r["fp_count"]),
            "fingerprint_cpu_median_s": statistics.median(r["fp_cpu"]),
            "recompute_count_last_step": r["off"].stats.recompute_count,
        }
        r["off"].close()
    on, off = out["check_params=on"], out["check_params=off"]
    emit({"benchmark": "check_params_cost", "machine": machine(),
          "model": {**cfg.__dict__, "batch": args.batch}, "steps": args.steps,
          "threads": 1, "configs": out,
          "fingerprint_share_of_step_cpu": on["fingerprint_cpu_median_s"] / on["cpu_median_s"],
          "cpu_median_ratio_on_vs_off": on["cpu_median_s"] / off["cpu_median_s"],
          "cpu_min_ratio_on_vs_off": on["cpu_min_s"] / off["cpu_min_s"]}, args.out)


if __name__ == "__main__":
    main()
