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
#      ``move_fixed_cpu_s``: the engine's threads; before 2026-12-02 the probe
#      also made two staging copies the tier does not, pricing these moves
#      about 4x over with the C++ engine) over the
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
#    A ``checkpoint="auto"`` block is one more option, ranked with the
#    tensors' by the same price: checkpointing it costs its profiled forward
#    once more in backward and frees the bytes saved inside it less the
#    bytes of the inputs it keeps (which the checkpoint saves); or, moving
#    its movable inputs to cpu or nvme, costs also their moves (priced as a
#    tensor's: saved at the block's entry, needed at the first unpack of a
#    tensor saved inside it) and frees those bytes too. Taking it undoes the
#    choices already made for its tensors (they are no longer saved), skips
#    them later, gives their room back to the tensors refused for room, and,
#    where its inputs stay, makes moving each one more option (NOTE [Blocks
#    the planner may checkpoint] in planner/runtime.py, rule 6). Ties go to
#    the tensors, and to kept inputs.
#    That greedy choice is the start of an improvement pass, which lowers its
#    priced cost under the same budgets (NOTE [Planner choice] in
#    planner/improve.py); steps 3 and 4 take the improved choice.
# 3. The prefetch window (the plan's ``suggested_prefetch_bytes``, which a
#    step following the plan uses when ``prefetch_bytes`` is unset): the room
#    the budget leaves at the start of backward (budget - predicted kept), no
#    more than the bytes moved, and at least AUTO_MIN_BYTES (restores need
#    some lead); ``prefetch_bytes`` when set. Unset, it is raised by the
#    largest moved tensor (no more than the bytes moved) where the
#    simulation (4) predicts less stall with it, or the same stall at the
#    measured rates and less with reads SLOW_READS times slower (the plan's
#    notes say which). Measured (2026-12-02-cpu-stall-predict): with a
#    one-tensor window the prefetcher starts a restore only when the moved
#    tensor before it is used, so a moved tensor needed soon after another
#    (attention's softmax output after its dropout's) has only the compute
#    between them to be read in (13-30 ms predicted); on the loaded shared
#    machine such reads took 3-22x the probe's time, and those restores were
#    the only late ones left. The raise may hold that one tensor more
#    restored ahead than the budget's room at the start of backward, as the
#    AUTO_MIN_BYTES floor may.
# 4. The chosen moves are then simulated: that gives the predicted stall
#    (per tensor ``PlannedTensor.restore_s``: its read's start and end and
#    its need, from the start of backward). Rules:
#    a. Moves out queue in pack order on one serial channel per tier.
#    b. Restores run on one serial channel per tier, issued as the
#       prefetcher issues them (tiermem/runtime/prefetch.py), not in use order: at
#       the kick (the first use of the plan's kick tensor, the kept tensor
#       the profile saw unpacked first, before every moved one: NOTE
#       [Restores start with backward] in runtime/hooks.py) from the last packed
#       moved tensor down, and at each moved tensor's unpack from the cursor
#       (just below it when it is above the last one, or at or below the
#       cursor), down the packing order while the bytes restored and not yet
#       used are below the window; a move out not landed by then stops the
#       cursor until the next moved unpack. A tensor not started by its use
#       is read on demand then (its unpack waits its whole read, e.g. the
#       first one backward needs when there is no kick), ahead of what that
#       unpack's refill issues; one whose move out has not landed at its use
#       is not read (the unpack takes the source: ``MovingStore.take``).
#    c. A restore that overlaps moves out of its tier runs at the measured
#       both-directions rate for the overlap (``disk_both`` / ``link_both``:
#       its time there is stretched by single rate / both rate).
#    d. Each stall delays every later need.
#    e. The needs are the followed step's, not the profile's: the profile
#       ran under the safe order (NOTE [Profile under the safe order] in
#       planner/runtime.py), whose backward read or regenerated nearly every
#       tensor. Each record's first use is moved earlier by what the unpacks
#       before it cost in the profile and the plan does not pay (their time,
#       ``TensorRecord.unpack_s``: read waits and regenerations; and, for each
#       read from nvme, half the CPU charge of a round trip: its read's share,
#       which the compute lost as in 2), and later by what the plan adds
#       (its recomputes' ``recompute_s``, half the CPU charge of each of its
#       reads, a checkpointed block's forward at the start of its recompute):
#       ``_followed_uses``. A tensor that a regeneration read as its recipe's
#       input before autograd unpacked it (``TensorRecord.leaf_use_s``, by
#       ``leaf_reader``) is needed then when the plan recomputes that reader
#       (attention's softmax output, read by the regeneration of its
#       dropout's output), else at its own first unpack.
#    Measured (2026-12-02-cpu-stall-predict, a 4-layer TinyGPT): every late
#    restore of the plans made without b and the leaf uses of e was read on
#    demand (2-4 per followed step, none predicted, the first plans
#    predicting 0 stall), most of them attention's softmax outputs read by
#    the regeneration of the dropout output those plans recompute; with
#    them, no restore was read on demand. The profiled steps' own stall (its
#    first read mostly) ranged 0.1-540 ms; under the shared machine's load
#    the followed steps' needs still differed from the corrected ones by
#    hundreds of ms either way, so the timeline correction is not shown by
#    measurement (its unit tests show what it does).
# Budgets the tiers cannot meet leave the rest kept, and the plan says so.
# The options' prices (2) read the profile's timeline as it is; only the
# prediction reads the followed step's (4e).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import time
from types import SimpleNamespace
from typing import List, Optional, Tuple

