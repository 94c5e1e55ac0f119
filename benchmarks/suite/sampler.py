"""The one-step memory timeline of an isolated run: a sampler thread reading
device allocator bytes, process RSS and live malloc bytes every ~0.5-2 ms while
one training step runs, with the step's phase boundaries."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Optional

from ..common import rss_bytes
from .util import err_text


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
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


def timeline_step(runner, batch, seed: int, device) -> dict:
    """One more training step of ``runner`` with the sampler running: bytes over
    time, the time axis starting at the forward."""
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
        return {"error": err_text(e)}
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
