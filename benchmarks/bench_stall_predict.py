"""Per restore, the auto plan's simulated restore against what a step that
follows the plan did (issue 12: the first plan predicted no stall, the
measured stall was tens of ms).

For each ``auto@P%`` configuration (its own Offloader and TinyGPT, same seed
and batches) it runs a profiled step and then ``--steps`` steps that follow
the plan (re-plans included, as the closed loop makes them). Per followed
step and moved tensor (pack index ``i``, matched to the step's handle by its
position among the moved tensors, bytes checked), times in ms from the
step's first unpack (the model's: from the profile's first unpack):

- predicted (``PlannedTensor.restore_s``): restore start, end, and need;
- measured: the restore's start (a prefetch, or on demand in the unpack:
  ``demand``), its unpack (need), the unpack's wait (``stats.stall_seconds``'
  part) and whether it was late, and when the wait ended.

Also per step: predicted and measured stall, backward span of the profile and
of the step (first to last unpack), main-thread CPU time of the backward
(``time.thread_time``), and where the unpacks of moved tensors spent their
time outside the counted wait (the ``take`` call: landing waits, launches,
the window's refill).

Instrumented by wrapping ``tiermem.offloader.unpack`` and
``MovingStore._restore`` in this process only (nothing in the hot path).
Run: ``python benchmarks/bench_stall_predict.py [--nvme-dir DIR] [--out x.json]``.
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
import tiermem.offloader  # noqa: E402
from common import add_gpt_args, emit, gpt_config, machine  # noqa: E402
from tiermem.models import TinyGPT  # noqa: E402
from tiermem.runtime.step import Step  # noqa: E402
from tiermem.tiers.moving import MovedHandle, MovingStore  # noqa: E402

_log: dict = {"first": None, "last": None, "unpacks": [], "restores": [], "in_take": None}
_orig_unpack = tiermem.offloader.unpack
_orig_restore = MovingStore._restore
_orig_take = MovingStore.take
_orig_restored = Step.restored


def _unpack(handle):
    now = time.perf_counter()
    if _log["first"] is None:
        _log["first"] = now
    if type(handle) is not MovedHandle:
        out = _orig_unpack(handle)
        _log["last"] = time.perf_counter()
        return out
    pos = handle.entry.pos
    _log["in_take"] = pos
    out = _orig_unpack(handle)
    end = time.perf_counter()
    _log["in_take"] = None
    _log["last"] = end
    _log["unpacks"].append((pos, handle.nbytes, now, end, handle.module,
                            tuple(handle.layout.size)))
    return out


def _take(self, h, more_uses):
    t0 = time.perf_counter()
    out = _orig_take(self, h, more_uses)
    _log["unpacks_take"].append((h.entry.pos, time.perf_counter() - t0))
    return out


def _restore(self, h):
    t = time.perf_counter()
    out = _orig_restore(self, h)
    pos = h.entry.pos
    _log["restores"].append((pos, t, time.perf_counter(), _log["in_take"] == pos))
    return out


_waits: list = []


def _restored(self, prefetched, seconds, late, host_wait=False):
    _waits.append((time.perf_counter(), seconds, late))
    return _orig_restored(self, prefetched, seconds, late, host_wait)


def _install() -> None:
    tiermem.offloader.unpack = _unpack
    MovingStore._restore = _restore
    MovingStore.take = _take
    Step.restored = _restored


def _reset() -> None:
    _log.update(first=None, last=None, unpacks=[], restores=[], in_take=None, unpacks_take=[])
    del _waits[:]


def _ms(x):
    return None if x is None else round(x * 1e3, 3)


def _step_rows(plan, stats) -> dict:
    """Predicted against measured, per moved tensor of ``plan``."""
    moved = [p for p in plan.tensors if p.tier in ("cpu", "nvme")]
    t0 = _log["first"]
    restores = {pos: (s, e, demand) for pos, s, e, demand in _log["restores"]}
    unpacks = {}
    for pos, nbytes, s, e, module, shape in _log["unpacks"]:
        unpacks.setdefault(pos, (nbytes, s, e, module, shape))
    takes = {}
    for pos, sec in _log["unpacks_take"]:
        takes.setdefault(pos, sec)
    # The waits in order of the unpacks of moved tensors that took a restore.
    rows = []
    for pos, p in enumerate(moved):
        rs = getattr(p, "restore_s", None)   # None on a planner without it
        u = unpacks.get(pos)
        r = restores.get(pos)
        row = {"index": p.index, "module": p.module, "nbytes": p.nbytes,
               "predicted_start_ms": _ms(rs[0]) if rs else None,
               "predicted_end_ms": _ms(rs[1]) if rs else None,
               "predicted_need_ms": _ms(rs[2]) if rs else None,
               "predicted_stall_ms": _ms(p.cost_s)}
        if u is not None:
            nbytes, s, e, module, shape = u
            row.update(match=(nbytes, module, shape) == (p.nbytes, p.module, tuple(p.shape)),
                       need_ms=_ms(s - t0),
                       unpack_ms=_ms(e - s), take_ms=_ms(takes.get(pos, 0.0)))
        if r is not None:
            row.update(start_ms=_ms(r[0] - t0), issue_ms=_ms(r[1] - r[0]), demand=r[2])
        rows.append(row)
    # Waits (Step.restored) in unpack order, attributed by time to the moved unpack.
    for when, sec, late in _waits:
        best = None
        for row in rows:
            if "need_ms" in row and row["need_ms"] <= (when - t0) * 1e3 + 1e-6:
                if best is None or row["need_ms"] > best["need_ms"]:
                    best = row
        if best is not None and "wait_ms" not in best:
            best.update(wait_ms=_ms(sec), late=late)
    late = [r for r in rows if r.get("late")]
    return {"rows": rows, "backward_span_ms": _ms((_log["last"] or t0) - t0),
            "all_matched": all(r.get("match", False) for r in rows),
            "restores_on_demand": sum(bool(r.get("demand")) for r in rows),
            "late_on_demand": sum(bool(r.get("demand")) for r in late),
            "late_prefetched": sum(not r.get("demand") for r in late),
            "predicted_on_demand": sum(
                r["predicted_start_ms"] is not None
                and abs(r["predicted_start_ms"] - r["predicted_need_ms"]) < 1e-3
                and r["predicted_end_ms"] > r["predicted_start_ms"] for r in rows),
            "predicted_late": sum((r["predicted_stall_ms"] or 0) > 0 for r in rows),
            "need_error_ms_median": statistics.median(
                [r["need_ms"] - r["predicted_need_ms"] for r in rows
                 if "need_ms" in r and r["predicted_need_ms"] is not None] or [0.0])}


def run_config(budget: str, model_cfg, batches, nvme_dir, steps: int, engine: str) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    off = tiermem.Offloader(policy="auto", device_budget=budget, nvme_dir=nvme_dir,
                            engine=engine)
    out = {"budget": budget, "steps": []}
    for k, tokens in enumerate(batches[:steps + 1]):
        torch.manual_seed(1000 + k)
        opt.zero_grad(set_to_none=True)
        plan_before = off.plan   # the plan this step follows (None: profiled)
        _reset()
        t0 = time.perf_counter()
        with off:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                     tokens[:, 1:].flatten())
        t1, c1 = time.perf_counter(), time.thread_time()
        loss.backward()
        t2, c2 = time.perf_counter(), time.thread_time()
        opt.step()
        stats = off.stats
        step = {"step": k, "forward_ms": _ms(t1 - t0), "backward_ms": _ms(t2 - t1),
                "backward_main_cpu_ms": _ms(c2 - c1),
                "stall_ms": _ms(stats.stall_seconds), "late": stats.late_restores,
                "host_waits": stats.host_waits, "misses": stats.prefetch_misses,
                "moved_bytes": stats.offloaded_bytes,
                "first_unpack_after_backward_call_ms": _ms(
                    None if _log["first"] is None else _log["first"] - t1)}
        plan = off.plan   # read after backward: the closed loop has checked this step
        if plan_before is None:
            step["profiled"] = True
        else:
            step.update(predicted_stall_ms=_ms(plan_before.predicted_stall_s),
                        replans_of_followed=plan_before.replans,
                        window_bytes=plan_before.suggested_prefetch_bytes,
                        rates_factor=getattr(plan_before, "rate_factor", 1.0))
            step.update(_step_rows(plan_before, stats))
        step["replans_now"] = None if plan is None else plan.replans
        step["replan_reason"] = None if plan is None else plan.replan_reason
        out["steps"].append(step)
        print(f"{budget} step {k}: fwd {t1 - t0:.3f} bwd {t2 - t1:.3f} stall "
              f"{stats.stall_seconds * 1e3:.2f} ms predicted "
              f"{'-' if plan_before is None else round(plan_before.predicted_stall_s * 1e3, 2)}"
              f" replans {step['replans_now']}", file=sys.stderr)
    prof = tiermem.testing.kept_profiles(off).get(off.plan.keys) if off.plan is not None else None
    if prof is not None:
        out["profile_backward_span_ms"] = _ms(prof.backward_end_s - prof.backward_start_s) \
            if getattr(prof, "backward_end_s", None) is not None else None
        b0 = prof.backward_start_s
        out["profile_records"] = [
            {"index": r.index, "module": r.module, "op": r.op, "tier": r.profile_tier,
             "plan_tier": off.plan.tensors[r.index].tier,
             "use_ms": _ms(None if r.first_use_s is None else r.first_use_s - b0),
             "unpack_ms": _ms(getattr(r, "unpack_s", None)),
             "recompute_ms": _ms(r.recompute_s)} for r in prof.records]
    out["rates"] = off.plan.rates if off.plan is not None else None
    off.close()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvme-dir", default=None)
    add_gpt_args(ap, batch=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--budgets", default="50%,25%")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    _install()
    cfg = gpt_config(args)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab, (args.batch, args.seq_len + 1), generator=g)
               for _ in range(args.steps + 1)]
    tmp = None
    nvme_dir = args.nvme_dir
    if nvme_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-stall-")
        nvme_dir = tmp.name
    out = {"name": "bench_stall_predict", "machine": machine(), "args": vars(args),
           "configs": {}}
    t_start = time.perf_counter()
    for budget in args.budgets.split(","):
        d = os.path.join(nvme_dir, budget.replace("%", "pct"))
        os.makedirs(d, exist_ok=True)
        out["configs"][f"auto@{budget}"] = run_config(budget, cfg, batches, d, args.steps,
                                                      args.engine)
    out["wall_seconds"] = time.perf_counter() - t_start
    for name, c in out["configs"].items():
        followed = [s for s in c["steps"] if not s.get("profiled")]
        c["summary"] = {
            "predicted_stall_ms": [s["predicted_stall_ms"] for s in followed],
            "stall_ms": [s["stall_ms"] for s in followed],
            "replans": c["steps"][-1]["replans_now"],
            "first_replan_reason": c["steps"][-1]["replan_reason"],
            "late_on_demand": [s.get("late_on_demand") for s in followed],
            "late_prefetched": [s.get("late_prefetched") for s in followed],
            "predicted_on_demand": [s.get("predicted_on_demand") for s in followed],
            "need_error_ms_median": [s.get("need_error_ms_median") for s in followed],
            "backward_main_cpu_ms": [s["backward_main_cpu_ms"] for s in followed],
            "median_stall_ms": statistics.median(s["stall_ms"] for s in followed)
            if followed else None}
    if tmp is not None:
        tmp.cleanup()
    emit(out, args.out)
    return out


if __name__ == "__main__":
    main()
