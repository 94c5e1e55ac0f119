"""The auto planner's timeline of a followed step: when backward needs each
moved tensor, and the serial channels and prefetch window that give each
restore's stall (NOTE [Planner cost model], 4, in solver.py).
"""

# NOTE [Predicted restores]
# a. Moves out queue in pack order on one serial channel per tier.
# b. Restores run on one serial channel per tier, issued by the prefetcher's
#    own window walk (runtime/prefetch.py: fill_window, cursor_after_use): at
#    the kick (the plan's kick tensor's use) from the top, and at each moved
#    unpack; a move out not landed stops the walk. A tensor not started by
#    its use is read on demand then; one not landed is not read at all.
# c. A restore overlapping moves out of its tier runs at the measured
#    both-directions rate for the overlap.
# d. Each stall delays every later need.
# e. The needs are the followed step's, not the profile's (which ran the
#    safe order): each first use moves earlier by what the profile's earlier
#    unpacks cost that the plan does not pay, later by what the plan adds
#    (recomputes, reads' CPU charge, a checkpointed block's forward); a
#    tensor a recomputed reader reads first is needed at that read.

from __future__ import annotations

import bisect
import itertools
from types import SimpleNamespace
from typing import Optional

from ..policy import Tier
from ..runtime.prefetch import cursor_after_use, fill_window
from .costs import Option, cpu_charge_s
from .profile import TensorRecord
from .rates import Rates

__all__ = ["simulate", "followed_uses", "slower", "kick_of", "since", "overlap_s"]


def overlap_s(a: float, b: float, spans: list) -> float:
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


def simulate(chosen, bwd_start: float, window_bytes: Optional[int] = None,
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
            back += overlap_s(start, start + back, out_spans.get(o.tier, ())) * (o.slowdown - 1.0)
        started[r.index] = (start, start + back)
        back_free[o.tier] = start + back

    def fill(now: float) -> None:   # the prefetcher's own window walk
        def start(p: int) -> Optional[int]:
            r, o = order[p]
            if r.index in used or r.index in started:
                return 0
            if out_end[r.index] > now:
                return None   # not landed: retried at the next moved unpack
            read(r, o, now)
            return r.nbytes
        st.cursor, st.inflight = fill_window(st.cursor, st.inflight, window, start)

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
        st.cursor = cursor_after_use(p, st.last, st.cursor)   # Prefetcher.advance
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


def followed_uses(records, choice, costs, blocks, chosen, kick, bwd_start: float,
                   rates: Rates) -> dict:
    """When a step following the plan needs each moved tensor (and the kick
    tensor), by index (NOTE [Predicted restores], e): the profile's first use
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


def slower(o: Option, factor: float) -> Option:
    """``o`` with its restore ``factor`` times longer (NOTE [Planner cost
    model], 3)."""
    return Option(o.tier, o.cost_s, o.freed, o.out_s, o.back_s * factor, o.cpu_s,
                   o.slowdown)



def kick_of(records, choice, checkpointed, chosen) -> Optional[TensorRecord]:
    """The kept tensor whose unpack starts a followed step's restores: the one
    the profile saw unpacked first, if before every moved one (NOTE [Restores
    start with backward] in runtime/hooks.py); None when nothing moves."""
    if not chosen:
        return None
    first_move = min(r._use for r, _ in chosen)
    kept = [r for r in records if choice[r.index] is Tier.KEEP and r.index not in checkpointed
            and r.first_use_s is not None and r.first_use_s < first_move]
    return min(kept, key=lambda r: (r.first_use_s, r.index), default=None)


def since(times, origin: float):
    """``times`` (a tuple of seconds) less ``origin``; None stays None."""
    return None if times is None else tuple(t - origin for t in times)

