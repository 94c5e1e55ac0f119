"""What a container's memory cgroup still allows (NOTE [Container memory limits]).

A leaf module (no tiermem imports): the cpu tier's default budget
(runtime/placement.py) and the auto planner's default device budget on the CPU
(planner/rates.py) both read :func:`available_memory_bytes`.
"""

from __future__ import annotations

import os
from typing import Optional

import psutil

__all__ = ["available_memory_bytes", "cgroup_memory_available_bytes"]


def available_memory_bytes() -> int:
    """RAM this process may still take: what the OS reports available
    (``psutil``), or what its memory cgroup may still take if that is less
    (NOTE [Container memory limits])."""
    available = psutil.virtual_memory().available
    in_cgroup = cgroup_memory_available_bytes()
    return available if in_cgroup is None else min(available, in_cgroup)

# NOTE [Container memory limits]
# The default cpu budget never exceeds what this process's memory cgroup may still
# take: past its limit the OOM killer ends the process, and the cpu tier's pinned
# buffers are never reclaimed, while /proc/meminfo (psutil) describes the host. So
# the budget takes the least of the host's available memory and the cgroup's
# limit less its usage, usage not counting inactive file cache (the kernel drops
# it before it kills; counting it would give a budget near 0 after heavy reads).
# Read from /sys/fs/cgroup: v2 memory.max ("max": no limit), memory.current and
# memory.stat's inactive_file; v1 memory/memory.limit_in_bytes (no limit: about
# 2**63), memory.usage_in_bytes and memory.stat's total_inactive_file. A limit set
# only on an ancestor cgroup is not seen; absent or unreadable files mean "no
# limit known": the host's figure alone decides.
_CGROUP_ROOT = "/sys/fs/cgroup"
#: A v1 limit at least this large is "no limit" (the kernel's is 2**63 less a page).
_CGROUP_V1_NO_LIMIT = 1 << 62


def cgroup_memory_available_bytes(root: Optional[str] = None) -> Optional[int]:
    """Bytes this process's memory cgroup may still take before its limit:
    the limit less the usage, the inactive file cache not counted as used (at
    least 0); ``None`` when no limit is set or the files under ``root`` (the
    cgroup mount, default ``/sys/fs/cgroup``: v2 ``memory.max``, v1
    ``memory/memory.limit_in_bytes``) cannot be read.
    NOTE [Container memory limits]."""
    root = _CGROUP_ROOT if root is None else root
    for limit_file, usage_file, stat_dir, inactive_key in (
            ("memory.max", "memory.current", "", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory",
             "total_inactive_file")):
        limit_text = _read_cgroup_file(os.path.join(root, limit_file))
        if limit_text is None:
            continue
        if limit_text == "max":
            return None
        usage_text = _read_cgroup_file(os.path.join(root, usage_file))
        if not (limit_text.isascii() and limit_text.isdigit() and usage_text is not None
                and usage_text.isascii() and usage_text.isdigit()):
            return None
        limit = int(limit_text)
        if limit >= _CGROUP_V1_NO_LIMIT:
            return None
        used = int(usage_text) - _inactive_file_bytes(os.path.join(root, stat_dir, "memory.stat"),
                                                      inactive_key)
        return max(limit - max(used, 0), 0)
    return None


def _read_cgroup_file(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _inactive_file_bytes(stat_path: str, key: str) -> int:
    """``key``'s value in a cgroup's ``memory.stat`` (0 if it cannot be read)."""
    text = _read_cgroup_file(stat_path) or ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isascii() and parts[1].isdigit():
            return int(parts[1])
    return 0
