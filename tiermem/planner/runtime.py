"""``policy="auto"`` at run time: which step profiles, which plan a step
follows, and the closed loop that corrects a plan from measurement.

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
#
# NOTE [Steps that never reach backward]
# A forward whose backward never runs (a loss found non-finite and skipped, a
# warm-up or validation forward with grad on) or that raises must not steer
# the planner:
# 1. A profiled step's profile waits for its backward (the windows and
#    regeneration times come from it), and the steps after it follow the
#    safe order meanwhile. If its graph is freed without a backward (every
#    handle it recorded has died, or the step itself has, with no unpack
#    seen), the profile is dropped when the next step starts and that step
#    profiles instead (``Recorder.graph_dropped``). A graph still held then
#    (``loss`` rebound only after the next forward) is seen dropped a step
#    later: at most two safe-order steps, never a planner stuck in the safe
#    order for the rest of the run.
# 2. A step following a plan that raised in its forward (a bad batch, an
#    out-of-memory caught and skipped) stopped early: fewer tensors than the
#    plan's says nothing of the next step's signature, so the plans and the
#    current one are left as they are (no profile, no check). A step that
#    left its plan before it raised still asks for a profile, as any step
#    off its plan does.
#
# NOTE [Following a plan]
# A plan is a tier order per pack index (``TensorInfo.index``), valid for one
# step signature: the (shape, dtype, device) of each tensor in pack order.
# The pack hook checks each tensor's key against the plan's at its index
# (one tuple comparison) and takes the plan's order. On the first tensor that
# differs (another sequence length, another branch), the plans cached for
# other signatures are searched for one that agrees with the step so far
# and with this tensor; if one does the step follows it (plans are cached per
# signature: an old shape reuses its plan, no new profile), else the rest of
# the step goes to the safe order and the next step profiles. Every order is
# a valid placement, so a step off its plan is still exact; only its budget
# is not planned.
# The hot path (measured: bench_overhead, benchmarks/results/
# 2026-12-01-cpu-overhead-auto.md). Most tensors of most plans are kept, and
# a kept tensor needs no dedup key (kept tensors are never deduplicated: NOTE
# [Pack order of checks] in runtime/hooks.py). So the profile also records each *pack
# position* (every tensor that reaches the plan, dedup hits included): the
# new tensor of index i, or a dedup hit of index i. ``Plan.kept_at`` maps a
# position to (i, shape, dtype, device) (new, planned keep) or (~i, ...) (a
# hit of i, planned keep), with the key of i, else None. The pack hook reads
# ``kept_at[pos]``; where it names a kept tensor whose (shape, dtype, device)
# match (three comparisons, no tuple built) and, for a new tensor, the step's
# index is i, the tensor is kept at once, as the fixed keep tier keeps it
# (no module name in its handle, no dedup key, no dedup entry, no TensorInfo;
# the entry is made only when producers are tracked, for the recipes that
# look their inputs up). The device check stands for the pack hook's
# movable-tensor check, which costs more (a plan holds cpu and cuda tensors
# only). A position that was a hit in the
# profile is not counted as an index, as in the profile. Anything else takes
# the general path above (dedup lookup, index, key check). Exactness never
# rests on the table: a kept tensor is a valid placement whatever else the
# step saved (a storage kept twice costs nothing); what a wrong guess could
# cost is only memory (a tensor kept that this step's dedup would have shared
# with a moved one), which the closed loop measures.
#
# NOTE [Plans across sizes]
# Batch and sequence sizes often change from step to step (variable-length
# batches). A plan per exact signature would profile every new size (each
# profile a step under the safe order) and cache without end. So the first
# PROFILED_SIZES sizes of a structure are profiled and planned each (a shape
# change re-plans; an old shape reuses its plan), and after that a step whose
# sizes match no cached plan follows a *resized* view of a cached plan of the
# same structure: the same number of tensors, and at each position the same
# rank, dtype and device (``_Rank`` compares equal to any shape of its rank,
# and with a size budget to none with more elements than the plan's).
# Which plan: with a percentage budget, the one whose tensor at the first
# differing position is closest in size (the kept share scales with the
# sizes); with a size budget (bytes), the closest one that is not smaller
# there (larger tensors would keep more than the budget), and none if every
# cached one is smaller: that step goes to the safe order and the next one
# profiles its size. With a size budget a resized plan is followed only by
# tensors no larger than the ones it was made for, position by position;
# the same rule matches the inputs of the blocks it checkpoints, which it
# moves as planned (``_input_orders``). A resized plan has no closed loop of its own (its
# budget was priced for other sizes); its tier per tensor is exact like any
# plan's. The caches are bounded: at most MAX_PLANS plans (and their
# profiles), the least recently used dropped first.
#
# NOTE [Closed loop]
# When a step that followed a plan is over (checked when the next step
# starts, or when ``Offloader.plan`` is read), its measured kept bytes
# (``stats.bytes_by_tier['keep']``: what stayed where it was made, small
# tensors and recipe inputs included, parameters never) and stall
# (``stats.stall_seconds``) are written into the plan and compared with the
# prediction. Kept bytes over the budget by more than KEPT_TOLERANCE of it,
# and above the prediction, re-plan with the budget lowered by the overshoot;
# a stall above the prediction by more than STALL_TOLERANCE_S and half the
# prediction re-plans with the copy and disk rates halved. At most
# MAX_REPLANS re-plans per signature, each from the same profile with a
# stricter target (never a looser one), and only from the first step that
# followed a plan (a stall that shows up later, machine noise, corrects
# nothing), so the plan is stable after at most three steps (profile, plan,
# one correction) and cannot oscillate.
#
# NOTE [Stall on the GPU's timeline]
# The closed loop compares a measured stall with the plan's prediction, which
# on CUDA is made on the GPU's timeline (NOTE [Profile times on a GPU] in
# planner/profile.py). The host's waits (``stats.stall_seconds``) are not that
# stall there: a restore from the cpu tier makes the consumer's stream wait
# for the copy's event and the host goes on (a few µs whatever the GPU
# waits), and a read from disk blocks the host while the GPU may still run
# queued work. So the first step that follows a plan (the one the check
# reads) times each restore's wait on the consumer's stream: a timing event
# recorded before the unpack starts or waits for the restore and one after
# its stream is ordered after the copy (``Step.gpu_wait_start`` /
# ``gpu_wait_end``, from the moving tiers' unpack); the time between them is
# how long that stream sat idle for the restore (the host's own wait
# included, when the GPU ran dry meanwhile). Their sum is the measured stall
# of a CUDA step, read when the check runs (the next step's start: one host
# wait for the last event, once per plan). On the CPU, and where no restore
# was timed, the host's waits are the stall, as before.
#
# NOTE [Tracking priced]
# A step that follows a plan recomputing something tracks producers in the
# (module, torch call) pairs its recipes ran in (NOTE [Tracking inside torch
# calls] in tracking/modules.py): every aten op there goes through the producer mode's
# Python handler, which costs the forward ``Rates.track_op_s`` per op
# (measured: rates.py; a scaled_dot_product_attention call runs 34 aten ops
# on CPU, so recomputing a tensor made inside it costs more in tracking than
# its regeneration). So the planner prices it:
# 1. The profiled step counts the ops its mode handles per (innermost module,
#    outermost call) (``Profile.call_ops``); a recipe's pair with no call
#    (an op outside every torch call) stands for all of that module's ops,
#    and a recipe without recorded modules for every op of the forward, as
#    the step would track them.
# 2. Each tensor's recompute option carries a share of the tracking its
#    recipe needs: each pair's ops x ``track_op_s`` (a pair whose calls each
#    ran one recomputable op: x ``track_call_s``, NOTE [Calls recorded whole]
#    in tracking/producers.py), divided among the
#    recomputable tensors whose recipes need that pair (a pair is paid once
#    per step however many recipes use it). The solver ranks it with the
#    regeneration time (NOTE [Planner cost model]).
# 3. The share assumes every user of a pair is recomputed; a plan that
#    recomputes fewer pays more. So the plan's own tracking
#    (``Plan.predicted_tracking_s``: the ops of the pairs it tracks x
#    ``track_op_s``, plus the calls it records whole, ``Plan.direct_calls``,
#    x ``track_call_s``) is compared with the plan made with no recompute but
#    what hints ask for (two solves): the latter is taken when it meets the
#    budget and its predicted step cost (stall, CPU charge, recompute,
#    tracking) is lower. A plan's notes say what its tracking costs, and
#    why it recomputes or declined to.
# Not priced: the module hooks and the call gate of a scoped step (a torch
# function mode, one Python call per torch call in the scoped modules). A
# per-op price is an approximation: most of what a dispatch mode costs a
# real forward on the CPU is its kernels running 3-10% longer while it is
# active (benchmarks/results/2026-12-02-cpu-tracking-untracked-pack.md), a
# cost that scales with the tracked calls' time rather than their op count;
# plans under-price tracking most where they track few ops.

# NOTE [Blocks the planner may checkpoint]
# ``wrap_blocks(model, Block, checkpoint="auto")`` gives the planner one more
# option per block call: checkpoint the whole block. The rules:
# 1. Only outermost auto blocks are options, counted in call order within
#    the step's forward (``StepPlanning.blocks_seen``); an auto block inside
#    one, or run in backward (an enclosing checkpoint regenerating), runs as
#    its enclosing region decides: plainly.
# 2. The profiled step runs every auto block plainly and records, per block
#    (``BlockRecord``), the pack indexes and positions its saved tensors took,
#    its entry time, its forward time and its tensor arguments (what a
#    checkpoint of it saves instead; ``BlockInput``, rule 6).
# 3. The solver prices the block like a tensor option (NOTE [Planner cost
#    model] in solver.py): it frees the block's saved bytes less the bytes
#    of the inputs it keeps, and costs one more forward of the block in
#    backward, plus the moves of the inputs it moves (rule 6).
# 4. A step that follows a plan checkpointing block b packs something else
#    there: the checkpoint's inputs instead of the block's tensors (the
#    block's own saves happen only in the recompute, in backward, under
#    PyTorch's checkpoint hooks or inside autograd's engine, where tiermem
#    keeps them without an index: NOTE [Pack order of checks] in runtime/hooks.py).
#    So at the block's entry the step must stand where the profile stood
#    (same block name, pack index ``start`` and position ``start_pos``;
#    else the block runs plainly and the plan's keys decide as for any
#    tensor); inside it the checkpoint's inputs take no pack index: each
#    goes where the plan's ``PlannedBlock.inputs`` say (rule 6), matched by
#    argument position and (shape, dtype, device), else kept; and on
#    its exit the step's pack index and position jump to the profile's
#    ``end`` and ``end_pos``. The rest of the step is thus numbered as in the
#    profile, checked against the same keys and fast table, and is
#    recognised as following the plan: no new profile, the closed loop
#    measures it (NOTE [Closed loop]).
# 5. A position after a checkpointed block that was, in the profile, a dedup
#    hit of a tensor saved inside it (a block whose last op saves its output,
#    ReLU, tanh, saved again by the next op) is a new tensor in a step that
#    checkpoints that block: it is kept without taking a pack index
#    (``Plan.revived_at``, counted in the plan's kept bytes), so the rest of
#    the step stays numbered as in the profile.
# 6. A checkpointed block's inputs (its tensor arguments, which the
#    checkpoint saves at the block's entry and unpacks when backward starts
#    the block's recompute: in the profile's timeline, the first unpack of a
#    tensor saved inside the block) are kept, or moved to cpu (CUDA inputs)
#    or nvme, each priced like a tensor's move over that window (solver.py).
#    The options of a block are thus "checkpoint, inputs kept" and
#    "checkpoint, inputs moved to T", ranked by price per freed byte; once a
#    block is checkpointed with its inputs kept, moving each of them is one
#    more option, so a budget below what the kept inputs need is still
#    reached. Never recompute: an input is where the recompute starts;
#    regenerating it means regenerating its producer, i.e. a larger
#    checkpointed region (wrap that instead), and its producer is usually
#    in the block before, itself checkpointed. Dedup (NOTE [Dedup] in
#    runtime/step.py) decides what is one storage, per input (``BlockInput.kind``,
#    recorded at the block's entry in the profile): a parameter stays as
#    the pack hook keeps it (not counted); a small or unmovable one is kept;
#    one whose storage an earlier tensor #j saved (``"before"``: a block
#    after one ending in ReLU) shares #j's handle, counted there, or, where
#    #j is not remembered (a kept tensor on the fast path), is kept and
#    counted as a dedup hit (no bytes); if #j is inside a checkpointed block
#    it is new and kept, counted; one the rest of the step saves again after
#    the block (``"after"``) is kept, and that later save is a dedup hit of
#    it (rule 5 does not count it again). Only ``"movable"`` inputs move, so
#    a storage is moved at most once and counted once, by the plan and by
#    the step's stats alike (the closed loop compares them).
# Checkpointing preserves the RNG state (torch.utils.checkpoint's default),
# so dropout inside a checkpointed block draws the same bits: exact.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from typing import Optional

import torch

from ..config import BudgetShare
from ..policy import Tier
from . import agree as _agree
from .hints import Hints
from .plan import Plan
from .profile import Profile, Recorder
from .rates import default_device_budget_bytes, measure_rates
from .solver import make_plan, safe_order

__all__ = ["Planner", "StepPlanning", "tracking_scope", "tracking_ops", "tracking_calls",
           "tracking_direct",
           "tracked_op_count", "direct_call_count", "tracking_shares",
           "MAX_REPLANS", "MAX_PLANS", "PROFILED_SIZES",
           "KEPT_TOLERANCE", "STALL_TOLERANCE_S"]

_log = logging.getLogger("tiermem")

MAX_REPLANS = 1
#: Plans (with their profiles) kept per Offloader (NOTE [Plans across sizes]).
MAX_PLANS = 16
#: Sizes of one structure profiled and planned each before other sizes of it
#: follow a resized plan (NOTE [Plans across sizes]).
PROFILED_SIZES = 3
KEPT_TOLERANCE = 0.05
STALL_TOLERANCE_S = 0.002


class _Rank:
    """Equal to any shape of ``n`` dimensions with at most ``max_numel``
    elements (``None``: any size). NOTE [Plans across sizes]."""

    __slots__ = ("n", "max_numel")

    def __init__(self, n: int, max_numel: Optional[int]) -> None:
        self.n, self.max_numel = n, max_numel

    def __eq__(self, other) -> bool:
        try:
            if len(other) != self.n:
                return False
        except TypeError:
            return NotImplemented
        return self.max_numel is None or _numel(other) <= self.max_numel

    def __ne__(self, other) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None

    def __repr__(self) -> str:
        most = "" if self.max_numel is None else f", at most {self.max_numel} elements"
        return f"<a shape of rank {self.n}{most}>"


def _cuda_of(records) -> Optional[str]:
    """The CUDA device of the first CUDA tensor among ``records`` (a
    profile's), as named there (``"cuda:1"``), else ``None``: the device whose
    links and free memory the planner reads (a model on ``cuda:1`` need not
    have made it the current device)."""
    for r in records:
        if r.device.startswith("cuda"):
            return r.device
    return None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_resized(plan: Plan) -> bool:
    """A resized view of another plan (NOTE [Plans across sizes])."""
    return getattr(plan, "source", None) is not None


class StepPlanning:
    """What the pack hook asks for one step under ``auto`` (``Step.planning``).

    The pack hook reads ``kept_at`` and ``plan`` directly (NOTE [Following a
    plan]): ``pos`` counts the tensors that reached the plan, dedup hits
    included; ``count`` the indices handed out (``Step.index``)."""

    __slots__ = ("planner", "plan", "recorder", "safe", "off_plan", "count", "tracks", "pos",
                 "kept_at", "step", "blocks_seen", "block_depth", "in_checkpoint", "revived",
                 "scope", "scope_ops", "scope_calls", "scope_direct", "kick", "checkpoint_inputs",
                 "gpu_waits")

    def __init__(self, planner: "Planner", plan: Optional[Plan],
                 recorder: Optional[Recorder]) -> None:
        self.planner = planner
        self.plan = plan
        self.recorder = recorder
        self.safe = planner.safe
        self.off_plan = False
        self.count = 0
        self.pos = 0
        #: The plan's per-position fast table (``Plan.kept_at``), () when none
        #: applies (profiling, safe order, or the step left its plan).
        self.kept_at = () if plan is None else plan.kept_at
        #: Positions that are new tensors because the plan checkpoints a
        #: block (``Plan.revived_at``; rule 5 of NOTE [Blocks the planner may
        #: checkpoint]); empty once positions no longer line up.
        self.revived = () if plan is None else plan.revived_at
        #: The pack index whose kept tensor starts the restores when backward
        #: unpacks it (NOTE [Restores start with backward] in runtime/hooks.py), or None.
        self.kick = None if plan is None else plan.kick_index
        #: Producer tracking is needed (profiling, safe order, or a plan that recomputes).
        self.tracks = plan is None or plan.recomputes
        #: The Step (set by the OffloadContext); auto blocks move its index.
        self.step = None
        #: NOTE [Blocks the planner may checkpoint]: outermost auto blocks
        #: entered so far, auto blocks running now, and whether a planned
        #: checkpoint is saving its inputs now.
        self.blocks_seen = 0
        self.block_depth = 0
        self.in_checkpoint = False
        #: While ``in_checkpoint``: dedup key -> tier order of the planned
        #: checkpoint's inputs (None: counted with the tensor it shares;
        #: rule 6); an input not in it is kept.
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
        self.gpu_waits: Optional[list] = (
            [] if plan is not None and plan.measured_steps == 0 else None)

    def order(self, index: int, t, nbytes: int, module: str, producers) -> tuple:
        """The tier order of tensor ``index`` (NOTE [Following a plan])."""
        self.count = index + 1
        rec = self.recorder
        if rec is not None:
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
                return plan.orders[index]
            self.kept_at = self.revived = ()   # positions no longer line up with a plan
            self.kick = None
            plan = self.plan = None if self.off_plan else self.planner.switch(keys, index, t)
            if plan is not None:
                return plan.orders[index]
            self.off_plan = True
        hints = self.planner.hints
        if hints is not None:   # the safe order, MUST answers obeyed (NOTE [Planner hints])
            hint = hints.ask(index, t, nbytes, module,
                             None if producers is None else producers.op_name(t))
            if hint is not None and hint[0].must:
                return hints.must_order(hint[0], t.device.type)
        return self.safe[t.device.type]


    def block(self, module: str, args: tuple, plain, checkpointed):
        """Run an auto block: ``plain()`` or ``checkpointed()``, as the profile
        or the plan says (NOTE [Blocks the planner may checkpoint])."""
        if self.block_depth:   # rule 1: inside an auto block
            return plain()
        b = self.blocks_seen
        self.blocks_seen = b + 1
        self.block_depth = 1
        try:
            if self.recorder is not None:
                return self.recorder.block(b, module, args, plain, self)
            plan = self.plan
            pb = None if plan is None or b >= len(plan.blocks) else plan.blocks[b]
            if (pb is None or not pb.checkpoint or pb.module != module
                    or self.count != pb.start or self.pos != pb.start_pos):
                return plain()
            self.kept_at = ()
            resized = (isinstance(self.planner.cfg.device_budget, BudgetShare)
                       if _is_resized(plan) else None)
            self.checkpoint_inputs = _input_orders(pb, args, self.step.key_of, resized)
            self.in_checkpoint = True
            try:
                out = checkpointed()
            finally:
                self.in_checkpoint = False
                self.checkpoint_inputs = {}
            # Rule 4: the rest of the step is numbered as in the profile.
            self.step.index = self.count = pb.end
            self.pos = pb.end_pos
            if self.plan is plan:
                self.kept_at, self.revived = plan.kept_at, plan.revived_at
            return out
        finally:
            self.block_depth = 0


def _input_orders(pb, args: tuple, key_of, resized: Optional[bool] = None) -> dict:
    """Dedup key -> tier order (``None``: a dedup hit counted with its saver)
    of the planned inputs of checkpointed block ``pb`` that are moved or
    shared, for the arguments ``args`` that match the plan's (shape, dtype,
    device); every other input is kept (rule 6 of NOTE [Blocks the planner
    may checkpoint]). ``resized``: ``None`` for the plan made for these
    sizes; for a resized view of it (NOTE [Plans across sizes]) an argument
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
        elif a.dim() != len(x.shape) or (not resized and a.numel() > _numel(x.shape)):
            continue
        out[key_of(a)] = (None if x.shared_with is not None
                          else tuple(Tier(t) for t in x.order))
    return out


