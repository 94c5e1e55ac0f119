"""The auto planner's prices: per saved tensor its options (recompute, cpu,
nvme), per auto block its checkpoint; the tier orders a plan gives.
"""

# NOTE [Option prices]
# - recompute (only where the recompute tier took it in the profile): its
#   regeneration time measured in the profile's backward (else bytes / the
#   pointwise rate); frees its bytes less its recipe's kept inputs.
# - cpu (CUDA tensors only: a CPU tensor's host copy is the same RAM): the
#   stall of one tensor alone on the link, copied out after its save and back
#   from the start of backward: max(0, back - (use - max(bwd start, save + out))).
# - nvme: the same with the disk's measured legs (plus PCIe on CUDA); for a
#   CPU tensor plus its CPU charge: its round trip's CPU seconds over the
#   threads the compute spreads over, which a CPU device's compute loses.
# - an auto block's checkpoint: its profiled forward once more in backward;
#   frees what it saved less the inputs the checkpoint keeps; its movable
#   inputs may then move too, priced as tensors needed when its recompute
#   starts (rule 6 of NOTE [Blocks the planner may checkpoint]).
# Prices are lone: no channel contention; the simulation adds that after.

from __future__ import annotations

from typing import List, Optional, Tuple

from ..policy import Tier
from ..runtime.prefetch import AUTO_MIN_BYTES
from .profile import BlockInput, BlockRecord, TensorRecord
from .rates import Rates

__all__ = ["safe_order", "tier_orders", "Option", "cpu_charge_s", "plan_window_bytes",
           "options_of", "recompute_option", "move_option", "legs_of", "obey", "hinted_first",
           "InputOption", "BlockOption", "KEPT_KINDS", "SLOW_READS"]

PREF = {Tier.RECOMPUTE: 0, Tier.CPU: 1, Tier.NVME: 2}
#: How much slower than measured the reads a plan's window is sized to
#: absorb (NOTE [Planner cost model], 3).
SLOW_READS = 2.0


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


class Option:
    __slots__ = ("tier", "cost_s", "freed", "out_s", "back_s", "cpu_s", "slowdown", "track_s")

    def __init__(self, tier, cost_s, freed, out_s=0.0, back_s=0.0, cpu_s=0.0,
                 slowdown=1.0, track_s=0.0) -> None:
        self.tier, self.cost_s, self.freed = tier, cost_s, freed
        self.out_s, self.back_s = out_s, back_s
        #: CPU charge (part of cost_s) and the both-directions slowdown of its restore.
        self.cpu_s, self.slowdown = cpu_s, slowdown
        #: A recompute's share of the tracking its recipe needs (part of
        #: cost_s: NOTE [Tracking priced] in planner/runtime.py).
        self.track_s = track_s


def cpu_charge_s(nbytes: int, device: str, tier: Tier, rates: Rates) -> float:
    """Step seconds the CPU work of moving ``nbytes`` to ``tier`` takes from the
    compute (NOTE [Planner cost model]): nvme moves of CPU tensors only."""
    if tier is not Tier.NVME or device.startswith("cuda") or not rates.move_cpu:
        return 0.0
    return (nbytes / rates.move_cpu + rates.move_fixed_cpu_s) / max(1.0, rates.compute_threads)


def slowdown_of(tier: Tier, cuda: bool, rates: Rates) -> float:
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


def legs_of(r: TensorRecord, tier: Tier, rates: Rates) -> Optional[Tuple[float, float]]:
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


def recompute_option(r: TensorRecord, rates: Rates, track_s: float = 0.0) -> Option:
    """Recomputing ``r``: its measured regeneration time (else bytes / the
    pointwise rate) plus ``track_s``, its share of the tracking its recipe
    needs (NOTE [Tracking priced] in planner/runtime.py), freeing its bytes
    less its recipe's kept inputs."""
    cost = r.recompute_s if r.recompute_s is not None else r.nbytes / rates.pointwise
    return Option(Tier.RECOMPUTE, cost + track_s, max(0, r.nbytes - r.input_kept_bytes),
                   track_s=track_s)


def move_option(r: TensorRecord, tier: Tier, legs: Tuple[float, float], rates: Rates,
                 bwd_start: float) -> Option:
    """Moving ``r`` to ``tier`` with ``legs`` (out, back): its lone-link stall
    plus its CPU charge (NOTE [Option prices])."""
    out, back = legs
    lead = r._use - max(bwd_start, r.pack_s + out)
    cpu = cpu_charge_s(r.nbytes, r.device, tier, rates)
    return Option(tier, max(0.0, back - lead) + cpu, r.nbytes, out, back, cpu,
                   slowdown_of(tier, r.device.startswith("cuda"), rates))


def options_of(r: TensorRecord, rates: Rates, has_nvme: bool, bwd_start: float,
             track_s: Optional[float] = 0.0) -> List[Option]:
    """``r``'s options, cheapest per freed byte first (``r._use`` set);
    ``track_s``: its recompute's tracking share, ``None``: not an option
    (NOTE [Tracking priced] in planner/runtime.py)."""
    opts = []
    if r.recomputable and r.nbytes > r.input_kept_bytes and track_s is not None:
        opts.append(recompute_option(r, rates, track_s))
    for tier in (Tier.CPU, Tier.NVME):
        if tier is Tier.NVME and not has_nvme:
            continue
        legs = legs_of(r, tier, rates)
        if legs is not None:
            opts.append(move_option(r, tier, legs, rates, bwd_start))
    opts.sort(key=lambda o: (o.cost_s / o.freed, PREF[o.tier]))
    return opts



