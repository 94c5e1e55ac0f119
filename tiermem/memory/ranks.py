"""Where this process stands in a distributed job (torchrun, or any launcher
that sets the same variables): its rank, the number of ranks on its node, and
the per-rank share of a per-node default.
"""

# NOTE [Per-rank budgets]
# The ranks of one node together stay within the node's defaults: each runs its
# own Offloader, sharing the node's RAM, NVMe disk and pinned memory. So:
# - A default derived from the node (half the available RAM for cpu, 80% of the
#   NVMe dir's free space, 256 MiB of pinned staging) is divided by
#   LOCAL_WORLD_SIZE (1 when unset); staging gets at least STAGING_MIN_BYTES, or
#   a tensor larger than the whole pool could never be staged.
# - An explicit setting (cpu_budget, nvme_budget, prefetch_bytes, by argument or
#   TIERMEM_*) is per rank: eight ranks with TIERMEM_CPU_BUDGET=8GiB may hold 64 GiB.
# - Each rank's NVMe files live in its own private directory, named with its rank,
#   under the one shared TIERMEM_NVME_DIR (memory/spilldir.py).
# The ``tiermem`` logger and ``doctor`` name the rank whenever one is set.

from __future__ import annotations

import logging
import os
from typing import Optional

from ..config import parse_int
from ..errors import ConfigError

__all__ = ["local_world_size", "rank", "local_rank", "rank_label", "per_rank_share",
           "STAGING_NODE_BYTES", "STAGING_MIN_BYTES", "RankFilter"]

#: Pinned staging of the nvme tier for one node, split among its ranks.
STAGING_NODE_BYTES = 256 << 20
#: The least staging a rank gets by default.
STAGING_MIN_BYTES = 64 << 20


def _env_int(name: str, minimum: int) -> Optional[int]:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = parse_int(text, name=name)   # ASCII digits only: "4_0" is not 40
    except ConfigError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"tiermem: {name}={text!r} is not an integer of at least {minimum} "
                          "(set by torchrun and other launchers; unset it outside one)")
    return value


def local_world_size() -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` (1 when unset). Raises
    :class:`ConfigError` naming the variable when it is not a positive integer."""
    n = _env_int("LOCAL_WORLD_SIZE", 1)
    return 1 if n is None else n


def rank() -> Optional[int]:
    """``RANK`` (global rank), or ``None`` outside a distributed launch."""
    return _env_int("RANK", 0)


def local_rank() -> Optional[int]:
    """``LOCAL_RANK`` (rank on this node), or ``None`` outside a distributed launch."""
    return _env_int("LOCAL_RANK", 0)


def rank_label() -> str:
    """``"rank 3"``, ``"rank 11 (local 3)"``, or ``""`` when no rank is set."""
    try:
        r, lr = rank(), local_rank()
    except ConfigError:
        return "rank ?"
    if r is None and lr is None:
        return ""
    if r is None:
        return f"local rank {lr}"
    return f"rank {r}" if lr is None or lr == r else f"rank {r} (local {lr})"


def per_rank_share(node_bytes: int) -> int:
    """``node_bytes`` divided among this node's ranks (NOTE [Per-rank budgets])."""
    return node_bytes // local_world_size()


class RankFilter(logging.Filter):
    """Names the rank in every record of the ``tiermem`` logger: messages that
    start with ``tiermem:`` start with ``tiermem[rank 1]:`` instead, and
    ``record.tiermem_rank`` holds the label (``""`` outside a distributed
    launch) for formatters. Read from the environment at each record: a
    launcher may set it after tiermem is imported."""

    def filter(self, record: logging.LogRecord) -> bool:
        label = rank_label()
        record.tiermem_rank = label
        if label and isinstance(record.msg, str) and record.msg.startswith("tiermem:"):
            record.msg = f"tiermem[{label}]:" + record.msg[len("tiermem:"):]
        return True


_logger = logging.getLogger("tiermem")
if not any(isinstance(f, RankFilter) for f in _logger.filters):
    _logger.addFilter(RankFilter())
