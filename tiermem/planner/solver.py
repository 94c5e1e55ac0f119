"""From a profile, rates and budgets to a :class:`~tiermem.planner.plan.Plan`.

# NOTE [Planner cost model]
# Deterministic and explainable, one pass over the profiled tensors:
# 1. Everything fits (fixed bytes + every tensor <= device budget): keep all,
#    move nothing (moving costs time and buys nothing).
# 2. Else each tensor gets its options, each priced in predicted seconds
#    added to the step and in device bytes it frees:
#    - recompute (only if the recompute tier took it in the profile): the
#      regeneration time measured in the profile's backward (else bytes /
#      measured pointwise rate); frees its bytes less the recipe inputs that
#      the profile left on the device;
#    - cpu (CUDA tensors only: for a CPU tensor the host tier is the same
#      RAM and frees nothing): the stall of copying it out after its save and
#      back from the start of backward, one tensor alone on the link:
#      max(0, back - (first use - max(backward start, save + out)));
#    - nvme (when the tier exists): the same with the disk's measured write
#      and read (plus the PCIe legs on CUDA); for a CPU tensor plus its *CPU
#      charge*: the CPU seconds of its round trip (bytes / ``move_cpu`` +
#      ``move_fixed_cpu_s``: staging copies, engine and chain threads) over the
#      ``compute_threads`` the compute spreads over. On a CPU device those
#      seconds are taken from the compute's cores, so the step is longer by
#      them even when no unpack waits (measured: benchmarks/results/
#      2026-12-01-cpu-costmodel-before.md: step time beyond keep's, less the
#      stall, was about the extra process CPU time / 2 on 2 threads). Not charged
#      on CUDA (the host's work runs beside the GPU's).
#    The cheapest option per freed byte wins (ties: recompute, cpu, nvme);
#    tensors are taken in that order of price, then longest window first
#    (what backward needs first stays), until the kept bytes are within
#    the budget. A move whose tier is out of room (cpu budget, nvme budget,
#    counted as if everything moved were held at once) tries the tensor's
#    next option ("nvme: host budget full").
# 3. The prefetch window (the plan's ``suggested_prefetch_bytes``, which a
#    step following the plan uses when ``prefetch_bytes`` is unset): the room
#    the budget leaves at the start of backward (budget - predicted kept), no
#    more than the bytes moved, and at least AUTO_MIN_BYTES (restores need
#    some lead); ``prefetch_bytes`` when set.
# 4. The chosen moves are then simulated on serial channels, one per
#    direction and tier (moves queue in pack order out, in first-use order
#    back, each stall delaying later needs): that gives the predicted stall.
#    Restores start only at the first unpack of a moved tensor (the
#    prefetcher advances on those: tiermem/prefetch.py), so the first one
#    backward needs waits its whole read (measured: 91-99% of the stalls
#    predicted 0 in 2026-12-01-cpu-costmodel-before were that one wait); a
#    restore starts when its move out has landed, its channel is free and the window has room (bytes
#    restored and not yet used + its own <= window; one at least); a restore
#    that overlaps moves out of its tier runs at the measured both-directions
#    rate for the overlap (``disk_both`` / ``link_both``: its time there is
#    stretched by single rate / both rate; no penalty without overlap).
# Budgets the tiers cannot meet leave the rest kept, and the plan says so.
# Times come from the profile's timeline, which ran under the safe order
# (NOTE [Profile under the safe order] in planner/runtime.py): its backward
# includes regenerations a plan may not make.
"""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

from ..policy import Tier
from ..prefetch import AUTO_MIN_BYTES
from ..telemetry import format_bytes
from .plan import Plan, PlannedTensor
from .profile import Profile, TensorRecord
from .rates import Rates

__all__ = ["make_plan", "safe_order", "tier_orders", "cpu_charge_s", "plan_window_bytes"]

_PREF = {Tier.RECOMPUTE: 0, Tier.CPU: 1, Tier.NVME: 2}


def safe_order(device_type: str, has_nvme: bool) -> Tuple[Tier, ...]:
    """The order of a profiled step (and of tensors off the plan): recompute
    what is eligible, else the tiers that free device memory, else keep."""
    if device_type == "cuda":
        return ((Tier.RECOMPUTE, Tier.CPU, Tier.NVME, Tier.KEEP) if has_nvme
                else (Tier.RECOMPUTE, Tier.CPU, Tier.KEEP))
    return (Tier.RECOMPUTE, Tier.NVME, Tier.KEEP) if has_nvme else (Tier.RECOMPUTE, Tier.KEEP)


