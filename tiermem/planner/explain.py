"""The auto planner's reasons: why each tensor, block and checkpointed
block's input goes where the choice put it, written from the choice and the
constraints that bind (the device budget, a tier's room, a hint)."""

from __future__ import annotations

from typing import List

from ..policy import Tier
from ..telemetry import format_bytes
from .costs import BlockOption, tier_orders
from .hints import is_move_hint
from .plan import PlannedBlock, PlannedInput
from .profile import TensorRecord

__all__ = ["why_no_option", "unavailable", "planned_block", "planned_inputs", "as_input",
           "per_mib", "KIND_REASON", "choice_reasons"]


def why_no_option(r: TensorRecord, has_nvme: bool) -> str:
    cpu_dev = not r.device.startswith("cuda")
    why = ["not recomputable" if not r.recomputable
           else "its recipe's inputs cost as much device memory as it frees"]
    if cpu_dev:
        why.append("the cpu tier would hold a CPU tensor in the same RAM")
    if not has_nvme:
        why.append("no nvme_dir")
    return "kept: no tier frees its memory here (" + "; ".join(why) + ")"


def unavailable(r: TensorRecord, tier: Tier, has_nvme: bool) -> str:
    """Why ``tier`` is not an option of ``r`` (NOTE [Planner hints], rule 3)."""
    if tier is Tier.RECOMPUTE:
        return ("not recomputable" if not r.recomputable
                else "its recipe's inputs cost as much device memory as it frees")
    if tier is Tier.CPU and not r.device.startswith("cuda"):
        return "the cpu tier would hold a CPU tensor in the same RAM"
    if tier is Tier.NVME and not has_nvme:
        return "no nvme_dir"
    return f"no measured {tier.value} rate"



def planned_block(b: BlockOption, need: int, kept_all: int, budget_bytes: int, stalls: dict,
                   has_nvme: bool, met: bool) -> PlannedBlock:
    """The plan's entry for block ``b``, with the reason of its choice."""
    rec = b.rec
    small = f" + {format_bytes(rec.fixed_bytes)} small" if rec.fixed_bytes else ""
    what = (f"{rec.forward_s * 1e3:.2f} ms more forward in backward to free "
            f"{format_bytes(max(0, b.freed))} (saved {format_bytes(b.saved)}{small} less inputs "
            f"{format_bytes(b.kept_in)})")
    inputs = []
    if b.chosen:
        moved = b.moved_bytes()
        tiers = sorted({i.move.tier.value for i in b.ins if i.move is not None})
        head = ("checkpoint" if not moved else
                f"checkpoint, inputs moved to {'/'.join(tiers)}")
        what = (f"{rec.forward_s * 1e3:.2f} ms more forward in backward to free "
                f"{format_bytes(b.freed + moved)} (saved {format_bytes(b.saved)}{small}, inputs "
                f"{format_bytes(b.kept_in)}" + (f", {format_bytes(moved)} of them moved"
                                                if moved else " kept") + ")")
        cost = b.cost_s + sum(i.move.cost_s for i in b.ins if i.move is not None)
        reason = (f"{head}: {what}" + (f" and {(cost - b.cost_s) * 1e3:.2f} ms to move them "
                                       "(stall + CPU)" if moved else "")
                  + f"; {cost / max(1, b.freed + moved) * 1e9:.3f} s per GB freed")
        inputs = planned_inputs(b, stalls, has_nvme, met)
    elif need <= 0:
        reason = (f"no checkpoint: everything fits in the device budget "
                  f"({format_bytes(kept_all)} <= {format_bytes(budget_bytes)})")
    elif b.nested_must:
        reason = (f"no checkpoint: a block inside it has the policy {b.nested_must}, which "
                  "checkpointing would not obey (its forward would run again in backward)")
    elif b.has_must:
        reason = ("no checkpoint: it saves tensors with MUST answers (hints), which "
                  "checkpointing would not obey")
    elif b.price == float("inf"):
        reason = (f"no checkpoint: its inputs ({format_bytes(b.kept_in)}) are as large "
                  f"as what it saves ({format_bytes(b.saved)})")
    else:
        reason = (f"no checkpoint: the budget is met by cheaper options (a checkpoint: "
                  f"{what}" + (f", or its inputs moved to {b.tier.value} too" if b.tier else "")
                  + f"; {b.price * 1e9:.3f} s per GB freed)")
    return PlannedBlock(rec.index, rec.module, rec.start, rec.end, rec.start_pos, rec.end_pos,
                        b.saved, rec.input_bytes, rec.forward_s, b.chosen, reason, inputs)


KIND_REASON = {
    "param": "a parameter (or a leaf that requires grad): never moved, not counted",
    "small": "smaller than min_offload_bytes: kept",
    "unmovable": "not a plain cpu or cuda tensor: kept",
    "after": ("kept: the rest of the step saves it again after the block (moving it "
              "would not free it)"),
}


