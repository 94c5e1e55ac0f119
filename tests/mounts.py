"""Mounting a small filesystem for a test (we run as root in CI)."""

from __future__ import annotations

import contextlib
import gc
import pathlib
import subprocess

import pytest


@contextlib.contextmanager
def mounted(where: pathlib.Path, fstype: str, options: str):
    """Mount a fresh ``fstype`` (tmpfs, ramfs) with ``options`` at the new
    directory ``where`` for the block, then unmount it; skip the test with the
    reason if the mount is refused."""
    where.mkdir()
    cmd = ["mount", "-t", fstype, "-o", options, fstype, str(where)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a {fstype}: {e}")
    if res.returncode != 0:
        pytest.skip(f"`{' '.join(cmd)}` was refused: {res.stderr.strip() or res.returncode}")
    try:
        yield where
    finally:
        gc.collect()   # close files a failed test left open
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)
