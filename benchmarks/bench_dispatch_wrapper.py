"""What hiding producer tracking's dispatch handler from Dynamo ourselves saves
(NOTE [The handler hidden from Dynamo] in tiermem/tracking/producers.py).

PyTorch wraps every dispatch mode's handler in ``torch._dynamo.disable``;
tiermem hides its handler with two C calls instead. This times the forward of
TinyGPT under ``policy="recompute"`` with each of the two wrappers around the
same handler, interleaved round by round, against the plain forward, and
reports medians and the paired difference per forward and per op.

    python benchmarks/bench_dispatch_wrapper.py [--device cuda] [--width 256]
        [--seq-len 128] [--rounds 30] [--out x.json]

On CUDA the forward is timed on the host (until it returns), after a
synchronisation: the host time is what tracking adds (docs/host-cost.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_gpt_args, emit, gpt_config, machine, pick_device, sync  # noqa: E402

import tiermem  # noqa: E402
import tiermem.tracking.producers as producers  # noqa: E402
from tiermem.models import TinyGPT  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpt_args(ap)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = pick_device(a.device)
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)
    cfg = gpt_config(a, vocab=512)
    torch.manual_seed(0)
    with dev:
        base = TinyGPT(cfg)
    x = torch.randint(0, cfg.vocab, (a.batch, cfg.seq_len), device=dev)

    producers.ProducerMode()   # hides the handler (the first mode made does)
    hidden = producers.ProducerMode.__dict__["__torch_dispatch__"]
    raw = getattr(hidden, "_torchdynamo_orig_callable", hidden)
    handlers = {"hidden (tiermem)": hidden,
                "torch's disable wrapper": torch._disable_dynamo(raw, recursive=True)}
    runs = {"plain": (None, contextlib.nullcontext())}
    for name in handlers:
        runs[name] = (name, tiermem.Offloader(policy="recompute"))
    models = {}
    for name in runs:
        with dev:
            models[name] = TinyGPT(cfg)
        models[name].load_state_dict(base.state_dict())
    ops = [0]

    class _Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[0] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        base(x, x)
    times: dict = {name: [] for name in runs}
    for r in range(a.warmup + a.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            handler, ctx = runs[name]
            if handler is not None:
                producers.ProducerMode.__torch_dispatch__ = handlers[handler]
            sync(dev)
            t0 = time.perf_counter()
            with ctx:
                loss = models[name](x, x)
            t = time.perf_counter() - t0
            loss.backward()
            sync(dev)
            for p in models[name].parameters():
                p.grad = None
            if r >= a.warmup:
                times[name].append(t)
    producers.ProducerMode.__torch_dispatch__ = hidden
    diffs = [w - h for w, h in zip(times["torch's disable wrapper"], times["hidden (tiermem)"])]
    out = {"benchmark": "dispatch handler wrapper", "machine": machine(),
           "model": {**cfg.__dict__, "batch": a.batch}, "device": str(dev),
           "rounds": a.rounds, "aten_ops_per_forward": ops[0],
           "forward_host_median_s": {k: statistics.median(v) for k, v in times.items()},
           "wrapper_minus_hidden_median_s": statistics.median(diffs),
           "wrapper_minus_hidden_us_per_op": statistics.median(diffs) / ops[0] * 1e6}
    emit(out, a.out)


if __name__ == "__main__":
    main()
