"""Where ``auto``'s unpredicted stall and step time come from on the CPU
(issue 12's cost-model gaps), and the predicted against the measured kept
bytes over a followed step.

Configurations (one TinyGPT + optimizer each, same seed, same batches,
round-robin so slow periods of a shared machine hit all alike): ``keep``,
``nvme`` (everything movable to the nvme tier), ``recompute+nvme`` (policy
``"recompute,nvme"``), ``tail`` (a callable policy: the last block, ``ln_f``,
the head and the loss kept, the rest to nvme), ``auto@50%``, ``auto@25%``
(with the same nvme dir). A name ending in ``/nokick`` runs its
configuration with every KickKept made a plain Kept (NOTE [Restores start
with backward] in tiermem/runtime/hooks.py), in the same process and rounds: the
kick's effect, like for like. A name ending in ``/nohold`` runs it with
``tail_hold_bytes=0`` (no tail hold: NOTE [Tail hold] in
tiermem/runtime/tailhold.py). Per measured step and configuration:

- forward / backward wall seconds, the main thread's CPU seconds in each
  (``time.thread_time``; on the CPU autograd runs the backward in the calling
  thread) and the process's (``time.process_time``): the process CPU time
  beyond keep's is what the moves cost in CPU (staging copies, engine and
  chain threads), the main thread's wall beyond its CPU time is time it
  could not run (descheduled by other threads on the same cores, or blocked);
- ``stats.stall_seconds`` and each restore's wait (``Step.restored``, wrapped
  here), with its time from the backward's start: a stall made at the first
  unpacks is read latency at backward start, one spread over the backward is
  the prefetch falling behind;
- auto rows: the plan's predicted stall, CPU charge and step cost, its
  prefetch window and the window the step used, and the kept bytes sampled
  after every pack (``bytes_by_tier['keep']``) against the plan's predicted
  kept bytes per pack index (``Plan.kept_timeline``).

Run: ``python benchmarks/bench_costmodel.py --nvme-dir DIR [--out x.json]``.
Never collected by pytest.
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
from common import add_gpt_args, emit, gpt_config, machine  # noqa: E402
from tiermem.models import TinyGPT  # noqa: E402
from tiermem.runtime.step import Step  # noqa: E402
import tiermem.runtime.hooks  # noqa: E402

_KICK_KEPT = tiermem.runtime.hooks.KickKept


def _no_kick(kept, step, top=None):
    """A KickKept made a plain Kept (the ``/nokick`` configurations)."""
    return kept

_restores: list = []
_orig_restored = Step.restored


def _restored(self, prefetched, seconds, late, host_wait=False):
    _restores.append((time.perf_counter(), seconds, late, host_wait, prefetched))
    return _orig_restored(self, prefetched, seconds, late, host_wait)


class _KeptSampler:
    """The measured kept timeline of one step: (pack index reached,
    ``bytes_by_tier['keep']``) after every module's forward (a global forward
    hook: outside the pack path, a nested saved_tensors_hooks would replace
    the Offloader's)."""

    def __init__(self, off) -> None:
        self.off = off
        self.samples: list = []

    def __call__(self, module, args, output):
        ctx = self.off._ctx
        if ctx is not None:
            self.samples.append((ctx.step.index, ctx.stats.bytes_by_tier["keep"]))