class Planner:
    """The planner of one Offloader (``policy="auto"``); see the module docstring."""

    def __init__(self, placement, cfg, hints=None) -> None:
        self._placement = placement
        self.cfg = cfg
        self.has_nvme = Tier.NVME in placement.stores
        self.safe = {"cpu": safe_order("cpu", self.has_nvme),
                     "cuda": safe_order("cuda", self.has_nvme)}
        #: The ``hints`` callable, asked only off the plan (NOTE [Planner hints]).
        self.hints = None if hints is None else Hints(hints, self.safe)
        #: Plans by step signature (the tuple of keys; NOTE [Following a plan]).
        self.plans: dict = {}
        self._profiles: dict = {}
        #: Resized views of plans, by the keys of the plan they view.
        self._resized_plans: dict = {}
        self.current: Optional[Plan] = None
        #: Profiled steps so far.
        self.profiles = 0
        self._pending: Optional[Recorder] = None
        self._need_profile = True
        self._last = None
        self.rates = None
        #: Steps begun, and the numbers agreed with the other ranks at step
        #: AGREE_AT_STEP, or None (NOTE [Ranks agree once] in planner/agree.py).
        self.steps_begun = 0
        self.agreement: Optional[_agree.Agreement] = None

    # -- per step ----------------------------------------------------------------------
    def begin_step(self, unpack) -> StepPlanning:
        """The planning of a step starting now: profile, follow a plan, or
        (a profile's backward not run yet) the safe order. At the
        AGREE_AT_STEP-th step, under torch.distributed, first the exchange
        with the other ranks (NOTE [Ranks agree once] in planner/agree.py)."""
        self.steps_begun += 1
        if self.steps_begun == _agree.AGREE_AT_STEP and _agree.active(self.cfg.agree_ranks):
            self._agree()
        self.settle()
        if self._pending is not None:
            return StepPlanning(self, None, None)
        if self._need_profile or self.current is None:
            self._need_profile = False
            return StepPlanning(self, None, Recorder(unpack))
        return StepPlanning(self, self.current, None)

    def end_forward(self, sp: StepPlanning, stats, failed: bool) -> None:
        """The step's forward is over (``failed``: it raised)."""
        if sp.recorder is not None:
            if failed:
                self._need_profile = True
                return
            sp.recorder.end_forward(sp.step)
            self._pending = sp.recorder
            self.profiles += 1
            return
        plan = sp.plan
        if plan is None:
            if sp.off_plan:
                self._need_profile = True
            return
        if failed:   # NOTE [Steps that never reach backward], rule 2
            return
        if sp.count != len(plan.orders):   # a shorter step: a plan for it, or a profile
            plan = None if _is_resized(plan) else self.plans.get(plan.keys[:sp.count])
            if plan is None:
                self._need_profile = True
                return
        self.current = plan
        self._last = (plan, stats, sp.gpu_waits)

    def settle(self) -> Optional[Plan]:
        """Plan from a profile whose backward ran, and check the last planned
        step (NOTE [Closed loop]); returns the current plan."""
        rec = self._pending
        if rec is not None and rec.graph_dropped:
            # NOTE [Steps that never reach backward], rule 1
            _log.info("tiermem: auto: the profiled step's graph was freed without a "
                      "backward; the next step profiles again")
            self._pending = rec = None
            self._need_profile = True
        if rec is not None and rec.backward_seen and not self._awaits_ranks():
            self._pending = None
            profile = rec.finish()
            if self.agreement is not None:
                profile = self.agreement.apply(profile)
            self._profiles[profile.keys] = profile
            self.current = self._plan(profile)
        if self._last is not None:
            plan, stats, gpu_waits = self._last
            self._last = None
            self._check(plan, stats, gpu_waits)
        return self.current

    def switch(self, keys: tuple, index: int, t) -> Optional[Plan]:
        """A cached plan agreeing with ``keys[:index]`` and with ``t`` at
        ``index``; else a resized one (NOTE [Plans across sizes]); else ``None``."""
        key = (t.shape, t.dtype, t.device)
        for other, plan in self.plans.items():
            if (len(other) > index and other[index] == key
                    and other[:index] == keys[:index]):
                self._touch(other)
                return plan
        return self._resized(keys, index, t)

    def _resized(self, keys: tuple, index: int, t) -> Optional[Plan]:
        share = isinstance(self.cfg.device_budget, BudgetShare)
        n = t.numel()
        best, alike = None, 0
        for other, plan in self.plans.items():
            if len(other) <= index:
                continue
            shape, dtype, device = other[index]
            if dtype is not t.dtype or device != t.device or len(shape) != t.dim():
                continue
            if any(len(a[0]) != len(b[0]) or a[1] is not b[1] or a[2] != b[2]
                   for a, b in zip(other[:index], keys[:index])):
                continue
            alike += 1
            planned = _numel(shape)
            if not share and planned < n:
                continue
            score = abs(planned - n)
            if best is None or score < best[0]:
                best = (score, other, plan)
        if best is None or alike < PROFILED_SIZES:
            return None   # profile this size (the next step does)
        _, other, plan = best
        self._touch(other)
        resized = self._resized_plans.get(other)
        if resized is None or resized.source is not plan:
            resized = copy.copy(plan)
            resized.source = plan
            resized.notes = list(plan.notes) + [
                "followed by steps of other sizes with this plan's structure (NOTE [Plans "
                "across sizes]); the figures are those of the profiled sizes"]
            ranks = tuple(_Rank(len(k[0]), None if share else _numel(k[0])) for k in plan.keys)
            resized.keys = tuple((r, k[1], k[2]) for r, k in zip(ranks, plan.keys))
            resized.kept_at = tuple(
                None if e is None else (e[0], ranks[e[0] if e[0] >= 0 else ~e[0]]) + e[2:]
                for e in plan.kept_at)
            self._resized_plans[other] = resized
        return resized

    def _touch(self, keys: tuple) -> None:
        """``keys``' plan was just used: last to be dropped (NOTE [Plans across sizes])."""
        plan = self.plans.pop(keys, None)
        if plan is not None:
            self.plans[keys] = plan

    def _remember(self, keys: tuple, plan: Plan) -> None:
        self.plans.pop(keys, None)
        self.plans[keys] = plan
        while len(self.plans) > MAX_PLANS:
            oldest = next(iter(self.plans))
            if self.current is not None and oldest == self.current.keys:
                self._touch(oldest)
                oldest = next(iter(self.plans))
            del self.plans[oldest]
            self._profiles.pop(oldest, None)
            self._resized_plans.pop(oldest, None)

    # -- agreeing with the other ranks (NOTE [Ranks agree once] in planner/agree.py) ----
    def _awaits_ranks(self) -> bool:
        """The first plan waits for the exchange of step AGREE_AT_STEP."""
        return self.steps_begun < _agree.AGREE_AT_STEP and _agree.active(self.cfg.agree_ranks)

    def _agree(self) -> None:
        import torch.distributed as dist
        rec = self._pending
        records = [] if rec is None else rec.records
        cuda = None
        try:   # whatever fails here, this rank must reach the exchange
            cuda = _cuda_of(records)
            rates = self._measure_rates(cuda) if records else None
            default = (default_device_budget_bytes("cuda" if cuda else "cpu", device=cuda)
                       if records and self.cfg.device_budget is None else None)
            profile = rec.finish() if rec is not None and rec.backward_seen else None
        except Exception as e:
            _log.warning("tiermem: auto: this rank's figures could not be measured (%s: %s); "
                         "it agrees with the other ranks without them", type(e).__name__, e)
            rates = default = profile = None
        nvme = self._placement.stores.get(Tier.NVME)
        row = _agree.local_row(dist.get_rank(), rates, self.cfg.device_budget, default,
                               self._placement.cpu_budget_bytes,
                               None if nvme is None else nvme.arena.budget_bytes, profile)
        self.agreement = _agree.exchange(row, profile, cuda)
        if self.agreement is not None:
            if self.agreement.rates is not None:
                self.rates = dataclasses.replace(self.agreement.rates, disk_engine=(
                    None if rates is None else rates.disk_engine))
            _log.info("tiermem: auto: %s", self.agreement.describe(profile))

    def _measure_rates(self, cuda: Optional[str]):
        return measure_rates(self._placement.stores.get(Tier.NVME), cuda=cuda or False)

    # -- planning ----------------------------------------------------------------------
    def _budget(self, profile: Profile) -> tuple:
        a = self.agreement
        setting = self.cfg.device_budget if a is None else a.device_budget
        agreed = "" if a is None else f", smallest of {a.ranks} ranks"
        if isinstance(setting, BudgetShare):
            return int(setting.fraction * profile.baseline_bytes), str(setting) + agreed
        if setting is not None:
            return setting, ("device_budget" if a is None or self.cfg.device_budget is not None
                             else "default: free memory") + agreed
        cuda = _cuda_of(profile.records)
        return (default_device_budget_bytes("cuda" if cuda else "cpu", device=cuda),
                "default: free memory")

    def _plan(self, profile: Profile, target: Optional[int] = None, rate_factor: float = 1.0,
              replans: int = 0, reason: str = "") -> Plan:
        placement = self._placement
        if self.rates is None:
            self.rates = self._measure_rates(_cuda_of(profile.records))
        rates = self.rates if rate_factor == 1.0 else self.rates.scaled(rate_factor)
        budget, setting = self._budget(profile)
        nvme = placement.stores.get(Tier.NVME)
        cpu_room, nvme_room = (placement.cpu_budget_bytes,
                               None if nvme is None else nvme.arena.budget_bytes)
        if self.agreement is not None:   # the smallest of every rank's
            cpu_room, nvme_room = self.agreement.cpu_budget_bytes, self.agreement.nvme_budget_bytes
        plan = _priced_plan(profile, rates, functools.partial(
            make_plan, profile, rates, budget if target is None else target, setting,
            has_nvme=self.has_nvme, cpu_budget_bytes=cpu_room,
            nvme_budget_bytes=nvme_room, replans=replans, replan_reason=reason,
            prefetch_bytes=self.cfg.prefetch_bytes))
        plan.budget_bytes = budget
        plan.follow(profile.keys, profile.positions)
        plan.rate_factor = rate_factor
        plan.target_bytes = budget if target is None else target
        if target is not None and target < budget:
            plan.notes.append(f"planned to {target} bytes (budget lowered by the measured "
                              "overshoot)")
        if self.agreement is not None:
            plan.notes.append(self.agreement.describe(profile))
        for note in plan.notes:
            if note.startswith("budget not reachable"):
                _log.warning("tiermem: auto: %s (device_budget %s)", note, setting)
        self._remember(profile.keys, plan)
        return plan

    def _check(self, plan: Plan, stats, gpu_waits: Optional[list] = None) -> None:
        kept = stats.bytes_by_tier[Tier.KEEP.value]
        stall = stats.stall_seconds
        if gpu_waits:   # NOTE [Stall on the GPU's timeline]
            stall = gpu_stall_seconds(gpu_waits)
        plan.measured_kept_bytes = kept
        plan.measured_stall_s = stall
        plan.measured_steps += 1
        if (plan.replans >= MAX_REPLANS or plan.measured_steps > 1 or _is_resized(plan)
                or self.plans.get(plan.keys) is not plan):
            return   # only a plan's first measured step may correct it
        target = getattr(plan, "target_bytes", plan.budget_bytes)
        factor = plan.rate_factor
        why = []
        over = kept - plan.predicted_kept_bytes
        if kept > plan.budget_bytes * (1 + KEPT_TOLERANCE) and over > 0:
            target = max(0, target - over)
            why.append(f"kept {kept} bytes, predicted {plan.predicted_kept_bytes}")
        if stall > plan.predicted_stall_s + max(STALL_TOLERANCE_S, plan.predicted_stall_s / 2):
            factor /= 2
            why.append(f"stall {stall * 1e3:.2f} ms, predicted "
                       f"{plan.predicted_stall_s * 1e3:.2f} ms")
        if not why:
            return
        profile = self._profiles[plan.keys]
        new = self._plan(profile, target, factor, plan.replans + 1, "; ".join(why))
        if self.current is plan:
            self.current = new


