"""What one step tracks: the producer mode, the scope it runs in, and a
profile's namer of torch calls, chosen from the step decider's answer
(``StepDecider.tracking``, tiermem/deciders.py) and what live wrapped blocks
need (tiermem/blocks.py asks; this layer does not import it)."""

from __future__ import annotations

from typing import Optional, Tuple

from .modules import TrackingScope
from .producers import CallRecorder, ProducerMode

__all__ = ["step_tracking"]


def step_tracking(tracks, blocks_must: bool, blocks_recompute: bool
                  ) -> Tuple[Optional[ProducerMode], Optional[TrackingScope],
                             Optional[CallRecorder]]:
    """``(producers, scope, calls)`` for a step. ``tracks``: the decider's
    answer (``whole``, ``modules``, ``profiled``, ``op_names``, ``ops``,
    ``calls``, ``direct``); ``blocks_must``: a live wrapped block's policy is
    ``MUST_RECOMPUTE`` (tracking runs over the whole forward);
    ``blocks_recompute``: a live wrapped block's policy may recompute.

    ``producers`` is None when nothing is tracked; ``scope`` is None when
    tracking runs over the whole forward or not at all (NOTE [Scoped
    tracking] in tracking/modules.py); ``calls`` is set in a profiled step
    only (NOTE [Tracking inside torch calls] in tracking/modules.py)."""
    # Whether anything reads the names of ops that are not recomputable: the
    # decider's (TensorInfo.op of a callable policy, a profile, hints), the
    # reasons in stats.recompute_fallback_reasons (wrapped blocks) and a
    # MUST_RECOMPUTE error (NOTE [Recording only what recipes use] in
    # tracking/producers.py).
    op_names = bool(tracks.op_names or blocks_must or blocks_recompute)
    if tracks.whole or blocks_must:
        producers = ProducerMode(module_names=tracks.profiled, names=op_names)
        producers.follows = tracks.follows and not (blocks_must or blocks_recompute)
        calls = CallRecorder(producers) if tracks.profiled else None
        return producers, None, calls
    if not (tracks.modules or blocks_recompute):
        return None, None, None
    producers = ProducerMode(names=op_names)
    producers.alias_index = True   # NOTE [Views made inside untracked calls] in tracking/producers.py
    scope = TrackingScope(producers, tracks.modules or (), blocks_recompute, ops=tracks.ops,
                          calls=tracks.calls, direct=tracks.direct)
    return producers, scope, None
