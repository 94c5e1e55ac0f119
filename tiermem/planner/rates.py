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
- ``link_both`` / ``disk_both``: bytes per second *per direction* while both
  directions run at once (CUDA: a D2H and an H2D of :data:`PROBE_BYTES` on two
  streams; disk: a write and a read of :data:`PROBE_BYTES` through the engine,
  issued together). The planner slows a restore that overlaps moves out by
  ``single / both`` (NOTE [Planner cost model]).
- ``move_cpu``: on the host, bytes per CPU second of a round trip as the
  nvme tier makes it for a CPU tensor: the engine's write of the tensor as it
  is, and its read into a newly allocated page-aligned tensor, for
  :data:`MOVE_PROBE_BUFFERS` tensors of :data:`PROBE_BYTES`; CPU time of the
  whole process (``time.process_time``: engine and chain threads included).
  ``move_fixed_cpu_s``: the same for one 4 KiB round trip (the per-move cost).
  ``compute_threads``: ``torch.get_num_threads()``, the cores the compute
  spreads over. On a CPU device that CPU time is taken from the compute: the
  planner charges it to the step (NOTE [Planner cost model]).
- ``track_op_s``: seconds one aten op takes longer under producer tracking:
  a chain of :data:`TRACK_PROBE_LINKS` (linear, GELU, add) on 256 KiB
  tensors that require grad, run plainly and under a
  :class:`~tiermem.tracking.producers.ProducerMode` made as a scoped step makes it
  (the pointwise ops recorded, the linear not); the difference over the op
  count; measured once per process, on one intra-op thread and by its CPU
  clock (NOTE [A tracking price of 0]). What the planner prices a plan's
  tracking with (NOTE [Tracking priced] in planner/runtime.py). It grows
  with the tensors' size and varies between processes; an approximation of
  what tracking costs a real forward.
- ``track_call_s``: seconds one torch call recorded whole (NOTE [Calls
  recorded whole] in tracking/producers.py) adds: the same chain under a
  :class:`~tiermem.tracking.modules.CallGate` that records the GELU and the add whole
  and lets the linear pass (the gate's Python call for it is spread over
  the two), the difference over the calls recorded; measured with
  ``track_op_s``.

Each figure is the best of :data:`REPEATS` runs (the machine is shared: the
best run is the least disturbed one). The whole measurement stays under a
second (a few hundredths without an nvme store), once PyTorch has set up its
Python dispatch (the first dispatch mode of a process is slow to set up; the
planner measures after its profiled step did that). All rates are bytes per
second; ``None`` when not measurable here (no GPU, no nvme store).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

__all__ = ["Rates", "measure_rates", "PROBE_BYTES", "REPEATS", "default_device_budget_bytes",
           "HEADROOM_FRACTION", "MOVE_PROBE_BUFFERS", "TRACK_PROBE_LINKS"]

PROBE_BYTES = 4 << 20
#: Tensors of one ``move_cpu`` probe (module docstring).
MOVE_PROBE_BUFFERS = 2
REPEATS = 3
#: Links of the ``track_op_s`` probe's chain (three ops each).
TRACK_PROBE_LINKS = 16
#: At most this many times the tracking probe's runs (NOTE [A tracking price of 0]).
TRACK_PROBE_ATTEMPTS = 3
#: Share of the device's total memory a default device budget leaves free.
HEADROOM_FRACTION = 0.10

_cache: dict = {}
_track_cache: list = []   # (track_op_s, track_call_s), once per process
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
    #: Per direction while both directions run (bytes/s; None: not measured).
    link_both: Optional[float] = None
    disk_both: Optional[float] = None
    #: Host bytes moved per CPU second (nvme round trip of a CPU tensor).
    move_cpu: Optional[float] = None
    #: CPU seconds of one 4 KiB round trip (the per-move fixed cost).
    move_fixed_cpu_s: float = 0.0
    #: Threads the compute runs on (``torch.get_num_threads()``).
    compute_threads: float = 1.0
    #: Seconds producer tracking adds to one aten op (module docstring).
    track_op_s: float = 0.0
    #: Seconds recording one torch call whole adds (module docstring).
    track_call_s: float = 0.0
    #: Why the disk probe failed (``None``: it ran, or there is no nvme store):
    #: the error and the room it needed, e.g. ``"[Errno 28] No space left on
    #: device (8 MiB needed in /mnt/nvme/tiermem-1)"``. Rates with one are not
    #: cached: the next call probes again.
    disk_probe_error: Optional[str] = None

    def as_dict(self) -> dict:
        return asdict(self)

    def scaled(self, factor: float) -> "Rates":
        """The copy and disk rates times ``factor`` (the closed loop's
        correction when measured stalls exceed the prediction)."""
        f = lambda x: None if x is None else x * factor   # noqa: E731
        return replace(self, host_copy=self.host_copy * factor, d2h=f(self.d2h),
                       h2d=f(self.h2d), disk_write=f(self.disk_write),
                       disk_read=f(self.disk_read),
                       disk_write_latency_s=self.disk_write_latency_s / factor,
                       disk_read_latency_s=self.disk_read_latency_s / factor,
                       link_both=f(self.link_both), disk_both=f(self.disk_both))


