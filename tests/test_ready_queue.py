"""The CUDA chain's read queue on the CPU (csrc/ready_queue.h, NOTE [Reads in
completion order]): the CPU build binds it over int tickets
(``tiermem.testing.new_ready_queue``), so the protocol the chain's in thread
relies on runs here without a GPU. The
chain itself (reads handed on as their preads finish) is covered on a GPU by
tests/test_gpu_engine.py::test_a_slow_read_does_not_hold_back_a_finished_one.
"""

from __future__ import annotations

import pytest
import torch

import tiermem.testing
from tiermem.io import ALIGN_BYTES
from helpers import cpp_engine_unavailable

MiB = 1 << 20


@pytest.fixture
def extension():
    """Skips the test where the C++ extension cannot be built."""
    reason = cpp_engine_unavailable()
    if reason:
        pytest.skip(f"the C++ extension cannot be built: {reason}")


def test_items_come_out_in_completion_order_not_submission_order(extension):
    q = tiermem.testing.new_ready_queue()
    assert q.add_pending() and q.add_pending()   # ticket 0 (slow), then ticket 1
    q.complete(1)
    assert q.pop(0.0) == ("item", 1)             # not held behind ticket 0
    assert q.pending == 1
    assert q.pop(0.01) == ("timeout", None)
    q.complete(0)
    assert q.pop(0.0) == ("item", 0)
    assert q.pending == 0


def test_stop_refuses_new_items_and_finishes_only_after_the_pending_ones(extension):
    q = tiermem.testing.new_ready_queue()
    assert q.add_pending()
    q.stop()
    assert not q.add_pending()
    assert q.pop(0.01) == ("timeout", None)      # one still pending: not finished
    q.complete(7)
    assert q.pop(0.0) == ("item", 7)
    assert q.pop(0.0) == ("finished", None)


def test_an_engine_future_hands_its_ticket_on_once_done(extension, tmp_path):
    """Future.on_done (io_engine.h), as read_to_device uses it: a read still
    on the disk does not hold back one already done, and a ticket comes out
    only once its future is done."""
    from tiermem.io.cpp import CppEngine
    slow_engine, idle_engine = CppEngine(1), CppEngine(1)
    nbytes = 32 * MiB
    try:
        with slow_engine.open(str(tmp_path / "a.bin"), nbytes) as fa, \
                idle_engine.open(str(tmp_path / "b.bin"), ALIGN_BYTES) as fb:
            fa.write(torch.ones(nbytes, dtype=torch.uint8), 0).wait()
            fb.write(torch.full((ALIGN_BYTES,), 2, dtype=torch.uint8), 0).wait()
            small = fb.read(torch.empty(ALIGN_BYTES, dtype=torch.uint8), 0)
            small.wait()
            big_buf = torch.empty(nbytes, dtype=torch.uint8)
            big = fa.read(big_buf, 0)   # 4 chunks on one worker
            q = tiermem.testing.new_ready_queue()
            big_pending = not big.done()
            assert q.watch(big, 0)
            assert q.watch(small, 1)    # done: handed on at once
            first = q.pop(0.0)
            if big_pending:
                assert first == ("item", 1)
                second = q.pop(30.0)
            else:   # the disk beat us to it (never seen here): order is theirs
                second, first = first, q.pop(0.0)
            assert second == ("item", 0)
            assert big.done()           # called after the future is done
            assert bool((big_buf == 1).all())
            q.stop()
            assert not q.watch(small, 2)
            assert q.pop(0.0) == ("finished", None)
    finally:
        slow_engine.close()
        idle_engine.close()
