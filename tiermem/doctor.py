"""``python -m tiermem doctor``: what tiermem will use on this machine, and how fast.

Reports the settings in effect, the I/O engine and why, RAM and the default
cpu budget, pinned memory (with a GPU), the GPU, and for the NVMe directory
(``--dir`` or ``TIERMEM_NVME_DIR``): free space, whether O_DIRECT works, and
write/read bandwidth measured with the engine (``--mib`` MiB in 16 MiB writes,
then read back; the file is removed). ``--json`` prints a JSON object instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import secrets
import shutil
import tempfile
import time

import psutil
import torch

from ._version import __version__
from .config import Config
from .errors import ConfigError
from .memory.ranks import local_world_size, rank_label
from .runtime.placement import default_cpu_budget_bytes, default_nvme_budget_bytes
from .runtime.placement import default_staging_bytes
from .telemetry import format_bytes

__all__ = ["add_arguments", "run", "diagnose"]

_CHUNK_BYTES = 16 << 20


def _positive_mib(text: str) -> int:
    """``--mib``: a whole number of MiB, at least 1 (argparse reports the error)."""
    try:
        mib = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB") from None
    if mib < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the bandwidth test needs at least 1 MiB")
    return mib


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None,
                   help="NVMe directory to check (default: TIERMEM_NVME_DIR); a missing one "
                   "is created for the check and removed again")
    p.add_argument("--mib", type=_positive_mib, default=256, metavar="MIB",
                   help="MiB to write and read back for the bandwidth, at least 1 (default: 256)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _gpu() -> dict:
    if not torch.cuda.is_available():
        return {"available": False, "torch_cuda": torch.version.cuda}
    props = torch.cuda.get_device_properties(0)
    out = {"available": True, "torch_cuda": torch.version.cuda, "count": torch.cuda.device_count(),
           "name": props.name, "memory_bytes": props.total_memory}
    try:
        torch.zeros(1, device="cuda")   # the CUDA context first: not part of the timing
        t0 = time.perf_counter()
        buf = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
        out["pinned_64MiB_alloc_ms"] = (time.perf_counter() - t0) * 1e3
        del buf
    except RuntimeError as e:
        out["pinned_error"] = str(e)
    return out


def _o_direct(path: str) -> str:
    """Whether files under ``path`` take O_DIRECT, probed as the engines do:
    set it on a new file and write one aligned block (some filesystems accept
    the flag at open and refuse the I/O)."""
    from .io.pyengine import _enable_direct
    if not hasattr(os, "O_DIRECT"):
        return "no (this platform has no O_DIRECT)"
    probe = os.path.join(path, f".tiermem-probe-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        return f"unknown (cannot create a file: {e.strerror})"
    try:
        return "yes" if _enable_direct(fd) else "no (an aligned O_DIRECT write was refused)"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _bandwidth(path: str, engine_kind: str, threads: int, mib: int) -> dict:
    from .io import aligned_empty, get_engine
    engine = get_engine(engine_kind, threads)
    work = tempfile.mkdtemp(prefix=".tiermem-doctor-", dir=path)
    try:
        f = engine.open(os.path.join(work, "bench.bin"), 0)
        total = mib << 20
        f.resize(total)
        buf = aligned_empty(_CHUNK_BYTES)
        buf.random_(0, 256)
        offsets = range(0, total, _CHUNK_BYTES)
        t0 = time.perf_counter()
        for fut in [f.write(buf, off) for off in offsets]:
            fut.wait()
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        bufs = [aligned_empty(_CHUNK_BYTES) for _ in range(4)]
        for i in range(0, len(offsets), 4):
            futs = [f.read(bufs[j], off) for j, off in enumerate(offsets[i:i + 4])]
            for fut in futs:
                fut.wait()
        read_s = time.perf_counter() - t0
        direct = f.direct
        f.close()
        return {"engine": engine.name, "direct": direct, "bytes": total,
                "write_GBps": total / write_s / 1e9, "read_GBps": total / read_s / 1e9}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def diagnose(nvme_dir=None, mib: int = 256) -> dict:
    """Everything ``doctor`` reports, as a dict. The NVMe directory's missing
    parts, if any, are created for the check and removed afterwards."""
    if isinstance(mib, bool) or not isinstance(mib, int) or mib < 1:
        raise ConfigError(f"tiermem: doctor mib={mib!r} must be a whole number of MiB, at least 1")
    cfg = Config.from_env()
    report = {
        "tiermem": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "settings": {f.name: (getattr(cfg, f.name) if not callable(getattr(cfg, f.name))
                              else repr(getattr(cfg, f.name)))
                     for f in dataclasses.fields(cfg)},
        "ram_bytes": psutil.virtual_memory().total,
        "ram_available_bytes": psutil.virtual_memory().available,
        "gpu": _gpu(),
    }
    report["rank"] = {"label": rank_label(), "rank": os.environ.get("RANK"),
                      "local_rank": os.environ.get("LOCAL_RANK"),
                      "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
                      "world_size": os.environ.get("WORLD_SIZE"),
                      "agree_ranks": cfg.agree_ranks}
    try:
        report["rank"]["ranks_on_node"] = local_world_size()
        report["default_cpu_budget_bytes"] = default_cpu_budget_bytes()
        report["default_staging_bytes"] = default_staging_bytes(cfg.prefetch_bytes)
    except ConfigError as e:   # reported, not raised: doctor must always finish
        report["rank"]["error"] = str(e)
    from .io import engine_info
    from .planner.rates import measure_rates
    # Host and (CUDA) link rates the auto planner prices moves with; the disk's
    # are measured by the planner in its own directory (and below, by doctor).
    report["planner_rates"] = measure_rates(cuda=torch.cuda.is_available()).as_dict()
    report["engine"] = engine_info(cfg.engine)   # the engine this configuration uses
    path = nvme_dir or cfg.nvme_dir
    if path:
        report["nvme"] = _check_dir(path, "--dir" if nvme_dir else "TIERMEM_NVME_DIR", cfg, mib)
    return report


def _check_dir(path: str, setting: str, cfg: Config, mib: int) -> dict:
    nv = {"dir": path}
    created = _missing_parts(os.path.abspath(path))
    try:
        from .memory.spilldir import check_nvme_dir
        check_nvme_dir(path, setting)
        nv["free_bytes"] = psutil.disk_usage(path).free
        nv["default_nvme_budget_bytes"] = default_nvme_budget_bytes(path)
        nv["o_direct"] = _o_direct(path)
        nv["bandwidth"] = _bandwidth(path, cfg.engine, cfg.io_threads, mib)
    except Exception as e:  # reported, not raised: doctor must always finish
        nv["error"] = f"{type(e).__name__}: {e}"
    finally:
        for d in reversed(created):   # deepest first; only what was missing, only if empty
            with contextlib.suppress(OSError):
                os.rmdir(d)
    nv["created_and_removed"] = bool(created) and not os.path.lexists(created[0])
    return nv


def _missing_parts(path: str) -> list:
    """The directories ``mkdir -p path`` would create, outermost first."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing[::-1]