from ..policy import Tier
from ..runtime.prefetch import AUTO_MIN_BYTES
from ..telemetry import format_bytes
from .hints import is_move_hint
from .improve import improve_choice
from .plan import (CHECKPOINTED, Plan, PlannedBlock, PlannedInput, PlannedTensor,
                   revived_positions)
from .profile import BlockInput, BlockRecord, Profile, TensorRecord
from .rates import Rates

__all__ = ["make_plan", "safe_order", "tier_orders", "cpu_charge_s", "plan_window_bytes",
           "SLOW_READS"]

_PREF = {Tier.RECOMPUTE: 0, Tier.CPU: 1, Tier.NVME: 2}
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


class _Option:
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


def _recompute_option(r: TensorRecord, rates: Rates, track_s: float = 0.0) -> _Option:
    """Recomputing ``r``: its measured regeneration time (else bytes / the
    pointwise rate) plus ``track_s``, its share of the tracking its recipe
    needs (NOTE [Tracking priced] in planner/runtime.py), freeing its bytes
    less its recipe's kept inputs."""
    cost = r.recompute_s if r.recompute_s is not None else r.nbytes / rates.pointwise
    return _Option(Tier.RECOMPUTE, cost + track_s, max(0, r.nbytes - r.input_kept_bytes),
                   track_s=track_s)


def _move_option(r: TensorRecord, tier: Tier, legs: Tuple[float, float], rates: Rates,
                 bwd_start: float) -> _Option:
    """Moving ``r`` to ``tier`` with ``legs`` (out, back): its lone-link stall
    plus its CPU charge (NOTE [Planner cost model], 2)."""
    out, back = legs
    lead = r._use - max(bwd_start, r.pack_s + out)
    cpu = cpu_charge_s(r.nbytes, r.device, tier, rates)
    return _Option(tier, max(0.0, back - lead) + cpu, r.nbytes, out, back, cpu,
                   _slowdown(tier, r.device.startswith("cuda"), rates))


def _options(r: TensorRecord, rates: Rates, has_nvme: bool, bwd_start: float,
             track_s: Optional[float] = 0.0) -> List[_Option]:
    """``r``'s options, cheapest per freed byte first (``r._use`` set);
    ``track_s``: its recompute's tracking share, ``None``: not an option
    (NOTE [Tracking priced] in planner/runtime.py)."""
    opts = []
    if r.recomputable and r.nbytes > r.input_kept_bytes and track_s is not None:
        opts.append(_recompute_option(r, rates, track_s))
    for tier in (Tier.CPU, Tier.NVME):
        if tier is Tier.NVME and not has_nvme:
            continue
        legs = _legs(r, tier, rates)
        if legs is not None:
            opts.append(_move_option(r, tier, legs, rates, bwd_start))
    opts.sort(key=lambda o: (o.cost_s / o.freed, _PREF[o.tier]))
    return opts


