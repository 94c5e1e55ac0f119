"""Shared logic of the tiers that move a tensor away and bring it back (cpu, nvme).

A moving store implements these steps; this base class does the rest (the
launch after the saving op, the landing check, in-place safety; prefetch and
take come from :class:`~.restore.RestoreSide`, the release from
:class:`~.moved_handle.MovedHandle`):

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

Backward (``prefetch``, ``take``): restore.py. The store reports to the step
it was given at ``put`` (``handle.step``, :class:`~tiermem.tiers.base.StepEvents`).
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
import logging
import threading
import weakref
from typing import Optional

import torch

from ..errors import TierMemError
from ..runtime.copier import copier_for
from ..tracking.modestack import in_compiled_region
from .base import Layout, TierStore
from .moved_handle import MovedHandle   # re-exported: the tiers import it from here
from .restore import RestoreSide

_log = logging.getLogger("tiermem")

__all__ = ["MovingStore", "MovedHandle"]

# The number autograd's next node will get (this thread): NOTE [Launch after the saving op].
_sequence_nr = torch._C._autograd._get_sequence_nr

#: NOTE [In-flight window]: most launched moves whose sources are held (torchtune's 5).
DEFAULT_WINDOW_TENSORS = 5
#: NOTE [In-flight window]: most bytes of sources held for launched moves (the
#: prefetcher's largest window: the same bound on bytes in flight each way).
DEFAULT_WINDOW_BYTES = 256 * 1024 ** 2


def _where_kept(h: "MovedHandle") -> str:
    """Where a tensor whose move failed stays (NOTE [Staged moves])."""
    return "on its device" if h.host is None else "in its pinned staging buffer"


class MovingStore(RestoreSide, TierStore):
    """Base of the cpu and nvme tiers; see the module docstring. The backward
    side (``prefetch``, ``take``) is :class:`~.restore.RestoreSide`'s."""

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
        # too (NOTE [Interrupted releases] in moved_handle.py, rule 3).
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


def _storage_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage (what holding ``t`` holds)."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0
