"""The auto planner's improvement pass: from the greedy's choice (NOTE
[Planner cost model], 2, in planner/solver.py) to a cheaper one under the
same budgets.

# NOTE [Planner choice]
# The greedy takes options by price per freed byte until the budget is met:
# it may take a cheap-per-byte large tensor where a dearer small one would
# have sufficed (overshoot), or fill a tier a later tensor needed more. The
# pass starts from the greedy's choice and improves it by local moves, each
# priced exactly by the cost model's lone prices (a recompute's seconds, a
# move's lone-link stall + CPU charge, a block's forward; the channel
# simulation afterwards is unchanged):
# 1. Objective: first the shortfall (bytes the device budget is still
#    short), then the priced cost (the sum of the chosen options' prices). A
#    move is kept only when it lowers that pair strictly: the pass ends, a
#    met budget stays met, the shortfall never grows, the cost never exceeds
#    the greedy's where the greedy met the budget (where it did not, less
#    shortfall may cost more), and the cpu and nvme budgets hold at every
#    step (counted, as the greedy counts them, as if everything moved were
#    held at once).
# 2. Groups: a tensor (kept, or one of its options), a block (plain, or
#    checkpointed) and a block's movable input (kept, or one of its moves). A
#    checkpointed block voids its tensors (not saved: their options are
#    dropped, their tier room given back) and enables its inputs; a plain
#    one keeps its tensors' groups free and its inputs void (rule 6 of NOTE
#    [Blocks the planner may checkpoint] in planner/runtime.py). A
#    ``"before"`` input of a checkpointed block whose saver is inside another
#    checkpointed block costs its bytes, as in the greedy.
# 3. Fixed (left as the greedy chose): MUST answers, tensors with a hint
#    (hints rank by preference, not by price: NOTE [Planner hints] in
#    planner/hints.py) and the blocks holding one, with their inputs.
# 4. A move: set one group to another state (first moving the groups that
#    hold the tier room it needs to their cheapest other option, least added
#    cost first), then fill the shortfall from the groups at rest in the
#    greedy's order (price per freed byte; the option that meets the budget
#    is the cheapest one that alone covers the rest), then drop taken groups
#    whose bytes the budget no longer needs, costliest first. A round tries
#    every state of every group (beyond MOVE_GROUPS groups: the half taken
#    dearest per freed byte and the half at rest cheapest, the greedy's
#    margin) and keeps the best move; rounds run until one improves nothing
#    (at most MAX_ROUNDS): deterministic. Where blocks may be checkpointed, a
#    second search starts from no block checkpointed and the rest filled
#    afresh; the better of the two stands. A local optimum, not always the
#    global one (measured against brute force in tests/test_solver_opt.py).
# 5. Small instances (at most EXACT_STATES assignments of the groups that
#    are not fixed) are then solved exactly: a depth-first branch and bound
#    over every assignment, bounded by the search's result, pruning where the
#    cost so far is no better or the bytes left to free cannot meet the
#    budget: the optimum of rule 1's objective (a reachable budget met).
# 6. A tensor whose choice the pass changed says so in its reason, with the
#    greedy's choice and the priced cost before and after; the plan's notes
#    sum the change up.
"""

from __future__ import annotations

from typing import List, Optional

from ..policy import Tier

__all__ = ["improve_choice", "MAX_ROUNDS", "MOVE_GROUPS", "EXACT_STATES"]

#: At most this many rounds of moves (NOTE [Planner choice], 4).
MAX_ROUNDS = 50
#: A round of moves tries at most this many groups (NOTE [Planner choice], 4).
MOVE_GROUPS = 256
#: Instances with at most this many assignments are solved exactly (NOTE
#: [Planner choice], 5): about 8 tensors of 4 states.
EXACT_STATES = 1 << 17

_OFF = -1
_ROOM_TIERS = (Tier.CPU, Tier.NVME)


