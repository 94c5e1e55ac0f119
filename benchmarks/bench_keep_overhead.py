"""What a step of the side-by-side suite costs per configuration, with the
counters that tell tiermem's own cost from the machine's: is ``tiermem_keep``
(hooks, nothing moved) slower than the baseline, and why?

Runs the suite's interleaved role (``benchmarks/suite/roles.py``
``role_interleaved``: every configuration in this one process, stepping in
turn, the suite's runners and settings) and records, per step of each
configuration:

- ``wall``: the runner's step time (what the suite reports); ``cpu``: the
  process's CPU seconds over the step (every thread: torch's intra-op
  workers, tiermem's copier and I/O threads);
- ``minflt``: minor page faults (with ``MALLOC_MMAP_THRESHOLD_`` low, as the
  suite sets it, every large tensor is a fresh mapping: faults track the bytes
  allocated);
- ``gc``: collections per generation and their seconds (``gc.callbacks``);
- ``other_ticks``: CPU ticks of the threads other than the main thread and
  torch's intra-op workers (``/proc/self/task``): work left running by an
  earlier configuration;
- ``py_calls`` (``--count-calls``, one extra untimed step per configuration
  at the end, under ``cProfile``): Python function calls per step.

Then, per configuration, the step / baseline ratio paired by round (median
and 90% bootstrap interval: ``benchmarks/suite/budgets.py``).

``--order``: ``balanced`` (the suite's order, NOTE [Order of the interleaved
steps] in ``benchmarks/suite/roles.py``) or ``rotate`` (the order the suite
used before: one fixed order rotated each round, so that each configuration
always ran right after the same one).

Example (the recorded runs: ``benchmarks/results/2026-12-01-cpu-keep-overhead.md``)::

    python benchmarks/bench_keep_overhead.py --batch 32 --warmup 2 --steps 6 \\
        --configs baseline,checkpoint,...,tiermem_auto_25 --nvme-dir /tmp/nvme --out r.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def _thread_ticks() -> dict:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:   # the thread ended meanwhile
            continue
        out[tid] = (comm, int(fields[11]) + int(fields[12]))   # utime + stime
    return out


class _Counters:
    """Wraps ``Runner.step`` to record the counters of each step."""

    def __init__(self) -> None:
        self.rows: dict = {}
        self.gc_n = [0, 0, 0]
        self.gc_s = 0.0
        self._gc_t0 = 0.0
        self.main_tid = str(threading.get_native_id())
        self.pool_tids: set = set()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_n[info["generation"]] += 1
            self.gc_s += time.perf_counter() - self._gc_t0

    def wrap(self, runner_cls) -> None:
        orig = self.orig = runner_cls.step
        orig_init = runner_cls.__init__
        counters = self
        made: dict = {}

        def init(runner, name, *args, **kwargs):
            orig_init(runner, name, *args, **kwargs)
            # role_interleaved makes the second plain runner after the first,
            # under the same name: count it as _baseline_repeat.
            made[name] = made.get(name, 0) + 1
            runner._bench_key = name if made[name] == 1 else f"_{name}_repeat"

        runner_cls.__init__ = init

        def step(runner, x, y, seed, on_phase=None):
            th0 = _thread_ticks()
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            gc0, gcs0, c0 = list(counters.gc_n), counters.gc_s, time.process_time()
            out = orig(runner, x, y, seed, on_phase)
            cpu = time.process_time() - c0
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            th1 = _thread_ticks()
            if runner.name == "baseline" and not counters.pool_tids:
                # torch's intra-op workers: the threads a plain step ran on.
                counters.pool_tids = {t for t, (_, v) in th1.items()
                                      if v > th0.get(t, ("", 0))[1]} - {counters.main_tid}
            other = {}
            for tid, (comm, v) in th1.items():
                d = v - th0.get(tid, (comm, 0))[1]
                if d and tid != counters.main_tid and tid not in counters.pool_tids:
                    other[f"{comm}:{tid}"] = d
            key = getattr(runner, "_bench_key", runner.name)
            counters.rows.setdefault(key, []).append({
                "wall": out[1], "cpu": cpu, "phases": out[2],
                "minflt": ru1.ru_minflt - ru0.ru_minflt,
                "gc": [a - b for a, b in zip(counters.gc_n, gc0)],
                "gc_seconds": counters.gc_s - gcs0, "other_ticks": other,
                "threads": len(th1)})
            return out

        runner_cls.step = step


def _rotate(names, i):
    """The suite's order before NOTE [Order of the interleaved steps]."""
    names = list(names)
    k = i % len(names) if names else 0
    return names[k:] + names[:k]


