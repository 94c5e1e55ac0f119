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

__all__ = ["machine", "mount_of", "summarize", "emit", "pick_device", "sync", "max_rss_bytes",
           "rss_bytes", "reset_peak_rss", "vm_hwm_bytes", "add_gpt_args", "gpt_config"]


def add_gpt_args(ap, *, batch: int = 4) -> None:
    """The TinyGPT shape options the CPU benchmarks share: ``--layers`` (4),
    ``--width`` (256, 4 heads), ``--seq-len`` (256), ``--batch`` (``batch``) and
    ``--dropout`` (GPTConfig's unless given)."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--dropout", type=float, default=None,
                    help="the model's dropout (default: GPTConfig's, 0.1); 0 lets attention "
                         "run as one fused op on the CPU, as flash attention does on CUDA")


def gpt_config(args, vocab: int = 2048):
    """The ``GPTConfig`` of :func:`add_gpt_args`' options."""
    from tiermem.models import GPTConfig
    extra = {} if args.dropout is None else {"dropout": args.dropout}
    return GPTConfig(vocab=vocab, layers=args.layers, width=args.width, heads=4,
                     seq_len=args.seq_len, **extra)


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
    """The commit measured: ``TIERMEM_BENCH_COMMIT`` when set (a copied working
    tree, as on a lent GPU machine, keeps a stale HEAD: its dirtiness is then
    unknown, ``None``), else the checkout's HEAD and whether tiermem/ differs."""
    given = os.environ.get("TIERMEM_BENCH_COMMIT", "").strip()
    if given:
        return {"commit": given, "tiermem_dirty": None}
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


def mount_of(path: str) -> dict:
    """Filesystem type, device and mount point holding ``path`` (/proc/mounts),
    and for a block device its disk's model and rotational flag (/sys/block)
    and the filesystem's size and free bytes; {} where /proc is not available."""
    path = os.path.realpath(path)
    best = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                dev, mnt, fs = parts[0], parts[1].replace("\\040", " "), parts[2]
                if path == mnt or path.startswith(mnt.rstrip("/") + "/") or mnt == "/":
                    if best is None or len(mnt) > len(best[1]):
                        best = (dev, mnt, fs)
    except OSError:
        return {}
    if best is None:
        return {}
    dev, mnt, fs = best
    info = {"device": dev, "mount_point": mnt, "fs_type": fs}
    name = os.path.basename(os.path.realpath(dev)) if dev.startswith("/dev/") else None
    if name:
        block = name
        # Partition -> its disk (nvme0n1p2 -> nvme0n1, sda1 -> sda).
        if not os.path.exists(f"/sys/block/{block}"):
            for cand in os.listdir("/sys/block") if os.path.isdir("/sys/block") else []:
                if os.path.exists(f"/sys/block/{cand}/{name}"):
                    block = cand
                    break
        for key, rel in (("model", "device/model"), ("rotational", "queue/rotational")):
            try:
                with open(f"/sys/block/{block}/{rel}") as f:
                    info[key] = f.read().strip()
            except OSError:
                pass
        info["block_device"] = block
    try:
        du = psutil.disk_usage(path)
        info["size_bytes"], info["free_bytes"] = du.total, du.free
    except Exception:
        pass
    return info


def summarize(values: Iterable[float], *, mean: bool = True) -> dict:
    """median/min/max/mean/n of a sample (``mean=False``: median/min/max/n, the
    side-by-side suite's record)."""
    v = list(values)
    out = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    if mean:
        out["mean"] = statistics.fmean(v)
    out["n"] = len(v)
    return out


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmark: --device cuda, but torch.cuda.is_available() is False")
    return torch.device(choice)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process now (/proc/self/statm, one small read:
    cheap enough for a sampler thread; psutil where /proc is not available)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return psutil.Process().memory_info().rss


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
