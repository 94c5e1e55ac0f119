"""A plan: the tier order of each saved tensor of a step, what it predicts,
what was measured, and why each tensor goes where it goes.

``str(plan)`` is a per-module table, ``plan.explain(index)`` one tensor's
reason, ``plan.reasons`` all of them, ``plan.as_dict()`` a JSON-ready copy.
Made by :func:`tiermem.planner.solver.make_plan`; read through
``Offloader.plan``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from ..errors import TierMemError
from ..policy import Tier, TierOrder
from ..telemetry import format_bytes

__all__ = ["Plan", "PlannedTensor", "PlannedBlock", "PlannedInput", "CHECKPOINTED",
           "revived_positions"]

#: ``PlannedTensor.tier`` of a tensor saved inside a block the plan
#: checkpoints (NOTE [Blocks the planner may checkpoint] in planner/runtime.py).
CHECKPOINTED = "checkpoint"


@dataclass
class PlannedTensor:
    """One tensor of the plan (pack index ``index``)."""

    index: int
    module: str
    op: Optional[str]
    shape: Tuple[int, ...]
    dtype: str
    nbytes: int
    tier: str
    order: Tuple[str, ...]
    reason: str
    #: Seconds from its save to its first use in backward (profile timeline).
    window_s: float
    #: Predicted cost of the chosen tier (regeneration or stall), seconds.
    cost_s: float = 0.0
    #: The ``hints`` callable's answer for it (``"PREFER_RECOMPUTE"``,
    #: ``"'cpu'"``), ``None`` without one (NOTE [Planner hints] in planner/hints.py).
    hint: Optional[str] = None
    #: The answer was a MUST_*: ``order`` obeys it, and follows it in every step.
    must: bool = False

    #: Predicted CPU charge of its move (NOTE [Planner cost model]), seconds.
    cpu_s: float = 0.0
    #: Seconds from the step's start to its save (profile timeline).
    pack_s: float = 0.0
    #: Recompute: bytes of its recipe's inputs left on the device.
    input_kept_bytes: int = 0
    #: Moves: the simulated restore (NOTE [Planner cost model], 4), seconds
    #: from the start of backward: when its read starts and ends, and when
    #: backward needs it (earlier stalls included); ``None`` otherwise.
    restore_s: Optional[Tuple[float, float, float]] = None


def revived_positions(blocks: List["PlannedBlock"], positions: tuple) -> List[int]:
    """Pack positions outside the checkpointed ones of ``blocks`` that were,
    in the profile (``positions``: see ``Recorder.positions``), dedup hits of
    tensors saved inside them (rule 5 of NOTE [Blocks the planner may
    checkpoint] in planner/runtime.py)."""
    chosen = [b for b in blocks if b.checkpoint]
    if not chosen:
        return []
    inside = {i for b in chosen for i in range(b.start, b.end)}
    return [pos for pos, p in enumerate(positions)
            if p is not None and p < 0 and ~p in inside
            and not any(b.start_pos <= pos < b.end_pos for b in chosen)]


@dataclass
class PlannedInput:
    """One tensor argument of a block the plan checkpoints: what the
    checkpoint saves in the block's place, and where (rule 6 of NOTE [Blocks
    the planner may checkpoint] in planner/runtime.py)."""

    #: Position among the block's positional arguments.
    arg: int
    shape: Tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    #: ``BlockInput.kind`` (``tiermem.planner.profile.INPUT_KINDS``).
    kind: str
    #: ``"keep"``, ``"cpu"`` or ``"nvme"``.
    tier: str
    #: The tier order a step following the plan gives it.
    order: Tuple[str, ...]
    #: Bytes it adds to the kept bytes: 0 when moved, a parameter, or a dedup
    #: hit of the tensor ``shared_with`` (counted there).
    kept_bytes: int
    reason: str
    #: Seconds from the block's entry to the start of its recompute in
    #: backward (profile timeline).
    window_s: float = 0.0
    #: Predicted stall of its move, and its CPU charge, seconds.
    cost_s: float = 0.0
    cpu_s: float = 0.0
    #: The pack index whose handle it shares (``kind == "before"``), else None.
    shared_with: Optional[int] = None


@dataclass
class PlannedBlock:
    """One ``wrap_blocks(..., checkpoint="auto")`` block call (``index``: its
    order among the step's auto blocks) and whether the plan checkpoints it
    (NOTE [Blocks the planner may checkpoint] in planner/runtime.py). Its
    saved tensors are pack indexes ``start`` to ``end - 1`` of the profile
    (positions ``start_pos`` to ``end_pos - 1``)."""

    index: int
    module: str
    start: int
    end: int
    start_pos: int
    end_pos: int
    #: Bytes saved inside it in a plain step.
    saved_bytes: int
    #: Bytes a checkpoint of it saves (its tensor arguments; kept).
    input_bytes: int
    #: Its forward in the profile: about what a checkpoint adds to backward.
    forward_s: float
    checkpoint: bool
    reason: str
    #: What its checkpoint saves, per tensor argument (``PlannedInput``);
    #: empty when it is not checkpointed (or its inputs were not recorded:
    #: then every input is kept).
    inputs: List[PlannedInput] = field(default_factory=list)


@dataclass
class Plan:
    """See the module docstring. Byte figures count saved activations only
    (parameters never); "kept" is what stays where it was made
    (``stats.bytes_by_tier['keep']``: the plan's kept tensors, small and
    unmovable tensors, and recipe inputs left on the device)."""

    signature: str
    tensors: List[PlannedTensor]
    budget_bytes: int
    budget_setting: str
    baseline_bytes: int
    #: Kept bytes that never reach the planner (small, unmovable), less
    #: those saved inside the blocks the plan checkpoints.
    fixed_kept_bytes: int
    predicted_kept_bytes: int
    predicted_stall_s: float
    predicted_recompute_s: float
    #: The prefetch window of a step that follows this plan, when
    #: ``prefetch_bytes`` is unset (NOTE [Planner cost model], 3; applied in
    #: offloader.py); ``prefetch_bytes`` itself when set.
    suggested_prefetch_bytes: int
    rates: dict
    planning_seconds: float = 0.0
    #: Plans made for this signature before this one (closed-loop corrections).
    replans: int = 0
    #: Why this plan replaced the previous one ("" for the first).
    replan_reason: str = ""
    measured_kept_bytes: Optional[int] = None
    measured_stall_s: Optional[float] = None
    measured_steps: int = 0
    notes: List[str] = field(default_factory=list)
    #: The step's ``checkpoint="auto"`` blocks, in call order.
    blocks: List[PlannedBlock] = field(default_factory=list)
    #: Step seconds the moves' CPU work takes from the compute (CPU devices).
    predicted_cpu_s: float = 0.0
    #: The kept tensor (pack index) whose first unpack starts the step's
    #: restores, or None (NOTE [Restores start with backward] in runtime/hooks.py).
    kick_index: Optional[int] = None
    #: The choice's priced cost (the sum of its options' lone prices: NOTE
    #: [Planner choice] in planner/milp.py) and the greedy's choice's (the
    #: solver's floor); ``None`` when nothing had to move.
    priced_cost_s: Optional[float] = None
    greedy_priced_cost_s: Optional[float] = None
    #: Aten ops per forward a step following the plan tracks producers in,
    #: and the seconds that adds to its forward (NOTE [Tracking priced] in
    #: planner/runtime.py); 0 when it recomputes nothing or they were not
    #: counted.
    tracked_ops: int = 0
    #: Torch calls per forward a step following it records whole, without
    #: the mode (NOTE [Calls recorded whole] in tracking/producers.py).
    direct_calls: int = 0
    predicted_tracking_s: float = 0.0
    #: Forwards in flight the plan was made for: ``budget_bytes`` is one step's
    #: share (NOTE [Budget across micro-batches] in planner/planning.py).
    in_flight: int = 1

    @property
    def predicted_step_cost_s(self) -> float:
        """Predicted seconds the plan adds to a step: stall, CPU charge,
        recompute, producer tracking."""
        return (self.predicted_stall_s + self.predicted_cpu_s + self.predicted_recompute_s
                + self.predicted_tracking_s)

    def kept_timeline(self) -> List[Tuple[int, int]]:
        """Predicted kept bytes over the forward: ``(n, bytes)`` after the ``n``
        first planned tensors were saved (pack order): the kept ones and the
        recipe inputs of recomputed ones, plus the small and unmovable tensors
        (``fixed_kept_bytes``, whose pack times the profile does not keep)
        spread evenly over the step; the kept inputs of a checkpointed block
        at its first tensor (a checkpoint saves them on entry). Ends at
        ``predicted_kept_bytes`` (less, where a checkpointed block's output
        is saved again after it: NOTE [Blocks the planner may checkpoint],
        rule 5)."""
        at = {}
        for b in self.blocks:
            if b.checkpoint:
                at[b.start] = at.get(b.start, 0) + sum(x.kept_bytes for x in b.inputs)
        out, kept, n = [], 0, len(self.tensors)
        for i, p in enumerate(self.tensors):
            kept += at.get(i, 0)
            kept += p.nbytes if p.tier == Tier.KEEP.value else p.input_kept_bytes
            out.append((i + 1, kept + self.fixed_kept_bytes * (i + 1) // max(1, n)))
        return out

    # -- lookups used by the pack hook (runtime.py) ----------------------------------
    def __post_init__(self) -> None:
        # A MUST order is a TierOrder with ``must`` set: the recompute tier
        # raises rather than pass it on (NOTE [CheckpointPolicy answers]).
        self.orders: Tuple[tuple, ...] = tuple(
            TierOrder([Tier(x) for x in p.order], must=True) if p.must
            else tuple(Tier(x) for x in p.order) for p in self.tensors)
        self.recomputes = any(p.tier == Tier.RECOMPUTE.value for p in self.tensors)
        self.keys: tuple = ()
        self.kept_at: tuple = ()
        #: Pack positions that were dedup hits of tensors of checkpointed
        #: blocks (NOTE [Blocks the planner may checkpoint] in planner/runtime.py).
        self.revived_at: frozenset = frozenset()

    def follow(self, keys: tuple, positions: tuple) -> None:
        """Bind the plan to its step signature ``keys`` ((shape, dtype,
        device) per index) and the profile's pack ``positions`` (see
        ``Recorder.positions``), and build the per-position table the pack
        hook reads (NOTE [Following a plan] in
        planner/runtime.py): ``kept_at[pos]`` is ``(i, shape, dtype, device)``
        where position ``pos`` was the new tensor of index ``i`` and the plan
        keeps it, ``(~i, shape, dtype, device)`` where it was a dedup hit of
        index ``i`` and the plan keeps ``i`` (the key of ``i`` either way),
        else ``None`` (the general path; always for ``revived_at`` and for
        ``kick_index``: NOTE [Restores start with backward] in runtime/hooks.py)."""
        if len(keys) != len(self.orders):
            raise TierMemError(f"tiermem: a plan of {len(self.orders)} tensors bound to "
                                 f"{len(keys)} keys; this is a bug")
        self.keys = keys
        kept = tuple(o == (Tier.KEEP,) for o in self.orders)
        self.revived_at = revived = frozenset(revived_positions(self.blocks, positions))
        self.kept_at = tuple(
            None if p is None or not kept[p if p >= 0 else ~p] or pos in revived
            or p == self.kick_index   # packed on the general path (KickKept)
            else (p,) + tuple(keys[p if p >= 0 else ~p])
            for pos, p in enumerate(positions))

    # -- explain --------------------------------------------------------------------
    @property
    def reasons(self) -> Dict[int, str]:
        """Pack index -> the reason of its tier."""
        return {p.index: p.reason for p in self.tensors}

    def explain(self, index: int) -> str:
        """Why tensor ``index`` (pack order) goes where it goes."""
        p = self.tensors[index]
        return (f"#{p.index} {p.module or '<no module>'} {p.op or '?'} "
                f"{list(p.shape)} {p.dtype} {format_bytes(p.nbytes)}: {p.reason}")

    def bytes_by_tier(self) -> Dict[str, int]:
        """Bytes per tier (``"checkpoint"`` too when the step has auto blocks:
        the bytes checkpointing saves no more); the inputs of checkpointed
        blocks count in their tier (kept ones by ``kept_bytes``)."""
        out = {t.value: 0 for t in Tier}
        if self.blocks:
            out[CHECKPOINTED] = 0
        for p in self.tensors:
            out[p.tier] += p.nbytes
        for x in self._inputs():
            out[x.tier] += x.kept_bytes if x.tier == Tier.KEEP.value else x.nbytes
        return out

    def _inputs(self):
        """The planned inputs of the checkpointed blocks, in call order."""
        return [x for b in self.blocks if b.checkpoint for x in b.inputs]

    def as_dict(self) -> dict:
        """A JSON-ready copy (``json.dumps`` takes it as is)."""
        d = asdict(self)
        for t in d["tensors"]:   # lists, as JSON gives them back
            t["shape"], t["order"] = list(t["shape"]), list(t["order"])
            if t["restore_s"] is not None:
                t["restore_s"] = list(t["restore_s"])
        for b in d["blocks"]:
            for x in b["inputs"]:
                x["shape"], x["order"] = list(x["shape"]), list(x["order"])
        d["bytes_by_tier"] = self.bytes_by_tier()
        d["predicted_step_cost_s"] = self.predicted_step_cost_s
        return d

    def explain_block(self, index: int) -> str:
        """Why auto block ``index`` (call order) is checkpointed or not."""
        b = self.blocks[index]
        return f"block #{b.index} {b.module or '<no module>'}: {b.reason}"

    def explain_input(self, block: int, arg: int) -> str:
        """Where the checkpoint of auto block ``block`` puts its argument
        ``arg`` (positional), and why."""
        for x in self.blocks[block].inputs:
            if x.arg == arg:
                return (f"block #{block} input {arg} {list(x.shape)} {x.dtype} "
                        f"{format_bytes(x.nbytes)}: {x.reason}")
        raise KeyError(f"tiermem: block #{block} has no planned input {arg} (not "
                       "checkpointed, or not a tensor argument)")

    def __str__(self) -> str:
        tiers = [t.value for t in Tier] + ([CHECKPOINTED] if self.blocks else [])
        rows: Dict[str, Dict[str, int]] = {}
        for p in self.tensors:
            row = rows.setdefault(p.module or "<no module>", {t: 0 for t in tiers})
            row[p.tier] += p.nbytes
        for b in self.blocks:
            for x in b.inputs if b.checkpoint else ():
                row = rows.setdefault(b.module or "<no module>", {t: 0 for t in tiers})
                row[x.tier] += x.kept_bytes if x.tier == Tier.KEEP.value else x.nbytes
        width = max([len("module")] + [len(m) for m in rows])
        head = f"{'module':<{width}}  " + "  ".join(f"{t:>10}" for t in tiers)
        lines = [
            f"tiermem plan {self.signature}: budget {format_bytes(self.budget_bytes)} "
            f"({self.budget_setting}) of a plain step's {format_bytes(self.baseline_bytes)}; "
            f"{len(self.tensors)} tensors; planned in {self.planning_seconds * 1e3:.1f} ms"
            + (f"; re-planned {self.replans}x ({self.replan_reason})" if self.replans else ""),
            head, "-" * len(head)]
        for module, row in rows.items():
            lines.append(f"{module:<{width}}  " + "  ".join(
                f"{format_bytes(row[t]) if row[t] else '-':>10}" for t in tiers))
        total = self.bytes_by_tier()
        lines.append(f"{'total':<{width}}  " + "  ".join(
            f"{format_bytes(total[t]) if total[t] else '-':>10}" for t in tiers))
        measured = ("not measured yet" if self.measured_kept_bytes is None else
                    f"measured {format_bytes(self.measured_kept_bytes)}")
        lines.append(f"kept (incl. {format_bytes(self.fixed_kept_bytes)} small/unmovable): "
                     f"predicted {format_bytes(self.predicted_kept_bytes)}, {measured}")
        stall = ("" if self.measured_stall_s is None
                 else f", measured {self.measured_stall_s * 1e3:.2f} ms")
        tracking = ""
        if self.tracked_ops or self.direct_calls:
            whole = (f", {self.direct_calls} calls recorded whole" if self.direct_calls
                     else "")
            tracking = (f" + producer tracking {self.predicted_tracking_s * 1e3:.2f} ms "
                        f"({self.tracked_ops} ops{whole})")
        lines.append(f"stall: predicted {self.predicted_stall_s * 1e3:.2f} ms{stall}; "
                     f"CPU charge of moves: predicted {self.predicted_cpu_s * 1e3:.2f} ms; "
                     f"recompute: predicted {self.predicted_recompute_s * 1e3:.2f} ms"
                     f"{tracking}; "
                     f"prefetch window {format_bytes(self.suggested_prefetch_bytes)}")
        hinted = [p for p in self.tensors if p.hint is not None]
        if hinted:
            musts = sum(p.must for p in hinted)
            followed = sum(p.reason.endswith(" followed") for p in hinted if not p.must)
            lines.append(f"hints: {len(hinted)} tensors answered, {musts} MUST (obeyed), "
                         f"{len(hinted) - musts} hints ({followed} followed; "
                         "plan.explain(i) says why)")
        if self.blocks:
            n = sum(b.checkpoint for b in self.blocks)
            lines.append(f"auto blocks: {n} of {len(self.blocks)} checkpointed")
            for b in self.blocks:
                lines.append("  " + self.explain_block(b.index))
                lines.extend("    " + self.explain_input(b.index, x.arg)
                             for x in (b.inputs if b.checkpoint else ()))
        lines.extend(self.notes)
        return "\n".join(lines)
