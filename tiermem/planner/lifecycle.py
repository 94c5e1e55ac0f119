"""The planner's life per step signature: which step profiles, which plan a
step follows, when a profile expires. One state machine, per signature (the
(shape, dtype, device) of each saved tensor in pack order):

====================  ===========================================  ====================
state                 event                                        next state
====================  ===========================================  ====================
unseen                the first step of all begins                 profiling
unseen                a step leaves every plan at tensor *i*       requested (that step:
                      (another branch, size, model)                safe order from *i*)
requested             a step begins, no profile pending: it is     profiling
                      profiled; at its first tensor that shows
                      it is another signature it stops profiling
                      (*passed over*) and follows that one's plan
                      from there, or asks for its own profile
requested             passed over REQUEST_ATTEMPTS times           unseen
profiling             its backward has run (next step's start,     planned
                      or ``Offloader.plan``)
profiling             its forward raised, or its graph was freed   requested
                      without backward, or PROFILE_EXPIRY_STEPS
                      steps began before its backward
planned               a step of it begins (whatever plan was       planned (the step
                      current: the first differing tensor finds    follows its plan)
                      it among the cached ones)
planned               its first followed step measures over the    re-planned (at most
                      budget or stall (NOTE [Closed loop])         MAX_REPLANS times)
planned, re-planned   more than MAX_PLANS plans are cached         unseen (least
                                                                   recently used)
====================  ===========================================  ====================

One profile is pending at a time; the other steps meanwhile follow the
current plan (or, before the first, the safe order). A step off every plan is
safe-ordered from where it left, for that step only. So the profiles made are
at most the distinct signatures (plus the closed loop's re-plans, and a new
profile for each one that raised, was dropped or expired).

# NOTE [Plans across sizes]
# Sizes often change from step to step (variable-length batches). The first
# PROFILED_SIZES sizes of a structure are profiled and planned each; after
# that a step whose sizes match no cached plan follows a *resized* view of a
# cached plan of the same structure: at each position the same rank, dtype
# and device (``_Rank``; with a size budget also no more elements than
# planned). Which plan: the one closest in size at the first differing
# position (with a size budget, the closest not smaller; none if all are
# smaller: that step is off its plan). A resized plan moves a checkpointed
# block's inputs by the same rule (``_input_orders``), has no closed loop of
# its own (its prices are the profiled sizes'), and asks the hints callable
# per tensor, its MUST answers being shape-dependent. The caches are bounded:
# MAX_PLANS plans, least recently used dropped first.
#
# NOTE [Closed loop]
# A step that followed a plan is measured when the next step starts (or
# ``Offloader.plan`` is read): its kept bytes (``stats.bytes_by_tier['keep']``)
# and stall (``stats.stall_seconds``) are written into the plan. Kept bytes
# over the budget by more than KEPT_TOLERANCE, and above the prediction,
# re-plan with the budget lowered by the overshoot; a stall above the
# prediction by more than STALL_TOLERANCE_S and half of it re-plans with the
# copy and disk rates halved. Only the first step that followed a plan may
# correct it, at most MAX_REPLANS times, each from the same profile with a
# stricter target: stable after three steps, no oscillation.
"""

from __future__ import annotations

import copy
import logging
from typing import List, Optional

from ..config import BudgetShare
from ..policy import Tier
from . import agree as _agree
from .hints import Hints
from .plan import Plan
from .planning import KEPT_TOLERANCE, MAX_REPLANS, STALL_TOLERANCE_S, PlanMaker, gpu_stall_seconds
from .recorder import Recorder
from .runtime import StepPlanning
from .signatures import END, Rank, Request, is_resized, numel, rank_of
from .solver import safe_order

__all__ = ["Planner", "MAX_REPLANS", "MAX_PLANS", "PROFILED_SIZES", "KEPT_TOLERANCE",
           "STALL_TOLERANCE_S", "PROFILE_EXPIRY_STEPS", "REQUEST_ATTEMPTS",
           "gpu_stall_seconds"]

_log = logging.getLogger("tiermem")

#: Plans (with their profiles) kept per Offloader (NOTE [Plans across sizes]).
MAX_PLANS = 16
#: Sizes of one structure profiled and planned each before other sizes of it
#: follow a resized plan (NOTE [Plans across sizes]).
PROFILED_SIZES = 3
#: Steps begun after a profiled step without its backward having run: the
#: profile is dropped and its signature asks again (gradient accumulation of
#: up to this many micro-batches per backward still plans).
PROFILE_EXPIRY_STEPS = 8
#: Profile attempts that turned out to be other signatures before a request
#: is forgotten (a one-off signature: the last, short batch of an epoch).
REQUEST_ATTEMPTS = 4


