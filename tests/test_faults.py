"""Faults of the nvme tier that need no error to be handled right (issue 14,
"Soak and faults"): a disk slower than the prefetch window, and SIGTERM while
backward runs. (EIO and ENOSPC: test_nvme.py, test_io.py.)"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import tiermem
import tiermem.testing
from helpers import (SlowFuture, compare_records, land_moves, offloader, reference_steps,
                     train_steps)
from models import make_case

READ_DELAY_SECONDS = 0.03


class _SlowReadFile:
    """The store's file; each read completes ``delay`` seconds after it was
    submitted at the earliest (a disk far slower than compute)."""

    def __init__(self, f, delay: float) -> None:
        self._f, self.delay, self.reads = f, delay, 0

    def __getattr__(self, name):
        return getattr(self._f, name)

    def read(self, buf, offset):
        self.reads += 1
        return SlowFuture(self._f.read(buf, offset), time.monotonic() + self.delay)


class _Landed:
    """``with off``, then wait until every move landed (backward then reads
    from disk, not from a source still alive)."""

    def __init__(self, off) -> None:
        self.off = off

    def __enter__(self):
        return self.off.__enter__()

    def __exit__(self, *exc):
        self.off.__exit__(*exc)
        land_moves(self.off)


def test_a_disk_slower_than_the_prefetch_window_stalls_exactly_without_error(
        nvme_dir, engine, caplog):
    ref = reference_steps("block", 3)
    off = offloader("nvme", nvme_dir=nvme_dir, engine=engine)
    slow = _SlowReadFile(tiermem.testing.nvme_file(off), READ_DELAY_SECONDS)
    tiermem.testing.set_nvme_file(off, slow)
    stalls = []

    def step_context():   # also notes the stats of the step before
        if stalls or off.stats.count_by_tier["nvme"]:
            s = off.stats
            stalls.append((s.stall_seconds, s.late_restores, s.count_by_tier["nvme"]))
        else:
            stalls.append(None)
        return _Landed(off)

    with caplog.at_level(logging.WARNING, logger="tiermem"):
        compare_records(train_steps(make_case("block"), step_context, 3), ref, "block")
    step_context()
    stalls = stalls[1:]
    assert slow.reads > 0 and len(stalls) == 3, "nothing was read back: the test tests nothing"
    for stall, late, moved in stalls:
        assert moved > 0 and late > 0, stalls
        # Each step waited for at least one slow read (minus timer slack).
        assert stall >= READ_DELAY_SECONDS * 0.5, stalls
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert off.disk_bytes_in_use == 0 and off.host_bytes_in_use == 0
    off.close()
    assert os.listdir(nvme_dir) == []


_IN_BACKWARD = textwrap.dedent("""
    import os, signal, sys, time, torch, tiermem
    nvme_dir, marker, chained = sys.argv[1], sys.argv[2], sys.argv[3] == "chained"
    if chained:
        def mine(signum, frame):
            print("mine", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, mine)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256),
                                                      torch.nn.GELU()) for _ in range(4)])
    off = tiermem.Offloader(policy="nvme", nvme_dir=nvme_dir, min_offload_bytes=0,
                            engine="python")
    x = torch.randn(64, 256)

    def inside_backward(grad):
        # The grad of the first block's output: backward is half done, the
        # first block's saved tensors are still on disk.
        if step == 2:
            open(marker, "w").close()
            time.sleep(60)
        return grad

    for step in range(3):
        with off:
            h = model[0](x)
            h.register_hook(inside_backward)
            loss = model[1:](h).square().mean()
        loss.backward()
    print("finished", flush=True)
""")


@pytest.mark.parametrize("chained", [False, True], ids=["default", "chained"])
def test_sigterm_during_backward_removes_the_private_directory(tmp_path, chained):
    nvme_dir, marker = tmp_path / "nvme", tmp_path / "in-backward"
    p = subprocess.Popen([sys.executable, "-c", _IN_BACKWARD, str(nvme_dir), str(marker),
                          "chained" if chained else "default"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the child never reached backward"
            time.sleep(0.01)
        (private,) = os.listdir(nvme_dir)
        assert os.listdir(nvme_dir / private), "nothing on disk: the test tests nothing"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    if chained:
        assert p.returncode == 3 and out.split() == ["mine"], (p.returncode, out, err)
    else:
        assert p.returncode == -signal.SIGTERM, (p.returncode, out, err)
    assert os.listdir(nvme_dir) == []
