"""Records one profiled step into a :class:`~tiermem.planner.profile.Profile`:
the :class:`Recorder`, a :class:`~tiermem.runtime.contract.StepObserver`.

A :class:`Recorder` observes a step run under the *safe* placement (see
NOTE [Profile under the safe order] in planner/runtime.py). The step's planning
records each tensor that reaches the policy (:meth:`Recorder.record`); the
step reports the handle the tiers gave (:meth:`Recorder.placed`) and dedup
hits, and its unpack hook is :meth:`Recorder.unpack`, which stamps the first
unpack of each handle and times the regeneration of recomputed ones. Only
profiled steps pay for this: other steps have no observer of it.

Times are ``time.perf_counter()`` seconds from the step's start (the context's
entry), on CUDA read once the compute stream is done: NOTE [Profile times on
a GPU]."""

# NOTE [Profile times on a GPU]
# On CUDA the host runs ahead of the kernels: a pack's host time is when its op
# was *launched*, a regeneration's host time only its launches, and a restore's
# wait a stream wait the host never sees. So once a profiled step has seen a
# CUDA tensor, each of its time stamps (a pack, a first unpack and the end of
# its regeneration or restore, a leaf's use, the end of the forward) first
# synchronizes the current stream of that tensor's device (the compute stream,
# not the copy side streams, whose moves would otherwise be timed as blocking;
# in backward, autograd's stream): the stamp is when the GPU has done the work
# before it. The step starts with the current device's stream synchronized when
# CUDA is initialised (the last step's optimizer kernels are not this step's).
# The GPU then idles while the host launches, so the timeline is the GPU's
# stretched by launch time: windows a little longer, regeneration a little
# dearer, both on the safe side. Only profiled steps wait; blocks' forward
# times are CUDA events.

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any, Dict, List, Optional

import torch

from ..policy import Tier
from ..runtime.contract import StepObserver
from ..tiers.keep import Kept
from ..tiers.recompute import RecomputeHandle
from .profile import BlockInput, BlockRecord, Profile, TensorRecord, pool_repeated

__all__ = ["Recorder"]


def _is_param(t) -> bool:
    """A parameter, a view of one, or a leaf that requires grad: what the pack
    hook never moves (``step.is_stable_param``'s test; this layer does not
    import the step's)."""
    base = t._base if t._base is not None else t
    return (base.requires_grad and base.is_leaf) or issubclass(type(base), torch.nn.Parameter)


def _dedup_key(step, t) -> Optional[tuple]:
    """``t``'s dedup key (NOTE [Dedup] in runtime/step.py) if the pack hook could
    move it (a strided cpu or cuda ``torch.Tensor``), else None."""
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type not in (
            "cpu", "cuda"):
        return None
    return step.key_of(t)


