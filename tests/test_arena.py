"""Arena: aligned best-fit extents, coalescing, growth within budget, disk full."""

import errno
import random

import pytest

from tiermem.arena import Arena


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
