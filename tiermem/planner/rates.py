"""Transfer and compute rates the planner prices moves with, measured on this
machine and cached per process.

- ``host_copy``: a memcpy of :data:`PROBE_BYTES` between two host tensors
  (``Tensor.copy_``, what the cpu tier's copier runs for CPU tensors).
- ``d2h`` / ``h2d``: on CUDA, a pinned copy each way (the cpu tier's copies).
- ``disk_write`` / ``disk_read``: when an nvme store exists, a write and a read
  of :data:`PROBE_BYTES` through its I/O engine, in its private directory
  (O_DIRECT where the engine uses it), file removed after.
- ``pointwise``: bytes per second of ``torch.sin`` over a host tensor, the
  fallback price of a recompute whose regeneration was not timed.

Each figure is the best of :data:`REPEATS` runs (the machine is shared: the
best run is the least disturbed one). The whole measurement stays well under
half a second. All rates are bytes per second; ``None`` when not measurable
here (no GPU, no nvme store).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

__all__ = ["Rates", "measure_rates", "PROBE_BYTES", "REPEATS", "default_device_budget_bytes",
           "HEADROOM_FRACTION"]

PROBE_BYTES = 4 << 20
REPEATS = 3
#: Share of the device's total memory a default device budget leaves free.
HEADROOM_FRACTION = 0.10

_cache: dict = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Rates:
    """Measured rates in bytes per second (see the module docstring)."""

    host_copy: float
    pointwise: float
    d2h: Optional[float] = None
    h2d: Optional[float] = None
    disk_write: Optional[float] = None
    disk_read: Optional[float] = None
    disk_engine: Optional[str] = None
    #: Seconds of one 4 KiB write / read through the engine (per-request cost).
    disk_write_latency_s: float = 0.0
    disk_read_latency_s: float = 0.0
    measured_seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    def scaled(self, factor: float) -> "Rates":
        """The copy and disk rates times ``factor`` (the closed loop's
        correction when measured stalls exceed the prediction)."""
        f = lambda x: None if x is None else x * factor   # noqa: E731
        return Rates(self.host_copy * factor, self.pointwise, f(self.d2h), f(self.h2d),
                     f(self.disk_write), f(self.disk_read), self.disk_engine,
                     self.disk_write_latency_s / factor, self.disk_read_latency_s / factor,
                     self.measured_seconds)


def _best(fn, repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _host_rates() -> tuple:
    n = PROBE_BYTES // 4
    # Never the global generator: rates are measured when a step starts,
    # after the user seeded it for that step (dropout would draw other masks).
    src = torch.linspace(-3.0, 3.0, n)
    dst = torch.empty(n)
    copy = _best(lambda: dst.copy_(src))
    sin = _best(lambda: torch.sin(src, out=dst))
    return PROBE_BYTES / copy, PROBE_BYTES / sin


def _cuda_rates() -> tuple:
    n = PROBE_BYTES // 4
    dev = torch.empty(n, device="cuda")
    host = torch.empty(n, pin_memory=True)

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    d2h()
    return PROBE_BYTES / _best(d2h), PROBE_BYTES / _best(h2d)


def _disk_rates(nvme_store) -> tuple:
    from ..io.base import aligned_empty
    engine = nvme_store.engine
    path = os.path.join(os.path.dirname(nvme_store.path), f"rate-probe-{os.getpid()}.bin")
    buf = aligned_empty(PROBE_BYTES)
    buf.view(torch.uint8).fill_(7)
    f = engine.open(path, PROBE_BYTES)
    small = buf[:4096 // buf.element_size()]
    try:
        write = _best(lambda: f.write(buf, 0).wait())
        read = _best(lambda: f.read(buf, 0).wait())
        write_lat = _best(lambda: f.write(small, 0).wait())
        read_lat = _best(lambda: f.read(small, 0).wait())
    finally:
        f.close()
        try:
            os.unlink(path)
        except OSError:
            pass
    return PROBE_BYTES / write, PROBE_BYTES / read, engine.name, write_lat, read_lat


def measure_rates(nvme_store=None, cuda: bool = False) -> Rates:
    """The rates of this process (measured once per (cuda, nvme directory) and
    cached). ``nvme_store``: the nvme tier's store, if any (its engine and
    directory are probed)."""
    key = (cuda, None if nvme_store is None else os.path.dirname(nvme_store.path))
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        host_copy, pointwise = _host_rates()
        d2h = h2d = None
        if cuda and torch.cuda.is_available():
            d2h, h2d = _cuda_rates()
        disk = (None, None, None, 0.0, 0.0)
        if nvme_store is not None:
            try:
                disk = _disk_rates(nvme_store)
            except OSError:   # the tier will report its own errors; price it as absent
                pass
        rates = Rates(host_copy, pointwise, d2h, h2d, *disk, time.perf_counter() - t0)
        _cache[key] = rates
        return rates


def default_device_budget_bytes(device_type: str, free_bytes: Optional[int] = None,
                                total_bytes: Optional[int] = None) -> int:
    """The device budget when ``device_budget`` is unset: the device's free
    memory now less :data:`HEADROOM_FRACTION` of its total (CUDA:
    ``torch.cuda.mem_get_info``; CPU: available RAM). ``free_bytes`` /
    ``total_bytes`` override the measurement (tests). Measured when a plan is
    made, after the profiled step's backward freed its tensors."""
    if free_bytes is None or total_bytes is None:
        if device_type == "cuda":
            free, total = torch.cuda.mem_get_info()
        else:
            import psutil
            vm = psutil.virtual_memory()
            free, total = vm.available, vm.total
        free_bytes = free if free_bytes is None else free_bytes
        total_bytes = total if total_bytes is None else total_bytes
    return max(0, int(free_bytes - HEADROOM_FRACTION * total_bytes))
