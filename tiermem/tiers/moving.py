"""Shared logic of the tiers that move a tensor away and bring it back (cpu, nvme).

A moving store implements these steps; this base class does the rest (the
launch after the saving op, the landing check, in-place safety, prefetch,
release):

- ``_reserve(layout, t) -> reservation`` or ``None`` when full: take the room
  the tensor's bytes need (host buffer, disk extent), within the budget;
- ``_launch(src, layout, reservation) -> (slot, job)``: start moving the bytes
  out into the reserved room; ``slot`` is the store's record of where they
  go, ``job`` a :class:`~tiermem.runtime.jobs.Job`. On failure it gives the
  reservation back and raises (the tensor then stays where it is);
- ``_unreserve(reservation, layout)``: give back room never used (a handle
  dead before its launch; runs from a finalizer: no lock);
- ``_start_restore(handle) -> (tensor, job)``: allocate on the device and
  start bringing the bytes back (``handle.layout.pad`` elements first);
- ``_free(handle)``: give the slot back once ``handle.last_job`` is done.

Forward (``put``): reserve and return at once; the move is launched once the
op that saved the tensor has run (NOTE [Launch after the saving op]). The
forward thread checks finished jobs at every pack (``poll``) and then drops the source:
device memory is freed when the copy lands, not at backward. A store whose
move goes through a host staging buffer first (nvme, CUDA tensors) drops the
source earlier, once the bytes are in staging: see NOTE [Staged moves].

Backward (``take``, called by the unpack hook under the prefetcher's lock):
the restore was usually started ahead of need by the
:class:`~tiermem.runtime.prefetch.Prefetcher` (through ``prefetch``); ``take``
returns the rebuilt tensor and the wait that orders the consumer after the
copy (run by the hook outside the lock). The store reports to the step it was
given at ``put`` (``handle.step``, :class:`~tiermem.tiers.base.StepEvents`).
"""

# NOTE [Copy landed]
# A copied tensor must hold its pack-time values, never a torn mix of before
# and after an in-place write that raced the copy. PyTorch bumps a tensor's
# version on the host *after* issuing an in-place kernel (CPU: after running
# it). The forward thread, between two ops, checks ``job.done()`` and then the
# version: if the copy is complete and the version is unchanged, no in-place
# op was issued before the check, so none ran before the copy ended and the
# copy is clean; the source is dropped, and later in-place writes cannot
# affect the copy. If the version changed, the copy may be torn: the handle is
# marked and its unpack raises, as autograd would without hooks (see NOTE
# [In-place check] in keep.py). The check must run on the thread that issues
# the forward ops, never on the copy worker: a worker cannot tell a finished
# in-place kernel from one still running.

# NOTE [Launch after the saving op]
# A move copies the values the saving op left, not those from before its kernel:
# autograd packs an op's saved inputs before the kernel runs, and a kernel may
# write an input it saves without bumping its version (``rrelu_with_noise``
# writes its saved ``noise``). So a move is *reserved* at pack time (the budget
# decision and the fallback stay there) and *launched* only once the saving op
# has run: at the first pack of a later op, at the end of the forward, or when
# backward (or an abandoned forward) needs it. "A later op" is one whose autograd
# node sequence number (thread-local) differs: every op that saves creates its
# node before saving, and Python reaches a later op only after the saving op
# returned (CPU: its kernel ran; CUDA: it is queued before the copy's event).
# Until launched the source stays alive; a write meanwhile is caught by the
# version check (NOTE [Copy landed]).

# NOTE [Staged moves]
# A staged move never loses the tensor's bytes: a job with a ``host_view`` moves
# them through that host buffer (``copied()``: all in it; ``done()``: the move,
# the disk write, is over). Once copied, ``poll`` drops the source after the
# version check of NOTE [Copy landed], and ``h.host`` holds the staging view:
# - until the move lands the handle counts as not landed (no prefetch from the
#   disk) and ``get`` copies the bytes back from ``h.host``;
# - if the move then fails, ``h.host`` stays the only copy and ``get`` restores it;
# - the buffer goes back to its pool only through ``h.lease.release()``, and the
#   pool reuses it once the move and every copy out of it are done: it is never
#   handed out while a handle may still read it.

