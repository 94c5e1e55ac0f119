"""The prefetch schedule on its own (tiermem/runtime/prefetch.py), with stand-in handles:
the window's accounting when restores are taken, and when their handles die."""

import gc

from tiermem.runtime.prefetch import Prefetcher


class _Store:
    def __init__(self):
        self.started = []

    def prefetch(self, h):
        self.started.append(h.name)
        return True


class _Handle:
    def __init__(self, store, name, nbytes):
        self.store, self.name, self.nbytes = store, name, nbytes


def _step(n, nbytes=10, budget=30):
    store = _Store()
    p = Prefetcher(budget)
    handles = [_Handle(store, i, nbytes) for i in range(n)]
    entries = [p.add(h, nbytes) for h in handles]
    return p, store, handles, entries


def _unpack(p, entry):
    with p.lock:
        more = p.begin_use(entry)
        p.advance(entry)
    return more


def test_window_fills_below_the_unpacked_handle_and_stops_at_the_budget():
    p, store, handles, entries = _step(10)
    _unpack(p, entries[9])
    assert store.started == [8, 7, 6] and p.inflight_bytes == 30


def test_taking_a_prefetched_restore_frees_its_window_bytes():
    p, store, handles, entries = _step(10)
    _unpack(p, entries[9])
    _unpack(p, entries[8])               # taken: 10 bytes back, one more started
    assert store.started == [8, 7, 6, 5] and p.inflight_bytes == 30


def test_a_handle_dying_with_its_restore_in_flight_frees_its_window_bytes():
    p, store, handles, entries = _step(10)
    _unpack(p, entries[9])
    assert p.inflight_bytes == 30
    handles[8] = handles[7] = None       # their graphs were dropped, restores unused
    gc.collect()
    _unpack(p, entries[6])               # taken; and the two dead ones are noticed
    assert p.inflight_bytes == 30 and store.started == [8, 7, 6, 5, 4, 3]


def test_dead_handles_are_skipped_and_cost_nothing():
    p, store, handles, entries = _step(6)
    handles[3] = handles[4] = None
    gc.collect()
    _unpack(p, entries[5])
    assert store.started == [2, 1, 0]


def test_uses_of_a_tensor_saved_twice_count_within_one_pass():
    p, store, handles, entries = _step(3)
    p.share(entries[2])
    assert _unpack(p, entries[2]) == 1   # one more use to come in this pass
    assert _unpack(p, entries[2]) == 0
    assert _unpack(p, entries[2]) == 1   # retain_graph: a new pass begins