class Recorder(StepObserver):
    """Records one profiled step (see the module docstring). Forward calls
    come from the pack hook's thread; :meth:`unpack` from autograd's.
    ``active``: false once the step's planning stopped profiling it (passed
    over): the step's later events are not recorded."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.stats = None
        self.active = True
        self._unpack = self._leaf_unpack = None
        self.records: List[TensorRecord] = []
        self.keys: list = []
        #: Per pack position (NOTE [Planned keeps by position] in planner/runtime.py):
        #: ``i`` a new tensor of index ``i``; ``~i`` a dedup hit of index ``i``;
        #: ``None`` a dedup hit of a handle this step did not record.
        self.positions: list = []
        self._by_handle: Dict[int, int] = {}
        self._recompute_handles: set = set()
        #: Pack index -> ``RecomputeHandle.call_records`` of its recipe, read
        #: at ``finish`` (``recipe_unreturned``).
        self._call_records: dict = {}
        self._kept_before = 0
        self._inputs_before = 0
        self._recorded_kept = 0
        self.forward_end_s: Optional[float] = None
        self.fixed_kept_bytes = 0
        self.measured_kept_bytes = 0
        self.first_unpack_s: Optional[float] = None
        self.last_unpack_s: Optional[float] = None
        self.blocks: List[BlockRecord] = []
        #: Seconds spent placing tensors (from ``record`` to ``placed``) so far.
        self.placing_s = 0.0
        self._record_t = 0.0
        #: CUDA blocks: (start, end) timing events by block index.
        self._block_events: Dict[int, tuple] = {}
        #: The device of the first CUDA tensor recorded: its current stream
        #: is synchronized at each time stamp (NOTE [Profile times on a GPU]).
        self._cuda: Optional[torch.device] = None
        #: Records whose first unpack is running now, innermost last (a
        #: regeneration unpacks its recipe's inputs).
        self._reading: List[int] = []
        #: The profiled step's producer mode's ``op_counts`` (NOTE [Tracking
        #: priced] in planner/runtime.py; set at ``started``).
        self.op_counts: Optional[dict] = None
        #: The profiled step's producer mode's ``single_op_calls`` (NOTE
        #: [Calls recorded whole] in tracking/producers.py; set at ``started``).
        self.single_op_calls: Optional[dict] = None
        #: Weak references to the handles of the recorded tensors, the step
        #: (set at ``started``), and whether a handle could not be
        #: watched: ``graph_dropped`` (NOTE [Steps that never reach backward]
        #: in planner/runtime.py).
        self._handle_refs: list = []
        self._step_ref = None
        self._unwatched = False

    # -- step events (StepObserver) ----------------------------------------------------
    def started(self, step) -> None:
        """The step (watched weakly) starts now: its stats, and its producer
        mode's op counts and calls recorded whole, are the profile's."""
        self.stats = step.stats
        self._step_ref = weakref.ref(step)
        producers = step.producers
        if producers is not None:
            producers.op_counts = self.op_counts = {}
            self.single_op_calls = producers.single_op_calls
        if torch.cuda.is_initialized():   # NOTE [Profile times on a GPU]
            torch.cuda.current_stream().synchronize()
        self.t0 = time.perf_counter()

    def _now(self) -> float:
        """``time.perf_counter()``, once the compute stream of a CUDA step has
        done its work so far: NOTE [Profile times on a GPU]."""
        if self._cuda is not None:
            torch.cuda.current_stream(self._cuda).synchronize()
        return time.perf_counter()

    # -- forward -------------------------------------------------------------------
    def record(self, index: int, t, nbytes: int, module: str, op: Optional[str],
               hint: Optional[tuple] = None) -> None:
        """Tensor ``index`` is about to be placed (``hint``: see TensorRecord)."""
        if self._cuda is None and t.is_cuda:
            self._cuda = t.device
        now = self._now()
        self._record_t = now
        self.records.append(TensorRecord(
            index, module, op, tuple(t.shape), str(t.dtype).replace("torch.", ""),
            str(t.device), nbytes, now - self.t0, hint=hint))
        self.keys.append((t.shape, t.dtype, t.device))
        self.positions.append(index)
        by = self.stats.bytes_by_tier
        self._kept_before = by[Tier.KEEP.value]
        self._inputs_before = self.stats.recompute_input_bytes

    def wrap_unpack(self, unpack):
        self._unpack = unpack
        return self.unpack

    def wrap_leaf_unpack(self, unpack):
        self._leaf_unpack = unpack
        return self.leaf_unpack

    def placed(self, index: int, handle: Any) -> None:
        """Tensor ``index`` got ``handle`` (the put just made)."""
        if not self.active:
            return
        self.placing_s += time.perf_counter() - self._record_t
        rec = self.records[index]
        kept_delta = self.stats.bytes_by_tier[Tier.KEEP.value] - self._kept_before
        self._recorded_kept += kept_delta
        if type(handle) is RecomputeHandle:
            rec.profile_tier = Tier.RECOMPUTE.value
            rec.recomputable = True
            rec.input_kept_bytes = kept_delta   # its recipe's inputs left on the device
            rec.recipe_modules = handle.modules
            rec.recipe_ops = handle.ops
            rec.recipe_calls = handle.calls
            if handle.call_records:   # NOTE [Calls recorded whole] in tracking/producers.py
                self._call_records[index] = handle.call_records
            self._recompute_handles.add(id(handle))
        elif type(handle) is Kept:
            rec.profile_tier = Tier.KEEP.value
        else:
            rec.profile_tier = handle.store.tier.value
        self._by_handle[id(handle)] = index
        try:   # NOTE [Steps that never reach backward] in planner/runtime.py
            self._handle_refs.append(weakref.ref(handle))
        except TypeError:
            self._unwatched = True

    def hit(self, handle: Any) -> None:
        """The tensor at the next pack position was a dedup hit of ``handle``."""
        if not self.active:
            return
        index = self._by_handle.get(id(handle))
        self.positions.append(None if index is None else ~index)

    @property
    def graph_dropped(self) -> bool:
        """The step's graph is gone with no unpack seen: its step object has
        died, or every handle it recorded has (and each could be watched).
        NOTE [Steps that never reach backward] in planner/runtime.py."""
        if self.backward_seen or self.forward_end_s is None:
            return False
        step = self._step_ref
        if step is not None and step() is None:
            return True
        refs = self._handle_refs
        return bool(refs) and not self._unwatched and all(r() is None for r in refs)

    def end_forward(self) -> None:
        """The forward is over."""
        self.forward_end_s = self._now() - self.t0
        kept = self.stats.bytes_by_tier[Tier.KEEP.value]
        self.measured_kept_bytes = kept
        self.fixed_kept_bytes = max(0, kept - self._recorded_kept)

    def block(self, index: int, module: str, args: tuple, run, planning, step):
        """Run auto block ``index`` of ``step`` plainly (``run()``) and record
        it; the pack indexes and positions are read from ``planning``."""
        seen = set()
        input_bytes = 0
        cuda = None   # the device of the first CUDA input: its stream is timed
        found = []   # (arg position, tensor, dedup key, earlier saver's index or None)
        for k, a in enumerate(args):
            if isinstance(a, torch.Tensor) and id(a) not in seen:
                seen.add(id(a))
                input_bytes += a.nbytes
                if cuda is None and a.is_cuda:
                    cuda = a.device
                key = _dedup_key(step, a)
                before = None if key is None else step.find(key)
                found.append((k, a, key, None if before is None
                              else self._by_handle.get(id(before), -1)))
        start, start_pos = planning.count, planning.pos
        placing = self.placing_s
        kept0, recorded0 = self.stats.bytes_by_tier[Tier.KEEP.value], self._recorded_kept
        events = None
        if cuda is not None and torch.cuda.is_available():
            # The GPU's time, read in finish(), after backward: the forward
            # is never synchronized (the host's time is only the launches').
            # On the inputs' device's current stream, which need not be the
            # current device's.
            stream = torch.cuda.current_stream(cuda)
            events = (torch.cuda.Event(enable_timing=True),
                      torch.cuda.Event(enable_timing=True), stream)
            events[0].record(stream)
        t0 = time.perf_counter()
        out = run()
        # Less the time the profile's own placements took in it (recipes,
        # moves): a checkpoint's recompute pays none of that.
        forward_s = time.perf_counter() - t0 - (self.placing_s - placing)
        if events is not None:
            events[1].record(events[2])
            self._block_events[index] = events[:2]
        inputs = tuple(self._input(step, k, a, key, before, start, planning.count)
                       for k, a, key, before in found)
        fixed = ((self.stats.bytes_by_tier[Tier.KEEP.value] - kept0)
                 - (self._recorded_kept - recorded0))
        self.blocks.append(BlockRecord(index, module, start, planning.count, start_pos,
                                       planning.pos, max(forward_s, 0.0), input_bytes,
                                       t0 - self.t0, inputs, max(0, fixed),
                                       getattr(run, "must_inside", None)))
        return out

    def _input(self, step, k: int, a, key, before, start: int, end: int) -> BlockInput:
        """The record of argument ``k`` of a block that saved pack indexes
        ``start`` to ``end - 1`` (``before``: the index of the tensor that
        held its storage at the block's entry, -1 unrecorded, or None)."""
        kind, saved_as = "movable", None
        if _is_param(a):
            kind = "param"
        elif key is None or not a.nbytes or a.nbytes < step.min_offload_bytes:
            kind = "small" if key is not None else "unmovable"
        elif before is not None:
            kind, saved_as = ("before", before) if before >= 0 else ("unmovable", None)
        else:
            handle = step.find(key)
            i = None if handle is None else self._by_handle.get(id(handle))
            saved_as = i if i is not None and start <= i < end else None
        return BlockInput(k, tuple(a.shape), str(a.dtype).replace("torch.", ""),
                          str(a.device), a.nbytes, kind, saved_as)

    def _mark_saved_after(self) -> None:
        """Inputs whose inside save was hit again after the block (a dedup
        hit outside it) are saved by the rest of the step: ``"after"``."""
        positions = self.positions
        for bi, b in enumerate(self.blocks):
            marks = {~p for p in positions[b.end_pos:] if p is not None and p < 0}
            if any(x.kind == "movable" and x.saved_as in marks for x in b.inputs):
                self.blocks[bi] = dataclasses.replace(b, inputs=tuple(
                    dataclasses.replace(x, kind="after")
                    if x.kind == "movable" and x.saved_as in marks else x for x in b.inputs))

    # -- backward ------------------------------------------------------------------
    def unpack(self, handle: Any):
        """The unpack hook of a profiled step: the plain unpack, timed."""
        now = self._now() - self.t0
        if self.first_unpack_s is None:
            self.first_unpack_s = now
        index = self._by_handle.get(id(handle))
        if index is None or self.records[index].first_use_s is not None:
            out = self._unpack(handle)
        else:
            rec = self.records[index]
            rec.first_use_s = now
            outermost = not self._reading
            self._reading.append(index)
            start = time.perf_counter()
            try:
                out = self._unpack(handle)
            finally:
                self._reading.pop()
            took = self._now() - start
            if id(handle) in self._recompute_handles:
                rec.recompute_s = took
            if outermost:
                rec.unpack_s = took
        self.last_unpack_s = self._now() - self.t0
        return out

    def leaf_unpack(self, handle: Any):
        """The unpack of a recipe's leaf in a profiled step (``Step.unpack``):
        the plain unpack; a saved tensor that a regeneration reads before
        autograd first unpacks it gets ``leaf_use_s`` and ``leaf_reader``."""
        index = self._by_handle.get(id(handle))
        if index is not None and self._reading:
            rec = self.records[index]
            if rec.first_use_s is None and rec.leaf_use_s is None:
                rec.leaf_use_s = self._now() - self.t0
                rec.leaf_reader = self._reading[-1]
        return self._leaf_unpack(handle)

    @property
    def backward_seen(self) -> bool:
        return self.first_unpack_s is not None

    def finish(self) -> Profile:
        """The profile, once backward has run (or as far as it has)."""
        if self.forward_end_s is None:
            self.end_forward()
        for i, (start, end) in self._block_events.items():
            end.synchronize()   # long done: backward has run
            self.blocks[i] = dataclasses.replace(
                self.blocks[i], forward_s=start.elapsed_time(end) / 1e3)
        self._block_events = {}
        for index, found in self._call_records.items():   # the calls have returned
            self.records[index].recipe_unreturned = tuple(sorted(
                {(m, c) for m, c, r in found if not r.returned}))
        self._call_records = {}
        self._mark_saved_after()
        pool_repeated(self.records, self.blocks)
        return Profile(self.records, tuple(self.keys), self.fixed_kept_bytes,
                       self.forward_end_s, self.first_unpack_s, self.last_unpack_s,
                       self.measured_kept_bytes, self.stats.as_dict(),
                       tuple(self.positions), tuple(self.blocks),
                       dict(self.op_counts or {}),
                       {k: v for k, v in (self.single_op_calls or {}).items() if v})
