"""Processes that use tiermem end cleanly: at interpreter exit with copies in
flight (NOTE [Copy threads at exit] in tiermem/runtime/copier.py), and in a child
forked from a process with a C++ engine (NOTE [Engine after fork] in
csrc/io_engine.h). Each case runs in a fresh subprocess, which must exit 0
and never print C++'s "terminate called" (the SIGABRT once seen in a DDP rank).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import helpers

_TIMEOUT_S = 120   # generous: 2 loaded cores; each program takes ~2 s alone


def _run(code: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=_TIMEOUT_S)
    assert "terminate called" not in res.stderr, res.stderr
    assert res.returncode == 0, f"exit status {res.returncode}: {res.stderr[-2000:]}"
    return res


def test_exit_with_copies_in_flight_does_not_abort():
    """A forward under the cpu tier, then the program ends at once (no backward,
    no close): the copy threads are still copying (~200 MB) when the interpreter
    exits. Before the exit hook this died with SIGABRT every time here."""
    _run("""
        import torch, tiermem
        x = torch.randn(3000, 3000, requires_grad=True)
        off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
        with off:
            y = x.sin().cos().exp().tanh().sigmoid().sum()
        print("forward done")
    """)


def test_copies_after_the_exit_hook_run_on_the_caller():
    """An atexit hook registered before tiermem's runs after it: its copies run
    on the calling thread (no worker left to wait for), with the same
    gradients as without tiermem."""
    res = _run("""
        import atexit

        def late_training():
            import torch, tiermem
            torch.manual_seed(0)
            x = torch.randn(64, 64, requires_grad=True)
            (x.sin() * x.cos()).sum().backward()
            ref, x.grad = x.grad, None
            off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
            with off:
                y = (x.sin() * x.cos()).sum()
            y.backward()
            moved = off.stats.count_by_tier.get("cpu", 0)
            off.close()
            print("equal" if torch.equal(x.grad, ref) else "differ", moved)

        atexit.register(late_training)   # before tiermem's hook: runs after it
        import torch, tiermem
        with tiermem.Offloader(policy="cpu", min_offload_bytes=0):   # workers start now
            torch.ones(8, requires_grad=True).exp()
    """)
    verdict, moved = res.stdout.split()
    assert verdict == "equal" and int(moved) > 0, res.stdout


@pytest.fixture
def cpp_engine():
    reason = helpers.cpp_engine_unavailable()
    if reason is not None:
        pytest.skip(f"C++ engine unavailable: {reason}")


@pytest.mark.parametrize("in_child", ["close", "drop", "write", "open"])
def test_cpp_engine_in_a_forked_child(cpp_engine, tmp_path, in_child):
    """A child forked while the parent's engine has writes queued: closing or
    dropping the engine there returns (a join crashed: SIGSEGV), using it
    raises OSError(EBADF) naming the fork (a queued write never ran: a hang),
    and the parent's engine still works afterwards."""
    res = _run(f"""
        import errno, os, sys, torch
        from tiermem.io.cpp import load_extension
        m = load_extension()
        eng = m.Engine(2)
        f = eng.open({str(tmp_path / 'arena')!r}, 32 << 20)
        t = torch.randn(4 << 20)
        futs = [f.write(t, i * (16 << 20)) for i in range(2)]
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                if {in_child!r} == "close":
                    f.close()
                    eng.close()
                    code = 0 if eng.closed else 3
                elif {in_child!r} == "drop":
                    del f, futs, eng
                elif {in_child!r} == "write":
                    try:
                        f.write(t, 0).wait()
                        code = 4
                    except OSError as e:
                        code = 0 if e.errno == errno.EBADF and "forked" in str(e) else 5
                else:
                    try:
                        eng.open({str(tmp_path / 'child')!r}, 4096)
                        code = 6
                    except OSError as e:
                        code = 0 if e.errno == errno.EBADF and "forked" in str(e) else 7
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        for fut in futs:
            fut.wait()
        back = torch.empty_like(t)
        f.read(back, 16 << 20).wait()
        eng.close()
        print(status, torch.equal(back, t))
    """)
    assert res.stdout.split() == ["0", "True"], res.stdout + res.stderr
