"""The writes of the forward that producer tracking watches for the recompute
tier: an op writing to the storage of a dropped tensor taints its handle (NOTE
[Writes to dropped tensors]); one writing to a tensor a recipe holds as it is
makes the recipe take a copy first (NOTE [Writes to recipe inputs]).
:class:`WriteWatch` is the part of the producer mode that does it."""

from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .ops import _OpInfo
from .records import _plain

__all__ = ["WriteWatch"]


class WriteWatch:
    """The storages a producer mode watches for writes (a mixin of
    :class:`~tiermem.tracking.producers.ProducerMode`, whose handler calls
    :meth:`_note_writes` before each op that writes to an argument)."""

    def __init__(self) -> None:
        super().__init__()
        #: storage cdata -> [weakref to a dropped tensor's handle]: see NOTE
        #: [Writes to dropped tensors].
        self._watched: dict = {}
        #: storage cdata -> [weakref to a handle whose recipe holds a tensor on
        #: it as it is]: see NOTE [Writes to recipe inputs].
        self._watched_inputs: dict = {}

    def watch(self, t: torch.Tensor, handle) -> None:
        """Mark ``handle.tainted`` if an op of this forward writes to ``t``'s storage.

        # NOTE [Writes to dropped tensors]
        # A dropped (recompute) tensor is not held, so its version cannot be
        # checked at unpack once the program has let go of it. Autograd raises
        # when a saved tensor, or any view sharing its version counter, was
        # written in place after the save; the mode sees every write of the
        # forward, so it taints the handles of tensors on the written storage
        # (views of one base share both), and unpack raises as autograd would.
        """
        # The weak storage ref is kept: it pins the storage object's address,
        # so a later storage cannot be mistaken for this one.
        ref = StorageWeakRef(t.untyped_storage())
        entry = self._watched.get(ref.cdata)
        if entry is None:
            entry = self._watched[ref.cdata] = (ref, [])
        entry[1].append(weakref.ref(handle))

    def watch_input(self, t: torch.Tensor, leaf) -> None:
        """Call ``leaf.snapshot(copies)`` before an op of this forward writes to
        ``t``'s storage (``copies``: shared by the leaves of one write).

        # NOTE [Writes to recipe inputs]
        # A recipe holds parameters and leaves that require grad as they are
        # (NOTE [What a recipe holds]): they are not modified during a forward
        # pass, as a rule. Some programs do: nn.Embedding(max_norm=...) renorms
        # its weight in place at each call, a leaf may be written through a
        # .detach() alias. Autograd does not mind (it did not save them), so
        # neither may tiermem: the mode sees the write before it happens, and
        # each recipe leaf holding that tensor as it is takes a copy of its
        # values of now (one copy per tensor and write, shared by the leaves),
        # so the recipe regenerates exactly what the forward computed. Writes
        # after the forward (a ``.data`` change before backward) are not seen.
        """
        ref = StorageWeakRef(t.untyped_storage())
        entry = self._watched_inputs.get(ref.cdata)
        if entry is None:
            entry = self._watched_inputs[ref.cdata] = (ref, [])
        entry[1].append(weakref.ref(leaf))

    def _note_writes(self, info: _OpInfo, args, kwargs) -> None:
        """Before ``info``'s op runs on ``args`` and ``kwargs``: taint the
        handles on the storages it writes to, snapshot the recipe leaves there."""
        for i, name in info.written:
            t = args[i] if i < len(args) else kwargs.get(name)
            if not isinstance(t, torch.Tensor) or not _plain(t):
                continue
            key = self._taint(t)
            entry = self._watched_inputs.pop(key, None)
            if entry is not None:   # after the write these leaves hold copies
                copies: dict = {}
                for ref in entry[1]:
                    leaf = ref()
                    if leaf is not None:
                        leaf.snapshot(copies)

    def _taint(self, t: torch.Tensor) -> int:
        """Mark the handles of dropped tensors on ``t``'s storage written (NOTE
        [Writes to dropped tensors]); returns the storage's key."""
        key = StorageWeakRef(t.untyped_storage()).cdata
        entry = self._watched.get(key)
        if entry is not None:
            for ref in entry[1]:
                h = ref()
                if h is not None:
                    h.tainted = True
        return key

    def _clear_watched(self) -> None:
        self._watched.clear()
        self._watched_inputs.clear()
