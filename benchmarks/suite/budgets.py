"""Which configurations meet the planner's budgets (CPU runs), and how the
``auto`` rows compare with the others *paired by round*.

# NOTE [Paired step ratios]
# Issue 12's bar is "auto's step <= 1.02x the fastest configuration meeting
# the same budget". On a shared 2-core machine one configuration's steps
# range over 2x within a run, so two medians differing by 3% say nothing.
# The interleaved run times every configuration once per round, one after
# another (in an order balanced over the rounds: NOTE [Order of the
# interleaved steps] in roles.py), so a slow spell of the machine slows
# every configuration of that round alike. The
# ratio auto / other is taken per round (rounds both ran and measured), and
# its median is reported with a bootstrap confidence interval (rounds
# resampled with replacement, seeded: the same JSON always gives the same
# interval). The bar is *shown* only when the interval's upper end is at or
# below 1.02 against every configuration meeting the budget; a median below
# 1.02 with an interval reaching above is reported as "within the noise".

Computed by :func:`budget_analysis` from a finished run's JSON (``finalize``
stores it as ``res['budget_analysis']``; the Markdown report renders it).
"""

from __future__ import annotations

import random
import statistics
from typing import Dict, List, Optional, Sequence

#: Budgets of the planner's bar (issue 12), as shares of the baseline, and the
#: tolerance on the measured bytes (KEPT_TOLERANCE in tiermem/planner/runtime.py).
BUDGETS = (0.5, 0.25)
TOLERANCE = 0.05
#: The bar on auto's step time against the fastest configuration meeting its budget.
STEP_BAR = 1.02
#: Bootstrap settings of NOTE [Paired step ratios].
CI_LEVEL = 0.90
RESAMPLES = 2000


def paired_ratios(times_a: Sequence[float], rounds_a: Sequence[int],
                  times_b: Sequence[float], rounds_b: Sequence[int]) -> List[float]:
    """``a / b`` per round that both measured (``rounds_*[i]`` is the round of
    ``times_*[i]``), in round order."""
    by_round = dict(zip(rounds_b, times_b))
    return [ta / by_round[r] for ta, r in zip(times_a, rounds_a)
            if r in by_round and by_round[r] > 0]


def median_ci(values: Sequence[float], level: float = CI_LEVEL,
              resamples: int = RESAMPLES, seed: int = 0) -> Optional[dict]:
    """Median of ``values`` and a percentile-bootstrap interval of it at
    ``level`` (``None`` for fewer than 3 values: no interval worth the name)."""
    vals = list(values)
    if len(vals) < 3:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(vals, k=len(vals))) for _ in range(resamples))
    lo_i = int((1 - level) / 2 * resamples)
    hi_i = min(resamples - 1, int((1 + level) / 2 * resamples))
    return {"median": statistics.median(vals), "low": meds[lo_i], "high": meds[hi_i],
            "level": level, "n": len(vals)}


def _auto_at(name: str, share: float) -> bool:
    """Whether configuration ``name`` is an auto row planned for budget
    ``share``: ``tiermem_auto_50`` for 0.5; ``tiermem_auto`` (no budget in
    its name) for every budget it meets."""
    if not name.startswith("tiermem_auto"):
        return False
    suffix = name[len("tiermem_auto"):].lstrip("_")
    return not suffix or (suffix.isdigit() and int(suffix) == round(share * 100))


def _verdict(pairs: list) -> str:
    """The bar against the paired intervals of the other configurations
    meeting the budget (NOTE [Paired step ratios]): "met with margin" when
    every interval ends at or below the bar, "not met" when one starts above
    it, else "within the noise" (also when an interval is missing)."""
    if not pairs:
        return "no other configuration meets it"
    if all(v is not None and v["high"] <= STEP_BAR for v in pairs):
        return "met with margin"
    if any(v is not None and v["low"] > STEP_BAR for v in pairs):
        return "not met"
    return "within the noise"


def _rounds_of(e: dict) -> Optional[tuple]:
    """(times, rounds) of a configuration's interleaved run; rounds are
    numbered 0.. over the measured rounds when the run did not record them
    (a run before rounds were recorded: every configuration measured every
    round until it stopped)."""
    inter = e.get("interleaved") or {}
    times = inter.get("times")
    if not times or e.get("timing_mode") != "interleaved":
        return None
    rounds = inter.get("rounds") or list(range(len(times)))
    return [float(t) for t in times], list(rounds)


def budget_analysis(res: dict) -> Optional[dict]:
    """Per budget share: which configurations meet it, the fastest of them
    (by median step), and for every ``tiermem_auto*`` configuration meeting
    it the paired ratio against each other one meeting it (NOTE [Paired step
    ratios]). ``None`` on CUDA runs or without a baseline's held bytes.

    Two measures of the saved bytes left in RAM: ``forward_held_bytes`` (RSS
    after the forward less before it, isolated run, median) and, for tiermem,
    ``bytes_by_tier['keep']`` of the last step (what the planner's budget
    counts). On the CPU the cpu tier's copies are RAM too (in buffers pooled
    from earlier steps, so the RSS delta misses them): its bytes are added to
    both measures. A configuration meets a budget when both of its measures
    are within budget x baseline + 5% (the baseline's own measure of each kind)."""
    if res.get("device") == "cuda":
        return None
    confs = res["configs"]
    base = confs.get("baseline") or {}
    base_held = base.get("forward_held_bytes")
    if not base_held:
        return None
    base_kept = None
    keep = confs.get("tiermem_keep") or {}
    if (keep.get("tiermem") or {}).get("last_step"):
        base_kept = keep["tiermem"]["last_step"]["bytes_by_tier"]["keep"]
    rows: Dict[str, dict] = {}
    for name, e in confs.items():
        held = e.get("forward_held_bytes")
        st = e.get("step_seconds")
        if held is None or not st:
            continue
        tm = (e.get("tiermem") or {}).get("last_step")
        kept = None
        if tm:
            host = tm["bytes_by_tier"]["cpu"]
            kept = tm["bytes_by_tier"]["keep"] + host
            held += host
        meets = {}
        for b in BUDGETS:
            ok = held <= base_held * b * (1 + TOLERANCE)
            if kept is not None and base_kept:
                ok = ok and kept <= base_kept * b * (1 + TOLERANCE)
            meets[str(b)] = ok
        rows[name] = {"step_median_s": st["median"], "held_bytes": held, "kept_bytes": kept,
                      "meets": meets}
    out = {"budgets": list(BUDGETS), "tolerance": TOLERANCE, "step_bar": STEP_BAR,
           "rows": rows, "by_budget": {}}
    for b in BUDGETS:
        key = str(b)
        meeting = sorted((n for n, r in rows.items() if r["meets"][key]),
                         key=lambda n: rows[n]["step_median_s"])
        entry = {"meeting": meeting, "fastest": meeting[0] if meeting else None, "auto": {}}
        for auto in (n for n in meeting if _auto_at(n, b)):
            a = _rounds_of(confs[auto])
            vs = {}
            for other in meeting:
                if other == auto:
                    continue
                o = _rounds_of(confs[other])
                if a is None or o is None:
                    vs[other] = None
                    continue
                vs[other] = median_ci(paired_ratios(a[0], a[1], o[0], o[1]))
            others = [v for n, v in vs.items() if not n.startswith("tiermem_auto")]
            entry["auto"][auto] = {"paired": vs, "bar_verdict": _verdict(others)}
        out["by_budget"][key] = entry
    return out