# NOTE [In-flight window]
# At each ``poll`` at most ``window_tensors`` launched moves, and ``window_bytes``
# of their sources, are held: the host usually runs far ahead of the copies, so
# waiting for landing alone (NOTE [Copy landed]) would hold the saved tensors as
# if kept. Beyond the window the oldest are retired:
# - a job that can order the source's reuse after its copy without the host
#   (``Job.order_after_copy``: CUDA, the source's stream and the current stream
#   wait on the copy's event) gets the version check at once and drops its
#   source: every later kernel of those streams, in-place writes and reuse of the
#   freed block (handed out on that stream only) included, runs after the copy,
#   hence no ``record_stream``;
# - otherwise CPU tensors wait for the copy and land; a CUDA tensor whose job
#   cannot order a stream is left to land (the forward never waits on a CUDA copy).
# Moves count in launch order until retired, so the sources held never exceed the
# window.

from __future__ import annotations

import collections
import gc
import logging
import threading
import time
import weakref
from typing import Optional

import torch

from ..errors import TierMemError
from ..runtime.copier import copier_for
from ..runtime.jobs import CudaJob
from ..runtime.prefetch import HELD
from ..tracking.modestack import in_compiled_region
from .base import Layout, TierStore
from .keep import check_version

_log = logging.getLogger("tiermem")

__all__ = ["MovingStore", "MovedHandle"]

# The number autograd's next node will get (this thread): NOTE [Launch after the saving op].
_sequence_nr = torch._C._autograd._get_sequence_nr

#: NOTE [In-flight window]: most launched moves whose sources are held (torchtune's 5).
DEFAULT_WINDOW_TENSORS = 5
#: NOTE [In-flight window]: most bytes of sources held for launched moves (the
#: prefetcher's largest window: the same bound on bytes in flight each way).
DEFAULT_WINDOW_BYTES = 256 * 1024 ** 2


# NOTE [Interrupted releases]
# A handle's room (host buffer, disk extent) is given back exactly once, even when
# a KeyboardInterrupt lands in its release (Python then prints "Exception ignored"
# and drops it; it mostly lands at a finalizer's entry, after C work freed the handle):
# 1. No Python code runs before a dying handle is kept: ``MovedHandle.__del__`` is
#    a property whose C getter, ``_DYING.__getitem__``, stores the handle in
#    ``_DYING`` under a fresh ``_Finalizer`` (made in C), which is then called.
# 2. ``_release_dying`` releases that handle and every other whose finalizer has
#    run (``gc.is_finalized``), then drops them: an interrupted release is run
#    again at the next handle's death, not lost.
# 3. A release may so run twice or on two threads: each step of
#    ``MovingStore._release`` is idempotent or claimed first (in bytecodes where no
#    signal handler runs), so no room is handed to two tensors; an interrupt right
#    after a claim loses that room instead. A launch takes the reservation first.
# 4. Reading ``__del__`` of a live handle keeps it (and its room) for good.

class _Finalizer:
    """What a dying handle's ``__del__`` returns, then called: NOTE
    [Interrupted releases], rule 1. One per handle; made in C."""

    __slots__ = ()

    def __call__(self) -> None:
        self.release_dying(self)


#: Dying handles whose release is not over: NOTE [Interrupted releases].
_DYING: collections.defaultdict = collections.defaultdict(_Finalizer)


def _release_dying(token: _Finalizer, _dying=_DYING, _finalized=gc.is_finalized) -> None:
    """Release the handle stored under ``token`` and those kept after an
    interrupted release (NOTE [Interrupted releases], rule 2). A release that
    fails with an ``Exception`` (not an interruption) is not tried again.
    The defaults keep what it needs through interpreter shutdown."""
    for h, t in list(_dying.items()):
        if t is token or _finalized(h):
            try:
                store = getattr(h, "store", None)   # unset: dead inside put()
                if store is not None:
                    store._release(h)
            except Exception:
                _dying.pop(h, None)
                raise
            _dying.pop(h, None)


