"""Per-saved-tensor overhead of tiermem's pack + unpack, against plain autograd.

Method: a chain of ``n`` ``torch.sin`` ops, each of which saves exactly one
tensor (its input) of ``size`` bytes; forward + ``sum().backward()`` is timed
under each configuration:

- ``plain``: no hooks (the baseline),
- ``identity_hooks``: ``saved_tensors_hooks(lambda t: t, lambda t: t)``, i.e.
  what PyTorch's hook mechanism alone costs (a floor for any hook-based tool),
- ``keep``: ``Offloader(policy="keep", min_offload_bytes=0)``,
- ``cpu``: ``Offloader(policy="cpu", min_offload_bytes=0)`` (every tensor is
  copied to a host buffer and restored in backward; on a CPU-only machine the
  "device" is the host, so the copies are host-to-host memcpys on tiermem's
  worker threads),
- ``auto``: ``Offloader(policy="auto", device_budget="100%")``: after its first
  (profiled, discarded as warmup) step, a plan that keeps everything, followed
  by a lookup per tensor (NOTE [Following a plan] in tiermem/planner/runtime.py),
- ``callable_keep``: a callable policy answering keep (the TensorInfo path).

Configurations are run round-robin (one repeat of each, then the next), the
first ``--warmup`` rounds are discarded, and the figure reported per
configuration is ``(median(config) - median(plain)) / saved_tensors`` in
microseconds, for the forward (pack), the backward (unpack) and the total. The
number of saved tensors is taken from ``off.stats`` and checked against ``n``.

``--configs keep,auto`` runs only those (and ``plain``). ``--clock thread``
times with ``time.thread_time()``, the CPU time of the benchmark's thread,
instead of the wall clock: on a machine shared with other processes their
time slices are not counted (CPU device only: backward runs on the calling
thread there); host work done by tiermem's worker threads is not counted
either, so it suits the hook-only configurations (keep, auto, callable_keep).

Run: ``python benchmarks/bench_overhead.py [--out results.json]``. Prints JSON.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

import tiermem
from common import emit, machine, pick_device, summarize, sync

CONFIGS = ("plain", "identity_hooks", "keep", "cpu", "auto", "callable_keep")


class _Identity(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self) -> None:
        super().__init__(lambda t: t, lambda t: t)


def _chain(x0: torch.Tensor, n: int) -> torch.Tensor:
    x = x0 * 1.0  # a non-leaf start: sin(leaf) would save a leaf, which tiermem never moves
    for _ in range(n):
        x = torch.sin(x)
    return x.sum()


_clock = time.perf_counter


def _run_once(ctx, x0: torch.Tensor, n: int, device: torch.device) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one chain under ``ctx`` (or none)."""
    x0.grad = None
    gc.collect()
    sync(device)
    t0 = _clock()
    if ctx is None:
        loss = _chain(x0, n)
    else:
        with ctx:
            loss = _chain(x0, n)
    sync(device)
    t1 = _clock()
    loss.backward()
    sync(device)
    t2 = _clock()
    return t1 - t0, t2 - t1


