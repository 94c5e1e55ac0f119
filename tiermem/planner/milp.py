"""The auto planner's choice as a mixed-integer program, solved by HiGHS
(``scipy.optimize.milp``).
"""

# NOTE [Planner choice]
# The plan chosen is never worse, by (bytes short, cost), than the greedy's: both
# are solved and the better stands, so a solver stopped early cannot make the
# plan worse. The model: one binary per (tensor, option) (none taken: kept), per
# auto block (checkpointed or not) and per (checkpointed block's movable input,
# move). A tensor takes at most one option, none when its block is checkpointed;
# an input moves only when its block is; the bytes freed reach the device
# budget's need; cpu and nvme bytes stay within their rooms (as if all held at
# once). MUST answers are fixed before the model. Objective: the sum of the
# options' prices (costs.py); an unreachable budget frees the most bytes first,
# then at the least cost. PREFER hints come before the prices: NOTE [Hints in
# the program].

# NOTE [Hints in the program]
# PREFER hints rank options strictly (NOTE [Planner hints], rule 3): hinted
# moves before unhinted tensors and blocks, keep hints after both. So the
# program follows the greedy's rank: the level of the last option the greedy
# took (0 hinted moves, 1 unhinted, 2 keep hints) is the one chosen freely;
# lower levels' tensors the greedy moved must move (on any of their options),
# higher levels stay kept. Within that, hinted tensors take their hints' first
# tiers where they can (bytes x rank in the hint minimised first), then the
# prices decide. Without hints every variable is level 1: nothing changes.

# NOTE [Same plan on every rank]
# HiGHS is deterministic for a given model, and its search is bounded by a node
# count (NODE_LIMIT), which is the same on every rank: ranks planning the same
# agreed profile choose alike however loaded each is. The wall-clock limit
# (TIME_LIMIT_S) is a safety only: where it binds (``Model.clock_bound``) the
# plan says so, since another rank may have gone further.

from __future__ import annotations

import time
from typing import List, Optional, Tuple

import numpy as np
# Imported with the planner (an auto Offloader's construction), not at its
# first plan: the import takes most of a second on a cold, loaded machine.
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix, vstack

from ..policy import Tier
from .hints import is_move_hint

__all__ = ["Model", "NODE_LIMIT", "TIME_LIMIT_S"]

#: Branch-and-bound nodes HiGHS may explore per solve: the deterministic bound
#: (NOTE [Same plan on every rank]). Measured profiles take 0 or 1 node.
NODE_LIMIT = 200
#: Wall-clock seconds HiGHS may take per plan (both phases together): a safety.
TIME_LIMIT_S = 1.0
_ROOM_TIERS = (Tier.CPU, Tier.NVME)
_MIB = float(1 << 20)
_SCALE_S = 1e6   # the objective in microseconds (HiGHS' absolute gap is 1e-6)


