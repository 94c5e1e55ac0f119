"""From a profile, rates and budgets to a :class:`~tiermem.planner.plan.Plan`.
"""

# NOTE [Planner cost model]
# 1. Everything fits (fixed bytes + every tensor <= device budget): keep all;
#    moving costs time and buys nothing.
# 2. Else each tensor and auto block gets options priced in seconds added and
#    device bytes freed (NOTE [Option prices] in costs.py), chosen by NOTE
#    [Planner choice] (milp.py), the greedy its fallback and floor. Budgets the
#    tiers cannot meet leave the rest kept, and the plan says so.
# 3. The prefetch window: the room the budget leaves at backward's start, within
#    [AUTO_MIN_BYTES, bytes moved], or ``prefetch_bytes`` when set; unset, raised
#    by the largest moved tensor where the simulation (4) predicts less stall, at
#    the measured read rates or 1/SLOW_READS of them (the plan's notes say which).
# 4. The chosen moves are simulated on the followed step's timeline (NOTE
#    [Predicted restores] in timeline.py): the predicted stall per tensor.
# The prices (2) read the profile's timeline as it is; only 4 corrects it.

from __future__ import annotations

import functools
import itertools
import time
from types import SimpleNamespace
from typing import Optional

from ..policy import Tier
from ..telemetry import format_bytes
from .costs import (SLOW_READS, BlockOption, cpu_charge_s, hinted_first, obey, options_of,
                    plan_window_bytes, safe_order, tier_orders)
from .explain import (as_input, choice_reasons, per_mib, planned_block, unavailable,
                      why_no_option)
from .greedy import choose
from .hints import is_move_hint
from .milp import TIME_LIMIT_S, Model
from .plan import CHECKPOINTED, Plan, PlannedTensor, revived_positions
from .profile import Profile
from .rates import Rates
from .timeline import followed_uses, kick_of, simulate, since, slower

__all__ = ["make_plan", "safe_order", "tier_orders", "cpu_charge_s", "plan_window_bytes",
           "SLOW_READS"]


