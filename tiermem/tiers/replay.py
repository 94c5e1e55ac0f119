"""Running a recipe in backward: its regenerated tensor kept for the other
consumers of one backward pass (:class:`_Cached`), and autocast off while
the recorded ops run again (:func:`_no_autocast`). Used by
:mod:`tiermem.tiers.recompute`."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["_Cached", "_no_autocast"]


class _Cached:
    """A regenerated tensor kept for the other consumers of this backward
    pass; on CUDA, with an event recorded after its recipe on the stream that
    ran it (NOTE [Recomputed for consumers on several streams])."""

    __slots__ = ("out", "stream", "event")

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.stream = self.event = None
        if out.is_cuda:
            self.stream = torch.cuda.current_stream(out.device)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def for_current_stream(self) -> torch.Tensor:
        """The tensor, ordered after its recipe on the caller's current stream."""
        out = self.out
        if self.event is not None:
            current = torch.cuda.current_stream(out.device)
            if current != self.stream:
                current.wait_event(self.event)
                out.record_stream(current)
        return out


@contextlib.contextmanager
def _no_autocast():
    """Run the recorded aten ops as recorded: autocast already inserted its
    casts in forward (they are ops of the recipe)."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if device_type == "cuda" and not torch.cuda.is_available():
                continue
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