def _overlap(a: float, b: float, spans: list) -> float:
    """Seconds of [a, b] covered by the (disjoint, sorted) ``spans``: a
    binary search to the first span ending after ``a``, then the few that
    start before ``b``."""
    total = 0.0
    k = bisect.bisect_right(spans, (a, float("inf")))
    if k and spans[k - 1][1] > a:
        k -= 1
    while k < len(spans) and spans[k][0] < b:
        s, e = spans[k]
        total += max(0.0, min(b, e) - max(a, s))
        k += 1
    return total


def _simulate(chosen, bwd_start: float, window_bytes: Optional[int] = None,
              kick_s: Optional[float] = None, trace: Optional[dict] = None,
              use_s: Optional[dict] = None):
    """Serial channels and the prefetcher's cursor (see NOTE [Planner cost
    model], 4): per-tensor stall, total stall, and the most bytes restored
    ahead of their use at once; ``kick_s``: when the kept tensor that starts
    the restores is unpacked (None: no such tensor, restores start at the
    first moved unpack); ``trace``: filled with index -> (restore start,
    end, need), seconds (all three the need: its move out had not landed,
    nothing is read); ``use_s``: index -> when backward needs it (default
    ``r._use``, the profile's)."""
    if use_s is None:
        use_s = {r.index: r._use for r, _ in chosen}
    out_free: dict = {}
    out_end = {}
    out_spans: dict = {}
    order = sorted(chosen, key=lambda c: (c[0].pack_s, c[0].index))   # the prefetcher's
    for r, o in order:
        start = max(r.pack_s, out_free.get(o.tier, 0.0))
        out_end[r.index] = out_free[o.tier] = start + o.out_s
        out_spans.setdefault(o.tier, []).append((start, start + o.out_s))
    pos = {r.index: k for k, (r, _) in enumerate(order)}
    window = float("inf") if window_bytes is None else window_bytes
    back_free: dict = {}
    started: dict = {}   # index -> (start, end) of restores begun
    used: set = set()
    st = SimpleNamespace(cursor=-1, last=-1, inflight=0)

    def read(r, o, now: float) -> None:
        start = max(now, back_free.get(o.tier, now))
        back = o.back_s
        if o.slowdown > 1.0:
            back += _overlap(start, start + back, out_spans.get(o.tier, ())) * (o.slowdown - 1.0)
        started[r.index] = (start, start + back)
        back_free[o.tier] = start + back

    def fill(now: float) -> None:   # Prefetcher._fill
        while st.cursor >= 0 and st.inflight < window:
            r, o = order[st.cursor]
            if r.index not in used and r.index not in started:
                if out_end[r.index] > now:
                    break   # not landed: retried at the next moved unpack
                read(r, o, now)
                st.inflight += r.nbytes
            st.cursor -= 1

    uses = sorted(chosen, key=lambda c: (use_s[c[0].index], c[0].index))
    if kick_s is not None and uses and kick_s <= use_s[uses[0][0].index]:   # Prefetcher.kick
        st.cursor, st.last = len(order) - 1, len(order)
        fill(kick_s)
    shift = 0.0
    stalls = {}
    spans = []
    for r, o in uses:
        now = use_s[r.index] + shift
        used.add(r.index)
        if r.index in started:
            st.inflight -= r.nbytes
        elif out_end[r.index] <= now:
            read(r, o, now)        # on demand: take() starts it, then waits
        p = pos[r.index]
        if p > st.last or p <= st.cursor:   # Prefetcher.advance
            st.cursor = p - 1
        st.last = p
        fill(now)
        start, end = started.get(r.index, (now, now))   # not landed: the source, no read
        stall = max(0.0, end - now)
        shift += stall
        stalls[r.index] = stall
        if trace is not None:
            trace[r.index] = (start, end, now)
        spans.append((start, now + stall, r.nbytes))
    events = sorted([(s, n) for s, _, n in spans] + [(e, -n) for _, e, n in spans])
    ahead = peak = 0
    for _, n in events:
        ahead += n
        peak = max(peak, ahead)
    return stalls, sum(stalls.values()), peak


