"""Tiers, what a policy sees (:class:`TensorInfo`) and the built-in policies.

A policy answers, per saved tensor, with a :class:`Tier`, a tier name
(``"cpu"``), PyTorch's own ``torch.utils.checkpoint.CheckpointPolicy`` value,
or a list of these in order of preference; :func:`tier_order` turns the answer
into a :class:`TierOrder`, the tiers to try in turn.

# NOTE [CheckpointPolicy answers]
# What each ``CheckpointPolicy`` member (all six of torch 2.13) means to tiermem:
#
# | answer             | tiers tried, in order                       | when the first cannot take it              |
# | ------------------ | ------------------------------------------- | ------------------------------------------ |
# | MUST_SAVE          | keep                                        | (keep never refuses)                       |
# | PREFER_SAVE        | keep                                        | (keep never refuses)                       |
# | MUST_RECOMPUTE     | recompute                                   | TierMemError naming the op and the module  |
# | PREFER_RECOMPUTE   | recompute, then the device's default tier   | the next tier (stats.recompute_fallbacks)  |
# | MUST_CPU_OFFLOAD   | cpu, keep                                   | keep, one warning (stats.budget_fallbacks) |
# | PREFER_CPU_OFFLOAD | cpu, keep                                   | keep, one warning (stats.budget_fallbacks) |
#
# 1. The device's default tier is the one the default policy picks: cpu for
#    CUDA tensors (then keep); for CPU tensors nvme when the Offloader has an
#    nvme tier (then cpu, keep), else keep. It is also where the inputs of a
#    MUST_RECOMPUTE tensor's recipe are stored (NOTE [What a recipe holds] in
#    tiers/recompute.py). Placement fills it in per device
#    (``Placement.complete``); :attr:`TierOrder.then_default` marks the orders
#    that need it.
# 2. In a list each value stands for its first tier: ``[PREFER_RECOMPUTE,
#    "nvme"]`` is recompute, nvme, cpu, keep. After the last entry come its
#    fallbacks (rule 1 when it is a *_RECOMPUTE value). A MUST_* value may only
#    be the first entry (later entries of ``[MUST_RECOMPUTE, "nvme"]`` say where
#    the recipe's inputs go); elsewhere it is refused.
# 3. MUST_RECOMPUTE that cannot be honoured raises (in the forward, at the
#    tensor's save): the op is not on the allow-list, an input is gone, or the
#    recipe would cost as much memory as it frees. Those follow from the
#    program, not from the load, so they fail the same way every step: a MUST
#    the runtime silently broke would be found only by its memory use.
#    PREFER_RECOMPUTE is the soft form. A full cpu budget under
#    MUST_CPU_OFFLOAD is a matter of capacity and, like every full tier,
#    passes the tensor on with one warning.
# 4. Without the planner MUST_* and PREFER_* differ only as in the table. The
#    planner (``policy="auto"``) takes the same answers from its ``hints``
#    callable and reads :attr:`TierOrder.must`: a MUST_* answer is a
#    constraint it obeys; a PREFER_* answer (:attr:`TierOrder.hint`) and a
#    plain tier name are hints it may override (NOTE [Planner hints] in
#    planner/hints.py).
# 5. Tensors kept before any policy is asked (NOTE [Pack order of checks] in
#    runtime/hooks.py: parameters, small or unmovable tensors, saves during backward)
#    stay kept whatever the answer, MUST_RECOMPUTE included.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .config import POLICY_NAMES
from .errors import ConfigError, TierMemError

__all__ = ["Tier", "TensorInfo", "PolicyFn", "TierOrder", "resolve_policy", "tier_order",
           "is_constraint", "FALLBACK", "CHECKPOINT_POLICY_TIERS", "AUTO"]


class Tier(str, enum.Enum):
    """Where a saved activation lives until backward needs it."""

    KEEP = "keep"
    CPU = "cpu"
    NVME = "nvme"
    RECOMPUTE = "recompute"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TensorInfo:
    """What a policy sees of one saved tensor.

    ``module`` is the qualified name of the innermost running module
    (``"TinyGPT.blocks.1.ln1"``; ``""`` outside any module); ``op`` the producer
    op's name when known (else ``None``); ``index`` the order of packing within
    the step (0, 1, ...); ``is_param`` whether it is (a view of) a parameter or
    buffer — those are never moved, whatever the policy says.
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    module: str
    op: Optional[str]
    index: int
    is_param: bool


