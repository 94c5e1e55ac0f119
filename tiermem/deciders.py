"""Deciders: who answers "which tiers, in which order" for an Offloader's steps.

The runtime (hooks, step, placement, tiers) never names the planner: an
Offloader holds one :class:`Decider` and its steps call it; nothing calls
back. The protocol, per step:

- ``begin_step(unpack)``: the step's *planning*, the per-step object the pack
  hook asks for a tensor's order (``order``, ``kept_at``, ``block``), or
  ``None``: the :class:`~tiermem.runtime.placement.Placement`'s own order (a
  named policy's tiers, or a callable policy asked per tensor) decides.
  ``unpack``: the unpack hook, which a profiling decider may wrap.
- ``tracks_producers(planning)``: whether this step tracks producers over its
  whole forward (recipes of recompute, ``TensorInfo.op``).
- ``reads_op_names``: whether anything reads the names of ops that are not
  recomputable (a callable policy, hints).
- ``end_step(planning, stats, failed)``: the step's forward is over (``failed``:
  it raised).
- ``settle()``: what the next step follows (``Offloader.plan``): a plan, or
  ``None`` for deciders without one.

Implemented by :class:`PolicyDecider` (a named or callable policy), the
planner (:class:`~tiermem.planner.Planner`, ``policy="auto"``), and, per
block, the ``wrap_blocks`` scope (:data:`tiermem.blocks.BLOCK_SCOPE`: the tier
order of the innermost wrapped block running, which the pack hook takes before
the step's decider, and the contexts a ``checkpoint="auto"`` block asks).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from .config import Config
from .errors import ConfigError
from .policy import AUTO, resolve_policy

__all__ = ["Decider", "PolicyDecider", "make_decider", "check_hints"]


class Decider(Protocol):
    """See the module docstring."""

    reads_op_names: bool

    def begin_step(self, unpack: Callable[[Any], Any]) -> Optional[Any]: ...

    def tracks_producers(self, planning: Optional[Any]) -> bool: ...

    def end_step(self, planning: Optional[Any], stats, failed: bool) -> None: ...

    def settle(self) -> Optional[Any]: ...


class PolicyDecider:
    """A named or callable policy: the placement's order decides every tensor
    (no per-step planning); producers are tracked when a recipe may be needed
    or a callable policy may read ``TensorInfo.op``."""

    reads_op_names = True

    def __init__(self, tracks: bool) -> None:
        self._tracks = tracks

    def begin_step(self, unpack) -> None:
        return None

    def tracks_producers(self, planning) -> bool:
        return self._tracks

    def end_step(self, planning, stats, failed: bool) -> None:
        return None

    def settle(self) -> None:
        return None


def make_decider(cfg, placement, hints=None) -> Decider:
    """The decider of an Offloader with settings ``cfg`` over ``placement``:
    the planner for ``policy="auto"`` (with its ``hints``), else the policy's."""
    _, fn = resolve_policy(cfg.policy, nvme_dir=cfg.nvme_dir)
    if fn is AUTO:
        from .planner import Planner
        return Planner(placement, cfg, hints)
    return PolicyDecider(placement.tracks_producers)


def check_hints(hints: Any, cfg: Config) -> None:
    """``ConfigError`` for a ``hints`` setting the Offloader cannot use."""
    if hints is None:
        return
    if not callable(hints):
        raise ConfigError(
            f"tiermem: hints={hints!r} is not callable; pass a function (TensorInfo) -> "
            "a CheckpointPolicy value, a tier name or list, or None (no opinion)")
    if cfg.policy != "auto":
        raise ConfigError(
            f"tiermem: hints= is advice to the auto planner, but policy={cfg.policy!r} "
            "(from the argument or TIERMEM_POLICY); use policy='auto', or answer with "
            "CheckpointPolicy values from a callable policy (policy=fn)")
