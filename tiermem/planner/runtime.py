"""``policy="auto"`` inside a step: :class:`StepPlanning` answers the pack
hook (profile, follow a plan, or the safe order) and runs the
``checkpoint="auto"`` blocks. Which step profiles and which plan it starts
with is the per-signature state machine's (planner/lifecycle.py)."""

# NOTE [Profile under the safe order]
# A step with no plan for its shapes is profiled under the *safe* order:
# recompute what the recompute tier takes, else the tiers that free device
# memory (cpu, then nvme, for CUDA tensors; nvme for CPU tensors: the cpu
# tier would hold a CPU tensor in the same RAM and free nothing), else keep.
# No plan keeps less on the device than that, so the profile never needs
# more device memory than the plan it leads to (keep-everything could run
# out of memory where the plan fits). The price: that one step pays for
# producer tracking, recomputes and moves, and its timeline (the windows the
# plan reads) is the timeline of that placement.

# NOTE [Steps that never reach backward]
# A forward whose backward never runs (a skipped non-finite loss, a warm-up
# with grad on) or that raises must not steer the planner:
# 1. A profile waits for its backward (its windows come from it). If its
#    graph is freed first (``Recorder.graph_dropped``), or PROFILE_EXPIRY_STEPS
#    steps begin before its backward (an output kept for good), it is dropped
#    and its signature asks again: never stuck in the safe order.
# 2. A step following a plan that raised stopped early: its tensors say
#    nothing of the signature, so plans and requests are left as they are.
#    A step that left its plan before it raised has asked already.

# NOTE [Following a plan]
# A plan is a tier order per pack index (``TensorInfo.index``), valid for one
# step signature: the (shape, dtype, device) of each tensor in pack order.
# The pack hook compares each tensor's key with the plan's at its index and
# takes the plan's order. On the first tensor that differs (another sequence
# length, another branch) the step follows a cached plan of another signature
# that agrees with the step so far and with this tensor, if one does (an old
# shape reuses its plan, no new profile); else the rest of the step takes the
# safe order and the next step profiles. Every order is a valid placement, so
# a step off its plan is still exact; only its budget is not planned.
# Planned keeps take a shorter path: NOTE [Planned keeps by position].

# NOTE [Planned keeps by position]
# Most tensors of most plans are kept, and a kept tensor needs no dedup key
# (NOTE [Pack order of checks] in runtime/hooks.py). So the profile records
# each pack position (every tensor reaching the plan, dedup hits included) and
# ``Plan.kept_at[pos]`` is (i, shape, dtype, device) for a new tensor of index
# i planned kept, (~i, ...) for a dedup hit of i, else None. Where it matches
# (three comparisons; the device check stands for the movable-tensor check: a
# plan holds cpu and cuda tensors only) and a new tensor's index is i, the
# tensor is kept at once as the keep tier keeps it: no dedup key or entry, no
# TensorInfo unless producers are tracked (``StepDecider.keep_at``, one call
# per tensor, the pack hook's first question to the step's decider). A hit
# takes no index, as in the profile; anything else takes the general path
# (``decide``). Exactness never rests on the table: a kept tensor is a valid
# placement (a storage kept twice costs nothing); a wrong guess costs only
# memory, which the closed loop measures.

# NOTE [Stall on the GPU's timeline]
# On CUDA the closed loop compares the plan's predicted stall, made on the
# GPU's timeline (NOTE [Profile times on a GPU] in planner/recorder.py), with
# a stall measured on that timeline, not with the host's waits
# (``stats.stall_seconds``): a restore from the cpu tier makes the consumer's
# stream wait for the copy's event while the host goes on, and a disk read
# blocks the host while the GPU may still run queued work. So the first step
# following a plan times each restore's wait on the consumer's stream: timing
# events before the unpack waits and after its stream is ordered after the
# copy (``Step.gpu_wait_start`` / ``gpu_wait_end``, reported to the step's
# observer that asks for them, ``_GpuWaits``); their sum is the step's stall,
# read when the check runs (the next step's start: one host wait per plan).
# On the CPU, and where no restore was timed, the host's waits are the stall.