class _Group:
    """One decision (NOTE [Planner choice], 2): ``opts`` are (cost_s, freed
    bytes, tier whose room it takes or None, room bytes, option object);
    ``cur`` the index taken (-1: kept / plain)."""

    __slots__ = ("kind", "obj", "opts", "cur", "fixed", "block", "members", "ins", "pairs",
                 "rank", "prefer")

    def __init__(self, kind: str, obj, opts: list, cur: int, fixed: bool,
                 block: Optional[int] = None) -> None:
        self.kind, self.obj, self.opts, self.cur, self.fixed = kind, obj, opts, cur, fixed
        self.block = block          # tensor or input: its block's group
        self.members: List[int] = []   # block: its tensors' groups
        self.ins: List[int] = []       # block: its inputs' groups
        self.pairs: list = []          # block: (bytes, other block group) of "before" inputs
        self.rank: tuple = ()          # tie-break of its options in the greedy's order
        self.prefer: Optional[int] = None   # input: the option its block's tier gives


class _State:
    """The groups and the running totals of their choice."""

    def __init__(self, groups: List[_Group], need: int, freed: int, room: dict) -> None:
        self.g, self.need = groups, need
        self.cost, self.freed, self.room = 0.0, freed, dict(room)
        start = [G.cur for G in groups]
        for G in groups:
            G.cur = _OFF
        for blocks_first in (True, False):   # the totals of the start (blocks void first)
            for i, G in enumerate(groups):
                if (G.kind == "b") == blocks_first and start[i] != _OFF:
                    self.set(i, start[i])

    def void(self, i: int) -> bool:
        G = self.g[i]
        if G.kind == "t":
            return G.block is not None and self.g[G.block].cur != _OFF
        return G.kind == "i" and self.g[G.block].cur == _OFF

    def key(self) -> tuple:
        return max(0, self.need - self.freed), self.cost

    def fits(self, i: int, k: int) -> bool:
        if k == _OFF:
            return True
        _, _, tier, nbytes, _ = self.g[i].opts[k]
        G = self.g[i]
        back = 0
        if G.cur != _OFF and G.opts[G.cur][2] is tier:
            back = G.opts[G.cur][3]
        return tier is None or self.room[tier] + back >= nbytes

    def _pair_bytes(self, G: _Group) -> int:
        return sum(n for n, o in G.pairs if self.g[o].cur != _OFF)

    def set(self, i: int, k: int) -> None:
        """Group ``i`` to state ``k`` (the caller checked :meth:`fits`)."""
        G = self.g[i]
        if G.cur == k:
            return
        if G.kind == "b":
            if k != _OFF:
                for m in G.members:
                    self.set(m, _OFF)
                cost, freed = G.opts[k][:2]
                self.cost += cost
                self.freed += freed - self._pair_bytes(G)
            else:
                for m in G.ins:
                    self.set(m, _OFF)
                cost, freed = G.opts[G.cur][:2]
                self.cost -= cost
                self.freed -= freed - self._pair_bytes(G)
            G.cur = k
            return
        if G.cur != _OFF:
            cost, freed, tier, nbytes, _ = G.opts[G.cur]
            self.cost -= cost
            self.freed -= freed
            if tier is not None:
                self.room[tier] += nbytes
        if k != _OFF:
            cost, freed, tier, nbytes, _ = G.opts[k]
            self.cost += cost
            self.freed += freed
            if tier is not None:
                self.room[tier] -= nbytes
        G.cur = k

    def taken_cost(self, i: int) -> float:
        G = self.g[i]
        c = G.opts[G.cur][0]
        if G.kind == "b":
            c += sum(self.g[m].opts[self.g[m].cur][0] for m in G.ins if self.g[m].cur != _OFF)
        return c

    def drop_bytes(self, i: int) -> int:
        """Bytes freed no more if group ``i`` (taken) went back to kept / plain."""
        G = self.g[i]
        n = G.opts[G.cur][1]
        if G.kind == "b":
            n -= self._pair_bytes(G)
            n += sum(self.g[m].opts[self.g[m].cur][1] for m in G.ins if self.g[m].cur != _OFF)
        return n

    def snapshot(self) -> tuple:
        return [G.cur for G in self.g], self.cost, self.freed, dict(self.room)

    def restore(self, snap: tuple) -> None:
        curs, self.cost, self.freed, room = snap
        self.room = room
        for G, k in zip(self.g, curs):
            G.cur = k


