"""Seams into the planner of a ``policy="auto"`` Offloader: its profiles, a
plan made to order, the checks of steps against plans, and the pieces of its
cost model and rank agreement that tests check one by one."""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from ._patch import patched

__all__ = [
    "planner_of",
    "solver_finds_nothing",
    "kept_profiles",
    "plan_for",
    "plan_checks_see",
    "planned_device",
    "probed_device",
    "move_cpu_round_trip",
    "tracking_prices",
    "agreed_timeline",
    "agreed_rate_fields",
    "agreement_row",
    "set_use_times",
]


def planner_of(off):
    """The :class:`~tiermem.planner.Planner` of a ``policy="auto"`` Offloader
    (``profiles``: profiled steps so far; ``plans``: plans by step signature),
    ``None`` for other policies."""
    from ..planner import Planner
    decider = getattr(off, "_decider", None)
    return decider if isinstance(decider, Planner) else None


@contextlib.contextmanager
def solver_finds_nothing() -> Iterator[None]:
    """Plans made inside get no choice from the planner's solver, as when it
    hits its time limit without one: the greedy's choice stands."""
    from ..planner import milp
    with patched(milp.Model, "solve",
                 lambda self, *a, **k: (None, "no solution within the time limit")):
        yield


def kept_profiles(off) -> Mapping[tuple, Any]:
    """The profiles the planner of ``off`` keeps, by step signature (a plan's
    ``keys``): a read-only live view of the planner's own
    :class:`~tiermem.planner.profile.Profile` objects."""
    return types.MappingProxyType(planner_of(off)._profiles)


def plan_for(off, profile, target_bytes: int):
    """A new plan the planner of ``off`` makes for ``profile`` (one of
    :func:`kept_profiles`), aiming at ``target_bytes`` kept instead of its
    budget; the planner does not follow it unless made ``current``."""
    return planner_of(off)._plan(profile, target=target_bytes)


@contextlib.contextmanager
def plan_checks_see(edit: Callable[[Any, Any, Optional[list]], Optional[list]]
                    ) -> Iterator[None]:
    """While inside, each check of a step against its plan (the closed loop)
    first calls ``edit(plan, stats, gpu_waits)``, which may change ``stats``
    and returns the ``gpu_waits`` (CUDA event pairs, or ``None``) to check
    with. Process-wide."""
    from ..planner.lifecycle import Planner
    check = Planner._check

    def edited(self, plan, stats, gpu_waits=None):
        return check(self, plan, stats, edit(plan, stats, gpu_waits))

    with patched(Planner, "_check", edited):
        yield


def planned_device(records) -> Optional[str]:
    """The CUDA device, as named there, of the first CUDA tensor among a
    profile's ``records`` (each with ``.device``), else ``None``: the device
    whose links and free memory the planner reads."""
    from ..planner.planning import _cuda_of
    return _cuda_of(records)


def probed_device(cuda):
    """The ``torch.device`` the rate probes measure for ``cuda`` (a device
    name, ``True``: the current one), ``None`` for ``False``, a CPU name, or
    where CUDA is not available."""
    from ..planner.rates import _cuda_device
    return _cuda_device(cuda)


def move_cpu_round_trip(f, srcs: List) -> None:
    """Run the ``move_cpu`` rate probe's round trip of the float32 tensors
    ``srcs`` through ``f`` (``write(t, offset)`` and ``read(t, offset)``,
    each returning a job with ``wait()``)."""
    from ..planner.rates import _round_trip
    _round_trip(f, srcs)


def tracking_prices(best: Callable[..., float]) -> Tuple[float, float]:
    """``(track_op_s, track_call_s)`` from a new run of the tracking-price
    probe (none cached) whose runs ``best(fn, repeats, clock)`` times
    (``fn.__name__``: ``chain``, ``tracked`` or ``gated``). The process's
    cached prices are left as they were."""
    from ..planner import rates
    with patched(rates, "_track_cache", []), patched(rates, "_best", best):
        return rates._tracking_cost()


def agreed_timeline(profile) -> List[float]:
    """The figures of ``profile`` that the ranks' exchange broadcasts from
    the rank whose timeline is chosen (NaN: no figure)."""
    from ..planner.agree import _timeline
    return _timeline(profile)


def agreed_rate_fields() -> set:
    """The fields of :class:`~tiermem.planner.rates.Rates` the ranks agree on
    (each the slowest, or the largest charge, of every rank's)."""
    from ..planner import agree
    return set(agree._RATES_MIN + agree._RATES_MAX)


def agreement_row(row: List[float]) -> Dict[str, float]:
    """The named figures of a rank's row in the exchange: ``rank`` and
    ``structure_hash`` (NaN: the rank has no figure)."""
    from ..planner import agree
    return {"rank": row[agree._RANK], "structure_hash": row[agree._HASH]}


def set_use_times(profile) -> None:
    """Give each record of ``profile`` the time of use the cost model prices
    it by, as :func:`~tiermem.planner.solver.make_plan` does first: its
    ``first_use_s``, or the backward's start if backward never read it (what
    :func:`~tiermem.planner.costs.options_of` needs set)."""
    bwd = profile.backward_start_s
    if bwd is None:
        bwd = profile.forward_end_s
    for r in profile.records:
        r._use = r.first_use_s if r.first_use_s is not None else bwd
