"""The auto planner's greedy choice, the fallback and floor of the solver
(NOTE [Planner choice] in planner/milp.py): each tensor's cheapest option
per freed byte (ties: recompute, cpu, nvme) and each auto block's
checkpoint, taken in that order of price (hinted moves first, keep hints
last; then the longest window first) until the device budget is met. A move
whose tier is out of room tries the tensor's next option; a checkpoint
undoes its tensors' choices and gives their room back."""

from __future__ import annotations

import heapq
import itertools
from typing import Tuple

from ..policy import Tier
from ..telemetry import format_bytes
from .costs import BlockOption, InputOption
from .explain import unavailable
from .hints import is_move_hint
from .profile import TensorRecord

__all__ = ["choose", "hint_group"]


def hint_group(r: TensorRecord) -> int:
    """Where a tensor's hint puts it in the price ranking (NOTE [Planner
    hints]): hinted moves first (0), unhinted tensors and blocks (1), keep
    hints last (2)."""
    return 1 if r.hint is None else 0 if is_move_hint(r.hint[0]) else 2


def choose(records, options, blocks, need: int, freed: int, room: dict, choice: dict,
            costs: dict, reasons: dict, checkpointed: dict, hint_end: dict, must_ids: set,
            has_nvme: bool) -> Tuple[int, int]:
    """Step 2 of NOTE [Planner cost model]: take the cheapest options per freed
    byte, tensors', blocks' and checkpointed blocks' inputs', until ``need``
    bytes are freed (``freed``: already freed by the MUST answers, which are
    never revisited). Fills ``choice``, ``costs``, ``reasons``,
    ``checkpointed`` and ``hint_end``, and the blocks' ``chosen`` and their
    inputs' ``move``; returns (bytes freed, recipe and checkpoint input bytes
    the choices keep beyond those of the MUST answers)."""
    cands = [((hint_group(r), options[r.index][0].cost_s / options[r.index][0].freed, 0,
               -(r._use - r.pack_s), r.index), r)
             for r in records if options[r.index] and r.index not in must_ids]
    cands += [((1, b.price, 1, 0.0, b.rec.index), b) for b in blocks
              if b.price != float("inf") and not b.has_must and not b.nested_must]
    order = itertools.count()
    heap = [(key, next(order), c) for key, c in cands]
    heapq.heapify(heap)
    extra_kept = 0
    refused = []   # (key, record): no room when their turn came
    while heap:
        key, _, c = heapq.heappop(heap)
        if freed >= need:
            break
        if isinstance(c, BlockOption):
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
                if records[i].hint is not None:
                    hint_end[i] = (f"; hint {records[i].hint[1]} overridden: its block is "
                                   "checkpointed")
            b.chosen = True
            freed += b.freed
            extra_kept += b.kept_in
            # "before" inputs whose saver is no longer saved are kept anew
            # (rule 6 of the NOTE), this block's and earlier chosen ones'.
            for o in blocks:
                for x in o.rec.inputs if o.chosen else ():
                    if (x.kind == "before" and x.arg not in o.before_kept
                            and x.saved_as in checkpointed):
                        o.before_kept.add(x.arg)
                        freed -= x.nbytes
                        extra_kept += x.nbytes
            for i in b.ins:
                move = next((o for o in i.opts if o.tier is b.tier), None)
                if move is not None and room[move.tier] >= i.x.nbytes:
                    room[move.tier] -= i.x.nbytes
                    i.move = move
                    freed += i.x.nbytes
                    extra_kept -= i.x.nbytes
                elif i.opts:   # kept for now; moving it is one more option
                    o = i.opts[0]
                    heapq.heappush(heap, ((1, o.cost_s / o.freed, 2, -(i.rec._use - i.rec.pack_s),
                                           i.rec.index), next(order), i))
            for key, r in refused:   # the block gave room back: their turn again
                reasons.pop(r.index, None)
                heapq.heappush(heap, (key, next(order), r))
            refused.clear()
            continue
        if isinstance(c, InputOption):
            for o in c.opts:
                if room[o.tier] >= c.x.nbytes:
                    room[o.tier] -= c.x.nbytes
                    c.move = o
                    freed += c.x.nbytes
                    extra_kept -= c.x.nbytes
                    break
            continue
        r = c
        if r.index in checkpointed:
            continue
        full = []
        short = need - freed
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
            refused.append((key, r))
        group = hint_group(r)
        if r.hint is not None and group == 2 and choice[r.index] is not Tier.KEEP:
            hint_end[r.index] = (f"; hint {r.hint[1]} overridden: the budget was still "
                                 f"{format_bytes(short)} short after moving every "
                                 "tensor without a keep hint")
        elif r.hint is not None and group == 0:
            want = r.hint[0][0]
            if choice[r.index] is want:
                hint_end[r.index] = f"; hint {r.hint[1]} followed"
            else:
                why = (f"the {want.value} budget is full" if want in full
                       else unavailable(r, want, has_nvme))
                hint_end[r.index] = f"; hint {r.hint[1]} overridden: {why}"
    return freed, extra_kept


