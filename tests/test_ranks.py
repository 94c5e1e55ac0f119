"""Per-rank behaviour under torchrun (issue 13 #3, NOTE [Per-rank budgets] in
tiermem/memory/ranks.py): defaults derived from the node are split among its ranks
(LOCAL_WORLD_SIZE), explicit budgets are per rank, each rank has its own
private NVMe directory named with its rank, and log lines and ``doctor`` name
the rank. The ranks are simulated with the variables torchrun sets; one test
uses a second process as the other rank."""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import tiermem
import tiermem.testing
from tiermem.runtime.placement import default_cpu_budget_bytes, default_staging_bytes
from tiermem.memory.spilldir import YOUNG_SECONDS, default_nvme_budget_bytes

_GiB = 1 << 30
_MiB = 1 << 20


@pytest.fixture
def ranks(monkeypatch):
    """``ranks(rank, local_world_size)`` sets the variables as torchrun would
    (one node: LOCAL_RANK = RANK)."""
    def set_(rank=None, local_world_size=None):
        for name, value in (("RANK", rank), ("LOCAL_RANK", rank),
                            ("LOCAL_WORLD_SIZE", local_world_size)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, str(value))
    set_()
    return set_


def test_default_cpu_budget_is_half_the_available_ram_split_among_the_nodes_ranks(
        ranks, monkeypatch, tmp_path):
    mem = collections.namedtuple("mem", "available total")(8 * _GiB, 16 * _GiB)
    monkeypatch.setattr("psutil.virtual_memory", lambda: mem)
    with tiermem.testing.cgroup_root(tmp_path):   # no memory limit
        assert default_cpu_budget_bytes() == 4 * _GiB
        ranks(0, 4)
        assert default_cpu_budget_bytes() == 1 * _GiB
        off = tiermem.Offloader(policy="cpu")
        try:
            assert off.cpu_budget_bytes == 1 * _GiB
        finally:
            off.close()


def test_default_nvme_budget_is_80_percent_of_free_space_split_among_the_nodes_ranks(
        ranks, monkeypatch, nvme_dir):
    usage = collections.namedtuple("usage", "free total used")(10 * _GiB, 20 * _GiB, 0)
    monkeypatch.setattr("tiermem.memory.spilldir.psutil.disk_usage", lambda path: usage)
    assert default_nvme_budget_bytes("/") == 8 * _GiB
    ranks(1, 2)
    assert default_nvme_budget_bytes("/") == 4 * _GiB
    off = tiermem.Offloader(policy="nvme", nvme_dir=nvme_dir, engine="python")
    try:
        assert tiermem.testing.store_of(off, tiermem.Tier.NVME).arena.budget_bytes == 4 * _GiB
    finally:
        off.close()


@pytest.mark.parametrize("local_world_size, expected_mib", [(1, 256), (2, 128), (8, 64)])
def test_default_staging_pool_is_split_among_the_nodes_ranks_with_a_floor(
        ranks, nvme_dir, local_world_size, expected_mib):
    ranks(0, local_world_size)
    assert default_staging_bytes(None) == expected_mib * _MiB
    assert default_staging_bytes(512 * _MiB) == 512 * _MiB   # a larger prefetch window wins
    off = tiermem.Offloader(policy="nvme", nvme_dir=nvme_dir, engine="python")
    try:
        assert tiermem.testing.staging_pool(off).budget_bytes == expected_mib * _MiB
    finally:
        off.close()


def test_explicit_budgets_are_per_rank(ranks, nvme_dir):
    ranks(3, 4)
    off = tiermem.Offloader(policy="nvme", nvme_dir=nvme_dir, engine="python",
                            cpu_budget="1GiB", nvme_budget="2GiB")
    try:
        assert off.cpu_budget_bytes == _GiB
        assert tiermem.testing.store_of(off, tiermem.Tier.NVME).arena.budget_bytes == 2 * _GiB
    finally:
        off.close()


@pytest.mark.parametrize("value", ["x", "0", "-2"])
def test_a_bad_local_world_size_is_a_config_error_naming_it(ranks, monkeypatch, value):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(tiermem.ConfigError, match=f"LOCAL_WORLD_SIZE='{value}'"):
        tiermem.Offloader(policy="cpu")


def test_each_rank_has_its_own_private_directory_named_with_its_rank(ranks, nvme_dir):
    offs = []
    try:
        for rank in (0, 1):
            ranks(rank, 2)
            offs.append(tiermem.Offloader(policy="nvme", nvme_dir=nvme_dir, engine="python"))
        names = sorted(os.listdir(nvme_dir))
        assert len(names) == 2 and names[0] != names[1]
        assert sorted(n.rsplit("-", 1)[1] for n in names) == ["rank0", "rank1"]
        offs.pop(0).close()
        assert [n for n in os.listdir(nvme_dir)] == [n for n in names if n.endswith("rank1")]
    finally:
        for off in offs:
            off.close()
    assert os.listdir(nvme_dir) == []


