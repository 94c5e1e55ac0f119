"""Helpers shared by the benchmark drivers: machine description, timing, JSON output.

Benchmarks are scripts (``python benchmarks/bench_*.py``), never collected by
pytest; this module is imported from the script's own directory.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from typing import Iterable

import psutil
import torch

__all__ = ["machine", "summarize", "emit", "pick_device", "sync", "max_rss_bytes",
           "reset_peak_rss", "vm_hwm_bytes"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "tiermem"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    # tiermem_dirty: tracked files under tiermem/ differ from the commit.
    return {"commit": head or None, "tiermem_dirty": bool(dirty)}


def machine() -> dict:
    """What the figures were measured on."""
    import tiermem

    vm = psutil.virtual_memory()
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_bytes": vm.total,
        "ram_available_bytes": vm.available,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "tiermem": tiermem.__version__,
        "cuda_device": None,
        # Other processes compete for the cores: compare with load_average_end.
        "load_average_1_5_15min": list(os.getloadavg()),
        # Settings that change the figures (tiermem's, glibc malloc's, threads).
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(("TIERMEM_", "MALLOC_", "OMP_", "MKL_"))},
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["cuda_device"] = {"name": p.name, "memory_bytes": p.total_memory,
                               "count": torch.cuda.device_count()}
    info.update(_git_commit())
    return info


def summarize(values: Iterable[float]) -> dict:
    """median/min/max/mean/n of a sample."""
    v = list(values)
    return {"median": statistics.median(v), "min": min(v), "max": max(v),
            "mean": statistics.fmean(v), "n": len(v)}


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmark: --device cuda, but torch.cuda.is_available() is False")
    return torch.device(choice)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def emit(result: dict, out: str | None) -> None:
    """Print ``result`` as JSON on stdout and write it to ``out`` if given."""
    text = json.dumps(result, indent=2, sort_keys=False)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter of this process (Linux >= 4.0:
    write 5 to /proc/self/clear_refs); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def vm_hwm_bytes():
    """Peak RSS of this process since start or the last :func:`reset_peak_rss`
    (VmHWM), or None where /proc is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