class Planner(PlanMaker):
    """The planner of one Offloader (``policy="auto"``); see the module docstring.

    ``profiles``: profiled steps whose forward ended; ``profiles_dropped``:
    those of them dropped (graph freed or expired before backward)."""

    def __init__(self, placement, cfg, hints=None, order=None) -> None:
        self._placement = placement
        self.cfg = cfg
        #: The Offloader's backward order (its ``peak_in_flight``), or None.
        self._order = order
        self.has_nvme = Tier.NVME in placement.stores
        self.safe = {"cpu": safe_order("cpu", self.has_nvme),
                     "cuda": safe_order("cuda", self.has_nvme)}
        #: The ``hints`` callable, asked only off the plan (NOTE [Planner hints]).
        self.hints = None if hints is None else Hints(hints, self.safe)
        #: Plans by step signature (the tuple of keys; NOTE [Following a plan]).
        self.plans: dict = {}
        self._profiles: dict = {}
        #: Resized views of plans, by the keys of the plan they view.
        self._resized_plans: dict = {}
        self.current: Optional[Plan] = None
        self.profiles = 0
        self.profiles_dropped = 0
        #: Signatures asking for a profile (state "requested").
        self.requests: List[Request] = []
        self._pending: Optional[Recorder] = None
        self._pending_at = 0
        self._pending_requests: List[Request] = []
        self._profile_any = True
        self._last = None
        self.rates = None
        #: Steps begun, and the numbers agreed with the other ranks at step
        #: AGREE_AT_STEP, or None (NOTE [Ranks agree once] in planner/agree.py).
        self.steps_begun = 0
        self.agreement: Optional[_agree.Agreement] = None

    # -- the Decider protocol (tiermem/deciders.py) -------------------------------------
    @staticmethod
    def tracking(planning: StepPlanning):
        """Over the whole forward: profiling, safe order, or a plan that
        recomputes and names no scope (NOTE [Scoped tracking] in
        tracking/modules.py); op names for a profile and for hints."""
        return planning.tracking()

    def end_step(self, planning: StepPlanning, stats, failed: bool) -> None:
        self.end_forward(planning, stats, failed)

    # -- per step ----------------------------------------------------------------------
    def begin_step(self) -> StepPlanning:
        """The planning of a step starting now (the module docstring's table).
        At the AGREE_AT_STEP-th step, under torch.distributed, first the
        exchange with the other ranks (NOTE [Ranks agree once] in planner/agree.py)."""
        self.steps_begun += 1
        if self.steps_begun == _agree.AGREE_AT_STEP and _agree.active(self.cfg.agree_ranks):
            self._agree()
        self.settle()
        if self._pending is not None:
            if self.steps_begun - self._pending_at <= PROFILE_EXPIRY_STEPS:
                return StepPlanning(self, self.current, None)
            _log.info("tiermem: auto: the profiled step's backward did not run within %d "
                      "steps; its signature is profiled again", PROFILE_EXPIRY_STEPS)
            self._drop_pending()
        if self._profile_any or self.current is None:
            self._profile_any = False
            return StepPlanning(self, None, Recorder())
        if self.requests:
            return StepPlanning(self, None, Recorder(), wanted=list(self.requests))
        return StepPlanning(self, self.current, None)

    def end_forward(self, sp: StepPlanning, stats, failed: bool) -> None:
        """The step's forward is over (``failed``: it raised)."""
        if sp.recorder is not None:
            if failed:   # its signature is not known: asked again
                self._profile_any = self._profile_any or sp.wanted is None
                return
            satisfied = sp.satisfied(self.plans)
            if satisfied is None:
                self.passed_over(sp.wanted)
                return
            sp.recorder.end_forward()
            self.profiles += 1
            self._pending, self._pending_at = sp.recorder, self.steps_begun
            self._pending_requests = satisfied
            self.requests = [r for r in self.requests if r not in satisfied]
            return
        plan = sp.plan
        if plan is None or failed:   # rule 2 of NOTE [Steps that never reach backward]
            return
        if sp.count != len(plan.orders):   # a shorter step: a plan for it, or a profile
            keys = plan.keys
            plan = None if is_resized(plan) else self.plans.get(keys[:sp.count])
            if plan is None:
                self.request(keys, sp.count, END)
                return
        self.current = plan
        if not sp.mixed:
            self._last = (plan, stats, sp.gpu_waits)

    def settle(self) -> Optional[Plan]:
        """Plan from a profile whose backward ran, and check the last planned
        step (NOTE [Closed loop]); returns the current plan."""
        rec = self._pending
        if rec is not None and rec.graph_dropped:
            _log.info("tiermem: auto: the profiled step's graph was freed without a "
                      "backward; its signature is profiled again")
            self._drop_pending()
            rec = None
        if rec is not None and rec.backward_seen and not self._awaits_ranks():
            self._pending = None
            profile = rec.finish()
            if self.agreement is not None:
                profile = self.agreement.apply(profile)
            self._profiles[profile.keys] = profile
            self.current = self._plan(profile)
            self.requests = [r for r in self.requests if not r.matches(profile.keys)]
        self._follow_in_flight()   # NOTE [Budget across micro-batches] in planner/planning.py
        if self._last is not None:
            plan, stats, gpu_waits = self._last
            self._last = None
            self._check(plan, stats, gpu_waits)
        return self.current

    def _drop_pending(self) -> None:
        """The pending profile is dropped: its signature asks again."""
        self._pending = None
        self.profiles_dropped += 1
        if self._pending_requests:
            self.requests.extend(self._pending_requests)
        else:
            self._profile_any = True
        self._pending_requests = []

    # -- requests (state "requested") ---------------------------------------------------
    def request(self, keys: tuple, index: int, key) -> None:
        """A step left plan ``keys`` at tensor ``index`` (``key`` its
        (shape, dtype, device), or END: the step ended there)."""
        for r in self.requests:
            if r.index == index and r.key == key and r.keys[:index] == keys[:index]:
                r.attempts = 0
                return
        self.requests.append(Request(keys, index, key))
        del self.requests[:-MAX_PLANS]

    def passed_over(self, wanted: List[Request]) -> None:
        """A profile attempt was another signature than every one of ``wanted``."""
        for r in wanted:
            r.attempts += 1
        self.requests = [r for r in self.requests if r.attempts < REQUEST_ATTEMPTS]

    # -- plans of other signatures and sizes --------------------------------------------
    def switch(self, keys: tuple, index: int, t) -> Optional[Plan]:
        """A cached plan agreeing with ``keys[:index]`` and with ``t`` at
        ``index``; else a resized one (NOTE [Plans across sizes]); else ``None``."""
        key = (t.shape, t.dtype, t.device)
        for other, plan in self.plans.items():
            if (len(other) > index and other[index] == key
                    and other[:index] == keys[:index]):
                self._touch(other)
                return plan
        return self._resized(keys, index, t)

    def _resized(self, keys: tuple, index: int, t) -> Optional[Plan]:
        share = isinstance(self.cfg.device_budget, BudgetShare)
        n = t.numel()
        best, alike = None, 0
        for other, plan in self.plans.items():
            if len(other) <= index:
                continue
            shape, dtype, device = other[index]
            if dtype is not t.dtype or device != t.device or len(shape) != t.dim():
                continue
            if any(len(a[0]) != rank_of(b[0]) or a[1] is not b[1] or a[2] != b[2]
                   for a, b in zip(other[:index], keys[:index])):
                continue
            alike += 1
            planned = numel(shape)
            if not share and planned < n:
                continue
            score = abs(planned - n)
            if best is None or score < best[0]:
                best = (score, other, plan)
        if best is None or alike < PROFILED_SIZES:
            return None   # profile this size (a later step does)
        _, other, plan = best
        self._touch(other)
        resized = self._resized_plans.get(other)
        if resized is None or resized.source is not plan:
            resized = copy.copy(plan)
            resized.source = plan
            resized.notes = list(plan.notes) + [
                "followed by steps of other sizes with this plan's structure; the figures "
                "are those of the profiled sizes"]
            ranks = tuple(Rank(len(k[0]), None if share else numel(k[0])) for k in plan.keys)
            resized.keys = tuple((r, k[1], k[2]) for r, k in zip(ranks, plan.keys))
            resized.kept_at = tuple(
                None if e is None else (e[0], ranks[e[0] if e[0] >= 0 else ~e[0]]) + e[2:]
                for e in plan.kept_at)
            self._resized_plans[other] = resized
        return resized

    def _touch(self, keys: tuple) -> None:
        """``keys``' plan was just used: last to be dropped (NOTE [Plans across sizes])."""
        plan = self.plans.pop(keys, None)
        if plan is not None:
            self.plans[keys] = plan

    def _remember(self, keys: tuple, plan: Plan) -> None:
        self.plans.pop(keys, None)
        self.plans[keys] = plan
        while len(self.plans) > MAX_PLANS:
            oldest = next(iter(self.plans))
            if self.current is not None and oldest == self.current.keys:
                self._touch(oldest)
                oldest = next(iter(self.plans))
            del self.plans[oldest]
            self._profiles.pop(oldest, None)
            self._resized_plans.pop(oldest, None)