def _best(fn, repeats: int = REPEATS, clock=time.perf_counter) -> float:
    """Least ``clock`` seconds of ``fn`` over ``repeats`` runs (wall time by
    default; ``time.process_time`` for the process's CPU seconds, all threads)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
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


def _tracking_cost() -> tuple:
    """``(track_op_s, track_call_s)`` (module docstring): best of ``2 *
    REPEATS`` runs each way, interleaved. Host tensors only (no device is
    initialised), no generator drawn from.

    # NOTE [A tracking price of 0]
    # Tracking is never faster than not tracking, so a way's best time at or
    # below the plain chain's is a disturbed measurement (one lucky run on a
    # loaded machine), not a price; read as 0 it would make tracking free to
    # the planner. So the runs go on (up to TRACK_PROBE_ATTEMPTS times as many,
    # the bests taken over all of them) until both differences are positive.
    # The probe runs on one thread, timed by that thread's CPU clock
    # (``time.thread_time``: time descheduled, the main way a busy machine
    # disturbs a run, is not counted; with one intra-op thread every kernel
    # runs on it). A call price still not positive reads the op price (a call
    # recorded whole costs about what the mode costs its op: rough, but never
    # free); an op price still not positive reads 0.
    """
    if _track_cache:
        return _track_cache[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _track_cache.append(_tracking_probe())
    finally:
        torch.set_num_threads(threads)
    return _track_cache[0]


def _tracking_probe() -> tuple:
    """The runs of :func:`_tracking_cost` (one thread set by the caller)."""
    from ..tracking.producers import ProducerMode
    from ..tracking.modules import CallGate
    x = torch.linspace(-1.0, 1.0, 256 * 256).view(256, 256).requires_grad_()
    w = (torch.linspace(-0.05, 0.05, 256 * 256).view(256, 256)).requires_grad_()
    gelu, linear = torch.nn.functional.gelu, torch.nn.functional.linear

    def chain() -> None:
        y = x
        for _ in range(TRACK_PROBE_LINKS):
            y = y + gelu(linear(y, w))

    def tracked() -> None:
        mode = ProducerMode(names=False)
        with mode:
            chain()
        mode.clear()
    def gated() -> None:
        mode = ProducerMode(names=False)
        gate = CallGate(mode)
        gate.allowed = frozenset({"gelu", "add"})
        gate.direct = {"gelu": "gelu", "add": "add"}
        with gate:
            chain()
        mode.clear()
    plain = mode = whole = float("inf")
    chain()
    tracked()
    gated()
    clock = time.thread_time
    for _ in range(TRACK_PROBE_ATTEMPTS):   # NOTE [A tracking price of 0]
        for _ in range(2 * REPEATS):
            plain = min(plain, _best(chain, 1, clock))
            mode = min(mode, _best(tracked, 1, clock))
            whole = min(whole, _best(gated, 1, clock))
        if mode > plain and whole > plain:
            break
    op_s = max(0.0, mode - plain) / (3 * TRACK_PROBE_LINKS)
    call_s = (whole - plain) / (2 * TRACK_PROBE_LINKS) if whole > plain else op_s
    return op_s, call_s


def _cuda_rates(device: torch.device) -> tuple:
    with torch.cuda.device(device):   # streams, synchronize: that device's
        return _cuda_probe(device)


def _cuda_probe(device: torch.device) -> tuple:
    n = PROBE_BYTES // 4
    dev = torch.empty(n, device=device)
    host = torch.empty(n, pin_memory=True)

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    d2h()
    dev2 = torch.empty(n, device=device)
    host2 = torch.empty(n, pin_memory=True)
    out_stream, back_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def both():   # one copy each way, on two streams, at once
        with torch.cuda.stream(out_stream):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(back_stream):
            dev2.copy_(host2, non_blocking=True)
        torch.cuda.synchronize()
    return PROBE_BYTES / _best(d2h), PROBE_BYTES / _best(h2d), PROBE_BYTES / _best(both)


def _disk_rates(nvme_store) -> tuple:
    from ..io.base import aligned_empty
    engine = nvme_store.engine
    path = os.path.join(os.path.dirname(nvme_store.path), f"rate-probe-{os.getpid()}.bin")
    k = MOVE_PROBE_BUFFERS
    bufs = [aligned_empty(PROBE_BYTES) for _ in range(k)]
    buf, other = bufs[0], bufs[1]
    for b in bufs:
        b.view(torch.uint8).fill_(7)
    f = engine.open(path, k * PROBE_BYTES)
    small = buf[:4096 // buf.element_size()]
    try:
        write = _best(lambda: f.write(buf, 0).wait())
        read = _best(lambda: f.read(buf, 0).wait())
        write_lat = _best(lambda: f.write(small, 0).wait())
        read_lat = _best(lambda: f.read(small, 0).wait())

        srcs = [torch.full((PROBE_BYTES // 4,), 1.5) for _ in bufs]   # made by "compute"
        move_cpu = _best(lambda: _round_trip(f, srcs), clock=time.process_time)
        fixed = _best(lambda: _round_trip(f, [srcs[0][:1024]]), clock=time.process_time)

        def both():   # a write and a read of another (written) region, issued together
            w, r = f.write(buf, 0), f.read(other, PROBE_BYTES)
            w.wait()
            r.wait()
        both_s = _best(both)
    finally:
        f.close()
        try:
            os.unlink(path)
        except OSError:
            pass
    return (PROBE_BYTES / write, PROBE_BYTES / read, engine.name, write_lat, read_lat,
            PROBE_BYTES / both_s, k * PROBE_BYTES / move_cpu, fixed)


def _round_trip(f, srcs: list) -> None:
    """What the nvme tier's CPU path does for the float32 tensors ``srcs``: the
    engine writes each as it is (no staging copy: ``NvmeStore._reserve``
    stages CUDA tensors only), then reads it back into a newly allocated
    page-aligned tensor (``NvmeStore._start_restore``: no bounce copy)."""
    from ..io.base import aligned_empty
    nbytes = srcs[0].numel() * 4
    jobs = [f.write(src, i * nbytes) for i, src in enumerate(srcs)]
    for j in jobs:
        j.wait()
    dests = [aligned_empty(nbytes).view(torch.float32) for _ in srcs]
    jobs = [f.read(d, i * nbytes) for i, d in enumerate(dests)]
    for j in jobs:
        j.wait()


def measure_rates(nvme_store=None, cuda=False) -> Rates:
    """The rates of this process (measured once per (CUDA device, nvme
    directory) and cached; not when the disk probe failed, which is then
    named in ``Rates.disk_probe_error`` and run again at the next call). ``nvme_store``: the nvme tier's store, if any (its
    engine and directory are probed). ``cuda``: ``False``, else the CUDA
    device whose links to probe (``True``: the current one; a device or its
    name, ``"cuda:1"``: the device the model's tensors are on, which need not
    be the current one)."""
    device = _cuda_device(cuda)
    key = (None if device is None else str(device),
           None if nvme_store is None else os.path.dirname(nvme_store.path))
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        host_copy, pointwise = _host_rates()
        track_op_s, track_call_s = _tracking_cost()
        d2h = h2d = link_both = None
        if device is not None:
            d2h, h2d, link_both = _cuda_rates(device)
        disk = (None, None, None, 0.0, 0.0, None, None, 0.0)
        failed = None
        if nvme_store is not None:
            try:
                disk = _disk_rates(nvme_store)
            except (OSError, RuntimeError) as e:   # priced as absent, said in the plan
                failed = (f"{e} ({MOVE_PROBE_BUFFERS * PROBE_BYTES >> 20} MiB needed in "
                          f"{key[1]})")
        rates = Rates(host_copy, pointwise, d2h, h2d, *disk[:5], time.perf_counter() - t0,
                      link_both=link_both, disk_both=disk[5], move_cpu=disk[6],
                      move_fixed_cpu_s=disk[7],
                      compute_threads=float(max(1, torch.get_num_threads())),
                      track_op_s=track_op_s, track_call_s=track_call_s,
                      disk_probe_error=failed)
        if failed is None:
            _cache[key] = rates
        return rates


def _cuda_device(cuda) -> Optional[torch.device]:
    """The CUDA device ``cuda`` names (:func:`measure_rates`), ``None`` for
    ``False`` or where CUDA is not available."""
    if cuda is False or cuda is None or not torch.cuda.is_available():
        return None
    if cuda is True:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(cuda)
    if device.type != "cuda":
        return None
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def default_device_budget_bytes(device_type: str, free_bytes: Optional[int] = None,
                                total_bytes: Optional[int] = None, device=None) -> int:
    """The device budget when ``device_budget`` is unset: the device's free
    memory now less :data:`HEADROOM_FRACTION` of its total (CUDA:
    ``torch.cuda.mem_get_info`` of ``device``, the current one if ``None``;
    CPU: available RAM, or what the memory cgroup may still take if less:
    NOTE [Container memory limits] in memory/cgroup.py). ``free_bytes`` /
    ``total_bytes`` override the measurement (tests). Measured when a plan
    is made, after the profiled step's backward freed its tensors."""
    if free_bytes is None or total_bytes is None:
        if device_type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
        else:
            import psutil

            from ..memory.cgroup import available_memory_bytes
            free = available_memory_bytes()   # NOTE [Container memory limits]
            total = psutil.virtual_memory().total
        free_bytes = free if free_bytes is None else free_bytes
        total_bytes = total if total_bytes is None else total_bytes
    return max(0, int(free_bytes - HEADROOM_FRACTION * total_bytes))
