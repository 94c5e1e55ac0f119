"""Offloader.store_stats(): what the moving tiers hold, read without private attributes."""

import torch

import tiermem


def _chain(x, n=4):
    for _ in range(n):
        x = x.sin()
    return x


def test_store_stats_count_host_bytes_in_use_until_the_graph_is_freed():
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    x = torch.randn(1 << 14, requires_grad=True)
    with off:
        y = _chain(x)
    during = off.store_stats()["cpu"]
    assert during["host_in_use_bytes"] >= 3 * (1 << 16)   # x is a leaf: kept
    assert during["host_held_bytes"] >= during["host_in_use_bytes"]
    assert during["pinned_returns"] == 0 and "nvme" not in off.store_stats()
    y.sum().backward()
    del y
    after = off.store_stats()["cpu"]
    assert after["host_in_use_bytes"] == 0
    assert after["host_held_bytes"] >= during["host_in_use_bytes"]   # pooled for reuse
    off.close()


def test_store_stats_of_the_nvme_tier_name_the_disk(tmp_path):
    off = tiermem.Offloader(policy="nvme", min_offload_bytes=0, nvme_dir=str(tmp_path))
    x = torch.randn(1 << 14, requires_grad=True)
    with off:
        y = _chain(x)
    nvme = off.store_stats()["nvme"]
    assert nvme["disk_used_bytes"] >= 3 * (1 << 16)
    assert nvme["disk_file_bytes"] >= nvme["disk_used_bytes"]
    y.sum().backward()
    off.close()


def test_store_stats_of_a_disabled_offloader_are_empty(monkeypatch):
    monkeypatch.setenv("TIERMEM_DISABLE", "1")
    assert tiermem.Offloader(policy="cpu").store_stats() == {}
