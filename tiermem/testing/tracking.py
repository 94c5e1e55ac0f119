"""Seams into producer tracking and the recompute tier: what a producer
mode holds, how it finds a view's record, the generator a random call draws
from, and a recorded call replayed as the recompute tier replays it."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from ._patch import patched

__all__ = [
    "records_held",
    "alias_index_size",
    "no_alias_records",
    "generator_of_call",
    "replay_call",
    "kept_recomputed",
    "before_replayed_ops",
    "running_module",
    "step_producer_mode",
    "ops_in_full",
    "follow_learned_positions",
    "following_learned_positions",
    "forward_kinds_kept",
]


def records_held(mode) -> int:
    """How many tensors' records a :class:`~tiermem.tracking.producers.ProducerMode`
    holds now (0 after ``clear()``)."""
    return len(mode._records)


def ops_in_full(mode) -> int:
    """How many ops ``mode`` (a ProducerMode) has recorded in full (a recipe
    can run them again), not by name only, since it was made."""
    return mode.ops_in_full


def follow_learned_positions(off, enabled: bool) -> None:
    """Whether steps of ``off`` (a named policy) may follow the positions their
    recompute tier learned (NOTE [Records learned by position] in
    tiers/positions.py; on by default); off, every step records every
    recomputable op."""
    from ..policy import Tier
    off._placement.stores[Tier.RECOMPUTE].positions.enabled = bool(enabled)


def following_learned_positions(off) -> bool:
    """Whether the step of ``off`` under way follows learned positions (records
    in full only the ops the last learning step of its kind of forward used):
    known once the step's first op has run, ``False`` before."""
    from ..policy import Tier
    return off._placement.stores[Tier.RECOMPUTE].positions.following


def forward_kinds_kept(off) -> int:
    """How many kinds of forward the recompute tier of ``off`` keeps learned
    positions and refusals of (NOTE [Records learned by position], rule 4)."""
    from ..policy import Tier
    return len(off._placement.stores[Tier.RECOMPUTE].positions.kinds)


def alias_index_size(mode) -> int:
    """How many storages the alias index of ``mode`` (a ProducerMode) holds:
    where a view's record is found by its storage (0 unless asked for)."""
    return len(mode._by_storage)


@contextlib.contextmanager
def no_alias_records() -> Iterator[None]:
    """While inside, a producer mode finds no record of a tensor through its
    storage (a view of a recorded tensor has none). Process-wide."""
    from ..tracking.producers import ProducerMode
    with patched(ProducerMode, "_alias_record", lambda self, t: None):
        yield


def generator_of_call(args: tuple, kwargs: dict):
    """The generator a random call with ``args`` and ``kwargs`` draws from
    (a ``device`` argument first, then the tensors' device), as a producer
    mode captures it; ``None`` if none is known (the call is then not
    recomputable)."""
    from ..tracking.rng import capture_rng
    captured = capture_rng(args, kwargs)
    return None if captured is None else captured[0]


def replay_call(record, args: tuple) -> torch.Tensor:
    """Run a call a producer mode recorded whole (``record``: its
    :class:`~tiermem.tracking.producers.Record`) on ``args`` as the recompute
    tier replays it: ``record.func`` with ``record.kwargs``, the generator set
    to the state it drew from (``record.rng``) and put back afterwards."""
    from ..tiers.recompute import _Node, _run
    node = _Node()
    node.func, node.args, node.kwargs, node.out_index, node.rng = (
        record.func, tuple(args), dict(record.kwargs), None, record.rng)
    return _run(node, None)


def kept_recomputed(out: torch.Tensor):
    """What the recompute tier keeps of a regenerated tensor ``out`` for its
    other consumers in the same backward pass: ``.out``; ``.event``, recorded
    on the current stream (``None`` for a CPU tensor); ``.for_current_stream()``,
    the tensor ordered after that event on the caller's stream."""
    from ..tiers.recompute import _Cached
    return _Cached(out)


@contextlib.contextmanager
def before_replayed_ops(fn: Callable[[], Any]) -> Iterator[None]:
    """While inside, ``fn()`` runs before each op the recompute tier replays,
    on the thread and stream that replay it. Process-wide."""
    from ..tiers import recompute
    run = recompute._run

    def before(node, step):
        fn()
        return run(node, step)

    with patched(recompute, "_run", before):
        yield


def running_module() -> str:
    """The qualified name of the innermost module running on this thread as
    the module tracker sees it (``""``: none, or the tracker is off: a step
    that keeps everything runs without it)."""
    from ..tracking.modules import current_module
    return current_module()


@contextlib.contextmanager
def step_producer_mode(cls: type) -> Iterator[None]:
    """Steps that begin inside make their producer mode from ``cls``, a
    subclass of :class:`~tiermem.tracking.producers.ProducerMode` (to count or
    observe what they track), instead of the class itself."""
    from ..tracking import setup
    from ..tracking.producers import ProducerMode
    if not (isinstance(cls, type) and issubclass(cls, ProducerMode)):
        raise TypeError(f"step_producer_mode: {cls!r} is not a subclass of ProducerMode")
    with patched(setup, "ProducerMode", cls):
        yield
