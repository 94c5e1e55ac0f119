"""The one-shot form :func:`offload` (an Offloader cached per thread and per
settings) and :func:`no_offload`, a region whose saved tensors stay put."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional

import torch

from .config import Config
from .deciders import check_hints
from .offloader import Offloader
from .tracking.hidden import hidden_hook
from .runtime.hooks import keep_pack, unpack

__all__ = ["offload", "no_offload"]

_tls = threading.local()
_CACHE_SIZE = 8

# NOTE [Fork] in offloader.py: offload()'s cache starts empty in a forked child.
def _after_fork_in_child() -> None:
    _tls.__dict__.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def offload(policy: Any = None, *, hints: Optional[Callable] = None,
            **settings: Any) -> Offloader:
    """One-shot form: ``with tiermem.offload(policy="cpu"): loss = model(x)``.

    Returns an Offloader cached per thread and per resulting :class:`Config`
    (and ``hints`` callable), so repeated calls with the same settings reuse
    the same pools.
    """
    cfg = Config.from_env(policy=policy, **settings)
    check_hints(hints, cfg)
    key = cfg if hints is None else (cfg, hints)
    cache = getattr(_tls, "cache", None)
    if cache is None:
        cache = _tls.cache = {}
        _tls.retired = []
    _close_retired()
    off = cache.get(key)
    if off is not None and off.closed:   # closed by its user: make a fresh one
        del cache[key]
        off = None
    if off is None:
        if len(cache) >= _CACHE_SIZE:
            # Evicted, but closed only once no graph of it may still unpack:
            # closing earlier would lose saved tensors (NVMe files, buffers).
            _tls.retired.append(cache.pop(next(iter(cache))))
            _close_retired()
        # The same arguments, not cfg's fields: a value from the environment
        # stays named by its variable (NOTE [Setting names in messages]).
        off = cache[key] = Offloader(policy, hints=hints, **settings)
    return off


def _close_retired() -> None:
    """Close the evicted Offloaders of this thread that nothing uses any more."""
    retired = _tls.retired
    if retired:
        keep = []
        for off in retired:
            if off.in_use:
                keep.append(off)
            else:
                off.close()
        retired[:] = keep


class no_offload(torch.autograd.graph.saved_tensors_hooks):
    """A region whose saved tensors stay where autograd puts them.

    Nested inside an Offloader it wins (the innermost hooks apply). Tensors are
    kept as plain autograd would keep them, with autograd's in-place check
    preserved: autograd skips it while saved-tensor hooks are active, so the
    unpack raises itself for a tensor modified in place since it was saved.
    """

    def __init__(self) -> None:
        super().__init__(hidden_hook("keep", keep_pack), hidden_hook("unpack", unpack))
