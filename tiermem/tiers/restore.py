"""The backward side of the moving tiers (cpu, nvme): prefetch and take.

``take`` is called by the unpack hook under the prefetcher's lock: the restore
was usually started ahead of need by the
:class:`~tiermem.runtime.prefetch.Prefetcher` (through ``prefetch``); ``take``
returns the rebuilt tensor, or a finisher (``_Ordered``, ``_Waited``) that
orders the consumer after the copy, run by the hook outside the lock. The store
reports to the step it was given at ``put`` (``handle.step``,
:class:`~tiermem.tiers.base.StepEvents`).
"""

from __future__ import annotations

import time

import torch

from ..errors import TierMemError
from ..runtime.jobs import CudaJob
from ..runtime.prefetch import HELD
from .keep import check_version
from .moved_handle import MovedHandle

__all__ = ["RestoreSide"]


class RestoreSide:
    """The backward half of :class:`~.moving.MovingStore`, mixed into it (ahead
    of :class:`~.base.TierStore`). It uses the store's ``_lock``, ``tier``,
    ``_unlaunched``, ``launch``, ``poll``, ``_wait_landed`` (the forward side's
    landing) and ``_start_restore`` (the subclass step)."""

    @staticmethod
    def _from_host(h: MovedHandle, host: torch.Tensor) -> tuple:
        """The tensor rebuilt from its staged copy ``host`` (NOTE [Staged moves]
        in moving.py). On CUDA the copy is queued on the current stream (where
        the tensor is allocated and consumed), and the staging buffer's lease
        holds it back from its pool until that copy is done."""
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
            # Staged, and its move failed or has not landed: NOTE [Staged moves]
            # in moving.py.
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
