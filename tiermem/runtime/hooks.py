"""The saved-tensor hooks: pack (a tensor -> a handle) and unpack (a handle -> the tensor).

Pack (:class:`Packer`, one per step) decides what is never moved, finds
tensors this step stored already (NOTE [Dedup] in runtime/step.py), asks the policy
for a tier order and hands the tensor to :class:`~tiermem.runtime.placement.Placement`.
Unpack (:func:`unpack`, one function for every handle kind) checks a kept
tensor's version, or takes a tier's handle through the step's prefetcher
(count the use, take the restore, top the window up) and waits outside its
lock. Nothing else lives here."""

# NOTE [Pack order of checks]
# The pack hook runs for every saved tensor, so its checks are ordered from
# cheapest to dearest and stop at the first that decides: non-strided tensors,
# parameters/buffers (before size, so that stats never count a parameter as an
# activation), small tensors, a fixed "keep" policy, a tensor an auto plan keeps
# (NOTE [Planned keeps by position] in planner/runtime.py), unmovable tensors, then
# the dedup lookup, and only then the policy (a callable policy gets a TensorInfo;
# a named one needs none). Kept tensors are never deduplicated: keeping a
# tensor twice costs nothing.
#
# Inside backward (a checkpoint re-running its forward, or a user's backward
# within the context) tensors are kept: what backward regenerates is consumed
# at once and is never offloaded again.

# NOTE [Sharded parameters]
# Under FSDP2 a module's parameters are DTensor shards; before a block's forward
# each is all-gathered into an *unsharded* ``nn.Parameter`` whose storage is freed
# (``resize_(0)``) after it and refilled, same storage and version, in backward:
# 1. The root's parameters are noted through their local tensors, never through
#    the DTensor, whose storage Python cannot see.
# 2. Unsharded parameters and their views are kept by type, never moved nor
#    deduplicated: the kept handle shares the storage, so it reads what FSDP2
#    gathers again, and the in-place check passes (version preserved).
# 3. A recipe input whose storage was resized since its op ran counts as gone
#    (``producers.Ref.alive``): no recipe is planned on it.
# 4. In a sharded model recipes hold no parameter as it is (``Step.is_stable_param``):
#    FSDP2 may free it, or refill it mid-forward; small ones are copied, others stored.
# 5. Aliases that are not parameters: NOTE [Aliases of unsharded parameters].
# Saved DTensors (tensor parallelism) are kept as they are: no tier moves a subclass.

# NOTE [Aliases of unsharded parameters]
# A saved tensor sharing an unsharded parameter's storage without being a
# parameter or a view of one (``weight.detach()``, ``.data``) may be moved,
# and FSDP2 frees that storage after the forward whatever holds it. So when
# parameters may be freed every move out guards its source
# (``MovingStore._guard_freed_source``): on CUDA its block is ``record_stream``-ed
# on the copy's side stream (an exception to rule 1 of NOTE [Stream lifetime]);
# on the CPU the copy is waited for at launch. A launch after the free finds a
# storage of size 0: the move fails and the tensor is kept, refilled for
# backward. Such an alias has its parameter's dedup key, but dedup takes only a
# hit of the very storage object (NOTE [Dedup] in runtime/step.py), recipes
# never take an alias's handle for a parameter argument (``Step.lookup``), and
# a dropped tensor still alive is returned as it is only while its storage
# still has its memory (``RecomputeHandle.data_ptr``).

# NOTE [Restores start with backward]
# The prefetcher advances on unpacks of moved tensors, and backward usually
# unpacks kept tensors first, whose unpack must not look at the prefetcher; so
# the first moved tensor backward needs would be read on demand. Instead a step
# following a plan packs the kept tensor its profile saw unpacked first, before
# every moved one (``Plan.kick_index``), as a :class:`~tiermem.tiers.keep.KickKept`:
# its first unpack calls ``Prefetcher.kick``, starting restores from the moved
# tensors packed before it down, within the window, as an unpack just above them
# would, then returns the tensor as ``Kept`` does. Being in the step's own graph,
# it fires when that step's backward runs, whatever forwards ran between (1F1B).
# (1) Only autograd holds the KickKept; dedup and recipes hold its inner Kept.
# (2) It kicks once per step, only if no moved tensor was unpacked before.
# (3) A restore whose move out has not landed stops the kick, as it stops advance.
# (4) A step that leaves its plan drops the kick. (5) Steps following no plan:
# NOTE [Kicks without a plan]. A kick only starts restores earlier: exact.

