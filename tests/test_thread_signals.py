"""tiermem's worker threads block asynchronous signals, so a signal sent to
the process reaches the main thread, where Python runs its handlers
(NOTE [Signals go to the main thread] in tiermem/threads.py)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import helpers
from tiermem.threads import ASYNC_SIGNALS, block_async_signals

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                reason="needs /proc/self/task (Linux)")


def _blocked(tid: int) -> int:
    """The SigBlk mask of thread ``tid`` of this process."""
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    raise AssertionError("no SigBlk line")


def _has(mask: int, sig) -> bool:
    return bool(mask >> (int(sig) - 1) & 1)


def _tasks() -> set:
    """This process's threads, after torch has started its own (its
    intra-op pool starts at the first parallel op, from the main thread)."""
    a = torch.randn(256, 256, requires_grad=True)
    (a @ a).sin().sum().backward()
    return {int(t) for t in os.listdir("/proc/self/task")}


def _check_new_threads(before: set) -> None:
    new = {int(t) for t in os.listdir("/proc/self/task")} - before
    assert new, "no thread was started: the test checks nothing"
    for tid in new:
        mask = _blocked(tid)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            assert _has(mask, sig), f"thread {tid} takes {sig!r}"
        assert not _has(mask, signal.SIGSEGV), f"thread {tid} blocks SIGSEGV"
    main = _blocked(threading.main_thread().native_id)
    assert not _has(main, signal.SIGTERM), "the main thread's mask was changed"


def test_the_set_leaves_faults_alone():
    assert signal.SIGTERM in ASYNC_SIGNALS and signal.SIGINT in ASYNC_SIGNALS
    assert not {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT} & ASYNC_SIGNALS


def test_block_async_signals_only_in_the_calling_thread():
    out = {}

    def run():
        block_async_signals()
        out["mask"] = _blocked(threading.get_native_id())
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert _has(out["mask"], signal.SIGTERM)
    assert not _has(_blocked(threading.get_native_id()), signal.SIGTERM)


@pytest.mark.parametrize("engine", ["python", "cpp"])
def test_engine_threads_block_them(tmp_path, engine):
    if engine == "cpp" and helpers.cpp_engine_unavailable():
        pytest.skip(f"C++ engine unavailable: {helpers.cpp_engine_unavailable()}")
    from tiermem.io import cpp, pyengine
    before = _tasks()
    eng = cpp.CppEngine(2) if engine == "cpp" else pyengine.PythonEngine(2)
    try:
        with eng.open(str(tmp_path / "f.bin"), 4096) as f:   # started at first use if lazy
            f.write(torch.zeros(1024), 0).wait()
        _check_new_threads(before)
    finally:
        eng.close()


def test_copy_and_chain_threads_block_them(tmp_path):
    import tiermem
    before = _tasks()
    off = tiermem.Offloader(policy="nvme", nvme_dir=str(tmp_path), engine="python",
                            min_offload_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        y = (x.sin() * 2).sum()
    y.backward()
    try:
        _check_new_threads(before)
    finally:
        off.close()