def gpu_stall_seconds(waits: list) -> float:
    """Seconds the consumers' streams waited for restores: the sum over
    ``waits`` ((start, end) CUDA timing events, NOTE [Stall on the GPU's
    timeline]); waits for the last of them to complete."""
    for _, end in waits:
        end.synchronize()
    return sum(start.elapsed_time(end) for start, end in waits) / 1e3


def _with_tracking(plan: Plan, profile: Profile, rates) -> Plan:
    """``plan`` with its tracking scope, op names, calls and price set."""
    plan.tracking_scope = tracking_scope(plan, profile)
    plan.tracking_ops = tracking_ops(plan, profile)
    plan.tracking_calls = tracking_calls(plan, profile)
    plan.tracking_direct = tracking_direct(plan, plan.tracking_calls, profile)
    plan.tracked_ops, plan.direct_calls = _tracked_counts(plan, profile)
    plan.predicted_tracking_s = (
        plan.tracked_ops * (getattr(rates, "track_op_s", 0.0) or 0.0)
        + plan.direct_calls * (getattr(rates, "track_call_s", 0.0) or 0.0))
    return plan


def _prefers_recompute(record) -> bool:
    """Its hint asks for recompute first (a MUST is obeyed anyway; a PREFER
    hint keeps its recompute option in both solves of NOTE [Tracking
    priced], rule 3)."""
    hint = record.hint
    return hint is not None and len(hint[0]) > 0 and hint[0][0] is Tier.RECOMPUTE


