"""The forward's host cost: tiermem's producer tracking against PyTorch's own
selective-checkpointing dispatch mode (issue 33), in one run, interleaved.

Configurations, each on the same TinyGPT (same parameters, same batch):

- ``plain``: no hooks, no mode;
- ``sac_all_save``: every block under ``torch.utils.checkpoint.checkpoint``
  (non-reentrant) with ``create_selective_checkpoint_contexts`` and a policy
  answering ``MUST_SAVE`` for every op but dropout's mask buffer, which the
  forward writes in place and SAC refuses to save (recomputed: an
  ``empty_like`` and two in-place ops per dropout): the SAC dispatch mode's
  own cost;
- ``sac_usual``: the same with the usual policy: matmuls and attention
  saved, every other op recomputed (``PREFER_RECOMPUTE``);
- ``hooks_floor``: ``torch.autograd.graph.saved_tensors_hooks`` with a pack
  hook that only detaches (what any offloader built on those hooks pays per
  saved tensor before doing anything: torchtune's and ``save_on_cpu`` are);
- ``dispatch_floor``: a dispatch mode that only forwards each op (what any
  tracking by dispatch mode pays per op before doing anything: SAC's and
  tiermem's are such modes); ``tracking_only``: tiermem's producer mode as a
  learning step of ``recompute`` makes it (every op recorded), around the
  forward, with no saved-tensor hooks (``recompute_learning`` minus it is the
  pack side: recipes, dedup, stats);
- ``keep``, ``recompute``, ``recompute_cpu``: ``tiermem.Offloader`` with
  policy ``keep``, ``recompute``, ``"recompute,cpu"``; ``recompute_learning``:
  ``recompute`` with every step recording every op, as its learning steps do
  (NOTE [Records learned by position]: ``recompute``'s other steps record in full
  only the ops its recipes use); ``recompute_nocheck``:
  ``recompute`` with ``check_params=False`` (no parameter check: what SAC
  does not do either);
- ``auto_scoped``: ``Offloader(policy="auto", device_budget=--budget)``
  following its plan (tracking scoped to the plan's recipes, as shipped);
  ``auto_whole``: the same plan with tracking forced over the whole forward.

Per round (each in the order of a Williams design: NOTE [Order of the
interleaved steps] in benchmarks/suite/roles.py), every configuration runs
one forward, timed, and its backward, timed apart; the first ``--warmup``
rounds are discarded; each forward starts after ``gc.collect()``, so that
Python's collections of one configuration's objects do not land in another's
timing. Reported per configuration and width: medians of the
forward and of the step (forward + backward), paired ratios against
``plain`` per round with a 90% bootstrap interval of their median (NOTE
[Paired step ratios] in benchmarks/suite/budgets.py), and the host
microseconds added per aten op and per saved tensor of the plain forward
(forward time over plain's, divided by the counts).

Also per configuration: the host time from entering its context to the
start of the model's first module (``setup_s``: the step's own setup, with
nothing queued on a GPU yet; in a synchronised, device-bound forward it adds
to the forward's time whatever the rest costs).

``--profile CONFIG``: instead, cProfile over ``--rounds`` forwards of that
configuration (after ``--warmup``), and the functions with the most own
time per forward (where tracking's host time goes).

``--alternate-seq-len N``: every odd round runs all configurations on the
first N tokens, so forwards of two shapes come in turn (NOTE [Records learned
by position], rule 4, in tiermem/tiers/positions.py).

``--clock cpu --threads 1``: the main thread's CPU time
(``time.thread_time``) instead of wall time, for a machine shared with other
jobs; with one thread every op runs in it. Never collected by pytest.

    python benchmarks/bench_host_cost.py --clock cpu --threads 1 \\
        --out benchmarks/results/<date>-cpu-host-cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import emit, machine  # noqa: E402
from benchmarks.suite.budgets import median_ci  # noqa: E402
from benchmarks.suite.roles import round_order  # noqa: E402

import tiermem  # noqa: E402
import tiermem.testing  # noqa: E402
from tiermem.models import GPTConfig, TinyGPT  # noqa: E402

CONFIGS = ["plain", "sac_all_save", "sac_usual", "hooks_floor", "dispatch_floor", "tracking_only",
           "keep", "recompute", "recompute_learning", "recompute_nocheck",
           "recompute_cpu", "auto_scoped", "auto_whole"]
#: The tiermem policy of each fixed-policy configuration, and its other settings.
POLICY = {"keep": "keep", "recompute": "recompute", "recompute_learning": "recompute",
          "recompute_nocheck": "recompute", "recompute_cpu": "recompute,cpu"}
SETTINGS = {"recompute_nocheck": {"check_params": False}}

_aten = torch.ops.aten
#: What the usual SAC policy saves (torchtitan-style: matmuls and attention).
SAVED_BY_USUAL_SAC = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                      _aten._scaled_dot_product_flash_attention_for_cpu.default,
                      _aten._scaled_dot_product_efficient_attention.default,
                      _aten._scaled_dot_product_flash_attention.default}


def _written_later(op) -> bool:
    """Ops whose output the forward writes in place next (dropout's
    ``empty_like`` then ``bernoulli_`` then ``div_``): SAC refuses to save
    those ("cached ... has been mutated"), so both policies recompute them."""
    name = op._schema.name
    return name.endswith("_") or name in ("aten::empty_like", "aten::empty")


def _all_save(ctx, op, *args, **kwargs):
    return (CheckpointPolicy.PREFER_RECOMPUTE if _written_later(op)
            else CheckpointPolicy.MUST_SAVE)


def _usual(ctx, op, *args, **kwargs):
    return (CheckpointPolicy.MUST_SAVE if op in SAVED_BY_USUAL_SAC and not _written_later(op)
            else CheckpointPolicy.PREFER_RECOMPUTE)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops of a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()   # not t itself: a saved output would hold its own grad_fn


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _FloorHooks:
    """Reusable ``hooks_floor`` context: saved-tensor hooks doing nothing
    but a detach (a fresh ``saved_tensors_hooks`` per entry)."""

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_detached, _same)
        self._hooks.__enter__()

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Forwards(TorchDispatchMode):
    """``dispatch_floor``: a dispatch mode that only runs each op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _TrackingOnly:
    """Reusable ``tracking_only`` context: a fresh producer mode per entry, as
    a step of ``policy="recompute"`` makes it, with no saved-tensor hooks."""

    def __enter__(self):
        from tiermem.tracking.producers import ProducerMode
        self._mode = ProducerMode()
        self._mode.__enter__()

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._mode.clear()