_Finalizer.release_dying = staticmethod(_release_dying)   # kept through shutdown


class MovedHandle:
    """A saved tensor moved away by a :class:`MovingStore`. Owned by autograd;
    when autograd drops it, the store gets its slot back (NOTE [Interrupted
    releases]). ``released``: the store's ``_free`` was called (rule 3)."""

    __slots__ = ("store", "step", "entry", "layout", "nbytes", "slot", "version", "module",
                 "src", "host", "lease", "last_job", "restore", "cached", "tainted", "failed",
                 "tail", "released", "__weakref__")

    def __new__(cls) -> "MovedHandle":
        h = super().__new__(cls)
        h.released = False
        return h

    # NOTE [Interrupted releases], rule 1: a C getter, whose value is called.
    __del__ = property(_DYING.__getitem__)


def _where_kept(h: "MovedHandle") -> str:
    """Where a tensor whose move failed stays (NOTE [Staged moves])."""
    return "on its device" if h.host is None else "in its pinned staging buffer"


class MovingStore(TierStore):
    """Base of the cpu and nvme tiers; see the module docstring."""

    def __init__(self) -> None:
        # (weakref to handle, move-out job), in submission order. Weak: a handle
        # whose graph is dropped before its copy lands frees its slot at once.
        self._pending: collections.deque = collections.deque()
        # Staged moves whose copy to staging was not seen landed yet, in order.
        self._uncopied: collections.deque = collections.deque()
        self._lock = threading.RLock()
        self._warned_failure = False
        # Weak refs to handles reserved but not launched yet, in order, and the
        # autograd node sequence number they were reserved under.
        self._unlaunched: collections.deque = collections.deque()
        self._unlaunched_seq = -1
        #: NOTE [In-flight window]: bounds on the sources held for launched moves.
        self.window_tensors = DEFAULT_WINDOW_TENSORS
        self.window_bytes = DEFAULT_WINDOW_BYTES
        # (weak ref to handle, job, nbytes) of launched moves not retired, in
        # order, and their bytes (under the lock).
        self._window: collections.deque = collections.deque()
        self._window_bytes_held = 0

    # -- subclass steps -------------------------------------------------------
    def _reserve(self, layout: Layout, t: torch.Tensor):
        raise NotImplementedError

    def _launch(self, src: torch.Tensor, layout: Layout, reservation):
        raise NotImplementedError

    def _unreserve(self, reservation, layout: Layout) -> None:
        raise NotImplementedError

    def _start_restore(self, h: MovedHandle):
        raise NotImplementedError

    def _free(self, h: MovedHandle) -> None:
        raise NotImplementedError

    def _held_bytes(self) -> int:
        """Bytes this store holds now (reported to the step after each put)."""
        return 0

    def trim_idle(self) -> None:
        """Between steps (no copy of this store queued by the step to come):
        give back idle pinned buffers that refused requests need room from
        (NOTE [Trimming pinned buffers] in memory/hostpool.py), and mark what earlier
        steps gave back while its I/O still ran, for the step to come to wait
        for rather than grow or refuse (NOTE [Buffers of earlier steps] in
        memory/hostpool.py). Default: nothing."""

    def sources_in_flight(self) -> tuple:
        """``(count, bytes)`` of the sources held for launched moves not seen
        landed (NOTE [In-flight window])."""
        count = nbytes = 0
        with self._lock:
            for ref, _ in self._pending:
                h = ref()
                if h is not None and h.src is not None and not h.failed:
                    count, nbytes = count + 1, nbytes + h.nbytes
        return count, nbytes

    def pending_moves(self) -> list:
        """``(weak ref to handle, job)`` of each move not landed yet, in order."""
        with self._lock:
            return list(self._pending)

    # -- forward ------------------------------------------------------------
    def put(self, t: torch.Tensor, step, module: str = "") -> Optional[MovedHandle]:
        """Reserve room for ``t`` (``None``: full) and return its handle; the
        move is launched later (NOTE [Launch after the saving op])."""
        layout = Layout.of(t, in_compiled_region())   # NOTE [Layout of a moved tensor]
        reservation = self._reserve(layout, t)
        if reservation is None:
            return None
        h = MovedHandle()
        h.slot = reservation   # until launched
        h.layout, h.nbytes = layout, layout.nbytes
        h.version, h.module, h.src = t._version, module, t.detach()
        h.host = h.lease = h.last_job = None
        h.restore = h.cached = None
        h.tainted = h.failed = False
        h.tail = None
        h.step = step
        h.store = self
        self._unlaunched.append(weakref.ref(h))
        self._unlaunched_seq = _sequence_nr()
        h.entry = step.moved(h, h.nbytes)
        if step.tail is not None and step.hold_tail(h, max(h.nbytes, _storage_bytes(h.src))):
            h.tail = h.src   # NOTE [Tail hold] in runtime/tailhold.py
        step.held(self.tier, self._held_bytes())
        return h

    def launch(self) -> None:
        """Launch every reserved move (the ops that saved them have run)."""
        unlaunched = self._unlaunched
        while unlaunched:
            h = unlaunched.popleft()()
            if h is not None and h.last_job is None and h.src is not None and not h.failed:
                self._launch_one(h)

    @staticmethod
    def release_source(h: MovedHandle) -> None:
        """Drop the tail hold's reference to ``h``'s source (NOTE [Tail hold]
        in runtime/tailhold.py); the store's own reference, if any, is untouched."""
        h.tail = None

    def _launch_one(self, h: MovedHandle) -> None:
        if h.src._version != h.version:
            # Written in place since it was saved: the copy would be of the new
            # values; backward raises, as autograd would (NOTE [Copy landed]).
            reservation, h.slot = h.slot, None
            self._unreserve(reservation, h.layout)
            h.tainted = True
            h.src = None
            return
        if h.step.params_may_be_freed and h.nbytes and h.src.untyped_storage().nbytes() == 0:
            # Freed by FSDP2 since it was saved (rule 5 of NOTE [Sharded
            # parameters] in runtime/hooks.py): nothing to copy; kept as a failed move,
            # whose storage FSDP2 refills for backward. Not a warning.
            reservation, h.slot = h.slot, None
            self._unreserve(reservation, h.layout)
            h.failed = True
            h.step.move_failed()
            return
        # Claimed: ``_launch`` gives it back if it raises, a KeyboardInterrupt
        # too (NOTE [Interrupted releases], rule 3).
        reservation, h.slot = h.slot, None
        try:
            slot, job = self._launch(h.src, h.layout, reservation)
        except Exception as error:   # the reservation was given back
            h.failed = True          # the source stays: as a move that failed
            if not isinstance(error, TierMemError):
                error = TierMemError(f"tiermem: moving a tensor to the {self.tier.value} "
                                     f"tier failed: {type(error).__name__}: {error}")
            self._on_failure(h, error)
            return
        h.slot, h.last_job, h.lease = slot, job, getattr(job, "lease", None)
        if h.step.params_may_be_freed:
            self._guard_freed_source(h.src, job)
        with self._lock:
            ref = weakref.ref(h)
            self._pending.append((ref, job))
            if getattr(job, "host_view", None) is not None:
                self._uncopied.append((ref, job))
            self._window.append((ref, job, h.nbytes))
            self._window_bytes_held += h.nbytes

    def _guard_freed_source(self, src: torch.Tensor, job) -> None:
        """Rule 5 of NOTE [Sharded parameters] in runtime/hooks.py: the source's
        memory may be freed by FSDP2 (``storage.resize_(0)``) while the copy
        out still reads it. On CUDA the block is recorded on the copy's side
        stream, so the caching allocator reuses it only after the copy; on
        the CPU the copy (or write) is waited for here, before the forward
        can go on to free it."""
        if src.is_cuda:
            copiers = getattr(self, "_copiers", None)
            if copiers is not None:
                src.record_stream(copier_for(src.device, copiers).d2h)
            return
        try:
            job.wait_host()
        except Exception:   # a failed move: poll() finds it and handles it
            pass

    def poll(self) -> None:
        """Launch the moves of ops that have run (NOTE [Launch after the saving
        op]); finish every move that has landed, in order (NOTE [Copy landed])."""
        if self._unlaunched and _sequence_nr() != self._unlaunched_seq:
            self.launch()
        if not self._pending:
            if self._uncopied:
                self._uncopied.clear()   # all landed
            if self._window:   # all landed
                with self._lock:
                    self._window.clear()
                    self._window_bytes_held = 0
            return
        with self._lock:
            pending = self._pending
            while pending and pending[0][1].done():
                self._landed(*pending.popleft())
            if self._uncopied:
                self._drop_copied_sources()
            if self._window:
                self._bound_window()

    def _bound_window(self) -> None:
        """Retire the oldest moves until the window holds (NOTE [In-flight
        window]); caller holds the lock."""
        window = self._window
        while window:
            ref, job, nbytes = window[0]
            h = ref()
            held = h is not None and h.src is not None and not h.failed
            if held and (len(window) <= self.window_tensors
                         and self._window_bytes_held <= self.window_bytes):
                return
            if held and not self._retire(h, job):
                return   # a CUDA copy that cannot be ordered on a stream: it lands
            window.popleft()
            self._window_bytes_held -= nbytes

    def _retire(self, h: MovedHandle, job) -> bool:
        """Drop ``h``'s source now, ordering its reuse after its copy (NOTE
        [In-flight window]); ``False`` if that would need a host wait on a
        CUDA copy (nothing done)."""
        staged = getattr(job, "host_view", None)
        if job.order_after_copy():
            if h.src._version != h.version:
                h.tainted = True   # NOTE [Copy landed]; the staging is not needed
                if staged is not None and h.lease is not None:
                    h.lease.release()
            elif staged is not None:
                h.host = staged    # NOTE [Staged moves]
            h.src = None
            return True
        if h.layout.device.type == "cuda":
            return False
        if staged is None:
            self._wait_landed(h)
            return True
        try:
            job.wait_copied()
        except Exception:
            pass   # reported through job.failed() when it lands
        self._drop_copied_sources()
        if h.src is not None and not h.failed:   # the copy failed: the move is over
            self._wait_landed(h)
        return True

    def _drop_copied_sources(self) -> None:
        """NOTE [Staged moves]: drop the sources already copied to staging (in
        order: one side stream completes its copies in order)."""
        uncopied = self._uncopied
        while uncopied:
            ref, job = uncopied[0]
            h = ref()
            copied = False
            if h is not None and h.src is not None and not h.failed:
                copied = job.copied()
                if not copied and not job.done():
                    return   # not copied yet
            uncopied.popleft()
            # Gone, landed, failed with its source kept, or over without a copy:
            # landing decides. A copied move that is over but not landed yet
            # (writes finish out of order) drops its source here all the same.
            if h is None or h.src is None or h.failed or not copied:
                continue
            if h.src._version != h.version:
                # Torn copy: backward raises; the staging is not needed.
                h.tainted = True
                if h.lease is not None:
                    h.lease.release()
            else:
                h.host = job.host_view
            h.src = None

    def _landed(self, ref, job) -> None:
        h = ref()
        if h is None or (h.src is None and h.host is None):   # died, or already landed
            return
        error = job.failed()
        if error is not None:
            # The move failed (e.g. EIO): the source is still here, so the
            # tensor simply stays on its device, as if kept; or only its staged
            # copy is (NOTE [Staged moves]), and stays with the handle.
            h.failed = True
            if h.host is None and h.lease is not None:
                h.lease.release()
            self._on_failure(h, error)
            return
        if h.src is not None:
            if h.src._version != h.version:
                h.tainted = True
            h.src = None
        h.host = None
        if h.lease is not None:
            h.lease.release()

    def _on_failure(self, h: MovedHandle, error: BaseException) -> None:
        h.step.move_failed()
        if not self._warned_failure:
            self._warned_failure = True
            _log.warning("%s; the tensor stays %s (counted in stats.budget_fallbacks; "
                         "shown once)", error, _where_kept(h))

    def _land_first(self) -> None:
        ref, job = self._pending.popleft()
        try:
            job.wait_host()
        except Exception:
            pass   # reported through job.failed() in _landed
        self._landed(ref, job)

    def drain(self) -> None:
        self.launch()
        with self._lock:
            while self._pending:
                self._land_first()
            self._uncopied.clear()
            self._window.clear()
            self._window_bytes_held = 0

    def _wait_landed(self, h: MovedHandle) -> None:
        with self._lock:
            while h.src is not None and not h.failed and self._pending:
                self._land_first()

    @staticmethod
    def _from_host(h: MovedHandle, host: torch.Tensor) -> tuple:
        """The tensor rebuilt from its staged copy ``host`` (NOTE [Staged moves]).
        On CUDA the copy is queued on the current stream (where the tensor is
        allocated and consumed), and the staging buffer's lease holds it back
        from its pool until that copy is done."""
        layout = h.layout
        dev = torch.empty(layout.pad + layout.numel, dtype=layout.dtype, device=layout.device)
        if not dev.is_cuda:
            dev[layout.pad:].copy_(host)
            return layout.rebuild(dev), None
        stream = torch.cuda.current_stream(layout.device)
        dev[layout.pad:].copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        h.lease.hold_until(done)
        # For the other consumers of this pass (the first is on ``stream``).
        return layout.rebuild(dev), CudaJob(done, layout.device, stream, stream)

    # -- backward -----------------------------------------------------------
    def prefetch(self, h: MovedHandle):
        """Start restoring ``h``: ``True`` if started; ``False`` if it needs none
        (on its way, failed or tainted); ``None`` if its move out has not landed
        yet (the prefetcher waits there rather than skipping it);
        :data:`~tiermem.runtime.prefetch.HELD` if its source is held by the tail hold."""
        if h.failed or h.tainted or h.restore is not None or h.cached is not None:
            return False
        tail = h.tail
        if tail is not None and tail._version == h.version:
            return HELD   # in the window until taken (NOTE [Tail hold], 4)
        if h.src is not None or h.host is not None:
            return None
        h.restore = self._restore(h)
        return True

    def _restore(self, h: MovedHandle):
        dev, job = self._start_restore(h)
        h.last_job = job
        return dev, job

    def take(self, h: MovedHandle, more_uses: int):
        """``(tensor, None)`` or ``(None, finish)``: ``finish()`` waits for the
        restore (outside the prefetcher's lock) and returns the tensor.
        ``more_uses``: uses of ``h`` still to come in this backward pass (they
        get the same restore)."""
        if self._unlaunched:
            self.launch()   # every op of the forward has run
        self.poll()
        tail = h.tail
        if tail is not None:   # NOTE [Tail hold] in runtime/tailhold.py, 3
            if more_uses <= 0:
                h.tail = None
            if (tail._version == h.version and not h.tainted
                    and not h.step.params_may_be_freed):   # rule 6: none after all
                h.step.tail_taken()
                return (h.layout.dense(tail) if h.layout.compact else tail), None
            h.tail = None
        if h.src is not None and not h.failed:
            if h.src._version == h.version:
                # Not landed yet: the original is still here and unchanged.
                # A compact copy is dense: give a dense copy of the original,
                # so that backward sees the same layout whatever the timing.
                return (h.layout.dense(h.src) if h.layout.compact else h.src), None
            self._wait_landed(h)
        if h.failed and h.src is not None:
            check_version(h.src, h.version, h.module)
            return h.src, None
        if h.tainted:
            raise TierMemError(
                f"tiermem: a tensor saved for backward (shape {list(h.layout.size)}, "
                f"{h.layout.dtype}{' in module ' + h.module if h.module else ''}) was "
                "modified by an in-place operation while tiermem was moving it to the "
                f"{self.tier.value} tier; autograd would raise here too. Clone it "
                "before modifying it.")
        cached = h.cached
        if cached is not None:   # a tensor saved by several ops: restored once
            if more_uses <= 0:
                h.cached = None
        elif h.host is not None:
            with self._lock:   # no landing may give the buffer back meanwhile
                host = h.host
                cached = None if host is None else self._from_host(h, host)
            # Staged, and its move failed or has not landed: NOTE [Staged moves].
            if cached is not None and more_uses > 0:
                h.cached = cached
        if cached is not None:
            # Each consumer is ordered after the copy, on its own stream (the
            # consumers of one tensor may run on different streams).
            out, job = cached
            return (out, None) if job is None else (None, _Ordered(out, job))
        prefetched = h.restore is not None
        start_s = 0.0
        # NOTE [Stall on the GPU's timeline] in planner/runtime.py: None
        # unless this step's restore waits are timed on the GPU.
        gpu_wait = h.step.gpu_wait_start(h.layout.device)
        if not prefetched:
            # Read on demand: starting it (buffer, submission) is part of the
            # unpack's wait too (counted in stall_seconds by _Waited).
            t0 = time.perf_counter()
            h.restore = self._restore(h)
            start_s = time.perf_counter() - t0
        dev, job = h.restore
        h.restore = None
        out = h.layout.rebuild(dev)
        if more_uses > 0:
            # For the other consumers of this pass (each orders itself after the copy).
            h.cached = (out, job)
        return None, _Waited(out, dev, job, h.step, prefetched, start_s, gpu_wait)

    # -- release --------------------------------------------------------------
    def _release(self, h: MovedHandle) -> None:
        """Give back what a dying ``h`` holds. It may run again after an
        interruption, or on two threads: every step is idempotent or claimed
        first (NOTE [Interrupted releases], rule 3)."""
        if h.released:
            return
        h.tail = None
        if h.last_job is None:     # never launched (or its launch failed)
            h.src = None
            reservation, h.slot = h.slot, None   # claimed
            if reservation is not None:
                self._unreserve(reservation, h.layout)
            return
        if h.src is not None:      # died before its move out landed (last_job is that move)
            h.last_job.abandon(h.src)
            h.src = None
        h.host = None
        if h.lease is not None:    # the pool may reuse it once the move is over
            h.lease.release()      # idempotent
            h.lease = None
        h.cached = None
        if h.restore is not None:  # prefetched, never consumed
            dev, job = h.restore
            job.abandon(dev)
            h.restore = None
        if not h.released:
            h.released = True      # claimed
            self._free(h)