def _unreachable(plan: Plan) -> bool:
    return any(n.startswith("budget not reachable") for n in plan.notes)


def _priced_plan(profile: Profile, rates, make) -> Plan:
    """``make(tracking_s=..., no_recompute=...)``'s plan, tracking priced (NOTE
    [Tracking priced], rules 2 and 3)."""
    shares = tracking_shares(profile, rates)
    plan = _with_tracking(make(tracking_s=shares), profile, rates)
    if not plan.predicted_tracking_s:
        return plan
    chosen = frozenset(t.index for t in plan.tensors
                       if t.tier == Tier.RECOMPUTE.value and not t.must)
    if not chosen:
        return plan
    other = _with_tracking(make(tracking_s=shares, no_recompute=frozenset(
        r.index for r in profile.records if not _prefers_recompute(r))), profile, rates)
    cost, other_cost = plan.predicted_step_cost_s, other.predicted_step_cost_s
    whole = (f" and {plan.direct_calls} torch calls recorded whole" if plan.direct_calls
             else "")
    what = (f"recomputing {len(chosen)} tensors needs producer tracking over "
            f"{plan.tracked_ops} ops{whole} per forward (predicted "
            f"{plan.predicted_tracking_s * 1e3:.2f} ms)")
    if _unreachable(other):   # fewer bytes freed: the budget needs them
        plan.notes.append(f"tracking: {what}; the budget is not reachable without them")
        return plan
    if other_cost >= cost:
        plan.notes.append(f"tracking: {what}; worth it: without them the predicted step "
                          f"cost is {other_cost * 1e3:.2f} ms, with them {cost * 1e3:.2f} ms")
        return plan
    other.notes.append(f"tracking: the plan recomputing them was declined: {what}; "
                       f"predicted step cost {cost * 1e3:.2f} ms with them, "
                       f"{other_cost * 1e3:.2f} ms without")
    return other


