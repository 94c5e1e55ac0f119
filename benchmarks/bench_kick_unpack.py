"""What a KickKept costs a kept tensor (NOTE [Restores start with backward],
rule 5, in tiermem/runtime/hooks.py): the unpack hook on a plain ``Kept`` against a
``KickKept`` whose step's restores have started (every KickKept of a step
but the one that kicks), and the pack hook of a step without a plan on a
kept tensor before and after its first move (a small tensor, kept under
``min_offload_bytes``). Timed in a loop outside autograd, best of
``--repeats`` runs of ``--n`` calls, in nanoseconds per call.

Run: ``python benchmarks/bench_kick_unpack.py [--out x.json]``. Prints JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiermem  # noqa: E402
from common import emit, machine  # noqa: E402
from tiermem.runtime.hooks import unpack  # noqa: E402
from tiermem.tiers.keep import Kept, KickKept  # noqa: E402


def _best_ns(fn, make, n: int, repeats: int) -> float:
    """Best time per call of ``fn(a)`` over ``n`` arguments ``make()`` made
    before each timed run."""
    best = float("inf")
    for _ in range(repeats):
        args = [make() for _ in range(n)]
        t0 = time.perf_counter()
        for a in args:
            fn(a)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e9


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = {"name": "bench_kick_unpack", "machine": machine(), "args": vars(args)}
    t = torch.randn(64)
    with tempfile.TemporaryDirectory() as d:
        off = tiermem.Offloader(policy="nvme", nvme_dir=d, engine="python",
                                min_offload_bytes=64 << 10)
        with off as ctx:
            packer = ctx._packer   # the pack hook itself
            out["pack_kept_before_first_move_ns"] = _best_ns(packer, lambda: t, args.n,
                                                             args.repeats)
            moved = packer(torch.randn(1 << 15))   # 128 KiB: moved
            if not hasattr(packer, "kick_armed"):   # a tree before fixed kicks: this only
                out["unpack_kept_ns"] = _best_ns(unpack, lambda: Kept(t, ""), args.n,
                                                 args.repeats)
                emit(out, args.out)
                return out
            assert packer.kick_armed
            kick = packer(t)
            assert type(kick) is KickKept
            out["pack_kept_after_first_move_ns"] = _best_ns(packer, lambda: t, args.n,
                                                            args.repeats)
        step = ctx.step
        unpack(kick)   # kicks: restores start, as at the first kept unpack of backward
        assert step.prefetcher.started
        out["unpack_kept_ns"] = _best_ns(unpack, lambda: Kept(t, ""), args.n, args.repeats)
        # The other KickKepts of the step: each unpacked once, after the kick.
        out["unpack_kickkept_after_kick_ns"] = _best_ns(
            unpack, lambda: KickKept(Kept(t, ""), step), args.n, args.repeats)
        del moved, kick
        off.close()
    emit(out, args.out)
    return out


if __name__ == "__main__":
    main()