def obey(r: TensorRecord, rates: Rates, bwd_start: float, room: dict) -> Option:
    """The option of a MUST-answered tensor (NOTE [Planner hints], rule 2)."""
    tier = r.hint[0][0]
    if tier is Tier.RECOMPUTE:
        return recompute_option(r, rates)
    if tier is Tier.CPU:
        legs = legs_of(r, tier, rates)
        if legs is None or room[Tier.CPU] < r.nbytes:   # a CPU tensor, or the tier full
            return Option(tier, 0.0, 0)
        room[Tier.CPU] -= r.nbytes
        return move_option(r, tier, legs, rates, bwd_start)
    return Option(Tier.KEEP, 0.0, 0)


def hinted_first(r: TensorRecord, opts: List[Option]) -> List[Option]:
    """``opts`` with the tiers of ``r``'s move hint first, in its order."""
    order = r.hint[0]
    return sorted(opts, key=lambda o: order.index(o.tier) if o.tier in order else len(order))


class InputOption:
    """A movable input of block option ``block`` (rule 6 of NOTE [Blocks the
    planner may checkpoint] in planner/runtime.py): ``rec`` stands for it in
    the timeline (saved at the block's entry, needed when backward starts
    the block's recompute), ``opts`` its moves, ``move`` the one taken."""

    __slots__ = ("block", "x", "rec", "opts", "move")

    def __init__(self, block: "BlockOption", x: BlockInput, rec: TensorRecord, opts) -> None:
        self.block, self.x, self.rec, self.opts = block, x, rec, opts
        self.move: Optional[Option] = None


class BlockOption:
    """A block option (NOTE [Blocks the planner may checkpoint] in
    planner/runtime.py): checkpointing frees ``freed`` bytes for ``cost_s``
    with its inputs kept; ``tier``: the tier its movable inputs go to in its
    cheapest option per freed byte (``price``), None to keep them."""

    __slots__ = ("rec", "saved", "freed", "cost_s", "chosen", "has_must", "need_s", "ins",
                 "kept_in", "before_kept", "tier", "price", "nested_must")

    def __init__(self, rec: BlockRecord, records: List[TensorRecord], must_ids: set,
                 rates: Rates, has_nvme: bool, bwd_start: float, new_index) -> None:
        self.rec = rec
        self.has_must = any(i in must_ids for i in range(rec.start, rec.end))
        inside = records[rec.start:rec.end]
        self.saved = sum(r.nbytes for r in inside)
        # The recompute starts at the first unpack of a tensor saved inside.
        uses = [r._use for r in inside if r.first_use_s is not None]
        self.need_s = min(uses) if uses else bwd_start
        self.ins: List[InputOption] = []
        #: Args of ``"before"`` inputs counted kept (their saver checkpointed).
        self.before_kept: set = set()
        if rec.inputs:
            self.kept_in = sum(x.nbytes for x in rec.inputs if x.kind in KEPT_KINDS)
            for x in rec.inputs:
                if x.kind != "movable":
                    continue
                r = TensorRecord(new_index(), rec.module, None, x.shape, x.dtype, x.device,
                                 x.nbytes, rec.start_s, first_use_s=self.need_s)
                r._use = self.need_s
                opts = [o for o in options_of(r, rates, has_nvme, bwd_start)
                        if o.tier is not Tier.RECOMPUTE]
                self.ins.append(InputOption(self, x, r, opts))
        else:   # not recorded (a made-up profile): every input kept
            self.kept_in = rec.input_bytes
        self.freed = self.saved + rec.fixed_bytes - self.kept_in
        self.cost_s = rec.forward_s
        self.chosen = False
        #: The MUST policy of a wrap_blocks block nested in it (its name), or
        #: None: checkpointing would recompute what that policy saves.
        self.nested_must: Optional[str] = getattr(rec, "must_inside", None)
        self.tier: Optional[Tier] = None
        self.price = self.cost_s / self.freed if self.freed > 0 else float("inf")
        for tier in (Tier.CPU, Tier.NVME):
            moves = [next((o for o in i.opts if o.tier is tier), None) for i in self.ins]
            if not moves or None in moves:
                continue
            freed = self.freed + sum(i.x.nbytes for i in self.ins)
            price = (self.cost_s + sum(o.cost_s for o in moves)) / freed if freed > 0 else None
            if price is not None and price < self.price:
                self.price, self.tier = price, tier

    def moved_bytes(self) -> int:
        return sum(i.x.nbytes for i in self.ins if i.move is not None)


#: Input kinds a checkpoint keeps and the kept bytes count (``"before"``
#: only when its saver is not saved: see ``BlockOption.before_kept``).
KEPT_KINDS = ("movable", "small", "unmovable", "after")