class Model:
    """The program of one plan. ``options``: pack index -> its options
    (costs.Option, none for a kept-only tensor); ``blocks``: the
    costs.BlockOption list; ``need``: bytes still to free after the MUST
    answers; ``room``: the tiers' room after them. Variables are kept in
    ``self.vars`` as ``(kind, owner, option)``: kind ``"t"`` (owner: a
    record), ``"b"`` (owner: a block, option None), ``"i"`` (owner: an
    InputOption)."""

    def __init__(self, records, options: dict, blocks, need: int, room: dict,
                 must_ids: set) -> None:
        self.need, self.room = need, room
        #: A solve was stopped by the wall clock, not by NODE_LIMIT or optimality.
        self.clock_bound = False
        self.vars: List[tuple] = []
        self.freed: List[int] = []
        self.price: List[float] = []
        self.block_var = {}   # block position -> variable
        rows = []             # (variables, upper bound) of the "at most" rows
        for bi, b in enumerate(blocks):
            if b.price != float("inf") and not b.has_must and not b.nested_must:
                self.block_var[bi] = self._add(("b", b, None), b.freed, b.cost_s)
        block_of = {j: bi for bi, b in enumerate(blocks) for j in range(b.rec.start, b.rec.end)}
        for r in records:
            if r.index in must_ids or not options[r.index]:
                continue
            group = [self._add(("t", r, o), o.freed, o.cost_s)
                     for o in options[r.index]]
            bv = self.block_var.get(block_of.get(r.index))
            rows.append((group + ([bv] if bv is not None else []), 1))
        self.inputs = []
        for bi, bv in self.block_var.items():
            for i in blocks[bi].ins:
                group = [self._add(("i", i, o), i.x.nbytes, o.cost_s) for o in i.opts]
                if group:
                    rows.append((group, 0, bv))
        #: (bytes, block var, other block var) of "before" inputs (NOTE, pairs).
        self.pairs = []
        for bi, bv in self.block_var.items():
            for x in blocks[bi].rec.inputs:
                other = self.block_var.get(block_of.get(x.saved_as))
                if x.kind == "before" and other is not None:
                    self.pairs.append((x.nbytes, bv, other))
        self.rows = rows
        #: NOTE [Hints in the program]: each variable's level, and the hinted
        #: tensors' variables off their hints' first tier (-> MiB x rank).
        self.level, self.ranked = _hint_levels(self.vars, self.freed)
        #: Set by :meth:`follow_rank`: per variable, its upper bound, and
        #: the tensors that must move (their variables).
        self.ub: Optional[np.ndarray] = None
        self.must_move: List[List[int]] = []

    def _add(self, var: tuple, freed: int, price: float) -> int:
        self.vars.append(var)
        self.freed.append(freed)
        self.price.append(price)
        return len(self.vars) - 1

    # -- an assignment: the set of variables taken ----------------------------------
    def evaluate(self, taken: set) -> Tuple[int, float]:
        """(bytes freed, priced cost in seconds) of ``taken``, exactly."""
        freed = sum(self.freed[v] for v in taken)
        freed -= sum(n for n, a, b in self.pairs if a in taken and b in taken)
        return freed, sum(self.price[v] for v in taken)

    def valid(self, taken: set) -> bool:
        """Whether ``taken`` satisfies every constraint but the budget's."""
        for row in self.rows:
            n = sum(v in taken for v in row[0])
            if n > (row[1] if len(row) == 2 else row[1] + (row[2] in taken)):
                return False
        used = self.used(taken)
        return all(used[t] <= self.room[t] for t in _ROOM_TIERS)

    def used(self, taken: set) -> dict:
        """Room bytes ``taken`` uses per tier."""
        used = {t: 0 for t in _ROOM_TIERS}
        for v in taken:
            kind, owner, o = self.vars[v]
            if kind != "b" and o.tier in used:
                used[o.tier] += self.freed[v]
        return used

    def key(self, taken: set) -> Tuple[int, float]:
        """What the choice minimises: (bytes short, priced cost)."""
        freed, cost = self.evaluate(taken)
        return max(0, self.need - freed), cost

    def follow_rank(self, greedy: set) -> None:
        """NOTE [Hints in the program]: bound the program by the level of the
        greedy's choice ``greedy``."""
        if all(level == 1 for level in self.level):
            return
        top = max((self.level[v] for v in greedy), default=0)
        self.ub = np.array([0.0 if level > top else 1.0 for level in self.level])
        per_tensor: dict = {}
        for v, (kind, owner, _) in enumerate(self.vars):
            if kind == "t" and self.level[v] < top:
                per_tensor.setdefault(id(owner), []).append(v)
        self.must_move = [vs for vs in per_tensor.values() if any(v in greedy for v in vs)]

    # -- HiGHS ------------------------------------------------------------------------
    def solve(self, time_limit_s: float = TIME_LIMIT_S, reach: Optional[int] = None
              ) -> Tuple[Optional[set], str]:
        """The solver's assignment (or None) and HiGHS' status message.
        ``reach``: free at least that many bytes (default ``need``); a budget
        no assignment reaches is first maximised (NOTE [Planner choice])."""
        n = len(self.vars)
        if n == 0:
            return set(), "nothing to choose"
        npairs = len(self.pairs)
        total = n + npairs   # pair variables: both blocks checkpointed
        r_, c_, d_, lo, hi = [], [], [], [], []

        def row(entries, low, high):
            k = len(lo)
            for c, d in entries:
                r_.append(k)
                c_.append(c)
                d_.append(d)
            lo.append(low)
            hi.append(high)

        for vs in self.must_move:
            row([(v, 1.0) for v in vs], 1.0, np.inf)
        for entry in self.rows:
            if len(entry) == 2:
                row([(v, 1.0) for v in entry[0]], -np.inf, entry[1])
            else:
                row([(v, 1.0) for v in entry[0]] + [(entry[2], -1.0)], -np.inf, 0.0)
        for k, (_, a, b) in enumerate(self.pairs):
            row([(a, 1.0), (b, 1.0), (n + k, -1.0)], -np.inf, 1.0)
        for tier in _ROOM_TIERS:
            members = [(v, self.freed[v] / _MIB) for v, (kind, _, o) in enumerate(self.vars)
                       if kind != "b" and o.tier is tier]
            if members and sum(self.freed[v] for v, _ in members) > self.room[tier]:
                row(members, -np.inf, (self.room[tier] + 0.5) / _MIB)
        freed_row = [(v, self.freed[v] / _MIB) for v in range(n)]
        freed_row += [(n + k, -p[0] / _MIB) for k, p in enumerate(self.pairs)]
        base = len(lo)
        row(freed_row, -np.inf, np.inf)
        integrality = np.ones(total)
        ub = np.ones(total)
        if self.ub is not None:
            ub[:n] = self.ub
        bounds = Bounds(np.zeros(total), ub)
        options = {"time_limit": time_limit_s, "node_limit": NODE_LIMIT, "presolve": True,
                   "mip_rel_gap": 0.0}
        target = self.need if reach is None else reach
        A = coo_matrix((d_, (r_, c_)), shape=(len(lo), total)).tocsr()
        lo_arr, hi_arr = np.array(lo), np.array(hi)
        t0 = time.perf_counter()
        if reach is None:
            # Reachable at all? Maximise the bytes freed first (the cheap
            # phase: the rest of the time limit is the second's).
            c = np.zeros(total)
            c[:n] = -np.array(self.freed, dtype=float) / _MIB
            c[n:] = np.array([p[0] for p in self.pairs], dtype=float) / _MIB
            best = self._run(c, A, lo_arr, hi_arr, integrality, bounds,
                             options)
            if best is None:
                return None, "no solution within the time limit"
            target = min(target, self.evaluate(best)[0])
            options["time_limit"] = max(0.0, time_limit_s - (time.perf_counter() - t0))
        lo_arr = lo_arr.copy()
        lo_arr[base] = (target - 0.5) / _MIB
        if self.ranked:   # NOTE [Hints in the program]: hinted tiers first
            c = np.zeros(total)
            for v, w in self.ranked.items():
                c[v] = w
            taken = self._run(c, A, lo_arr, hi_arr, integrality, bounds, options)
            if taken is None:
                return None, "no solution within the limits"
            best = sum(w for v, w in self.ranked.items() if v in taken)
            A = vstack([A, coo_matrix((list(self.ranked.values()), ([0] * len(self.ranked),
                                       list(self.ranked))), shape=(1, total))]).tocsr()
            lo_arr = np.append(lo_arr, -np.inf)
            hi_arr = np.append(hi_arr, best + 0.5 / _MIB)
            options["time_limit"] = max(0.0, time_limit_s - (time.perf_counter() - t0))
        c = np.zeros(total)
        c[:n] = np.array(self.price) * _SCALE_S
        taken = self._run(c, A, lo_arr, hi_arr, integrality, bounds, options)
        if taken is None:
            return None, "no solution within the time limit"
        return taken, "solved"

    def _run(self, c, A, lo, hi, integrality, bounds, options) -> Optional[set]:
        """One HiGHS solve: the valid set of variables taken, or ``None``."""
        res = milp(c, integrality=integrality, bounds=bounds,
                   constraints=LinearConstraint(A, lo, hi), options=options)
        if res.status == 1 and "time limit" in res.message.lower():
            self.clock_bound = True
        if res.x is None:
            return None
        n = len(self.vars)
        taken = {v for v in range(n) if res.x[v] > 0.5}
        return taken if self.valid(taken) else None

    # -- to and from make_plan's state -------------------------------------------------
    def taken_of(self, costs: dict, checkpointed: dict, blocks) -> set:
        """The variables of the state ``greedy.choose`` left."""
        taken = set()
        for v, (kind, owner, o) in enumerate(self.vars):
            if kind == "t" and owner.index not in checkpointed and costs.get(owner.index) is o:
                taken.add(v)
            elif kind == "b" and owner.chosen:
                taken.add(v)
            elif kind == "i" and owner.block.chosen and owner.move is o:
                taken.add(v)
        return taken

    def apply(self, taken: set, records, blocks, choice: dict, costs: dict,
              checkpointed: dict, must_ids: set) -> Tuple[int, int]:
        """Write ``taken`` into make_plan's state (every non-MUST choice
        replaced); returns (bytes freed, recipe and checkpoint input bytes
        kept beyond the MUST answers')."""
        for r in records:
            if r.index not in must_ids:
                choice[r.index] = Tier.KEEP
                costs.pop(r.index, None)
                checkpointed.pop(r.index, None)
        for b in blocks:
            b.chosen = False
            b.before_kept = set()
            for i in b.ins:
                i.move = None
        extra = 0
        for v in sorted(taken, key=lambda v: self.vars[v][0] != "b"):   # blocks first
            kind, owner, o = self.vars[v]
            if kind == "b":
                owner.chosen = True
                extra += owner.kept_in
                for j in range(owner.rec.start, owner.rec.end):
                    checkpointed[j] = owner
            elif kind == "t":
                choice[owner.index], costs[owner.index] = o.tier, o
                if o.tier is Tier.RECOMPUTE:
                    extra += owner.input_kept_bytes
            else:
                owner.move = o
                extra -= owner.x.nbytes
        for b in blocks:
            if b.chosen:
                b.before_kept = {x.arg for x in b.rec.inputs
                                 if x.kind == "before" and x.saved_as in checkpointed}
                extra += sum(x.nbytes for x in b.rec.inputs if x.arg in b.before_kept)
        return self.evaluate(taken)[0], extra


def _hint_levels(variables: List[tuple], freed: List[int]) -> Tuple[List[int], dict]:
    """NOTE [Hints in the program]: each variable's level (0: a hinted move,
    1: unhinted, 2: a keep hint's), and variable -> MiB x rank in the hint of
    the hinted moves' options off the hint's first tier."""
    levels, ranked = [], {}
    for v, (kind, owner, o) in enumerate(variables):
        hint = owner.hint if kind == "t" else None
        if hint is None:
            levels.append(1)
        elif not is_move_hint(hint[0]):
            levels.append(2)
        else:
            levels.append(0)
            order = hint[0]
            rank = order.index(o.tier) if o.tier in order else len(order)
            if rank:
                ranked[v] = rank * freed[v] / _MIB
    return levels, ranked
