"""The suite's budget analysis: which rows meet the planner's budgets and the
auto rows' paired step ratios (NOTE [Paired step ratios] in
benchmarks/suite/budgets.py), on made-up runs."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.suite import budgets  # noqa: E402
from benchmarks.suite.markdown import _budget_lines  # noqa: E402

MIB = 1 << 20


def _row(held_mib, times, rounds=None, keep_mib=None, cpu_mib=0):
    e = {"status": "ok", "timing_mode": "interleaved", "forward_held_bytes": held_mib * MIB,
         "step_seconds": {"median": sorted(times)[len(times) // 2]},
         "interleaved": {"status": "ok", "times": list(times)}}
    if rounds is not None:
        e["interleaved"]["rounds"] = list(rounds)
    if keep_mib is not None:
        e["tiermem"] = {"last_step": {"bytes_by_tier": {"keep": keep_mib * MIB,
                                                        "cpu": cpu_mib * MIB}}}
    return e


def _run(configs):
    return {"device": "cpu", "configs": configs}


def _noisy(base, n, factor=1.0, spread=0.3):
    """Per-round times of a machine whose speed drifts a lot from round to round."""
    return [base * factor * (1 + spread * ((r * 7919) % 13) / 13) for r in range(n)]


def test_paired_ratio_sees_through_round_to_round_drift():
    # Every round is slow or fast for all configurations alike; auto is 1% faster.
    n = 21
    other = _noisy(4.0, n)
    auto = [t * 0.99 for t in other]
    res = _run({"baseline": _row(1000, _noisy(3.5, n)),
                "tiermem_keep": _row(1000, _noisy(3.6, n), keep_mib=1000),
                "tiermem_nvme": _row(40, other, keep_mib=20),
                "tiermem_auto_50": _row(480, auto, keep_mib=490)})
    ba = budgets.budget_analysis(res)
    e = ba["by_budget"]["0.5"]
    assert e["meeting"] == ["tiermem_auto_50", "tiermem_nvme"]
    pair = e["auto"]["tiermem_auto_50"]["paired"]["tiermem_nvme"]
    assert pair["median"] == pytest.approx(0.99)
    assert pair["high"] == pytest.approx(0.99) and pair["n"] == n
    assert e["auto"]["tiermem_auto_50"]["bar_verdict"] == "met with margin"
    # Not evaluated at 25%: it does not meet it, and its name says 50%.
    assert "tiermem_auto_50" not in ba["by_budget"]["0.25"]["auto"]


def test_verdicts_margin_noise_and_not_met():
    n = 15
    other = [4.0] * n
    noisy = [4.0 * (0.9 if r % 2 else 1.12) for r in range(n)]   # median 1.0..1.12 spread
    slow = [4.0 * 1.1] * n
    mk = lambda auto: budgets.budget_analysis(_run({   # noqa: E731
        "baseline": _row(1000, other), "tiermem_nvme": _row(40, other),
        "tiermem_auto_50": _row(400, auto)}))["by_budget"]["0.5"]["auto"]["tiermem_auto_50"]
    assert mk(noisy)["bar_verdict"] == "within the noise"
    assert mk(slow)["bar_verdict"] == "not met"
    assert mk([3.9] * n)["bar_verdict"] == "met with margin"


def test_pairs_only_rounds_both_measured():
    # nvme failed after round 2 of 6: auto is paired over rounds 0-2 only.
    assert budgets.paired_ratios([2, 2, 2, 2, 2, 2], range(6), [1, 4, 2], [0, 1, 2]) == [2, 0.5, 1]
    assert budgets.paired_ratios([1, 1], [0, 5], [1, 1], [1, 2]) == []
    assert budgets.median_ci([1.0, 1.0]) is None   # too few rounds for an interval


def test_interval_is_seeded_and_brackets_the_median():
    vals = [0.9, 1.1, 1.0, 0.95, 1.05, 1.2, 0.85, 1.0, 1.02]
    a, b = budgets.median_ci(vals), budgets.median_ci(vals)
    assert a == b
    assert a["low"] <= a["median"] <= a["high"] and a["low"] < a["high"]


def test_cpu_tier_bytes_count_as_ram_and_json_round_trip():
    res = _run({"baseline": _row(1000, [3.0] * 5),
                "tiermem_keep": _row(1000, [3.0] * 5, keep_mib=1000),
                # holds 300 MiB in its forward, plus 300 MiB in host buffers: misses 50%
                "tiermem_cpu": _row(300, [3.1] * 5, keep_mib=100, cpu_mib=300),
                "tiermem_auto": _row(450, [3.0] * 5, keep_mib=450)})
    ba = budgets.budget_analysis(res)
    assert ba["rows"]["tiermem_cpu"]["meets"] == {"0.5": False, "0.25": False}
    assert ba["by_budget"]["0.5"]["meeting"] == ["tiermem_auto"]
    assert ba["by_budget"]["0.5"]["auto"]["tiermem_auto"]["bar_verdict"] == (
        "no other configuration meets it")
    res["budget_analysis"] = json.loads(json.dumps(ba))
    text = "\n".join(_budget_lines(res))
    assert "fastest meeting 50%: tiermem_auto" in text
    assert "no other configuration meets it" in text


def test_no_analysis_on_cuda_or_without_baseline():
    assert budgets.budget_analysis({"device": "cuda", "configs": {}}) is None
    assert budgets.budget_analysis(_run({"tiermem_auto": _row(1, [1.0])})) is None
