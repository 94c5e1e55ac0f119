"""What every tier implements, and how a tensor's bytes are laid out when moved.

A tier is a :class:`TierStore`: ``put(t, step, module)`` takes a saved tensor
and returns a handle (or ``None`` when the tier is full, so placement falls
back); the unpack hook gives the handle back through ``take``. Handles are
owned by autograd; when autograd drops one, the tier gets its buffers back.
A tier reports what happens to the step it was given (:class:`StepEvents`),
keeps that step on its handles for backward, and reaches nothing else of the
step: the recompute tier also uses the step's :class:`RecipeServices`.
"""

# NOTE [Layout of a moved tensor]
# A restored tensor has the original sizes, strides and pointer alignment, so every
# backward kernel takes the same path and gradients stay bit-identical. We move
# the *span* of storage the tensor touches, ``[storage_offset, storage_offset + 1
# + sum((size_i - 1) * stride_i))`` (any strides: stride 0, overlapping, gapped),
# and restore with ``as_strided(size, stride)`` on the copy, ``pad`` elements in so
# the data keeps its address modulo 256 bytes on CUDA (cuBLAS(Lt) picks kernels by
# alignment up to 256; CUDA allocations are 512-aligned) and modulo 64 on the CPU
# (the CPU allocator's alignment, all CPU kernels look at). When the span is much
# larger than the tensor (a column of a big matrix), a dense copy (``compact``)
# moves instead: same values and sizes, contiguous strides; but not for a tensor
# a compiled region saved (``strides``): its compiled backward asserts the saved
# strides (inductor), and its span is no more than the storage it held anyway.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Tuple

import torch

from ..policy import Tier

#: A gapped view is moved as a dense copy when its span exceeds this many
#: times its element count. See NOTE [Layout of a moved tensor].
COMPACT_SPAN_RATIO = 2

#: Restored CUDA tensors keep the original data pointer's alignment modulo
#: this, CPU tensors modulo ``_ALIGN_BYTES_CPU`` (see NOTE [Layout of a moved
#: tensor]).
_ALIGN_BYTES = 256
_ALIGN_BYTES_CPU = 64