def _followed_uses(records, choice, costs, blocks, chosen, kick, bwd_start: float,
                   rates: Rates) -> dict:
    """When a step following the plan needs each moved tensor (and the kick
    tensor), by index (NOTE [Planner cost model], 4): the profile's first use
    less what its earlier unpacks cost there and the plan does not pay (the
    time they took, ``TensorRecord.unpack_s``: the safe order's reads and
    regenerations; the CPU charge of the reads it made, half a round trip's),
    plus what the plan adds (its recomputes' ``recompute_s``, the CPU charge
    of its reads, a checkpointed block's forward at its recompute's start).
    Moves add their stalls in the simulation."""
    nvme = Tier.NVME.value
    deltas = []   # (time, index, seconds the followed backward differs by after it)
    for r in records:
        if r.first_use_s is None:
            continue
        d = -(r.unpack_s or 0.0)
        if choice[r.index] is Tier.RECOMPUTE:
            d += costs[r.index].cost_s
        read = cpu_charge_s(r.nbytes, r.device, Tier.NVME, rates) / 2
        d += read * ((choice[r.index] is Tier.NVME) - (r.profile_tier == nvme))
        if d:
            deltas.append((r.first_use_s, r.index, d))
    for b in blocks:
        if b.chosen:
            # After its inputs' unpacks (the recompute starts with them).
            deltas.append((b.need_s, float("inf"), b.rec.forward_s))
    deltas.sort()
    times = [(t, i) for t, i, _ in deltas]
    shift = list(itertools.accumulate((d for _, _, d in deltas), initial=0.0))

    def at(r) -> float:
        use = r._use
        reader = getattr(r, "leaf_reader", None)
        if reader is not None and choice.get(reader) is Tier.RECOMPUTE:
            use = min(use, r.leaf_use_s)   # read by a regeneration the plan makes
        k = bisect.bisect_left(times, (use, r.index))   # unpacks strictly before
        return max(bwd_start, use + shift[k])
    out = {r.index: at(r) for r, _ in chosen}
    if kick is not None:
        out[kick.index] = at(kick)
    return out


def _slower(o: _Option, factor: float) -> _Option:
    """``o`` with its restore ``factor`` times longer (NOTE [Planner cost
    model], 3)."""
    return _Option(o.tier, o.cost_s, o.freed, o.out_s, o.back_s * factor, o.cpu_s,
                   o.slowdown)


def _why_no_option(r: TensorRecord, has_nvme: bool) -> str:
    cpu_dev = not r.device.startswith("cuda")
    why = ["not recomputable" if not r.recomputable
           else "its recipe's inputs cost as much device memory as it frees"]
    if cpu_dev:
        why.append("the cpu tier would hold a CPU tensor in the same RAM")
    if not has_nvme:
        why.append("no nvme_dir")
    return "kept: no tier frees its memory here (" + "; ".join(why) + ")"


def _unavailable(r: TensorRecord, tier: Tier, has_nvme: bool) -> str:
    """Why ``tier`` is not an option of ``r`` (NOTE [Planner hints], rule 3)."""
    if tier is Tier.RECOMPUTE:
        return ("not recomputable" if not r.recomputable
                else "its recipe's inputs cost as much device memory as it frees")
    if tier is Tier.CPU and not r.device.startswith("cuda"):
        return "the cpu tier would hold a CPU tensor in the same RAM"
    if tier is Tier.NVME and not has_nvme:
        return "no nvme_dir"
    return f"no measured {tier.value} rate"


def _obey(r: TensorRecord, rates: Rates, bwd_start: float, room: dict) -> _Option:
    """The option of a MUST-answered tensor (NOTE [Planner hints], rule 2)."""
    tier = r.hint[0][0]
    if tier is Tier.RECOMPUTE:
        return _recompute_option(r, rates)
    if tier is Tier.CPU:
        legs = _legs(r, tier, rates)
        if legs is None or room[Tier.CPU] < r.nbytes:   # a CPU tensor, or the tier full
            return _Option(tier, 0.0, 0)
        room[Tier.CPU] -= r.nbytes
        return _move_option(r, tier, legs, rates, bwd_start)
    return _Option(Tier.KEEP, 0.0, 0)


def _hinted_first(r: TensorRecord, opts: List[_Option]) -> List[_Option]:
    """``opts`` with the tiers of ``r``'s move hint first, in its order."""
    order = r.hint[0]
    return sorted(opts, key=lambda o: order.index(o.tier) if o.tier in order else len(order))


