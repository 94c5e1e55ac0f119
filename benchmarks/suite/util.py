"""Small helpers shared by the suite's modules: stderr logging, one-line error
text, out-of-memory detection, the command line as recorded, and the size
parsing and byte formatting of its options and report (thin wrappers over
tiermem's own: see each for what they add)."""

from __future__ import annotations

import os
import sys
from typing import List, Optional


def parse_size(text) -> Optional[int]:
    """``'24GiB' -> 25769803776``: :func:`tiermem.config.parse_size` (decimal
    kB/MB/GB, binary KiB/MiB/GiB), plus ``None``/``''`` -> None (an unset
    ``--device-budget``) and ints as they are (the presets' sizes). A bad size
    raises ConfigError, a ValueError: argparse reports it as an invalid value."""
    if text is None or text == "":
        return None
    if isinstance(text, int):
        return text
    from tiermem.config import parse_size as tiermem_parse_size
    return tiermem_parse_size(text, name="size")


_TIB = 1 << 40


def fmt_bytes(n) -> str:
    """:func:`tiermem.telemetry.format_bytes` (``1536 -> '1.5 KiB'``), plus
    ``None -> '–'`` and TiB from 1 TiB up (format_bytes stops at GiB: the
    report's RAM of a large host would read '2048.0 GiB')."""
    if n is None:
        return "–"
    if abs(n) >= _TIB:
        return f"{n / _TIB:.1f} TiB"
    from tiermem.telemetry import format_bytes
    return format_bytes(n)


def _oom_types():
    import torch
    out = [getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)]
    return tuple(t for t in out if t is not None)


def is_oom(e: BaseException) -> bool:
    """A device OOM, or the CPU allocator's "can't allocate memory"."""
    if isinstance(e, _oom_types()):
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)


def err_text(e: BaseException, limit: int = 600) -> str:
    """``Type: message``, first line only, at most ``limit`` characters."""
    s = f"{type(e).__name__}: {e}".strip()
    first = s.splitlines()[0] if s else type(e).__name__
    return first[:limit]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def command_line() -> List[str]:
    """How this run was started, as it is recorded: ``python -m benchmarks.suite
    ARGS`` (``sys.argv[0]`` is then the path of ``__main__.py``) or ``python
    PATH ARGS``."""
    exe = os.path.basename(sys.executable)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    if name.endswith(".__main__"):
        return [exe, "-m", name[: -len(".__main__")]] + sys.argv[1:]
    return [exe] + sys.argv