def _fill(st: _State, order: tuple, locked: int) -> None:
    """Take options of groups at rest in the greedy's order until the budget
    is met; the option that would meet it is the cheapest of those that alone
    cover the rest (the greedy's order overshoots there). ``order``: the
    options in the greedy's order, and the tensors' and inputs' by cost."""
    ranked, by_cost = order
    for _, i, k in ranked:
        if st.freed >= st.need:
            return
        if not _free(st, i, k, locked):
            if (st.g[i].opts[k][2] is None or not _free(st, i, _OFF, locked)
                    or not _make_room(st, i, k, free_only=True, locked=locked)):
                continue
        G = st.g[i]
        if G.kind != "b" and st.freed + G.opts[k][1] >= st.need:
            short = st.need - st.freed
            for j, m in by_cost:   # (i, k) at worst
                if st.g[j].opts[m][1] >= short and _free(st, j, m, locked):
                    i, k = j, m
                    break
            st.set(i, k)
            return
        if G.kind == "b":
            snap = st.snapshot()
            _take_block(st, i, k)
            if st.freed <= snap[2]:   # it voided as much as it freed
                st.restore(snap)
        else:
            st.set(i, k)


def _free(st: _State, i: int, k: int, locked: int) -> bool:
    """May ``_fill`` take option ``k`` of group ``i``?"""
    G = st.g[i]
    return not (i == locked or G.fixed or G.cur != _OFF or st.void(i) or not st.fits(i, k))


def _take_block(st: _State, i: int, k: int) -> None:
    """Checkpoint block ``i``; as the greedy, its inputs go to the block's tier if room."""
    st.set(i, k)
    for m in st.g[i].ins:
        j = st.g[m].prefer
        if j is not None and not st.g[m].fixed and st.fits(m, j):
            st.set(m, j)


def _make_room(st: _State, i: int, k: int, free_only: bool = False, locked: int = -1) -> bool:
    """Make room for option ``k`` of group ``i`` in its tier: move groups
    holding that tier to their cheapest other option that fits (or keep
    them), least added cost first (``free_only``: only those whose other
    option costs no more); False if it cannot (the state may have changed)."""
    _, _, tier, nbytes, _ = st.g[i].opts[k]
    if tier is None or st.fits(i, k):
        return True
    moves = []
    for h, H in enumerate(st.g):
        if (h in (i, locked) or H.fixed or H.cur == _OFF or H.opts[H.cur][2] is not tier
                or st.void(h)):
            continue
        alts = [(H.opts[a][0], a) for a in range(len(H.opts))
                if H.opts[a][2] is not tier and st.fits(h, a)]
        cost, a = min(alts, default=(0.0, _OFF))
        if free_only and (a == _OFF or cost > H.opts[H.cur][0]):
            continue
        moves.append((cost - H.opts[H.cur][0], h, a))
    if free_only and sum(st.g[h].opts[st.g[h].cur][3] for _, h, _ in moves) \
            + st.room[tier] < nbytes:
        return False
    for _, h, a in sorted(moves):
        if st.fits(i, k):
            break
        st.set(h, a if st.fits(h, a) else _OFF)
    return st.fits(i, k)


def _drop(st: _State, locked: int) -> None:
    """Drop taken groups the budget does not need, costliest first."""
    surplus = st.freed - st.need
    if surplus < 0:
        return
    taken = [i for i, G in enumerate(st.g)
             if G.cur != _OFF and not G.fixed and i != locked
             and (G.kind == "b" or G.opts[G.cur][1] <= surplus) and not st.void(i)]
    taken.sort(key=lambda i: (-st.taken_cost(i), i))
    for i in taken:
        if st.g[i].cur == _OFF or st.void(i):
            continue
        if st.freed - st.drop_bytes(i) >= st.need:
            st.set(i, _OFF)


def _better(a: tuple, b: tuple) -> bool:
    """Is key ``a`` strictly better than ``b`` (a float margin on the cost)?"""
    if a[0] != b[0]:
        return a[0] < b[0]
    return a[1] < b[1] - 1e-12 * max(1.0, abs(b[1]))


def _move(st: _State, order: tuple, i: int, k: int) -> bool:
    """One move (NOTE [Planner choice], 4); False (state unchanged) if group
    ``i`` cannot take state ``k``."""
    snap = st.snapshot()
    if not _make_room(st, i, k):
        st.restore(snap)
        return False
    if st.g[i].kind == "b" and k != _OFF:
        _take_block(st, i, k)
    else:
        st.set(i, k)
    _fill(st, order, i)
    _drop(st, i)
    return True