def _with_sac(model: TinyGPT, policy) -> TinyGPT:
    """``model`` with each block's forward under selective checkpointing."""
    for block in model.blocks:
        fwd = block.forward
        ctx = functools.partial(create_selective_checkpoint_contexts, policy)
        block.forward = functools.partial(checkpoint, fwd, use_reentrant=False, context_fn=ctx)
    return model


def _fixed(name: str) -> tiermem.Offloader:
    """The Offloader of fixed-policy configuration ``name``; ``recompute_learning``:
    every step records every op (NOTE [Records learned by position] off)."""
    off = tiermem.Offloader(policy=POLICY[name], **SETTINGS.get(name, {}))
    if name == "recompute_learning":
        tiermem.testing.follow_learned_positions(off, False)
    return off


def _planned(model, x, budget: str, whole: bool):
    """An auto Offloader that has profiled ``model`` and follows its plan;
    ``whole``: its plans track the whole forward."""
    off = tiermem.Offloader(policy="auto", device_budget=budget)
    for _ in range(3):
        with off:
            loss = model(x, x)
        loss.backward()
    plan = off.plan
    if whole:
        for p in tiermem.testing.planner_of(off).plans.values():
            p.tracking_scope = None
    return off, plan


def counts(model, x) -> dict:
    """Aten ops and saved tensors of one plain forward."""
    saved = [0]

    def pack(t):
        saved[0] += 1
        return t

    counter = _OpCounter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
        model(x, x)
    return {"aten_ops": counter.ops, "saved_tensors": saved[0]}