#: A policy: returns a tier, a ``CheckpointPolicy`` value, or a sequence of
#: these in order of preference (``("recompute", "cpu")``: recompute if
#: eligible, else cpu). NOTE [CheckpointPolicy answers].
PolicyFn = Callable[[TensorInfo], Union[Tier, str, CheckpointPolicy, Sequence]]


#: Where a tensor goes when its tier is full (or, for recompute, not eligible), in order.
FALLBACK = {"cpu": ("keep",), "nvme": ("cpu", "keep"), "recompute": ("keep",), "keep": ()}

_ACTIONS = {"SAVE": Tier.KEEP, "RECOMPUTE": Tier.RECOMPUTE, "CPU_OFFLOAD": Tier.CPU}

#: The tier each ``CheckpointPolicy`` member stands for (NOTE [CheckpointPolicy answers]).
#: Built from the members this torch defines, by what their name says after
#: ``MUST_``/``PREFER_``; a member of a later torch with another action is not
#: in it, and a policy answering with it gets the "not a tier" error.
CHECKPOINT_POLICY_TIERS = {
    m: _ACTIONS[m.name.split("_", 1)[1]] for m in CheckpointPolicy
    if m.name.split("_", 1)[0] in ("MUST", "PREFER") and m.name.split("_", 1)[1] in _ACTIONS}

_ACCEPTED = ("a tiermem.Tier, a tier name (keep, cpu, nvme, recompute), a "
             "torch.utils.checkpoint.CheckpointPolicy value, or a list of these in order of "
             "preference")


class TierOrder(tuple):
    """The tiers to try for one tensor, in order (a tuple of :class:`Tier`;
    equal to the plain tuple of the same tiers), and where the order came from.

    - ``must``: the answer was a ``CheckpointPolicy.MUST_*`` value: the first
      tier is a constraint. The planner never overrides it; the runtime raises
      where it cannot honour MUST_RECOMPUTE (NOTE [CheckpointPolicy answers]).
    - ``hint``: the ``CheckpointPolicy`` member of the answer's first entry, or
      ``None`` (a tier name). ``hint`` set and ``must`` false: a PREFER_* hint.
    - ``then_default``: the device's default tier and its fallbacks come after
      these tiers (filled in by ``Placement.complete``, which knows the device).
    """

    must: bool
    hint: Optional[CheckpointPolicy]
    then_default: bool

    def __new__(cls, tiers, must: bool = False, hint: Optional[CheckpointPolicy] = None,
                then_default: bool = False) -> "TierOrder":
        self = super().__new__(cls, tiers)
        self.must, self.hint, self.then_default = must, hint, then_default
        return self

    def with_tiers(self, tiers) -> "TierOrder":
        """The same provenance over other tiers (``then_default`` resolved)."""
        return TierOrder(tiers, self.must, self.hint)

    def __repr__(self) -> str:
        extra = "".join([", must=True" if self.must else "",
                         f", hint={self.hint.name}" if self.hint is not None else "",
                         ", then_default=True" if self.then_default else ""])
        return f"TierOrder(({', '.join(t.value for t in self)}){extra})"

    def __reduce__(self):
        return (TierOrder, (tuple(self), self.must, self.hint, self.then_default))


def as_tier(value: Union[Tier, str, CheckpointPolicy], *, source: str) -> Tier:
    """Turn one entry of a policy's answer into a :class:`Tier`, or raise
    ``TierMemError`` naming ``source``, the value and the accepted kinds."""
    if isinstance(value, Tier):
        return value
    if isinstance(value, CheckpointPolicy):
        tier = CHECKPOINT_POLICY_TIERS.get(value)
        if tier is not None:
            return tier
    elif isinstance(value, str):
        try:
            return Tier(value.strip().lower())
        except ValueError:
            pass
    raise TierMemError(
        f"tiermem: {source} returned {value!r} ({type(value).__name__}), which is not a "
        f"tier; a policy answers with {_ACCEPTED}") from None