def _candidates(st: _State) -> List[int]:
    """The groups a round moves (NOTE [Planner choice], 4): all, or beyond
    MOVE_GROUPS the MOVE_GROUPS / 2 taken ones dearest per freed byte and
    the MOVE_GROUPS / 2 at rest cheapest per freed byte (the greedy's
    margin), in group order."""
    live = [i for i, G in enumerate(st.g) if not G.fixed and not st.void(i)]
    if len(live) <= MOVE_GROUPS:
        return live
    def price(i: int, k: int) -> float:
        cost, freed = st.g[i].opts[k][:2]
        return cost / freed if freed > 0 else float("inf")
    taken = sorted((i for i in live if st.g[i].cur != _OFF),
                   key=lambda i: (-price(i, st.g[i].cur), i))
    rest = sorted((i for i in live if st.g[i].cur == _OFF and st.g[i].opts),
                  key=lambda i: (min(price(i, k) for k in range(len(st.g[i].opts))), i))
    half = MOVE_GROUPS // 2
    return sorted(taken[:half] + rest[:half])


def _search(st: _State, order: tuple) -> int:
    """NOTE [Planner choice], 4: rounds of moves, the best of each round kept
    (first in group order on a tie); returns the moves kept."""
    _drop(st, -1)
    _fill(st, order, -1)
    _drop(st, -1)
    for rounds in range(MAX_ROUNDS):
        best, at = st.key(), None
        for i in _candidates(st):
            G = st.g[i]
            for k in range(_OFF, len(G.opts)):
                if k == G.cur:
                    continue
                snap = st.snapshot()
                if _move(st, order, i, k) and _better(st.key(), best):
                    best, at = st.key(), (i, k)
                st.restore(snap)
        if at is None:
            return rounds
        _move(st, order, *at)
    return MAX_ROUNDS


def _exact(st: _State) -> None:
    """NOTE [Planner choice], 5: depth-first branch and bound over every
    assignment of the groups that are not fixed, from the state's bound;
    leaves the best assignment found (the optimum) in ``st``."""
    order = [i for i, G in enumerate(st.g) if not G.fixed]   # blocks come first
    bound = [0] * (len(order) + 1)   # the most bytes the groups from j on may free
    for j in range(len(order) - 1, -1, -1):
        bound[j] = bound[j + 1] + max([0] + [o[1] for o in st.g[order[j]].opts])
    best = [st.key(), st.snapshot()]
    for i in order:
        if st.g[i].kind == "b":
            st.set(i, _OFF)
    for i in order:
        st.set(i, _OFF)

    def visit(j: int) -> None:
        if not _better((max(0, st.need - st.freed - bound[j]), st.cost), best[0]):
            return
        if j == len(order):
            best[:] = [st.key(), st.snapshot()]
            return
        i = order[j]
        G = st.g[i]
        for k in range(_OFF, 0 if st.void(i) else len(G.opts)):
            if st.fits(i, k):
                st.set(i, k)
                visit(j + 1)
                st.set(i, _OFF)

    visit(0)
    st.restore(best[1])


def _states(groups: List[_Group]) -> int:
    n = 1
    for G in groups:
        if not G.fixed:
            n *= len(G.opts) + 1
    return n