def measure(width: int, a) -> dict:
    torch.manual_seed(0)
    dev = torch.device(a.device)
    cfg = GPTConfig(vocab=512, layers=a.layers, width=width, heads=4, seq_len=a.seq_len)
    with dev:   # made on the device: a wide model's CPU init would take longer than its timing
        base = TinyGPT(cfg)
    x = torch.randint(0, cfg.vocab, (a.batch, a.seq_len), device=dev)
    # --alternate-seq-len: odd rounds run every configuration on this length.
    x_odd = x[:, :a.alternate_seq_len].contiguous() if a.alternate_seq_len else x
    models, contexts, notes = {}, {}, {}
    for name in a.configs:
        with dev:
            m = TinyGPT(cfg)
        m.load_state_dict(base.state_dict())
        if name == "sac_all_save":
            _with_sac(m, _all_save)
        elif name == "sac_usual":
            _with_sac(m, _usual)
        models[name] = m
        if name.startswith("auto"):
            off, plan = _planned(m, x, a.budget, whole=name == "auto_whole")
            contexts[name] = off
            notes[name] = {"recomputed": sum(p.tier == "recompute" for p in plan.tensors),
                           "tensors": len(plan.tensors)}
        elif name in ("plain", "sac_all_save", "sac_usual"):
            contexts[name] = contextlib.nullcontext()
        elif name == "hooks_floor":
            contexts[name] = _FloorHooks()
        elif name == "dispatch_floor":
            contexts[name] = _Forwards()
        elif name == "tracking_only":
            contexts[name] = _TrackingOnly()
        else:
            contexts[name] = _fixed(name)
    n = counts(base, x)
    for c in contexts.values():   # the auto ones stepped already: see the loop below
        if isinstance(c, tiermem.Offloader):
            tiermem.testing.release_module_hooks(c)
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    # CUDA: the forward's host time (until it returns) and its time to the
    # device's end (synchronised): see docs/host-cost.md.
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fwd = {k: [] for k in a.configs}
    host = {k: [] for k in a.configs}
    step = {k: [] for k in a.configs}
    setup = {k: [] for k in a.configs}
    started: list = []
    first_hooks = [m.tok_emb.register_forward_pre_hook(lambda *_: started.append(clock()))
                   for m in models.values()]
    for r in range(a.warmup + a.rounds):
        for name in round_order(a.configs, r):
            m, ctx = models[name], contexts[name]
            gc.collect()   # no configuration pays for collections of another's garbage
            sync()
            started.clear()
            t0 = clock()
            xr = x_odd if r % 2 else x
            with ctx:
                loss = m(xr, xr)
            th = clock()
            sync()
            t1 = clock()
            loss.backward()
            sync()
            t2 = clock()
            for p in m.parameters():
                p.grad = None
            if isinstance(ctx, tiermem.Offloader):
                # No other configuration pays for tiermem's global module
                # hooks (held between an Offloader's steps once Dynamo has
                # run): its next step installs them again, inside its timed
                # forward.
                tiermem.testing.release_module_hooks(ctx)
            if r >= a.warmup:
                setup[name].append(started[0] - t0)
                fwd[name].append(t1 - t0)
                host[name].append(th - t0)
                step[name].append(t2 - t0)
    for hook in first_hooks:
        hook.remove()
    out = {"width": width, "device": str(dev), "counts": n, "plans": notes, "configs": {}}
    for name in a.configs:
        row = {"forward_s": statistics.median(fwd[name]), "step_s": statistics.median(step[name]),
               "setup_s": statistics.median(setup[name]),
               "forward_samples_s": fwd[name], "step_samples_s": step[name]}
        if dev.type == "cuda":
            row["forward_host_s"] = statistics.median(host[name])
            row["forward_host_samples_s"] = host[name]
        if name not in ("plain", "sac_all_save") and "sac_all_save" in fwd:
            # The bar of issue 33: this forward against SAC's, paired per round.
            row["forward_ratio_to_sac_all_save"] = median_ci(
                [f / s_ for f, s_ in zip(fwd[name], fwd["sac_all_save"])])
        if name != "plain":
            rf = [f / p for f, p in zip(fwd[name], fwd["plain"])]
            rs = [f / p for f, p in zip(step[name], step["plain"])]
            row["forward_ratio"] = median_ci(rf)
            row["step_ratio"] = median_ci(rs)
            extra = row["forward_s"] - statistics.median(fwd["plain"])
            row["forward_extra_us_per_op"] = extra * 1e6 / n["aten_ops"]
            row["forward_extra_us_per_saved_tensor"] = extra * 1e6 / n["saved_tensors"]
        out["configs"][name] = row
    for c in contexts.values():
        if isinstance(c, tiermem.Offloader):
            c.close()
    return out


