"""The child processes of the suite (``--role``; each runs in a fresh process
and writes one result JSON): ``probe`` (machine, ceilings, which
configurations can run here), ``interleaved`` (every configuration in one
process, stepping in turn: the step times) and ``isolated`` (one
configuration alone: peak memory, and the timeline if asked)."""

from __future__ import annotations

import gc
import json
import time
import traceback
from typing import List, Optional, Sequence

from ..common import reset_peak_rss, rss_bytes, vm_hwm_bytes
from .machine import ceiling_cuda_links, ceiling_disk, ceiling_host_copy, machine_info
from .sampler import timeline_step
from .util import err_text, is_oom, log


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
            # Strict, not warn_only: flash and memory-efficient attention take
            # their deterministic backward only in strict mode (warn_only keeps
            # the atomics and warns once), and every row's exactness is
            # checked bit for bit against the baseline's.
            torch.use_deterministic_algorithms(True)
            # Deterministic mode also fills every torch.empty with NaN by default:
            # a memset per allocation (pinned host buffers of save_on_cpu too)
            # that would tax the configurations unevenly. Not needed here.
            import torch.utils.deterministic
            torch.utils.deterministic.fill_uninitialized_memory = False
    return device


def role_build(opts: dict) -> dict:
    """Compile the C++ I/O engine, or find it up to date (NOTE [The engine is
    built before the clock] in orchestrate.py). A failed build is reported,
    not raised: the configurations then run on the engine tiermem falls back
    to (``io_engine`` of the probe says which)."""
    t0 = time.perf_counter()
    try:
        from tiermem.io.build import build
        path = build(verbose=False)
    except Exception as e:
        return {"status": "failed", "reason": err_text(e)[-1500:],
                "seconds": time.perf_counter() - t0}
    return {"status": "ok", "path": path, "seconds": time.perf_counter() - t0}


def role_probe(opts: dict) -> dict:
    import torch
    from ..models_bench import CONFIGS, peer_versions, probe_config

    device = _child_setup(opts)
    res = {"machine": machine_info(opts.get("nvme_dir")), "peers_installed": peer_versions()}
    ceil = {}
    t0 = time.perf_counter()
    try:
        ceil["host_copy"] = ceiling_host_copy(min(opts["ceiling_bytes"], 1 << 30))
    except Exception as e:
        ceil["host_copy"] = {"error": err_text(e)}
    if device.type == "cuda":
        try:
            ceil["cuda"] = ceiling_cuda_links(opts["ceiling_bytes"])
        except Exception as e:
            ceil["cuda"] = {"error": err_text(e)}
    else:
        ceil["cuda"] = {"skipped": "no CUDA device: pinned D2H/H2D not measured"}
    if opts.get("nvme_dir"):
        try:
            ceil["disk"] = ceiling_disk(opts["nvme_dir"], opts["ceiling_bytes"],
                                        opts["ceiling_chunk"], opts.get("io_threads") or 4,
                                        pinned=device.type == "cuda")
        except Exception as e:
            ceil["disk"] = {"error": err_text(e)}
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
        res["io_engine"] = {"error": err_text(e)}
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


def round_order(names: Sequence[str], i: int) -> List[str]:
    """The order in which round ``i`` of the interleaved run steps ``names``.

    # NOTE [Order of the interleaved steps]
    # A step may pay for the step run just before it in the same process
    # (the heap and page tables it left, work it left running). The suite
    # used to rotate one fixed order each round; a rotation of a cycle keeps
    # every neighbour, so each configuration ran right after the same one in
    # every round, and any such cost fell on one configuration every time
    # (a systematic bias that pairing by round cannot remove). The rounds
    # follow a Williams design instead, a Latin square balanced for the
    # immediate predecessor: over ``n`` rounds (``2n`` for an odd number
    # ``n`` of configurations) every configuration runs once (twice) at each
    # position and right after every other one exactly once (twice); later
    # rounds cycle through it again. Round ``i`` depends only on
    # ``(len(names), i)``, and the per-round pairing of NOTE [Paired step
    # ratios] in budgets.py is unchanged. Why it was looked at:
    # benchmarks/results/2026-12-01-cpu-keep-overhead.md.
    """
    n = len(names)
    if n <= 1:
        return list(names)
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:   # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    period = n if n % 2 == 0 else 2 * n
    k = i % period
    row = [(j + k) % n for j in first]
    if k >= n:   # odd n: the second square is the first one reversed
        row = [(j + k - n) % n for j in reversed(first)]
    return [names[j] for j in row]


def _slow_limit(opts: dict, i: int) -> float:
    """A warm-up step slower than this drops the configuration. The first step
    gets 3x: it pays one-time costs (pinned allocations, extension loads)."""
    return opts["max_step_seconds"] * (3.0 if i == 0 else 1.0)