# NOTE [Tracking priced]
# A step following a plan that recomputes tracks producers in the (module,
# torch call) pairs its recipes ran in (NOTE [Tracking inside torch calls] in
# tracking/modules.py), at ``Rates.track_op_s`` per aten op there: that can
# cost more than the regeneration it enables, so the planner prices it:
# 1. The profile counts handled ops per (innermost module, outermost call)
#    (``Profile.call_ops``); a pair with no call stands for all the module's
#    ops, a recipe without recorded modules for every op of the forward.
# 2. A recompute option carries a share of each pair it needs: ops x
#    ``track_op_s`` (calls recorded whole: x ``track_call_s``, see
#    NOTE [Calls recorded whole] in tracking/producers.py), split among the
#    tensors needing the pair (paid once per step), ranked with regeneration.
# 3. Shares assume every user of a pair is recomputed, so the plan's own
#    tracking (``Plan.predicted_tracking_s``) is checked against a second
#    solve recomputing only what hints ask: the cheaper plan in budget wins.

# NOTE [Blocks the planner may checkpoint]
# An auto block call is one more option: checkpoint it whole (RNG preserved).
# 1. Options are the outermost auto blocks of the forward, counted in call
#    order (``blocks_seen``); nested ones and ones run in backward run plainly.
# 2. The profile runs them plainly and records each (``BlockRecord``): its pack
#    indexes and positions, entry and forward time, tensor arguments.
# 3. The solver frees the block's saved bytes less its kept inputs' and charges
#    one more forward of it in backward plus its inputs' moves.
# 4. A step following the plan checkpoints a block only where the profile
#    entered it (name, ``start``, ``start_pos``; else plainly); inside it only
#    its inputs are packed, with no index, and on exit index and position jump
#    to ``end`` / ``end_pos``: the rest of the step lines up with the profile.
# 5. A position that was a dedup hit of a tensor saved inside the block is new
#    then: kept with no index (``Plan.revived_at``), counted in the kept bytes.
# 6. Its inputs are kept or moved: NOTE [Checkpointed block inputs].

# NOTE [Checkpointed block inputs]
# A checkpointed block's tensor arguments are saved at its entry and unpacked
# when backward starts its recompute (in the profile's timeline: the first
# unpack of a tensor saved inside the block). Each is kept, or moved to cpu
# (CUDA inputs) or nvme, priced like a tensor's move over that window; once a
# block is checkpointed with inputs kept, moving each is one more option.
# Never recomputed: regenerating an input means a larger checkpointed region.
# Each storage is counted once, by ``BlockInput.kind`` (recorded at the
# block's entry; NOTE [Dedup] in runtime/step.py): a parameter stays as the
# pack hook keeps it; a small or unmovable one is kept; ``"before"`` (saved
# earlier as #j) shares #j's handle, or is kept as a hit where #j is not
# remembered, or new and kept where #j is inside a checkpointed block;
# ``"after"`` (saved again after the block) is kept, that save a hit of it.
# Only ``"movable"`` inputs move, so plan and step stats count them alike.

from __future__ import annotations

from typing import List, Optional

import torch

from ..config import BudgetShare
from ..policy import Tier
from ..runtime.contract import (INDEXED, KEPT_HIT, KEPT_NEW, KICK, NO_INDEX, StepObserver,
                                Tracking)
from .plan import Plan
from .recorder import Recorder
from .signatures import Request, is_resized, numel

__all__ = ["StepPlanning"]

_KEEP_ORDER = (Tier.KEEP,)


class _GpuWaits(StepObserver):
    """The restore waits of a plan's first step, timed on the GPU (NOTE
    [Stall on the GPU's timeline]): ``waits``, (start, end) event pairs."""

    times_gpu_waits = True

    def __init__(self) -> None:
        self.waits: list = []

    def gpu_wait(self, start, end) -> None:
        self.waits.append((start, end))