@dataclass(frozen=True)
class Layout:
    """How to rebuild a tensor from a flat buffer of ``numel`` elements."""

    size: torch.Size
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    numel: int          # elements moved (the span, or the dense copy)
    compact: bool       # True: a dense copy; False: the span
    pad: int = 0        # elements before the data on restore (alignment, see NOTE)
    conj: bool = False  # a lazy conjugate view: moved as its memory, the bit restored
    neg: bool = False   # a lazy negative view: likewise

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @staticmethod
    def of(t: torch.Tensor, strides: bool = False) -> "Layout":
        """``strides``: never a dense copy (NOTE [Layout of a moved tensor])."""
        size, stride = t.size(), t.stride()
        numel = t.numel()
        pad = _pad_elements(t)
        bits = (t.is_conj(), t.is_neg())
        if t.is_contiguous() or numel == 0:
            return Layout(size, stride, t.dtype, t.device, numel, False, pad, *bits)
        span = _span_elements(size, stride)
        if span > COMPACT_SPAN_RATIO * numel and not strides:
            return Layout(size, stride, t.dtype, t.device, numel, True, 0, *bits)
        return Layout(size, stride, t.dtype, t.device, span, False, pad, *bits)

    def source(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor to copy out: the span as a flat view, or ``t`` itself when
        compact; of a conj/neg view, its memory as it is (the bits are put back
        by :meth:`rebuild`, so the restored tensor is the same kind of view)."""
        if self.conj:
            t = t.conj()          # clears the bit: a view of the memory as stored
        if self.neg:
            t = t._neg_view()
        if self.compact:
            return t
        return t.as_strided((self.numel,), (1,), t.storage_offset())

    def dest_view(self, flat: torch.Tensor) -> torch.Tensor:
        """View of a flat buffer that ``source(t)`` is copied into."""
        return flat.view(self.size) if self.compact else flat

    def rebuild(self, flat: torch.Tensor) -> torch.Tensor:
        """The tensor equal to the saved one, as a view of ``flat`` (``pad + numel``
        elements, the data after the pad)."""
        if self.compact:
            out = flat.view(self.size)
        else:
            # as_strided's offset is absolute in the storage: ``flat`` may itself
            # be a view (an aligned slice of a bigger buffer).
            out = flat.as_strided(self.size, self.stride, flat.storage_offset() + self.pad)
        return self._with_bits(out)

    def dense(self, t: torch.Tensor) -> torch.Tensor:
        """A dense copy of ``t`` (saved with this layout, compact), as the
        restore would give it: same values, contiguous, the same conj/neg bits."""
        return self._with_bits(self.source(t).contiguous())

    def _with_bits(self, out: torch.Tensor) -> torch.Tensor:
        if self.neg:
            out = out._neg_view()
        if self.conj:
            out = out.conj()
        return out


def _span_elements(size, stride) -> int:
    """Elements of storage a view touches, from its first to its last."""
    return 1 + sum((n - 1) * s for n, s in zip(size, stride))


def _pad_elements(t: torch.Tensor) -> int:
    """Elements to put before the data of a copy of ``t`` so that, in a buffer
    aligned to 256 bytes, it sits at ``t``'s address modulo 256 on CUDA, 64 on
    the CPU. The address, not the storage offset: CPU storages are only
    64-aligned, and torch often puts big ones at a page plus 64 bytes, whose
    pad modulo 256 would keep every restore from disk off the direct (page-
    aligned) path."""
    itemsize = t.element_size()
    align = _ALIGN_BYTES if t.is_cuda else _ALIGN_BYTES_CPU
    try:
        address = t.data_ptr()
    except RuntimeError:   # no real storage (fake or meta tensors)
        address = t.storage_offset() * itemsize
    return address % align // itemsize


def exact_copy(t: torch.Tensor) -> torch.Tensor:
    """A private copy of ``t`` with the same sizes, strides and address
    alignment (see NOTE [Layout of a moved tensor]): its storage span is
    copied, so kernels see the same layout and alignment as on ``t``."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    size, stride = t.size(), t.stride()
    if t.numel() == 0:
        return t.clone()
    span = _span_elements(size, stride)
    offset = t.storage_offset()
    pad = _pad_elements(t)
    flat = torch.empty(pad + span, dtype=t.dtype, device=t.device)
    flat[pad:].copy_(t.as_strided((span,), (1,), offset))
    return flat.as_strided(size, stride, pad)


class StepEvents(Protocol):
    """What a tier reports to the step it was given (:class:`tiermem.runtime.step.Step`)."""

    def moved(self, handle: Any, nbytes: int) -> Any:
        """A move out started; returns the handle's prefetch entry (``handle.entry``)."""

    def dropped(self, handle: Any, nbytes: int) -> Any:
        """A tensor was dropped to be recomputed; returns its entry."""

    def held(self, tier: Tier, nbytes_held: int) -> None:
        """The store of ``tier`` now holds ``nbytes_held`` bytes in all."""

    def move_failed(self) -> None:
        """A move failed after it started (the tensor stays where it was)."""

    def restored(self, prefetched: bool, seconds: float, late: bool) -> None:
        """An unpack took a restore (started ahead of need or not) and waited for it."""

    def gpu_wait_start(self, device: torch.device) -> Any:
        """A CUDA timing event recorded now on ``device``'s current stream if
        this step times its restore waits on the GPU, else ``None``."""

    def gpu_wait_end(self, start: Any, device: torch.device) -> None:
        """The restore wait begun at ``start`` is queued on the stream."""

    def recomputed(self, seconds: float) -> None:
        """A recipe ran in backward."""


class RecipeServices(StepEvents, Protocol):
    """What the recompute tier may ask of the step (NOTE [What a recipe holds])."""

    producers: Any   # tiermem.tracking.producers.ProducerMode or None

    def lookup(self, t: Any) -> Any:
        """The handle of a tensor or Ref this step saved already, else ``None``."""

    def share(self, handle: Any) -> None:
        """One more consumer of ``handle`` per backward pass."""

    def is_stable_param(self, t: torch.Tensor) -> bool: ...

    def is_small(self, t: torch.Tensor) -> bool: ...

    def keep_handle(self, t: torch.Tensor, *, clone: bool) -> Any: ...

    def watch_param(self, held: torch.Tensor) -> Any:
        """What a parameter a recipe holds as it is (``held``, its alias) is at
        pack; passed to :meth:`check_param` before each recompute that reads it."""

    def check_param(self, watch: Any) -> None:
        """Raise if the parameter ``watch`` watches changed since pack."""

    def store_input(self, t: torch.Tensor, order: Tuple[Tier, ...]) -> Any:
        """Store a recipe's own input in the tiers of ``order``; its handle."""

    def not_recomputable(self, reason: str) -> None: ...

    def recipe_inputs_stored(self, nbytes: int) -> None: ...

    def unpack(self, handle: Any) -> torch.Tensor:
        """A recipe's leaf, unpacked as the unpack hook would."""


class TierStore:
    """Interface of a tier. Subclasses set ``tier`` and implement the methods.

    Contract: the tensor the unpack hook gets back from ``put(t, step,
    module)``'s handle equals ``t`` in values, size, dtype and device (and
    strides, see NOTE [Layout of a moved tensor]); a handle may be unpacked
    several times (``retain_graph=True``); ``put`` returning ``None`` means
    "full, try the next tier" and must leave nothing allocated.

    ``take(handle, more_uses)`` (every tier but keep, whose handles the hook
    unpacks itself) runs under the step's prefetcher lock and must not wait:
    it returns ``(tensor, None)``, or ``(None, finish)`` with ``finish()``
    doing the waiting outside the lock and returning the tensor.
    """

    tier: Tier

    def put(self, t: torch.Tensor, step: StepEvents, module: str = "") -> Optional[object]:
        raise NotImplementedError

    def take(self, handle: Any, more_uses: int) -> Tuple[Optional[torch.Tensor], Any]:
        raise NotImplementedError

    def prefetch(self, handle: Any) -> Optional[bool]:
        """Start restoring ``handle`` ahead of need (see Prefetcher.advance)."""
        return False

    def poll(self) -> None:
        """Housekeeping on the forward thread at each pack (finish landed copies)."""

    def drain(self) -> None:
        """Wait for every copy in flight (error paths and ``close``)."""

    def close(self) -> None:
        """Release pooled buffers. The store must not hold live handles' data."""
