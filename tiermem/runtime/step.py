"""One step of an Offloader: its stats, dedup table, prefetch schedule, and
the services a tier is given.

A :class:`Step` lives from ``with offloader:`` until autograd has dropped the
step's last handle. The pack hook creates handles through
:class:`~tiermem.runtime.placement.Placement`, passing the step; tiers keep it on the
handles they make and report to it (:class:`~tiermem.tiers.base.StepEvents`):
a move started or failed, a restore started, taken or late, a recompute run.
They never write into the step's parts themselves.

The recompute tier also needs the services of
:class:`~tiermem.tiers.base.RecipeServices` (what this step saved already,
where a recipe's own inputs go): the step provides them, with the tier order
passed explicitly.

# NOTE [Dedup]
# A tensor saved by several ops in one step is stored once. The key is
# (storage pointer, offset, sizes, strides, dtype, version); since a freed
# storage's address can be reused by a new tensor of the same shape, each entry
# also holds a weak reference to the storage and is only a hit while that
# storage is alive. Alive is not enough: FSDP2 frees an unsharded
# parameter's memory with ``resize_(0)``, the storage object living on, and
# the next block's parameter may get the same address; an alias of each
# (``gain.detach()``), same shape and version, then had equal keys and the
# second was handed the first one's handle: wrong values, seen in
# tests/test_fsdp.py's param-alias case. So the pack hook also requires the
# hit to be of the very storage object it holds (``Step.find``'s
# ``storage``; 0.2 µs). When producer tracking is on (recompute), kept tensors are
# registered too: recipes share their handles (NOTE [What a recipe holds]).
"""

from __future__ import annotations

import functools

import weakref
from typing import Any, Callable, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..policy import Tier
from ..telemetry import StepStats
from ..tiers.base import exact_copy
from ..tiers.keep import Kept
from ..tracking.modules import current_module
from ..tracking.params import ParamChecks
from ..tracking.producers import ProducerMode, Ref, storage_key
from .prefetch import Entry, Prefetcher, auto_window_bytes

__all__ = ["Step", "is_stable_param"]

