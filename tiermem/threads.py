"""Worker threads of tiermem leave asynchronous signals to the main thread.

# NOTE [Signals go to the main thread]
# A signal sent to the process (SIGTERM from a scheduler, SIGHUP, SIGINT) is
# delivered by the kernel to any thread that does not block it. CPython runs
# Python handlers on the main thread only: when the signal lands on another
# thread, the C handler just sets a flag, and a main thread blocked in a
# system call (``time.sleep``, a wait without the GIL) is not woken, so the
# handler, and NOTE [Cleanup on SIGTERM] in spilldir.py with it, waits until
# that call returns (CI saw a SIGHUP'd process outlive a 30 s wait once). So
# every thread tiermem starts blocks the asynchronous signals first: Python
# threads call :func:`block_async_signals` at their start, and the C++
# engine's and CUDA chain's threads are made with them blocked
# (``BlockAsyncSignals`` in csrc/io_engine.h; a new thread inherits the
# mask). Synchronous signals (a fault in that thread: SIGSEGV, SIGBUS,
# SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS) stay unblocked, as they must.
"""

from __future__ import annotations

import signal

__all__ = ["block_async_signals", "ASYNC_SIGNALS"]

_SYNCHRONOUS = {getattr(signal, n) for n in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP",
                                              "SIGABRT", "SIGSYS", "SIGKILL", "SIGSTOP")
                if hasattr(signal, n)}

#: The signals tiermem's threads block (NOTE [Signals go to the main thread]).
ASYNC_SIGNALS = (frozenset(signal.valid_signals()) - _SYNCHRONOUS
                 if hasattr(signal, "valid_signals") else frozenset())


def block_async_signals() -> None:
    """Block :data:`ASYNC_SIGNALS` in the calling thread (a no-op where the
    platform has no ``pthread_sigmask``). Call it first in a worker thread."""
    if ASYNC_SIGNALS and hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, ASYNC_SIGNALS)
