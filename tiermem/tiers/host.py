"""The ``cpu`` tier: saved tensors copied to host buffers, restored ahead of need.

The move out is a copy into a pooled host buffer (pinned for CUDA tensors) on
the copier (side stream / worker thread); the restore a copy back. Landing,
in-place safety, prefetch and release are :class:`~.moving.MovingStore`'s.
"""

from __future__ import annotations

import torch

from ..memory.hostpool import HostPool
from ..policy import Tier
from ..runtime.copier import copier_for
from .base import Layout
from .moving import MovedHandle, MovingStore

__all__ = ["HostStore"]


class HostStore(MovingStore):
    """Host-memory tier for CUDA and CPU tensors, within ``budget_bytes``.

    ``slot`` of a handle: ``(buffer, typed view of its first nbytes, pinned)``.
    """

    tier = Tier.CPU

    def __init__(self, budget_bytes: int) -> None:
        super().__init__()
        self.pool = HostPool(budget_bytes)
        self._copiers: dict = {}

    @property
    def in_use_bytes(self) -> int:
        """Host bytes held by live handles."""
        return self.pool.in_use_bytes

    @property
    def held_bytes(self) -> int:
        """Host bytes held, in use or pooled (what the budget bounds)."""
        return self.pool.held_bytes

    def _reserve(self, layout: Layout, t: torch.Tensor):
        """A pooled host buffer (pinned for a CUDA tensor), or ``None``: full."""
        pinned = t.is_cuda
        buf = self.pool.acquire(layout.nbytes, pinned=pinned)
        return None if buf is None else (buf, pinned)

    def _launch(self, src: torch.Tensor, layout: Layout, reservation):
        buf, pinned = reservation
        try:
            host_view = buf[:layout.nbytes].view(layout.dtype)
            job = copier_for(src.device, self._copiers).copy_out(layout.source(src),
                                                                  layout.dest_view(host_view))
        except BaseException:
            self.pool.release(buf, None, pinned)
            raise
        return (buf, host_view, pinned), job

    def _unreserve(self, reservation, layout: Layout) -> None:
        buf, pinned = reservation
        self.pool.release(buf, None, pinned)   # lock-free (finalizers)

    def _start_restore(self, h: MovedHandle):
        layout = h.layout
        return copier_for(layout.device, self._copiers).restore(h.slot[1], layout.pad,
                                                                layout.dtype)

    def _free(self, h: MovedHandle) -> None:
        self.pool.release(h.slot[0], h.last_job, h.slot[2])

    def _held_bytes(self) -> int:
        return self.pool.in_use_bytes

    def trim_idle(self) -> None:
        self.pool.trim_when_idle()
        self.pool.start_step()

    def close(self) -> None:
        self.drain()
        self.pool.clear()