def _recipe_pairs(plan: Plan, profile: Profile, field: str) -> Optional[list]:
    """The profile's ``field`` (``recipe_ops``, ``recipe_calls``) of every
    tensor ``plan`` recomputes, joined; ``None`` if one was not recorded."""
    pairs: list = []
    for record, order in zip(profile.records, plan.orders):
        if order[0] is not Tier.RECOMPUTE:
            continue
        got = getattr(record, field)
        if not got:
            return None
        pairs.extend(got)
    return pairs


def tracking_scope(plan: Plan, profile: Profile) -> Optional[frozenset]:
    """The modules a step following ``plan`` tracks producers in: those that ran
    the recipe ops of the tensors it recomputes, as its profile recorded them
    (``""``: outside every module; empty: it recomputes nothing); ``None``
    (the whole forward) when one was not recorded. NOTE [Scoped tracking] in
    tracking/modules.py."""
    names: set = set()
    for record, order in zip(profile.records, plan.orders):
        if order[0] is not Tier.RECOMPUTE:
            continue
        modules = record.recipe_modules
        if not modules:
            return None
        names.update(modules)
    return frozenset(names)


def tracking_ops(plan: Plan, profile: Profile) -> Optional[dict]:
    """Per module of :func:`tracking_scope`, the names of the ops the recipes
    of the tensors ``plan`` recomputes ran there, as its profile recorded them;
    ``None`` (every recomputable op) when one was not recorded. NOTE
    [Recording only what recipes use] in tracking/producers.py."""
    pairs = _recipe_pairs(plan, profile, "recipe_ops")
    if pairs is None:
        return None
    ops: dict = {}
    for module, name in pairs:
        ops.setdefault(module, set()).add(name)
    return {m: frozenset(n) for m, n in ops.items()}


