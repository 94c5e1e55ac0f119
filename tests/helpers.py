"""Helpers shared by the tests (not collected; ``conftest.py`` puts this
directory on ``sys.path``). Test files import from here, from ``models`` (the
small models and their cases) and from ``conftest``'s fixtures, never from
one another.

- Tiers and engines: :data:`TIERS`, :data:`STORAGE_TIERS`, :data:`ENGINES`,
  :func:`offloader`, :func:`land_moves`, :func:`moved_count`,
  :func:`cpp_engine_unavailable`.
- Steps: :func:`run_step`, :func:`train_steps`, :func:`reference_steps`.
- Exact comparisons: :func:`assert_same_tensors`, :func:`compare_records`,
  :func:`assert_same_step`, :func:`same_bits`, :func:`expect_compact`.
- Waiting: :func:`until`.
- Filesystems: :func:`mounted` (tmpfs, ramfs; we run as root in CI).
- GPU: :func:`forbid_host_waits` (only called with a CUDA device).
"""

from __future__ import annotations

import contextlib
import gc
import pathlib
import subprocess
import threading
import time
from typing import Callable, Dict, Optional, Sequence

import pytest
import torch
import torch.nn as nn

import tiermem
import tiermem.testing
from models import Case, make_case, square_mean

__all__ = [
    "TIERS", "STORAGE_TIERS", "ENGINES", "offloader", "names_nvme", "land_moves", "moved_count",
    "cpp_engine_unavailable",
    "run_step", "train_steps", "reference_steps",
    "assert_same_tensors", "compare_records", "assert_same_step", "same_bits", "expect_compact",
    "until", "mounted", "forbid_host_waits", "SlowFuture",
]


# ---------------------------------------------------------------------------
# Tiers, engines, Offloaders
# ---------------------------------------------------------------------------

#: Every tier, as the policy string that sends every tensor there (the
#: ``tier`` fixture). ``"recompute,cpu"``: what cannot be recomputed goes to cpu.
TIERS = ("keep", "cpu", "nvme", "recompute", "recompute,cpu")

#: The tiers that hold a saved tensor's bytes (the ``storage_tier`` fixture).
STORAGE_TIERS = ("keep", "cpu", "nvme")

#: The I/O engines of the nvme tier (the ``engine`` fixture).
ENGINES = ("python", "cpp")


def offloader(policy="cpu", **settings) -> tiermem.Offloader:
    """An Offloader for a test: ``min_offload_bytes=0`` (every tensor goes
    through the policy) and, when it has an ``nvme_dir``, the Python engine,
    unless ``settings`` say otherwise."""
    settings.setdefault("min_offload_bytes", 0)
    if settings.get("nvme_dir") is not None:
        settings.setdefault("engine", "python")
    return tiermem.Offloader(policy=policy, **settings)


def names_nvme(policy) -> bool:
    """Whether a named policy (string or list of tiers) may send tensors to nvme."""
    if isinstance(policy, str):
        return "nvme" in policy.lower()
    if isinstance(policy, (list, tuple)):
        return any(names_nvme(p) for p in policy)
    return False


def land_moves(off) -> None:
    """Wait until every move of the cpu and nvme tiers has landed, and finish
    them as the next pack would (their sources dropped): backward then restores
    from host memory or disk."""
    for t in (tiermem.Tier.CPU, tiermem.Tier.NVME):
        try:
            store = tiermem.testing.store_of(off, t)
        except KeyError:   # no such store (nvme without a directory)
            continue
        store.drain()
    tiermem.testing.poll(off)


def moved_count(stats) -> int:
    """Saved tensors a step did not keep on their device (cpu, nvme, recompute)."""
    return sum(n for t, n in stats.count_by_tier.items() if t != "keep")


class SlowFuture:
    """An engine's future that is not done before ``ready_at``
    (``time.monotonic()``): a disk slower than compute, for fault tests."""

    def __init__(self, inner, ready_at: float) -> None:
        self.inner, self.ready_at = inner, ready_at

    def done(self) -> bool:
        return time.monotonic() >= self.ready_at and self.inner.done()

    def wait(self) -> None:
        left = self.ready_at - time.monotonic()
        if left > 0:
            time.sleep(left)
        self.inner.wait()


def cpp_engine_unavailable() -> Optional[str]:
    """Why the C++ I/O engine cannot be used here (the start of the build's
    error), or ``None`` if it can."""
    info = tiermem.engine_info("cpp")
    return None if info["engine"] == "cpp" else info["reason"][:500]


# ---------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------