dedup_key = storage_key
_KEEP = Tier.KEEP.value
_graph_task = torch._C._current_graph_task_id   # -1 outside autograd's engine


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (FSDP2's unsharded ones included)."""
    base = t._base if t._base is not None else t
    return issubclass(type(base), torch.nn.Parameter) or getattr(base, "_is_param", False)


def is_stable_param(t: torch.Tensor) -> bool:
    """A parameter (frozen or not, or a view of one) or a leaf that requires
    grad: never modified during a forward pass.

    ``issubclass`` on the type, because ``isinstance(t, Parameter)`` goes
    through a slow metaclass hook."""
    base = t._base
    if base is None:
        base = t
    return (base.requires_grad and base.is_leaf) or issubclass(  # frozen parameters
        type(base), torch.nn.Parameter)


def _moved_bytes(stats: StepStats) -> int:
    """Bytes a step moved off its device (cpu and nvme tiers)."""
    by = stats.bytes_by_tier
    return by[Tier.CPU.value] + by[Tier.NVME.value]


class Step:
    """State of one step; see the module docstring.

    ``placement``: the Offloader's :class:`~tiermem.runtime.placement.Placement` (for a
    recipe's inputs); ``unpack``: the unpack function (for a recipe's leaves);
    ``observers``: the :class:`~tiermem.runtime.contract.StepObserver` s of its
    events, from its decider (``unpack_hook``: the unpack hook they make of
    ``unpack``).
    """

    def __init__(self, placement, prefetch_bytes: Optional[int], min_offload_bytes: int,
                 producers: Optional[ProducerMode], unpack: Callable[[Any], torch.Tensor],
                 check_params: bool = True, observers: tuple = ()) -> None:
        self.stats = StepStats()
        # Not a bound method of the step: the step would then be in a reference
        # cycle (step -> prefetcher -> method -> step) and outlive its graph
        # until the collector ran (``Offloader.in_use``, offload()'s evictions).
        self.prefetcher = Prefetcher(prefetch_bytes,
                                     moved_bytes=functools.partial(_moved_bytes, self.stats),
                                     stats=self.stats)
        #: Producer of each tensor of the forward (``None`` unless the policy may
        #: recompute, or is a callable that may read ``TensorInfo.op``).
        self.producers = producers
        self.min_offload_bytes = min_offload_bytes
        self.index = 0            # TensorInfo.index of the next tensor a policy sees
        self.observers = observers
        #: Those observers that take the timing of restore waits on the GPU.
        self._gpu_timers = tuple(o for o in observers if o.times_gpu_waits)
        #: The model is sharded (FSDP2, DTensor parameters): the parameters its
        #: forward uses may be freed before backward, so recipes hold none as
        #: it is (see NOTE [Sharded parameters] in runtime/hooks.py).
        self.params_may_be_freed = False
        self.dedup: dict = {}     # NOTE [Dedup]: key -> (storage weak ref, handle weak ref)
        self._recipe_inputs: dict = {}   # private copies stored for recipes only
        self._placement = placement
        self._unpack = self.unpack_hook = unpack
        for o in observers:
            self._unpack = o.wrap_leaf_unpack(self._unpack)
            self.unpack_hook = o.wrap_unpack(self.unpack_hook)
        #: Parameters recipes hold as they are (NOTE [Parameters changed before
        #: backward] in tracking/params.py); fingerprints if ``check_params``.
        self.param_checks = ParamChecks(check_params)
        #: The Offloader's :class:`~tiermem.runtime.tailhold.TailHold` when this step
        #: holds the sources of its last moves (NOTE [Tail hold] in
        #: runtime/tailhold.py), else ``None``; ``tail_hold_bytes``: its bound
        #: (``None``: the prefetch window).
        self.tail = None
        self.tail_hold_bytes: Optional[int] = None
        self._tail_release_queued = False
        #: The Offloader's :class:`~tiermem.runtime.schedule.BackwardOrder`
        #: (NOTE [Backward order] in runtime/schedule.py), ``None`` when not in one;
        #: ``number``: this forward's number in it.
        self.order = None
        #: The recompute tier's learned positions when this step may follow them
        #: (NOTE [Records learned by position] in tiers/positions.py), else ``None``.
        self.positions = None
        if producers is not None and producers.follows:
            self.positions = placement.stores[Tier.RECOMPUTE].positions
            self.positions.begin(producers)
        self.number = -1
        self.forward_over = False
        self._backward_task = -1   # the graph task that last unpacked a handle
        self._first_handle = None   # a weak reference to the first handle packed

    def join(self, order) -> None:
        """Enter ``order`` (the Offloader's backward order) as its latest forward."""
        self.order = order
        self.number = order.add(self)

    def end_forward(self, failed: bool = False) -> None:
        """The forward pass is over (``failed``: it raised): drop what only
        packing needed."""
        self.forward_over = True
        if self.order is not None:
            self.order.forward_ended(self, failed)
        self.dedup.clear()
        self._recipe_inputs.clear()
        self.param_checks.end_forward()
        if self.positions is not None:
            self.positions.end(self.producers, failed)
        if self.producers is not None:
            self.producers.clear()
            self.producers = None

    # -- dedup (pack hook) ----------------------------------------------------------
    key_of = staticmethod(dedup_key)

    def remember(self, t: torch.Tensor, key: tuple, handle) -> None:
        """Register ``handle`` as holding ``t``'s values (NOTE [Dedup])."""
        self.dedup[key] = (StorageWeakRef(t.untyped_storage()), weakref.ref(handle))

    def find(self, key: tuple, storage=None):
        """The live handle registered under ``key``, else ``None``. With
        ``storage`` (the tensor's, whose key this is): only a handle
        registered for that very storage object (NOTE [Dedup], the live
        storage at a reused address)."""
        hit = self.dedup.get(key)
        if hit is None:
            return None
        storage_ref, handle_ref = hit
        handle = handle_ref()
        if handle is None or storage_ref.expired():
            return None
        if storage is not None and storage_ref.cdata != storage._cdata:
            return None
        return handle

    # -- events reported by tiers (StepEvents) -------------------------------------
    def moved(self, handle, nbytes: int) -> Entry:
        """A move out started: schedule the handle's restore (its entry)."""
        return self.prefetcher.add(handle, nbytes)

    def hold_tail(self, handle, nbytes: int) -> bool:
        """A move out started whose source holds ``nbytes``: whether the
        source stays held (NOTE [Tail hold] in runtime/tailhold.py, 1 and 6; only
        steps without a plan have ``tail``: the Offloader gives it)."""
        if self.params_may_be_freed:
            return False
        if self.order is not None and not self.order.is_next(self):
            return False   # NOTE [Backward order] in runtime/schedule.py, 3
        limit = self.tail_hold_bytes
        if limit is None:
            limit = self.prefetcher.budget_bytes
            if limit is None:
                limit = auto_window_bytes(_moved_bytes(self.stats))
        held = self.tail.add(handle, nbytes, limit)
        window = self.tail.window_bytes
        if window > self.stats.peak_tail_hold_bytes:
            self.stats.peak_tail_hold_bytes = window
        return held

    def tail_taken(self) -> None:
        """An unpack took a held source (NOTE [Tail hold], 3): count it, and,
        once per step, release the step's other held sources when this
        backward ends (rule 5)."""
        self.stats.tail_hits += 1
        if self._tail_release_queued or torch._C._current_graph_task_id() == -1:
            return
        self._tail_release_queued = True
        step_ref, tail = weakref.ref(self), self.tail

        def release() -> None:
            step = step_ref()
            if step is not None:
                step._tail_release_queued = False
                tail.release_step(step)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(release)
        except RuntimeError:   # not inside the engine after all: released otherwise
            self._tail_release_queued = False

    # -- the backward order (NOTE [Backward order] in runtime/schedule.py) ----------
    @property
    def has_restores(self) -> bool:
        """Whether this step moved or dropped a tensor (its backward restores)."""
        by = self.stats.count_by_tier
        return any(n for tier, n in by.items() if tier != _KEEP)

    def saved_first(self, handle) -> None:
        """``handle`` is the first this step packed: while autograd holds it,
        the step's graph is alive (``in_flight``)."""
        try:
            self._first_handle = weakref.ref(handle)
        except TypeError:   # not weakly referable: the step counts as alive
            pass

    @property
    def in_flight(self) -> bool:
        """Forward over, something saved, and its graph not freed (the first
        handle alive): a backward may still come (NOTE [Backward order], 1)."""
        first = self._first_handle
        return self.forward_over and first is not None and first() is not None

    def note_backward(self) -> None:
        """An unpack of this step's handle inside autograd's engine: once per
        backward pass, queue the order's ``backward_over`` for its end (rule 1)."""
        task = _graph_task()
        order = self.order
        if order is None or task == -1 or task == self._backward_task:
            return
        self._backward_task = task
        # Held by the callback until the pass ends: its handles die during it.
        over = functools.partial(order.backward_over, self)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(over)
        except RuntimeError:   # not inside the engine after all
            self._backward_task = -1

    def start_restores(self) -> None:
        """This step's backward comes next: start its restores within its
        window, as a kick does, unless they have started (rule 4)."""
        prefetcher = self.prefetcher
        if self.has_restores and not prefetcher.started:
            with prefetcher.lock:
                prefetcher.kick()

    def dropped(self, handle, nbytes: int) -> Entry:
        """A tensor was dropped, to be recomputed: count its uses."""
        return self.prefetcher.add(handle, nbytes, prefetchable=False)

    def held(self, tier: Tier, nbytes_held: int) -> None:
        """A store now holds ``nbytes_held`` bytes in all (peak of the step)."""
        stats = self.stats
        if tier is Tier.CPU:
            if nbytes_held > stats.peak_host_bytes:
                stats.peak_host_bytes = nbytes_held
        elif nbytes_held > stats.peak_disk_bytes:
            stats.peak_disk_bytes = nbytes_held

    def move_failed(self) -> None:
        """A move failed after it started: the tensor stays where it was."""
        self.stats.budget_fallbacks += 1

    def restored(self, prefetched: bool, seconds: float, late: bool,
                 host_wait: bool = False) -> None:
        """An unpack took a restore (``prefetched``: started ahead of need) and
        waited ``seconds`` for it (``late``: not complete when it came;
        ``host_wait``: the host had to wait for it, a read not done, rather
        than only ordering its stream after a copy)."""
        stats = self.stats
        if host_wait:
            stats.host_waits += 1
        if prefetched:
            stats.prefetch_hits += 1
        else:
            stats.prefetch_misses += 1
        if late:
            stats.late_restores += 1
        stats.stall_seconds += seconds

    def gpu_wait_start(self, device: torch.device):
        """A CUDA timing event recorded now on ``device``'s current stream, if
        an observer times this step's restore waits on the GPU (the first step
        that follows an auto plan: NOTE [Stall on the GPU's timeline] in
        planner/runtime.py), else ``None``."""
        if not self._gpu_timers or device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def gpu_wait_end(self, start, device: torch.device) -> None:
        """The restore wait begun at ``start`` (from :meth:`gpu_wait_start`)
        is queued: record its end on the same stream, report the pair."""
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(device))
        for o in self._gpu_timers:
            o.gpu_wait(start, end)

    def recomputed(self, seconds: float) -> None:
        self.stats.recompute_count += 1
        self.stats.recompute_seconds += seconds

    def not_recomputable(self, reason: str) -> None:
        self.stats.note_recompute_fallback(reason)

    def recipe_inputs_stored(self, nbytes: int) -> None:
        """Bytes stored only because a recipe needs them."""
        self.stats.recompute_input_bytes += nbytes

    # -- recipe services (RecipeServices; NOTE [What a recipe holds]) -----------------
    def lookup(self, t: Any) -> Any:
        """The handle of ``t`` (a tensor or a :class:`~tiermem.tracking.producers.Ref`)
        if this step already saved its values, else ``None``."""
        if type(t) is Ref:
            if self.params_may_be_freed and self._is_param_ref(t):
                # Rule 4 of NOTE [Sharded parameters]: no parameter as it is,
                # nor as the handle of an alias of it saved before (a Kept
                # ``weight.detach()`` has the parameter's key): the recipe
                # copies or stores it instead.
                return None
            # Same storage object (the weak refs pin its identity), same values:
            # the handle holds them even if the storage was freed since (moved).
            hit = self.dedup.get(t.key) or self._recipe_inputs.get(t.key)
            if hit is None or hit[0].cdata != t.storage.cdata:
                return None   # same address, another storage
            return hit[1]()
        storage = t.untyped_storage()
        return self.find(dedup_key(t, storage), storage)

    @staticmethod
    def _is_param_ref(ref: Ref) -> bool:
        """Whether ``ref``'s argument is a parameter or a view of one."""
        t = ref.tensor_ref()
        return t is not None and _is_parameter(t)

    def share(self, handle: Any) -> None:
        """Count one more consumer of ``handle`` in each backward pass."""
        if type(handle) is not Kept:
            self.prefetcher.share(handle.entry)

    def is_stable_param(self, t: torch.Tensor) -> bool:
        """Whether a recipe may hold ``t`` as it is (NOTE [What a recipe holds]):
        a parameter or a leaf that requires grad, except, when the model's
        parameters may be freed between forward and backward, a parameter
        (see NOTE [Sharded parameters] in runtime/hooks.py)."""
        if not is_stable_param(t):
            return False
        if not self.params_may_be_freed:
            return True
        return not _is_parameter(t)

    def is_small(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() < self.min_offload_bytes

    @staticmethod
    def keep_handle(t: torch.Tensor, *, clone: bool) -> Kept:
        return Kept(exact_copy(t) if clone else t, "")

    def watch_param(self, held: torch.Tensor) -> Any:
        return self.param_checks.watch(held, dedup_key(held))

    def check_param(self, watch: Any) -> None:
        self.param_checks.check(watch)

    def store_input(self, t: torch.Tensor, order: Tuple[Tier, ...]) -> Any:
        """Store an input of a recipe that no one saved, in the tiers of
        ``order`` (recompute left out; keep if none), registered for dedup.

        ``order``: the tiers the tensor being planned would go to if it were
        not recomputed (its policy's later choices). A callable policy is not
        asked again: it sees the tensors autograd saves, and
        ``TensorInfo.index`` counts those only."""
        order = tuple(tier for tier in order if tier is not Tier.RECOMPUTE) or (Tier.KEEP,)
        # Autograd did not save ``t``, so the program may still modify it in
        # place (also while a copy of it is in flight); the recipe needs its
        # values of now: a private copy is stored, shared by recipes only (a
        # later save of ``t`` by autograd gets its own handle, with the in-place
        # check). NOTE [What a recipe holds].
        nbytes = t.numel() * t.element_size()
        handle = self._placement.put(order, exact_copy(t), self, current_module(), nbytes)
        self._recipe_inputs[dedup_key(t)] = (StorageWeakRef(t.untyped_storage()),
                                             weakref.ref(handle))
        return handle

    def unpack(self, handle: Any) -> torch.Tensor:
        """A recipe's leaf, unpacked as autograd's unpack would."""
        return self._unpack(handle)