def tracking_calls(plan: Plan, profile: Profile) -> Optional[dict]:
    """Per module of :func:`tracking_scope`, the names of the torch calls the
    ops of the recipes of the tensors ``plan`` recomputes ran in there, as its
    profile recorded them (``None`` for a module where one ran outside every
    torch call: all of it is tracked); ``None`` when a recipe's calls were not
    recorded. NOTE [Tracking inside torch calls] in tracking/modules.py."""
    pairs = _recipe_pairs(plan, profile, "recipe_calls")
    if pairs is None:
        return None
    calls: dict = {}
    for module, call in pairs:
        if call is None:
            calls[module] = None
        elif module not in calls:
            calls[module] = {call}
        elif calls[module] is not None:
            calls[module].add(call)
    return {m: None if c is None else frozenset(c) for m, c in calls.items()}


def tracking_direct(plan: Plan, calls: Optional[dict], profile: Profile) -> Optional[dict]:
    """Of ``calls`` (``plan``'s :func:`tracking_calls`), per module, those the
    profile saw run one recomputable op each, by that op's name,
    and whose returned tensors hold every output of theirs that ``plan``'s
    recipes use: a step records them whole (NOTE [Calls recorded whole] in
    tracking/producers.py); ``None`` when ``calls`` is."""
    if calls is None:
        return None
    single = profile.single_op_calls
    unreturned: set = set()
    for record, order in zip(profile.records, plan.orders):
        if order[0] is Tier.RECOMPUTE:
            unreturned.update(record.recipe_unreturned)
    direct: dict = {}
    for module, names in calls.items():
        if names is None:
            continue
        got = {c: single[(module, c)] for c in names
               if (module, c) in single and (module, c) not in unreturned}
        if got:
            direct[module] = got
    return direct