def role_interleaved(opts: dict) -> dict:
    import torch
    from ..models_bench import (ModelSpec, build_model, make_batches, make_runner,
                                state_fingerprint, step_seed, tensor_state_bytes)

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
            out[name] = {"status": "ok", "times": [], "rounds": [], "phases": [], "losses": [],
                         "tiermem_steps": []}
        except Exception as e:
            out[name] = {"status": "error", "reason": err_text(e),
                         "traceback": traceback.format_exc()[-2000:]}
    del base
    rounds = opts["warmup"] + opts["steps"]
    batches = make_batches(spec, device, rounds, seed)
    warm = opts["warmup"]
    done_rounds = 0
    for i in range(rounds):
        r0 = time.perf_counter()
        # A balanced order (NOTE [Order of the interleaved steps]), over the
        # configurations still running: names keeps the requested order.
        live = [n for n in names if n in runners]
        order = [(n, runners[n]) for n in round_order(live, i)]
        for name, r in order:
            rec = out[name]
            x, y = batches[i]
            try:
                loss, dt, ph = r.step(x, y, step_seed(seed, i))
            except Exception as e:
                rec["status"] = "oom" if is_oom(e) else "error"
                rec["reason"] = err_text(e)
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
                rec["rounds"].append(i - warm)
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
            log("[interleaved] no configuration left to run")
            break
        log(f"[interleaved] round {i + 1}/{rounds} ({'warm-up' if i < warm else 'measured'}) "
            f"{dt_round:.2f} s, {len(runners)} configs")
        elapsed = time.perf_counter() - t_start
        if i + 1 < rounds and elapsed + 1.2 * dt_round > limit:
            log(f"[interleaved] stopping after {i + 1} rounds: time limit {limit:.0f} s")
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


def role_isolated(opts: dict, name: str) -> dict:
    import torch
    from ..models_bench import (ModelSpec, Runner, build_model, make_batches, state_fingerprint,
                                step_seed, tensor_state_bytes)

    t_start = time.perf_counter()
    device = _child_setup(opts)
    cuda = device.type == "cuda"
    spec = ModelSpec(**opts["spec"])
    seed = opts["seed"]
    res = {"config": name, "status": "ok"}
    if opts.get("shared_device"):   # NOTE [Timings of runs that shared the machine]
        res["shared_device"] = True
    try:
        runner = Runner(name, build_model(spec, device, seed), spec, device, opts)
    except Exception as e:
        res.update(status="oom" if is_oom(e) else "error", reason=err_text(e),
                   traceback=traceback.format_exc()[-2000:], failed_at_step="setup")
        return res
    n_meas = opts["memory_steps"] if opts["interleave"] else opts.get("solo_steps",
                                                                       opts["steps"])
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
    times, phases, losses, tsteps, held = [], [], [], [], []
    for i in range(n):
        x, y = batches[i]
        try:
            loss, dt, ph = runner.step(x, y, step_seed(seed, i))
        except Exception as e:
            res.update(status="oom" if is_oom(e) else "error", reason=err_text(e),
                       failed_at_step=i)
            if res["status"] == "error":
                res["traceback"] = traceback.format_exc()[-2000:]
            break
        losses.append(float(loss))
        if i >= opts["warmup"]:
            times.append(dt)
            phases.append(ph)
            held.append(runner.forward_held_bytes)
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
    res["forward_held_bytes"] = held
    res["tiermem_last_step"] = runner.tiermem_stats()
    res["peer_stats"] = runner.peer_stats()
    res["extra"] = runner.extra
    if runner.off is not None:
        res["tiermem_host_bytes_in_use_after"] = runner.off.host_bytes_in_use
    if res["status"] == "ok":
        res["state_bytes"] = tensor_state_bytes(runner.model, runner.opt)
        res["fingerprint"] = state_fingerprint(runner.model, runner.opt)
        if opts.get("timeline"):
            res["timeline"] = timeline_step(runner, batches[n], step_seed(seed, n), device)
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
        return {"error": err_text(e)}
    return {"allocated_bytes_peak": st.get("allocated_bytes.peak"),
            "allocated_bytes_current": st.get("allocated_bytes.current"),
            "active_bytes_peak": st.get("active_bytes.peak"),
            "num_host_alloc": st.get("num_host_alloc"),
            "host_alloc_seconds": (st.get("host_alloc_time.total") or 0) / 1e6,
            "method": "torch.cuda.host_memory_stats() (blocks rounded to powers of two; peaks "
                      "are torch's best-effort per-bucket aggregate); reset after setup"}


def child_main(args) -> int:
    with open(args.child_opts) as f:
        opts = json.load(f)
    try:
        if args.role == "build":
            res = role_build(opts)
        elif args.role == "probe":
            res = role_probe(opts)
        elif args.role == "interleaved":
            res = role_interleaved(opts)
        else:
            res = role_isolated(opts, args.config)
    except Exception as e:
        res = {"status": "error", "reason": err_text(e), "traceback": traceback.format_exc()}
        if is_oom(e):
            res["status"] = "oom"
    with open(args.result, "w") as f:
        json.dump(res, f)
    return 0
