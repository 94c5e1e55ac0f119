"""What a step's decider hands the runtime (the per-step protocol,
``StepDecider`` in tiermem/deciders.py): :class:`Tracking`, what the step
tracks, and :class:`StepObserver`, the events a watcher of the step (a
profile, the timing of restore waits) subscribes to. Values and no-op
defaults only: defined here, below both the runtime and the planner, so that
either may use them and neither names the other."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

__all__ = ["Tracking", "StepObserver", "NO_TRACKING", "KEPT_NEW", "KEPT_HIT", "NO_INDEX",
           "INDEXED", "KICK"]

#: ``StepDecider.keep_at``: keep the tensor as the step's next index / as a
#: dedup hit taking no index (0: not decided there).
KEPT_NEW, KEPT_HIT = 1, 2
#: ``StepDecider.decide``'s ``how``: no index taken / the next index taken /
#: the next index taken, and a kept handle starts the restores.
NO_INDEX, INDEXED, KICK = 0, 1, 2


class Tracking(NamedTuple):
    """What one step tracks (NOTE [Scoped tracking] in tracking/modules.py).

    ``whole``: producers over the whole forward (recipes of recompute,
    ``TensorInfo.op``); ``op_names``: something reads the names of ops that
    are not recomputable (a callable policy, a profile, hints);
    ``profiled``: the step is profiled (module names, op counts and the torch
    calls recorded with the producers). Unless ``whole``: ``modules``, the
    modules to track in (``None``: none), and per module of them ``ops``
    (op names recorded), ``calls`` (torch calls tracked in) and ``direct``
    (calls recorded whole), each ``None`` for all. ``follows``: a step of a
    named policy with recompute first, which may record in full only the ops
    its recompute tier learned (NOTE [Records learned by position] in
    tiers/positions.py)."""

    whole: bool = False
    op_names: bool = False
    profiled: bool = False
    modules: Optional[Any] = None
    ops: Optional[dict] = None
    calls: Optional[dict] = None
    direct: Optional[dict] = None
    follows: bool = False


#: A step that tracks nothing of its own.
NO_TRACKING = Tracking()


class StepObserver:
    """Watches one step's events; every method here does nothing. A step's
    observers come from its decider (``StepDecider.observers``) and are called
    in order; a step without any pays one falsy check per event site.

    ``times_gpu_waits``: the step times each restore wait on the consumer's
    CUDA stream and reports the pair of events (:meth:`gpu_wait`)."""

    times_gpu_waits = False

    def started(self, step) -> None:
        """The step is set up (its ``stats`` and ``producers`` exist) and its
        forward begins now."""

    def hit(self, handle: Any) -> None:
        """The tensor at the next pack position was a dedup hit of ``handle``
        (a step its decider places)."""

    def placed(self, index: int, handle: Any) -> None:
        """Tensor ``index`` (``TensorInfo.index``) got ``handle``."""

    def wrap_unpack(self, unpack: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The unpack hook autograd calls for this step, given the one it
        would call (``unpack``)."""
        return unpack

    def wrap_leaf_unpack(self, unpack: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The unpack of a recipe's leaf (``Step.unpack``), given ``unpack``."""
        return unpack

    def gpu_wait(self, start: Any, end: Any) -> None:
        """With ``times_gpu_waits``: a restore wait queued on a CUDA stream
        between timing events ``start`` and ``end``."""
