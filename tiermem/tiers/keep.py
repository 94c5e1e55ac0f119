"""The ``keep`` tier: the tensor stays where it is, as autograd would keep it."""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import TierMemError
from ..policy import Tier
from .base import TierStore

__all__ = ["KeepStore", "Kept", "KickKept", "MarkedKept", "check_version"]


class Kept:
    """Handle of a kept tensor.

    Holds ``t.detach()``, never ``t`` itself: a saved *output* holds its grad_fn,
    which holds this handle, and that cycle runs through C++ autograd nodes that
    Python's collector cannot see (measured: identity hooks leak every saved
    output). ``detach`` shares storage and version counter, so the in-place
    check below still sees writes made through ``t``.

    The pack hook sets ``tensor`` to ``t`` itself when ``t`` is a parameter or
    another leaf (no grad_fn, so no cycle): plain autograd holds a saved leaf
    itself, so after ``p.data = new`` between forward and backward its
    backward reads the new storage, and so must ours (an alias would keep
    reading the old one). A recipe, which must read the forward's values,
    holds an alias instead (NOTE [Parameters changed before backward] in
    tracking/params.py).
    """

    __slots__ = ("tensor", "version", "module", "__weakref__")

    def __init__(self, t: torch.Tensor, module: str) -> None:
        self.tensor = t.detach()
        self.version = t._version
        self.module = module

    @classmethod
    def leaf(cls, t: torch.Tensor) -> "Kept":
        """The handle of a leaf (a parameter, or a tensor without a grad_fn
        that requires grad), holding ``t`` itself: see the class docstring."""
        kept = cls.__new__(cls)
        kept.tensor = t
        kept.version = t._version
        kept.module = ""
        return kept


class KickKept:
    """Handle of a kept tensor whose first unpack starts its step's restores
    (unless they started already): in a planned step the one backward unpacks
    first, in a step without a plan each kept tensor packed after the first
    moved one. ``kept``: the kept handle; ``step``: the step whose prefetcher
    it kicks; ``top``: restores start from the moved tensors packed before
    that position (``Prefetcher.scheduled`` when it was packed), or from the
    last packed one if ``None`` (NOTE [Restores start with backward] in
    runtime/hooks.py).

    Only autograd holds it; the step's dedup table and recipes hold ``kept``,
    so every other use of the tensor sees a plain :class:`Kept`.
    """

    __slots__ = ("kept", "step", "top", "__weakref__")

    def __init__(self, kept: Kept, step, top: Optional[int] = None) -> None:
        self.kept = kept
        self.step = step
        self.top = top

    def unpack(self) -> torch.Tensor:
        """Start the step's restores (the first time), then unpack as :class:`Kept`."""
        step = self.step
        if step is not None:
            self.step = None
            step.note_backward()   # NOTE [Backward order] in runtime/schedule.py
            prefetcher = step.prefetcher
            if not prefetcher.started:   # else the kick would do nothing
                with prefetcher.lock:
                    prefetcher.kick(self.top)
        return _checked(self.kept)


class MarkedKept:
    """Handle of a step's first saved tensor when it is kept: its first
    unpack tells the step that its backward runs (NOTE [Backward order] in
    runtime/schedule.py, 1), then unpacks as :class:`Kept`. Only autograd
    holds it; the step's dedup table and recipes hold ``kept``."""

    __slots__ = ("kept", "step", "__weakref__")

    def __init__(self, kept: Kept, step) -> None:
        self.kept = kept
        self.step = step

    def unpack(self) -> torch.Tensor:
        step = self.step
        if step is not None:
            self.step = None
            step.note_backward()
        return _checked(self.kept)


def _checked(kept: Kept) -> torch.Tensor:
    """``kept``'s tensor, as its unpack returns it (NOTE [In-place check])."""
    t = kept.tensor
    if t._version != kept.version:
        check_version(t, kept.version, kept.module)
    return t


def check_version(t: torch.Tensor, saved_version: int, module: str) -> None:
    """Raise as autograd would if ``t`` was modified in place since it was saved.

    # NOTE [In-place check]
    # With any saved-tensor hooks active, autograd skips its own version check
    # (identity hooks + ``y = x.exp(); y.add_(1)`` give a silently wrong
    # gradient). Every tier therefore records ``t._version`` at pack: the keep
    # tier compares it at unpack (here); copying tiers compare it when their copy
    # has landed (see NOTE [Copy landed] in tiers/moving.py).
    """
    if t._version != saved_version:
        where = f" in module {module}" if module else ""
        raise TierMemError(
            f"tiermem: a tensor saved for backward (shape {list(t.shape)}, {t.dtype}{where}) "
            f"was modified by an in-place operation after it was saved (version "
            f"{saved_version} -> {t._version}); autograd would raise here too. Clone it "
            "before modifying it, or do the in-place operation out of place.")


class KeepStore(TierStore):
    """Keeps the tensor. Its handles are unpacked by the unpack hook itself
    (:func:`tiermem.runtime.hooks.unpack`: the in-place check above, nothing else)."""

    tier = Tier.KEEP

    def put(self, t: torch.Tensor, step=None, module: str = "") -> Kept:
        return Kept(t, module)