class StepPlanning:
    """One step under ``auto``: the planner's :class:`~tiermem.deciders.StepDecider`.

    The runtime calls only the protocol's methods (``keep_at``, ``decide``,
    ``dedup_hit``, ``block``, ...); the fields are the planner's: ``pos``
    counts the tensors that reached the plan, dedup hits included; ``count``
    the indices handed out (the step's index)."""

    __slots__ = ("planner", "plan", "recorder", "safe", "off_plan", "count", "tracks", "pos",
                 "kept_at", "blocks_seen", "block_depth", "in_checkpoint", "revived",
                 "scope", "scope_ops", "scope_calls", "scope_direct", "kick", "checkpoint_inputs",
                 "gpu_waits", "wanted", "seen", "mixed", "ask_hints", "_observers")

    def __init__(self, planner, plan: Optional[Plan], recorder: Optional[Recorder],
                 wanted: Optional[List[Request]] = None) -> None:
        self.planner = planner
        self.plan = plan
        self.recorder = recorder
        #: A profile attempt for these requested signatures only (``None``: any).
        self.wanted = wanted
        #: While ``wanted``: the keys of the step's tensors so far.
        self.seen: list = []
        #: Part of the step was placed otherwise than by ``plan`` (a profile
        #: attempt passed over): no closed-loop check of it.
        self.mixed = False
        self.safe = planner.safe
        self.off_plan = False
        self.count = 0
        self.pos = 0
        #: A resized plan under hints: each tensor's hints are asked (a MUST
        #: answer may depend on the sizes; NOTE [Plans across sizes] in
        #: planner/lifecycle.py), so no tensor takes the fast table.
        self.ask_hints = (plan is not None and planner.hints is not None
                          and is_resized(plan))
        #: The plan's per-position fast table (``Plan.kept_at``), () when none
        #: applies (profiling, safe order, or the step left its plan).
        self.kept_at = () if plan is None or self.ask_hints else plan.kept_at
        #: Positions that are new tensors because the plan checkpoints a
        #: block (``Plan.revived_at``; rule 5 of NOTE [Blocks the planner may
        #: checkpoint]); empty once positions no longer line up.
        self.revived = () if plan is None else plan.revived_at
        #: The pack index whose kept tensor starts the restores when backward
        #: unpacks it (NOTE [Restores start with backward] in runtime/hooks.py), or None.
        self.kick = None if plan is None else plan.kick_index
        #: Producer tracking is needed (profiling, safe order, or a plan that recomputes).
        self.tracks = plan is None or plan.recomputes
        #: NOTE [Blocks the planner may checkpoint]: outermost auto blocks
        #: entered so far, auto blocks running now, and whether a planned
        #: checkpoint is saving its inputs now.
        self.blocks_seen = 0
        self.block_depth = 0
        self.in_checkpoint = False
        #: While ``in_checkpoint``: dedup key -> tier order of the planned
        #: checkpoint's inputs (None: counted with the tensor it shares;
        #: NOTE [Checkpointed block inputs]); an input not in it is kept.
        self.checkpoint_inputs: dict = {}
        #: The modules to track in (NOTE [Scoped tracking] in tracking/modules.py), or
        #: ``None``: the whole forward (when ``tracks``). With hints, the whole
        #: forward: a step that leaves its plan asks the hints callable, whose
        #: ``TensorInfo.op`` needs every op recorded.
        self.scope = (None if plan is None or planner.hints is not None
                      else getattr(plan, "tracking_scope", None))
        #: With ``scope``: the op names to record per module of it (NOTE
        #: [Recording only what recipes use] in tracking/producers.py), or ``None``:
        #: every recomputable op.
        self.scope_ops = (None if self.scope is None
                          else getattr(plan, "tracking_ops", None))
        #: With ``scope``: the torch calls to track in per module of it (NOTE
        #: [Tracking inside torch calls] in tracking/modules.py), or ``None``: all of
        #: each module.
        self.scope_calls = (None if self.scope is None
                            else getattr(plan, "tracking_calls", None))
        #: With ``scope_calls``: per module, the calls recorded whole (NOTE
        #: [Calls recorded whole] in tracking/producers.py).
        self.scope_direct = (None if self.scope_calls is None
                             else getattr(plan, "tracking_direct", None))
        #: The first step following ``plan``: (start, end) CUDA timing events
        #: of its restore waits (NOTE [Stall on the GPU's timeline]), else None.
        timer = _GpuWaits() if plan is not None and plan.measured_steps == 0 else None
        self.gpu_waits: Optional[list] = None if timer is None else timer.waits
        self._observers = tuple(o for o in (recorder, timer) if o is not None)

    # -- the StepDecider protocol (tiermem/deciders.py) ---------------------------------
    def tracking(self) -> Tracking:
        profiled = self.recorder is not None
        return Tracking(whole=self.tracks and self.scope is None,
                        op_names=profiled or self.planner.hints is not None,
                        profiled=profiled, modules=self.scope, ops=self.scope_ops,
                        calls=self.scope_calls, direct=self.scope_direct)

    def prefetch_bytes(self) -> Optional[int]:
        """A step that follows a plan uses the plan's window (NOTE [Planner
        cost model], 3, in planner/solver.py)."""
        return None if self.plan is None else self.plan.suggested_prefetch_bytes

    def observers(self) -> tuple:
        """The profile's recorder (a profiled step), the timing of restore
        waits (a plan's first step)."""
        return self._observers

    def keep_at(self, t, index: int) -> int:
        """NOTE [Planned keeps by position]: one tuple lookup, one (shape,
        dtype, device) check, which also stands for the pack hook's movable
        check (a plan holds cpu and cuda tensors only)."""
        pos = self.pos
        kept_at = self.kept_at
        entry = kept_at[pos] if pos < len(kept_at) else None
        if entry is not None:
            i, shape, dtype, device = entry
            if t.dtype is dtype and t.shape == shape and t.device == device:
                if i < 0:   # a dedup hit in the profile, of a kept tensor
                    self.pos = pos + 1
                    return KEPT_HIT
                if index == i:
                    self.pos = pos + 1
                    self.count = i + 1
                    return KEPT_NEW
        return 0

    def dedup_hit(self) -> None:
        self.pos += 1

    def decide(self, index: int, t, key: tuple, nbytes: int, module: str, producers):
        """NOTE [Following a plan]; inside a planned checkpoint its inputs
        (NOTE [Checkpointed block inputs]); revived positions (NOTE [Blocks
        the planner may checkpoint], rule 5)."""
        pos = self.pos
        self.pos = pos + 1
        if self.in_checkpoint:
            return self.checkpoint_inputs.get(key, _KEEP_ORDER), NO_INDEX
        revived = self.revived
        if revived and pos in revived:
            return _KEEP_ORDER, NO_INDEX
        order = self.order(index, t, nbytes, module, producers)
        return order, (KICK if index == self.kick else INDEXED)

    # -- the planner's answers ----------------------------------------------------------
    def order(self, index: int, t, nbytes: int, module: str, producers) -> tuple:
        """The tier order of tensor ``index`` (NOTE [Following a plan])."""
        self.count = index + 1
        rec = self.recorder
        if rec is not None and (self.wanted is None or self._still_wanted(index, t)):
            op = None if producers is None else producers.op_name(t)
            hints = self.planner.hints
            hint = None if hints is None else hints.ask(index, t, nbytes, module, op)
            rec.record(index, t, nbytes, module, op, hint)
            if hint is not None and hint[0].must:   # NOTE [Planner hints], rule 2
                return hints.must_order(hint[0], t.device.type)
            return self.safe[t.device.type]
        plan = self.plan
        if plan is not None:
            keys = plan.keys
            if index < len(keys) and keys[index] == (t.shape, t.dtype, t.device):
                if self.ask_hints:
                    order = self._must(index, t, nbytes, module, producers)
                    if order is not None:
                        return order
                return plan.orders[index]
            self.kept_at = self.revived = ()   # positions no longer line up with a plan
            self.kick = None
            plan = self.plan = None if self.off_plan else self.planner.switch(keys, index, t)
            if plan is not None:
                self.ask_hints = self.planner.hints is not None and is_resized(plan)
                return self.order(index, t, nbytes, module, producers)
            self.off_plan = True
            self.planner.request(keys, index, (t.shape, t.dtype, t.device))
        order = self._must(index, t, nbytes, module, producers)
        return self.safe[t.device.type] if order is None else order

    def _must(self, index: int, t, nbytes: int, module: str, producers):
        """The order obeying the hints' MUST answer for tensor ``index``, else
        ``None`` (NOTE [Planner hints] in planner/hints.py)."""
        hints = self.planner.hints
        if hints is not None:   # the safe order, MUST answers obeyed (NOTE [Planner hints])
            hint = hints.ask(index, t, nbytes, module,
                             None if producers is None else producers.op_name(t))
            if hint is not None and hint[0].must:
                return hints.must_order(hint[0], t.device.type)
        return None

    def _still_wanted(self, index: int, t) -> bool:
        """A profile attempt (``wanted``): whether the step may still be one
        of the requested signatures; if not, the attempt is passed over and
        the step follows the plan it is on from here, if any, or asks for its
        own profile (the table in planner/lifecycle.py)."""
        key = (t.shape, t.dtype, t.device)
        alive = [r for r in self.wanted if r.agrees(index, key)]
        seen = self.seen
        if alive:
            self.wanted = alive
            seen.append(key)
            return True
        planner = self.planner
        plan = planner.switch(tuple(seen), index, t)
        if plan is None:   # neither wanted nor planned: a signature of its own, profiled
            self.wanted = None
            return True
        self.recorder.active = False   # its observer ignores the rest of the step
        self.recorder = None
        self.mixed = True
        planner.passed_over(self.wanted)
        self.plan = plan
        self.ask_hints = planner.hints is not None and is_resized(plan)
        return False

    def satisfied(self, plans: dict) -> Optional[List[Request]]:
        """At the end of a profiled step's forward: the requests it answers
        (``[]``: any step was wanted, or it is a signature of its own: a
        shorter step), or ``None``: it is none of the wanted ones."""
        if self.wanted is None:
            return []
        done = [r for r in self.wanted if r.ended_at(self.count)]
        if done:
            return done
        for r in self.wanted:
            shorter = r.keys[:self.count]
            if self.count < r.index and not any(shorter == k for k in plans):
                return []
        return None


    def block(self, module: str, args: tuple, plain, checkpointed, step):
        """Run an auto block: ``plain()`` or ``checkpointed()``, as the profile
        or the plan says (NOTE [Blocks the planner may checkpoint]); returns
        its output and, after a planned checkpoint, the index ``step``
        resumes at (rule 4), else None."""
        if self.block_depth:   # rule 1: inside an auto block
            return plain(), None
        b = self.blocks_seen
        self.blocks_seen = b + 1
        self.block_depth = 1
        try:
            if self.recorder is not None:
                return self.recorder.block(b, module, args, plain, self, step), None
            plan = self.plan
            pb = None if plan is None or b >= len(plan.blocks) else plan.blocks[b]
            if (pb is None or not pb.checkpoint or pb.module != module
                    or self.count != pb.start or self.pos != pb.start_pos):
                return plain(), None
            self.kept_at = ()
            resized = (isinstance(self.planner.cfg.device_budget, BudgetShare)
                       if is_resized(plan) else None)
            self.checkpoint_inputs = _input_orders(pb, args, step.key_of, resized)
            self.in_checkpoint = True
            try:
                out = checkpointed()
            finally:
                self.in_checkpoint = False
                self.checkpoint_inputs = {}
            # Rule 4: the rest of the step is numbered as in the profile.
            self.count = pb.end
            self.pos = pb.end_pos
            if self.plan is plan:
                self.kept_at, self.revived = plan.kept_at, plan.revived_at
            return out, pb.end
        finally:
            self.block_depth = 0