def make_plan(profile: Profile, rates: Rates, budget_bytes: int, budget_setting: str, *,
              has_nvme: bool, cpu_budget_bytes: int, nvme_budget_bytes: Optional[int],
              replans: int = 0, replan_reason: str = "",
              prefetch_bytes: Optional[int] = None, improve: bool = True,
              tracking_s: Optional[dict] = None, no_recompute: frozenset = frozenset(),
              time_limit_s: float = TIME_LIMIT_S) -> Plan:
    """The plan of ``profile``'s step under ``budget_bytes`` (NOTE [Planner cost
    model]; hints: NOTE [Planner hints] in planner/hints.py); ``prefetch_bytes``:
    the window setting, ``None`` when unset (the plan then sizes it);
    ``improve``: solve the model (NOTE [Planner choice] in planner/milp.py,
    at most ``time_limit_s`` seconds) and take the better of its choice and
    the greedy's; False gives the greedy's alone (tests and benchmarks
    compare the two). ``tracking_s``: pack index ->
    its recompute's share of tracking; ``no_recompute``: pack indexes not to
    recompute unless a MUST hint says so (NOTE [Tracking priced] in
    planner/runtime.py)."""
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
    hint_end = {}   # pack index -> what became of its hint (the end of its reason)
    shares = tracking_s or {}
    options = {r.index: options_of(r, rates, has_nvme, bwd_start,
                                 None if r.index in no_recompute else shares.get(r.index, 0.0))
               for r in records}
    room = {Tier.CPU: cpu_budget_bytes,
            Tier.NVME: nvme_budget_bytes if nvme_budget_bytes is not None else 1 << 62}
    extra_kept = freed = must_kept = same_ram = 0
    musts = [r for r in records if r.hint is not None and r.hint[0].must]
    for r in musts:   # constraints first, whatever the budget
        o = obey(r, rates, bwd_start, room)
        name = r.hint[1]
        choice[r.index] = o.tier
        costs[r.index] = o
        freed += o.freed
        hint_end[r.index] = f"; {name} (hints): a constraint, obeyed"
        if o.tier is Tier.KEEP:
            must_kept += r.nbytes
            reasons[r.index] = f"kept: {name} (hints): a constraint, never moved"
            hint_end[r.index] = ""
        elif o.tier is Tier.RECOMPUTE:
            extra_kept += r.input_kept_bytes
        elif not o.freed:   # cpu: a CPU tensor (same RAM), or the cpu budget full
            same_ram += r.nbytes
            hint_end[r.index] += (" (held in the same RAM: counted as kept)"
                                  if not r.device.startswith("cuda")
                                  else " (cpu budget full: predicted kept, its fallback)")
    for r in records:   # hinted moves first, keep hints last (NOTE [Planner hints])
        if r.hint is not None and not r.hint[0].must and is_move_hint(r.hint[0]):
            options[r.index] = hinted_first(r, options[r.index])
    must_ids = {r.index for r in musts}
    synthetic = itertools.count(len(records))   # timeline indexes of block inputs
    blocks = [BlockOption(b, records, must_ids, rates, has_nvme, bwd_start,
                     functools.partial(next, synthetic)) for b in profile.blocks]
    checkpointed: dict = {}   # record index -> its checkpointed BlockOption
    priced = greedy_priced = None
    if need <= freed:
        for r in records:
            if r.index in must_ids:
                continue
            reasons[r.index] = (f"kept: everything fits in the device budget "
                                f"({format_bytes(kept_all)} <= {format_bytes(budget_bytes)})"
                                if need <= 0 else "kept: the budget is met without moving it")
    else:
        freed0, room0 = freed, dict(room)
        freed, more_kept = choose(records, options, blocks, need, freed, room, choice, costs,
                                  reasons, checkpointed, hint_end, must_ids, has_nvme)
        freed, more_kept, priced, greedy_priced = _solve(
            records, options, blocks, need, freed0, room0, freed, more_kept, choice, costs,
            checkpointed, must_ids, notes, improve, time_limit_s)
        room = _room_left(room0, records, costs, checkpointed, must_ids, blocks)
        choice_reasons(records, options, costs, checkpointed, room, need, freed, must_ids,
                       has_nvme, reasons, hint_end)
        extra_kept += more_kept
        if freed < need:
            notes.append(f"budget not reachable: the tiers here free at most "
                         f"{format_bytes(freed)} of the {format_bytes(need)} asked")
            if must_kept or same_ram:
                # Would the tiers reach it if the MUST-kept tensors could move?
                movable = sum(options[r.index][0].freed for r in musts
                              if options[r.index] and not costs[r.index].freed)
                notes[-1] += (f"; MUST answers of the hints keep {format_bytes(must_kept)}"
                              + (f" and hold {format_bytes(same_ram)} in the cpu tier "
                                 "counted as kept" if same_ram else "")
                              + (" (constraints: without them it would be reachable)"
                                 if freed + movable >= need else " (constraints)"))
    for r in records:   # hints the loop did not reach, or reached without moving
        if r.hint is None or r.index in hint_end:
            continue
        if is_move_hint(r.hint[0]):
            want = r.hint[0][0]
            why = ("the budget is met without moving it" if freed >= need or need <= 0
                   else unavailable(r, want, has_nvme) if not options[r.index]
                   else "the host and disk budgets are full")
            hint_end[r.index] = (f"; hint {r.hint[1]} "
                                 f"{'not followed' if freed >= need else 'overridden'}: {why}")
        else:
            hint_end[r.index] = f"; hint {r.hint[1]} followed"
    chosen = [(r, costs[r.index]) for r in records
              if choice[r.index] in (Tier.CPU, Tier.NVME)]
    chosen += [(i.rec, i.move) for b in blocks if b.chosen for i in b.ins if i.move is not None]
    # Small tensors saved inside checkpointed blocks are saved no more.
    fixed_kept = profile.fixed_kept_bytes - sum(b.rec.fixed_bytes for b in blocks if b.chosen)
    kept = fixed_kept + extra_kept + same_ram + sum(
        r.nbytes for r in records
        if choice[r.index] is Tier.KEEP and r.index not in checkpointed)
    # Rule 5 of the NOTE: saved again after a checkpointed block, new there;
    # but an input's own later save shares the input's handle (rule 6).
    spans = [SimpleNamespace(checkpoint=b.chosen, start=b.rec.start, end=b.rec.end,
                             start_pos=b.rec.start_pos, end_pos=b.rec.end_pos) for b in blocks]
    shared_later = {x.saved_as for b in blocks if b.chosen for x in b.rec.inputs
                    if x.kind == "after"}
    kept += sum(records[i].nbytes for i in {
        ~profile.positions[pos] for pos in revived_positions(spans, profile.positions)}
        - shared_later)
    moved_bytes = sum(r.nbytes for r, _ in chosen)
    window = plan_window_bytes(budget_bytes, kept, moved_bytes, prefetch_bytes)
    kick = kick_of(records, choice, checkpointed, chosen)
    use_s = followed_uses(records, choice, costs, blocks, chosen, kick, bwd_start, rates)
    kick_s = None if kick is None else use_s[kick.index]
    restores: dict = {}
    stalls, stall_total, _ = simulate(chosen, bwd_start, window, kick_s, restores, use_s)
    wider = min(moved_bytes, window + max((r.nbytes for r, _ in chosen), default=0))
    if prefetch_bytes is None and wider > window:
        # NOTE [Planner cost model], 3: one tensor more where that predicts
        # less stall, at the measured read rates or at half of them.
        trace: dict = {}
        w_stalls, w_total, _ = simulate(chosen, bwd_start, wider, kick_s, trace, use_s)
        slow = [(r, slower(o, SLOW_READS)) for r, o in chosen]
        why = ""
        if w_total < stall_total:
            why = (f"predicted stall {stall_total * 1e3:.2f} -> {w_total * 1e3:.2f} ms")
        elif w_total == stall_total:
            at_half = simulate(slow, bwd_start, window, kick_s, None, use_s)[1]
            w_half = simulate(slow, bwd_start, wider, kick_s, None, use_s)[1]
            if w_half < at_half:
                why = (f"with reads at 1/{SLOW_READS:g} of the measured rate: predicted "
                       f"stall {at_half * 1e3:.2f} -> {w_half * 1e3:.2f} ms")
        if why:
            notes.append(f"prefetch window raised from {format_bytes(window)} to "
                         f"{format_bytes(wider)} ({why})")
            window, stalls, stall_total, restores = wider, w_stalls, w_total, trace
    planned_blocks = [planned_block(b, need, kept_all, budget_bytes, stalls, has_nvme,
                                     freed >= need) for b in blocks]
    inside_of = {x.saved_as: (pb, px) for b, pb in zip(blocks, planned_blocks) if b.chosen
                 for x, px in zip(b.rec.inputs, pb.inputs)
                 if x.kind in ("movable", "after") and x.saved_as is not None}
    recompute_total = cpu_total = 0.0
    tensors = []
    orders = {}
    for r in records:
        tier = choice[r.index]
        dev = "cuda" if r.device.startswith("cuda") else "cpu"
        order = orders.get(dev) or orders.setdefault(dev, tier_orders(dev, has_nvme))
        must = r.index in must_ids
        if must:   # the order the profile obeyed (Hints.must_order)
            tiers = safe_order(dev, has_nvme) if r.hint[0].then_default else r.hint[0]
        else:
            tiers = order[tier]
        use_ms = (r._use - bwd_start) * 1e3
        window_s = r._use - r.pack_s
        cost = cpu = 0.0
        b = checkpointed.get(r.index)
        if b is not None:   # never saved: its block is checkpointed
            tensors.append(PlannedTensor(
                r.index, r.module, r.op, r.shape, r.dtype, r.nbytes, CHECKPOINTED,
                tuple(t.value for t in order[Tier.RECOMPUTE]),
                f"checkpointed with its block (#{b.rec.index} {b.rec.module}): saved only "
                "in backward's recompute" + as_input(inside_of.get(r.index))
                + hint_end.get(r.index, ""), window_s, 0.0,
                None if r.hint is None else r.hint[1], pack_s=r.pack_s))
            continue
        if tier is Tier.RECOMPUTE:
            track = costs[r.index].track_s
            cost = costs[r.index].cost_s - track
            recompute_total += cost
            reason = f"recompute: {cost * 1e3:.2f} ms to regenerate {format_bytes(r.nbytes)}"
            if track:
                reason += f" (+{track * 1e3:.2f} ms: its share of producer tracking)"
            moves = [o for o in options[r.index] if o.tier is not Tier.RECOMPUTE]
            if r.index in reasons:   # not its cheapest option per freed byte
                reason = f"{reasons[r.index]}; {reason[len('recompute: '):]}"
            elif moves and options[r.index][0] is costs[r.index]:
                o = moves[0]
                reason += (f", cheaper per freed byte than {o.tier.value} "
                           f"({per_mib(cost + track, costs[r.index].freed)} vs "
                           f"{per_mib(o.cost_s, o.freed)} ms/MiB: stall + CPU)")
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
                reason = why_no_option(r, has_nvme)
            elif reason is None:
                o = options[r.index][0]
                what = (("a regeneration with its share of producer tracking would take"
                         if o.track_s else "a regeneration would take")
                        if o.tier is Tier.RECOMPUTE
                        else f"a {o.tier.value} move would cost (stall + CPU)")
                reason = (f"kept: needed {use_ms:.1f} ms into backward, {what} "
                          f"{o.cost_s * 1e3:.2f} ms; the budget is met without moving it")
        tensors.append(PlannedTensor(
            r.index, r.module, r.op, r.shape, r.dtype, r.nbytes, tier.value,
            tuple(t.value for t in tiers), reason + hint_end.get(r.index, ""), window_s, cost,
            None if r.hint is None else r.hint[1], must, cpu_s=cpu, pack_s=r.pack_s,
            input_kept_bytes=r.input_kept_bytes if tier is Tier.RECOMPUTE else 0,
            restore_s=since(restores.get(r.index), bwd_start)))
    recompute_total += sum(b.cost_s for b in blocks if b.chosen)
    cpu_total += sum(x.cpu_s for b in planned_blocks for x in b.inputs)
    return Plan(profile.signature, tensors, budget_bytes, budget_setting,
                profile.baseline_bytes, fixed_kept, kept, stall_total,
                recompute_total, window, rates.as_dict(), time.perf_counter() - t0,
                replans, replan_reason, notes=notes, blocks=planned_blocks,
                predicted_cpu_s=cpu_total, kick_index=None if kick is None else kick.index,
                priced_cost_s=priced, greedy_priced_cost_s=greedy_priced)




