"""The prefetcher's window walk per tensor: ``Prefetcher.kick`` then one
``begin_use`` + ``advance`` per moved tensor, 20,000 fake handles whose
store starts every restore, a window that never fills; ns per tensor,
medians of 7 interleaved runs of two trees' runtime/prefetch.py.

Run: ``python benchmarks/bench_prefetch_walk.py OLD/prefetch.py NEW/prefetch.py``.
"""

import importlib.util
import json
import statistics
import sys
import time


class _Store:
    def prefetch(self, handle):
        return True


class _Handle:
    __slots__ = ("store", "nbytes", "__weakref__")

    def __init__(self) -> None:
        self.store, self.nbytes = _Store(), 1024


def _run(mod, n: int = 20000) -> float:
    p = mod.Prefetcher(1 << 40)
    handles = [_Handle() for _ in range(n)]
    entries = [p.add(h, 1024) for h in handles]
    t0 = time.perf_counter()
    p.kick()
    for e in reversed(entries):
        p.begin_use(e)
        p.advance(e)
    return (time.perf_counter() - t0) / n


def main() -> None:
    mods = {}
    for k, path in enumerate(sys.argv[1:3]):
        spec = importlib.util.spec_from_file_location(f"prefetch_{k}", path)
        mods[path] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[path])
    res = {path: [] for path in mods}
    for _ in range(7):
        for path, m in mods.items():
            res[path].append(_run(m) * 1e9)
    print(json.dumps({p: {"median_ns_per_tensor": statistics.median(v), "ns": v}
                      for p, v in res.items()}, indent=2))


if __name__ == "__main__":
    main()