# NOTE [Kicks without a plan]
# A step following no plan (a fixed or callable policy) has no profile to say
# which kept tensor backward unpacks first. So once it has moved a tensor
# (``Packer.kick_armed``) every later kept pack is a KickKept: backward unpacks
# roughly in reverse packing order, so kept tensors packed after the last move
# come before it, and whichever unpacks first kicks (all of them, since one node
# may unpack a moved input before a kept tensor saved after it); the others see
# ``Prefetcher.started`` (no lock) and only unpack. Kept packs before the first
# move, and a step that moves nothing, stay plain Kept. Kicking from where it
# was packed, a backward that begins mid-graph (``autograd.grad`` of an
# intermediate) restores what it needs next. When backward needs a moved tensor
# before any kept one (cross-entropy's log-softmax output) it is read on demand
# and leads, unless the tail hold still has its source (NOTE [Tail hold] in
# runtime/tailhold.py): then it is taken from memory.

from __future__ import annotations

from typing import Any

import torch

from ..policy import Tier, TensorInfo
from .contract import KEPT_HIT, KICK, NO_INDEX
from ..tracking.hidden import opaque
from .roots import RootWalks
from ..tiers.keep import Kept, KickKept, MarkedKept, check_version
from ..tracking.modules import current_module
from ..tracking.producers import storage_key

__all__ = ["Packer", "unpack", "keep_pack", "opaque"]

_KEEP = Tier.KEEP.value
_in_backward = torch._C._current_graph_task_id   # -1 outside autograd's engine
_Parameter = torch.nn.Parameter
_strided = torch.strided
_Tensor = torch.Tensor


def keep_pack(t: torch.Tensor) -> Kept:
    """The pack hook of :func:`tiermem.no_offload`: keep, with the in-place check."""
    return Kept(t, "")


def unpack(handle: Any) -> torch.Tensor:
    """The unpack hook of every context, for every kind of handle."""
    if type(handle) is Kept:
        t = handle.tensor
        if t._version != handle.version:   # NOTE [In-place check]
            check_version(t, handle.version, handle.module)
        return t
    if type(handle) is KickKept or type(handle) is MarkedKept:
        return handle.unpack()   # NOTE [Restores start with backward]
    step = handle.step
    if step._backward_task != _in_backward():   # NOTE [Backward order] in runtime/schedule.py
        step.note_backward()
    prefetcher = step.prefetcher
    entry = handle.entry
    with prefetcher.lock:
        more_uses = prefetcher.begin_use(entry)
        out, finish = handle.store.take(handle, more_uses)
        prefetcher.advance(entry)
    return out if finish is None else finish()


def _movable(t: torch.Tensor) -> bool:
    if type(t) is not torch.Tensor:
        return False
    kind = t.device.type
    return kind == "cpu" or (kind == "cuda" and not _capturing())   # NOTE [CUDA graph capture]


# NOTE [CUDA graph capture]
# A CUDA graph captures the kernels queued on a stream; tiermem's moves are
# host-driven (side streams joined by events, host polls of those events,
# pinned buffers, reads from disk), none of which a capture may contain: the
# first move would fail inside CUDA (an event queried while captured, a side
# stream never joined back). And a captured graph's tensors live in its own
# memory pool at fixed addresses. So:
# 1. entering an Offloader while the current stream is capturing raises a
#    ``TierMemError`` saying so (``Offloader.__enter__``);
# 2. a CUDA tensor saved while a capture runs (one begun inside the step,
#    e.g. ``torch.cuda.make_graphed_callables`` called in an attached
#    forward) is kept where it is, as an unmovable tensor (``_movable``):
#    one C call per CUDA tensor that reaches the tiers, none on the planned
#    keep's fast path.
def _capturing() -> bool:
    """The current CUDA stream is capturing a graph (CUDA is initialised:
    only asked for a CUDA tensor)."""
    return torch.cuda.is_current_stream_capturing()