def _pair_ops(profile: Profile, module: Optional[str], call: Optional[str]) -> int:
    """Ops a step tracking (``module``, ``call``) tracks: ``call`` ``None``: all
    of ``module``; ``module`` ``None``: every op of the forward (rule 1 of NOTE
    [Tracking priced])."""
    ops = profile.call_ops
    if module is None:
        return sum(ops.values())
    if call is None:
        return sum(n for (m, _), n in ops.items() if m == module)
    return ops.get((module, call), 0)


def _record_pairs(record) -> tuple:
    """The (module, call) pairs ``record``'s recipe needs tracked; ``((None,
    None),)``: the whole forward (its modules were not recorded)."""
    if record.recipe_calls:
        return tuple(record.recipe_calls)
    if record.recipe_modules:
        return tuple((m, None) for m in record.recipe_modules)
    return ((None, None),)


def _tracked_counts(plan: Plan, profile: Profile) -> tuple:
    """``(tracked_op_count, direct_call_count)`` of ``plan``, in one pass."""
    if not profile.call_ops:
        return 0, 0
    scope = tracking_scope(plan, profile)
    if scope is None:
        return _pair_ops(profile, None, None), 0
    calls = tracking_calls(plan, profile)
    direct = tracking_direct(plan, calls, profile) or {}
    ops = whole_calls = 0
    for module in scope:
        names = None if calls is None else calls.get(module)
        if names is None:
            ops += _pair_ops(profile, module, None)
            continue
        whole = direct.get(module, {})
        for c in names:
            if c in whole:
                whole_calls += _pair_ops(profile, module, c)
            else:
                ops += _pair_ops(profile, module, c)
    return ops, whole_calls


