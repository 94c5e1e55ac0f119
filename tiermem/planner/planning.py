"""From a profile to a plan at run time: the budget (a share, a size, or the
free memory; agreed among ranks once; shared by the forwards in flight), the
measured rates (a failed disk probe is retried at the next profile and named
in the plan), the choice with its tracking priced, and the closed loop's
check of a plan's first step (NOTE [Closed loop] in planner/lifecycle.py).

# NOTE [Budget across micro-batches]
# Invariant: what a stage keeps at once stays within ``device_budget`` when
# several forwards are in flight (pipeline schedules, accumulation). Why: a
# step's saved tensors live from its forward to its backward, so k forwards in
# flight keep k steps' bytes at once. The planner reads the most forwards seen
# in flight (the Offloader's backward order, counted at each forward's end)
# and plans each step for ``device_budget / k``; a percentage is already per
# step (a share of what a plain step keeps, so of k steps' too) and is not
# divided. When k grows after a plan was made, the current plan is made again
# from its profile (its closed-loop count unchanged); plans stay shared by
# every step of one signature.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

from ..config import BudgetShare
from ..policy import Tier
from . import agree as _agree
from .plan import Plan
from .profile import Profile
from .signatures import is_resized
from .rates import default_device_budget_bytes, measure_rates
from .solver import make_plan
from .tracking_cost import priced_plan

__all__ = ["PlanMaker", "gpu_stall_seconds", "MAX_REPLANS", "KEPT_TOLERANCE",
           "STALL_TOLERANCE_S"]

_log = logging.getLogger("tiermem")

#: Re-plans of one signature by the closed loop (NOTE [Closed loop]).
MAX_REPLANS = 1
KEPT_TOLERANCE = 0.05
STALL_TOLERANCE_S = 0.002


def _cuda_of(records) -> Optional[str]:
    """The CUDA device of the first CUDA tensor among ``records`` (a
    profile's), as named there (``"cuda:1"``), else ``None``: the device whose
    links and free memory the planner reads (a model on ``cuda:1`` need not
    have made it the current device)."""
    for r in records:
        if r.device.startswith("cuda"):
            return r.device
    return None


class PlanMaker:
    """The plan-making half of :class:`~tiermem.planner.lifecycle.Planner`
    (``_placement``, ``cfg``, ``has_nvme``, ``rates``, ``agreement``,
    ``steps_begun``, ``plans``, ``_profiles``, ``current`` are its)."""

    # -- agreeing with the other ranks (NOTE [Ranks agree once] in planner/agree.py) ----
    def _awaits_ranks(self) -> bool:
        """The first plan waits for the exchange of step AGREE_AT_STEP."""
        return self.steps_begun < _agree.AGREE_AT_STEP and _agree.active(self.cfg.agree_ranks)

    def _agree(self) -> None:
        import torch.distributed as dist
        rec = self._pending
        records = [] if rec is None else rec.records
        cuda = None
        try:   # whatever fails here, this rank must reach the exchange
            cuda = _cuda_of(records)
            rates = self._measure_rates(cuda) if records else None
            default = (default_device_budget_bytes("cuda" if cuda else "cpu", device=cuda)
                       if records and self.cfg.device_budget is None else None)
            profile = rec.finish() if rec is not None and rec.backward_seen else None
        except Exception as e:
            _log.warning("tiermem: auto: this rank's figures could not be measured (%s: %s); "
                         "it agrees with the other ranks without them", type(e).__name__, e)
            rates = default = profile = None
        nvme = self._placement.stores.get(Tier.NVME)
        row = _agree.local_row(dist.get_rank(), rates, self.cfg.device_budget, default,
                               self._placement.cpu_budget_bytes,
                               None if nvme is None else nvme.arena.budget_bytes, profile)
        self.agreement = _agree.exchange(row, profile, cuda)
        if self.agreement is not None:
            if self.agreement.rates is not None:
                self.rates = dataclasses.replace(
                    self.agreement.rates,
                    disk_engine=None if rates is None else rates.disk_engine,
                    disk_probe_error=None if rates is None else rates.disk_probe_error)
            _log.info("tiermem: auto: %s", self.agreement.describe(profile))

    def _measure_rates(self, cuda: Optional[str]):
        return measure_rates(self._placement.stores.get(Tier.NVME), cuda=cuda or False)

    # -- planning ----------------------------------------------------------------------
    def _in_flight(self) -> int:
        """The most forwards in flight at once on this Offloader (at least 1)."""
        order = self._order
        return 1 if order is None else max(1, order.peak_in_flight)

    def _budget(self, profile: Profile) -> tuple:
        """``(bytes, setting)``: one step's share of the budget (NOTE [Budget
        across micro-batches])."""
        a = self.agreement
        setting = self.cfg.device_budget if a is None else a.device_budget
        agreed = "" if a is None else f", smallest of {a.ranks} ranks"
        if isinstance(setting, BudgetShare):
            return int(setting.fraction * profile.baseline_bytes), str(setting) + agreed
        k = self._in_flight()
        per = "" if k == 1 else f", divided among {k} forwards in flight"
        if setting is not None:
            return setting // k, ("device_budget" if a is None or self.cfg.device_budget
                                  is not None else "default: free memory") + agreed + per
        cuda = _cuda_of(profile.records)
        return (default_device_budget_bytes("cuda" if cuda else "cpu", device=cuda) // k,
                "default: free memory" + per)

    def _follow_in_flight(self) -> None:
        """More forwards are in flight than the current plan was made for:
        plan its profile again for the smaller share (NOTE [Budget across
        micro-batches])."""
        plan = self.current
        if (plan is None or is_resized(plan) or isinstance(self.cfg.device_budget, BudgetShare)
                or plan.in_flight >= self._in_flight()):
            return
        profile = self._profiles.get(plan.keys)
        if profile is not None:
            self.current = self._plan(profile, None, plan.rate_factor, plan.replans,
                                      f"{self._in_flight()} forwards in flight")

    def _plan(self, profile: Profile, target: Optional[int] = None, rate_factor: float = 1.0,
              replans: int = 0, reason: str = "") -> Plan:
        placement = self._placement
        if self.rates is None or (target is None and self.rates.disk_probe_error):
            self.rates = self._measure_rates(_cuda_of(profile.records))   # retried
        rates = self.rates if rate_factor == 1.0 else self.rates.scaled(rate_factor)
        budget, setting = self._budget(profile)
        nvme = placement.stores.get(Tier.NVME)
        cpu_room, nvme_room = (placement.cpu_budget_bytes,
                               None if nvme is None else nvme.arena.budget_bytes)
        if self.agreement is not None:   # the smallest of every rank's
            cpu_room, nvme_room = self.agreement.cpu_budget_bytes, self.agreement.nvme_budget_bytes
        plan = priced_plan(profile, rates, functools.partial(
            make_plan, profile, rates, budget if target is None else target, setting,
            has_nvme=self.has_nvme, cpu_budget_bytes=cpu_room,
            nvme_budget_bytes=nvme_room, replans=replans, replan_reason=reason,
            prefetch_bytes=self.cfg.prefetch_bytes))
        plan.budget_bytes = budget
        plan.in_flight = self._in_flight()
        plan.follow(profile.keys, profile.positions)
        plan.rate_factor = rate_factor
        plan.target_bytes = budget if target is None else target
        if target is not None and target < budget:
            plan.notes.append(f"planned to {target} bytes (budget lowered by the measured "
                              "overshoot)")
        if self.agreement is not None:
            plan.notes.append(self.agreement.describe(profile))
        if self.has_nvme and rates.disk_probe_error:
            plan.notes.append(f"nvme: disk probe failed: {rates.disk_probe_error}; the nvme "
                              "tier is left out of this plan and probed again at the next "
                              "profile")
        for note in plan.notes:
            if note.startswith("budget not reachable"):
                _log.warning("tiermem: auto: %s (device_budget: %d bytes, %s)", note,
                             budget, setting)
        self._remember(profile.keys, plan)
        return plan

    def _check(self, plan: Plan, stats, gpu_waits: Optional[list] = None) -> None:
        kept = stats.bytes_by_tier[Tier.KEEP.value]
        stall = stats.stall_seconds
        if gpu_waits:   # NOTE [Stall on the GPU's timeline]
            stall = gpu_stall_seconds(gpu_waits)
        plan.measured_kept_bytes = kept
        plan.measured_stall_s = stall
        plan.measured_steps += 1
        if (plan.replans >= MAX_REPLANS or plan.measured_steps > 1 or is_resized(plan)
                or self.plans.get(plan.keys) is not plan):
            return   # only a plan's first measured step may correct it
        target = getattr(plan, "target_bytes", plan.budget_bytes)
        factor = plan.rate_factor
        why = []
        over = kept - plan.predicted_kept_bytes
        if kept > plan.budget_bytes * (1 + KEPT_TOLERANCE) and over > 0:
            target = max(0, target - over)
            why.append(f"kept {kept} bytes, predicted {plan.predicted_kept_bytes}")
        if stall > plan.predicted_stall_s + max(STALL_TOLERANCE_S, plan.predicted_stall_s / 2):
            factor /= 2
            why.append(f"stall {stall * 1e3:.2f} ms, predicted "
                       f"{plan.predicted_stall_s * 1e3:.2f} ms")
        if not why:
            return
        profile = self._profiles[plan.keys]
        new = self._plan(profile, target, factor, plan.replans + 1, "; ".join(why))
        if self.current is plan:
            self.current = new


def gpu_stall_seconds(waits: list) -> float:
    """Seconds the consumers' streams waited for restores: the sum over
    ``waits`` ((start, end) CUDA timing events, NOTE [Stall on the GPU's
    timeline] in planner/runtime.py); waits for the last of them to complete."""
    for _, end in waits:
        end.synchronize()
    return sum(start.elapsed_time(end) for start, end in waits) / 1e3
