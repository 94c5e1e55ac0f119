"""Tiers, what a policy sees (:class:`TensorInfo`) and the built-in policies."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from .config import POLICY_NAMES
from .errors import ConfigError, TierMemError

__all__ = ["Tier", "TensorInfo", "PolicyFn", "resolve_policy", "tier_order", "FALLBACK",
           "AUTO"]


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


#: A policy: returns a tier, or a sequence of tiers in order of preference
#: (``("recompute", "cpu")``: recompute if eligible, else cpu).
PolicyFn = Callable[[TensorInfo], Union[Tier, str, Sequence]]


#: Where a tensor goes when its tier is full (or, for recompute, not eligible), in order.
FALLBACK = {"cpu": ("keep",), "nvme": ("cpu", "keep"), "recompute": ("keep",), "keep": ()}


def as_tier(value: Union[Tier, str], *, source: str) -> Tier:
    """Turn a policy's answer into a :class:`Tier`, or raise naming ``source``."""
    if isinstance(value, Tier):
        return value
    try:
        return Tier(str(value).lower())
    except ValueError:
        valid = ", ".join(t.value for t in Tier)
        raise TierMemError(
            f"tiermem: {source} returned {value!r}, which is not a tier; valid: {valid}") from None


def tier_order(choice: Union[Tier, str, Sequence], *, source: str) -> Tuple[Tier, ...]:
    """The tiers to try for a tensor, in order: the chosen ones, then the
    fallbacks of the last (``"nvme"`` -> nvme, cpu, keep; ``("recompute",
    "cpu")`` -> recompute, cpu, keep). Keep always ends the order."""
    if isinstance(choice, str) and "," in choice:   # "recompute,cpu", as TIERMEM_POLICY takes
        choice = [c.strip() for c in choice.split(",")]
    if isinstance(choice, (list, tuple)):
        chosen = [as_tier(c, source=source) for c in choice]
        if not chosen:
            raise TierMemError(f"tiermem: {source} returned an empty list of tiers")
    else:
        chosen = [as_tier(choice, source=source)]
    order = []
    for t in chosen + [Tier(f) for f in FALLBACK[chosen[-1].value]] + [Tier.KEEP]:
        if t not in order:
            order.append(t)
    return tuple(order)


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
