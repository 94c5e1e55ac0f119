"""Side-by-side benchmark suite: tiermem against plain autograd, checkpointing and the peers.

One run measures a matrix of configurations (``benchmarks/models_bench.py``
lists them) on a GPT-style decoder (:class:`tiermem.models.TinyGPT`, AdamW,
synthetic tokens), plus the ceilings of the links they use, and writes one JSON,
a Markdown table and PNG plots.

How it measures (each part runs in its own fresh process; this process only
orchestrates and never initialises CUDA):

1. *probe*: the machine (GPU, driver, torch, CPU, RAM, the NVMe dir's disk),
   which configurations can run here and why not, and the **ceilings**: host
   memcpy; on CUDA pinned device-to-host and host-to-device alone and both at
   once (CUDA events, large pinned buffers); the NVMe dir's write/read bandwidth
   through tiermem's I/O engine (O_DIRECT where the filesystem takes it).
2. *interleaved* (``--interleave``, default where it fits): all configurations
   in one process, each with its own deep copy of the same model, stepping in
   turn (round-robin, so drifts of the machine hit all alike); the first
   ``--warmup`` rounds are discarded; median/min/max of ``--steps``. A step is
   zero_grad + forward + backward + AdamW, timed on the host between device
   synchronizations; forward/backward/optimizer split by CUDA events on the
   compute stream (no sync inside the step) or host clocks on the CPU.
3. *isolated*: one fresh process per configuration for peak memory: CUDA
   ``max_memory_allocated`` (with ``--device-budget``: a
   ``set_per_process_memory_fraction`` budget, so a configuration that does
   not fit is reported as OOM), and peak host RSS (``VmHWM`` after writing 5 to
   ``/proc/self/clear_refs`` once model and optimizer exist). Without
   ``--interleave`` (budgeted sizes) the step times come from these processes,
   one configuration after another. Configurations named in ``--timeline``
   also record one step's memory over time (a sampler thread reading
   ``torch.cuda.memory_allocated`` and the process RSS every ~0.5 ms).

Exactness: every configuration trains from the same parameters with the same
batches and dropout seeds; losses at every step and a fingerprint of the final
parameters and AdamW states are compared with the baseline's (on CUDA with
``torch.use_deterministic_algorithms(True, warn_only=True)`` and
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, unless ``--no-deterministic``).

Presets: ``cpu-smoke`` (CI, < 1 min on 2 cores), ``cpu`` (the recorded CPU
table, a few minutes), ``gpu-a`` (baseline fits, activations dominate) and
``gpu-b`` (baseline does not fit a 24 GiB budget); any option overrides the
preset. Example::

    python benchmarks/suite.py --preset cpu --out-dir benchmarks/results --name 2026-11-30-cpu-suite

Outputs ``OUT_DIR/NAME.json``, ``NAME.md``, ``NAME-pareto.png`` and
``NAME-timeline.png`` (plots need matplotlib; ``benchmarks/plots.py NAME.json``
redraws them later).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from common import mount_of, rss_bytes, summarize  # noqa: E402

SCHEMA = 1

# ---------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------

ALL_CONFIGS = ["baseline", "checkpoint", "sac", "save_on_cpu", "torchtune", "deepspeed",
               "tiermem_keep", "tiermem_cpu", "tiermem_nvme", "tiermem_mixed",
               "ckpt_tiermem_cpu", "tiermem_recompute", "tiermem_recompute_cpu",
               "tiermem_recompute_nvme", "tiermem_auto"]

_GPU_MODEL = dict(layers=12, width=2048, heads=16, seq_len=2048, vocab=8192,
                  dtype="bfloat16", dropout=0.1)

PRESETS: Dict[str, dict] = {
    # CI smoke: every configuration end to end, tiny sizes (no figure is meaningful).
    "cpu-smoke": dict(device="cpu", layers=2, width=128, heads=4, seq_len=128, batch=2,
                      vocab=512, dtype="float32", dropout=0.1, warmup=1, steps=2,
                      memory_steps=1, interleave=True, memory_jobs=2,
                      ceiling_bytes=16 << 20, ceiling_chunk=4 << 20, timeline="baseline,tiermem_cpu",
                      configs=",".join(ALL_CONFIGS), time_limit=240, max_step_seconds=30.0),
    # The recorded CPU table: small enough for 2 cores in a few minutes.
    "cpu": dict(device="cpu", layers=4, width=256, heads=4, seq_len=256, batch=4,
                vocab=2048, dtype="float32", dropout=0.1, warmup=3, steps=20,
                memory_steps=2, interleave=True, memory_jobs=1,
                ceiling_bytes=256 << 20, ceiling_chunk=16 << 20,
                timeline="baseline,tiermem_cpu", configs=",".join(ALL_CONFIGS),
                time_limit=600, max_step_seconds=30.0),
    # GPU size A: the baseline fits comfortably (~21 GiB estimated, bf16) and
    # activations (~14 GiB) dominate parameters + AdamW states (~5 GiB).
    "gpu-a": dict(device="cuda", batch=8, **_GPU_MODEL, warmup=2, steps=8, memory_steps=2,
                  interleave=True, memory_jobs=3, ceiling_bytes=2 << 30,
                  ceiling_chunk=64 << 20, timeline="baseline,tiermem_cpu",
                  configs=",".join(ALL_CONFIGS), time_limit=200, max_step_seconds=8.0),
    # GPU size B: the same model at twice the batch under a 24 GiB device budget
    # (a 24 GB card): the baseline (~36 GiB estimated) does not fit. Each
    # configuration runs alone under the budget (no interleaving possible).
    "gpu-b": dict(device="cuda", batch=16, **_GPU_MODEL, warmup=1, steps=3, memory_steps=3,
                  interleave=False, memory_jobs=1, device_budget="24GiB",
                  ceiling_bytes=1 << 30, ceiling_chunk=64 << 20,
                  timeline="checkpoint,tiermem_cpu",
                  # Run order = this order (one after another): if the time limit
                  # cuts the run short, the last ones are reported as not run.
                  configs="baseline,tiermem_cpu,checkpoint,tiermem_mixed,ckpt_tiermem_cpu,"
                          "tiermem_recompute_cpu,sac,deepspeed,torchtune,save_on_cpu",
                  time_limit=170, max_step_seconds=8.0),
}

_DEFAULTS = dict(device="auto", layers=4, width=256, heads=4, seq_len=256, batch=4,
                 vocab=2048, dtype="float32", dropout=0.1, warmup=3, steps=10,
                 memory_steps=2, interleave=True, memory_jobs=1, ceiling_bytes=256 << 20,
                 ceiling_chunk=16 << 20, timeline="baseline,tiermem_cpu",
                 configs=",".join(ALL_CONFIGS), time_limit=1800, max_step_seconds=30.0,
                 device_budget=None)

# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def parse_size(text) -> Optional[int]:
    """``'24GiB' -> 25769803776``: :func:`tiermem.config.parse_size` (decimal
    kB/MB/GB, binary KiB/MiB/GiB), plus ``None``/``''`` -> None (an unset
    ``--device-budget``) and ints as they are (the presets' sizes). A bad size
    raises ConfigError, a ValueError: argparse reports it as an invalid value."""
    if text is None or text == "":
        return None
    if isinstance(text, int):
        return text
    from tiermem.config import parse_size as tiermem_parse_size
    return tiermem_parse_size(text, name="size")


_TIB = 1 << 40


def fmt_bytes(n) -> str:
    """:func:`tiermem.telemetry.format_bytes` (``1536 -> '1.5 KiB'``), plus
    ``None -> '–'`` and TiB from 1 TiB up (format_bytes stops at GiB: the
    report's RAM of a large host would read '2048.0 GiB')."""
    if n is None:
        return "–"
    if abs(n) >= _TIB:
        return f"{n / _TIB:.1f} TiB"
    from tiermem.telemetry import format_bytes
    return format_bytes(n)


class _MallInfo2(__import__("ctypes").Structure):
    _fields_ = [(n, __import__("ctypes").c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_mallinfo2 = None


def _heap_live_bytes() -> Optional[int]:
    """Bytes malloc has handed out and not taken back (glibc ``mallinfo2``:
    in-use arena bytes + mmapped chunks), i.e. live CPU tensors and other heap
    objects; unlike RSS it falls when memory is freed. None where unavailable."""
    global _mallinfo2
    if _mallinfo2 is None:
        try:
            import ctypes
            libc = ctypes.CDLL(None)
            fn = libc.mallinfo2
            fn.restype = _MallInfo2
            _mallinfo2 = fn
        except (OSError, AttributeError):
            _mallinfo2 = False
    if not _mallinfo2:
        return None
    mi = _mallinfo2()
    return int(mi.uordblks + mi.hblkhd)


def _oom_types():
    import torch
    out = [getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)]
    return tuple(t for t in out if t is not None)


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, _oom_types()):
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)


def _err_text(e: BaseException, limit: int = 600) -> str:
    s = f"{type(e).__name__}: {e}".strip()
    first = s.splitlines()[0] if s else type(e).__name__
    return first[:limit]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Machine description (extends benchmarks/common.machine())
# ---------------------------------------------------------------------------


def _nvidia_smi() -> Optional[dict]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    q = "name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max"
    try:
        proc = subprocess.run([exe, f"--query-gpu={q}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    out = proc.stdout.strip()
    if proc.returncode != 0 or not out:
        return {"error": (proc.stdout + proc.stderr).strip()[:300]}
    vals = [v.strip() for v in out.splitlines()[0].split(",")]
    keys = ["name", "driver_version", "memory_total", "pcie_gen_current", "pcie_width_current",
            "pcie_gen_max"]
    return dict(zip(keys, vals))


def machine_info(nvme_dir: Optional[str]) -> dict:
    import psutil
    import torch
    from common import machine

    info = machine()
    vm = psutil.virtual_memory()
    info["ram_total_bytes"] = vm.total
    info["swap_bytes"] = psutil.swap_memory().total
    info["cuda_runtime"] = torch.version.cuda
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["cuda_device"].update({"capability": f"{p.major}.{p.minor}",
                                    "multiprocessors": p.multi_processor_count})
        info["nvidia_smi"] = _nvidia_smi()
        try:
            info["cudnn"] = torch.backends.cudnn.version()
        except Exception:
            pass
    if nvme_dir:
        info["nvme_dir"] = {"path": nvme_dir, **mount_of(nvme_dir)}
    info["tmp_dir_disk"] = mount_of(tempfile.gettempdir())
    return info


# ---------------------------------------------------------------------------
# Ceilings
# ---------------------------------------------------------------------------


def ceiling_host_copy(nbytes: int, reps: int = 3) -> dict:
    import torch
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"bytes": nbytes, "gbps": nbytes / best / 1e9,
            "gbps_median": nbytes / statistics.median(times) / 1e9, "reps": reps,
            "method": f"torch copy_ between two {fmt_bytes(nbytes)} host tensors "
                      f"({torch.get_num_threads()} threads), best of {reps}"}


def ceiling_cuda_links(nbytes: int, reps: int = 5) -> dict:
    """Pinned D2H and H2D, alone and both at once, timed with CUDA events."""
    import torch
    try:
        return _cuda_links(nbytes, reps)
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the buffers died with _cuda_links' frame


def _cuda_links(nbytes: int, reps: int) -> dict:
    import torch
    dev = torch.device("cuda")
    d_src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    d_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    h_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(2)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def one(direction):
        st = s1 if direction == "d2h" else s2
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(st):
            a.record(st)
            if direction == "d2h":
                h_dst.copy_(d_src, non_blocking=True)
            else:
                d_dst.copy_(h_src, non_blocking=True)
            b.record(st)
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3

    out = {"bytes": nbytes, "reps": reps,
           "method": "copy_ between a device tensor and a pinned host tensor on a side stream, "
                     "CUDA events; best (and median) of reps"}
    for d in ("d2h", "h2d"):
        one(d)  # warm
        ts = [one(d) for _ in range(reps)]
        out[d] = {"gbps": nbytes / min(ts) / 1e9,
                  "gbps_median": nbytes / statistics.median(ts) / 1e9}
    both_d2h, both_h2d, both_total = [], [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        s1.wait_event(start)
        s2.wait_event(start)
        with torch.cuda.stream(s1):
            h_dst.copy_(d_src, non_blocking=True)
            e1.record(s1)
        with torch.cuda.stream(s2):
            d_dst.copy_(h_src, non_blocking=True)
            e2.record(s2)
        torch.cuda.synchronize()
        t1, t2 = start.elapsed_time(e1) / 1e3, start.elapsed_time(e2) / 1e3
        both_d2h.append(t1)
        both_h2d.append(t2)
        both_total.append(max(t1, t2))
    both_d2h, both_h2d, both_total = both_d2h[1:], both_h2d[1:], both_total[1:]
    out["both"] = {"d2h_gbps": nbytes / statistics.median(both_d2h) / 1e9,
                   "h2d_gbps": nbytes / statistics.median(both_h2d) / 1e9,
                   "aggregate_gbps": 2 * nbytes / statistics.median(both_total) / 1e9,
                   "method": "both copies started together on two streams; medians"}
    return out


def ceiling_disk(nvme_dir: str, nbytes: int, chunk: int, threads: int, pinned: bool,
                 depth: int = 4) -> dict:
    """Sequential write then read of ``nbytes`` in ``chunk`` requests, ``depth`` in
    flight, through tiermem's I/O engine (the NVMe tier's path)."""
    from tiermem.io import aligned_empty, get_engine

    eng = get_engine("auto", threads)
    chunk = max(4096, chunk // 4096 * 4096)
    nbytes = max(chunk, nbytes // chunk * chunk)
    path = os.path.join(nvme_dir, f"tiermem-suite-ceiling-{os.getpid()}.bin")
    bufs = [aligned_empty(chunk, pin_memory=pinned) for _ in range(depth)]
    for i, b in enumerate(bufs):
        b.fill_(i + 1)
    out = {"engine": eng.name, "threads": threads, "bytes": nbytes, "request_bytes": chunk,
           "queue_depth": depth, "pinned_buffers": pinned, "path_dir": nvme_dir}
    f = eng.open(path, nbytes)
    try:
        out["direct"] = bool(getattr(f, "direct", False))

        def run(op):
            futs = []
            t0 = time.perf_counter()
            for k, off in enumerate(range(0, nbytes, chunk)):
                if len(futs) >= depth:
                    futs.pop(0).wait()
                buf = bufs[k % depth]
                futs.append(f.write(buf, off) if op == "write" else f.read(buf, off))
            for fu in futs:
                fu.wait()
            return time.perf_counter() - t0

        tw = run("write")
        tr = run("read")
        out["write_gbps"] = nbytes / tw / 1e9
        out["read_gbps"] = nbytes / tr / 1e9
        if not out["direct"]:
            out["note"] = ("buffered I/O (the filesystem refused O_DIRECT): the figures include "
                           "the page cache and overstate the disk")
    finally:
        f.close()
        try:
            os.unlink(path)
        except OSError:
            pass
    return out


# ---------------------------------------------------------------------------
# Child roles
# ---------------------------------------------------------------------------


def _child_setup(opts: dict):
    import torch
    device = torch.device(opts["device"])
    if opts.get("torch_threads"):
        torch.set_num_threads(int(opts["torch_threads"]))
    if device.type == "cuda":
        torch.cuda.set_device(0)
        budget = opts.get("device_budget_bytes")
        if budget:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), 0)
        if opts.get("deterministic"):
            torch.use_deterministic_algorithms(True, warn_only=True)
            # Deterministic mode also fills every torch.empty with NaN by default:
            # a memset per allocation (pinned host buffers of save_on_cpu too)
            # that would tax the configurations unevenly. Not needed here.
            import torch.utils.deterministic
            torch.utils.deterministic.fill_uninitialized_memory = False
    return device


def role_probe(opts: dict) -> dict:
    import torch
    from models_bench import CONFIGS, peer_versions, probe_config

    device = _child_setup(opts)
    res = {"machine": machine_info(opts.get("nvme_dir")), "peers_installed": peer_versions()}
    ceil = {}
    t0 = time.perf_counter()
    try:
        ceil["host_copy"] = ceiling_host_copy(min(opts["ceiling_bytes"], 1 << 30))
    except Exception as e:
        ceil["host_copy"] = {"error": _err_text(e)}
    if device.type == "cuda":
        try:
            ceil["cuda"] = ceiling_cuda_links(opts["ceiling_bytes"])
        except Exception as e:
            ceil["cuda"] = {"error": _err_text(e)}
    else:
        ceil["cuda"] = {"skipped": "no CUDA device: pinned D2H/H2D not measured"}
    if opts.get("nvme_dir"):
        try:
            ceil["disk"] = ceiling_disk(opts["nvme_dir"], opts["ceiling_bytes"],
                                        opts["ceiling_chunk"], opts.get("io_threads") or 4,
                                        pinned=device.type == "cuda")
        except Exception as e:
            ceil["disk"] = {"error": _err_text(e)}
    ceil["seconds"] = time.perf_counter() - t0
    res["ceilings"] = ceil
    avail = {}
    for name in opts["configs"]:
        if name not in CONFIGS:
            avail[name] = f"unknown configuration {name!r}"
            continue
        avail[name] = probe_config(name, device, opts)
    res["unavailable"] = {k: v for k, v in avail.items() if v}
    try:
        from tiermem.io import engine_info
        res["io_engine"] = engine_info()
    except Exception as e:
        res["io_engine"] = {"error": _err_text(e)}
    if device.type == "cuda":
        res["sdpa_backends_enabled"] = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)(),
            "math": torch.backends.cuda.math_sdp_enabled()}
    return res


def _tiermem_step_record(stats: Optional[dict]) -> Optional[dict]:
    if stats is None:
        return None
    keep = ("stall_seconds", "late_restores", "prefetch_misses", "prefetch_hits",
            "budget_fallbacks", "peak_host_bytes", "peak_disk_bytes", "dedup_hits",
            "pinned_returns_total")
    return {k: stats.get(k) for k in keep}


def _tiermem_summary(stats_last: Optional[dict], per_step: List[dict]) -> Optional[dict]:
    if stats_last is None:
        return None
    out = {"last_step": stats_last}
    if per_step:
        out["stall_seconds"] = summarize([float(s["stall_seconds"]) for s in per_step],
                                         mean=False)
        out["late_restores_max"] = max(s["late_restores"] for s in per_step)
        out["late_restores_last"] = per_step[-1]["late_restores"]
        out["prefetch_misses_max"] = max(s["prefetch_misses"] for s in per_step)
    return out


def _slow_limit(opts: dict, i: int) -> float:
    """A warm-up step slower than this drops the configuration. The first step
    gets 3x: it pays one-time costs (pinned allocations, extension loads)."""
    return opts["max_step_seconds"] * (3.0 if i == 0 else 1.0)


def role_interleaved(opts: dict) -> dict:
    import torch
    from models_bench import (ModelSpec, build_model, make_batches, make_runner, state_fingerprint,
                              step_seed, tensor_state_bytes)

    t_start = time.perf_counter()
    limit = opts.get("child_time_limit") or 1e9
    device = _child_setup(opts)
    spec = ModelSpec(**opts["spec"])
    seed = opts["seed"]
    base = build_model(spec, device, seed)
    runners, out = {}, {}
    names = list(opts["configs"])
    if opts.get("repeat_baseline") and "baseline" in names:
        # A second baseline: are two plain runs bit-identical on this machine at
        # all? (If not, no configuration can be, and the exactness check says so.)
        names.append("_baseline_repeat")
    for name in names:
        try:
            kind = "baseline" if name == "_baseline_repeat" else name
            runners[name] = make_runner(kind, base, spec, device, opts)
            out[name] = {"status": "ok", "times": [], "phases": [], "losses": [],
                         "tiermem_steps": []}
        except Exception as e:
            out[name] = {"status": "error", "reason": _err_text(e),
                         "traceback": traceback.format_exc()[-2000:]}
    del base
    rounds = opts["warmup"] + opts["steps"]
    batches = make_batches(spec, device, rounds, seed)
    warm = opts["warmup"]
    done_rounds = 0
    for i in range(rounds):
        r0 = time.perf_counter()
        for name, r in list(runners.items()):
            rec = out[name]
            x, y = batches[i]
            try:
                loss, dt, ph = r.step(x, y, step_seed(seed, i))
            except Exception as e:
                rec["status"] = "oom" if _is_oom(e) else "error"
                rec["reason"] = _err_text(e)
                rec["failed_at_step"] = i
                if rec["status"] == "error":
                    rec["traceback"] = traceback.format_exc()[-2000:]
                r.release()
                del runners[name]
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            rec["losses"].append(float(loss))
            if i >= warm:
                rec["times"].append(dt)
                rec["phases"].append(ph)
                st = r.tiermem_stats()
                if st is not None:
                    rec["tiermem_steps"].append(_tiermem_step_record(st))
            elif dt > _slow_limit(opts, i):
                rec["status"] = "too_slow"
                rec["reason"] = (f"warm-up step {i} took {dt:.3g} s > {_slow_limit(opts, i):.3g} s "
                                 f"(--max-step-seconds {opts['max_step_seconds']:g}; 3x for "
                                 f"the first step)")
                rec["warmup_step_seconds"] = dt
                rec["tiermem_last_step"] = r.tiermem_stats()
                r.release()
                del runners[name]
                gc.collect()
                continue
        done_rounds = i + 1
        dt_round = time.perf_counter() - r0
        if not runners:
            _log("[interleaved] no configuration left to run")
            break
        _log(f"[interleaved] round {i + 1}/{rounds} ({'warm-up' if i < warm else 'measured'}) "
             f"{dt_round:.2f} s, {len(runners)} configs")
        elapsed = time.perf_counter() - t_start
        if i + 1 < rounds and elapsed + 1.2 * dt_round > limit:
            _log(f"[interleaved] stopping after {i + 1} rounds: time limit {limit:.0f} s")
            break
    for name, r in runners.items():
        rec = out[name]
        rec["tiermem_last_step"] = r.tiermem_stats()
        rec["peer_stats"] = r.peer_stats()
        rec["extra"] = r.extra
        rec["state_bytes"] = tensor_state_bytes(r.model, r.opt)
        rec["fingerprint"] = state_fingerprint(r.model, r.opt)
        r.close()
    return {"configs": out, "rounds_done": done_rounds, "rounds_planned": rounds,
            "seconds": time.perf_counter() - t_start}


class _Sampler(threading.Thread):
    """Samples device (allocator) and host (RSS) bytes every ``interval`` seconds."""

    def __init__(self, device, interval: float) -> None:
        super().__init__(daemon=True)
        self.device = device
        self.interval = interval
        self.t, self.dev, self.host, self.heap = [], [], [], []
        self.stop_event = threading.Event()
        self.t0 = time.perf_counter()

    def sample(self) -> None:
        import torch
        self.t.append(time.perf_counter() - self.t0)
        self.dev.append(torch.cuda.memory_allocated(self.device)
                        if self.device.type == "cuda" else None)
        self.host.append(rss_bytes())
        self.heap.append(_heap_live_bytes())

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            time.sleep(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        self.join()
        self.sample()


def role_isolated(opts: dict, name: str) -> dict:
    import torch
    from common import reset_peak_rss, vm_hwm_bytes
    from models_bench import (ModelSpec, Runner, build_model, make_batches, state_fingerprint,
                              step_seed, tensor_state_bytes)

    t_start = time.perf_counter()
    device = _child_setup(opts)
    cuda = device.type == "cuda"
    spec = ModelSpec(**opts["spec"])
    seed = opts["seed"]
    res = {"config": name, "status": "ok"}
    try:
        runner = Runner(name, build_model(spec, device, seed), spec, device, opts)
    except Exception as e:
        res.update(status="oom" if _is_oom(e) else "error", reason=_err_text(e),
                   traceback=traceback.format_exc()[-2000:], failed_at_step="setup")
        return res
    n_meas = opts["memory_steps"] if opts["interleave"] else opts["steps"]
    n = opts["warmup"] + n_meas
    batches = make_batches(spec, device, n + 1, seed)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        try:
            torch.cuda.reset_peak_host_memory_stats()
        except Exception:
            pass
        res["device_allocated_after_setup_bytes"] = torch.cuda.memory_allocated()
    res["host_rss_after_setup_bytes"] = rss_bytes()
    res["host_peak_method"] = ("VmHWM after clear_refs=5 (reset once model and optimizer "
                               "exist)" if reset_peak_rss() else
                               "VmHWM since process start (clear_refs not supported)")
    times, phases, losses, tsteps = [], [], [], []
    for i in range(n):
        x, y = batches[i]
        try:
            loss, dt, ph = runner.step(x, y, step_seed(seed, i))
        except Exception as e:
            res.update(status="oom" if _is_oom(e) else "error", reason=_err_text(e),
                       failed_at_step=i)
            if res["status"] == "error":
                res["traceback"] = traceback.format_exc()[-2000:]
            break
        losses.append(float(loss))
        if i >= opts["warmup"]:
            times.append(dt)
            phases.append(ph)
            st = runner.tiermem_stats()
            if st is not None:
                tsteps.append(_tiermem_step_record(st))
        elif dt > _slow_limit(opts, i) and n > 1:
            res.update(status="too_slow", warmup_step_seconds=dt,
                       reason=f"warm-up step {i} took {dt:.3g} s > {_slow_limit(opts, i):.3g} s "
                              f"(--max-step-seconds {opts['max_step_seconds']:g}; 3x for the "
                              f"first step)")
            break
    if cuda:
        torch.cuda.synchronize()
        res["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        res["peak_device_reserved_bytes"] = torch.cuda.max_memory_reserved()
        res["device_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
        res["pinned_host"] = _pinned_stats()
    res["peak_host_bytes"] = vm_hwm_bytes()
    if res["peak_host_bytes"] is not None:
        res["peak_host_increase_bytes"] = res["peak_host_bytes"] - res["host_rss_after_setup_bytes"]
    res["losses"] = losses
    res["times"] = times
    res["phases"] = phases
    res["tiermem_steps"] = tsteps
    res["tiermem_last_step"] = runner.tiermem_stats()
    res["peer_stats"] = runner.peer_stats()
    res["extra"] = runner.extra
    if runner.off is not None:
        res["tiermem_host_bytes_in_use_after"] = runner.off.host_bytes_in_use
    if res["status"] == "ok":
        res["state_bytes"] = tensor_state_bytes(runner.model, runner.opt)
        res["fingerprint"] = state_fingerprint(runner.model, runner.opt)
        if opts.get("timeline"):
            res["timeline"] = _timeline_step(runner, batches[n], step_seed(seed, n), device)
    runner.close()
    res["seconds"] = time.perf_counter() - t_start
    return res


def _pinned_stats() -> Optional[dict]:
    """torch's caching pinned-host allocator (torch.empty(pin_memory=True): used by
    tiermem's pools, save_on_cpu, torchtune and DeepSpeed alike). Pinned pages
    need not show in RSS, so this is the host figure that matters on CUDA."""
    import torch
    try:
        st = torch.cuda.host_memory_stats()
    except Exception as e:  # older torch, or no CUDA
        return {"error": _err_text(e)}
    return {"allocated_bytes_peak": st.get("allocated_bytes.peak"),
            "allocated_bytes_current": st.get("allocated_bytes.current"),
            "active_bytes_peak": st.get("active_bytes.peak"),
            "num_host_alloc": st.get("num_host_alloc"),
            "host_alloc_seconds": (st.get("host_alloc_time.total") or 0) / 1e6,
            "method": "torch.cuda.host_memory_stats() (blocks rounded to powers of two; peaks "
                      "are torch's best-effort per-bucket aggregate); reset after setup"}


def _timeline_step(runner, batch, seed: int, device) -> dict:
    import torch
    marks = {}
    # 0.5 ms on a GPU machine (many cores, the host mostly waits); 2 ms on a
    # CPU-only one, where the sampler competes with the step for the cores.
    interval = 0.0005 if device.type == "cuda" else 0.002
    s = _Sampler(device, interval)

    def on_phase(label):
        marks[label] = time.perf_counter() - s.t0

    if device.type == "cuda":
        torch.cuda.synchronize()
    s.sample()
    s.start()
    try:
        runner.step(batch[0], batch[1], seed, on_phase=on_phase)
    except Exception as e:
        s.stop()
        return {"error": _err_text(e)}
    s.stop()
    t0 = marks.get("forward", 0.0)
    return {"t_seconds": [round(t - t0, 6) for t in s.t], "device_bytes": s.dev,
            "host_bytes": s.host, "heap_bytes": s.heap,
            "marks": {k: round(v - t0, 6) for k, v in marks.items()},
            "interval_seconds": interval,
            "method": (f"sampler thread every ~{interval * 1e3:g} ms: "
                       + ("torch.cuda.memory_allocated (the allocator's view, in host order), "
                          if device.type == "cuda" else "")
                       + "process RSS (/proc/self/statm) and live malloc bytes (glibc "
                         "mallinfo2: in-use + mmapped; falls when memory is freed, unlike RSS). "
                         "The sampler slows the step it watches: the time axis is stretched, "
                         "most on a CPU-only machine.")}


def child_main(args) -> int:
    with open(args.child_opts) as f:
        opts = json.load(f)
    try:
        if args.role == "probe":
            res = role_probe(opts)
        elif args.role == "interleaved":
            res = role_interleaved(opts)
        else:
            res = role_isolated(opts, args.config)
    except Exception as e:
        res = {"status": "error", "reason": _err_text(e), "traceback": traceback.format_exc()}
        if _is_oom(e):
            res["status"] = "oom"
    with open(args.result, "w") as f:
        json.dump(res, f)
    return 0


# ---------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------


class Progress:
    """tqdm bar over the suite's parts when it makes sense, else plain lines."""

    def __init__(self, total: int, mode: str) -> None:
        self.bar = None
        if mode in ("auto", "bar"):
            try:
                from tqdm import tqdm
                if mode == "bar" or sys.stderr.isatty():
                    self.bar = tqdm(total=total, desc="suite", unit="part", file=sys.stderr)
            except ImportError:
                pass
        self.quiet = mode == "none"
        self.total, self.n = total, 0

    def note(self, msg: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            _log(msg)

    def advance(self, what: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what[:40])
            self.bar.update(1)
        elif not self.quiet:
            _log(f"[suite] {self.n}/{self.total} done: {what}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Suite:
    def __init__(self, args, opts: dict) -> None:
        self.args = args
        self.opts = opts
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + opts["time_limit"]
        self.tmp = tempfile.mkdtemp(prefix="tiermem-suite-")
        self.result: dict = {}

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def run_child(self, role: str, timeout: float, config: Optional[str] = None,
                  extra: Optional[dict] = None) -> dict:
        opts = dict(self.opts, **(extra or {}))
        tag = role if config is None else f"{role}-{config}"
        opath = os.path.join(self.tmp, f"{tag}.opts.json")
        rpath = os.path.join(self.tmp, f"{tag}.result.json")
        with open(opath, "w") as f:
            json.dump(opts, f)
        cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--child-opts", opath,
               "--result", rpath]
        if config:
            cmd += ["--config", config]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if opts.get("malloc_mmap_threshold"):
            env["MALLOC_MMAP_THRESHOLD_"] = str(int(opts["malloc_mmap_threshold"]))
        if opts.get("deterministic"):
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        t0 = time.perf_counter()
        timeout = max(5.0, timeout)
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=None,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            tail = (e.stdout or "")[-1500:] if isinstance(e.stdout, str) else ""
            return {"status": "timeout", "reason": f"killed after {timeout:.0f} s (time limit)",
                    "stdout_tail": tail, "wall_seconds": time.perf_counter() - t0}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(rpath):
            return {"status": "crashed",
                    "reason": f"child exited with status {proc.returncode} and no result",
                    "stdout_tail": (proc.stdout or "")[-1500:], "wall_seconds": wall}
        with open(rpath) as f:
            res = json.load(f)
        res["wall_seconds"] = wall
        return res

    def write_json(self) -> str:
        path = os.path.join(self.args.out_dir, f"{self.args.name}.json")
        os.makedirs(self.args.out_dir, exist_ok=True)
        self.result["wall_seconds"] = time.perf_counter() - self.t0
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
        return path

    def run(self) -> dict:
        a, opts = self.args, self.opts
        requested = opts["configs"]
        timeline = [c for c in opts["timeline_configs"] if c in requested]
        n_parts = 2 + (1 if opts["interleave"] else 0) + len(requested) + 1
        prog = Progress(n_parts, a.progress)
        res = self.result
        res.update({
            "suite": "tiermem side-by-side activation-memory benchmark", "schema": SCHEMA,
            "name": a.name, "preset": a.preset, "command": [os.path.basename(sys.executable)]
            + sys.argv, "device": opts["device"], "model": dict(opts["spec"]),
            "settings": {k: opts[k] for k in (
                "warmup", "steps", "memory_steps", "interleave", "memory_jobs", "seed",
                "device_budget_bytes", "deterministic", "nvme_dir", "min_offload_bytes",
                "tiermem_cpu_budget", "mixed_min_bytes", "max_step_seconds", "time_limit",
                "ceiling_bytes", "ceiling_chunk", "io_threads", "repeat_baseline",
                "malloc_mmap_threshold")},
            "configs_requested": requested, "configs": {}, "notes": [], "phases": {}})
        from models_bench import CONFIGS, ModelSpec, build_model, mixed_threshold
        spec = ModelSpec(**opts["spec"])
        res["model"]["tokens_per_step"] = spec.tokens_per_step
        try:
            import torch
            with torch.device("meta"):
                m = build_model(spec, torch.device("meta"), 0)
            res["model"]["parameters"] = m.num_parameters()
            res["model"]["parameter_bytes"] = sum(p.numel() * p.element_size()
                                                  for p in m.parameters())
            del m
        except Exception as e:  # meta init unsupported: not essential
            res["notes"].append(f"parameter count unavailable: {_err_text(e)}")
        if "tiermem_mixed" in requested:
            res["settings"]["mixed_policy_min_bytes"] = mixed_threshold(spec, opts)
        for c in requested:
            res["configs"][c] = {"description": CONFIGS[c].description if c in CONFIGS else None,
                                 "family": CONFIGS[c].family if c in CONFIGS else None,
                                 "status": "pending"}

        # 1. probe + ceilings
        prog.note(f"[suite] {a.name}: probe and ceilings ({opts['device']})")
        t = time.perf_counter()
        probe = self.run_child("probe", min(self.remaining(), max(60.0, 0.25 * opts["time_limit"])))
        res["phases"]["probe"] = time.perf_counter() - t
        res["machine"] = probe.get("machine")
        res["ceilings"] = probe.get("ceilings")
        res["io_engine"] = probe.get("io_engine")
        res["sdpa_backends_enabled"] = probe.get("sdpa_backends_enabled")
        if probe.get("status") in ("timeout", "crashed", "error"):
            res["notes"].append(f"probe failed: {probe.get('reason')}")
            res["probe_error"] = {k: probe.get(k) for k in ("status", "reason", "traceback",
                                                             "stdout_tail")}
        unavailable = probe.get("unavailable", {})
        res["peers"] = self._peer_report(probe, unavailable)
        runnable = [c for c in requested if c not in unavailable]
        for c, why in unavailable.items():
            if c in res["configs"]:
                res["configs"][c].update(status="skipped", reason=why)
        prog.advance("probe")
        self.write_json()

        # 2. interleaved timing
        inter = None
        if opts["interleave"] and runnable:
            budget = self.remaining() * (0.5 if len(runnable) > 1 else 0.6)
            prog.note(f"[suite] interleaved timing of {len(runnable)} configs "
                      f"({opts['warmup']}+{opts['steps']} rounds, limit {budget:.0f} s)")
            t = time.perf_counter()
            inter = self.run_child("interleaved", budget + 30.0,
                                   extra={"configs": runnable, "child_time_limit": budget})
            res["phases"]["interleaved"] = time.perf_counter() - t
            if inter.get("status") in ("timeout", "crashed", "error"):
                res["notes"].append(f"interleaved run failed: {inter.get('status')}: "
                                    f"{inter.get('reason')}")
                res["interleaved_error"] = {k: inter.get(k) for k in (
                    "status", "reason", "traceback", "stdout_tail")}
                inter = None
            prog.advance("interleaved")
            if inter:
                res["interleaved"] = {"rounds_done": inter["rounds_done"],
                                      "rounds_planned": inter["rounds_planned"],
                                      "seconds": inter["seconds"]}
                rep = inter["configs"].pop("_baseline_repeat", None)
                if rep is not None:
                    res["interleaved"]["baseline_repeat"] = _repeat_check(
                        inter["configs"].get("baseline"), rep)
                for c, rec in inter["configs"].items():
                    res["configs"][c]["interleaved"] = rec
            self.write_json()

        # 3. isolated processes (memory; timing too without interleaving)
        iso_cfgs = list(runnable)
        if inter:  # a config too slow or broken there is not retried alone
            for c, rec in inter["configs"].items():
                if rec["status"] in ("too_slow", "error"):
                    iso_cfgs.remove(c)
                    prog.advance(f"{c} (not repeated: {rec['status']})")
        solo = [c for c in iso_cfgs if c in timeline or not opts["interleave"]]
        pool = [c for c in iso_cfgs if c not in solo]
        t = time.perf_counter()

        def launch(c):
            rem = self.remaining()
            if rem < 10:
                return {"status": "skipped", "reason": "suite time limit reached"}
            left = max(1, len([x for x in iso_cfgs if res["configs"][x].get("isolated") is None]))
            cap = max(30.0, rem / max(1.0, left / max(1, opts["memory_jobs"])) * 1.5)
            extra = {"timeline": c in timeline}
            if opts["memory_jobs"] > 1 and opts["device"] == "cpu":
                # Concurrent CPU children share the cores: no oversubscription
                # (their memory is what is measured, not their time). All of them,
                # solo ones too, use the same thread count: CPU reductions give
                # different bits with different thread counts, and their losses
                # are compared bit for bit.
                extra["torch_threads"] = max(1, (os.cpu_count() or 1) // opts["memory_jobs"])
            return self.run_child("isolated", min(rem, cap), config=c, extra=extra)

        for c in solo:
            prog.note(f"[suite] isolated: {c}")
            r = launch(c)
            res["configs"][c]["isolated"] = r
            prog.advance(f"{c}: {r.get('status')}")
            self.write_json()
        if pool:
            prog.note(f"[suite] isolated memory runs of {len(pool)} configs, "
                      f"{opts['memory_jobs']} at a time")
            with concurrent.futures.ThreadPoolExecutor(max_workers=opts["memory_jobs"]) as ex:
                futs = {ex.submit(launch, c): c for c in pool}
                for fu in concurrent.futures.as_completed(futs):
                    c = futs[fu]
                    r = fu.result()
                    res["configs"][c]["isolated"] = r
                    prog.advance(f"{c}: {r.get('status')}")
                    self.write_json()
        res["phases"]["isolated"] = time.perf_counter() - t
        prog.close()
        self.finish()
        return res

    def _peer_report(self, probe: dict, unavailable: dict) -> dict:
        inst = probe.get("peers_installed", {}) or {}
        out = {}
        for peer, pkgs in (("torchtune", ("torchtune", "torchao")), ("deepspeed", ("deepspeed",))):
            requested = peer in self.opts["configs"]
            entry = {"versions": {p: inst.get(p) for p in pkgs}, "requested": requested}
            if not requested:
                entry["ran"] = False
                entry["reason"] = "not requested (--configs)"
            elif peer in unavailable:
                entry["ran"] = False
                entry["reason"] = unavailable[peer]
            else:
                entry["ran"] = None  # filled by finish()
            out[peer] = entry
        out["save_on_cpu"] = {"ran": None, "versions": {"torch": (probe.get("machine") or {})
                                                         .get("torch")}}
        if "save_on_cpu" not in self.opts["configs"]:
            out["save_on_cpu"].update(ran=False, reason="not requested (--configs)")
        return out

    # -- merging ------------------------------------------------------------
    def finish(self) -> None:
        self.result["wall_seconds"] = time.perf_counter() - self.t0
        finalize(self.result, self.args.out_dir, self.args.name, self.args.no_plots)
        shutil.rmtree(self.tmp, ignore_errors=True)


def finalize(res: dict, out_dir: str, name: str, no_plots: bool = False) -> None:
    """Merge the runs of each configuration into its headline fields, compare
    with the reference, analyse transfers; write NAME.json, NAME.md and plots.
    Also used by ``--rerender`` on the partial JSON of a run that was stopped."""
    s = res["settings"]
    opts = {"spec": res["model"], "interleave": s["interleave"], "device": res["device"]}
    cuda = res["device"] == "cuda"
    confs = res["configs"]
    for c, e in confs.items():
        if e.get("status") == "pending" and not (e.get("interleaved") or e.get("isolated")):
            e["status"] = "not_run"
            e["reason"] = "the run stopped before this configuration ran"
        merge_config(e, opts)
    ref = _reference(confs)
    res["exactness_reference"] = ref
    repeat = (res.get("interleaved") or {}).get("baseline_repeat")
    for c, e in confs.items():
        e["exact"] = _exactness(c, e, ref, confs)
        if repeat and repeat.get("reproducible") is False and e["exact"].get("bit_identical") is False:
            e["exact"]["bit_identical"] = None
            e["exact"]["note"] = ("not determinable: two plain runs of the baseline were not "
                                  "bit-identical on this machine")
    base = confs.get("baseline", {})
    base_t = (base.get("step_seconds") or {}).get("median") if base.get("status") == "ok" else None
    for c, e in confs.items():
        st = e.get("step_seconds")
        e.pop("vs_baseline", None)
        if st and base_t:
            e["vs_baseline"] = st["median"] / base_t
    res["link_analysis"] = link_analysis(res, cuda)
    for peer in ("torchtune", "deepspeed", "save_on_cpu"):
        p = (res.get("peers") or {}).get(peer)
        if p is None or p.get("ran") is False:
            continue
        e = confs.get(peer)
        p["ran"] = bool(e and e.get("status") in ("ok", "partial"))
        if e and e.get("status") not in ("ok", "partial"):
            p["reason"] = f"{e.get('status')}: {e.get('reason')}"
        if peer == "deepspeed" and e and not cuda:
            p["note"] = ("DeepSpeed's CPU accelerator is a synchronized device, so its "
                         "engine offloads nothing here: this row is checkpointing plus "
                         "its hooks")
    notes = res.setdefault("notes", [])
    for n in (
        "CPU-only machine: the cpu tier, save_on_cpu and the peers move host memory to host "
        "memory; they cost time and save nothing here. Peak memory is the process RSS."
        if not cuda else None,
        "Timing: " + ("interleaved (round-robin in one process)" if s["interleave"] else
                      "each configuration alone in its own process, one after another "
                      "(a per-process device budget cannot be shared)")):
        if n and n not in notes:
            notes.append(n)
    if not cuda and s.get("device_budget_bytes"):
        n = "--device-budget is a CUDA allocator budget: it was not applied on the CPU."
        if n not in notes:
            notes.append(n)
    if s.get("malloc_mmap_threshold"):
        n = (f"Every child process ran with MALLOC_MMAP_THRESHOLD_={s['malloc_mmap_threshold']} "
             "(glibc): tensors freed during the step leave the RSS, so peak RSS tracks live "
             "memory, and all configurations share one allocator setting (with glibc's "
             "dynamic threshold, freed activations stay in the heap and RSS barely moves).")
        if n not in notes:
            notes.append(n)
    elif not cuda and "tiermem_nvme" in confs and confs["tiermem_nvme"].get("status") == "ok":
        n = ("tiermem's nvme tier sets glibc's mmap threshold to 1 MiB when its Offloader is "
             "created (tiermem/tiers/nvme.py, NOTE [Freed memory and RSS]); this is "
             "process-wide: "
             + ("in the interleaved process every configuration ran under it; " if s["interleave"]
                else "")
             + "of the isolated runs only tiermem_nvme's process did, which lowers its peak "
             "RSS partly by the allocator setting rather than by moving tensors.")
        if n not in notes:
            notes.append(n)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    md_path = os.path.join(out_dir, f"{name}.md")

    def dump():
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)

    dump()
    with open(md_path, "w") as f:
        f.write(render_markdown(res))
    plots = []
    if not no_plots:
        try:
            import plots as plotmod
            plots = plotmod.plot_all(res, os.path.join(out_dir, name))
            res["plots"] = {"written": [os.path.basename(p) for p in plots]}
        except ImportError as e:
            msg = (f"plots skipped: matplotlib is not importable ({e}); redraw later with "
                   f"`python benchmarks/plots.py {os.path.basename(path)}`")
            _log(f"[suite] {msg}")
            res["plots"] = {"written": [], "skipped": msg}
        except Exception as e:
            res["plots"] = {"written": [], "error": _err_text(e)}
            _log(f"[suite] plots failed: {_err_text(e)}")
    else:
        res["plots"] = {"written": [], "skipped": "--no-plots"}
    dump()
    _log(f"[suite] wrote {path}, {md_path}" + "".join(f", {p}" for p in plots))
    _log(render_markdown(res))


def merge_config(e: dict, opts: dict) -> None:
    """Fill the headline fields of one configuration from its runs."""
    inter, iso = e.get("interleaved"), e.get("isolated")
    spec_tokens = opts["spec"]["batch"] * opts["spec"]["seq_len"]
    for k in ("status", "reason", "failed_at_step"):
        if e.get("status") != "skipped" and k != "status":
            e.pop(k, None)
    if e.get("status") == "skipped":
        return
    timing = None
    if inter and inter.get("status") == "ok" and inter.get("times"):
        timing, mode = inter, "interleaved"
    elif iso and iso.get("status") == "ok" and iso.get("times"):
        timing, mode = iso, "isolated"
    statuses = [r.get("status") for r in (inter, iso) if r]
    if "oom" in statuses:
        e["status"] = "oom"
        src = inter if (inter and inter.get("status") == "oom") else iso
        e["reason"] = src.get("reason")
        e["failed_at_step"] = src.get("failed_at_step")
    elif timing is not None and all(s == "ok" for s in statuses):
        e["status"] = "ok"
    elif timing is not None:
        bad = [r for r in (inter, iso) if r and r.get("status") != "ok"][0]
        e["status"] = "partial"
        e["reason"] = f"{bad.get('status')}: {bad.get('reason')}"
    else:
        bad = [r for r in (inter, iso) if r and r.get("status") != "ok"]
        e["status"] = bad[0].get("status") if bad else "not_run"
        e["reason"] = bad[0].get("reason") if bad else "no run"
    if timing is not None:
        e["timing_mode"] = mode
        e["step_seconds"] = summarize([float(t) for t in timing["times"]], mean=False)
        e["tokens_per_second"] = spec_tokens / e["step_seconds"]["median"]
        ph = timing.get("phases") or []
        if ph:
            e["phase_seconds_median"] = {k: statistics.median([p[k] for p in ph])
                                         for k in ph[0]}
        src_stats = timing
        e["tiermem"] = _tiermem_summary(src_stats.get("tiermem_last_step"),
                                        src_stats.get("tiermem_steps") or [])
        if timing.get("peer_stats"):
            e["peer_stats"] = timing["peer_stats"]
        if timing.get("extra"):
            e["extra"] = timing["extra"]
    if iso:
        for k in ("peak_device_bytes", "peak_device_reserved_bytes", "peak_host_bytes",
                  "peak_host_increase_bytes", "host_peak_method", "state_bytes",
                  "device_allocated_after_setup_bytes"):
            if iso.get(k) is not None:
                e[k] = iso[k]
        pin = iso.get("pinned_host") or {}
        if pin.get("allocated_bytes_peak") is not None:
            e["peak_pinned_host_bytes"] = pin["allocated_bytes_peak"]
        if e.get("tiermem") is None and iso.get("tiermem_last_step"):
            e["tiermem"] = _tiermem_summary(iso["tiermem_last_step"], iso.get("tiermem_steps") or [])


def _repeat_check(base: Optional[dict], rep: dict) -> dict:
    """Whether two plain runs in the same process were bit-identical."""
    out = {"status": rep.get("status")}
    if base and base.get("status") == "ok" and rep.get("status") == "ok":
        n = min(len(base["losses"]), len(rep["losses"]))
        out["losses_equal"] = base["losses"][:n] == rep["losses"][:n]
        out["state_equal"] = base.get("fingerprint") == rep.get("fingerprint")
        out["reproducible"] = out["losses_equal"] and out["state_equal"]
        out["steps_compared"] = n
    return out


def _reference(confs: dict) -> Optional[str]:
    """The baseline; where it did not run (OOM under a budget), plain
    checkpointing, then selective checkpointing, then any configuration."""
    first = ["baseline", "checkpoint", "sac"]
    order = first + [c for c in confs if c not in first]
    for c in order:
        e = confs.get(c)
        if e and e.get("status") in ("ok", "partial"):
            return c
    return None


def _exactness(name: str, e: dict, ref: Optional[str], confs: dict) -> dict:
    out = {"reference": ref}
    if ref is None or e.get("status") not in ("ok", "partial"):
        return out
    r = confs[ref]
    checks = []
    for mode in ("interleaved", "isolated"):
        mine, theirs = e.get(mode), r.get(mode)
        if not (mine and theirs and mine.get("status") == "ok" and theirs.get("status") == "ok"):
            continue
        la, lb = mine.get("losses") or [], theirs.get("losses") or []
        n = min(len(la), len(lb))
        if n:
            out[f"{mode}_losses_equal"] = la[:n] == lb[:n]
            out[f"{mode}_steps_compared"] = n
            checks.append(out[f"{mode}_losses_equal"])
        fa, fb = mine.get("fingerprint"), theirs.get("fingerprint")
        if fa and fb and len(la) == len(lb):
            out[f"{mode}_state_equal"] = fa == fb
            checks.append(fa == fb)
        if n and la[:n] != lb[:n]:
            diff = [i for i in range(n) if la[i] != lb[i]]
            out[f"{mode}_first_differing_step"] = diff[0]
            out[f"{mode}_max_abs_loss_diff"] = max(abs(la[i] - lb[i]) for i in diff)
    out["bit_identical"] = all(checks) if checks else None
    return out


def link_analysis(res: dict, cuda: bool) -> dict:
    """Seconds of link time per step that each tiermem configuration's moves need,
    against the measured ceilings and the baseline's phase times."""
    ceil = res.get("ceilings") or {}
    confs = res["configs"]
    base = confs.get("baseline", {})
    bph = base.get("phase_seconds_median") if base.get("status") == "ok" else None
    out = {"method": (
        "moved = bytes the tier held per step (cpu + nvme); D2H/H2D seconds = moved / the "
        "pinned link ceiling (CUDA) or the host memcpy ceiling (CPU); disk seconds = nvme "
        "bytes / O_DIRECT write (read) ceiling. bound_step = max(forward, D2H, disk write) + "
        "max(backward, H2D, disk read) + optimizer, with the baseline's phase times: the step "
        "time if every transfer overlapped perfectly with compute (a lower bound that ignores "
        "when each tensor is produced and needed)."), "configs": {}}
    if cuda:
        c = ceil.get("cuda") or {}
        d2h = (c.get("d2h") or {}).get("gbps")
        h2d = (c.get("h2d") or {}).get("gbps")
        link = "pinned PCIe"
    else:
        d2h = h2d = (ceil.get("host_copy") or {}).get("gbps")
        link = "host memcpy"
    disk = ceil.get("disk") or {}
    dw, dr = disk.get("write_gbps"), disk.get("read_gbps")
    out["link"] = link
    for name, e in confs.items():
        tm = e.get("tiermem")
        if not tm or e.get("status") not in ("ok", "partial"):
            continue
        bt = tm["last_step"]["bytes_by_tier"]
        moved = bt.get("cpu", 0) + bt.get("nvme", 0)
        nv = bt.get("nvme", 0)
        a = {"moved_bytes": moved, "nvme_bytes": nv, "kept_bytes": bt.get("keep", 0)}
        if d2h:
            a["d2h_seconds"] = moved / (d2h * 1e9)
        if h2d:
            a["h2d_seconds"] = moved / (h2d * 1e9)
        if nv and dw:
            a["disk_write_seconds"] = nv / (dw * 1e9)
        if nv and dr:
            a["disk_read_seconds"] = nv / (dr * 1e9)
        step = (e.get("step_seconds") or {}).get("median")
        own = e.get("phase_seconds_median")
        if own:
            a["forward_seconds"] = own["forward"]
            a["backward_seconds"] = own["backward"]
            # How busy the link was during this configuration's own phases
            # (>1: the transfers cannot fit inside that phase at the ceiling).
            if "d2h_seconds" in a and own["forward"]:
                a["d2h_over_own_forward"] = a["d2h_seconds"] / own["forward"]
            if "h2d_seconds" in a and own["backward"]:
                a["h2d_over_own_backward"] = a["h2d_seconds"] / own["backward"]
        if bph and "d2h_seconds" in a:
            fwd = max(bph["forward"], a["d2h_seconds"], a.get("disk_write_seconds", 0.0))
            bwd = max(bph["backward"], a["h2d_seconds"], a.get("disk_read_seconds", 0.0))
            a["bound_step_seconds"] = fwd + bwd + bph["optimizer"]
            a["d2h_over_baseline_forward"] = a["d2h_seconds"] / bph["forward"] if bph["forward"] else None
            a["h2d_over_baseline_backward"] = (a["h2d_seconds"] / bph["backward"]
                                               if bph["backward"] else None)
            if step:
                a["measured_over_bound"] = step / a["bound_step_seconds"]
        if step:
            a["measured_step_seconds"] = step
        out["configs"][name] = a
    return out


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------


def _ms(s) -> str:
    return "–" if s is None else f"{s * 1e3:.1f}"


def render_markdown(res: dict) -> str:
    m = res.get("machine") or {}
    mdl = res["model"]
    cuda = res["device"] == "cuda"
    lines = [f"## {res['name']}: side-by-side activation-memory benchmark", ""]
    dev = (m.get("cuda_device") or {}).get("name") if cuda else "none (CPU only)"
    smi = m.get("nvidia_smi") or {}
    lines.append(f"- Date: {m.get('date')}; commit {str(m.get('commit'))[:12]}"
                 f"{' (tiermem/ modified)' if m.get('tiermem_dirty') else ''}")
    lines.append(f"- Machine: GPU {dev}"
                 + (f", driver {smi.get('driver_version')}, PCIe gen {smi.get('pcie_gen_current')}"
                    f" x{smi.get('pcie_width_current')}" if smi else "")
                 + f"; CPU {m.get('cpu_model')} ({m.get('logical_cores')} logical cores); "
                 f"RAM {fmt_bytes(m.get('ram_total_bytes'))}; torch {m.get('torch')}"
                 + (f" (CUDA {m.get('torch_cuda')})" if m.get("torch_cuda") else ""))
    nd = m.get("nvme_dir") or {}
    if nd:
        lines.append(f"- NVMe dir: {nd.get('path')} on {nd.get('device')} ({nd.get('fs_type')}"
                     + (f", {nd.get('model')}" if nd.get("model") else "") + ")")
    lines.append(f"- Model: TinyGPT {mdl['layers']} layers, width {mdl['width']}, "
                 f"{mdl['heads']} heads, seq {mdl['seq_len']}, batch {mdl['batch']}, vocab "
                 f"{mdl['vocab']}, {mdl['dtype']}, dropout {mdl['dropout']}; "
                 f"{mdl.get('parameters', 0) / 1e6:.1f} M parameters; AdamW; "
                 f"{mdl['tokens_per_step']} tokens/step")
    s = res["settings"]
    budget = s.get("device_budget_bytes")
    lines.append(f"- Steps: {s['warmup']} warm-up discarded, {s['steps']} measured "
                 f"({'interleaved round-robin' if s['interleave'] else 'each config alone'})"
                 + (f"; device budget {fmt_bytes(budget)}" if budget else "")
                 + ("; deterministic algorithms" if s.get("deterministic") else ""))
    lines.append(f"- Command: `{' '.join(res['command'])}`")
    lines.append("")
    mem_label = "peak device" if cuda else "peak RSS"
    host_label = "peak host RSS (pinned)" if cuda else "RSS increase"
    lines += [f"| config | status | step ms median (min–max) | × baseline | tokens/s | "
              f"{mem_label} | {host_label} | moved/step (cpu + nvme) | stall ms | late restores "
              f"| = baseline |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in res["configs"].items():
        st = e.get("step_seconds")
        step = (f"{_ms(st['median'])} ({_ms(st['min'])}–{_ms(st['max'])})" if st else "–")
        vs = f"{e['vs_baseline']:.2f}" if e.get("vs_baseline") else "–"
        tps = f"{e['tokens_per_second']:,.0f}" if e.get("tokens_per_second") else "–"
        dmem = fmt_bytes(e.get("peak_device_bytes")) if cuda else fmt_bytes(e.get("peak_host_bytes"))
        hmem = fmt_bytes(e.get("peak_host_bytes") if cuda else e.get("peak_host_increase_bytes"))
        if cuda and e.get("peak_pinned_host_bytes") is not None:
            hmem += f" ({fmt_bytes(e['peak_pinned_host_bytes'])})"
        tm = e.get("tiermem")
        moved = stall = late = "–"
        if tm:
            bt = tm["last_step"]["bytes_by_tier"]
            moved = fmt_bytes(bt.get("cpu", 0) + bt.get("nvme", 0))
            if bt.get("nvme"):
                moved += f" ({fmt_bytes(bt['nvme'])} nvme)"
            ss = tm.get("stall_seconds")
            stall = f"{ss['median'] * 1e3:.2f}" if ss else "–"
            late = str(tm.get("late_restores_max", "–"))
        ex = (e.get("exact") or {}).get("bit_identical")
        exs = {True: "yes", False: "**NO**", None: "–"}[ex]
        status = e.get("status", "?")
        if status == "oom":
            status = "**OOM**"
        lines.append(f"| {name} | {status} | {step} | {vs} | {tps} | {dmem} | {hmem} | {moved} "
                     f"| {stall} | {late} | {exs} |")
    lines.append("")
    rep = (res.get("interleaved") or {}).get("baseline_repeat")
    if rep and "reproducible" in rep:
        lines.append(f"(Control: a second plain baseline in the same run was "
                     f"{'bit-identical' if rep['reproducible'] else '**not** bit-identical'} "
                     f"to the first over {rep['steps_compared']} steps.)")
        lines.append("")
    ref = res.get("exactness_reference")
    if ref and ref != "baseline":
        lines.append(f"(= baseline: compared with `{ref}`, the baseline did not run to the end.)")
        lines.append("")
    # ceilings
    c = res.get("ceilings") or {}
    lines.append("**Ceilings measured in this run:**")
    hc = c.get("host_copy") or {}
    if hc.get("gbps"):
        lines.append(f"- host memcpy: {hc['gbps']:.1f} GB/s")
    cu = c.get("cuda") or {}
    if cu.get("d2h"):
        lines.append(f"- pinned D2H {cu['d2h']['gbps']:.1f} GB/s, H2D {cu['h2d']['gbps']:.1f} "
                     f"GB/s; both at once: D2H {cu['both']['d2h_gbps']:.1f} + H2D "
                     f"{cu['both']['h2d_gbps']:.1f} GB/s")
    elif cu:
        lines.append(f"- PCIe: {cu.get('skipped') or cu.get('error')}")
    dk = c.get("disk") or {}
    if dk.get("write_gbps"):
        lines.append(f"- NVMe dir ({dk.get('engine')} engine, "
                     f"{'O_DIRECT' if dk.get('direct') else 'buffered'}): write "
                     f"{dk['write_gbps']:.2f} GB/s, read {dk['read_gbps']:.2f} GB/s")
    elif dk:
        lines.append(f"- NVMe dir: {dk.get('error')}")
    la = res.get("link_analysis") or {}
    if la.get("configs"):
        lines += ["", f"**Transfers against the ceilings** (link: {la.get('link')}; seconds per "
                  "step; bound = step time if all transfers overlapped with the baseline's "
                  "compute):", "",
                  "| config | moved/step | D2H s | H2D s | disk w/r s | own fwd/bwd s | "
                  "D2H / own fwd | H2D / own bwd | baseline fwd/bwd s | bound step s | "
                  "measured step s | measured / bound |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        b = res["configs"].get("baseline") or {}
        bph = (b.get("phase_seconds_median") or {}) if b.get("status") == "ok" else {}
        for name, a in la["configs"].items():
            if not a["moved_bytes"]:
                continue

            def f3(x):
                return "–" if x is None else f"{x:.3f}"

            def f2(x):
                return "–" if x is None else f"{x:.2f}"
            dwr = (f"{f3(a.get('disk_write_seconds'))}/{f3(a.get('disk_read_seconds'))}"
                   if a.get("nvme_bytes") else "–")
            mob = a.get("measured_over_bound")
            lines.append(
                f"| {name} | {fmt_bytes(a['moved_bytes'])} | {f3(a.get('d2h_seconds'))} | "
                f"{f3(a.get('h2d_seconds'))} | {dwr} | {f3(a.get('forward_seconds'))}/"
                f"{f3(a.get('backward_seconds'))} | {f2(a.get('d2h_over_own_forward'))} | "
                f"{f2(a.get('h2d_over_own_backward'))} | {f3(bph.get('forward'))}/"
                f"{f3(bph.get('backward'))} | {f3(a.get('bound_step_seconds'))} | "
                f"{f3(a.get('measured_step_seconds'))} | "
                f"{'–' if mob is None else f'{mob:.2f}'} |")
    # not run
    skipped = [(n, e) for n, e in res["configs"].items()
               if e.get("status") not in ("ok", "partial")]
    if skipped:
        lines += ["", "**Not run or failed:**"]
        for n, e in skipped:
            lines.append(f"- `{n}`: {e.get('status')}: {e.get('reason')}")
    peers = res.get("peers") or {}
    lines += ["", "**Peers:** " + "; ".join(
        f"{p}: {'ran' if v.get('ran') else 'did not run'}"
        + (f" ({v.get('reason')})" if v.get("reason") and not v.get("ran") else "")
        + (f" — {v['note']}" if v.get("note") else "")
        for p, v in peers.items())]
    for n in res.get("notes", []):
        lines.append(f"- {n}")
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Presets: " + ", ".join(PRESETS))
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default=None, help="output file stem (default: the preset)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    for k in ("layers", "width", "heads", "seq-len", "batch", "vocab", "warmup", "steps",
              "memory-steps", "memory-jobs"):
        p.add_argument(f"--{k}", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--configs", default=None,
                   help=f"comma-separated, from {','.join(ALL_CONFIGS)}")
    p.add_argument("--timeline", default=None,
                   help="configs whose one-step memory timeline is recorded (comma-separated)")
    p.add_argument("--interleave", dest="interleave", action="store_true", default=None)
    p.add_argument("--no-interleave", dest="interleave", action="store_false")
    p.add_argument("--device-budget", default=None,
                   help="per-process CUDA memory budget (e.g. 24GiB), via "
                        "set_per_process_memory_fraction")
    p.add_argument("--nvme-dir", default=None,
                   help="dir for the nvme tier and the disk ceiling (default: a new temp dir "
                        "under /tmp; use a real disk, not tmpfs)")
    p.add_argument("--min-offload-bytes", type=parse_size, default=None,
                   help="tiermem min_offload_bytes (default: tiermem's)")
    p.add_argument("--tiermem-cpu-budget", default=None,
                   help="tiermem cpu_budget (default: tiermem's: half the available RAM)")
    p.add_argument("--mixed-min-bytes", type=parse_size, default=None,
                   help="tiermem_mixed: tensors this big go to cpu (default: one MLP hidden "
                        "activation)")
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--malloc-mmap-threshold", type=parse_size, default=None,
                   help="set MALLOC_MMAP_THRESHOLD_ (glibc) in every child process, so that "
                        "freed tensors leave the RSS and every configuration runs under the "
                        "same allocator setting (default on CPU: 1MiB, the nvme tier's own "
                        "setting; 0: leave glibc's dynamic threshold)")
    p.add_argument("--ceiling-bytes", type=parse_size, default=None)
    p.add_argument("--ceiling-chunk", type=parse_size, default=None)
    p.add_argument("--max-step-seconds", type=float, default=None,
                   help="drop a config whose warm-up step takes longer")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole run; parts past it are reported as skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                   default=True)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--repeat-baseline", action="store_true", default=None,
                   help="also run a second baseline in the interleaved process, to check "
                        "that plain runs are bit-identical here (default: on CUDA only)")
    p.add_argument("--progress", choices=("auto", "bar", "plain", "none"), default="auto")
    p.add_argument("--rerender", metavar="JSON", default=None,
                   help="only redo the merge, Markdown and plots of a (partial) result JSON, "
                        "e.g. of a run stopped by a time limit; writes next to it")
    # children
    p.add_argument("--role", choices=("main", "probe", "interleaved", "isolated"),
                   default="main", help=argparse.SUPPRESS)
    p.add_argument("--child-opts", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    return p


def resolve(args) -> dict:
    """The options of this run: defaults < preset < command line."""
    vals = dict(_DEFAULTS)
    if args.preset:
        vals.update(PRESETS[args.preset])
    for k in list(_DEFAULTS) + ["device_budget"]:
        v = getattr(args, k.replace("-", "_"), None)
        if k == "timeline":
            v = args.timeline
        if v is not None:
            vals[k] = v
    device = vals["device"]
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("suite: --device cuda, but torch.cuda.is_available() is False")
    configs = [c for c in str(vals["configs"]).split(",") if c]
    bad = [c for c in configs if c not in ALL_CONFIGS]
    if bad:
        sys.exit(f"suite: unknown config(s) {bad}; choose from {ALL_CONFIGS}")
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="tiermem-suite-nvme-", dir="/tmp")
    from models_bench import ModelSpec
    spec = ModelSpec(layers=vals["layers"], width=vals["width"], heads=vals["heads"],
                     seq_len=vals["seq_len"], batch=vals["batch"], vocab=vals["vocab"],
                     dtype=vals["dtype"], dropout=vals["dropout"])
    spec.gpt_config()  # validates
    spec.torch_dtype
    return {
        "device": device, "spec": spec.as_dict(), "configs": configs,
        "timeline_configs": [c for c in str(vals["timeline"]).split(",") if c],
        "warmup": vals["warmup"], "steps": vals["steps"], "memory_steps": vals["memory_steps"],
        "interleave": bool(vals["interleave"]), "memory_jobs": max(1, vals["memory_jobs"]),
        "device_budget_bytes": parse_size(vals.get("device_budget")),
        "nvme_dir": nvme_dir, "nvme_dir_created": args.nvme_dir is None,
        "min_offload_bytes": args.min_offload_bytes, "tiermem_cpu_budget": args.tiermem_cpu_budget,
        "mixed_min_bytes": args.mixed_min_bytes, "io_threads": args.io_threads,
        "malloc_mmap_threshold": (args.malloc_mmap_threshold if args.malloc_mmap_threshold
                                  is not None else (1 << 20 if device == "cpu" else 0)),
        "ceiling_bytes": int(vals["ceiling_bytes"]), "ceiling_chunk": int(vals["ceiling_chunk"]),
        "max_step_seconds": float(vals["max_step_seconds"]),
        "time_limit": float(vals["time_limit"]), "seed": args.seed,
        "deterministic": bool(args.deterministic) and device == "cuda",
        "repeat_baseline": (device == "cuda" if args.repeat_baseline is None
                            else bool(args.repeat_baseline)),
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.role != "main":
        return child_main(args)
    if args.rerender:
        with open(args.rerender) as f:
            res = json.load(f)
        stem = os.path.splitext(os.path.basename(args.rerender))[0]
        finalize(res, os.path.dirname(os.path.abspath(args.rerender)), stem, args.no_plots)
        return 0
    args.name = args.name or args.preset or "suite"
    opts = resolve(args)
    suite = Suite(args, opts)
    try:
        res = suite.run()
    finally:
        if opts.get("nvme_dir_created"):
            shutil.rmtree(opts["nvme_dir"], ignore_errors=True)
    bad = [c for c, e in res["configs"].items()
           if (e.get("exact") or {}).get("bit_identical") is False]
    if bad:
        _log(f"[suite] WARNING: losses/state differ from {res.get('exactness_reference')} "
             f"for: {', '.join(bad)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
