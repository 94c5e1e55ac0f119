"""The order of the suite's interleaved steps (NOTE [Order of the interleaved
steps] in benchmarks/suite/roles.py): balanced for the immediate predecessor,
so that a configuration that slows the step after it biases no one's ratio."""

from __future__ import annotations

import os
import statistics
import sys
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import models_bench  # noqa: E402
from benchmarks.suite import roles  # noqa: E402
from benchmarks.suite.budgets import paired_ratios  # noqa: E402


def _cycle(n):
    return n if n % 2 == 0 else 2 * n


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 11, 12])
def test_every_configuration_follows_every_other_equally_often(n):
    names = [f"c{i}" for i in range(n)]
    follows, at = Counter(), Counter()
    for i in range(_cycle(n)):
        order = roles.round_order(names, i)
        assert sorted(order) == sorted(names)
        follows.update(zip(order, order[1:]))
        at.update((name, pos) for pos, name in enumerate(order))
    times = 1 if n % 2 == 0 else 2
    assert len(follows) == n * (n - 1)            # every ordered pair occurs ...
    assert set(follows.values()) == {times}       # ... equally often
    assert set(at.values()) == {times}            # and every position too


def test_order_depends_on_round_and_count_only():
    names = ["a", "b", "c"]
    assert roles.round_order(names, 7) == roles.round_order(names, 7 + 6)
    assert roles.round_order(["x"], 3) == ["x"]
    assert roles.round_order([], 0) == []


class _FakeRunner:
    """A configuration whose step takes 1 s, 1.1 s right after ``slows_next``."""

    last = None

    def __init__(self, name):
        self.name = name
        self.model = self.opt = None
        self.extra = {}

    def step(self, x, y, seed, on_phase=None):
        dt = 1.1 if _FakeRunner.last == "slows_next" else 1.0
        _FakeRunner.last = self.name
        return 0.0, dt, {"forward": dt / 2, "backward": dt / 2, "optimizer": 0.0}

    def tiermem_stats(self):
        return None

    def peer_stats(self):
        return None

    def close(self):
        pass

    release = close


def _victim_ratios(monkeypatch):
    monkeypatch.setattr(models_bench, "build_model", lambda spec, device, seed: None)
    monkeypatch.setattr(models_bench, "make_runner",
                        lambda name, base, spec, device, opts: _FakeRunner(name))
    monkeypatch.setattr(models_bench, "make_batches",
                        lambda spec, device, n, seed: [(None, None)] * n)
    monkeypatch.setattr(models_bench, "tensor_state_bytes", lambda m, o: {})
    monkeypatch.setattr(models_bench, "state_fingerprint", lambda m, o: "")
    _FakeRunner.last = None
    names = ["baseline", "a", "b", "slows_next", "victim"]
    opts = {"device": "cpu", "spec": {}, "seed": 0, "configs": names, "warmup": 0,
            "steps": _cycle(len(names)), "max_step_seconds": 10.0}
    res = roles.role_interleaved(opts)["configs"]
    base = res["baseline"]
    return {name: statistics.median(paired_ratios(res[name]["times"], res[name]["rounds"],
                                                  base["times"], base["rounds"]))
            for name in ("a", "b", "victim")}


def test_a_slow_predecessor_biases_no_paired_ratio(monkeypatch):
    assert _victim_ratios(monkeypatch) == pytest.approx({"a": 1.0, "b": 1.0, "victim": 1.0})


def test_a_rotated_order_gave_the_successor_a_fixed_penalty(monkeypatch):
    # The suite's order before the note: one order rotated each round, so
    # "victim" always ran right after "slows_next" (what the note fixes).
    monkeypatch.setattr(roles, "round_order",
                        lambda names, i: list(names)[i % len(names):] + list(names)[:i % len(names)])
    assert _victim_ratios(monkeypatch)["victim"] == pytest.approx(1.1)