def bench_size(size_bytes: int, n: int, repeats: int, warmup: int,
               device: torch.device, configs: tuple = CONFIGS) -> dict:
    numel = size_bytes // 4
    x0 = torch.randn(numel, device=device, requires_grad=True)
    makers = {
        "plain": lambda: None,
        "identity_hooks": _Identity,
        "keep": lambda: tiermem.Offloader(policy="keep", min_offload_bytes=0),
        "cpu": lambda: tiermem.Offloader(policy="cpu", min_offload_bytes=0),
        "auto": lambda: tiermem.Offloader(policy="auto", min_offload_bytes=0,
                                          device_budget="100%"),
        "callable_keep": lambda: tiermem.Offloader(policy=lambda info: "keep",
                                                   min_offload_bytes=0),
    }
    ctxs = {c: makers[c]() for c in configs}
    if warmup < 2:
        raise ValueError("bench_overhead: --warmup must be at least 2 (auto profiles its first step)")
    fwd = {c: [] for c in configs}
    bwd = {c: [] for c in configs}
    saved = {}
    grads = {}
    for r in range(warmup + repeats):
        for c in configs:
            f, b = _run_once(ctxs[c], x0, n, device)
            if r >= warmup:
                fwd[c].append(f)
                bwd[c].append(b)
            if r == 0:
                grads[c] = x0.grad.clone()
            ctx = ctxs[c]
            if isinstance(ctx, tiermem.Offloader):
                st = ctx.stats
                saved[c] = {"count_by_tier": {k: v for k, v in st.count_by_tier.items() if v},
                            "dedup_hits": st.dedup_hits, "param_count": st.param_count,
                            "prefetch_hits": st.prefetch_hits,
                            "prefetch_misses": st.prefetch_misses,
                            "stall_seconds": st.stall_seconds}
    for c in configs:
        if not isinstance(ctxs[c], tiermem.Offloader):
            continue
        ctxs[c].close()
        count = sum(saved[c]["count_by_tier"].values())
        if count != n:
            raise RuntimeError(f"bench_overhead: {c} saved {count} tensors, expected {n}")

    base_f = summarize(fwd["plain"])["median"]
    base_b = summarize(bwd["plain"])["median"]
    out = {"size_bytes": size_bytes, "numel": numel, "dtype": "float32",
           "saved_tensors_per_run": n, "repeats": repeats, "warmup_discarded": warmup,
           "grads_equal_plain": {c: bool(torch.equal(grads[c], grads["plain"])) for c in configs},
           "configs": {}}
    for c in configs:
        sf, sb = summarize(fwd[c]), summarize(bwd[c])
        tot = summarize([a + b for a, b in zip(fwd[c], bwd[c])])
        entry = {"forward_s": sf, "backward_s": sb, "total_s": tot}
        if c != "plain":
            entry["overhead_us_per_saved_tensor"] = {
                "pack_forward": (sf["median"] - base_f) / n * 1e6,
                "unpack_backward": (sb["median"] - base_b) / n * 1e6,
                "total": (sf["median"] + sb["median"] - base_f - base_b) / n * 1e6,
            }
            # The same from the fastest runs: less sensitive to other processes.
            entry["overhead_us_per_saved_tensor_from_min"] = {
                "pack_forward": (sf["min"] - min(fwd["plain"])) / n * 1e6,
                "unpack_backward": (sb["min"] - min(bwd["plain"])) / n * 1e6,
            }
        if c in saved:
            entry["stats_last_run"] = saved[c]
        out["configs"][c] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4096,1048576",
                   help="saved tensor sizes in bytes, comma-separated (default: 4 KiB, 1 MiB)")
    p.add_argument("--n", default="2000,200",
                   help="saved tensors per run for each size (default: 2000,200)")
    p.add_argument("--repeats", type=int, default=25, help="measured rounds (default: 25)")
    p.add_argument("--warmup", type=int, default=3, help="discarded rounds (default: 3)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--configs", default=",".join(CONFIGS[1:]),
                   help="configurations besides plain, comma-separated (default: all)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="wall clock, or the benchmark thread's CPU time (CPU device only)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    configs = ("plain",) + tuple(c for c in args.configs.split(",") if c and c != "plain")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS[1:])}")
    sizes = [int(s) for s in args.sizes.split(",")]
    ns = [int(s) for s in args.n.split(",")]
    if len(ns) != len(sizes):
        p.error("--n needs one count per size")
    device = pick_device(args.device)
    if args.clock == "thread":
        if device.type != "cpu":
            p.error(f"--clock thread: CPU device only (the device is {device})")
        global _clock
        _clock = time.thread_time
    torch.manual_seed(0)
    mach = machine()  # before the runs, so the commit recorded is the one measured
    t0 = time.perf_counter()
    results = [bench_size(s, n, args.repeats, args.warmup, device, configs)
               for s, n in zip(sizes, ns)]
    emit({"benchmark": "overhead", "device": str(device),
          "method": "chain of torch.sin ops, one saved tensor each; "
                    "(median(config) - median(plain)) / saved tensors; configs round-robin",
          "clock": "time.thread_time" if args.clock == "thread" else "time.perf_counter",
          "machine": mach, "wall_seconds": time.perf_counter() - t0,
          "load_average_end": list(os.getloadavg()),
          "results": results}, args.out)


if __name__ == "__main__":
    main()
