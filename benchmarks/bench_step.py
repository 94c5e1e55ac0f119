"""Training-step time and peak memory of TinyGPT: no tiermem vs ``keep`` vs ``cpu``
(also ``nvme``, ``recompute``, ``recompute-nocheck``: ``--configs``).

Timing: one model + AdamW per configuration, all built from the same seed;
each round runs one step of every configuration in turn (round-robin, so slow
drifts of the machine hit all configurations alike); the first ``--warmup``
rounds are discarded. A step is zero_grad, forward (under the Offloader, if
any), backward, AdamW step, timed on the host (with ``cuda.synchronize`` on
CUDA). Every configuration sees the same batches and dropout seeds, so their
losses must be bit-identical; the JSON says whether they were.

Peak memory:

- CPU: each configuration runs in a fresh subprocess (``--child``): it builds the
  model and optimizer, resets the kernel's peak-RSS counter (write 5 to
  ``/proc/self/clear_refs``, Linux >= 4.0), runs ``--warmup`` +
  ``--memory-steps`` steps, and reports ``VmHWM`` (peak RSS during the steps)
  and the RSS before them. (Not ``ru_maxrss``: Linux carries it over from the
  parent process across fork + exec, so it would show the parent's peak.)
- CUDA: in this process, ``torch.cuda.max_memory_allocated`` over one step of
  each configuration after ``reset_peak_memory_stats``, and the allocated bytes
  before the step (weights and optimizer states of all configurations).

Run: ``python benchmarks/bench_step.py [--out results.json]``. Prints JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import tiermem
from common import (emit, machine, pick_device, reset_peak_rss, rss_bytes, summarize, sync,
                    vm_hwm_bytes)
from tiermem.models import GPTConfig, TinyGPT

#: ``recompute-nocheck``: recompute with ``check_params=False`` (the cost of
#: NOTE [Parameters changed before backward] is the difference).
CONFIGS = ("plain", "keep", "cpu", "nvme", "recompute", "recompute-nocheck")
DEFAULT_CONFIGS = ("plain", "keep", "cpu")


def _model_cfg(args) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, layers=args.layers, width=args.width, heads=args.heads,
                     seq_len=args.seq_len, dropout=args.dropout)


class _Runner:
    """One configuration: a model, its optimizer and (maybe) an Offloader."""

    def __init__(self, config: str, model: TinyGPT, min_offload_bytes, nvme_dir=None) -> None:
        self.config = config
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        extra = {"nvme_dir": nvme_dir} if config == "nvme" else {}
        policy = config
        if config == "recompute-nocheck":
            policy, extra = "recompute", {"check_params": False}
        self.off = (None if config == "plain"
                    else tiermem.Offloader(policy=policy, min_offload_bytes=min_offload_bytes,
                                           **extra))

    def step(self, x, y, seed: int) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        if self.off is None:
            loss = self.model(x, y)
        else:
            with self.off:
                loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def stats(self):
        if self.off is None:
            return None
        s = self.off.stats
        return {"bytes_by_tier": {k: v for k, v in s.bytes_by_tier.items() if v},
                "count_by_tier": {k: v for k, v in s.count_by_tier.items() if v},
                "dedup_hits": s.dedup_hits, "param_count": s.param_count,
                "small_count": s.small_count, "peak_host_bytes": s.peak_host_bytes,
                "peak_disk_bytes": s.peak_disk_bytes, "late_restores": s.late_restores,
                "stall_seconds": s.stall_seconds, "prefetch_hits": s.prefetch_hits,
                "prefetch_misses": s.prefetch_misses}


def _batches(args, device, n: int):
    gen = torch.Generator().manual_seed(args.seed + 1)
    out = []
    for _ in range(n):
        x = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen)
        out.append((x.to(device), torch.roll(x, -1, dims=1).to(device)))
    return out


def _build(args, device, configs):
    torch.manual_seed(args.seed)
    base = TinyGPT(_model_cfg(args)).to(device)
    return [_Runner(c, copy.deepcopy(base), args.min_offload_bytes, args.nvme_dir)
            for c in configs]


def time_steps(args, device) -> dict:
    runners = _build(args, device, args.configs)
    rounds = args.warmup + args.steps
    batches = _batches(args, device, rounds)
    times = {r.config: [] for r in runners}
    losses_equal = True
    for i in range(rounds):
        x, y = batches[i]
        losses = []
        for r in runners:
            sync(device)
            t0 = time.perf_counter()
            loss = r.step(x, y, args.seed * 1_000_003 + i)
            sync(device)
            dt = time.perf_counter() - t0
            losses.append(loss)
            if i >= args.warmup:
                times[r.config].append(dt)
        losses_equal &= all(torch.equal(losses[0], l) for l in losses[1:])
    out = {}
    base = summarize(times["plain"])["median"] if "plain" in times else None
    for r in runners:
        s = summarize(times[r.config])
        entry = {"step_seconds": s}
        if base:
            entry["median_vs_plain"] = s["median"] / base
        st = r.stats()
        if st is not None:
            entry["tiermem_stats_last_step"] = st
            r.off.close()
        out[r.config] = entry
    return {"configs": out, "losses_bit_identical_across_configs": bool(losses_equal)}






def memory_child(args, device) -> dict:
    """Peak RSS of one configuration's steps (run in a fresh process on CPU).

    The kernel's peak-RSS counter is reset once the model and optimizer exist,
    so the peak covers only the training steps (warm-up included: memory the
    allocator or tiermem's pools keep between steps counts). ``ru_maxrss`` is
    not used: Linux carries it over from the parent across fork + exec.
    """
    (runner,) = _build(args, device, [args.child])
    n_steps = args.warmup + args.memory_steps
    batches = _batches(args, device, n_steps)
    import gc
    gc.collect()
    hwm_setup = vm_hwm_bytes()
    rss_setup = rss_bytes()
    reset = reset_peak_rss()
    for i in range(n_steps):
        runner.step(*batches[i], seed=i)
    hwm = vm_hwm_bytes() if reset else None
    out = {"config": args.child, "steps": n_steps,
           "rss_after_setup_bytes": rss_setup,
           "peak_rss_during_steps_bytes": hwm,
           "peak_rss_increase_bytes": None if hwm is None else hwm - rss_setup,
           "rss_after_steps_bytes": rss_bytes(),
           "peak_rss_import_and_setup_bytes": hwm_setup,
           "tiermem_stats_last_step": runner.stats()}
    if runner.off is not None:
        out["host_bytes_in_use_after_step"] = runner.off.host_bytes_in_use
        cpu = runner.off.store_stats().get("cpu")
        if cpu is not None:
            out["host_bytes_pooled_after_step"] = cpu["host_held_bytes"]
    return out


def memory_cpu(args) -> dict:
    out = {}
    for c in args.configs:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", c, "--device", "cpu"]
        cmd += _forward_args(args)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"bench_step: child for {c} failed:\n{proc.stderr}")
        out[c] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"method": "fresh subprocess per config; peak RSS = VmHWM after clear_refs=5 "
                      "(reset after model/optimizer setup, before the first step)", "configs": out}


def memory_cuda(args, device) -> dict:
    runners = _build(args, device, args.configs)
    batches = _batches(args, device, args.warmup + 1)
    out = {}
    for r in runners:
        for i in range(args.warmup):
            r.step(*batches[i], seed=i)
    for r in runners:
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        r.step(*batches[-1], seed=args.warmup)
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        out[r.config] = {"allocated_before_step_bytes": before, "peak_allocated_bytes": peak,
                         "peak_increase_bytes": peak - before, "tiermem_stats": r.stats()}
        if r.off is not None:
            r.off.close()
    return {"method": "in-process torch.cuda.max_memory_allocated per step", "configs": out}


def _forward_args(args) -> list:
    keys = ("vocab", "layers", "width", "heads", "seq_len", "dropout", "batch", "seed",
            "warmup", "memory_steps")
    out = []
    for k in keys:
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.min_offload_bytes is not None:
        out += ["--min-offload-bytes", str(args.min_offload_bytes)]
    out += ["--nvme-dir", args.nvme_dir]
    return out


def main() -> None:
    d = GPTConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="measured steps per config")
    p.add_argument("--warmup", type=int, default=3, help="discarded steps per config")
    p.add_argument("--memory-steps", type=int, default=3, help="steps of the memory runs")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, from {','.join(CONFIGS)}",
                   type=lambda s: tuple(c for c in s.split(",") if c))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--min-offload-bytes", type=int, default=None,
                   help="tiermem min_offload_bytes (default: tiermem's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--nvme-dir", default=None,
                   help="directory for the nvme config (default: a new temp dir under /tmp; "
                        "use a real disk, not tmpfs)")
    p.add_argument("--child", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown config(s) {bad}; choose from {CONFIGS}")
    device = pick_device(args.device)
    if args.child:
        if args.nvme_dir is None:   # run by hand: the parent passes its own
            args.nvme_dir = tempfile.mkdtemp(prefix="tiermem-bench-", dir="/tmp")
        print(json.dumps(memory_child(args, device)))
        return
    made_dir = args.nvme_dir is None
    if made_dir:   # passed on to the children; removed at the end
        args.nvme_dir = tempfile.mkdtemp(prefix="tiermem-bench-", dir="/tmp")
    mach = machine()  # before the runs, so the commit recorded is the one measured
    t0 = time.perf_counter()
    try:
        timing = time_steps(args, device)
        memory = memory_cuda(args, device) if device.type == "cuda" else memory_cpu(args)
    finally:
        if made_dir:
            shutil.rmtree(args.nvme_dir, ignore_errors=True)
    model = TinyGPT(_model_cfg(args))
    emit({"benchmark": "step", "device": str(device),
          "model": {**_model_cfg(args).__dict__, "parameters": model.num_parameters(),
                    "batch": args.batch},
          "steps_measured": args.steps, "warmup_discarded": args.warmup,
          "method": "round-robin across configs each step; step = zero_grad + fwd + bwd + AdamW",
          "machine": mach, "timing": timing, "memory": memory,
          "wall_seconds": time.perf_counter() - t0,
          "load_average_end": list(os.getloadavg())}, args.out)


if __name__ == "__main__":
    main()
