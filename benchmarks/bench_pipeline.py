"""A 1F1B pipeline in one process (tests/pipeline_driver.py, not distributed):
saved bytes held per stage over the schedule, and the time of one optimizer
step under cpu, nvme and auto (one Offloader per stage) against the plain
schedule and against full checkpointing (torch.utils.checkpoint per block).

- Memory: one recorded step per configuration; after each op of each stage,
  the bytes of saved activations its forwards in flight keep in memory, as
  tiermem counts them (``stats.bytes_by_tier['keep']``; the plain schedule
  and checkpointing are counted under ``policy="keep"``, which moves
  nothing), and the bytes restored (or held by the tail hold) ahead of their
  unpack (``ctx.prefetcher.inflight_bytes``); per stage the peak of sources
  the tail hold keeps (counted in "ahead" too once its backward starts). On a
  CPU, "kept" and "moved to cpu" are the same RAM.
- Time: medians of ``--rounds`` rounds, the configurations interleaved in
  each round, after ``--warmup`` steps each (auto profiles and plans there);
  each configuration's ratio to the plain step of the same round.
- ``auto``: ``device_budget`` a size, ``--auto-budget`` times the plain first
  stage's peak (what its forwards in flight keep at once).

    python benchmarks/bench_pipeline.py --threads 1 --out results.json --plot timeline.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import tiermem  # noqa: E402
from benchmarks.common import emit, machine, mount_of  # noqa: E402
from pipeline_driver import make_batches, make_stages, run_schedule  # noqa: E402
from tiermem.models import GPTConfig  # noqa: E402

CONFIGS = ("plain", "checkpoint", "cpu", "nvme", "auto")


def _offloaders(name, stages, nvme_dir, budget):
    """One Offloader per stage for ``name`` (``None``: no tiermem)."""
    if name in ("plain", "checkpoint"):
        return None
    offs = []
    for s in range(stages):
        kw = {"min_offload_bytes": 0}
        if name in ("nvme", "auto"):   # auto: on a CPU only nvme and recompute free RAM
            kw.update(nvme_dir=os.path.join(nvme_dir, f"stage{s}"), engine="python")
        if name == "auto":
            kw.update(device_budget=budget)
        offs.append(tiermem.Offloader(policy=name, **kw))
    return offs


def _step(stage_list, batches, opt, offs, on_op=None) -> float:
    contexts = None if offs is None else [lambda o=o: o for o in offs]
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    run_schedule(stage_list, batches, "1f1b", contexts, on_op=on_op)
    opt.step()
    return time.perf_counter() - t0


def _timeline(stage_list, batches, opt, offs, stages):
    """Bytes each stage's forwards in flight keep, after each op of the step;
    and per stage the restores of the step: read on demand (misses), started
    ahead (hits), and seconds waited for them."""
    import tiermem.testing
    live = [dict() for _ in range(stages)]
    rows, ahead, stats, tail = [], [], [[] for _ in range(stages)], [0] * stages

    def on_op(s, op, ctx):
        if op[0] == "F":
            live[s][op[1]] = ctx
            stats[s].append(ctx.stats)
        else:
            live[s].pop(op[1], None)
        rows.append([sum(c.stats.bytes_by_tier["keep"] for c in d.values()) for d in live])
        ahead.append([sum(c.prefetcher.inflight_bytes for c in d.values()) for d in live])
        tail[s] = max(tail[s], tiermem.testing.tail_held_bytes(offs[s]))
    _step(stage_list, batches, opt, offs, on_op)
    restores = [{"misses": sum(x.prefetch_misses for x in st),
                 "hits": sum(x.prefetch_hits for x in st),
                 "tail_hits": sum(x.tail_hits for x in st),
                 "stall_seconds": sum(x.stall_seconds for x in st),
                 "peak_tail_held_bytes": tail[s]} for s, st in enumerate(stats)]
    return rows, ahead, restores


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--blocks-per-stage", type=int, default=1)
    ap.add_argument("--auto-budget", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab=2, layers=1, width=args.width, heads=args.heads,
                    seq_len=args.seq_len, dropout=0.1)
    batches = make_batches(args.micro_batches, args.batch, cfg)
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="tiermem-bench-pipeline-")
    S = args.stages

    def fresh():
        st = make_stages(S, cfg, args.blocks_per_stage)
        opt = torch.optim.SGD([p for x in st for p in x.parameters()], lr=1e-3)
        return st, opt

    # The plain schedule's kept bytes (policy keep moves nothing): the budget.
    st, opt = fresh()
    keep = [tiermem.Offloader(policy="keep", min_offload_bytes=0) for _ in range(S)]
    timelines, ahead, restores = {}, {}, {}
    timelines["plain"], ahead["plain"], restores["plain"] = _timeline(st, batches, opt, keep, S)
    plain_peak0 = max(r[0] for r in timelines["plain"])
    budget = int(args.auto_budget * plain_peak0)

    runs = {}
    for name in CONFIGS:
        st, opt = fresh()
        if name == "checkpoint":
            for x in st:
                x.checkpointed = True
        offs = _offloaders(name, S, nvme_dir, budget)
        for _ in range(args.warmup):
            _step(st, batches, opt, offs)
        runs[name] = (st, opt, offs)
    for name in CONFIGS[1:]:   # recorded after warm-up (auto follows its plan)
        st, opt, offs = runs[name]
        count = offs if offs is not None else [
            tiermem.Offloader(policy="keep", min_offload_bytes=0) for _ in range(S)]
        timelines[name], ahead[name], restores[name] = _timeline(st, batches, opt, count, S)
    times = {n: [] for n in CONFIGS}
    for _ in range(args.rounds):
        for name in CONFIGS:
            st, opt, offs = runs[name]
            times[name].append(_step(st, batches, opt, offs))
    configs = {}
    for name in CONFIGS:
        ratios = [t / p for t, p in zip(times[name], times["plain"])]
        peaks = [max(r[s] for r in timelines[name]) for s in range(S)]
        configs[name] = {"step_seconds": {"median": statistics.median(times[name]),
                                          "min": min(times[name]), "max": max(times[name])},
                         "ratio_to_plain_median": statistics.median(ratios),
                         "peak_kept_bytes_per_stage": peaks,
                         "restores_per_stage": restores[name],
                         "peak_restored_ahead_bytes_per_stage": [
                             max(r[s] for r in ahead[name]) for s in range(S)],
                         "timeline_restored_ahead_bytes": ahead[name],
                         "timeline_kept_bytes": timelines[name]}
    auto_offs = runs["auto"][2]
    plan = auto_offs[0].plan
    result = {
        "name": "pipeline",
        "what": "1F1B, one process; saved bytes kept per stage, step time per config",
        "machine": machine(),
        "nvme_mount": mount_of(nvme_dir),
        "args": vars(args),
        "auto": {"device_budget_bytes": budget, "plain_stage0_peak_bytes": plain_peak0,
                 "stage0_peak_bytes": configs["auto"]["peak_kept_bytes_per_stage"][0],
                 "stage0_within_budget": configs["auto"]["peak_kept_bytes_per_stage"][0]
                 <= budget * 1.05,
                 "stage0_plan_in_flight": getattr(plan, "in_flight", None),
                 "stage0_plan_notes": [] if plan is None else list(plan.notes)},
        "configs": configs,
    }
    for offs in [keep] + [r[2] for r in runs.values() if r[2] is not None]:
        for o in offs:
            o.close()
    emit(result, args.out)
    if args.plot:
        plot(result, args.plot)
    return 0


def plot(res: dict, path: str) -> None:
    """Per stage (columns): the bytes kept (top row) and kept plus restored
    ahead (bottom row) over the schedule's ops, one line per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    S = res["args"]["stages"]
    fig, axes = plt.subplots(2, S, figsize=(4 * S, 6.4), sharey=True, sharex=True)
    styles = {"plain": ("black", "-"), "checkpoint": ("tab:orange", "-"),
              "cpu": ("tab:green", "-"), "nvme": ("tab:red", ":"), "auto": ("tab:blue", "-")}
    for row, with_ahead in enumerate((False, True)):
        for s in range(S):
            ax = axes[row][s]
            for name, e in res["configs"].items():
                ys = [(r[s] + (a[s] if with_ahead else 0)) / (1 << 20) for r, a in
                      zip(e["timeline_kept_bytes"], e["timeline_restored_ahead_bytes"])]
                color, ls = styles.get(name, (None, "-"))
                ax.step(range(len(ys)), ys, where="post", label=name, color=color, ls=ls)
            if s == 0:
                ax.axhline(res["auto"]["device_budget_bytes"] / (1 << 20), ls="--",
                           c="gray", label="auto's budget (stage 0)")
                ax.set_ylabel("kept + restored ahead (MiB)" if with_ahead else "kept (MiB)")
            if row == 0:
                ax.set_title(f"stage {s}")
            else:
                ax.set_xlabel("op of the 1F1B step (all stages)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    a = res["args"]
    fig.suptitle(f"Saved activations per stage: 1F1B, {S} stages x {a['micro_batches']} "
                 f"micro-batches, one process, {a['threads']} thread(s) (cpu and nvme coincide)")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