_RANK_PROCESS = textwrap.dedent("""
    import os, sys, time
    import tiermem
    off = tiermem.Offloader(policy="nvme", nvme_dir=sys.argv[1], engine="python")
    print(os.listdir(sys.argv[1])[0], flush=True)
    time.sleep(120)
""")


def _age(path):
    old = time.time() - YOUNG_SECONDS - 5
    os.utime(path, (old, old))


def test_a_live_rank_keeps_its_directory_and_a_killed_ranks_is_removed_at_the_next_start(
        ranks, nvme_dir):
    """Another rank (a second process, RANK=1) shares the NVMe dir: this
    rank's start leaves its directory alone while it lives (however old it
    looks); once it is killed with SIGKILL, the next start removes it."""
    env = dict(os.environ, RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               PYTHONPATH=os.pathsep.join(sys.path))
    other = subprocess.Popen([sys.executable, "-c", _RANK_PROCESS, nvme_dir], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        theirs = other.stdout.readline().strip()
        assert theirs.endswith("-rank1"), theirs
        _age(os.path.join(nvme_dir, theirs))
        ranks(0, 2)
        off = tiermem.Offloader(policy="nvme", nvme_dir=nvme_dir, engine="python")
        off.close()
        assert os.listdir(nvme_dir) == [theirs]
        other.send_signal(signal.SIGKILL)
        other.wait(30)
        _age(os.path.join(nvme_dir, theirs))
        off = tiermem.Offloader(policy="nvme", nvme_dir=nvme_dir, engine="python")
        try:
            assert [n for n in os.listdir(nvme_dir) if n.endswith("-rank1")] == []
        finally:
            off.close()
    finally:
        other.kill()
        other.wait(30)


def test_log_lines_name_the_rank(ranks, caplog):
    ranks(1, 2)
    off = tiermem.Offloader(policy="cpu", cpu_budget=0, min_offload_bytes=0)
    try:
        x = torch.randn(64, 64, requires_grad=True)
        with caplog.at_level(logging.WARNING, logger="tiermem"), off:
            loss = (x.exp() * 2).sum()
        loss.backward()
    finally:
        off.close()
    full = [r.getMessage() for r in caplog.records if "cpu tier is full" in r.getMessage()]
    assert full and full[0].startswith("tiermem[rank 1]: the cpu tier is full"), full
    assert caplog.records[-1].tiermem_rank == "rank 1"


def test_log_lines_outside_a_distributed_launch_are_unchanged(ranks, caplog):
    off = tiermem.Offloader(policy="cpu", cpu_budget=0, min_offload_bytes=0)
    try:
        x = torch.randn(64, 64, requires_grad=True)
        with caplog.at_level(logging.WARNING, logger="tiermem"), off:
            (x.exp() * 2).sum().backward()
    finally:
        off.close()
    assert any(r.getMessage().startswith("tiermem: the cpu tier is full") for r in caplog.records)


def _print_report(doctor) -> None:
    """What ``python -m tiermem doctor`` prints (a new diagnosis)."""
    import argparse
    doctor.run(argparse.Namespace(dir=None, mib=256, json=False))


def test_doctor_names_the_rank_and_its_share(ranks, capsys):
    from tiermem import doctor
    ranks(1, 2)
    report = doctor.diagnose()
    assert report["rank"]["label"] == "rank 1" and report["rank"]["ranks_on_node"] == 2
    assert report["default_staging_bytes"] == 128 * _MiB
    _print_report(doctor)
    out = capsys.readouterr().out
    assert "distributed: rank 1, 2 rank(s) on this node" in out


def test_doctor_says_whether_the_ranks_plan_from_agreed_numbers(ranks, capsys, monkeypatch):
    from tiermem import doctor
    ranks(1, 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    _print_report(doctor)
    assert "slowest rates of 4 ranks, agreed once" in capsys.readouterr().out
    monkeypatch.setenv("TIERMEM_AGREE_RANKS", "0")
    _print_report(doctor)
    assert "each rank plans from its own budgets and rates" in capsys.readouterr().out


def test_a_launchers_rank_variable_takes_ascii_digits_only(monkeypatch):
    """``LOCAL_WORLD_SIZE=4_0`` is not 40 (``int()`` would read it so)."""
    from tiermem.memory.ranks import local_world_size
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4_0")
    with pytest.raises(tiermem.ConfigError, match="LOCAL_WORLD_SIZE='4_0'"):
        local_world_size()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", " 4 ")
    assert local_world_size() == 4
