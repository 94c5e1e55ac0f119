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
#      and read (plus the PCIe legs on CUDA).
#    The cheapest option per freed byte wins (ties: recompute, cpu, nvme);
#    tensors are taken in that order of price, then longest window first
#    (what backward needs first stays), until the kept bytes are within
#    the budget. A move whose tier is out of room (cpu budget, nvme budget,
#    counted as if everything moved were held at once) tries the tensor's
#    next option ("nvme: host budget full").
#    A ``checkpoint="auto"`` block is one more option, ranked with the
#    tensors' by the same price: checkpointing it costs its profiled forward
#    once more in backward and frees the bytes saved inside it less its
#    input bytes (which the checkpoint saves, kept). Taking it undoes the
#    choices already made for its tensors (they are no longer saved)
#    and skips them later (NOTE [Blocks the planner may checkpoint] in
#    planner/runtime.py). Ties go to the tensors.
# 3. The chosen moves are then simulated on serial channels, one per
#    direction (moves queue in pack order out, in first-use order back,
#    each stall delaying later needs): that gives the predicted stall.
# Budgets the tiers cannot meet leave the rest kept, and the plan says so.
# Times come from the profile's timeline, which ran under the safe order
# (NOTE [Profile under the safe order] in planner/runtime.py): its backward
# includes regenerations a plan may not make.
"""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

from ..policy import Tier
from ..telemetry import format_bytes
from .plan import CHECKPOINTED, Plan, PlannedBlock, PlannedTensor, revived_positions
from .profile import BlockRecord, Profile, TensorRecord
from .rates import Rates

__all__ = ["make_plan", "safe_order", "tier_orders"]

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
    __slots__ = ("tier", "cost_s", "freed", "out_s", "back_s")

    def __init__(self, tier, cost_s, freed, out_s=0.0, back_s=0.0) -> None:
        self.tier, self.cost_s, self.freed = tier, cost_s, freed
        self.out_s, self.back_s = out_s, back_s


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
        opts.append(_Option(tier, max(0.0, back - lead), r.nbytes, out, back))
    opts.sort(key=lambda o: (o.cost_s / o.freed, _PREF[o.tier]))
    return opts


def _simulate(chosen, bwd_start: float):
    """Serial channels (see NOTE [Planner cost model]): per-tensor stall,
    total stall, and the most bytes restored ahead of their use at once."""
    out_free: dict = {}
    out_end = {}
    for r, o in sorted(chosen, key=lambda c: c[0].pack_s):
        start = max(r.pack_s, out_free.get(o.tier, 0.0))
        out_end[r.index] = out_free[o.tier] = start + o.out_s
    back_free: dict = {}
    shift = 0.0
    stalls = {}
    spans = []
    for r, o in sorted(chosen, key=lambda c: (c[0]._use, c[0].index)):
        use = r._use
        start = max(bwd_start, back_free.get(o.tier, bwd_start), out_end[r.index])
        end = start + o.back_s
        need = use + shift
        stall = max(0.0, end - need)
        shift += stall
        stalls[r.index] = stall
        back_free[o.tier] = end
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


class _Block:
    """A block option (NOTE [Blocks the planner may checkpoint] in
    planner/runtime.py): checkpointing frees ``freed`` bytes for ``cost_s``."""

    __slots__ = ("rec", "saved", "freed", "cost_s", "chosen")

    def __init__(self, rec: BlockRecord, records: List[TensorRecord]) -> None:
        self.rec = rec
        self.saved = sum(r.nbytes for r in records[rec.start:rec.end])
        self.freed = self.saved - rec.input_bytes
        self.cost_s = rec.forward_s
        self.chosen = False


def _choose(records, options, blocks, need: int, room: dict, choice: dict, costs: dict,
            reasons: dict, checkpointed: dict) -> Tuple[int, int]:
    """Step 2 of NOTE [Planner cost model]: take the cheapest options per freed
    byte, tensors' and blocks', until ``need`` bytes are freed. Fills
    ``choice``, ``costs``, ``reasons`` and ``checkpointed``; returns (bytes
    freed, recipe and checkpoint input bytes the choices keep)."""
    cands = [((options[r.index][0].cost_s / options[r.index][0].freed, 0,
               -(r._use - r.pack_s), r.index), r) for r in records if options[r.index]]
    cands += [((b.cost_s / b.freed, 1, 0.0, b.rec.index), b) for b in blocks if b.freed > 0]
    cands.sort(key=lambda c: c[0])
    freed = extra_kept = 0
    for _, c in cands:
        if freed >= need:
            break
        if isinstance(c, _Block):
            b = c
            for i in range(b.rec.start, b.rec.end):   # its tensors are no longer saved
                o = costs.pop(i, None)
                if o is not None:
                    freed -= o.freed
                    if o.tier in room:
                        room[o.tier] += records[i].nbytes
                    if o.tier is Tier.RECOMPUTE:
                        extra_kept -= records[i].input_kept_bytes
                reasons.pop(i, None)
                choice[i] = Tier.KEEP
                checkpointed[i] = b
            b.chosen = True
            freed += b.freed
            extra_kept += b.rec.input_bytes
            continue
        r = c
        if r.index in checkpointed:
            continue
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
    return freed, extra_kept


def _planned_block(b: _Block, need: int, kept_all: int, budget_bytes: int) -> PlannedBlock:
    """The plan's entry for block ``b``, with the reason of its choice."""
    rec = b.rec
    what = (f"{rec.forward_s * 1e3:.2f} ms more forward in backward to free "
            f"{format_bytes(max(0, b.freed))} (saved {format_bytes(b.saved)} less inputs "
            f"{format_bytes(rec.input_bytes)})")
    if b.chosen:
        reason = f"checkpoint: {what}; {b.cost_s / b.freed * 1e9:.3f} s per GB freed"
    elif need <= 0:
        reason = (f"no checkpoint: everything fits in the device budget "
                  f"({format_bytes(kept_all)} <= {format_bytes(budget_bytes)})")
    elif b.freed <= 0:
        reason = (f"no checkpoint: its inputs ({format_bytes(rec.input_bytes)}) are as large "
                  f"as what it saves ({format_bytes(b.saved)})")
    else:
        reason = (f"no checkpoint: the budget is met by cheaper options (a checkpoint: "
                  f"{what}; {b.cost_s / b.freed * 1e9:.3f} s per GB freed)")
    return PlannedBlock(rec.index, rec.module, rec.start, rec.end, rec.start_pos, rec.end_pos,
                        b.saved, rec.input_bytes, rec.forward_s, b.chosen, reason)