def planned_inputs(b: BlockOption, stalls: dict, has_nvme: bool, met: bool) -> List[PlannedInput]:
    """What the checkpoint of chosen block ``b`` saves, per tensor argument
    (``met``: the plan meets its budget)."""
    rec = b.rec
    head = f"block #{rec.index} checkpointed; its input"
    moves = {i.x.arg: i for i in b.ins}
    out = []
    for x in rec.inputs:
        dev = "cuda" if x.device.startswith("cuda") else "cpu"
        tier, kept, cost, cpu, shared = Tier.KEEP, x.nbytes, 0.0, 0.0, None
        window_s = b.need_s - rec.start_s
        i = moves.get(x.arg)
        if i is not None and i.move is not None:
            o = i.move
            tier, kept, cost, cpu = o.tier, 0, stalls[i.rec.index], o.cpu_s
            cmp = ">=" if window_s >= o.out_s + o.back_s else "<"
            reason = (f"{head} moved to {tier.value}: window {window_s * 1e3:.1f} ms (to the "
                      f"start of its recompute) {cmp} copy {(o.out_s + o.back_s) * 1e3:.1f} ms "
                      f"(predicted stall {cost * 1e3:.2f} ms"
                      + (f", CPU {cpu * 1e3:.2f} ms" if cpu else "") + ")")
        elif i is not None:
            if not i.opts:
                why = ("the cpu tier would hold a CPU tensor in the same RAM"
                       if dev == "cpu" else "no move measured") + (
                           "" if has_nvme else "; no nvme_dir")
                reason = f"{head} kept: no tier frees its memory here ({why})"
            elif not met:
                reason = f"{head} kept: host and disk budgets full"
            else:
                o = i.opts[0]
                reason = (f"{head} kept: the budget is met without moving it (a "
                          f"{o.tier.value} move would cost {o.cost_s * 1e3:.2f} ms: stall + CPU)")
        elif x.kind == "before":
            if x.arg in b.before_kept:
                reason = (f"{head} kept: a dedup hit of #{x.saved_as} in a plain step, "
                          "whose block is checkpointed too")
            else:
                kept, shared = 0, x.saved_as
                reason = (f"{head} shares the handle of #{x.saved_as} (saved before the "
                          "block; counted there)")
        else:
            kept = 0 if x.kind == "param" else x.nbytes
            reason = f"{head} {KIND_REASON[x.kind]}"
        order = (tier_orders(dev, has_nvme)[tier] if tier is not Tier.KEEP else (Tier.KEEP,))
        out.append(PlannedInput(x.arg, tuple(x.shape), x.dtype, x.device, x.nbytes, x.kind,
                                tier.value, tuple(t.value for t in order), kept, reason,
                                window_s, cost, cpu, shared))
    return out




def as_input(found) -> str:
    """The end of a checkpointed tensor's reason when it is its block's input."""
    if found is None:
        return ""
    b, x = found
    where = "kept" if x.tier == Tier.KEEP.value else f"moved to {x.tier}"
    return f"; its storage is the block's input {x.arg}, which the checkpoint saves: {where}"


def per_mib(seconds: float, freed: int) -> str:
    return f"{seconds * 1e3 / max(1, freed) * (1 << 20):.3f}"


def choice_reasons(records, options: dict, costs: dict, checkpointed: dict, room_left: dict,
                   need: int, freed: int, must_ids: set, has_nvme: bool, reasons: dict,
                   hint_end: dict) -> None:
    """Write the reasons (``reasons``: the head, ``hint_end``: what became of
    a hint) of the choice in ``costs`` / ``checkpointed``, from the constraints
    that bind: a tier's room (``room_left``: bytes left per tier), the device
    budget (``need`` bytes asked, ``freed`` freed), the block a tensor's
    checkpoint takes. MUST answers and kept tensors whose budget is met are
    left to the caller."""
    keep_hinted = sum(o.freed for i, o in costs.items()
                      if i not in must_ids and records[i].hint is not None
                      and not is_move_hint(records[i].hint[0]))
    short = need - (freed - keep_hinted)
    for r in records:
        i = r.index
        if i in must_ids:
            continue
        reasons.pop(i, None)
        hint_end.pop(i, None)
        if i in checkpointed:
            if r.hint is not None:
                hint_end[i] = f"; hint {r.hint[1]} overridden: its block is checkpointed"
            continue
        o, opts = costs.get(i), options[i]
        if o is None:
            if opts and freed < need:
                reasons[i] = "kept: host and disk budgets full"
            continue
        best = opts[0]
        if best is not o and best.tier in room_left and room_left[best.tier] < r.nbytes:
            reasons[i] = (f"{o.tier.value}: {'host' if best.tier is Tier.CPU else 'disk'} "
                          "budget full")
        elif best is not o and (r.hint is None or not is_move_hint(r.hint[0])):
            reasons[i] = (f"{o.tier.value}: {best.tier.value} is cheaper per freed byte but "
                          "costs more in total here")
        if r.hint is None:
            continue
        if not is_move_hint(r.hint[0]):
            hint_end[i] = (f"; hint {r.hint[1]} overridden: the budget was still "
                           f"{format_bytes(short)} short after moving every tensor without "
                           "a keep hint")
            continue
        want = r.hint[0][0]
        if o.tier is want:
            hint_end[i] = f"; hint {r.hint[1]} followed"
            continue
        offered = any(p.tier is want for p in opts)
        why = (unavailable(r, want, has_nvme) if not offered
               else f"the {want.value} budget is full"
               if want in room_left and room_left[want] < r.nbytes
               else f"{o.tier.value} costs less here")
        hint_end[i] = f"; hint {r.hint[1]} overridden: {why}"