class Runner:
    def __init__(self, name: str, model: TinyGPT, nvme_dir: str, engine: str) -> None:
        self.name = name
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        base, _, variant = name.partition("/")
        kw = dict(nvme_dir=nvme_dir, engine=engine)
        if variant == "nohold":
            kw["tail_hold_bytes"] = 0
        self.base = base
        self.kick = variant != "nokick"
        if base == "keep":
            self.off = tiermem.Offloader(policy="keep")
        elif base == "nvme":
            self.off = tiermem.Offloader(policy="nvme", **kw)
        elif base == "recompute+nvme":
            self.off = tiermem.Offloader(policy="recompute,nvme", **kw)
        elif base == "tail":
            last = f"TinyGPT.blocks.{model.cfg.layers - 1}"
            kept = ("", "TinyGPT.ln_f", "TinyGPT.head")

            def tail(info):
                m = info.module
                return "keep" if m in kept or m == last or m.startswith(last + ".") else "nvme"
            self.off = tiermem.Offloader(policy=tail, **kw)
        else:
            self.off = tiermem.Offloader(policy="auto", device_budget=base.split("@")[1], **kw)
        self.rows: list = []

    def step(self, tokens, seed: int, sample: bool) -> dict:
        torch.manual_seed(seed)
        self.opt.zero_grad(set_to_none=True)
        sampler = _KeptSampler(self.off)
        tiermem.runtime.hooks.KickKept = _KICK_KEPT if self.kick else _no_kick
        del _restores[:]
        c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        with self.off as ctx:
            hook = (torch.nn.modules.module.register_module_forward_hook(sampler)
                    if sample else None)
            try:
                logits = self.model(tokens[:, :-1])
            finally:
                if hook is not None:
                    hook.remove()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                     tokens[:, 1:].flatten())
        stats = self.off.stats
        if sample:   # the forward's end (the loss saves outside any module)
            sampler.samples.append((ctx.step.index, stats.bytes_by_tier["keep"]))
        c1, p1, t1 = time.thread_time(), time.process_time(), time.perf_counter()
        loss.backward()
        c2, p2, t2 = time.thread_time(), time.process_time(), time.perf_counter()
        self.opt.step()
        waits = [(round((w - t1) * 1e3, 3), round(s * 1e3, 3), late, hw)
                 for w, s, late, hw, _ in _restores if s > 0]
        window = getattr(getattr(ctx, "prefetcher", None), "budget_bytes", None)
        row = {"loss": loss.item(), "prefetch_window_bytes": window, "forward_s": t1 - t0, "backward_s": t2 - t1,
               "forward_main_cpu_s": c1 - c0, "backward_main_cpu_s": c2 - c1,
               "forward_process_cpu_s": p1 - p0, "backward_process_cpu_s": p2 - p1,
               "stall_s": stats.stall_seconds, "late_restores": stats.late_restores,
               "host_waits": stats.host_waits, "restores": len(_restores),
               "prefetch_hits": stats.prefetch_hits, "prefetch_misses": stats.prefetch_misses,
               "tail_hits": stats.tail_hits,
               "peak_tail_hold_bytes": stats.peak_tail_hold_bytes,
               "moved_bytes": stats.offloaded_bytes,
               "kept_bytes": stats.bytes_by_tier["keep"],
               "stall_in_first_10pct_s": 0.0, "waits_ms": waits[:40]}
        cut = t1 + 0.1 * (t2 - t1)
        row["stall_in_first_10pct_s"] = sum(s for w, s, *_ in _restores if w <= cut)
        plan = self.off.plan if self.base.startswith("auto") else None
        if plan is not None:
            row.update(predicted_stall_s=plan.predicted_stall_s,
                       predicted_cpu_s=getattr(plan, "predicted_cpu_s", None),
                       predicted_step_cost_s=getattr(plan, "predicted_step_cost_s", None),
                       rates={k: plan.rates.get(k) for k in (
                           "move_cpu", "move_fixed_cpu_s", "compute_threads", "disk_write",
                           "disk_read", "disk_both")},
                       predicted_kept_bytes=plan.predicted_kept_bytes,
                       budget_bytes=plan.budget_bytes,
                       plan_tiers=plan.bytes_by_tier(),
                       plan_prefetch_bytes=plan.suggested_prefetch_bytes,
                       replans=plan.replans, replan_reason=plan.replan_reason,
                       recompute_bytes=plan.bytes_by_tier()["recompute"])
        if sample:
            row["kept_samples"] = sampler.samples
            if plan is not None and hasattr(plan, "kept_timeline"):
                row["predicted_kept_timeline"] = plan.kept_timeline()
        return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvme-dir", default=None)
    add_gpt_args(ap, batch=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--configs", default="keep,nvme,auto@50%,auto@25%")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    Step.restored = _restored
    cfg = gpt_config(args)
    tmp = None
    nvme_dir = args.nvme_dir
    if nvme_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-costmodel-")
        nvme_dir = tmp.name
    runners = []
    def subdir(name):
        return os.path.join(nvme_dir, "".join(c if c.isalnum() else "_" for c in name))

    for name in args.configs.split(","):
        os.makedirs(subdir(name), exist_ok=True)
    for name in args.configs.split(","):
        torch.manual_seed(0)
        runners.append(Runner(name, TinyGPT(cfg), subdir(name), args.engine))
    g = torch.Generator().manual_seed(1)
    t_start = time.perf_counter()
    for rnd in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq_len + 1), generator=g)
        for r in runners:
            row = r.step(tokens, 1000 + rnd, sample=(rnd == args.warmup + args.steps - 1))
            row["round"] = rnd
            if rnd >= args.warmup:
                r.rows.append(row)
            print(f"round {rnd} {r.name}: fwd {row['forward_s']:.3f} bwd {row['backward_s']:.3f}"
                  f" stall {row['stall_s'] * 1e3:.2f} ms", file=sys.stderr)
    out = {"name": "bench_costmodel", "machine": machine(), "args": vars(args),
           "model": {"layers": cfg.layers, "width": cfg.width, "seq_len": cfg.seq_len,
                     "batch": args.batch, "vocab": cfg.vocab},
           "wall_seconds": time.perf_counter() - t_start, "configs": {}}
    keep = {r.name: r for r in runners}.get("keep")
    for r in runners:
        med = lambda k: statistics.median(x[k] for x in r.rows)   # noqa: E731
        summary = {k: med(k) for k in ("forward_s", "backward_s", "forward_main_cpu_s",
                                       "backward_main_cpu_s", "forward_process_cpu_s",
                                       "backward_process_cpu_s", "stall_s",
                                       "stall_in_first_10pct_s", "prefetch_misses")}
        summary["step_s"] = statistics.median(x["forward_s"] + x["backward_s"] for x in r.rows)
        if keep is not None and r is not keep:
            pairs = list(zip(r.rows, keep.rows))
            summary["extra_process_cpu_s"] = statistics.median(
                (a["forward_process_cpu_s"] + a["backward_process_cpu_s"])
                - (b["forward_process_cpu_s"] + b["backward_process_cpu_s"]) for a, b in pairs)
            summary["extra_step_s"] = statistics.median(
                (a["forward_s"] + a["backward_s"]) - (b["forward_s"] + b["backward_s"])
                for a, b in pairs)
            summary["extra_step_less_stall_s"] = statistics.median(
                (a["forward_s"] + a["backward_s"] - a["stall_s"])
                - (b["forward_s"] + b["backward_s"]) for a, b in pairs)
        if r.base.startswith("auto") and r.rows:
            last = r.rows[-1]
            for k in ("predicted_stall_s", "predicted_cpu_s", "predicted_step_cost_s",
                      "predicted_kept_bytes", "budget_bytes", "plan_tiers",
                      "plan_prefetch_bytes", "prefetch_window_bytes", "replans",
                      "replan_reason", "recompute_bytes"):
                summary[k] = last.get(k)
        summary["moved_bytes"] = r.rows[-1]["moved_bytes"] if r.rows else 0
        out["configs"][r.name] = {"summary": summary, "steps": r.rows}
    losses = [[x["loss"] for x in r.rows] for r in runners]
    out["losses_equal"] = all(ls == losses[0] for ls in losses)
    if tmp is not None:
        tmp.cleanup()
    emit(out, args.out)
    return out


if __name__ == "__main__":
    main()
