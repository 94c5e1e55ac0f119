"""The parent process of a suite run: it starts the child processes (the C++
engine's build, the probe, then interleaved timing, then the isolated runs,
several at a time where asked) within the time limit, collects their
results into one JSON as they come, and shows progress. It never initialises
CUDA itself."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

from .report import finalize, repeat_check
from .util import command_line, err_text, log

SCHEMA = 1
# The children run this package's __main__.py as a script, which works from
# any working directory (see __main__.py).
_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")

# NOTE [The engine is built before the clock]
# tiermem compiles its C++ I/O engine on first use (torch's JIT build, into
# TORCH_EXTENSIONS_DIR). In a fresh environment that first use fell inside
# the probe, whose time limit (a quarter of --time-limit, at least 60 s) a
# cold build can exceed on its own: measured on 2 shared cores, 128 s
# against a CUDA build of torch (torch 2.11+cu130, no GPU), about 60 s
# against the CPU build; the probe was killed at 105 s and the run lost its
# ceilings and the smoke tests their link analysis. So a child of its own
# builds the engine (or finds it up to date, about a second) before the
# probe, with BUILD_TIMEOUT_S, and its time is not counted against
# --time-limit (the deadline moves by it): the limit is for measuring, and a
# one-time compile says nothing about the configurations.
# ``phases['build']`` and ``engine_build`` report it; a failed build is a note,
# and the run goes on with the engine tiermem falls back to. ``--no-build``
# skips it, for a caller that built the engine itself (gpu_suite.sh, whose
# build part has its own limit): a failed build there is not tried again
# inside a benchmark part's limit.
BUILD_TIMEOUT_S = 900.0


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
            log(msg)

    def advance(self, what: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what[:40])
            self.bar.update(1)
        elif not self.quiet:
            log(f"[suite] {self.n}/{self.total} done: {what}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Suite:
    """One run: the probe, interleaved and isolated children in turn, each given
    what is left of ``--time-limit``; the result JSON rewritten after each."""

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
        cmd = [sys.executable, _MAIN, "--role", role, "--child-opts", opath,
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

    def _build(self, res: dict, prog) -> None:
        """Phase 0: NOTE [The engine is built before the clock]."""
        a = self.args
        prog.note(f"[suite] {a.name}: the C++ I/O engine (built if not up to date)")
        t = time.perf_counter()
        built = self.run_child("build", BUILD_TIMEOUT_S)
        took = time.perf_counter() - t
        res["phases"]["build"] = took
        self.deadline += took
        res["engine_build"] = {k: built.get(k) for k in ("status", "reason", "seconds")}
        if built.get("status") != "ok":
            res["notes"].append(f"the C++ I/O engine was not built ({built.get('reason')}); "
                                "the configurations ran on the engine tiermem fell back to "
                                "(io_engine)")
        prog.advance("build")

    def _fit_interleaving(self, res: dict, runnable: list) -> None:
        """On CUDA, time each configuration alone where the interleaved child
        could not hold them all: NOTE [Interleaving must fit the device] in
        configs.py."""
        from .configs import interleave_fits, interleaved_state_bytes
        opts = self.opts
        if not (opts["interleave"] and opts["device"] == "cuda" and runnable):
            return
        total = ((res.get("machine") or {}).get("cuda_device") or {}).get("memory_bytes")
        pbytes = res["model"].get("parameter_bytes")
        if not total or not pbytes:
            return
        n = len(runnable) + (1 if opts.get("repeat_baseline") and "baseline" in runnable else 0)
        if interleave_fits(pbytes, n, total):
            return
        from .configs import SOLO_STEPS_CUDA
        solo_steps = min(opts["steps"], SOLO_STEPS_CUDA)
        self.opts = dict(opts, interleave=False, solo_steps=solo_steps)
        res["settings"]["interleave"] = False
        res["settings"]["solo_steps"] = solo_steps
        res["notes"].append(
            f"timed each configuration alone, not interleaved: {n} configurations' model and "
            f"AdamW states ({interleaved_state_bytes(pbytes, n) / 2**30:.1f} GiB) would take more "
            f"than the interleaved process can hold on this device ({total / 2**30:.1f} GiB); "
            f"{opts['warmup']} warm-up and {solo_steps} measured steps each")

    def run(self) -> dict:
        a, opts = self.args, self.opts
        requested = opts["configs"]
        timeline = [c for c in opts["timeline_configs"] if c in requested]
        n_parts = (2 + (0 if a.no_build else 1) + (1 if opts["interleave"] else 0)
                   + len(requested) + 1)
        prog = Progress(n_parts, a.progress)
        res = self.result
        res.update({
            "suite": "tiermem side-by-side activation-memory benchmark", "schema": SCHEMA,
            "name": a.name, "preset": a.preset, "command": command_line(),
            "device": opts["device"], "model": dict(opts["spec"]),
            "settings": {k: opts[k] for k in (
                "warmup", "steps", "memory_steps", "interleave", "memory_jobs", "seed",
                "device_budget_bytes", "deterministic", "nvme_dir", "min_offload_bytes",
                "tiermem_cpu_budget", "mixed_min_bytes", "max_step_seconds", "time_limit",
                "ceiling_bytes", "ceiling_chunk", "io_threads", "repeat_baseline",
                "malloc_mmap_threshold")},
            "configs_requested": requested, "configs": {}, "notes": [], "phases": {}})
        from ..models_bench import CONFIGS, ModelSpec, build_model, mixed_threshold
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
            res["notes"].append(f"parameter count unavailable: {err_text(e)}")
        if "tiermem_mixed" in requested:
            res["settings"]["mixed_policy_min_bytes"] = mixed_threshold(spec, opts)
        for c in requested:
            res["configs"][c] = {"description": CONFIGS[c].description if c in CONFIGS else None,
                                 "family": CONFIGS[c].family if c in CONFIGS else None,
                                 "status": "pending"}

        # 0. the C++ engine: NOTE [The engine is built before the clock]
        if not a.no_build:
            self._build(res, prog)

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
        self._fit_interleaving(res, runnable)
        opts = self.opts
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
                    res["interleaved"]["baseline_repeat"] = repeat_check(
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

        def launch(c, shared=False):
            rem = self.remaining()
            if rem < 10:
                return {"status": "skipped", "reason": "suite time limit reached"}
            left = max(1, len([x for x in iso_cfgs if res["configs"][x].get("isolated") is None]))
            at_once = opts["memory_jobs"] if shared else 1   # solo runs go one by one
            cap = max(30.0, rem / max(1.0, left / max(1, at_once)) * 1.5)
            extra = {"timeline": c in timeline}
            if shared and opts["memory_jobs"] > 1:
                extra["shared_device"] = True   # NOTE [Timings of runs that shared the machine]
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
                futs = {ex.submit(launch, c, True): c for c in pool}
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
