"""tiermem never changes the forward's values (issue 16).

Producer tracking is a ``TorchDispatchMode``; PyTorch runs a mode's ops with
the Conjugate/Negative keys excluded, and kernels that make a lazy conjugate
view inside then compute wrong values (PyTorch #198118: complex
``linalg.pinv``; complex ``linalg.lstsq``'s residuals). tiermem runs each op
as it would run without a mode (NOTE [Ops run as without a mode] in
tiermem/tracking/dispatch.py). Checked here on every policy that tracks producers and
on those that do not, forward values and gradients bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers import TIERS, same_bits


def _callable_policy(info):
    return "recompute,cpu" if info.op == "aten.relu" else "cpu"


POLICIES = [pytest.param(t, id=t) for t in TIERS] + [
    pytest.param(_callable_policy, id="callable")]


def _cases():
    c64 = torch.complex64
    yield "linalg.pinv", lambda a: torch.linalg.pinv(a), (5, 3), c64
    yield "linalg.pinv-hermitian", lambda a: torch.linalg.pinv(a @ a.mH, hermitian=True), \
        (4, 4), c64
    yield "pinverse", lambda a: torch.pinverse(a), (3, 5), torch.complex128
    yield "lstsq", lambda a: torch.linalg.lstsq(a, a[:, :2].conj() * 2, driver="gelsd"), \
        (6, 3), c64
    yield "solve-conj", lambda a: torch.linalg.solve(a.conj(), a[:, :1]), (3, 3), c64
    yield "matmul-conj-view", lambda a: a.mH @ a, (4, 3), c64
    # Present in later torch versions (same upstream bug).
    if hasattr(torch.linalg, "polar"):
        yield "linalg.polar", lambda a: torch.linalg.polar(a), (3, 3), c64
    if hasattr(torch.linalg, "matrix_sqrth"):
        yield "linalg.matrix_sqrth", lambda a: torch.linalg.matrix_sqrth(a @ a.mH), (3, 3), c64


CASES = [pytest.param(fn, shape, dtype, id=name) for name, fn, shape, dtype in _cases()]


def _outputs(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor)]


def _run(fn, a0, ctx):
    a = a0.clone().requires_grad_(True)
    with ctx:
        act = a * 1   # an activation (leaves that require grad are never moved)
        outs = _outputs(fn(act))
    loss = sum((o.real.sum() + o.imag.sum()) if o.is_complex() else o.sum()
               for o in outs if o.requires_grad)
    (g,) = torch.autograd.grad(loss, a)
    return [o.detach() for o in outs], g


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fn,shape,dtype", CASES)
def test_complex_linalg_forward_and_grads_unchanged(policy, fn, shape, dtype, make_off):
    off = make_off(policy)
    for seed in range(3):
        torch.manual_seed(seed)
        a0 = torch.randn(shape, dtype=dtype)
        ref_outs, ref_g = _run(fn, a0, contextlib.nullcontext())
        outs, g = _run(fn, a0, off)
        for i, (o, r) in enumerate(zip(outs, ref_outs)):
            assert same_bits(o, r), f"seed {seed}: output {i} differs"
        assert same_bits(g, ref_g), f"seed {seed}: gradient differs"


def test_pinv_identity_holds_under_tracking(make_off):
    """The symptom users would see: ``A @ pinv(A) @ A == A`` (to rounding)."""
    off = make_off("recompute")
    torch.manual_seed(0)
    a = torch.randn(5, 3, dtype=torch.complex64)
    with off:
        p = torch.linalg.pinv(a * 1)
    assert torch.allclose(a @ p @ a, a, atol=1e-5)


def test_other_modes_see_what_they_would_without_tiermem(make_off):
    """Only when tiermem's mode is the last one does it allow the view-bit
    keys: a user's mode below it sees the exclusion PyTorch sets, as without
    tiermem, and it is restored after each op."""
    seen = []
    key = torch._C.DispatchKey.Conjugate

    class Probe(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(torch._C._dispatch_tls_is_dispatch_key_excluded(key))
            return func(*args, **(kwargs or {}))

    off = make_off("recompute")
    x = torch.randn(4, requires_grad=True)
    with Probe():          # under tiermem's mode: its ops reach the probe after ours
        with off:
            y = (x * 2).sin()
    assert seen and all(seen), "the user's mode saw ops with Conjugate allowed"
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    y.sum().backward()
