"""Seams into an :class:`Offloader`'s runtime and tiers: its stores, moves,
handles and copies, what a test may see and change there (see the package
docstring). Every function takes the Offloader it works on, or patches the
process for the duration of a ``with`` block, and says what it returns.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, List, Tuple

from ..policy import Tier
from ..tracking import modules as _modules
from ._patch import patched

__all__ = [
    "store_of",
    "poll",
    "pending",
    "nvme_file",
    "set_nvme_file",
    "staging_pool",
    "stage_cpu_tensors",
    "uses_engine_chain",
    "tier_order",
    "order_for",
    "remove_private_dir",
    "record_placements",
    "deferred_param_checks",
    "sources_in_flight",
    "set_move_window",
    "slow_copies",
    "tail_held_bytes",
    "in_forward",
    "unlaunched_moves",
    "wait_cpu_copies",
    "slow_restore_starts",
    "after_prefetch_fills",
    "failing_host_releases",
    "release_kept_handle",
    "finish_restore",
    "before_cuda_copies",
    "step_number",
    "record_restores",
    "refusals_planned",
    "peak_in_flight",
    "holds_module_hooks",
    "release_module_hooks",
    "registration_hooks_installed",
    "dynamo_has_run",
]


def store_of(off, tier: Tier):
    """The store of ``tier`` (a :class:`~tiermem.tiers.base.TierStore`); ``KeyError``
    if this Offloader has none (nvme without a directory, or disabled)."""
    return off._placement.stores[Tier(tier)]


def poll(off) -> None:
    """Do what the forward thread does at each pack: finish the moves that have
    landed (drop their sources; NOTE [Copy landed])."""
    off._placement.poll()


def pending(off, tier: Tier) -> List[Tuple[Any, Any]]:
    """``(handle or None, job)`` of each move of ``tier`` not landed yet, in
    order (``None``: the handle died)."""
    return [(ref(), job) for ref, job in store_of(off, tier).pending_moves()]


def nvme_file(off):
    """The open arena file of the nvme tier (an ``IOFile`` of its engine)."""
    return store_of(off, Tier.NVME).file


def set_nvme_file(off, f) -> None:
    """Make the nvme tier write and read through ``f`` (a wrapper of
    :func:`nvme_file`, e.g. one that injects faults or holds writes back)."""
    store_of(off, Tier.NVME).file = f


def staging_pool(off):
    """The nvme tier's pool of staging buffers (a :class:`~tiermem.memory.hostpool.HostPool`)."""
    return store_of(off, Tier.NVME).staging


def stage_cpu_tensors(off, on: bool = True) -> None:
    """Move CPU tensors to disk through staging and the Python chain, the way
    CUDA tensors go (NOTE [Staged moves] then runs on a CPU-only machine)."""
    store_of(off, Tier.NVME).stage_cpu = on


def uses_engine_chain(off) -> bool:
    """Whether the nvme tier sends CUDA tensors through the C++ engine's chain."""
    return store_of(off, Tier.NVME).uses_engine_chain


def tier_order(off) -> Tuple[Tier, ...]:
    """The tier order of a named policy (``None`` for a callable policy)."""
    return off._placement.fixed_order


def order_for(off, info):
    """The :class:`~tiermem.policy.TierOrder` a callable policy's answer for
    ``info`` (a :class:`~tiermem.TensorInfo`) gives, the device's default
    filled in (NOTE [CheckpointPolicy answers] in policy.py). Asks the policy."""
    return off._placement.order_for(info)


def remove_private_dir(off) -> None:
    """Remove the nvme tier's private directory now (what a finalizer does)."""
    store_of(off, Tier.NVME).remove_dir()


@contextlib.contextmanager
def record_placements(off) -> Iterator[List[Tuple[str, str]]]:
    """Record ``(module, first tier tried)`` for each tensor placed while inside."""
    placement = off._placement
    seen: List[Tuple[str, str]] = []
    orig: Callable = placement.put

    def spy(order, t, step, module, nbytes):
        handle = orig(order, t, step, module, nbytes)
        seen.append((module, order[0].value))
        return handle

    placement.put = spy
    try:
        yield seen
    finally:
        del placement.put