def improve_choice(records, options, blocks, need: int, base_freed: int, room0: dict,
                   greedy_freed: int, greedy_kept: int, greedy_room: dict, choice: dict,
                   costs: dict,
                   reasons: dict, checkpointed: dict, must_ids: set, *,
                   search: bool = True) -> Optional[tuple]:
    """NOTE [Planner choice]: improve the greedy's choice in place.

    ``options``, ``choice``, ``costs``, ``reasons`` and ``checkpointed`` are
    make_plan's (solver.py), as ``_choose`` left them; ``blocks`` its
    ``_Block`` objects (``chosen``, inputs' ``move`` and ``before_kept`` are
    rewritten); ``base_freed`` the bytes the MUST answers free and
    ``room0`` the tiers' room after them; ``greedy_freed``, ``greedy_kept``
    and ``greedy_room`` what the greedy counted (freed, extra kept, room).
    Returns ``(freed, extra_kept, greedy_cost_s, cost_s, changed)``: bytes
    freed, recipe and checkpoint input bytes kept beyond the MUST answers',
    the priced cost of the greedy's choice and of the improved one, and how
    many tensors and blocks changed; None, changing nothing, when the pass
    counts the greedy's choice otherwise than the greedy did (a bug: the
    greedy's plan stands).
    ``search=False``: price the greedy's choice and change nothing."""
    groups: List[_Group] = []
    tgroup = {}
    block_of = {}
    for bi, b in enumerate(blocks):
        for j in range(b.rec.start, b.rec.end):
            block_of[j] = bi
    bgroup = {}
    for bi, b in enumerate(blocks):
        hinted = any(records[j].hint is not None
                     for j in range(b.rec.start, b.rec.end))
        fixed = b.price == float("inf") or b.has_must or hinted
        G = _Group("b", b, [(b.cost_s, b.freed, None, 0, None)], 0 if b.chosen else _OFF, fixed)
        G.rank = (b.price, 1, 0.0, b.rec.index)
        bgroup[bi] = len(groups)
        groups.append(G)
    for r in records:
        opts = [(o.cost_s, o.freed, o.tier if o.tier in _ROOM_TIERS else None, r.nbytes, o)
                for o in options[r.index]]
        fixed = r.index in must_ids or r.hint is not None or not opts
        cur = _OFF
        if r.index not in checkpointed and r.index not in must_ids and r.index in costs:
            cur = next((k for k, o in enumerate(options[r.index]) if o is costs[r.index]), _OFF)
        bi = block_of.get(r.index)
        G = _Group("t", r, opts, cur, fixed, None if bi is None else bgroup[bi])
        G.rank = (-(r._use - r.pack_s), r.index)
        if bi is not None:
            groups[bgroup[bi]].members.append(len(groups))
        tgroup[r.index] = len(groups)
        groups.append(G)
    for bi, b in enumerate(blocks):
        bg = groups[bgroup[bi]]
        for inp in b.ins:
            opts = [(o.cost_s, inp.x.nbytes, o.tier, inp.x.nbytes, o) for o in inp.opts]
            cur = next((k for k, o in enumerate(inp.opts) if o is inp.move), _OFF)
            G = _Group("i", inp, opts, cur, bg.fixed or not opts, bgroup[bi])
            # the greedy's tier for it when its block is taken (None: kept)
            G.prefer = next((k for k, o in enumerate(inp.opts) if o.tier is b.tier), None)
            G.rank = (0.0, len(groups))
            bg.ins.append(len(groups))
            groups.append(G)
        for x in b.rec.inputs:   # "before" inputs saved inside another block
            if x.kind == "before" and x.saved_as in block_of:
                other = bgroup[block_of[x.saved_as]]
                bg.pairs.append((x.nbytes, other))
                groups[other].pairs.append((x.nbytes, bgroup[bi]))
    st = _State(groups, need, base_freed, room0)
    if (st.freed != greedy_freed or _extra_kept(groups, blocks, must_ids) != greedy_kept
            or any(st.room[t] != greedy_room[t] for t in _ROOM_TIERS)):
        return None
    greedy = [G.cur for G in groups]
    greedy_cost = st.cost
    # The fill's order: the greedy's (price per freed byte), and on a tie the
    # option that takes no tier room first, then the tier with more room.
    scarce = {None: 0}
    scarce.update({t: n for n, t in enumerate(sorted(_ROOM_TIERS, key=lambda t: -room0[t]), 1)})
    ranked = []
    for i, G in enumerate(groups):
        if G.fixed:
            continue
        for k, (cost, freed, tier, _, _) in enumerate(G.opts):
            if freed <= 0:
                continue
            kind = {"t": 0, "b": 1, "i": 2}[G.kind]
            ranked.append(((cost / freed, scarce[tier], kind) + tuple(G.rank[-2:]), i, k))
    ranked.sort(key=lambda e: e[0])
    by_cost = [(i, k) for _, i, k in sorted(ranked, key=lambda e: (groups[e[1]].opts[e[2]][0],
                                                                   e[0]))
               if groups[i].kind != "b"]
    order = (ranked, by_cost)
    if search:
        _search(st, order)
        if any(G.kind == "b" and not G.fixed for G in groups):
            # A second start: no block checkpointed, the rest filled afresh
            # (the greedy's blocks can hold the search in a local optimum).
            first, first_key = st.snapshot(), st.key()
            for i, G in enumerate(groups):
                if G.kind == "b" and not G.fixed:
                    st.set(i, _OFF)
            for i, G in enumerate(groups):
                if not G.fixed and not st.void(i):
                    st.set(i, _OFF)
            _search(st, order)
            if not _better(st.key(), first_key):
                st.restore(first)
        if _states(groups) <= EXACT_STATES:
            _exact(st)
    changed = [i for i, G in enumerate(groups) if G.cur != greedy[i]]
    if changed:
        _write_back(st, groups, greedy, records, blocks, bgroup, tgroup, choice, costs,
                    reasons, checkpointed, greedy_cost)
    extra = _extra_kept(groups, blocks, must_ids)
    n_changed = sum(1 for i in changed if groups[i].kind in ("t", "b"))
    return st.freed, extra, greedy_cost, st.cost, n_changed