def make_plan(profile: Profile, rates: Rates, budget_bytes: int, budget_setting: str, *,
              has_nvme: bool, cpu_budget_bytes: int, nvme_budget_bytes: Optional[int],
              replans: int = 0, replan_reason: str = "") -> Plan:
    """The plan of ``profile``'s step under ``budget_bytes`` (NOTE [Planner cost model])."""
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
    blocks = [_Block(b, records) for b in profile.blocks]
    checkpointed: dict = {}   # record index -> its checkpointed _Block
    if need <= 0:
        for r in records:
            reasons[r.index] = (f"kept: everything fits in the device budget "
                                f"({format_bytes(kept_all)} <= {format_bytes(budget_bytes)})")
    else:
        room = {Tier.CPU: cpu_budget_bytes,
                Tier.NVME: nvme_budget_bytes if nvme_budget_bytes is not None else 1 << 62}
        freed, extra_kept = _choose(records, options, blocks, need, room, choice, costs,
                                    reasons, checkpointed)
        if freed < need:
            notes.append(f"budget not reachable: the tiers here free at most "
                         f"{format_bytes(freed)} of the {format_bytes(need)} asked")
    chosen = [(r, costs[r.index]) for r in records
              if choice[r.index] in (Tier.CPU, Tier.NVME)]
    stalls, stall_total, ahead = _simulate(chosen, bwd_start)
    recompute_total = 0.0
    tensors = []
    orders = {}
    for r in records:
        tier = choice[r.index]
        dev = "cuda" if r.device.startswith("cuda") else "cpu"
        order = orders.get(dev) or orders.setdefault(dev, tier_orders(dev, has_nvme))
        use_ms = (r._use - bwd_start) * 1e3
        window = r._use - r.pack_s
        cost = 0.0
        b = checkpointed.get(r.index)
        if b is not None:   # never saved: its block is checkpointed
            tensors.append(PlannedTensor(
                r.index, r.module, r.op, r.shape, r.dtype, r.nbytes, CHECKPOINTED,
                tuple(t.value for t in order[Tier.RECOMPUTE]),
                f"checkpointed with its block (#{b.rec.index} {b.rec.module}): saved only "
                "in backward's recompute", window, 0.0))
            continue
        if tier is Tier.RECOMPUTE:
            cost = costs[r.index].cost_s
            recompute_total += cost
            reason = f"recompute: {cost * 1e3:.2f} ms to regenerate {format_bytes(r.nbytes)}"
        elif tier in (Tier.CPU, Tier.NVME):
            o = costs[r.index]
            cost = stalls[r.index]
            cmp = ">=" if window >= o.out_s + o.back_s else "<"
            reason = reasons.get(r.index, tier.value)
            reason += (f": window {window * 1e3:.1f} ms {cmp} copy "
                       f"{(o.out_s + o.back_s) * 1e3:.1f} ms (predicted stall "
                       f"{cost * 1e3:.2f} ms)")
        else:
            reason = reasons.get(r.index)
            if reason is None and not options[r.index]:
                reason = _why_no_option(r, has_nvme)
            elif reason is None:
                o = options[r.index][0]
                what = ("a regeneration would take" if o.tier is Tier.RECOMPUTE
                        else f"a {o.tier.value} restore would stall")
                reason = (f"kept: needed {use_ms:.1f} ms into backward, {what} "
                          f"{o.cost_s * 1e3:.2f} ms; the budget is met without moving it")
        tensors.append(PlannedTensor(
            r.index, r.module, r.op, r.shape, r.dtype, r.nbytes, tier.value,
            tuple(t.value for t in order[tier]), reason, window, cost))
    kept = profile.fixed_kept_bytes + extra_kept + sum(
        r.nbytes for r in records
        if choice[r.index] is Tier.KEEP and r.index not in checkpointed)
    planned_blocks = [_planned_block(b, need, kept_all, budget_bytes)
                      for b in blocks]
    kept += sum(records[i].nbytes for i in {   # rule 5 of the NOTE
        ~profile.positions[pos] for pos in revived_positions(planned_blocks, profile.positions)})
    recompute_total += sum(b.cost_s for b in blocks if b.chosen)
    return Plan(profile.signature, tensors, budget_bytes, budget_setting,
                profile.baseline_bytes, profile.fixed_kept_bytes, kept, stall_total,
                recompute_total, ahead, rates.as_dict(), time.perf_counter() - t0,
                replans, replan_reason, notes=notes, blocks=planned_blocks)