class _In:
    """A movable input of block option ``block`` (rule 6 of NOTE [Blocks the
    planner may checkpoint] in planner/runtime.py): ``rec`` stands for it in
    the timeline (saved at the block's entry, needed when backward starts
    the block's recompute), ``opts`` its moves, ``move`` the one taken."""

    __slots__ = ("block", "x", "rec", "opts", "move")

    def __init__(self, block: "_Block", x: BlockInput, rec: TensorRecord, opts) -> None:
        self.block, self.x, self.rec, self.opts = block, x, rec, opts
        self.move: Optional[_Option] = None


class _Block:
    """A block option (NOTE [Blocks the planner may checkpoint] in
    planner/runtime.py): checkpointing frees ``freed`` bytes for ``cost_s``
    with its inputs kept; ``tier``: the tier its movable inputs go to in its
    cheapest option per freed byte (``price``), None to keep them."""

    __slots__ = ("rec", "saved", "freed", "cost_s", "chosen", "has_must", "need_s", "ins",
                 "kept_in", "before_kept", "tier", "price")

    def __init__(self, rec: BlockRecord, records: List[TensorRecord], must_ids: set,
                 rates: Rates, has_nvme: bool, bwd_start: float, new_index) -> None:
        self.rec = rec
        self.has_must = any(i in must_ids for i in range(rec.start, rec.end))
        inside = records[rec.start:rec.end]
        self.saved = sum(r.nbytes for r in inside)
        # The recompute starts at the first unpack of a tensor saved inside.
        uses = [r._use for r in inside if r.first_use_s is not None]
        self.need_s = min(uses) if uses else bwd_start
        self.ins: List[_In] = []
        #: Args of ``"before"`` inputs counted kept (their saver checkpointed).
        self.before_kept: set = set()
        if rec.inputs:
            self.kept_in = sum(x.nbytes for x in rec.inputs if x.kind in _KEPT_KINDS)
            for x in rec.inputs:
                if x.kind != "movable":
                    continue
                r = TensorRecord(new_index(), rec.module, None, x.shape, x.dtype, x.device,
                                 x.nbytes, rec.start_s, first_use_s=self.need_s)
                r._use = self.need_s
                opts = [o for o in _options(r, rates, has_nvme, bwd_start)
                        if o.tier is not Tier.RECOMPUTE]
                self.ins.append(_In(self, x, r, opts))
        else:   # not recorded (a made-up profile): every input kept
            self.kept_in = rec.input_bytes
        self.freed = self.saved + rec.fixed_bytes - self.kept_in
        self.cost_s = rec.forward_s
        self.chosen = False
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
#: only when its saver is not saved: see ``_Block.before_kept``).
_KEPT_KINDS = ("movable", "small", "unmovable", "after")


def _hint_group(r: TensorRecord) -> int:
    """Where a tensor's hint puts it in the price ranking (NOTE [Planner
    hints]): hinted moves first (0), unhinted tensors and blocks (1), keep
    hints last (2)."""
    return 1 if r.hint is None else 0 if is_move_hint(r.hint[0]) else 2


def _choose(records, options, blocks, need: int, freed: int, room: dict, choice: dict,
            costs: dict, reasons: dict, checkpointed: dict, hint_end: dict, must_ids: set,
            has_nvme: bool) -> Tuple[int, int]:
    """Step 2 of NOTE [Planner cost model]: take the cheapest options per freed
    byte, tensors', blocks' and checkpointed blocks' inputs', until ``need``
    bytes are freed (``freed``: already freed by the MUST answers, which are
    never revisited). Fills ``choice``, ``costs``, ``reasons``,
    ``checkpointed`` and ``hint_end``, and the blocks' ``chosen`` and their
    inputs' ``move``; returns (bytes freed, recipe and checkpoint input bytes
    the choices keep beyond those of the MUST answers)."""
    cands = [((_hint_group(r), options[r.index][0].cost_s / options[r.index][0].freed, 0,
               -(r._use - r.pack_s), r.index), r)
             for r in records if options[r.index] and r.index not in must_ids]
    cands += [((1, b.price, 1, 0.0, b.rec.index), b) for b in blocks
              if b.price != float("inf") and not b.has_must]
    order = itertools.count()
    heap = [(key, next(order), c) for key, c in cands]
    heapq.heapify(heap)
    extra_kept = 0
    refused = []   # (key, record): no room when their turn came
    while heap:
        key, _, c = heapq.heappop(heap)
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
        if isinstance(c, _In):
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
        group = _hint_group(r)
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
                       else _unavailable(r, want, has_nvme))
                hint_end[r.index] = f"; hint {r.hint[1]} overridden: {why}"
    return freed, extra_kept