@contextlib.contextmanager
def deferred_param_checks() -> Iterator[None]:
    """While inside, parameter fingerprints of CPU tensors are compared the way
    CUDA ones are: a flag per comparison, read once at the end of backward
    (NOTE [Parameters changed before backward] in tracking/params.py). Process-wide."""
    from ..tracking import params as paramcheck
    before = paramcheck.defer_on_cpu
    paramcheck.defer_on_cpu = True
    try:
        yield
    finally:
        paramcheck.defer_on_cpu = before


def sources_in_flight(off, tier: Tier) -> Tuple[int, int]:
    """``(count, bytes)`` of the sources ``tier`` still holds for moves it has
    launched (their copy not seen landed): what NOTE [In-flight window] in
    tiers/moving.py bounds."""
    return store_of(off, tier).sources_in_flight()


def set_move_window(off, tensors: int = None, nbytes: int = None) -> None:
    """Set the in-flight window of every moving tier of ``off`` (``None``:
    leave that bound as it is). See NOTE [In-flight window] in tiers/moving.py."""
    for store in off._placement.movers:
        if tensors is not None:
            store.window_tensors = tensors
        if nbytes is not None:
            store.window_bytes = nbytes


@contextlib.contextmanager
def slow_copies(delay_seconds: float) -> Iterator[None]:
    """While inside, every copy out of the CPU copier (the worker thread of
    the cpu tier, and of the nvme tier's staged CPU tensors) first sleeps
    ``delay_seconds`` on its worker: a copy far slower than compute, as a
    GPU running behind the host. Process-wide."""
    from ..runtime.copier import ThreadCopier
    original = ThreadCopier.copy_out

    def slow(self, src, dst):
        return self._out.submit(lambda: (time.sleep(delay_seconds), dst.copy_(src)))

    ThreadCopier.copy_out = slow
    try:
        yield
    finally:
        ThreadCopier.copy_out = original


def tail_held_bytes(off) -> int:
    """Bytes of moved tensors' sources the tail hold of ``off`` holds now
    (each counted as its storage, if larger than the tensor)."""
    return off._tail.held_bytes()


def in_forward(off) -> bool:
    """Whether a forward pass is under ``off`` in this thread now."""
    return off._active_here()


def unlaunched_moves(off, tier: Tier) -> int:
    """How many moves ``tier`` has queued whose copy is not launched yet
    (NOTE [Launch after the saving op])."""
    return len(store_of(off, tier)._unlaunched)


def wait_cpu_copies() -> None:
    """Wait until the CPU copier's threads (out and in) have run every copy
    queued so far."""
    from ..runtime.copier import ThreadCopier
    copier = ThreadCopier()
    for worker in (copier._out, copier._in):
        worker.submit(lambda: None).wait_host()


@contextlib.contextmanager
def slow_restore_starts(delay_seconds: float) -> Iterator[None]:
    """While inside, each restore a moving tier (cpu, nvme) starts first
    sleeps ``delay_seconds`` on the thread that starts it. Process-wide."""
    from ..tiers.moving import MovingStore
    original = MovingStore._restore

    def slow(self, h):
        time.sleep(delay_seconds)
        return original(self, h)

    with patched(MovingStore, "_restore", slow):
        yield


@contextlib.contextmanager
def after_prefetch_fills(fn: Callable[[Any], None]) -> Iterator[None]:
    """While inside, ``fn(stats)`` runs each time a prefetcher has topped its
    window up, with the :class:`~tiermem.StepStats` it counts into (``None``
    if it counts nowhere). Process-wide."""
    from ..runtime.prefetch import Prefetcher
    original = Prefetcher._fill

    def fill(self):
        original(self)
        fn(self._stats)

    with patched(Prefetcher, "_fill", fill):
        yield


@contextlib.contextmanager
def failing_host_releases(error: BaseException) -> Iterator[None]:
    """While inside, the cpu tier's release of a dead handle's host buffer
    raises ``error`` instead of freeing it. Process-wide."""
    from ..tiers.host import HostStore

    def fail(self, h):
        raise error

    with patched(HostStore, "_free", fail):
        yield


def release_kept_handle(handle) -> None:
    """Drop what reading ``handle.__del__`` kept (NOTE [Interrupted releases],
    rule 4): the handle, and its room, can then be released when it dies."""
    from ..tiers import moved_handle
    moved_handle._DYING.pop(handle)