def _storage_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage (what holding ``t`` holds)."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0


class _Ordered:
    """``finish`` of a restore already made: order the consumer after its copy."""

    __slots__ = ("out", "job")

    def __init__(self, out: torch.Tensor, job) -> None:
        self.out, self.job = out, job

    def __call__(self) -> torch.Tensor:
        self.job.order_before_use(self.out)
        return self.out


class _Waited:
    """``finish`` of a restore taken now: wait for it, and report the wait
    (``start_s``: the seconds the unpack spent starting it, for a read on
    demand; they count as stall too). ``gpu_wait``: a CUDA timing event
    recorded on the consumer's stream before the unpack started or waited
    for the restore, when the step times its waits on the GPU (NOTE [Stall
    on the GPU's timeline] in planner/runtime.py), else ``None``."""

    __slots__ = ("out", "dev", "job", "step", "prefetched", "start_s", "gpu_wait")

    def __init__(self, out: torch.Tensor, dev: torch.Tensor, job, step,
                 prefetched: bool, start_s: float = 0.0, gpu_wait=None) -> None:
        self.out, self.dev, self.job, self.step = out, dev, job, step
        self.prefetched = prefetched
        self.start_s = start_s
        self.gpu_wait = gpu_wait

    def __call__(self) -> torch.Tensor:
        job = self.job
        late = not job.done()
        host_wait = late and not job.host_ready()   # else at most a GPU-side wait
        t0 = time.perf_counter()
        job.order_before_use(self.dev)
        self.step.restored(self.prefetched, self.start_s + time.perf_counter() - t0, late,
                           host_wait)
        if self.gpu_wait is not None:
            self.step.gpu_wait_end(self.gpu_wait, self.dev.device)
        return self.out
