"""What a build of the C++ engine was made from: its key, its name and its stamp.

Shared by the install-time build (``setup.py`` loads this file by path, so it
imports only the standard library) and the run-time one (:mod:`tiermem.io.cpp`).

# NOTE [Engine build identity]
# A compiled engine is valid only for the torch it was compiled against (its
# ABI: same version string, which also names the CPU or CUDA build), the
# Python (extension ABI tag) and the exact sources and flags. Those four make
# its key, and a run-time build lives in a directory named after the key
# (``tiermem_C[_cuda]_<torch>_<python>_<sha>``) with its sources copied in:
# two installs of the same sources compile the same files under the same
# name and share one build; different sources or another torch never reuse
# each other's. A build is complete only once its stamp (the key, written
# after the module imported) is there; a module found with a stamp is
# imported without asking the compiler. The module built at install carries
# a stamp too, and is used only when its key is the one of the torch and the
# sources at hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from typing import Iterable, Optional

__all__ = ["variant", "variant_sha256", "sources_sha256", "python_tag", "build_name",
           "make_stamp", "stamp_mismatch", "write_stamp", "read_stamp", "STAMP_NAME",
           "PREBUILT_MODULE", "PREBUILT_STAMP"]

#: Files of csrc/ compiled into the engine, in build order, and the headers they
#: include; the CUDA build adds the chain (NOTE [CUDA build of the engine] in cpp.py).
SOURCES = ("io_engine.cpp", "tensor_release.cpp", "bindings.cpp")
HEADERS = ("io_engine.h", "tensor_release.h", "checks.h", "ready_queue.h", "text.h")
CUDA_SOURCES = ("cuda_chain.cpp", "cuda_bindings.cpp")
CUDA_HEADERS = ("cuda_chain.h", "cuda_bindings.h")

#: A run-time build's stamp, in its build directory.
STAMP_NAME = "tiermem-build.json"
#: The module an install builds (``tiermem/_C*.so``) and its stamp beside it.
PREBUILT_MODULE = "tiermem._C"
PREBUILT_STAMP = "_C.build.json"


def variant(csrc: str, cuda: bool) -> tuple:
    """``(sources, headers, cflags)`` of the CPU-only or the CUDA build, as paths
    under ``csrc``. ``-std`` is left to torch (its headers need the standard it
    passes); io_engine.cpp itself is plain C++17."""
    sources = SOURCES + (CUDA_SOURCES if cuda else ())
    headers = HEADERS + (CUDA_HEADERS if cuda else ())
    cflags = ["-O3"] + (["-DTIERMEM_WITH_CUDA"] if cuda else [])
    return ([os.path.join(csrc, n) for n in sources], [os.path.join(csrc, n) for n in headers],
            cflags)


def variant_sha256(csrc: str, cuda: bool) -> str:
    """The sources' hash (:func:`sources_sha256`) of one build variant."""
    sources, headers, cflags = variant(csrc, cuda)
    return sources_sha256(sources + headers, cflags + (["cuda"] if cuda else []))


def sources_sha256(paths: Iterable[str], flags: Iterable[str] = ()) -> str:
    """SHA-256 (hex) of the files' base names and contents, in the given order,
    and of the compiler flags: the same sources anywhere on disk hash alike."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        h.update(f"{os.path.basename(path)}\0{len(data)}\0".encode())
        h.update(data)
    h.update("\0".join(flags).encode())
    return h.hexdigest()


def python_tag() -> str:
    """``py311`` for CPython 3.11: extension modules are built per Python."""
    return f"py{sys.version_info[0]}{sys.version_info[1]}"


def build_name(torch_version: str, cuda: bool, sha256: str) -> str:
    """The module and directory name of a run-time build (NOTE [Engine build
    identity]): a Python identifier, e.g. ``tiermem_C_2_13_0_cpu_py311_1a2b3c4d5e6f``."""
    torch_part = re.sub(r"[^0-9A-Za-z]+", "_", torch_version).strip("_")
    return f"tiermem_C{'_cuda' if cuda else ''}_{torch_part}_{python_tag()}_{sha256[:12]}"


def make_stamp(torch_version: str, cuda: bool, sha256: str, note: str = "") -> dict:
    """The record of one build: what it was made from (``note``: why it has CUDA or not)."""
    return {"torch": torch_version, "python": python_tag(), "cuda": bool(cuda),
            "sources_sha256": sha256, "note": note}


def stamp_mismatch(stamp: Optional[dict], torch_version: str, sha256: str) -> Optional[str]:
    """``None`` when a build stamped ``stamp`` fits this torch, Python and these
    sources (``sha256`` of its variant's sources and flags), else why not."""
    if not isinstance(stamp, dict):
        return "it has no readable build stamp"
    if stamp.get("torch") != torch_version:
        return f"it was built for torch {stamp.get('torch')}, this is torch {torch_version}"
    if stamp.get("python") != python_tag():
        return f"it was built for {stamp.get('python')}, this is {python_tag()}"
    if stamp.get("sources_sha256") != sha256:
        return "it was built from other sources than the ones installed"
    return None


def write_stamp(path: str, stamp: dict) -> None:
    """Write ``stamp`` to ``path`` atomically (a reader sees all of it or none)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(stamp, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_stamp(path: str) -> Optional[dict]:
    """The stamp at ``path``, or ``None`` if there is none or it cannot be read."""
    try:
        with open(path) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None