class Packer:
    """The pack hook of one step (``step``), placing through ``placement``;
    ``scope``: the ``wrap_blocks`` scope (its ``stack`` of tier orders, the
    innermost block's first), asked before the step's decider; ``step_decider``:
    the step's ``StepDecider`` (tiermem/deciders.py), asked through its
    methods only, or ``None``: the placement's order decides; ``keeps_all``:
    the step keeps every tensor and polls no tier (NOTE [Steps that keep
    everything] in offloader.py); ``roots``: the Offloader's walks of its
    root modules (NOTE [Roots walked once] in runtime/roots.py)."""

    def __init__(self, step, placement, scope, roots: RootWalks, step_decider=None,
                 keeps_all=False) -> None:
        self.step = step
        self._roots = roots
        self.placement = placement
        self._scope = scope
        self._step_decider = step_decider
        #: ``step_decider.keep_at``, bound once: it runs per tensor.
        self._keep_at = None if step_decider is None else step_decider.keep_at
        self.min_bytes = step.min_offload_bytes
        self._polls = () if keeps_all else tuple(s.poll for s in placement.movers)
        # Storages of the parameters and buffers of the modules run in this
        # step (a view of one may be saved through an op that hides its base).
        self.param_storages: set = set()
        self._seen_roots: set = set()
        #: A tensor of this step, which follows no plan, went to a moving tier:
        #: later kept packs get a KickKept (NOTE [Kicks without a plan]). Armed
        #: at first for the first pack: ``_pack_first``.
        self.kick_armed = True
        self._first = True

    def note_root(self, module: torch.nn.Module) -> None:
        """A root module started its forward: remember its parameters' storages
        (see NOTE [Sharded parameters]), from its walk kept by the Offloader
        (NOTE [Roots walked once] in runtime/roots.py)."""
        if id(module) in self._seen_roots:
            return
        self._seen_roots.add(id(module))
        if self._roots.note(module, self.param_storages):
            self.step.params_may_be_freed = True

    def clear(self) -> None:
        self.param_storages.clear()
        self._seen_roots.clear()

    def __call__(self, t: torch.Tensor) -> Any:
        """NOTE [Pack order of checks]."""
        if self.kick_armed:   # NOTE [Kicks without a plan]
            return self._pack_after_move(t)
        if _in_backward() != -1:
            # Saved by backward itself (a checkpoint regenerating its region,
            # create_graph): consumed at once, kept, not part of the step's stats.
            return Kept(t, "")
        for poll in self._polls:
            poll()
        stats = self.step.stats
        if t.layout != _strided:
            stats.unsupported_count += 1
            stats.record(_KEEP, t.numel() * t.element_size())
            return Kept(t, "")
        # Parameters, buffers and user leaves that require grad are never moved.
        # nn.Linear saves ``weight.t()``, a *view* of a Parameter, so the base
        # and the storage count, not the Python type of ``t`` (``issubclass``:
        # ``isinstance(t, Parameter)`` goes through a slow metaclass hook).
        # The first test is step.is_stable_param, inlined: this runs per tensor.
        base = t._base
        if base is None:
            base = t
        if ((base.requires_grad and base.is_leaf) or issubclass(type(base), _Parameter)
                or (self.param_storages and type(t) is torch.Tensor
                    and t.untyped_storage().data_ptr() in self.param_storages)):
            stats.param_count += 1
            if base is t and t.is_leaf:
                return Kept.leaf(t)   # the leaf itself: see Kept (``p.data = new``)
            return Kept(t, "")
        nbytes = t.nbytes
        if nbytes < self.min_bytes or nbytes == 0:
            stats.small_count += 1
            stats.record(_KEEP, nbytes)
            return Kept(t, "")
        scoped = self._scope.stack
        scoped = scoped[-1] if scoped else None   # inside a block wrapped with a policy
        fixed = self.placement.fixed if scoped is None else scoped[0]
        if fixed is Tier.KEEP:
            stats.record(_KEEP, nbytes)
            return Kept(t, "")
        if fixed is None:   # policy auto (or a callable policy); not inside a scoped block
            keep_at = self._keep_at
            if keep_at is not None and type(t) is _Tensor:
                # The planned keep (NOTE [Planned keeps by position] in
                # planner/runtime.py): its check also stands for _movable below;
                # no dedup key, no TensorInfo.
                step = self.step
                kept = keep_at(t, step.index)
                if kept:
                    if kept == KEPT_HIT:   # a dedup hit in the profile, of a kept tensor
                        stats.dedup_hits += 1
                        return Kept(t, "")
                    step.index += 1
                    stats.record(_KEEP, nbytes)
                    kept = Kept(t, "")
                    if step.producers is not None:   # recipes look inputs up
                        step.remember(t, step.key_of(t), kept)
                    return kept
        if not _movable(t):
            stats.unsupported_count += 1
            stats.record(_KEEP, nbytes)
            return Kept(t, current_module())
        if fixed is None and self._step_decider is not None:
            return self._place_decided(t, nbytes, self._step_decider)
        return self._place(t, nbytes, scoped, fixed)

    def _pack_after_move(self, t: torch.Tensor) -> Any:
        """Pack ``t`` in a step that follows no plan and has moved a tensor
        already: a kept tensor's handle is wrapped in a
        :class:`~tiermem.tiers.keep.KickKept` (NOTE [Restores start with
        backward], 5); the dedup table and recipes hold the inner Kept (rule 1)."""
        if self._first:
            return self._pack_first(t)
        self.kick_armed = False   # the plain pack path, once
        try:
            handle = self(t)
        finally:
            self.kick_armed = True
        if type(handle) is Kept and _in_backward() == -1:
            step = self.step
            return KickKept(handle, step, step.prefetcher.scheduled)
        return handle

    def _pack_first(self, t: torch.Tensor) -> Any:
        """The step's first pack: a kept handle becomes a :class:`MarkedKept`
        that tells the step its backward runs (NOTE [Backward order] in
        runtime/schedule.py, 1); the dedup table and recipes hold the inner Kept."""
        self._first = self.kick_armed = False   # a move in ``self(t)`` arms it again
        handle = self(t)
        step = self.step
        if type(handle) is Kept and step.order is not None and _in_backward() == -1:
            handle = MarkedKept(handle, step)
        step.saved_first(handle)
        return handle

    def _place_decided(self, t: torch.Tensor, nbytes: int, step_decider) -> Any:
        """The step's decider places ``t`` (``policy="auto"``, the general
        path: NOTE [Following a plan] in planner/runtime.py): dedup lookup,
        then the decider's order."""
        step = self.step
        storage = t.untyped_storage()
        key = storage_key(t, storage)
        handle = step.find(key, storage)
        observers = step.observers
        if handle is not None:
            step.stats.dedup_hits += 1
            step.share(handle)
            step_decider.dedup_hit()
            for o in observers:
                o.hit(handle)
            return handle
        module = current_module()
        index = step.index
        order, how = step_decider.decide(index, t, key, nbytes, module, step.producers)
        if order is None:   # a hit of a tensor stored under another key, counted there
            step.stats.dedup_hits += 1
            return Kept(t, module)
        if how != NO_INDEX:
            step.index = index + 1
        handle = self.placement.put(order, t, step, module, nbytes)
        if how != NO_INDEX:
            for o in observers:
                o.placed(index, handle)
        # Kept ones too, tracked or not: the pack positions and indices of a
        # step that follows its plan are those of its profile.
        step.remember(t, key, handle)
        if how == KICK and type(handle) is Kept:
            return KickKept(handle, step)   # NOTE [Restores start with backward]
        return handle

    def _place(self, t: torch.Tensor, nbytes: int, scoped, fixed) -> Any:
        step = self.step
        storage = t.untyped_storage()
        key = storage_key(t, storage)
        handle = step.find(key, storage)
        if handle is not None:
            step.stats.dedup_hits += 1
            step.share(handle)
            return handle
        module = current_module()
        placement = self.placement
        if scoped is not None:
            # A CheckpointPolicy recompute value: the device's default follows
            # (NOTE [CheckpointPolicy answers] in policy.py).
            order = placement.complete(scoped, t.device) if scoped.then_default else scoped
        elif fixed is not None:
            order = placement.fixed_order
        else:
            index = step.index
            step.index += 1
            producers = step.producers
            op = None if producers is None else producers.op_name(t)
            info = TensorInfo(t.shape, t.dtype, t.device, nbytes, module, op, index, False)
            order = placement.order_for(info)
        handle = placement.put(order, t, step, module, nbytes)
        if type(handle) is not Kept or step.producers is not None:
            step.remember(t, key, handle)
        if (not self.kick_armed and self._step_decider is None
                and step.prefetcher.scheduled):   # NOTE [Kicks without a plan]
            self.kick_armed = True
        return handle
