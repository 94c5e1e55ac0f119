"""Cost of producer tracking (the recompute tier's TorchDispatchMode) in forward,
whole-forward and scoped (NOTE [Scoped tracking] in tiermem/tracking/modules.py), and a
feasibility measurement of recipes read from the autograd graph.

Times the forward pass of TinyGPT (loss included) under, round-robin (each
round in the order of a Williams design: NOTE [Order of the interleaved
steps] in benchmarks/suite/roles.py), warm-up discarded, medians, and paired
ratios per round with a 90% bootstrap interval of their median (NOTE [Paired
step ratios] in benchmarks/suite/budgets.py):

- ``none``: no mode, no hooks; ``module_hooks``: tiermem's module tracker
  alone (every Offloader step installs it);
- ``noop_mode``: a dispatch mode that only forwards (the floor of any
  ``TorchDispatchMode``-based tool, such as selective checkpointing);
  ``noop_function_mode``: a ``TorchFunctionMode`` that only forwards (the
  floor of tracking at the level of the model's torch calls instead);
- ``producer_mode``: :class:`~tiermem.tracking.producers.ProducerMode` around the
  whole forward; ``full_tracking``: the same with the module tracker (what a
  step whose plan recomputed cost before scoping); ``producer_mode_nonames``:
  the mode made with ``names=False`` (ops that are not recomputable run
  unrecorded: NOTE [Recording only what recipes use] in tiermem/tracking/producers.py);
- ``scoped_plan``, ``scoped_all_blocks``, ``scoped_1_block``: the module
  tracker with a :class:`~tiermem.tracking.modules.TrackingScope` over the modules of
  a real ``auto`` plan's recipes (``--budget``: on the CPU without an NVMe
  dir the plan recomputes everything it can), over those inside the blocks,
  and over those of block 0 only (the scope of a plan that recomputes one
  block's tensors); these record every recomputable op in scope, as steps
  did before NOTE [Recording only what recipes use];
- ``scoped_plan_ops``, ``scoped_all_blocks_ops``: the same scopes as a step
  following the plan tracks them now: ``names=False`` and, per module, only
  the ops its recipes ran there (``plan.tracking_ops``);
- ``scoped_plan_calls``: the plan's scope and op filter with tracking only
  inside the torch calls its recipes' ops ran in (``plan.tracking_calls``:
  NOTE [Tracking inside torch calls] in tiermem/tracking/modules.py), every such call
  under the dispatch mode; ``scoped_plan_direct``: the same, the calls that
  ran one op in the profile recorded whole without the mode
  (``plan.tracking_direct``: NOTE [Calls recorded whole] in
  tiermem/tracking/producers.py), as a step following the plan tracks now;
- ``auto_scoped`` / ``auto_module_scoped`` / ``auto_whole_forward``: the
  forward of a step of a real ``Offloader(policy="auto")`` following that
  plan, with its scope (tracking inside the plan's calls), with its scope
  tracked whole module by module (as before the calls), and with
  whole-forward tracking forced (each round also runs the backward, untimed);
  ``auto_scoped_no_direct``: with every tracked call under the mode (as
  before calls were recorded whole).

``--call-costs``: only what a no-op dispatch mode adds to single torch calls
of TinyGPT's kinds (attention, linear, layer norm, GELU, dropout), the
least that tracking inside each costs.

``--clock cpu --threads 1``: the forward's CPU time in the one thread that
runs every op (``time.thread_time``), for a machine shared with other jobs,
where wall-clock times mostly measure the other jobs (wall times are
recorded too).

``--grad-fn``: for each tensor the recompute tier could drop (a recorded
recomputable producer), whether its recipe can be read from the autograd
graph at pack time instead (``t.grad_fn`` and its ``_saved_*`` attributes:
every argument of the producer op present, no RNG state needed). JSON out.

    python benchmarks/bench_tracking.py --clock cpu --threads 1 --grad-fn \
        --out benchmarks/results/<date>-cpu-tracking-scoped.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import add_gpt_args, emit, gpt_config, machine, pick_device, summarize, sync  # noqa: E402
from benchmarks.suite.budgets import median_ci  # noqa: E402
from benchmarks.suite.roles import round_order  # noqa: E402

import tiermem  # noqa: E402
import tiermem.testing  # noqa: E402
from tiermem.models import TinyGPT  # noqa: E402
from tiermem.tracking.producers import RANDOM_OPS, ProducerMode, storage_key  # noqa: E402
from tiermem.tracking.modules import ModuleStack, TrackingScope, current_module  # noqa: E402


class NoopMode(TorchDispatchMode):
    """Runs every op unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class NoopFunctionMode(TorchFunctionMode):
    """Runs every torch function unchanged: the floor of tracking one level
    up, at ``__torch_function__`` (F.linear, F.gelu, Tensor.view: what the
    model's Python calls, before they decompose into aten ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class ModuleOfEachOp(TorchDispatchMode):
    """Counts the ops of a forward by innermost running module."""

    def __init__(self) -> None:
        super().__init__()
        self.by_module: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_module[current_module()] += 1
        return func(*args, **(kwargs or {}))


def _scoped(names, ops=None, names_too=True, calls=None, direct=None):
    def ctx():
        stack = contextlib.ExitStack()
        mode = ProducerMode(names=names_too)
        mode.alias_index = calls is not None
        stack.enter_context(ModuleStack(scope=TrackingScope(mode, names, ops=ops, calls=calls,
                                                            direct=direct)))
        stack.mode = mode
        return stack
    return ctx


def _nonames():
    return ProducerMode(names=False)


def records_made(ctx_factory, model, x) -> int:
    """Records one forward under ``ctx_factory()`` leaves (outputs recorded)."""
    ctx = ctx_factory()
    with ctx:
        model(x, x)
    mode = ctx if isinstance(ctx, ProducerMode) else ctx.mode
    return len(mode._records)


def _full():
    stack = contextlib.ExitStack()
    stack.enter_context(ModuleStack())
    stack.enter_context(ProducerMode())
    return stack


def _plan_scope(model, x, budget):
    off = tiermem.Offloader(policy="auto", device_budget=budget)
    for _ in range(3):
        with off:
            loss = model(x, x)
        loss.backward()
    plan = off.plan
    return off, plan


def _auto_forward(off, force_whole, by_module=False, hook_tracked=False, no_direct=False):
    """A step of ``off`` (its forward); ``hook_tracked``: with the pack hook's
    own ops dispatched to the producer mode, as before NOTE [The pack hook
    runs untracked] (tiermem/tracking/producers.py); ``no_direct``: every tracked call
    under the dispatch mode, as before NOTE [Calls recorded whole]."""
    def run(model, x):
        off.plan   # reading it settles the planner (closed loop) before the step
        if force_whole:
            for p in tiermem.testing.planner_of(off).plans.values():
                p.tracking_scope = None
        if by_module:
            for p in tiermem.testing.planner_of(off).plans.values():
                p.tracking_calls = None
        if no_direct:
            for p in tiermem.testing.planner_of(off).plans.values():
                p.tracking_direct = None
        real = tiermem.offloader.untracked_pack
        if hook_tracked:
            tiermem.offloader.untracked_pack = lambda mode, pack: pack
        try:
            with off:
                loss = model(x, x)
        finally:
            tiermem.offloader.untracked_pack = real
        return loss
    return run


def grad_fn_feasibility(model, x) -> dict:
    """Per tensor the recompute tier could drop in one forward: can the
    autograd graph give its recipe at pack time?"""
    rows = []
    mode = ProducerMode()

    seen = set()

    def pack(t):
        rec = mode.record_of(t)
        if rec is None or rec.func is None or storage_key(t) in seen:
            return t   # not recomputable, or saved before (one row per tensor)
        seen.add(storage_key(t))
        node = t.grad_fn
        nbytes = t.numel() * t.element_size()
        row = {"op": rec.name, "bytes": nbytes, "node": None if node is None else type(node).__name__}
        missing = []
        if node is None:
            missing.append("no grad_fn (does not require grad)")
        else:
            attrs = set(dir(node))
            schema = rec.func._schema
            values = list(rec.args) + [None] * (len(schema.arguments) - len(rec.args))
            for i, a in enumerate(schema.arguments):
                if a.kwarg_only and a.name not in rec.kwargs:
                    continue
                v = rec.kwargs.get(a.name, values[i] if i < len(values) else None)
                is_tensor = "Tensor" in str(a.type)
                if not is_tensor and (a.has_default_value() and v is None or v == a.default_value):
                    continue   # a default: nothing to read
                if f"_saved_{a.name}" not in attrs and f"_raw_saved_{a.name}" not in attrs:
                    missing.append(a.name)
            if rec.func.overloadpacket in RANDOM_OPS:
                missing.append("generator state (not in the graph)")
        row["missing"] = missing
        row["feasible"] = not missing
        rows.append(row)
        return t

    with ModuleStack(), mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    del loss
    by_op: dict = {}
    for r in rows:
        e = by_op.setdefault(r["op"], {"tensors": 0, "bytes": 0, "feasible_tensors": 0,
                                       "feasible_bytes": 0, "node": r["node"],
                                       "missing": sorted(set(r["missing"]))})
        e["tensors"] += 1
        e["bytes"] += r["bytes"]
        if r["feasible"]:
            e["feasible_tensors"] += 1
            e["feasible_bytes"] += r["bytes"]
    total = sum(r["bytes"] for r in rows)
    feas = sum(r["bytes"] for r in rows if r["feasible"])
    return {"recomputable_tensors": len(rows), "recomputable_bytes": total,
            "feasible_tensors": sum(r["feasible"] for r in rows), "feasible_bytes": feas,
            "by_op": by_op}


def per_op_cost(n: int = 4000, repeats: int = 7) -> dict:
    """Microseconds per op added by each mode, on ops whose kernel is tiny (a
    small ``add``: the cost is the mode's; ``producer_mode_unrecorded``: an op
    the mode does not record), and per enter+leave of a scope's mode (one
    module boundary each way); min of ``repeats``."""
    a = torch.ones(4)

    def ops():
        for _ in range(n):
            torch.add(a, a)

    def timed(ctx_factory) -> float:
        best = float("inf")
        for _ in range(repeats):
            with ctx_factory():
                c0 = time.thread_time()
                ops()
                best = min(best, time.thread_time() - c0)
        return best

    plain = timed(contextlib.nullcontext)
    def unrecorded():
        mode = ProducerMode(names=False)
        mode.wanted = frozenset()   # add is not among the ops to record
        return mode

    out = {"noop_mode": (timed(NoopMode) - plain) / n * 1e6,
           "producer_mode": (timed(ProducerMode) - plain) / n * 1e6,
           "producer_mode_unrecorded": (timed(unrecorded) - plain) / n * 1e6}
    mode = ProducerMode()
    best = float("inf")
    for _ in range(repeats):
        c0 = time.thread_time()
        for _ in range(n):
            mode.__enter__()
            mode.__exit__(None, None, None)
        best = min(best, time.thread_time() - c0)
    out["mode_enter_leave"] = best / n * 1e6
    return out


def kernel_times(model, x, repeats: int = 5) -> dict:
    """Aten self CPU time per op name (``torch.profiler``) of one forward,
    plainly and under :class:`NoopMode`, summed over ``repeats`` interleaved
    forwards each (after two warm-up pairs): which kernels run longer, or
    differently, while a dispatch mode is active. Op counts are not compared
    (under a mode the profiler sees each op twice: the handler's call and the
    kernel's)."""
    from torch.profiler import ProfilerActivity, profile

    def once(mode: bool) -> collections.Counter:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if mode:
                with NoopMode():
                    model(x, x)
            else:
                model(x, x)
        out: collections.Counter = collections.Counter()
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                out[e.key] += e.self_cpu_time_total
        return out
    for _ in range(2):
        once(False)
        once(True)
    plain: collections.Counter = collections.Counter()
    mode: collections.Counter = collections.Counter()
    for _ in range(repeats):
        plain.update(once(False))
        mode.update(once(True))
    rows = sorted(set(plain) | set(mode), key=lambda k: plain[k] - mode[k])
    return {"repeats": repeats,
            "total_ms": {"plain": sum(plain.values()) / repeats / 1e3,
                         "noop_mode": sum(mode.values()) / repeats / 1e3},
            "per_op_ms": {k: {"plain": plain[k] / repeats / 1e3,
                              "noop_mode": mode[k] / repeats / 1e3} for k in rows[:12]}}


def call_slowdown(dev, repeats: int = 200) -> dict:
    """Per torch call of TinyGPT's kinds (its shapes at batch 4, seq 256,
    width 256), the call's median time without a mode and under a
    dispatch mode that only forwards, interleaved: what tracking inside that
    call costs at least (NOTE [Tracking inside torch calls] in
    tiermem/tracking/modules.py)."""
    F = torch.nn.functional
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(4, 4, 256, 64, generator=g, device=dev) for _ in range(3))
    a = torch.randn(1024, 256, generator=g, device=dev)
    w = torch.randn(1024, 256, generator=g, device=dev)
    h = torch.randn(1024, 1024, generator=g, device=dev)
    calls = {
        "scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=0.1),
        "linear": lambda: F.linear(a, w),
        "layer_norm": lambda: F.layer_norm(a, (256,)),
        "gelu": lambda: F.gelu(h),
        "dropout": lambda: F.dropout(h, 0.1),
    }
    out = {}
    for name, fn in calls.items():
        t = {"plain": [], "mode": []}
        for r in range(repeats):
            order = (("plain", contextlib.nullcontext), ("mode", NoopMode))
            for key, ctx in (order if r % 2 else order[::-1]):
                with ctx():
                    sync(dev)
                    t0 = time.perf_counter()
                    fn()
                    sync(dev)
                    t[key].append(time.perf_counter() - t0)
        plain, mode = statistics.median(t["plain"]), statistics.median(t["mode"])
        ratios = [m / p for m, p in zip(t["mode"], t["plain"])]
        out[name] = {"plain_us": plain * 1e6, "mode_us": mode * 1e6,
                     "extra_us": (mode - plain) * 1e6, "paired_ratio": median_ci(ratios)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_args(p, batch=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget", default="10%")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-auto", action="store_true", help="skip the auto_* rows")
    p.add_argument("--grad-fn", action="store_true", help="add the autograd-graph experiment")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: leave as is); with --clock cpu use 1")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the main thread's CPU time (time.thread_time), for a machine "
                        "shared with other jobs; with --threads 1 every op runs in it")
    p.add_argument("--configs", default=None,
                   help="comma-separated subset of the rows to time (none and module_hooks "
                        "are always in: the ratios are taken against them); default: all")
    p.add_argument("--call-costs", action="store_true",
                   help="only measure what a dispatch mode adds to single torch calls")
    p.add_argument("--kernel-times", action="store_true",
                   help="only profile the forward's aten self times, plain and under a "
                        "no-op dispatch mode")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = pick_device(a.device)
    if a.clock == "cpu" and dev.type != "cpu":
        sys.exit("bench_tracking: --clock cpu measures host CPU time: use it on the CPU")
    if a.call_costs:
        emit({"benchmark": "dispatch-mode cost inside single torch calls",
              "machine": machine(), "device": str(dev), "torch_threads": torch.get_num_threads(),
              "calls": call_slowdown(dev)}, a.out)
        return 0
    torch.manual_seed(0)
    cfg = gpt_config(a)
    model = TinyGPT(cfg).to(dev)
    x = torch.randint(0, cfg.vocab, (a.batch, a.seq_len), device=dev)
    if a.kernel_times:
        emit({"benchmark": "aten self time of a forward, plain and under a no-op dispatch mode",
              "machine": machine(), "device": str(dev), "torch_threads": torch.get_num_threads(),
              "model": {"layers": a.layers, "width": a.width, "seq_len": a.seq_len,
                        "batch": a.batch, "dropout": cfg.dropout},
              "kernels": kernel_times(model, x)}, a.out)
        return 0
    counter = ModuleOfEachOp()
    with ModuleStack(), counter:
        model(x, x)
    n_ops = sum(counter.by_module.values())
    fcount = NoopFunctionMode()
    with fcount:
        model(x, x)

    off, plan = _plan_scope(model, x, a.budget)
    plan_scope = plan.tracking_scope
    if plan_scope is None:
        sys.exit("bench_tracking: the plan tracks the whole forward; no scope to measure")
    in_blocks = frozenset(n for n in plan_scope if n.startswith("TinyGPT.blocks."))
    block0 = frozenset(n for n in in_blocks if n.startswith("TinyGPT.blocks.0."))
    scopes = {"scoped_plan": plan_scope, "scoped_all_blocks": in_blocks,
              "scoped_1_block": block0}
    plan_ops = plan.tracking_ops
    if plan_ops is None:
        sys.exit("bench_tracking: the plan records every op in its scope; no filter to measure")
    configs = {
        "none": contextlib.nullcontext,
        "module_hooks": ModuleStack,
        "noop_mode": NoopMode,
        "noop_function_mode": NoopFunctionMode,
        "producer_mode": ProducerMode,
        "producer_mode_nonames": _nonames,
        "full_tracking": _full,
    }
    configs.update({k: _scoped(v) for k, v in scopes.items()})
    configs["scoped_plan_ops"] = _scoped(plan_scope, plan_ops, names_too=False)
    configs["scoped_all_blocks_ops"] = _scoped(
        in_blocks, {m: n for m, n in plan_ops.items() if m in in_blocks}, names_too=False)
    plan_calls = plan.tracking_calls
    if plan_calls is not None:
        configs["scoped_plan_calls"] = _scoped(plan_scope, plan_ops, names_too=False,
                                               calls=plan_calls)
        configs["scoped_plan_direct"] = _scoped(plan_scope, plan_ops, names_too=False,
                                                calls=plan_calls, direct=plan.tracking_direct)
    recorded = {k: records_made(configs[k], model, x) for k in configs
                if k.startswith(("producer_mode", "scoped_"))}
    runners = {k: (lambda c: (lambda m, i: _under(c, m, i)))(c) for k, c in configs.items()}
    if not a.no_auto:
        off_full, _ = _plan_scope(model, x, a.budget)
        runners["auto_scoped"] = _auto_forward(off, False)
        runners["auto_whole_forward"] = _auto_forward(off_full, True)
        off_module, _ = _plan_scope(model, x, a.budget)
        runners["auto_module_scoped"] = _auto_forward(off_module, False, by_module=True)
        off_hook, _ = _plan_scope(model, x, a.budget)
        runners["auto_scoped_hook_tracked"] = _auto_forward(off_hook, False, hook_tracked=True)
        off_nodirect, _ = _plan_scope(model, x, a.budget)
        runners["auto_scoped_no_direct"] = _auto_forward(off_nodirect, False, no_direct=True)
    if a.configs:
        keep = {"none", "module_hooks"} | set(a.configs.split(","))
        unknown = keep - set(runners)
        if unknown:
            sys.exit(f"bench_tracking: --configs: unknown rows {sorted(unknown)}; "
                     f"known: {sorted(runners)}")
        runners = {k: v for k, v in runners.items() if k in keep}
    times = {k: [] for k in runners}
    walls = {k: [] for k in runners}
    names = list(runners)
    for r in range(a.warmup + a.rounds):
        # A Williams design: every row runs right after every other one
        # equally often (the auto rows' backward leaves caches cold for the
        # next), so no row always pays for the same predecessor.
        for name in round_order(names, r):
            run = runners[name]
            sync(dev)
            c0, t0 = time.thread_time(), time.perf_counter()
            loss = run(model, x)
            sync(dev)
            dc, dt = time.thread_time() - c0, time.perf_counter() - t0
            if name.startswith("auto_"):
                loss.backward()
            if r >= a.warmup:
                times[name].append(dc if a.clock == "cpu" else dt)
                walls[name].append(dt)
            del loss
    res = {"benchmark": "producer tracking cost in forward: whole-forward and scoped",
           "machine": machine(),
           "model": {"layers": a.layers, "width": a.width, "seq_len": a.seq_len,
                     "batch": a.batch, "dropout": cfg.dropout,
                     "loss": "in the forward (cross-entropy)"},
           "device": str(dev), "rounds": a.rounds, "warmup": a.warmup,
           "ops_per_forward": n_ops, "torch_function_calls_per_forward": fcount.calls,
           "plan": {"budget": a.budget, "recomputed_tensors": sum(
               o[0].value == "recompute" for o in plan.orders), "tensors": len(plan.orders)},
           "scopes": {k: {"modules": sorted(v),
                          "ops_tracked": sum(counter.by_module[m] for m in v)}
                      for k, v in scopes.items()},
           "plan_tracking_ops": {m: sorted(n) for m, n in sorted(plan_ops.items())},
           "plan_tracking_calls": (None if plan_calls is None else {
               m: None if n is None else sorted(n) for m, n in sorted(plan_calls.items())}),
           "plan_tracking_direct": {m: dict(sorted(c.items())) for m, c in
                                    sorted((plan.tracking_direct or {}).items())},
           "records_per_forward": recorded,
           "torch_threads": torch.get_num_threads(), "clock": a.clock,
           "forward_seconds": {k: summarize(v) for k, v in times.items()},
           "forward_wall_seconds": {k: summarize(v) for k, v in walls.items()}}
    # Paired per round (adjacent in time, so a shared machine's slow drift
    # cancels): median over rounds of each configuration's time / none's.
    def paired(k, base):
        return [t / b for t, b in zip(times[k], times[base])]
    res["paired_ratio_vs_none"] = {
        k: statistics.median(paired(k, "none")) for k in times if k != "none"}
    res["paired_ratio_vs_none_ci"] = {
        k: median_ci(paired(k, "none")) for k in times if k != "none"}
    scoped_rows = tuple(k for k in ("full_tracking", "scoped_plan", "scoped_all_blocks",
                                    "scoped_1_block", "scoped_plan_ops",
                                    "scoped_all_blocks_ops", "scoped_plan_calls",
                                    "scoped_plan_direct")
                       if k in times)
    res["paired_ratio_vs_module_hooks"] = {
        k: statistics.median(paired(k, "module_hooks")) for k in scoped_rows}
    res["paired_ratio_vs_module_hooks_ci"] = {
        k: median_ci(paired(k, "module_hooks")) for k in scoped_rows}
    if "auto_scoped" in times and "auto_scoped_hook_tracked" in times:
        res["paired_ratio_auto_scoped_vs_hook_tracked_ci"] = median_ci(
            paired("auto_scoped", "auto_scoped_hook_tracked"))
    if "auto_scoped" in times and "auto_scoped_no_direct" in times:
        res["paired_ratio_auto_scoped_vs_no_direct_ci"] = median_ci(
            paired("auto_scoped", "auto_scoped_no_direct"))
    if "scoped_plan_direct" in times and "scoped_plan_calls" in times:
        res["paired_ratio_scoped_direct_vs_calls_ci"] = median_ci(
            paired("scoped_plan_direct", "scoped_plan_calls"))
    if "auto_scoped" in times and "auto_whole_forward" in times:
        res["paired_ratio_auto_scoped_vs_whole_forward"] = statistics.median(
            paired("auto_scoped", "auto_whole_forward"))
    res["samples"] = times
    res["per_op_us"] = per_op_cost()
    med = {k: v["median"] for k, v in res["forward_seconds"].items()}
    base = med["none"]
    res["overhead_vs_none"] = {k: med[k] / base - 1 for k in med if k != "none"}
    res["tracking_cost_vs_module_hooks"] = {
        k: med[k] / med["module_hooks"] - 1 for k in scoped_rows}
    res["overhead_per_op_us"] = {k: (med[k] - base) / n_ops * 1e6
                                 for k in ("noop_mode", "producer_mode", "producer_mode_nonames")
                                 if k in med}
    if "auto_scoped" in med and "auto_whole_forward" in med:
        res["auto_scoped_vs_whole_forward"] = med["auto_scoped"] / med["auto_whole_forward"] - 1
    # The planner's price of the plan's tracking (NOTE [Tracking priced] in
    # tiermem/planner/runtime.py) against what the rows measured.
    predicted = getattr(plan, "predicted_tracking_s", None)
    if predicted is not None:
        measured = {k: med[k] - med["module_hooks"]
                    for k in ("scoped_plan_calls", "scoped_plan_direct") if k in med}
        res["plan_tracking_priced"] = {
            "tracked_ops": plan.tracked_ops, "track_op_s": plan.rates.get("track_op_s"),
            "predicted_tracking_s": predicted,
            "predicted_share_of_plain_forward": predicted / base,
            "measured_over_module_hooks_s": measured,
            "measured_share_of_plain_forward": {k: v / base for k, v in measured.items()},
            "measured_us_per_tracked_op": {k: v / plan.tracked_ops * 1e6
                                           for k, v in measured.items()
                                           if plan.tracked_ops}}
    if a.grad_fn:
        res["grad_fn_feasibility"] = grad_fn_feasibility(model, x)
    off.close()
    if not a.no_auto:
        off_full.close()
        off_module.close()
        off_hook.close()
        off_nodirect.close()
    emit(res, a.out)
    return 0


def _under(ctx_factory, model, x):
    with ctx_factory():
        return model(x, x)


if __name__ == "__main__":
    sys.exit(main())
