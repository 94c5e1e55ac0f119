"""Soak: a long run per policy, with fixed and with varying shapes, that must stay flat.

For each policy (keep, cpu, nvme, recompute, recompute+nvme, auto at a 50%
budget) and each shape
mode (``fixed``: one batch size; ``varying``: batch sizes drawn from 64..1024
rows, as variable-length NLP batches are), a small MLP trains ``--steps``
steps under one Offloader. Every ``--every`` steps the run records: RSS,
pooled host bytes (held and in use), pinned bytes held (CUDA), open file
descriptors, threads, and the files and bytes in the NVMe dir.

Verdict: after ``--warmup`` steps, no resource may grow beyond its tolerance
between the first sample after warm-up and the largest later one: RSS by 10%
of the first sample plus 64 MiB (allocator noise), the others not at all
beyond small slack (pooled bytes: one step's moved bytes; fds and threads: 2;
NVMe files: 0; NVMe dir bytes: one step's moved bytes). A run that fails the
verdict exits 1.

Run: ``python benchmarks/soak.py [--steps 500] [--out soak.json] [--plot soak.png]``.
Prints JSON. ``tests/test_soak_smoke.py`` runs a short version in CI.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiermem  # noqa: E402
from common import emit, machine  # noqa: E402

#: ``auto@50%``: the planner with ``device_budget="50%"``.
POLICIES = ("keep", "cpu", "nvme", "recompute", "recompute,nvme", "auto@50%")
MODES = ("fixed", "varying")
RSS_SLACK_BYTES = 64 << 20
RSS_SLACK_RATIO = 0.10


def _dir_usage(path: str) -> tuple:
    files = used = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue
            files += 1
            used += st.st_blocks * 512
    return files, used


def _sample(proc: psutil.Process, off: tiermem.Offloader, nvme_dir: str, step: int) -> dict:
    stores = off.store_stats()
    cpu = stores.get("cpu", {})
    nv = stores.get("nvme", {})
    files, used = _dir_usage(nvme_dir)
    return {
        "step": step,
        "rss_bytes": proc.memory_info().rss,
        "pooled_held_bytes": cpu.get("host_held_bytes", 0) + nv.get("staging_held_bytes", 0),
        "pooled_in_use_bytes": cpu.get("host_in_use_bytes", 0) + nv.get("staging_in_use_bytes", 0),
        "pinned_returns": sum(s.get("pinned_returns", 0) for s in stores.values()),
        "open_fds": proc.num_fds(),
        "threads": proc.num_threads(),
        "nvme_files": files,
        "nvme_dir_bytes": used,
    }


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.GELU(),
                               torch.nn.LayerNorm(width), torch.nn.Linear(width, width),
                               torch.nn.GELU(), torch.nn.Linear(width, 64))


def soak_one(policy: str, mode: str, steps: int, every: int, warmup: int, width: int,
             nvme_root: str) -> dict:
    """One policy x shape mode; returns its samples and verdict."""
    tag = policy.replace(",", "+").replace("@", "-").replace("%", "pct")
    nvme_dir = tempfile.mkdtemp(prefix=f"soak-{tag}-{mode}-", dir=nvme_root)
    model = _model(width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    name, _, budget = policy.partition("@")
    extra = {"device_budget": budget} if budget else {}
    off = tiermem.Offloader(policy=name, nvme_dir=nvme_dir, min_offload_bytes=0, **extra)
    rng = random.Random(0)
    proc = psutil.Process()
    samples, moved = [], 0
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        rows = 512 if mode == "fixed" else rng.randint(64, 1024)
        x = torch.randn(rows, 64)
        with off:
            loss = model(x).square().mean()
        moved = max(moved, off.stats.offloaded_bytes)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        if step % every == 0 or step == steps:
            gc.collect()
            samples.append(_sample(proc, off, nvme_dir, step))
    seconds = time.perf_counter() - t0
    off.close()
    left = _dir_usage(nvme_dir)
    os.rmdir(nvme_dir)   # fails (and the run with it) if close() left anything
    return {"policy": policy, "mode": mode, "steps": steps, "seconds": seconds,
            "most_offloaded_bytes_per_step": moved, "samples": samples,
            "left_in_nvme_dir_after_close": {"files": left[0], "bytes": left[1]},
            "verdict": verdict(samples, warmup, moved)}


def verdict(samples: list, warmup: int, moved_bytes: int) -> dict:
    """Which resources grew after warm-up beyond their tolerance (module docstring)."""
    after = [s for s in samples if s["step"] > warmup]
    if len(after) < 2:
        return {"ok": True, "grew": {}, "note": "too few samples after warm-up to judge"}
    first = after[0]
    tolerance = {
        "rss_bytes": first["rss_bytes"] * RSS_SLACK_RATIO + RSS_SLACK_BYTES,
        "pooled_held_bytes": moved_bytes,
        "open_fds": 2,
        "threads": 2,
        "nvme_files": 0,
        "nvme_dir_bytes": moved_bytes,
    }
    grew = {}
    for key, slack in tolerance.items():
        growth = max(s[key] for s in after) - first[key]
        if growth > slack:
            grew[key] = {"first": first[key], "max": max(s[key] for s in after),
                         "tolerance": slack}
    return {"ok": not grew, "grew": grew}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("rss_bytes", "pooled_held_bytes", "threads", "nvme_dir_bytes")
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 2.4 * len(keys)), sharex=True)
    for run in result["runs"]:
        steps = [s["step"] for s in run["samples"]]
        for ax, key in zip(axes, keys):
            scale = 2**20 if key.endswith("bytes") else 1
            ax.plot(steps, [s[key] / scale for s in run["samples"]],
                    label=f'{run["policy"]} {run["mode"]}')
    for ax, key in zip(axes, keys):
        ax.set_ylabel(key.replace("_bytes", " MiB"))
    axes[-1].set_xlabel("step")
    axes[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--every", type=int, default=50, help="sample every N steps")
    ap.add_argument("--warmup", type=int, default=100, help="steps before the verdict looks")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--policies", default=",".join(p.replace(",", "+") for p in POLICIES),
                    help="'+' joins a preference list, e.g. recompute+nvme")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--nvme-dir", default=None, help="default: a temporary directory")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    root = args.nvme_dir or tempfile.mkdtemp(prefix="tiermem-soak-")
    runs = []
    for policy in args.policies.split(","):
        for mode in args.modes.split(","):
            runs.append(soak_one(policy.replace("+", ","), mode, args.steps, args.every,
                                 args.warmup, args.width, root))
    result = {"benchmark": "soak", "machine": machine(), "settings": vars(args),
              "runs": runs, "ok": all(r["verdict"]["ok"] for r in runs)}
    emit(result, args.out)
    if args.plot:
        plot(result, args.plot)
    if args.nvme_dir is None:
        os.rmdir(root)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
