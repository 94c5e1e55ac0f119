"""Cost of ``check_params`` (NOTE [Parameters changed before backward]) on the
recompute tier: TinyGPT training steps under ``policy="recompute"`` with the
check on and off, interleaved step by step, one intra-op thread.

Reports per configuration the median and minimum step time, both wall and
process CPU time (``time.process_time``: on a shared machine the CPU time the
step itself used is steadier than its wall time), and, for the check, the
fingerprints taken per step and the CPU time spent in them (measured by
wrapping ``tiermem.tracking.params.fingerprint``).

On CUDA (``--device cuda``) the times are wall-clock on the host (the host
work the check adds, what can starve the GPU: docs/host-cost.md); the forward's
host time (until it returns) is reported apart, and so are the fingerprints taken
at pack (forward) and at recompute (backward), and the time in
``ParamChecks.watch`` (fingerprint and name lookup) during the forward.

Run: ``python benchmarks/check_params_cost.py [--steps 40] [--device cuda]
[--width 256 --seq-len 512 --batch 4] [--out x.json]``. Prints JSON.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import tiermem
import tiermem.tracking.params as paramcheck
from common import emit, machine, pick_device, sync
from tiermem.models import GPTConfig, TinyGPT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (host wall clock)")
    p.add_argument("--width", type=int, default=None, help="default: GPTConfig's")
    p.add_argument("--layers", type=int, default=None, help="default: GPTConfig's")
    p.add_argument("--seq-len", type=int, default=None, help="default: GPTConfig's")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = pick_device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    given = {k: v for k, v in (("width", args.width), ("layers", args.layers),
                               ("seq_len", args.seq_len)) if v is not None}
    cfg = GPTConfig(**given)
    with dev:
        base = TinyGPT(cfg)
    cuda = dev.type == "cuda"
    # CPU: the process's CPU time is steadier on a shared machine; CUDA: the
    # host's wall clock (process time would count the driver's other threads).
    clock = time.perf_counter if cuda else time.process_time
    runs = {}
    for name, check in (("check_params=on", True), ("check_params=off", False)):
        model = copy.deepcopy(base)
        runs[name] = {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3),
                      "off": tiermem.Offloader(policy="recompute", check_params=check),
                      "wall": [], "cpu": [], "fp_count": [], "fp_cpu": [], "fwd_host": [],
                      "fp_fwd": [], "watch_s": []}
    fp_stats = {"count": 0, "cpu": 0.0, "forward": 0, "watch": 0.0}
    inner = paramcheck.fingerprint
    inner_watch = paramcheck.ParamChecks.watch

    def timed(t, copy=True):
        t0 = clock()
        try:
            return inner(t, copy)
        finally:
            fp_stats["count"] += 1
            fp_stats["forward"] += copy   # copy=False: the comparison at recompute
            fp_stats["cpu"] += clock() - t0

    def timed_watch(self, held, key):
        t0 = clock()
        try:
            return inner_watch(self, held, key)
        finally:
            fp_stats["watch"] += clock() - t0

    paramcheck.fingerprint = timed
    paramcheck.ParamChecks.watch = timed_watch
    g = torch.Generator().manual_seed(1)
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=g).to(dev)
        y = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=g).to(dev)
        for r in runs.values():
            fp_stats.update(count=0, cpu=0.0, forward=0, watch=0.0)
            torch.manual_seed(i)
            sync(dev)
            w0, c0 = time.perf_counter(), clock()
            r["opt"].zero_grad(set_to_none=True)
            with r["off"]:
                loss = r["model"](x, y)
            fh = clock()
            loss.backward()
            r["opt"].step()
            sync(dev)
            w1, c1 = time.perf_counter(), clock()
            if i >= args.warmup:
                r["wall"].append(w1 - w0)
                r["cpu"].append(c1 - c0)
                r["fwd_host"].append(fh - c0)
                r["fp_count"].append(fp_stats["count"])
                r["fp_fwd"].append(fp_stats["forward"])
                r["fp_cpu"].append(fp_stats["cpu"])
                r["watch_s"].append(fp_stats["watch"])
    out = {}
    for name, r in runs.items():
        out[name] = {
            "wall_median_s": statistics.median(r["wall"]), "wall_min_s": min(r["wall"]),
            "cpu_median_s": statistics.median(r["cpu"]), "cpu_min_s": min(r["cpu"]),
            "fingerprints_per_step": statistics.median(r["fp_count"]),
            "fingerprint_cpu_median_s": statistics.median(r["fp_cpu"]),
            "fingerprints_in_forward_per_step": statistics.median(r["fp_fwd"]),
            "watch_in_forward_median_s": statistics.median(r["watch_s"]),
            "forward_host_median_s": statistics.median(r["fwd_host"]),
            "recompute_count_last_step": r["off"].stats.recompute_count,
        }
        r["off"].close()
    on, off = out["check_params=on"], out["check_params=off"]
    emit({"benchmark": "check_params_cost", "machine": machine(),
          "model": {**cfg.__dict__, "batch": args.batch}, "steps": args.steps,
          "device": str(dev), "clock": "wall (host)" if cuda else "process CPU time",
          "threads": torch.get_num_threads(), "configs": out,
          "fingerprint_share_of_step_cpu": on["fingerprint_cpu_median_s"] / on["cpu_median_s"],
          "cpu_median_ratio_on_vs_off": on["cpu_median_s"] / off["cpu_median_s"],
          "cpu_min_ratio_on_vs_off": on["cpu_min_s"] / off["cpu_min_s"]}, args.out)


if __name__ == "__main__":
    main()
