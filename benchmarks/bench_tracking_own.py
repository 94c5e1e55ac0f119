"""Producer tracking's own Python time per forward: the time spent inside
``ProducerMode.__torch_dispatch__`` outside the op it runs, in a real step of
an ``auto`` Offloader that follows its plan (the mode the Offloader makes,
instrumented), and in a whole-forward ``ProducerMode()``.

Why a second benchmark: on a 2-core machine shared with other jobs,
``bench_tracking.py``'s forward times carry a noise of about ±5% and a floor
(any dispatch mode, even one that only forwards, measured 2-14% in
different runs) that is not tracking's own work. This one times only the
handler's own code, with ``time.perf_counter_ns`` around it and around the op
(about 0.06 µs per reading; a preemption inside a handler shows as an
outlier, so medians over rounds). ``noop`` is a mode that only forwards,
timed the same way: its own time is the timers' and PyTorch's wrapper's.

It replaces the mode where a step makes it (``tiermem.tracking.setup``) and
``tiermem.tracking.producers._run_as_without_mode``; it ran against
``tiermem.offloader`` until the tracking setup moved (its auto step then timed
nothing). Run it against a tree:

    PYTHONPATH=<tree> python benchmarks/bench_tracking_own.py --out <json>
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_gpt_args, emit, gpt_config, machine  # noqa: E402

import tiermem  # noqa: E402
import tiermem.tracking.setup  # noqa: E402
import tiermem.tracking.producers as producers  # noqa: E402
from tiermem.models import TinyGPT  # noqa: E402

_clock = time.perf_counter_ns
_acc = {"op": 0, "total": 0, "calls": 0}
_run = producers._run_as_without_mode


def _timed_run(func, types, args, kwargs):
    t0 = _clock()
    try:
        return _run(func, types, args, kwargs)
    finally:
        _acc["op"] += _clock() - t0


_raw = producers.ProducerMode.__torch_dispatch__
_raw = getattr(_raw, "_torchdynamo_orig_callable", _raw)   # the handler itself


class _Timed(producers.ProducerMode):
    """The Offloader's mode, its handler timed (made by the Offloader: it is
    patched in as ``tiermem.tracking.setup.ProducerMode``, where a step makes
    its mode)."""

    made: list = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peak = 0
        type(self).made.append(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = _clock()
        try:
            return _raw(self, func, types, args, kwargs)
        finally:
            _acc["total"] += _clock() - t0
            _acc["calls"] += 1

    def clear(self) -> None:
        self.peak = max(self.peak, len(self._records))
        super().clear()


class _Noop(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = _clock()
        try:
            return _timed_run(func, types, args, kwargs or {})
        finally:
            _acc["total"] += _clock() - t0
            _acc["calls"] += 1


def _measure(run) -> tuple:
    _acc.update(op=0, total=0, calls=0)
    c0 = time.thread_time()
    run()
    forward_s = time.thread_time() - c0
    return (_acc["total"] - _acc["op"]) / 1e9, forward_s, _acc["calls"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_args(p, batch=4)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--budget", default="10%")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = gpt_config(a)
    model = TinyGPT(cfg)
    x = torch.randint(0, cfg.vocab, (a.batch, a.seq_len))
    producers._run_as_without_mode = _timed_run   # the handler calls it by module global
    tiermem.tracking.setup.ProducerMode = _Timed   # where a step makes its mode
    off = tiermem.Offloader(policy="auto", device_budget=a.budget)
    for _ in range(3):   # profile, plan, first measured step
        with off:
            loss = model(x, x)
        loss.backward()
    plan = off.plan
    if not plan.recomputes:
        sys.exit("bench_tracking_own: the plan recomputes nothing")

    def planned():
        with off:
            out = model(x, x)
        planned.loss = out

    def whole():
        with _Timed():
            model(x, x)

    def noop():
        with _Noop():
            model(x, x)

    rows = {"noop": noop, "producer_mode_whole_forward": whole, "auto_planned_step": planned}
    samples = {k: [] for k in rows}
    records = {}
    names = list(rows)
    for r in range(a.rounds + 2):
        for k in names[r % len(names):] + names[:r % len(names)]:
            _Timed.made = []
            own, fwd, calls = _measure(rows[k])
            if k == "auto_planned_step":
                planned.loss.backward()
                planned.loss = None
            if r >= 2:
                samples[k].append((own, fwd, calls))
                records[k] = sum(max(m.peak, len(m._records)) for m in _Timed.made)
    res = {"benchmark": "producer tracking: own handler time per forward",
           "machine": machine(), "torch_threads": 1, "rounds": a.rounds,
           "model": {"layers": a.layers, "width": a.width, "seq_len": a.seq_len,
                     "batch": a.batch},
           "plan": {"budget": a.budget, "recomputed_tensors": sum(
               o[0].value == "recompute" for o in plan.orders), "tensors": len(plan.orders)},
           "rows": {}}
    for k, v in samples.items():
        own = statistics.median(s[0] for s in v)
        fwd = statistics.median(s[1] for s in v)
        calls = v[0][2]
        res["rows"][k] = {
            "handler_calls": calls, "records": records.get(k),
            "own_ms_median": own * 1e3, "own_ms_min": min(s[0] for s in v) * 1e3,
            "forward_cpu_ms_median": fwd * 1e3,
            "own_share_of_forward_median": statistics.median(s[0] / s[1] for s in v),
            "own_us_per_call": own / max(1, calls) * 1e6}
    off.close()
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