def tier_orders(device_type: str, has_nvme: bool) -> dict:
    """The full tier order a plan gives a tensor of ``device_type`` per chosen tier."""
    cuda = device_type == "cuda"
    orders = {Tier.KEEP: (Tier.KEEP,), Tier.RECOMPUTE: safe_order(device_type, has_nvme)}
    if cuda:
        orders[Tier.CPU] = ((Tier.CPU, Tier.NVME, Tier.KEEP) if has_nvme
                            else (Tier.CPU, Tier.KEEP))
    if has_nvme:
        orders[Tier.NVME] = (Tier.NVME, Tier.CPU, Tier.KEEP) if cuda else (Tier.NVME, Tier.KEEP)
    return orders


class _Option:
    __slots__ = ("tier", "cost_s", "freed", "out_s", "back_s", "cpu_s", "slowdown")

    def __init__(self, tier, cost_s, freed, out_s=0.0, back_s=0.0, cpu_s=0.0,
                 slowdown=1.0) -> None:
        self.tier, self.cost_s, self.freed = tier, cost_s, freed
        self.out_s, self.back_s = out_s, back_s
        #: CPU charge (part of cost_s) and the both-directions slowdown of its restore.
        self.cpu_s, self.slowdown = cpu_s, slowdown


def cpu_charge_s(nbytes: int, device: str, tier: Tier, rates: Rates) -> float:
    """Step seconds the CPU work of moving ``nbytes`` to ``tier`` takes from the
    compute (NOTE [Planner cost model]): nvme moves of CPU tensors only."""
    if tier is not Tier.NVME or device.startswith("cuda") or not rates.move_cpu:
        return 0.0
    return (nbytes / rates.move_cpu + rates.move_fixed_cpu_s) / max(1.0, rates.compute_threads)


def _slowdown(tier: Tier, cuda: bool, rates: Rates) -> float:
    """How much slower a restore to ``tier`` runs while moves out overlap it."""
    f = 1.0
    if tier is Tier.NVME and rates.disk_both and rates.disk_read:
        f = max(f, rates.disk_read / rates.disk_both)
    if (cuda or tier is Tier.CPU) and rates.link_both and rates.h2d:
        f = max(f, rates.h2d / rates.link_both)
    return f


def plan_window_bytes(budget_bytes: int, kept_bytes: int, moved_bytes: int,
                      prefetch_bytes: Optional[int] = None) -> int:
    """The prefetch window of a plan (NOTE [Planner cost model], 3)."""
    if prefetch_bytes is not None:
        return prefetch_bytes
    return max(AUTO_MIN_BYTES, min(budget_bytes - kept_bytes, moved_bytes))


def _legs(r: TensorRecord, tier: Tier, rates: Rates) -> Optional[Tuple[float, float]]:
    """(seconds out, seconds back) of moving ``r`` to ``tier``, or None."""
    n = r.nbytes
    cuda = r.device.startswith("cuda")
    if tier is Tier.CPU:
        if not cuda or not rates.d2h or not rates.h2d:
            return None
        return n / rates.d2h, n / rates.h2d
    if not rates.disk_write or not rates.disk_read:
        return None
    out = rates.disk_write_latency_s + n / rates.disk_write
    back = rates.disk_read_latency_s + n / rates.disk_read
    if cuda:
        if not rates.d2h or not rates.h2d:
            return None
        out, back = out + n / rates.d2h, back + n / rates.h2d
    return out, back


def _options(r: TensorRecord, rates: Rates, has_nvme: bool, bwd_start: float,
             use: float) -> List[_Option]:
    opts = []
    if r.recomputable and r.nbytes > r.input_kept_bytes:
        cost = r.recompute_s if r.recompute_s is not None else r.nbytes / rates.pointwise
        opts.append(_Option(Tier.RECOMPUTE, cost, r.nbytes - r.input_kept_bytes))
    for tier in (Tier.CPU, Tier.NVME):
        if tier is Tier.NVME and not has_nvme:
            continue
        legs = _legs(r, tier, rates)
        if legs is None:
            continue
        out, back = legs
        lead = use - max(bwd_start, r.pack_s + out)
        cpu = cpu_charge_s(r.nbytes, r.device, tier, rates)
        opts.append(_Option(tier, max(0.0, back - lead) + cpu, r.nbytes, out, back, cpu,
                            _slowdown(tier, r.device.startswith("cuda"), rates)))
    opts.sort(key=lambda o: (o.cost_s / o.freed, _PREF[o.tier]))
    return opts