def profile(width: int, a, name: str, top: int = 40) -> dict:
    """cProfile's own time per forward of ``name``'s forwards, by function."""
    import cProfile
    import pstats
    torch.manual_seed(0)
    dev = torch.device(a.device)
    cfg = GPTConfig(vocab=512, layers=a.layers, width=width, heads=4, seq_len=a.seq_len)
    with dev:
        m = TinyGPT(cfg)
    x = torch.randint(0, cfg.vocab, (a.batch, a.seq_len), device=dev)
    if name.startswith("sac"):
        _with_sac(m, _all_save if name == "sac_all_save" else _usual)
    if name.startswith("auto"):
        ctx, _ = _planned(m, x, a.budget, whole=name == "auto_whole")
    elif name in POLICY:
        ctx = _fixed(name)
    elif name == "hooks_floor":
        ctx = _FloorHooks()
    elif name == "dispatch_floor":
        ctx = _Forwards()
    elif name == "tracking_only":
        ctx = _TrackingOnly()
    else:
        ctx = contextlib.nullcontext()
    prof = cProfile.Profile()
    for r in range(a.warmup + a.rounds):
        if r >= a.warmup:
            prof.enable()
        with ctx:
            loss = m(x, x)
        prof.disable()
        loss.backward()
    stats = pstats.Stats(prof).stats

    def label(k) -> str:
        return f"{k[0].split('/site-packages/')[-1]}:{k[1]}({k[2]})"

    # pstats rows: (primitive calls, calls, own time, cumulative time, callers);
    # callers: {caller: (primitive calls, calls, own time, cumulative time)}.
    rows = sorted(((v[2] / a.rounds, v[1] / a.rounds, label(k), v[4])
                   for k, v in stats.items()), key=lambda r: r[:2], reverse=True)[:top]
    total = sum(v[2] for v in stats.values()) / a.rounds
    if isinstance(ctx, tiermem.Offloader):
        ctx.close()
    return {"config": name, "width": width, "device": str(dev), "profiled_s_per_forward": total,
            "top_own_time": [
                {"function": f, "own_s_per_forward": s_, "calls_per_forward": c,
                 # Who calls it, by the time spent in it from there (a built-in's
                 # label alone often does not say which op it is).
                 "callers": [{"function": label(ck), "calls_per_forward": cv[1] / a.rounds,
                              "own_s_per_forward": cv[2] / a.rounds}
                             for ck, cv in sorted(callers.items(), key=lambda i: -i[1][2])[:3]]}
                for s_, c, f, callers in rows]}


def _ci(c) -> str:
    return "-" if not c else f"{c['median']:.3f} ({c['low']:.3f}-{c['high']:.3f})"


def summarize(data: dict) -> str:
    """A Markdown table of a result of :func:`measure` (``--summarize FILE``)."""
    lines = []
    for r in data["results"]:
        n = r["counts"]
        lines += [f"Width {r['width']} on {r.get('device', 'cpu')}: {n['aten_ops']} aten ops, "
                  f"{n['saved_tensors']} saved tensors per forward.", "",
                  "| config | forward ms | / plain (90% CI) | / SAC all-save (90% CI) | "
                  "step / plain | +µs per op | +µs per saved tensor | host ms | setup µs |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, c in r["configs"].items():
            host, setup = c.get("forward_host_s"), c.get("setup_s")
            lines.append(
                f"| {name} | {c['forward_s'] * 1e3:.2f} | {_ci(c.get('forward_ratio'))} | "
                f"{_ci(c.get('forward_ratio_to_sac_all_save'))} | {_ci(c.get('step_ratio'))} | "
                f"{c.get('forward_extra_us_per_op', 0):.2f} | "
                f"{c.get('forward_extra_us_per_saved_tensor', 0):.2f} | "
                f"{'-' if host is None else f'{host * 1e3:.2f}'} | "
                f"{'-' if setup is None else f'{setup * 1e6:.0f}'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="256,512")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--alternate-seq-len", type=int, default=0, metavar="N",
                   help="odd rounds use sequences of N tokens (two kinds of forward in "
                        "turn; per-op and per-tensor figures count the --seq-len forward)")
    p.add_argument("--budget", default="50%")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (wall clock; adds forward_host_s)")
    p.add_argument("--profile", default=None, metavar="CONFIG",
                   help="cProfile this configuration's forwards instead of timing")
    p.add_argument("--out", default=None)
    p.add_argument("--summarize", default=None, metavar="FILE",
                   help="print a Markdown table of a result JSON, run nothing")
    a = p.parse_args(argv)
    if a.summarize:
        with open(a.summarize) as f:
            print(summarize(json.load(f)))
        return 0
    if a.profile:
        if a.threads:
            torch.set_num_threads(a.threads)
        emit({"benchmark": "forward host cost: cProfile own time", "machine": machine(),
              "torch_threads": torch.get_num_threads(), "settings": vars(a),
              "profiles": [profile(int(w), a, a.profile) for w in a.widths.split(",")]}, a.out)
        return 0
    a.configs = a.configs.split(",")
    unknown = set(a.configs) - set(CONFIGS)
    if unknown or "plain" not in a.configs:
        p.error(f"--configs: unknown {sorted(unknown)} (known: {CONFIGS}); plain is required")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA device here")
    if a.device.startswith("cuda") and a.clock == "cpu":
        p.error("--device cuda times the wall clock (the device runs apart): drop --clock cpu")
    load_before = list(os.getloadavg())
    rows = [measure(int(w), a) for w in a.widths.split(",")]
    emit({"benchmark": "forward host cost: tiermem tracking against torch SAC",
          "machine": machine(), "torch_threads": torch.get_num_threads(),
          "settings": {k: v for k, v in vars(a).items()},
          "load_average_before_after": [load_before, list(os.getloadavg())],
          "results": rows}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
