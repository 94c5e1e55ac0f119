"""tiermem.offload(): the one-shot form's per-thread cache of Offloaders."""

import gc
import os

import torch

import tiermem
import tiermem.testing


def _chain(x):
    return x.sin().cos().exp()


def test_same_settings_reuse_one_offloader(tmp_path):
    a = tiermem.offload(policy="cpu", min_offload_bytes=0)
    assert tiermem.offload(policy="cpu", min_offload_bytes=0) is a


def test_evicting_an_offloader_never_loses_saved_tensors(tmp_path):
    """More distinct settings than the cache holds, each a micro-batch whose
    backward comes after all of them (gradient accumulation): the evicted
    Offloaders must stay usable until their graphs are gone, and are closed
    (their directories removed) once they are."""
    n = tiermem.testing.oneshot_cache_size() + 1
    xs = [torch.randn(1 << 12, requires_grad=True) for _ in range(n)]
    refs = []
    for x in xs:
        _chain(x).sum().backward()
        refs.append(x.grad.clone())
        x.grad = None
    outs, dirs = [], []
    for i, x in enumerate(xs):
        d = tmp_path / f"d{i}"
        d.mkdir()
        dirs.append(d)
        # A new lambda each time: a new Config, a new cache entry.
        with tiermem.offload(policy=lambda info: "nvme", nvme_dir=str(d), min_offload_bytes=0):
            outs.append(_chain(x))
    assert os.listdir(dirs[0]), "the first micro-batch's tensors are on disk"
    for out, x, ref in zip(outs, xs, refs):
        out.sum().backward()
        assert torch.equal(x.grad, ref)
    del outs, out
    gc.collect()
    tiermem.offload(policy="cpu")          # the next call closes what is no longer used
    assert os.listdir(dirs[0]) == [], "an evicted Offloader was never closed"


def test_a_step_is_not_in_use_once_its_graph_is_gone_without_the_collector(tmp_path):
    """A step is freed by reference counting alone when its graph goes: no
    reference cycle keeps it (``Offloader.in_use``, and offload()'s closing of
    evicted Offloaders, would otherwise wait for the cyclic collector)."""
    x = torch.randn(1 << 12, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        for policy in ("keep", "cpu", "nvme", "recompute", "recompute,cpu"):
            off = tiermem.Offloader(policy=policy, nvme_dir=str(tmp_path / policy),
                                    min_offload_bytes=0, engine="python")
            with off:
                y = _chain(x)
            assert off.in_use
            y.sum().backward()
            del y
            assert not off.in_use, f"{policy}: the step outlived its graph"
            off.close()
    finally:
        gc.enable()
