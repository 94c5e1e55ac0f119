"""Cost of producer tracking (the recompute tier's TorchDispatchMode) in forward.

Times the forward pass of TinyGPT with no dispatch mode, with a dispatch mode
that does nothing (the floor of any ``TorchDispatchMode``-based tool, such as
selective checkpointing), and with tiermem's :class:`~tiermem.producers.ProducerMode`;
round-robin, warm-up discarded, medians. JSON out.

    python benchmarks/bench_tracking.py --out benchmarks/results/<date>-cpu-tracking.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, machine, pick_device, summarize, sync  # noqa: E402

from tiermem.models import GPTConfig, TinyGPT  # noqa: E402
from tiermem.producers import ProducerMode  # noqa: E402


class NoopMode(TorchDispatchMode):
    """Runs every op unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class CountMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    dev = pick_device(a.device)
    torch.manual_seed(0)
    cfg = GPTConfig(layers=a.layers, width=a.width, heads=4, seq_len=a.seq_len, vocab=2048)
    model = TinyGPT(cfg).to(dev)
    x = torch.randint(0, cfg.vocab, (a.batch, a.seq_len), device=dev)
    counter = CountMode()
    with counter:
        model(x, x)
    modes = {"none": None, "noop_mode": NoopMode, "producer_mode": ProducerMode}
    times = {k: [] for k in modes}
    for r in range(a.warmup + a.rounds):
        for name, mode in modes.items():
            sync(dev)
            t0 = time.perf_counter()
            if mode is None:
                loss = model(x, x)
            else:
                with mode():
                    loss = model(x, x)
            sync(dev)
            if r >= a.warmup:
                times[name].append(time.perf_counter() - t0)
            del loss
    res = {"benchmark": "producer tracking cost in forward", "machine": machine(),
           "model": {"layers": a.layers, "width": a.width, "seq_len": a.seq_len,
                     "batch": a.batch}, "device": str(dev), "ops_per_forward": counter.n,
           "forward_seconds": {k: summarize(v) for k, v in times.items()}}
    base = res["forward_seconds"]["none"]["median"]
    res["overhead_per_op_us"] = {
        k: (res["forward_seconds"][k]["median"] - base) / counter.n * 1e6
        for k in ("noop_mode", "producer_mode")}
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