def finish_restore(job, step, prefetched: bool = True) -> None:
    """Finish a restore as an unpack that takes it does: wait for ``job``
    (``done()``, ``host_ready()``, ``order_before_use(tensor)``) and report
    the wait to ``step.restored`` (late, and whether the host waited)."""
    from ..tiers.restore import _Waited
    _Waited(None, None, job, step, prefetched)()


@contextlib.contextmanager
def before_cuda_copies(fn: Callable[[str, Any], None]) -> Iterator[None]:
    """While inside, ``fn(direction, stream)`` runs before each copy a CUDA
    copier issues: ``direction`` is ``"out"`` (device to host) or ``"in"``,
    ``stream`` the side stream the copy goes on. Process-wide."""
    from ..runtime.copier import CudaCopier
    original = CudaCopier._copy

    def copy(self, stream, src, dst):
        fn("out" if stream is self.d2h else "in", stream)
        return original(self, stream, src, dst)

    with patched(CudaCopier, "_copy", copy):
        yield


def step_number(ctx) -> int:
    """The number of the forward ``ctx`` (what ``with off as ctx`` gives) ran:
    its Offloader's forwards counted from 0 (NOTE [Backward order])."""
    return ctx.step.number


@contextlib.contextmanager
def record_restores(off) -> Iterator[List[Tuple[int, str]]]:
    """Record ``(step number, how)`` for each restore of ``off``'s saved
    tensors while inside, in the order they happen: ``"ahead"`` when a store
    starts one before its unpack (a prefetch, or a source the tail hold
    keeps), ``"take"`` at each unpack of a moved or dropped tensor (a restore
    taken, read on demand, or a recipe run). Step numbers: :func:`step_number`."""
    seen: List[Tuple[int, str]] = []
    stores = [s for tier, s in off._placement.stores.items() if tier is not Tier.KEEP]
    with contextlib.ExitStack() as stack:
        for store in stores:
            prefetch, take = store.prefetch, store.take

            def ahead(h, prefetch=prefetch):
                out = prefetch(h)
                if out:
                    seen.append((h.step.number, "ahead"))
                return out

            def taken(h, more_uses, take=take):
                seen.append((h.step.number, "take"))
                return take(h, more_uses)
            stack.enter_context(patched(store, "prefetch", ahead))
            stack.enter_context(patched(store, "take", taken))
        yield seen


def peak_in_flight(off) -> int:
    """The most forwards of ``off`` seen in flight at once (forward over,
    backward not run, graph alive), counted at each forward's end: what
    ``policy="auto"`` divides a size budget by (NOTE [Backward order])."""
    return off._order.peak_in_flight


def refusals_planned(off) -> int:
    """How many tensors the recompute tier refused in the current or last
    forward after planning their recipes (not answered from the last forward's
    refusals: NOTE [Refusals remembered] in tiers/refusals.py)."""
    return off._placement.stores[Tier.RECOMPUTE].refusals.planned()


def holds_module_hooks(off) -> bool:
    """Whether ``off`` keeps tiermem's global module hooks installed between
    its steps: while any Offloader does, every module call of the process
    takes torch's slow path (NOTE [Hooks held between steps] in
    tracking/modules.py)."""
    return off in _modules._holders


def release_module_hooks(off) -> None:
    """``off`` no longer holds the global module hooks between its steps
    (as ``close()`` does); its next step that tracks modules installs them
    again. They go once no step runs and no other Offloader holds them."""
    _modules.release(off)


def registration_hooks_installed() -> int:
    """How many of torch's global module, parameter and buffer registration
    hooks tiermem has installed now (3 while an Offloader holds them, else 0:
    NOTE [Registration hooks held while used] in runtime/roots.py)."""
    from ..runtime import roots
    return sum(h is not None for h in roots._installed)


@contextlib.contextmanager
def dynamo_has_run(ran: bool) -> Iterator[None]:
    """Steps that end inside see Dynamo as having run in this process (``ran``)
    or not, whatever its counters say: what decides whether an Offloader
    holds the global module hooks between its steps (NOTE [Hooks held between
    steps] in tracking/modules.py)."""
    with patched(_modules, "dynamo_ran", lambda: bool(ran)):
        yield