def run_step(model: nn.Module, inputs: Sequence[torch.Tensor], ctx, seed: int = 1,
             loss_fn: Callable[[torch.Tensor], torch.Tensor] = square_mean):
    """One forward under ``ctx`` (an Offloader, or ``contextlib.nullcontext()``
    for the reference) and one backward outside it.

    Returns ``(loss, {param name: grad})``, all cloned.
    """
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with ctx:
        loss = loss_fn(model(*inputs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return loss.detach().clone(), grads


def train_steps(case: Case, ctx_factory: Callable[[], object], steps: int = 3,
                seed: int = 10):
    """``steps`` AdamW steps; the forward of each under ``ctx_factory()``.

    Returns one record per step: ``(loss, grads, params after the step)``.
    """
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    records = []
    for i in range(steps):
        loss, grads = run_step(case.model, case.inputs, ctx_factory(), seed=seed + i,
                               loss_fn=case.loss_fn)
        opt.step()
        params = {n: p.detach().clone() for n, p in case.model.named_parameters()}
        records.append((loss, grads, params))
    return records


def reference_steps(name: str, steps: int = 3, seed: int = 10):
    """``train_steps`` of a fresh ``name`` case without tiermem."""
    return train_steps(make_case(name), contextlib.nullcontext, steps, seed)


# ---------------------------------------------------------------------------
# Exact comparisons
# ---------------------------------------------------------------------------

def assert_same_tensors(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str):
    """Same names, and for each the same dtype, shape and values (``torch.equal``)."""
    assert a.keys() == b.keys(), f"{what}: different names {sorted(a)} vs {sorted(b)}"
    assert a, f"{what}: nothing to compare"
    for n in a:
        x, y = a[n], b[n]
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {n} dtype/shape differ"
        if not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item()
            raise AssertionError(f"{what}: {n} differs (max abs diff {diff:g})")


def compare_records(records, ref, name: str) -> None:
    """Loss, gradients and parameters of every step of :func:`train_steps`
    records equal (``torch.equal``) to those of ``ref``; with more than one
    step, the steps changed the parameters (the comparison is not of a frozen
    model)."""
    assert len(records) == len(ref), f"{name}: {len(records)} steps vs {len(ref)}"
    for step, ((loss, grads, params), (rloss, rgrads, rparams)) in enumerate(zip(records, ref)):
        assert torch.equal(loss, rloss), f"{name} step {step}: loss {loss} != {rloss}"
        assert_same_tensors(grads, rgrads, f"{name} step {step} grads")
        assert_same_tensors(params, rparams, f"{name} step {step} params")
    if len(records) > 1:
        first, last = records[0][2], records[-1][2]
        assert any(not torch.equal(first[n], last[n]) for n in first), \
            f"{name}: the parameters did not change over {len(records)} steps"


def assert_same_step(got, ref, what: str = "step") -> None:
    """``got`` and ``ref``, each ``(loss, grads)`` with grads a list or a
    ``{name: grad}`` dict, are bit-identical."""
    assert torch.equal(got[0], ref[0]), f"{what}: loss {got[0]} != {ref[0]}"
    if isinstance(got[1], dict):
        assert_same_tensors(got[1], ref[1], what)
        return
    assert len(got[1]) == len(ref[1]), f"{what}: {len(got[1])} gradients vs {len(ref[1])}"
    for i, (g, r) in enumerate(zip(got[1], ref[1])):
        assert torch.equal(g, r), f"{what}: gradient {i} differs"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN == NaN, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    if a.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def expect_compact(t: torch.Tensor) -> bool:
    """tiermem's rule: a gapped view whose storage span exceeds twice its
    elements is moved as a dense copy (NOTE [Layout of a moved tensor])."""
    if t.numel() == 0 or t.is_contiguous():
        return False
    span = 1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride()))
    return span > 2 * t.numel()


# ---------------------------------------------------------------------------
# Waiting
# ---------------------------------------------------------------------------

def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``cond()`` until it is true; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


# ---------------------------------------------------------------------------
# Filesystems
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def forbid_host_waits(*job_classes):
    """Inside the block, a host wait for the GPU on this thread fails the test:
    torch's synchronizing calls raise (``set_sync_debug_mode("error")``, which
    is process-wide), and since that mode does not see event waits,
    ``torch.cuda.Event.synchronize`` and the ``wait_host`` of each of
    ``job_classes`` raise too when called on this thread (worker threads may
    wait for events: that is their job). Patches are undone on the way out."""
    me = threading.get_ident()

    def guarded(original):
        def wait(*args, **kwargs):
            if threading.get_ident() == me:
                raise AssertionError("host wait in the forward pass")
            return original(*args, **kwargs)
        return wait
    with pytest.MonkeyPatch.context() as mp:
        for cls in job_classes:
            mp.setattr(cls, "wait_host", guarded(cls.wait_host))
        mp.setattr(torch.cuda.Event, "synchronize", guarded(torch.cuda.Event.synchronize))
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
