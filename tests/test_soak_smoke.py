"""The soak benchmark (benchmarks/soak.py) in short, and its verdict."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import soak  # noqa: E402


def _sample(step, **over):
    s = {"step": step, "rss_bytes": 500 << 20, "pooled_held_bytes": 10 << 20, "open_fds": 20,
         "threads": 8, "nvme_files": 2, "nvme_dir_bytes": 4 << 20}
    s.update(over)
    return s


def test_verdict_flags_growth_after_warmup_only():
    flat = [_sample(10, rss_bytes=100 << 20), _sample(20), _sample(30), _sample(40)]
    assert soak.verdict(flat, warmup=15, moved_bytes=1 << 20)["ok"]
    leaking = [_sample(20), _sample(30, pooled_held_bytes=12 << 20),
               _sample(40, pooled_held_bytes=14 << 20, threads=12)]
    v = soak.verdict(leaking, warmup=15, moved_bytes=1 << 20)
    assert not v["ok"] and set(v["grew"]) == {"pooled_held_bytes", "threads"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fixed", "varying"])
def test_short_soak_is_flat_and_leaves_nothing(tmp_path, mode):
    for policy in soak.POLICIES:
        run = soak.soak_one(policy, mode, steps=40, every=10, warmup=10, width=256,
                            nvme_root=str(tmp_path))
        assert run["verdict"]["ok"], (policy, mode, run["verdict"])
        assert run["left_in_nvme_dir_after_close"] == {"files": 0, "bytes": 0}
    assert os.listdir(tmp_path) == []
