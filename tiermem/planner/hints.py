"""Per-tensor hints to the ``auto`` planner: ``Offloader(policy="auto", hints=fn)``.

``fn`` has a callable policy's signature, ``(TensorInfo) -> answer``, and
answers as a policy does (a ``CheckpointPolicy`` member, a tier name, a list of
these; NOTE [CheckpointPolicy answers] in policy.py) or with ``None``: no
opinion. :class:`Hints` asks it and parses the answer; the solver
(``solver.make_plan``) obeys or weighs it."""

# NOTE [Planner hints]
# 1. ``fn`` is asked only off the plan (NOTE [Hints asked off the plan]), so an
#    answer must depend on the tensor (module, op, shape, index), not the step.
# 2. MUST_* answers are constraints in every step, profiled ones included:
#    MUST_SAVE keeps the tensor; MUST_RECOMPUTE recomputes it (``TierMemError``
#    in the forward where the recompute tier cannot take it), its recipe's
#    inputs going where the safe order sends them; MUST_CPU_OFFLOAD is cpu,
#    then keep. The solver never places them otherwise and counts what they
#    keep against the budget (a CPU tensor on the cpu tier: kept); a budget
#    they put out of reach is said in the plan's notes.
# 3. Other answers (PREFER_*, tier names, lists) are hints, followed only while
#    the budget needs bytes: a move hint's tensor moves before unhinted ones,
#    its hinted tiers first, unless the tier cannot free its memory here or is
#    full; a keep hint's moves only after every unhinted one. Each reason ends
#    "followed", "overridden: <why>" or "not followed: <why>".

# NOTE [Hints asked off the plan]
# ``fn`` is asked once per tensor that reaches the planner in a profiled step
# and in steps under the safe order (no plan yet, or the step left its plan).
# A step that follows a plan never calls it: the profile records each answer
# at its pack index and the plan bakes it into that index's tier order, so the
# hot path stays the plan lookup (NOTE [Following a plan] in
# planner/runtime.py), and a changed answer takes effect only when the step's
# shapes are profiled again. The profile ignores hints: its safe order
# measures every option, which is what lets the solver weigh them.
# ``TensorInfo.op`` is ``None`` in a safe-order step that does not track
# producers (one whose plan recomputed nothing and which left it).

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from torch.utils.checkpoint import CheckpointPolicy

from ..errors import TierMemError
from ..policy import Tier, TensorInfo, TierOrder, tier_order

__all__ = ["Hints", "hint_name", "is_move_hint"]

_SOURCE = "the hints callable"


def hint_name(choice: Any) -> str:
    """How a reason names an answer: ``PREFER_RECOMPUTE``, ``'cpu'``,
    ``[PREFER_RECOMPUTE, 'nvme']``."""
    if isinstance(choice, (list, tuple)):
        return "[" + ", ".join(hint_name(c) for c in choice) + "]"
    if isinstance(choice, CheckpointPolicy):
        return choice.name
    return repr(getattr(choice, "value", choice))


def is_move_hint(order: TierOrder) -> bool:
    """Whether a (non-MUST) hint asks to move the tensor (its first tier is
    not keep): NOTE [Planner hints], rule 3."""
    return order[0] is not Tier.KEEP


class Hints:
    """The ``hints`` callable of an auto Offloader, asked per tensor (NOTE
    [Planner hints]). ``safe``: the planner's safe order per device type, the
    order of a MUST_RECOMPUTE tensor (its recipe's inputs go to the rest)."""

    def __init__(self, fn: Callable[[TensorInfo], Any], safe: Dict[str, tuple]) -> None:
        self.fn = fn
        self.safe = safe
        self._answers: dict = {}
        self._musts: dict = {}

    def ask(self, index: int, t, nbytes: int, module: str,
            op: Optional[str]) -> Optional[Tuple[TierOrder, str]]:
        """``(order, name)`` of the answer for tensor ``index``, or ``None`` (no
        opinion). Raises ``TierMemError`` naming the answer and the tensor for
        an answer a policy could not give."""
        choice = self.fn(TensorInfo(t.shape, t.dtype, t.device, nbytes, module, op, index,
                                    False))
        if choice is None:
            return None
        key = tuple(choice) if isinstance(choice, list) else choice
        try:
            found = self._answers.get(key)
        except TypeError:   # unhashable: parsed (and refused) below
            found = None
        if found is None:
            try:
                order = tier_order(choice, source=_SOURCE)
            except TierMemError as e:
                raise TierMemError(
                    f"{e}, or None (no opinion); asked for tensor #{index} of "
                    f"{module or '<no module>'}, shape {list(t.shape)}") from None
            found = self._answers[key] = (order, hint_name(choice))
        return found

    def must_order(self, order: TierOrder, device_type: str) -> TierOrder:
        """The tier order that obeys MUST answer ``order`` for a tensor on
        ``device_type`` (rule 2 of NOTE [Planner hints])."""
        key = (tuple(order), order.hint, order.then_default, device_type)
        done = self._musts.get(key)
        if done is None:
            tiers = self.safe[device_type] if order.then_default else tuple(order)
            done = self._musts[key] = TierOrder(tiers, True, order.hint)
        return done
