"""Deciders: who answers "which tiers, in which order" for an Offloader's steps.

The runtime (hooks, step, placement, tiers) never names the planner: an
Offloader holds one :class:`Decider`, and each step one :class:`StepDecider`
(or none); the runtime calls their methods, reads none of their state, and
nothing calls back. Observers (a profile, the timing of restore waits) get
the step's events (:class:`~tiermem.runtime.contract.StepObserver`).

:class:`Decider`, per Offloader:

- ``begin_step()``: the :class:`StepDecider` of a step starting now, or
  ``None``: the :class:`~tiermem.runtime.placement.Placement`'s own order (a
  named policy's tiers, or a callable policy asked per tensor) decides.
- ``tracking(planning)``: what the step tracks (a
  :class:`~tiermem.runtime.contract.Tracking`), ``planning`` being what
  ``begin_step`` gave.
- ``end_step(planning, stats, failed)``: the step's forward is over (``failed``:
  it raised); ``stats`` its :class:`~tiermem.StepStats`.
- ``settle()``: what the next step follows (``Offloader.plan``): a plan, or
  ``None`` for deciders without one.

:class:`StepDecider`, per step: its methods are the contract, in the order a
step calls them: ``tracking``, ``prefetch_bytes`` and ``observers`` when the
step is set up; per saved tensor ``keep_at`` (the planned keep's fast path;
NOTE [Planned keeps by position] in planner/runtime.py), else ``dedup_hit``
or ``decide``; ``block`` for each ``checkpoint="auto"`` block. The step
passes what a call needs (the Step, as
:class:`~tiermem.tiers.base.RecipeServices` for dedup keys and lookups) and
gets back what it must do (an order, the index to resume at); the decider
keeps no reference to the step and writes nothing of it.

Implemented by :class:`PolicyDecider` (a named or callable policy; its steps
have no StepDecider), the planner (:class:`~tiermem.planner.Planner`,
``policy="auto"``; its steps' StepDecider is the planner's
``StepPlanning``), and, per block, the ``wrap_blocks`` scope
(:data:`tiermem.blocks.BLOCK_SCOPE`: the tier order of the innermost wrapped
block running, which the pack hook takes before the step's decider, and the
contexts a ``checkpoint="auto"`` block asks).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Tuple

from .config import Config
from .errors import ConfigError
from .policy import AUTO, Tier, resolve_policy
from .runtime.contract import (INDEXED, KEPT_HIT, KEPT_NEW, KICK, NO_INDEX, StepObserver,
                               Tracking)

__all__ = ["Decider", "StepDecider", "PolicyDecider", "make_decider", "check_hints",
           "Tracking", "StepObserver", "KEPT_NEW", "KEPT_HIT", "NO_INDEX", "INDEXED", "KICK"]


class StepDecider(Protocol):
    """The decisions of one step (see the module docstring). Every tier
    order it returns is a valid placement: exactness never rests on it."""

    def tracking(self) -> Tracking:
        """What this step tracks."""

    def prefetch_bytes(self) -> Optional[int]:
        """The prefetch window of this step (``None``: the Offloader's)."""

    def observers(self) -> Tuple[StepObserver, ...]:
        """The observers of this step's events (``()``: none)."""

    def keep_at(self, t, index: int) -> int:
        """The fast path, asked first for a plain tensor at the next pack
        position, ``index`` being the step's next index: ``KEPT_NEW`` (keep
        it as tensor ``index``: the step's index moves on), ``KEPT_HIT``
        (keep it, a dedup hit taking no index) or 0: ask :meth:`decide`."""

    def dedup_hit(self) -> None:
        """The tensor at the next pack position was a dedup hit of a tensor
        this step stored (observers get it with the handle)."""

    def decide(self, index: int, t, key: tuple, nbytes: int, module: str,
               producers) -> Tuple[Optional[tuple], int]:
        """``(order, how)`` for tensor ``t`` at the next pack position
        (``key``: its dedup key; ``index``: the step's next index;
        ``producers``: the step's producer mode or ``None``). ``how``:
        ``INDEXED`` (it is tensor ``index``), ``KICK`` (the same, and a kept
        handle starts the restores: NOTE [Restores start with backward] in
        runtime/hooks.py) or ``NO_INDEX``; ``order`` ``None`` (with
        ``NO_INDEX``): keep it uncounted, a dedup hit of a tensor stored
        under another key."""

    def block(self, module: str, args: tuple, plain: Callable[[], Any],
              checkpointed: Callable[[], Any], step) -> Tuple[Any, Optional[int]]:
        """Run a ``checkpoint="auto"`` block (``plain()`` or
        ``checkpointed()``) with tensor arguments ``args`` in ``step``:
        ``(its output, the index the step resumes at, or None)``."""


class Decider(Protocol):
    """See the module docstring."""

    def begin_step(self) -> Optional[StepDecider]: ...

    def tracking(self, planning: Optional[StepDecider]) -> Tracking: ...

    def end_step(self, planning: Optional[StepDecider], stats, failed: bool) -> None: ...

    def settle(self) -> Optional[Any]: ...


class PolicyDecider:
    """A named or callable policy: the placement's order decides every tensor
    (no StepDecider); producers are tracked when a recipe may be needed or a
    callable policy may read ``TensorInfo.op``."""

    def __init__(self, tracks: bool, follows: bool = False) -> None:
        self._tracking = Tracking(whole=tracks, op_names=True, follows=tracks and follows)

    def begin_step(self) -> None:
        return None

    def tracking(self, planning) -> Tracking:
        return self._tracking

    def end_step(self, planning, stats, failed: bool) -> None:
        return None

    def settle(self) -> None:
        return None


def make_decider(cfg, placement, hints=None, order=None) -> Decider:
    """The decider of an Offloader with settings ``cfg`` over ``placement``:
    the planner for ``policy="auto"`` (with its ``hints``, and the Offloader's
    :class:`~tiermem.runtime.schedule.BackwardOrder` ``order``, whose
    ``peak_in_flight`` it reads), else the policy's."""
    _, fn = resolve_policy(cfg.policy, nvme_dir=cfg.nvme_dir)
    if fn is AUTO:
        from .planner import Planner
        return Planner(placement, cfg, hints, order)
    # Following learned positions needs every candidate to reach the recompute
    # tier: an order with recompute first (NOTE [Records learned by position]).
    return PolicyDecider(placement.tracks_producers, follows=placement.fixed is Tier.RECOMPUTE)


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
