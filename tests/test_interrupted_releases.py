"""A KeyboardInterrupt (a signal handler, run in the main thread between two
bytecodes) that lands while a handle gives its room back, or while its move is
launched, neither loses that room for good nor gives it back twice.
NOTE [Interrupted releases] in tiers/moved_handle.py."""

import contextlib
import os
import sys

import pytest
import torch

import tiermem
import tiermem.testing
from tiermem.tiers import moved_handle, moving

import helpers

_TIERMEM_DIR = os.path.dirname(tiermem.__file__) + os.sep
_HANDLE_PY = moved_handle.__file__   # where a handle's release starts

# Where, in a release, an interrupt loses the room for good: at the entry of
# the store's give-back, right after the release claimed it (rule 3).
_CLAIMED_WINDOWS = {("_free", "call"), ("release", "call")}


def _in_use(off, tier) -> int:
    """Host (cpu) or disk (nvme) bytes held by handles, I/O that is over settled."""
    return off.host_bytes_in_use if tier == "cpu" else off.disk_bytes_in_use


@contextlib.contextmanager
def _unraisable():
    """The exceptions Python drops ("Exception ignored in ..."), e.g. from a finalizer."""
    caught, previous = [], sys.unraisablehook
    sys.unraisablehook = lambda u: caught.append(u.exc_type)
    try:
        yield caught
    finally:
        sys.unraisablehook = previous


@contextlib.contextmanager
def _interrupt_at(nth, in_file=_TIERMEM_DIR):
    """Raise a KeyboardInterrupt at the ``nth`` entry to or exit from a
    function of ``in_file`` (a file, or a directory's prefix) on this thread,
    where CPython runs a pending signal's handler; yields a list that gets
    ``(function, event)`` of where it was raised."""
    count, where = [0], []

    def at_event(frame, event, arg):
        if event in ("call", "return"):
            count[0] += 1
            if count[0] == nth:
                where.append((frame.f_code.co_name, event))
                raise KeyboardInterrupt
        return at_event

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(in_file):
            return None
        return at_event(frame, event, arg)

    sys.settrace(tracer)
    try:
        yield where
    finally:
        sys.settrace(None)


def _graph(off, x, ops=1):
    """A loss whose graph holds ``ops`` moved tensors (landed), and the bytes they hold."""
    before = off.host_bytes_in_use + off.disk_bytes_in_use
    with off:
        y = x
        for _ in range(ops):
            y = y.exp()    # saves its result
        loss = y.sum()
    helpers.land_moves(off)
    return loss, off.host_bytes_in_use + off.disk_bytes_in_use - before


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_release_interrupted_at_its_first_python_code_is_done_with_the_next(make_off, tier):
    """The common case: the signal arrives during C work that frees the graph,
    and its handler runs at the first Python code of the first handle's
    release. That release runs again when the next handle dies."""
    off = make_off(tier)
    x = torch.randn(1 << 12, requires_grad=True)
    loss, held = _graph(off, x, ops=3)
    assert held > 0 and _in_use(off, tier) == held
    with _unraisable() as caught, _interrupt_at(1, in_file=_HANDLE_PY) as where:
        del loss
    assert where and caught == [KeyboardInterrupt]
    assert _in_use(off, tier) == 0


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_release_interrupted_anywhere_gives_its_room_back_once(make_off, tier):
    """Interrupted at each function entry or exit of tiermem's release of one
    handle, the release runs again when the next handle dies: its bytes come
    back exactly once. At the store's give-back right after the claim they
    stay counted instead: never given back twice (rule 3)."""
    off = make_off(tier)
    x = torch.randn(1 << 12, requires_grad=True)
    leaked = nth = 0
    while True:
        nth += 1
        loss, held = _graph(off, x)
        with _unraisable() as caught, _interrupt_at(nth) as where:
            del loss
        if not where:
            break
        assert caught == [KeyboardInterrupt]
        other, _ = _graph(off, x)
        del other                        # the next handle's death
        if where[0] in _CLAIMED_WINDOWS:
            leaked += held
        assert _in_use(off, tier) == leaked, f"interrupted at {where[0]}"
    assert nth > 6   # the sweep went through the release
    assert leaked <= 2 * held


def test_a_release_that_fails_is_given_up_and_holds_back_no_other(make_off):
    """A release that raises an ``Exception`` (a bug, not an interruption) is
    given up, as Python gives up a ``__del__`` that raises: it is not run
    again at every later death, nor does it keep the later ones from running."""
    off = make_off("cpu")
    x = torch.randn(1 << 12, requires_grad=True)
    loss, held = _graph(off, x)

    with tiermem.testing.failing_host_releases(RuntimeError("a bug")), _unraisable() as caught:
        del loss
    assert caught == [RuntimeError]
    for _ in range(2):
        other, _ = _graph(off, x)
        with _unraisable() as caught:
            del other
        assert caught == []
    assert _in_use(off, "cpu") == held


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_launch_interrupted_gives_its_reservation_back_once(make_off, monkeypatch, tier):
    """A KeyboardInterrupt raised where the move out is submitted: ``_launch``
    gives the reservation back, and the handle, when it dies, does not give it
    back a second time (the pool would hand one buffer to two tensors)."""
    off = make_off(tier)
    if tier == "cpu":
        def interrupted(self, src, dst):
            raise KeyboardInterrupt
        monkeypatch.setattr(tiermem.runtime.copier.ThreadCopier, "copy_out", interrupted)
    else:
        class Interrupted:
            def __init__(self, f):
                self._f = f

            def write(self, buf, offset):
                raise KeyboardInterrupt

            def __getattr__(self, name):
                return getattr(self._f, name)
        tiermem.testing.set_nvme_file(off, Interrupted(tiermem.testing.nvme_file(off)))
    x = torch.randn(1 << 12, requires_grad=True)
    with pytest.raises(KeyboardInterrupt):
        with off:
            a = x.exp()
            a.sin()       # a later op's pack launches exp's move
    del a
    assert _in_use(off, tier) == 0
    if tier == "cpu":
        pool = tiermem.testing.store_of(off, tiermem.Tier.CPU).pool
        one, two = pool.acquire(1 << 14, pinned=False), pool.acquire(1 << 14, pinned=False)
        assert one is not two
        pool.release(one)
        pool.release(two)


def test_reading_del_of_a_live_handle_does_not_release_it(make_off, monkeypatch):
    """A debugger listing a live handle's attributes reads ``__del__``: the
    handle is kept, not released, while other handles die (rule 4)."""
    off = make_off("cpu")
    handles = []
    put = moving.MovingStore.put

    def capturing(self, t, step, module=""):
        h = put(self, t, step, module)
        handles.append(h)
        return h
    monkeypatch.setattr(moving.MovingStore, "put", capturing)
    x = torch.randn(1 << 12, requires_grad=True)
    loss, held = _graph(off, x)
    monkeypatch.undo()
    [h] = handles
    h.__del__           # a read, not a call
    other, _ = _graph(off, x)
    del other           # a release: it must leave h alone
    assert _in_use(off, "cpu") == held
    loss.backward()
    assert torch.equal(x.grad, x.detach().exp())
    tiermem.testing.release_kept_handle(h)   # what rule 4 leaves behind, dropped: h dies now
    del h, handles[:], loss
    assert _in_use(off, "cpu") == 0