def _overlap(a: float, b: float, spans: list) -> float:
    """Seconds of [a, b] covered by the (disjoint, sorted) ``spans``."""
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans)


def _simulate(chosen, bwd_start: float, window_bytes: Optional[int] = None):
    """Serial channels (see NOTE [Planner cost model], 4): per-tensor stall,
    total stall, and the most bytes restored ahead of their use at once."""
    out_free: dict = {}
    out_end = {}
    out_spans: dict = {}
    for r, o in sorted(chosen, key=lambda c: c[0].pack_s):
        start = max(r.pack_s, out_free.get(o.tier, 0.0))
        out_end[r.index] = out_free[o.tier] = start + o.out_s
        out_spans.setdefault(o.tier, []).append((start, start + o.out_s))
    back_free: dict = {}
    shift = 0.0
    stalls = {}
    spans = []
    inflight = []        # (need time, bytes) of restores not yet used, in use order
    first = None         # when the first restore may start: the first moved unpack
    for r, o in sorted(chosen, key=lambda c: (c[0]._use, c[0].index)):
        need = r._use + shift
        if first is None:
            first = need
        start = max(first, back_free.get(o.tier, first), out_end[r.index])
        if window_bytes is not None:
            # Window: earlier restores are used (freed from it) at their need.
            inflight = [(t, n) for t, n in inflight if t > start]
            while inflight and sum(n for _, n in inflight) + r.nbytes > window_bytes:
                start = max(start, inflight.pop(0)[0])
        back = o.back_s
        if o.slowdown > 1.0:
            back += _overlap(start, start + back, out_spans.get(o.tier, ())) * (o.slowdown - 1.0)
        end = start + back
        stall = max(0.0, end - need)
        shift += stall
        stalls[r.index] = stall
        back_free[o.tier] = end
        inflight.append((need + stall, r.nbytes))
        spans.append((start, need + stall, r.nbytes))
    events = sorted([(s, n) for s, _, n in spans] + [(e, -n) for _, e, n in spans])
    ahead = peak = 0
    for _, n in events:
        ahead += n
        peak = max(peak, ahead)
    return stalls, sum(stalls.values()), peak


def _why_no_option(r: TensorRecord, has_nvme: bool) -> str:
    cpu_dev = not r.device.startswith("cuda")
    why = ["not recomputable" if not r.recomputable
           else "its recipe's inputs cost as much device memory as it frees"]
    if cpu_dev:
        why.append("the cpu tier would hold a CPU tensor in the same RAM")
    if not has_nvme:
        why.append("no nvme_dir")
    return "kept: no tier frees its memory here (" + "; ".join(why) + ")"


