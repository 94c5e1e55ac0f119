"""Tiers, what a policy sees (:class:`TensorInfo`) and the built-in policies."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .config import POLICY_NAMES
from .errors import ConfigError, TierMemError

__all__ = ["Tier", "TensorInfo", "PolicyFn", "resolve_policy"]


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


PolicyFn = Callable[[TensorInfo], Union[Tier, str]]


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


def resolve_policy(policy: Union[str, PolicyFn, None], *, nvme_dir: Optional[str]):
    """Turn the ``policy`` setting into ``(fixed_tier, fn)``.

    Exactly one is set: ``fixed_tier`` for the named single-tier policies (the
    hot path then needs no :class:`TensorInfo`), ``fn`` for callables and the
    device-dependent default. ``"auto"`` is not available yet and raises.
    """
    if policy is None:
        default_cpu_side = Tier.NVME if nvme_dir else Tier.KEEP

        def default_policy(info: TensorInfo) -> Tier:
            return Tier.CPU if info.device.type == "cuda" else default_cpu_side
        return None, default_policy
    if callable(policy) and not isinstance(policy, str):
        return None, policy
    name = str(policy).lower()
    if name == "auto":
        raise ConfigError(
            "tiermem: policy='auto' (the planner) is not available in this version; "
            "use keep or cpu, or a callable policy")
    if name not in POLICY_NAMES:
        raise ConfigError(
            f"tiermem: policy={policy!r} is not valid; choose one of {', '.join(POLICY_NAMES)} "
            "or pass a callable")
    return Tier(name), None
