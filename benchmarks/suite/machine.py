"""What the suite measures on (run by the probe child): the machine description
(extending :func:`benchmarks.common.machine`: GPU details, nvidia-smi, the NVMe
dir's disk) and the ceilings of the links the configurations use: host memcpy,
pinned CUDA D2H/H2D alone and both at once, and the NVMe dir's write/read
bandwidth through tiermem's I/O engine."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Optional

from ..common import machine, mount_of
from .util import fmt_bytes


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