def make_plan(profile: Profile, rates: Rates, budget_bytes: int, budget_setting: str, *,
              has_nvme: bool, cpu_budget_bytes: int, nvme_budget_bytes: Optional[int],
              replans: int = 0, replan_reason: str = "",
              prefetch_bytes: Optional[int] = None) -> Plan:
    """The plan of ``profile``'s step under ``budget_bytes`` (NOTE [Planner cost
    model]); ``prefetch_bytes``: the window setting, ``None`` when unset (the
    plan then sizes it)."""
    t0 = time.perf_counter()
    records = profile.records
    fwd_end = profile.forward_end_s
    bwd_start = profile.backward_start_s if profile.backward_start_s is not None else fwd_end
    for r in records:
        r._use = r.first_use_s if r.first_use_s is not None else bwd_start
    kept_all = profile.fixed_kept_bytes + sum(r.nbytes for r in records)
    need = kept_all - budget_bytes
    choice = {r.index: Tier.KEEP for r in records}
    reasons = {}
    costs = {}
    notes = []
    options = {r.index: _options(r, rates, has_nvme, bwd_start, r._use) for r in records}
    extra_kept = 0
    if need <= 0:
        for r in records:
            reasons[r.index] = (f"kept: everything fits in the device budget "
                                f"({format_bytes(kept_all)} <= {format_bytes(budget_bytes)})")
    else:
        ranked = sorted((r for r in records if options[r.index]),
                        key=lambda r: (options[r.index][0].cost_s / options[r.index][0].freed,
                                       -(r._use - r.pack_s), r.index))
        room = {Tier.CPU: cpu_budget_bytes,
                Tier.NVME: nvme_budget_bytes if nvme_budget_bytes is not None else 1 << 62}
        freed = 0
        for r in ranked:
            if freed >= need:
                break
            full = []
            for o in options[r.index]:
                if o.tier in room and room[o.tier] < r.nbytes:
                    full.append(o.tier)
                    continue
                if o.tier in room:
                    room[o.tier] -= r.nbytes
                choice[r.index] = o.tier
                costs[r.index] = o
                freed += o.freed
                if o.tier is Tier.RECOMPUTE:
                    extra_kept += r.input_kept_bytes
                if full and o.tier is Tier.NVME:
                    reasons[r.index] = "nvme: host budget full"
                break
            else:
                reasons[r.index] = "kept: host and disk budgets full"
        if freed < need:
            notes.append(f"budget not reachable: the tiers here free at most "
                         f"{format_bytes(freed)} of the {format_bytes(need)} asked")
    chosen = [(r, costs[r.index]) for r in records
              if choice[r.index] in (Tier.CPU, Tier.NVME)]
    kept = profile.fixed_kept_bytes + extra_kept + sum(
        r.nbytes for r in records if choice[r.index] is Tier.KEEP)
    window = plan_window_bytes(budget_bytes, kept, sum(r.nbytes for r, _ in chosen),
                               prefetch_bytes)
    stalls, stall_total, _ = _simulate(chosen, bwd_start, window)
    recompute_total = cpu_total = 0.0
    tensors = []
    orders = {}
    for r in records:
        tier = choice[r.index]
        dev = "cuda" if r.device.startswith("cuda") else "cpu"
        order = orders.get(dev) or orders.setdefault(dev, tier_orders(dev, has_nvme))
        use_ms = (r._use - bwd_start) * 1e3
        window_s = r._use - r.pack_s
        cost = cpu = 0.0
        if tier is Tier.RECOMPUTE:
            cost = costs[r.index].cost_s
            recompute_total += cost
            reason = f"recompute: {cost * 1e3:.2f} ms to regenerate {format_bytes(r.nbytes)}"
            moves = [o for o in options[r.index] if o.tier is not Tier.RECOMPUTE]
            if moves:
                o = moves[0]
                reason += (f", cheaper per freed byte than {o.tier.value} "
                           f"({_per_mib(cost, costs[r.index].freed)} vs "
                           f"{_per_mib(o.cost_s, o.freed)} ms/MiB: stall + CPU)")
        elif tier in (Tier.CPU, Tier.NVME):
            o = costs[r.index]
            cost = stalls[r.index]
            cpu = o.cpu_s
            cpu_total += cpu
            cmp = ">=" if window_s >= o.out_s + o.back_s else "<"
            reason = reasons.get(r.index, tier.value)
            reason += (f": window {window_s * 1e3:.1f} ms {cmp} copy "
                       f"{(o.out_s + o.back_s) * 1e3:.1f} ms (predicted stall "
                       f"{cost * 1e3:.2f} ms" + (f", CPU {cpu * 1e3:.2f} ms" if cpu else "")
                       + ")")
        else:
            reason = reasons.get(r.index)
            if reason is None and not options[r.index]:
                reason = _why_no_option(r, has_nvme)
            elif reason is None:
                o = options[r.index][0]
                what = ("a regeneration would take" if o.tier is Tier.RECOMPUTE
                        else f"a {o.tier.value} move would cost (stall + CPU)")
                reason = (f"kept: needed {use_ms:.1f} ms into backward, {what} "
                          f"{o.cost_s * 1e3:.2f} ms; the budget is met without moving it")
        tensors.append(PlannedTensor(
            r.index, r.module, r.op, r.shape, r.dtype, r.nbytes, tier.value,
            tuple(t.value for t in order[tier]), reason, window_s, cost, cpu, r.pack_s,
            r.input_kept_bytes if tier is Tier.RECOMPUTE else 0))
    return Plan(profile.signature, tensors, budget_bytes, budget_setting,
                profile.baseline_bytes, profile.fixed_kept_bytes, kept, stall_total,
                recompute_total, window, rates.as_dict(), time.perf_counter() - t0,
                replans, replan_reason, notes=notes, predicted_cpu_s=cpu_total)


def _per_mib(seconds: float, freed: int) -> str:
    return f"{seconds * 1e3 / max(1, freed) * (1 << 20):.3f}"
