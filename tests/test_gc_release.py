"""Graphs freed by Python's cyclic collector release their handles from a
finalizer, at whatever allocation the collector ran: possibly inside a lock of
tiermem's on the same thread. NOTE [Releases from finalizers] in memory/hostpool.py."""

import contextlib
import gc
import threading

import pytest
import torch

import tiermem
import tiermem.testing


class _CollectingJob:
    """A finished job whose ``done()`` runs the collector: the pool calls it
    under its lock, so this is the collector running inside the lock."""

    def done(self):
        gc.collect()
        return True


def _step_whose_graph_only_a_cycle_holds(off, x):
    with off:
        loss = x.sin().cos().exp().sum()
    tiermem.testing.store_of(off, tiermem.Tier.CPU).drain()
    tiermem.testing.poll(off)              # every move landed: handles hold pool buffers
    junk = [loss]
    junk.append(junk)                      # only this cycle holds the graph now


def test_handles_freed_by_the_collector_inside_the_pool_lock_do_not_deadlock():
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    pool = tiermem.testing.store_of(off, tiermem.Tier.CPU).pool
    x = torch.randn(1 << 12, requires_grad=True)
    spare = pool.acquire(1 << 15, pinned=False)   # a class the step does not use
    pool.release(spare, _CollectingJob())  # the next acquire of its class asks done()
    gc.disable()                           # the cycle must survive until then
    try:
        _step_whose_graph_only_a_cycle_holds(off, x)
        assert pool.in_use_bytes >= 2 * (1 << 14)   # cos and exp saved a moved tensor each
        got = []
        t = threading.Thread(target=lambda: got.append(pool.acquire(1 << 15, pinned=False)),
                             daemon=True)
        t.start()
        t.join(30)
    finally:
        gc.enable()
    assert not t.is_alive(), "deadlock: a handle freed by the collector waited for the pool lock"
    assert got and got[0] is not None
    pool.release(got[0])
    assert pool.in_use_bytes == 0, "the buffers of the collected graph were not given back"
    off.close()


def test_many_steps_with_graphs_left_to_the_collector_stay_flat():
    """Every other step's graph is left to the collector (a stored exception's
    traceback does this in real code); the pool must neither hang nor grow."""
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    threshold = gc.get_threshold()
    gc.set_threshold(50)                   # collections land at many allocation points
    try:
        for step in range(60):
            with off:
                loss = model(torch.randn(32, 64)).square().mean()
            if step % 2:
                junk = [loss]
                junk.append(junk)
                del junk, loss
            else:
                loss.backward()
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert off.host_bytes_in_use == 0
    off.close()


@pytest.mark.parametrize("policy", ["cpu", "nvme", "recompute", "recompute,cpu"])
def test_a_collection_at_every_allocation_changes_nothing(tmp_path, policy):
    """gc.set_threshold(1): the collector runs at nearly every allocation, so
    finalizers run at every point of tiermem's code; steps with graphs left to
    the collector every other time stay exact and never hang."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 32))
    xs = [torch.randn(16, 32) for _ in range(4)]

    def grads(ctx_of):
        out = []
        for i, x in enumerate(xs):
            model.zero_grad()
            with ctx_of():
                loss = model(x).square().mean()
            loss.backward()
            out.append([p.grad.clone() for p in model.parameters()])
            if i % 2:          # also leave a graph to the collector
                with ctx_of():
                    junk = [model(x).sum()]
                junk.append(junk)
                del junk
        return out

    ref = grads(contextlib.nullcontext)
    off = tiermem.Offloader(policy=policy, nvme_dir=str(tmp_path), min_offload_bytes=0)
    got, threshold = [], gc.get_threshold()
    t = threading.Thread(target=lambda: got.append(grads(lambda: off)), daemon=True)
    gc.set_threshold(1)
    try:
        t.start()
        t.join(120)
    finally:
        gc.set_threshold(*threshold)
    assert not t.is_alive(), "a step hung with the collector running at every allocation"
    for g, r in zip(got[0], ref):
        assert all(torch.equal(a, b) for a, b in zip(g, r))
    gc.collect()
    assert off.host_bytes_in_use == 0
    off.close()