def _count_calls(res_runners, batches, seed) -> dict:
    import cProfile
    import pstats
    from benchmarks.models_bench import step_seed
    out = {}
    for name, r in res_runners.items():
        x, y = batches[-1]
        prof = cProfile.Profile()
        prof.enable()
        r.step(x, y, step_seed(seed, len(batches) - 1))
        prof.disable()
        out[name] = pstats.Stats(prof).total_calls
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="baseline,tiermem_keep")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--order", choices=("balanced", "rotate"), default="balanced")
    p.add_argument("--nvme-dir", default=None)
    p.add_argument("--malloc-mmap-threshold", type=int, default=1 << 20,
                   help="MALLOC_MMAP_THRESHOLD_ of the run, as the suite sets it (0: unset)")
    p.add_argument("--count-calls", action="store_true")
    p.add_argument("--repeat-baseline", action="store_true",
                   help="a second plain runner (_baseline_repeat): do two identical "
                        "instances differ?")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    want = str(a.malloc_mmap_threshold) if a.malloc_mmap_threshold else None
    if os.environ.get(MMAP_ENV) != want:   # glibc reads it at start: run again
        env = dict(os.environ)
        env.pop(MMAP_ENV, None)
        if want:
            env[MMAP_ENV] = want
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)]
                  + (argv if argv is not None else sys.argv[1:]), env)

    import benchmarks.models_bench as mb
    import benchmarks.suite.roles as roles
    from benchmarks.common import machine
    from benchmarks.suite.budgets import median_ci, paired_ratios

    counters = _Counters()
    counters.wrap(mb.Runner)
    if a.order == "rotate":
        roles.round_order = _rotate
    configs = a.configs.split(",")
    spec = dict(layers=4, width=256, heads=4, seq_len=256, batch=a.batch, vocab=2048,
                dtype="float32", dropout=0.1)
    opts = dict(device="cpu", spec=spec, seed=0, configs=configs, warmup=a.warmup,
                steps=a.steps, max_step_seconds=120.0, nvme_dir=a.nvme_dir, io_threads=4,
                child_time_limit=None, repeat_baseline=a.repeat_baseline)
    load0 = os.getloadavg()
    t0 = time.time()
    res = roles.role_interleaved(opts)
    seconds = time.time() - t0
    load1 = os.getloadavg()
    out = {"bench": "keep_overhead", "argv": sys.argv[1:], "order": a.order,
           MMAP_ENV: os.environ.get(MMAP_ENV), "spec": spec, "configs": configs,
           "machine": machine(), "loadavg_before": load0, "loadavg_after": load1,
           "seconds": seconds, "steps": {}, "vs_baseline": {}, "summary": {}}
    base = res["configs"]["baseline"]
    for name in configs + (["_baseline_repeat"] if a.repeat_baseline else []):
        rec = res["configs"][name]
        rows = counters.rows.get(name, [])[a.warmup:]
        out["steps"][name] = rows
        if not rows:
            continue
        out["summary"][name] = {
            "status": rec["status"],
            "wall_median": statistics.median(r["wall"] for r in rows),
            "cpu_median": statistics.median(r["cpu"] for r in rows),
            "forward_median": statistics.median(r["phases"]["forward"] for r in rows),
            "backward_median": statistics.median(r["phases"]["backward"] for r in rows),
            "minflt_median": statistics.median(r["minflt"] for r in rows),
            "gc_collections": [sum(r["gc"][g] for r in rows) for g in range(3)],
            "gc_seconds": sum(r["gc_seconds"] for r in rows),
            "other_thread_ticks": sum(sum(r["other_ticks"].values()) for r in rows)}
        if name == "baseline" or rec["status"] != "ok":
            continue
        cpu_b = [r["cpu"] for r in counters.rows["baseline"][a.warmup:]]
        cpu_n = [r["cpu"] for r in rows]
        rb = list(range(len(cpu_b)))
        out["vs_baseline"][name] = {
            "wall": median_ci(paired_ratios(rec["times"], rec["rounds"], base["times"],
                                            base["rounds"])),
            "cpu": median_ci(paired_ratios(cpu_n, list(range(len(cpu_n))), cpu_b, rb)),
            "forward": median_ci(paired_ratios(
                [ph["forward"] for ph in rec["phases"]], rec["rounds"],
                [ph["forward"] for ph in base["phases"]], base["rounds"])),
            "backward": median_ci(paired_ratios(
                [ph["backward"] for ph in rec["phases"]], rec["rounds"],
                [ph["backward"] for ph in base["phases"]], base["rounds"])),
            "wall_per_round": paired_ratios(rec["times"], rec["rounds"], base["times"],
                                            base["rounds"])}
    if a.count_calls:
        # Fresh runners (role_interleaved closed its own): one untimed step
        # each after two warm-up steps, under cProfile.
        import torch
        from benchmarks.models_bench import ModelSpec, build_model, make_batches, make_runner
        mb.Runner.step = counters.orig   # uncounted: cProfile sees the step only
        ms = ModelSpec(**spec)
        model = build_model(ms, torch.device("cpu"), 0)
        runners = {n: make_runner(n, model, ms, torch.device("cpu"), opts) for n in configs}
        batches = make_batches(ms, torch.device("cpu"), 3, 0)
        for i in range(2):
            for r in runners.values():
                r.step(*batches[i], mb.step_seed(0, i))
        out["py_calls_per_step"] = _count_calls(runners, batches, 0)
        for r in runners.values():
            r.close()
    text = json.dumps(out, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    short = {k: out[k] for k in ("order", "summary", "py_calls_per_step") if k in out}
    short["vs_baseline"] = {n: {k: v for k, v in d.items() if k != "wall_per_round"}
                            for n, d in out["vs_baseline"].items()}
    print(json.dumps(short, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