def _input_orders(pb, args: tuple, key_of, resized: Optional[bool] = None) -> dict:
    """Dedup key -> tier order (``None``: a dedup hit counted with its saver)
    of the planned inputs of checkpointed block ``pb`` that are moved or
    shared, for the arguments ``args`` that match the plan's (shape, dtype,
    device); every other input is kept (NOTE [Checkpointed block
    inputs]). ``resized``: ``None`` for the plan made for these
    sizes; for a resized view of it (NOTE [Plans across sizes] in planner/lifecycle.py) an argument
    of the same rank matches, of any size with a percentage budget
    (``True``), of no more elements than planned with a size budget
    (``False``), as the view's tensors do."""
    out = {}
    for x in pb.inputs:
        if x.tier == Tier.KEEP.value and x.shared_with is None:
            continue
        a = args[x.arg] if x.arg < len(args) else None
        if (type(a) is not torch.Tensor or str(a.dtype) != "torch." + x.dtype
                or str(a.device) != x.device):
            continue
        if resized is None:
            if tuple(a.shape) != x.shape:
                continue
        elif a.dim() != len(x.shape) or (not resized and a.numel() > numel(x.shape)):
            continue
        out[key_of(a)] = (None if x.shared_with is not None
                          else tuple(Tier(t) for t in x.order))
    return out


