"""I/O engine throughput against fio: write then read ``--total-mib`` in tensors of
each ``--sizes-mib``, for the C++ engine, the Python thread-pool engine, an
aiofiles-based Python variant, and fio (O_DIRECT, same block size, same file
size, libaio with iodepth = the engines' thread count; ``fio`` with its default
malloc buffers, ``fio_hugepages`` with hugetlb buffers, the like-for-like
baseline for the engines' huge-page buffers: see :class:`HugePages`).

Runs are interleaved (every repeat runs each engine once, in a fresh seeded
random order, after one untimed warm-up pass each) and the median of
``--repeats`` is reported, with ratios to fio measured in the same
process run. Buffers are 4096-aligned (``tiermem.io.aligned_empty``: the direct
path, as for staging buffers; huge pages advised), the same memory for every
engine; the C++ engine is also measured with plain ``torch.empty`` buffers
(64-byte aligned, as CPU activations are: the bounce-buffer path) as
``cpp_unaligned``, and with only ``--threads`` buffers reused, as fio reuses its
``iodepth`` buffers, as ``cpp_hot`` (on the VM measured, touching more distinct
memory made O_DIRECT slower: a DMA-mapping effect, not per-request cost).
Engines submit all requests of a pass, then wait for all. A second sweep on
tmpfs (``--overhead-dir``, memory speed) shows the engines' own CPU cost. A
third, ``contended`` (on the disk), runs the engines while another Python
thread runs pure-Python code, as a training loop's forward pass does while
activations are written: it reports the engines' throughput and how fast the
Python thread ran, relative to running alone (``busy_rate_vs_alone``). Engine
threads that need the GIL wait up to a switch interval (5 ms) for it each time.

Usage::

    python benchmarks/bench_io.py --out benchmarks/results/DATE-cpu-io.json
    python benchmarks/bench_io.py --smoke            # a few seconds (CI)

``--dir`` must be on a real disk (not tmpfs/ramfs, whose "I/O" is a memcpy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, machine, mount_of  # noqa: E402

import tiermem  # noqa: E402
from tiermem.io import ALIGN_BYTES, aligned_empty  # noqa: E402
from tiermem.io import pyengine  # noqa: E402

MiB = 1 << 20
ENGINES = ("cpp", "cpp_hot", "cpp_unaligned", "python", "aiofiles")


class AiofilesEngine(pyengine.PythonEngine):
    """The Python engine with its chunks run through aiofiles: an asyncio loop in
    a thread awaits ``aiofiles.os.wrap(chunk)`` on an executor of ``threads``
    workers (aiofiles' own model: blocking calls in ``run_in_executor``)."""

    name = "aiofiles"

    def _start_workers(self) -> None:
        import aiofiles.os

        self._arun = aiofiles.os.wrap(pyengine._run)
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="tiermem-aio")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._loop_thread.start()

    def _enqueue(self, items) -> None:
        def schedule():
            for item in items:
                self._loop.create_task(self._arun(item, loop=self._loop,
                                                  executor=self._executor))
        self._loop.call_soon_threadsafe(schedule)

    def _stop_workers(self) -> None:
        async def drain():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            await asyncio.gather(*tasks)
        asyncio.run_coroutine_threadsafe(drain(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._executor.shutdown()


def _fs_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    return mount_of(path).get("fs_type", "unknown")


def _make_engine(name: str, threads: int):
    if name.startswith("cpp"):
        from tiermem.io.cpp import CppEngine
        return CppEngine(threads)
    if name == "python":
        return pyengine.PythonEngine(threads)
    return AiofilesEngine(threads)


def _buffers(size: int, count: int, aligned: bool) -> list:
    """``count`` distinct buffers of ``size`` bytes.

    aligned: slots of one ``aligned_empty`` region (4096-aligned, huge pages
    advised), as a pooled staging arena gives them: the engines' direct path.
    Otherwise plain ``torch.empty`` tensors (torch's 64-byte alignment, as CPU
    activations are): the bounce-buffer path.
    """
    if aligned:
        slot = -(-size // ALIGN_BYTES) * ALIGN_BYTES
        region = aligned_empty(slot * count)
        bufs = [region[i * slot:i * slot + size] for i in range(count)]
    else:
        bufs = [torch.empty(size, dtype=torch.uint8) for _ in range(count)]
    for i, b in enumerate(bufs):
        b.fill_((i + 1) % 256)
    return bufs


class BusyPython:
    """A thread running pure-Python code (bytecode, no I/O) while the block runs;
    ``rate`` is its loop iterations per second. Stands for the Python work of a
    training step (module calls, hooks) that holds the GIL between ops."""

    def __init__(self) -> None:
        self.rate = None
        self._stop = threading.Event()
        self._count = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        stop, n = self._stop, 0
        while not stop.is_set():
            acc = 0
            for i in range(500):
                acc += i
            n += 1
        self._count = n

    def __enter__(self) -> "BusyPython":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.rate = self._count / (time.perf_counter() - self._t0)

    @classmethod
    def alone(cls, seconds: float = 1.0) -> float:
        """Iterations per second with nothing else running."""
        with cls() as busy:
            time.sleep(seconds)
        return busy.rate


def run_engine(engine, name: str, directory: str, size: int, total: int, bufs,
               busy: bool = False) -> dict:
    """Write ``total`` bytes in requests of ``size``, then read them back: GB/s
    (with ``busy``, while a :class:`BusyPython` thread runs: its rate too)."""
    path = os.path.join(directory, f"bench-{name}-{os.getpid()}")
    f = engine.open(path, total)
    ctx = BusyPython() if busy else contextlib.nullcontext()
    try:
        n = total // size
        with ctx:
            t0 = time.perf_counter()
            futs = [f.write(bufs[i % len(bufs)], i * size) for i in range(n)]
            for fut in futs:
                fut.wait()
            t1 = time.perf_counter()
            futs = [f.read(bufs[i % len(bufs)], i * size) for i in range(n)]
            for fut in futs:
                fut.wait()
            t2 = time.perf_counter()
    finally:
        f.close()
        os.unlink(path)
    out = {"write_gbps": total / (t1 - t0) / 1e9, "read_gbps": total / (t2 - t1) / 1e9}
    if busy:
        out["busy_rate"] = ctx.rate
    return out


def run_fio(directory: str, size: int, total: int, iodepth: int, mem: str = "malloc") -> dict:
    """fio on a fresh file: write then read ``total`` bytes in blocks of ``size``,
    O_DIRECT, libaio, ``iodepth`` in flight; buffers from ``mem`` (``malloc``:
    4 KiB pages; ``mmaphuge``: hugetlb pages)."""
    path = os.path.join(directory, f"bench-fio-{os.getpid()}")
    out = {}
    try:
        for rw in ("write", "read"):
            cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={size}",
                   f"--size={total}", "--direct=1", "--ioengine=libaio", f"--iodepth={iodepth}",
                   "--numjobs=1", f"--mem={mem}", "--end_fsync=0", "--invalidate=1",
                   "--output-format=json"]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"fio failed ({res.returncode}): {res.stderr.strip()}")
            job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0][rw]
            out[f"{rw}_gbps"] = job["bw_bytes"] / 1e9
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out


_NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


class HugePages:
    """Reserve hugetlb pages for fio's ``--mem=mmaphuge`` (root only), restored on exit.

    The engines' aligned buffers use transparent huge pages (``aligned_empty``);
    fio's default ``malloc`` buffers use 4 KiB pages, which made its O_DIRECT
    reads about 2x slower here. fio has no transparent-huge-page option, so the
    like-for-like baseline is fio on hugetlb pages.
    """

    def __init__(self, nbytes: int):
        self.pages = -(-nbytes // (2 * MiB)) + 8
        self.before = None
        self.reason = None

    def __enter__(self) -> "HugePages":
        try:
            with open(_NR_HUGEPAGES) as f:
                self.before = int(f.read())
            with open(_NR_HUGEPAGES, "w") as f:
                f.write(str(max(self.before, self.pages)))
            with open(_NR_HUGEPAGES) as f:
                got = int(f.read())
            if got < self.pages:
                self.reason = f"only {got} of {self.pages} hugetlb pages could be reserved"
        except (OSError, ValueError) as e:
            self.reason = f"cannot reserve hugetlb pages ({e})"
        return self

    def __exit__(self, *exc) -> None:
        if self.before is not None:
            try:
                with open(_NR_HUGEPAGES, "w") as f:
                    f.write(str(self.before))
            except OSError:
                pass


def _default_dir() -> str:
    for base in ("/work", tempfile.gettempdir(), os.getcwd()):
        if os.path.isdir(base) and os.access(base, os.W_OK) and \
                _fs_type(base) not in ("tmpfs", "ramfs"):
            return base
    return tempfile.gettempdir()


def sweep(live: dict, runners: list, directory: str, sizes: list, total: int, repeats: int,
          threads: int, label: str, busy: bool = False) -> list:
    """For each size: warm-up, then ``repeats`` interleaved runs of every runner;
    one row of medians (and ratios to fio when it ran) per size. ``busy``: the
    engines run beside a :class:`BusyPython` thread (see the module docstring)."""
    alone = BusyPython.alone() if busy else None
    engines = [n for n in runners if not n.startswith("fio")]
    fios = [n for n in runners if n.startswith("fio")]
    rows = []
    for size in sizes:
        count = max(1, min(total // size, (256 * MiB) // size))
        aligned = _buffers(size, count, aligned=True)
        bufs = {name: aligned for name in engines}
        if "cpp_unaligned" in engines:
            bufs["cpp_unaligned"] = _buffers(size, count, aligned=False)
        if "cpp_hot" in engines:  # as many buffers as fio has (iodepth), reused
            bufs["cpp_hot"] = aligned[:threads]
        for name in engines:  # warm-up: first touches of buffers, threads, file system
            run_engine(live[name], name, directory, size, min(total, max(size, 64 * MiB)),
                       bufs[name])
        samples = {name: [] for name in runners}
        for rep in range(repeats):
            for name in random.Random(rep).sample(runners, len(runners)):
                if name.startswith("fio"):
                    mem = "mmaphuge" if name == "fio_hugepages" else "malloc"
                    samples[name].append(run_fio(directory, size, total, threads, mem))
                else:
                    samples[name].append(run_engine(live[name], name, directory, size, total,
                                                    bufs[name], busy))
                print(f"bench_io: {label} size {size} rep {rep} {name}: "
                      f"{ {k: round(v, 2) for k, v in samples[name][-1].items()} }",
                      file=sys.stderr)
        del bufs, aligned
        row = {"tensor_bytes": size, "total_bytes": total}
        for name, runs in samples.items():
            row[name] = {k: round(statistics.median(r[k] for r in runs), 3)
                         for k in ("write_gbps", "read_gbps")}
            if busy:
                row[name]["busy_rate_vs_alone"] = round(
                    statistics.median(r["busy_rate"] for r in runs) / alone, 3)
            row[name]["samples"] = [{k: round(v, 3) for k, v in r.items()
                                     if k != "busy_rate"} for r in runs]
        for name in engines:
            for ref in fios:
                row[name][f"write_vs_{ref}"] = round(
                    row[name]["write_gbps"] / row[ref]["write_gbps"], 3)
                row[name][f"read_vs_{ref}"] = round(
                    row[name]["read_gbps"] / row[ref]["read_gbps"], 3)
            if name != "python" and "python" in samples:
                row[name]["write_vs_python"] = round(
                    row[name]["write_gbps"] / row["python"]["write_gbps"], 3)
                row[name]["read_vs_python"] = round(
                    row[name]["read_gbps"] / row["python"]["read_gbps"], 3)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the disk to measure "
                   "(default: a temp dir under /work or the system temp dir)")
    p.add_argument("--total-mib", type=int, default=1024, help="bytes per pass, MiB")
    p.add_argument("--sizes-mib", default="1,16,256", help="tensor sizes, MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=4, help="engine threads = fio iodepth")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--no-hugepages", action="store_true",
                   help="skip fio_hugepages (it reserves hugetlb pages for the run; root only)")
    p.add_argument("--allow-tmpfs", action="store_true", help="measure a tmpfs/ramfs dir anyway")
    p.add_argument("--overhead-dir", default="/dev/shm",
                   help="tmpfs dir for the engine-overhead sweep (memory speed: what is left "
                   "is the engines' own cost); '' to skip it")
    p.add_argument("--overhead-sizes-kib", default="64,1024")
    p.add_argument("--overhead-total-mib", type=int, default=256)
    p.add_argument("--contended-sizes-kib", default="64,1024,16384",
                   help="sizes of the contended sweep (beside a busy Python thread); '' to "
                   "skip it")
    p.add_argument("--contended-total-mib", type=int, default=256)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (CI)")
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args(argv)
    if args.smoke:
        args.total_mib, args.sizes_mib, args.repeats = 8, "1,4", 1
        args.overhead_total_mib, args.no_hugepages = 8, True
        args.contended_sizes_kib, args.contended_total_mib = "64,1024", 8

    base = args.dir or _default_dir()
    fstype = _fs_type(base)
    if fstype in ("tmpfs", "ramfs") and not args.allow_tmpfs:
        sys.exit(f"bench_io: {base} is on {fstype}, not a disk (pass --allow-tmpfs to go on)")
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        sys.exit(f"bench_io: unknown engines {sorted(unknown)}; choose from {ENGINES}")
    notes = []
    if any(e.startswith("cpp") for e in engines):
        info = tiermem.io.engine_info()
        if info["engine"] != "cpp":
            notes.append(f"cpp skipped: {info['reason'][:300]}")
            engines = [e for e in engines if not e.startswith("cpp")]
    if "aiofiles" in engines:
        try:
            import aiofiles  # noqa: F401
        except ImportError:
            notes.append("aiofiles skipped: not installed (pip install aiofiles)")
            engines.remove("aiofiles")
    use_fio = not args.no_fio and shutil.which("fio") is not None
    if not args.no_fio and not use_fio:
        notes.append("fio skipped: not installed (apt-get install -y fio)")
        print("bench_io: fio is not installed; skipping it (apt-get install -y fio)",
              file=sys.stderr)

    sizes = [int(s) * MiB for s in args.sizes_mib.split(",")]
    fios = []
    huge = HugePages(args.threads * max(sizes) if use_fio else 0)
    if use_fio:
        fios.append("fio")
        if not args.no_hugepages:
            huge.__enter__()
            if huge.reason:
                notes.append(f"fio_hugepages skipped: {huge.reason}")
            else:
                fios.append("fio_hugepages")
    live = {name: _make_engine(name, args.threads) for name in engines}
    overhead, overhead_fs, contended = [], None, []
    directory = tempfile.mkdtemp(prefix="tiermem-bench-io-", dir=base)
    try:
        results = sweep(live, engines + fios, directory, sizes, args.total_mib * MiB,
                        args.repeats, args.threads, "disk")
        huge.__exit__()
        if args.contended_sizes_kib:
            contended = sweep(live, [e for e in engines if e in ("cpp", "python")], directory,
                              [int(s) * 1024 for s in args.contended_sizes_kib.split(",")],
                              args.contended_total_mib * MiB, args.repeats, args.threads,
                              "contended", busy=True)
        if args.overhead_dir and os.path.isdir(args.overhead_dir):
            overhead_fs = _fs_type(args.overhead_dir)
            tmp = tempfile.mkdtemp(prefix="tiermem-bench-io-", dir=args.overhead_dir)
            try:
                overhead = sweep(live, [e for e in engines if e in ("cpp", "python", "aiofiles")],
                                 tmp,
                                 [int(s) * 1024 for s in args.overhead_sizes_kib.split(",")],
                                 args.overhead_total_mib * MiB, args.repeats, args.threads,
                                 "overhead")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        huge.__exit__()
        for eng in live.values():
            eng.close()
        shutil.rmtree(directory, ignore_errors=True)

    emit({"benchmark": "bench_io", "machine": machine(),
          "config": {"dir": base, "fs_type": fstype, "threads": args.threads,
                     "fio": (f"fio --direct=1 --ioengine=libaio --iodepth={args.threads} "
                             "--bs=<tensor_bytes> --size=<total_bytes> --mem=malloc "
                             "(fio_hugepages: --mem=mmaphuge), write then read a fresh file")
                     if use_fio else None,
                     "buffers": "engines: slots of one aligned_empty region (4096-aligned, "
                                "transparent huge pages advised), up to 256 MiB of distinct "
                                "buffers; cpp_hot: `threads` of those slots reused; "
                                "cpp_unaligned: torch.empty",
                     "repeats": args.repeats, "engines": engines, "smoke": args.smoke,
                     "overhead_dir": args.overhead_dir or None, "overhead_fs_type": overhead_fs,
                     "contended": ("cpp and python engines on --dir beside a BusyPython thread "
                                   "(pure-Python loop); busy_rate_vs_alone = its iterations/s "
                                   "over its rate alone") if contended else None},
          "notes": notes, "results": results, "engine_overhead_tmpfs": overhead,
          "contended": contended}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