def _print(r: dict) -> None:
    print(f"tiermem {r['tiermem']} | torch {r['torch']} | Python {r['python']}")
    rk = r["rank"]
    if "error" in rk:
        print(f"distributed: {rk['error']}")
    elif rk["label"]:
        print(f"distributed: {rk['label']}, {rk['ranks_on_node']} rank(s) on this node "
              "(LOCAL_WORLD_SIZE): default budgets below are this rank's share, explicit "
              "ones are per rank")
        world = rk.get("world_size") or "all"
        print("  policy auto: " + (
            f"every rank plans from the smallest budgets and slowest rates of {world} ranks, "
            "agreed once at each auto Offloader's second step (TIERMEM_AGREE_RANKS=1; the "
            "agreed numbers: the log line 'auto: planned from numbers agreed by N ranks' and "
            "off.plan's notes)" if rk.get("agree_ranks")
            else "each rank plans from its own budgets and rates (TIERMEM_AGREE_RANKS=0)"))
    else:
        print("distributed: no rank set (RANK/LOCAL_RANK): budgets below are this process's")
    set_ = {k: v for k, v in r["settings"].items() if v is not None}
    print("settings in effect: " + ", ".join(f"{k}={v}" for k, v in set_.items()))
    e = r["engine"]
    print(f"I/O engine: {e['engine']} ({e['reason'].splitlines()[0]})")
    line = (f"RAM: {format_bytes(r['ram_bytes'])} total, "
            f"{format_bytes(r['ram_available_bytes'])} available")
    if "default_cpu_budget_bytes" in r:
        line += (f"; default cpu budget {format_bytes(r['default_cpu_budget_bytes'])}, "
                 f"nvme staging {format_bytes(r['default_staging_bytes'])}")
    print(line)
    pr = r["planner_rates"]
    line = (f"planner rates (policy auto): host copy {pr['host_copy'] / 1e9:.2f} GB/s, "
            f"pointwise {pr['pointwise'] / 1e9:.2f} GB/s")
    if pr["d2h"]:
        line += f", D2H {pr['d2h'] / 1e9:.2f} GB/s, H2D {pr['h2d'] / 1e9:.2f} GB/s"
    if pr.get("link_both"):
        line += f", each way while both run {pr['link_both'] / 1e9:.2f} GB/s"
    if pr.get("track_op_s"):
        line += f", producer tracking {pr['track_op_s'] * 1e6:.1f} us per op"
        if pr.get("track_call_s"):
            line += f" ({pr['track_call_s'] * 1e6:.1f} us per call recorded whole)"
    print(line + f" (measured in {pr['measured_seconds'] * 1e3:.0f} ms)")
    g = r["gpu"]
    if g["available"]:
        line = f"GPU: {g['count']} x {g['name']}, {format_bytes(g['memory_bytes'])}"
        if "pinned_64MiB_alloc_ms" in g:
            line += f"; pinning 64 MiB took {g['pinned_64MiB_alloc_ms']:.1f} ms"
        print(line + (f"; pinned memory FAILED: {g['pinned_error']}" if "pinned_error" in g else ""))
    else:
        print(f"GPU: none (torch built with CUDA {g['torch_cuda']})")
    nv = r.get("nvme")
    if nv is None:
        print("NVMe dir: not set (TIERMEM_NVME_DIR or --dir)")
        return
    if "error" in nv:
        print(f"NVMe dir {nv['dir']}: {nv['error']}")
        return
    b = nv["bandwidth"]
    made = " (created for this check, then removed)" if nv["created_and_removed"] else ""
    print(f"NVMe dir {nv['dir']}{made}: {format_bytes(nv['free_bytes'])} free, default budget "
          f"{format_bytes(nv['default_nvme_budget_bytes'])}, O_DIRECT {nv['o_direct']}")
    print(f"  {b['engine']} engine ({'direct' if b['direct'] else 'buffered'}), "
          f"{format_bytes(b['bytes'])}: write {b['write_GBps']:.2f} GB/s, "
          f"read {b['read_GBps']:.2f} GB/s (read may come from the page cache when buffered)")


def run(args: argparse.Namespace) -> int:
    report = diagnose(args.dir, args.mib)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print(report)
    return 1 if "error" in report.get("nvme", {}) else 0
