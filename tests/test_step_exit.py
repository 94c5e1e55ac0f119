"""Leaving a step's context when one of its exit steps raises, or a
KeyboardInterrupt lands there (a second Ctrl-C while the exit drains slow
copies): every other exit step still runs, the error reaches the caller, and
the Offloader takes the next step, exactly (NOTE [Every exit step runs] in
tiermem/offloader.py)."""

import contextlib

import pytest

import tiermem.runtime.placement
import tiermem.testing
import tiermem.planner.lifecycle
from helpers import assert_same_step, offloader
from models import make_case


def _step(case, ctx):
    case.model.zero_grad(set_to_none=True)
    with ctx:
        loss = case.loss_fn(case.model(*case.inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in case.model.named_parameters()}


def _interrupt_once(monkeypatch, owner, name):
    """``owner.name`` raises KeyboardInterrupt at its first call, then runs as before."""
    original = getattr(owner, name)
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    return calls


@pytest.mark.parametrize("policy,where", [("cpu", "launch"), ("cpu", "drain"), ("auto", "launch"),
                                          ("auto", "drain"), ("auto", "end_forward")])
def test_an_interrupted_exit_leaves_the_offloader_usable(monkeypatch, nvme_dir, where, policy):
    """``launch`` runs at a normal exit, ``drain`` at the exit of a forward
    that raised (the first Ctrl-C), the planner's ``end_forward`` at every
    exit of an auto step."""
    settings = {"device_budget": "50%", "nvme_dir": nvme_dir} if policy == "auto" else {}
    off = offloader(policy, **settings)
    ref_case, case = make_case("mlp"), make_case("mlp")
    _step(case, off)
    _step(ref_case, contextlib.nullcontext())
    owner = (tiermem.runtime.placement.Placement if where != "end_forward"
             else tiermem.planner.lifecycle.Planner)
    calls = _interrupt_once(monkeypatch, owner, where)
    with pytest.raises(KeyboardInterrupt):
        with off:
            loss = case.loss_fn(case.model(*case.inputs))
            if where == "drain":
                raise KeyboardInterrupt   # the first Ctrl-C; the second lands in drain
    assert calls, f"{where} was not reached"
    del loss
    assert not tiermem.testing.in_forward(off)
    for _ in range(3):
        assert_same_step(_step(case, off), _step(ref_case, contextlib.nullcontext()),
                         f"after an interrupt in {where}")
    if policy == "auto":
        # A released handle's extent is freed once its I/O in flight is done
        # (a read prefetched for the last backward may still be running).
        tiermem.testing.store_of(off, "nvme").settle()
    assert off.host_bytes_in_use == 0 and off.disk_bytes_in_use == 0
    off.close()
