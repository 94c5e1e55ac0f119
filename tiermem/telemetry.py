"""Per-step statistics of an Offloader (:class:`StepStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .policy import Tier

__all__ = ["StepStats", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_NO_TIER_COUNTS = {t.value: 0 for t in Tier}
_per_tier = _NO_TIER_COUNTS.copy   # tier string -> 0, a new dict per call


@dataclass
class StepStats:
    """What one step (one ``with offloader:`` and its backward) did.

    Forward fields are final when the context exits; backward fields
    (``stall_seconds``, ``prefetched_bytes``, prefetch hits/misses) grow while
    backward runs.

    - ``bytes_by_tier`` / ``count_by_tier``: saved activations by the tier that
      holds them (tier string -> bytes / count); parameters are not included.
    - ``dedup_hits``: saves of a tensor already stored in this step (stored once).
    - ``param_count``: saves of parameters/buffers (never moved); in a step
      that keeps everything (policy ``keep``, no recompute anywhere), of
      parameters only: a saved buffer then counts as a kept activation.
    - ``small_count``: tensors kept because they were under ``min_offload_bytes``.
    - ``budget_fallbacks``: tensors that did not go to the tier the policy chose
      because it was full (they went to the next tier with room), or whose move
      failed (they stayed on their device).
    - ``unsupported_count``: tensors kept because no tier can move them (sparse,
      tensor subclasses, devices other than cpu/cuda).
    - ``stall_seconds``: host time that unpack waited for a tensor to come
      back, starting a read on demand included.
    - ``prefetched_bytes``, ``prefetch_hits``, ``prefetch_misses``: backward
      restores started ahead of need, and unpacks that found / did not find
      their tensor already on its way.
    - ``late_restores``: restores not complete when their unpack came (on CUDA
      an upper bound of GPU stalls: the stream may still not have reached them).
    - ``host_waits``: late restores whose unpack blocked the host (a read from
      disk not done yet, or a CPU copy), rather than only making the stream wait
      on a copy's event; their time is in ``stall_seconds``.
    - ``tail_hits``: unpacks that took a moved tensor's source, still held
      by the tail hold (``tail_hold_bytes``), with no restore;
      ``peak_tail_hold_bytes``: most bytes in the tail hold during the step
      (an upper bound on the memory it held; at most ``tail_hold_bytes``).
    - ``peak_host_bytes``: most host bytes held by the cpu tier during the step.
    - ``peak_disk_bytes``: most bytes of the nvme tier's file in use during the step.
    - ``bytes_by_tier["recompute"]``: bytes of saved tensors dropped (to be
      regenerated in backward); ``recompute_input_bytes``: bytes stored only
      because a recipe needs them (also counted in their own tier);
      ``recompute_count`` / ``recompute_seconds``: regenerations in backward and
      the host time they took (on CUDA: launch time; the kernels run async);
      ``recompute_fallbacks``: tensors the policy wanted to recompute that were
      not eligible (they went to the next tier), by reason in
      ``recompute_fallback_reasons``.
    """

    bytes_by_tier: dict = field(default_factory=_per_tier)
    count_by_tier: dict = field(default_factory=_per_tier)
    dedup_hits: int = 0
    param_count: int = 0
    small_count: int = 0
    budget_fallbacks: int = 0
    unsupported_count: int = 0
    stall_seconds: float = 0.0
    prefetched_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    late_restores: int = 0
    host_waits: int = 0
    tail_hits: int = 0
    peak_tail_hold_bytes: int = 0
    peak_host_bytes: int = 0
    peak_disk_bytes: int = 0
    recompute_input_bytes: int = 0
    recompute_count: int = 0
    recompute_seconds: float = 0.0
    recompute_fallbacks: int = 0
    recompute_fallback_reasons: dict = field(default_factory=dict)

    def record(self, tier: str, nbytes: int) -> None:
        """Count one tensor of ``nbytes`` held by ``tier`` (a tier string)."""
        self.bytes_by_tier[tier] += nbytes
        self.count_by_tier[tier] += 1

    def note_recompute_fallback(self, reason: str) -> None:
        """Count a tensor that could not be recomputed, and why."""
        self.recompute_fallbacks += 1
        reasons = self.recompute_fallback_reasons
        reasons[reason] = reasons.get(reason, 0) + 1

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of saved activations not kept on their device."""
        return sum(b for t, b in self.bytes_by_tier.items() if t != Tier.KEEP.value)

    def as_dict(self) -> dict:
        """A JSON-ready copy."""
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}

    def __str__(self) -> str:
        tiers = ", ".join(
            f"{t} {self.count_by_tier[t]} ({format_bytes(self.bytes_by_tier[t])})"
            for t in self.bytes_by_tier if self.count_by_tier[t])
        restores = self.prefetch_hits + self.prefetch_misses
        parts = [
            f"tiermem step: {tiers or 'nothing saved'}",
            f"dedup {self.dedup_hits}",
            f"prefetched {format_bytes(self.prefetched_bytes)} ({self.prefetch_hits}/{restores} on time)",
            f"stall {self.stall_seconds * 1e3:.2f} ms",
        ]
        if self.tail_hits:
            parts.append(f"tail hold {self.tail_hits} taken "
                         f"(held {format_bytes(self.peak_tail_hold_bytes)})")
        parts += [
            f"host peak {format_bytes(self.peak_host_bytes)}",
        ]
        if self.peak_disk_bytes:
            parts.append(f"disk peak {format_bytes(self.peak_disk_bytes)}")
        if self.recompute_count or self.recompute_fallbacks:
            parts.append(f"recomputed {self.recompute_count} in "
                         f"{self.recompute_seconds * 1e3:.2f} ms, "
                         f"{self.recompute_fallbacks} not eligible")
        if self.budget_fallbacks:
            parts.append(f"budget fallbacks {self.budget_fallbacks}")
        return " | ".join(parts)