def _solve(records, options, blocks, need: int, freed0: int, room0: dict, greedy_freed: int,
           greedy_kept: int, choice: dict, costs: dict, checkpointed: dict, must_ids: set,
           notes: list, improve: bool, time_limit_s: float):
    """NOTE [Planner choice]: the model's choice where it beats the greedy's
    (already in the state), written into the state. Returns (bytes freed,
    extra kept bytes, priced cost of the choice, priced cost of the greedy's)."""
    model = Model(records, options, blocks, need - freed0, room0, must_ids)
    greedy = model.taken_of(costs, checkpointed, blocks)
    model.follow_rank(greedy)
    got, greedy_priced = model.evaluate(greedy)
    if got != greedy_freed - freed0:
        notes.append("choice: the greedy's: the model counted it otherwise than the greedy "
                     "(this is a bug)")
        return greedy_freed, greedy_kept, greedy_priced, greedy_priced
    if not improve:
        return greedy_freed, greedy_kept, greedy_priced, greedy_priced
    # The greedy met the budget: it is reachable, no need to maximise first.
    taken, _ = model.solve(time_limit_s, reach=model.need if greedy_freed >= need else None)
    if model.clock_bound:   # NOTE [Same plan on every rank] in planner/milp.py
        notes.append(f"solver: HiGHS stopped at its wall-clock limit ({time_limit_s:g} s), "
                     "not at its node limit: on a loaded machine ranks may choose differently")
    if taken is None:
        notes.append(f"choice: the greedy's: the solver found no choice within its time "
                     f"limit ({time_limit_s:g} s)")
        return greedy_freed, greedy_kept, greedy_priced, greedy_priced
    (short, cost), (g_short, g_cost) = model.key(taken), model.key(greedy)
    if short > g_short or (short == g_short
                           and cost >= g_cost - 1e-12 * max(1.0, abs(g_cost))):
        return greedy_freed, greedy_kept, greedy_priced, greedy_priced
    freed, kept = model.apply(taken, records, blocks, choice, costs, checkpointed, must_ids)
    priced = model.evaluate(taken)[1]
    notes.append(f"choice: the solver's (HiGHS) over the greedy's: priced cost "
                 f"{greedy_priced * 1e3:.2f} -> {priced * 1e3:.2f} ms"
                 + (f", {format_bytes(g_short - short)} more freed" if short < g_short else ""))
    return freed0 + freed, kept, priced, greedy_priced


def _room_left(room0: dict, records, costs: dict, checkpointed: dict, must_ids: set,
               blocks) -> dict:
    """The tiers' room the choice leaves (``room0``: after the MUST answers)."""
    left = dict(room0)
    for i, o in costs.items():
        if i not in must_ids and i not in checkpointed and o.tier in left:
            left[o.tier] -= records[i].nbytes
    for b in blocks:
        for x in b.ins if b.chosen else ():
            if x.move is not None:
                left[x.move.tier] -= x.x.nbytes
    return left
