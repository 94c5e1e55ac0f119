"""Arena: aligned best-fit extents, coalescing, growth within budget, disk full."""

import dis
import errno
import random
import sys

import pytest

import tiermem.testing
from tiermem.memory.arena import Arena
from tiermem.errors import TierMemError


class FakeFile:
    def __init__(self, capacity=None):
        self.size = 0
        self.capacity = capacity
        self.calls = []

    def resize(self, n):
        self.calls.append(n)
        if self.capacity is not None and n > self.capacity:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.size = n


def test_extents_are_aligned_and_disjoint():
    f = FakeFile()
    a = Arena(f.resize, budget_bytes=1 << 30, grow_bytes=1 << 20)
    spans = []
    for n in [1, 4095, 4096, 4097, 100_000, 3]:
        off = a.alloc(n)
        assert off % 4096 == 0
        spans.append((off, off + (n + 4095) // 4096 * 4096))
    spans.sort()
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= f.size == a.size_bytes


def test_same_shapes_every_step_do_not_grow_the_file():
    f = FakeFile()
    a = Arena(f.resize, budget_bytes=1 << 30, grow_bytes=1 << 16)
    sizes = [random.Random(i).randrange(1, 300_000) for i in range(40)]
    for step in range(50):
        offs = [a.alloc(n) for n in sizes]
        if step == 0:
            size_after_first = a.size_bytes
        for off, n in reversed(list(zip(offs, sizes))):  # backward frees in reverse
            a.free(off, n)
        assert a.used_bytes == 0
    assert a.size_bytes == size_after_first
    assert a.free_extents == 1  # everything coalesced into one free extent


def test_budget_is_never_exceeded():
    f = FakeFile()
    a = Arena(f.resize, budget_bytes=10 * 4096, grow_bytes=1 << 20)
    assert a.alloc(8 * 4096) == 0
    assert a.alloc(3 * 4096) is None
    assert a.alloc(2 * 4096) == 8 * 4096
    assert max(f.calls) <= 10 * 4096


def test_enospc_while_growing_makes_the_arena_full_not_an_error():
    f = FakeFile(capacity=64 * 4096)
    a = Arena(f.resize, budget_bytes=1 << 30, grow_bytes=1 << 20)
    first = a.alloc(60 * 4096)       # big growth refused, exact growth fits
    assert first == 0 and not a.disk_full
    assert a.alloc(10 * 4096) is None
    assert a.disk_full
    a.free(first, 60 * 4096)
    assert a.alloc(10 * 4096) == 0  # freed space is reused


def test_other_resize_errors_propagate():
    def resize(n):
        raise OSError(errno.EIO, "Input/output error")
    a = Arena(resize, budget_bytes=1 << 30)
    with pytest.raises(OSError) as err:
        a.alloc(10)
    assert err.value.errno == errno.EIO


# -- NOTE [Interrupted updates] in memory/arena.py ------------------------------------------

def _check(a):
    """The arena's invariants: free extents sorted, disjoint, coalesced, within
    the file, and the used bytes exactly the rest."""
    free = a.free_list
    assert all(s + n < t for (s, n), (t, _) in zip(free, free[1:])), free
    assert all(n > 0 and s % a.align == 0 and n % a.align == 0 for s, n in free), free
    assert not free or free[-1][0] + free[-1][1] <= a.size_bytes
    assert a.used_bytes == a.size_bytes - sum(n for _, n in free)
    assert not tiermem.testing.arena_locked(a)


def _state(a):
    return a.free_list, a.used_bytes, a.size_bytes


# Where CPython 3.11+ runs a pending signal's handler: at a function's entry
# (the "call" event), after a call returns, at a loop's back edge.
_CHECKED_AFTER = {"CALL", "JUMP_BACKWARD"}


def _interrupted_at(nth, fn):
    """Run ``fn()`` with a KeyboardInterrupt raised at the ``nth`` point of
    memory/arena.py where a signal handler may run; whether it was raised."""
    count, last = [0], {}

    def at_opcode(frame, event, arg):
        if event == "opcode":
            op = dis.opname[frame.f_code.co_code[frame.f_lasti]]
            checked, last[frame] = last.get(frame) in _CHECKED_AFTER, op
        else:
            checked = event == "call"
        if checked:
            count[0] += 1
            if count[0] == nth:
                raise KeyboardInterrupt
        return at_opcode

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != Arena.alloc.__code__.co_filename:
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return at_opcode(frame, event, arg)

    sys.settrace(tracer)
    try:
        fn()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def _fragmented():
    """An arena with free extents on both sides of used ones, and its offsets."""
    a = Arena(FakeFile().resize, budget_bytes=1 << 30, align=4096, grow_bytes=16 * 4096)
    offs = [a.alloc(4096 * (i + 1)) for i in range(4)]   # 1, 2, 3, 4 pages; 6 left
    a.free(offs[0], 4096)
    a.free(offs[2], 3 * 4096)
    return a, offs


_UPDATES = {
    "alloc from a free extent": lambda a, offs: a.alloc(2 * 4096),
    "alloc that grows the file": lambda a, offs: a.alloc(40 * 4096),
    "free merging both sides": lambda a, offs: a.free(offs[1], 2 * 4096),
    "free merging the tail": lambda a, offs: a.free(offs[3], 4 * 4096),
}


@pytest.mark.parametrize("update", list(_UPDATES))
def test_an_interrupted_update_is_all_or_nothing(update):
    """A KeyboardInterrupt wherever a signal handler may run in ``alloc`` or
    ``free`` leaves the arena as before or as after the update, never in
    between, and usable."""
    a, offs = _fragmented()
    _UPDATES[update](a, offs)
    after = _state(a)
    nth = 0
    while True:
        nth += 1
        a, offs = _fragmented()
        before = _state(a)
        if not _interrupted_at(nth, lambda: _UPDATES[update](a, offs)):
            break
        _check(a)
        assert _state(a) in (before, after), f"half an update at point {nth}"
        off = a.alloc(4096)   # still usable
        a.free(off, 4096)
        assert _state(a) in (before, after)
    assert nth > 5   # the sweep did interrupt the update


def test_an_extent_given_back_twice_is_ignored(caplog):
    """A release repeated after an interruption gives an extent back twice:
    the second time it is free (whole, or but for a part handed out again) and
    is ignored, with one warning, rather than handed out twice."""
    a = Arena(FakeFile().resize, budget_bytes=1 << 30, grow_bytes=1 << 20)
    first, second = a.alloc(8 * 4096), a.alloc(4096)
    a.free(first, 8 * 4096)
    with caplog.at_level("WARNING", logger="tiermem"):
        a.free(first, 8 * 4096)
        again = a.alloc(4 * 4096)   # the first half of the freed extent
        a.free(first, 8 * 4096)     # overlaps free bytes: still a repeat
    assert again == first
    assert a.repeated_frees == 2 and a.used_bytes == 5 * 4096
    assert a.alloc(4 * 4096) == first + 4 * 4096   # nothing was handed out twice
    assert len([r for r in caplog.records if "given back while free" in r.message]) == 1
    _check(a)
    del second


def test_an_extent_outside_the_arena_is_a_bug():
    a = Arena(FakeFile().resize, budget_bytes=1 << 30, grow_bytes=1 << 20)
    a.alloc(4096)
    with pytest.raises(TierMemError, match="this is a bug"):
        a.free(a.size_bytes, 4096)
