"""Prebuild the C++ I/O engine (used by ``python -m tiermem build``)."""

from __future__ import annotations

from ..errors import TierMemError
from . import cpp

__all__ = ["build"]


def build(verbose: bool = True) -> str:
    """Compile (or find up to date) the C++ extension (``tiermem_C``, or
    ``tiermem_C_cuda`` with a CUDA build of torch); return its path.

    Raises :class:`tiermem.TierMemError` with the compiler's output on failure.
    """
    cpp.load_extension(verbose=verbose)
    path = cpp.extension_path()
    if path is None:
        raise TierMemError("tiermem: the C++ extension loaded without a file path (this is a bug)")
    return path
