"""Tiers, what a policy sees (:class:`TensorInfo`) and the built-in policies.

A policy answers, per saved tensor, with a :class:`Tier`, a tier name
(``"cpu"``), PyTorch's own ``torch.utils.checkpoint.CheckpointPolicy`` value,
or a list of these in order of preference; :func:`tier_order` turns the answer
into a :class:`TierOrder`, the tiers to try in turn.
"""

# NOTE [CheckpointPolicy answers]
# A MUST_* answer is honoured or fails the same way every step; a PREFER_* answer
# or a tier name may pass the tensor on. Tiers tried: MUST_SAVE, PREFER_SAVE: keep.
# MUST_RECOMPUTE: recompute, else TierMemError naming the op and the module.
# PREFER_RECOMPUTE: recompute, then the device's default tier. MUST_CPU_OFFLOAD,
# PREFER_CPU_OFFLOAD: cpu, then keep with one warning.
# 1. The device's default tier is the default policy's: cpu (then keep) for CUDA
#    tensors; for CPU tensors nvme if the Offloader has one (then cpu, keep), else
#    keep. MUST_RECOMPUTE stores its recipe's inputs there (``Placement.complete``).
# 2. In a list each value stands for its first tier; a MUST_* value only first.
# 3. MUST_RECOMPUTE raises because its failures (op not allowed, input gone, no
#    memory freed) follow from the program, not the load; a full cpu budget is
#    capacity, so MUST_CPU_OFFLOAD passes the tensor on like every full tier.
# 4. The planner obeys MUST_* as constraints (``TierOrder.must``); the rest are hints.
# 5. Tensors kept before any policy is asked stay kept, MUST_RECOMPUTE included.

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