def _extra_kept(groups, blocks, must_ids) -> int:
    """Recipe and checkpoint input bytes the choice keeps (as ``_choose`` counts them)."""
    extra = 0
    for G in groups:
        if G.kind == "t" and G.cur != _OFF and G.obj.index not in must_ids:
            if G.opts[G.cur][4].tier is Tier.RECOMPUTE:
                extra += G.obj.input_kept_bytes
        elif G.kind == "b" and G.cur != _OFF:
            b = G.obj
            extra += b.kept_in + sum(x.nbytes for x in b.rec.inputs if x.arg in b.before_kept)
            extra -= sum(groups[m].opts[groups[m].cur][1] for m in G.ins
                         if groups[m].cur != _OFF)
    return extra


def _what(G: _Group, k: int, was_checkpointed: bool) -> str:
    """The greedy's choice for a tensor, in words."""
    if was_checkpointed:
        return "checkpoint of its block"
    return "keep" if k == _OFF else G.opts[k][4].tier.value


def _write_back(st, groups, greedy, records, blocks, bgroup, tgroup, choice, costs, reasons,
                checkpointed, greedy_cost) -> None:
    """Put the improved choice into make_plan's dicts and the blocks, with
    reasons for what changed (NOTE [Planner choice], 6)."""
    by = f"priced cost of the choice {greedy_cost * 1e3:.2f} -> {st.cost * 1e3:.2f} ms"
    for bi, b in enumerate(blocks):
        G = groups[bgroup[bi]]
        b.chosen = G.cur != _OFF
        for m in G.ins:
            inp = groups[m]
            inp.obj.move = inp.opts[inp.cur][4] if inp.cur != _OFF and b.chosen else None
    was_void = {}
    for bi, b in enumerate(blocks):
        for j in range(b.rec.start, b.rec.end):
            was_void[j] = greedy[bgroup[bi]] != _OFF
            if b.chosen:
                checkpointed[j] = b
                choice[j] = Tier.KEEP
                costs.pop(j, None)
                reasons.pop(j, None)
            else:
                checkpointed.pop(j, None)
    for b in blocks:
        b.before_kept = {x.arg for x in b.rec.inputs
                         if b.chosen and x.kind == "before" and x.saved_as in checkpointed}
    for r in records:
        i = tgroup[r.index]
        G = groups[i]
        if G.fixed or st.void(i):
            continue
        if G.cur == greedy[i] and not was_void.get(r.index):
            if G.cur == _OFF and reasons.get(r.index) == "kept: host and disk budgets full" \
                    and any(st.fits(i, k) for k in range(len(G.opts))) \
                    and st.freed >= st.need:
                reasons[r.index] = "kept: the budget is met without moving it"
            continue
        old = _what(G, greedy[i], was_void.get(r.index, False))
        if G.cur == _OFF:
            choice[r.index] = Tier.KEEP
            costs.pop(r.index, None)
            reasons[r.index] = (f"kept: the budget is met without moving it (the improvement "
                                f"pass, NOTE [Planner choice], replaced the greedy's {old}: "
                                f"{by})" if st.freed >= st.need
                                else "kept: host and disk budgets full")
        else:
            o = G.opts[G.cur][4]
            choice[r.index] = o.tier
            costs[r.index] = o
            reasons[r.index] = (f"{o.tier.value}: chosen by the improvement pass (NOTE "
                                f"[Planner choice]) over the greedy's {old}: {by}")