def _planned_block(b: _Block, need: int, kept_all: int, budget_bytes: int, stalls: dict,
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
        inputs = _planned_inputs(b, stalls, has_nvme, met)
    elif need <= 0:
        reason = (f"no checkpoint: everything fits in the device budget "
                  f"({format_bytes(kept_all)} <= {format_bytes(budget_bytes)})")
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


_KIND_REASON = {
    "param": "a parameter (or a leaf that requires grad): never moved, not counted",
    "small": "smaller than min_offload_bytes: kept",
    "unmovable": "not a plain cpu or cuda tensor: kept",
    "after": ("kept: the rest of the step saves it again after the block (moving it "
              "would not free it)"),
}


def _planned_inputs(b: _Block, stalls: dict, has_nvme: bool, met: bool) -> List[PlannedInput]:
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
            reason = f"{head} {_KIND_REASON[x.kind]}"
        order = (tier_orders(dev, has_nvme)[tier] if tier is not Tier.KEEP else (Tier.KEEP,))
        out.append(PlannedInput(x.arg, tuple(x.shape), x.dtype, x.device, x.nbytes, x.kind,
                                tier.value, tuple(t.value for t in order), kept, reason,
                                window_s, cost, cpu, shared))
    return out


def make_plan(profile: Profile, rates: Rates, budget_bytes: int, budget_setting: str, *,
              has_nvme: bool, cpu_budget_bytes: int, nvme_budget_bytes: Optional[int],
              replans: int = 0, replan_reason: str = "",
              prefetch_bytes: Optional[int] = None, improve: bool = True,
              tracking_s: Optional[dict] = None, no_recompute: frozenset = frozenset()) -> Plan:
    """The plan of ``profile``'s step under ``budget_bytes`` (NOTE [Planner cost
    model]; hints: NOTE [Planner hints] in planner/hints.py); ``prefetch_bytes``:
    the window setting, ``None`` when unset (the plan then sizes it);
    ``improve``: run the improvement pass over the greedy's choice (NOTE
    [Planner choice] in planner/improve.py); False gives the greedy's alone
    (tests and benchmarks compare the two). ``tracking_s``: pack index ->
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
    options = {r.index: _options(r, rates, has_nvme, bwd_start,
                                 None if r.index in no_recompute else shares.get(r.index, 0.0))
               for r in records}
    room = {Tier.CPU: cpu_budget_bytes,
            Tier.NVME: nvme_budget_bytes if nvme_budget_bytes is not None else 1 << 62}
    extra_kept = freed = must_kept = same_ram = 0
    musts = [r for r in records if r.hint is not None and r.hint[0].must]
    for r in musts:   # constraints first, whatever the budget
        o = _obey(r, rates, bwd_start, room)
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
            options[r.index] = _hinted_first(r, options[r.index])
    must_ids = {r.index for r in musts}
    synthetic = itertools.count(len(records))   # timeline indexes of block inputs
    blocks = [_Block(b, records, must_ids, rates, has_nvme, bwd_start,
                     functools.partial(next, synthetic)) for b in profile.blocks]
    checkpointed: dict = {}   # record index -> its checkpointed _Block
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
        freed, more_kept = _choose(records, options, blocks, need, freed, room, choice, costs,
                                   reasons, checkpointed, hint_end, must_ids, has_nvme)
        got = improve_choice(records, options, blocks, need, freed0, room0, freed, more_kept,
                             room, choice, costs, reasons, checkpointed, must_ids,
                             search=improve)
        if got is None:
            notes.append("choice: the greedy's, unimproved: the improvement pass counted "
                         "it otherwise than the greedy (this is a bug)")
        else:
            freed, more_kept, greedy_priced, priced, changed = got
            if changed:
                notes.append(f"choice: the improvement pass (NOTE [Planner choice] in "
                             f"planner/improve.py) changed {changed} of the greedy's "
                             f"tensor and block choices: priced cost "
                             f"{greedy_priced * 1e3:.2f} -> {priced * 1e3:.2f} ms")
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
                   else _unavailable(r, want, has_nvme) if not options[r.index]
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
    kick = _kick(records, choice, checkpointed, chosen)
    use_s = _followed_uses(records, choice, costs, blocks, chosen, kick, bwd_start, rates)
    kick_s = None if kick is None else use_s[kick.index]
    restores: dict = {}
    stalls, stall_total, _ = _simulate(chosen, bwd_start, window, kick_s, restores, use_s)
    wider = min(moved_bytes, window + max((r.nbytes for r, _ in chosen), default=0))
    if prefetch_bytes is None and wider > window:
        # NOTE [Planner cost model], 3: one tensor more where that predicts
        # less stall, at the measured read rates or at half of them.
        trace: dict = {}
        w_stalls, w_total, _ = _simulate(chosen, bwd_start, wider, kick_s, trace, use_s)
        slow = [(r, _slower(o, SLOW_READS)) for r, o in chosen]
        why = ""
        if w_total < stall_total:
            why = (f"predicted stall {stall_total * 1e3:.2f} -> {w_total * 1e3:.2f} ms")
        elif w_total == stall_total:
            at_half = _simulate(slow, bwd_start, window, kick_s, None, use_s)[1]
            w_half = _simulate(slow, bwd_start, wider, kick_s, None, use_s)[1]
            if w_half < at_half:
                why = (f"with reads at 1/{SLOW_READS:g} of the measured rate: predicted "
                       f"stall {at_half * 1e3:.2f} -> {w_half * 1e3:.2f} ms")
        if why:
            notes.append(f"prefetch window raised from {format_bytes(window)} to "
                         f"{format_bytes(wider)} ({why})")
            window, stalls, stall_total, restores = wider, w_stalls, w_total, trace
    planned_blocks = [_planned_block(b, need, kept_all, budget_bytes, stalls, has_nvme,
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
                "in backward's recompute" + _as_input(inside_of.get(r.index))
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
            if r.index in reasons:   # chosen by the improvement pass
                reason = f"{reasons[r.index]}; {reason[len('recompute: '):]}"
            elif moves and options[r.index][0] is costs[r.index]:
                o = moves[0]
                reason += (f", cheaper per freed byte than {o.tier.value} "
                           f"({_per_mib(cost + track, costs[r.index].freed)} vs "
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
            restore_s=_since(restores.get(r.index), bwd_start)))
    recompute_total += sum(b.cost_s for b in blocks if b.chosen)
    cpu_total += sum(x.cpu_s for b in planned_blocks for x in b.inputs)
    return Plan(profile.signature, tensors, budget_bytes, budget_setting,
                profile.baseline_bytes, fixed_kept, kept, stall_total,
                recompute_total, window, rates.as_dict(), time.perf_counter() - t0,
                replans, replan_reason, notes=notes, blocks=planned_blocks,
                predicted_cpu_s=cpu_total, kick_index=None if kick is None else kick.index,
                priced_cost_s=priced, greedy_priced_cost_s=greedy_priced)


def _kick(records, choice, checkpointed, chosen) -> Optional[TensorRecord]:
    """The kept tensor whose unpack starts a followed step's restores: the one
    the profile saw unpacked first, if before every moved one (NOTE [Restores
    start with backward] in runtime/hooks.py); None when nothing moves."""
    if not chosen:
        return None
    first_move = min(r._use for r, _ in chosen)
    kept = [r for r in records if choice[r.index] is Tier.KEEP and r.index not in checkpointed
            and r.first_use_s is not None and r.first_use_s < first_move]
    return min(kept, key=lambda r: (r.first_use_s, r.index), default=None)


def _since(times, origin: float):
    """``times`` (a tuple of seconds) less ``origin``; None stays None."""
    return None if times is None else tuple(t - origin for t in times)


def _as_input(found) -> str:
    """The end of a checkpointed tensor's reason when it is its block's input."""
    if found is None:
        return ""
    b, x = found
    where = "kept" if x.tier == Tier.KEEP.value else f"moved to {x.tier}"
    return f"; its storage is the block's input {x.arg}, which the checkpoint saves: {where}"


def _per_mib(seconds: float, freed: int) -> str:
    return f"{seconds * 1e3 / max(1, freed) * (1 << 20):.3f}"