def tracked_op_count(plan: Plan, profile: Profile) -> int:
    """Aten ops per forward a step following ``plan`` hands the dispatch mode,
    as the profile counted them (0: it recomputes nothing, or nothing was
    counted); the calls it records whole are :func:`direct_call_count`'s.
    NOTE [Tracking priced]."""
    return _tracked_counts(plan, profile)[0]


def direct_call_count(plan: Plan, profile: Profile) -> int:
    """Torch calls per forward a step following ``plan`` records whole (each
    one op in the profile: NOTE [Calls recorded whole] in tracking/producers.py)."""
    return _tracked_counts(plan, profile)[1]


def tracking_shares(profile: Profile, rates) -> dict:
    """Pack index -> seconds of tracking charged to recomputing it (rule 2 of
    NOTE [Tracking priced]); empty when nothing was counted or tracking is
    free here."""
    per_op = getattr(rates, "track_op_s", 0.0) or 0.0
    if not profile.call_ops or per_op <= 0:
        return {}
    per_call = getattr(rates, "track_call_s", 0.0) or 0.0
    single = profile.single_op_calls
    users: dict = {}
    for r in profile.records:
        if r.recomputable:
            for pair in set(_record_pairs(r)):
                users[pair] = users.get(pair, 0) + 1
    shares = {}
    for r in profile.records:
        if r.recomputable:
            shares[r.index] = sum(
                _pair_ops(profile, m, c) * (per_call if (m, c) in single else per_op)
                / users[(m, c)] for m, c in set(_record_pairs(r)))
    return shares