def tier_order(choice: Union[Tier, str, CheckpointPolicy, Sequence], *,
               source: str) -> TierOrder:
    """The tiers to try for a tensor, in order: the chosen ones, then the
    fallbacks of the last (``"nvme"`` -> nvme, cpu, keep; ``("recompute",
    "cpu")`` -> recompute, cpu, keep). Keep always ends the order, except in
    an order with ``then_default`` set, which ``Placement.complete`` ends.

    ``CheckpointPolicy`` values (alone or in a list) follow NOTE
    [CheckpointPolicy answers]; the result says whether the answer is a
    constraint (``must``) or a hint (``hint``). Raises ``TierMemError`` naming
    ``source`` for an answer of another type, an unknown tier name, an empty
    list, or a MUST_* value after the first entry."""
    if isinstance(choice, str) and not isinstance(choice, Tier) and "," in choice:
        choice = [c.strip() for c in choice.split(",")]   # "recompute,cpu", as TIERMEM_POLICY
    if isinstance(choice, (list, tuple)):
        entries = list(choice)
        if not entries:
            raise TierMemError(f"tiermem: {source} returned an empty list of tiers")
    else:
        entries = [choice]
    chosen = [as_tier(c, source=source) for c in entries]
    for c in entries[1:]:
        if isinstance(c, CheckpointPolicy) and c.name.startswith("MUST_"):
            raise TierMemError(
                f"tiermem: {source} returned {choice!r}: {c} may only be the first entry of a "
                "list (a MUST is a constraint, not a fallback); use its PREFER_ form there")
    first, last = entries[0], entries[-1]
    hint = first if isinstance(first, CheckpointPolicy) else None
    must = hint is not None and hint.name.startswith("MUST_")
    then_default = isinstance(last, CheckpointPolicy) and chosen[-1] is Tier.RECOMPUTE
    later = [] if then_default else [Tier(f) for f in FALLBACK[chosen[-1].value]]
    order = []
    for t in chosen + later + ([] if then_default else [Tier.KEEP]):
        if t not in order:
            order.append(t)
    return TierOrder(order, must, hint, then_default)


def is_constraint(choice) -> bool:
    """Whether a policy's answer binds the planner: a ``CheckpointPolicy.MUST_*``
    value (alone or first in a list). ``choice``: a :class:`TierOrder` or a raw
    answer as :func:`tier_order` takes it (which raises on invalid ones).
    PREFER_* values and tier names are hints (NOTE [CheckpointPolicy answers])."""
    if not isinstance(choice, TierOrder):
        choice = tier_order(choice, source="the policy")
    return choice.must


def AUTO(info: TensorInfo):
    """The ``policy_fn`` of ``policy="auto"``: a marker. Placement answers for it
    with the planner (:mod:`tiermem.planner`); it is never called."""
    raise TierMemError("tiermem: the auto policy was called as a function; this is a bug")


def resolve_policy(policy: Union[str, PolicyFn, None], *, nvme_dir: Optional[str]):
    """Turn the ``policy`` setting into ``(fixed_order, fn)``.

    Exactly one is set: ``fixed_order`` (see :func:`tier_order`) for named
    policies, including preference lists such as ``"recompute,cpu"`` (the hot
    path then needs no :class:`TensorInfo`); ``fn`` for callables and the
    device-dependent default; ``"auto"`` gives ``(None, AUTO)``, which
    placement turns into the planner.
    """
    if policy is None:
        default_cpu_side = Tier.NVME if nvme_dir else Tier.KEEP

        def default_policy(info: TensorInfo) -> Tier:
            return Tier.CPU if info.device.type == "cuda" else default_cpu_side
        default_policy.tiermem_builtin = True   # reads no info.op: no producer tracking
        return None, default_policy
    if callable(policy) and not isinstance(policy, str):
        return None, policy
    names = [n.strip() for n in str(policy).lower().split(",")]
    if "auto" in names:
        if len(names) > 1:
            raise ConfigError(f"tiermem: policy={policy!r}: 'auto' cannot be part of a "
                              "preference list; use it alone")
        return None, AUTO
    bad = [n for n in names if n not in POLICY_NAMES]
    if bad:
        raise ConfigError(
            f"tiermem: policy={policy!r} is not valid; choose one of {', '.join(POLICY_NAMES)}, "
            "a comma-separated preference list such as 'recompute,cpu', or pass a callable")
    return tier_order(names, source="the policy"), None
