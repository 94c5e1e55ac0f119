"""Steps that keep every tensor run without the module tracker (NOTE [Steps
that keep everything] in tiermem/offloader.py; issue 33): its global module
hooks put every module call of the process on torch's slow path. These tests
check when a step goes without it (and gives back hooks its Offloader held),
that it still tracks when anything could move a tensor, what its stats count,
and the seam the host-cost benchmark uses to keep the hooks out of other
configurations' timings."""

from __future__ import annotations

import torch
import torch.nn as nn

import tiermem
import tiermem.testing
from helpers import same_bits
from models import MLP


class _SeesHooks(nn.Module):
    """Records, each time it runs, whether the module tracker saw it start."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen: list = []

    def forward(self, x):
        self.seen.append(tiermem.testing.running_module() != "")
        return self.lin(x).relu()


def _step(off, model, x):
    with off:
        loss = model(x).square().sum()
    loss.backward()


def test_keep_steps_install_no_module_hooks_and_stay_exact():
    torch.manual_seed(0)
    model, ref = _SeesHooks(), _SeesHooks()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 8, requires_grad=True)
    off = tiermem.Offloader(policy="keep")
    for _ in range(2):
        _step(off, model, x)
    ref(x).square().sum().backward()
    assert model.seen == [False, False]
    assert not tiermem.testing.holds_module_hooks(off)
    assert same_bits(model.lin.weight.grad / 2, ref.lin.weight.grad)
    assert off.stats.count_by_tier["keep"] >= 1 and off.stats.param_count >= 1   # weight.t()
    off.close()


def test_steps_that_may_move_track_modules():
    """A moving policy, and a keep policy while a wrapped block has a policy
    of its own, run the tracker (the hooks are there during the forward)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = _SeesHooks()
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    _step(off, model, x)
    assert model.seen == [True]
    off.close()

    outer = nn.Sequential(_SeesHooks(), _SeesHooks())
    wrapping = tiermem.wrap_blocks(outer, ["1"], checkpoint=False, policy="cpu")
    keep = tiermem.Offloader(policy="keep", min_offload_bytes=0)
    with tiermem.testing.dynamo_has_run(True):   # hooks held between steps
        _step(keep, outer, x)
        assert outer[0].seen == [True] and tiermem.testing.holds_module_hooks(keep)
        assert keep.stats.count_by_tier["cpu"] >= 1   # the wrapped block's tensors moved
        forward = outer[1].forward   # the wrapped forward, still alive after unwrap
        wrapping.unwrap()
        _step(keep, outer, x)
        assert outer[0].seen == [True, False]   # no wrapped block with a policy is left
        assert not tiermem.testing.holds_module_hooks(keep)   # given back by that step
    del forward
    keep.close()


def test_keep_stats_count_parameters_and_buffers_as_documented():
    """In a step that keeps everything parameters are found by type, a buffer
    (BatchNorm's running statistics, saved by batch_norm) counts as a kept
    activation; a step of a moving policy counts both as parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6))
    x = torch.randn(8, 6)

    def stats(policy):
        off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
        _step(off, model, x)
        off.close()
        return off.stats

    kept, moved = stats("keep"), stats("cpu")
    assert moved.param_count - kept.param_count == 2   # running_mean, running_var
    kept_total = sum(kept.count_by_tier.values())
    moved_total = sum(moved.count_by_tier.values())
    assert kept_total - moved_total == 2
    assert kept.param_count >= 2   # the weight.t() of both linears


def test_release_module_hooks_lets_the_next_step_install_them_again():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, MLP.D_IN)
    off = tiermem.Offloader(policy="recompute")
    with tiermem.testing.dynamo_has_run(True):
        _step(off, model, x)
        assert tiermem.testing.holds_module_hooks(off)   # held between steps
        tiermem.testing.release_module_hooks(off)
        assert not tiermem.testing.holds_module_hooks(off)
        _step(off, model, x)
        assert tiermem.testing.holds_module_hooks(off)
    off.close()
    assert not tiermem.testing.holds_module_hooks(off)


def test_without_dynamo_module_hooks_leave_with_each_step():
    """NOTE [Hooks held between steps]: until Dynamo has run in the process,
    a step tracks modules during its forward and removes the hooks at its
    end, so module calls between steps (an eval loop) need not run with them.
    Fails before: an Offloader held them from its first step to its close()."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = _SeesHooks()
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    with tiermem.testing.dynamo_has_run(False):
        _step(off, model, x)
        assert model.seen == [True]                    # tracked during the forward
        assert not tiermem.testing.holds_module_hooks(off)
        _step(off, model, x)                           # installed again for this one
        assert model.seen == [True, True]
        assert not tiermem.testing.holds_module_hooks(off)
    off.close()


def test_once_dynamo_has_run_an_offloader_holds_the_hooks():
    compiled = torch.compile(lambda t: t.sin() + 1, backend="eager")
    compiled(torch.randn(3))        # Dynamo considers a frame: its counters say so
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, MLP.D_IN)
    off = tiermem.Offloader(policy="recompute")
    _step(off, model, x)
    assert tiermem.testing.holds_module_hooks(off)
    off.close()
    assert not tiermem.testing.holds_module_hooks(off)


def test_keep_step_hooks_check_versions_and_hold_leaves_as_autograd_does():
    """NOTE [Hooks of a step that keeps everything] in runtime/keephooks.py:
    an in-place write to a saved tensor raises at unpack as autograd would,
    and a leaf replaced between forward and backward (``p.data = new``) is
    read as plain autograd reads it (the leaf itself is held)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    off = tiermem.Offloader(policy="keep")
    with off:
        first = x.exp()   # the step's first saved tensor has a handle of its own
        y = first.exp()   # saves its output y
    y.add_(1)
    try:
        y.sum().backward()
    except tiermem.TierMemError as e:
        assert "in-place" in str(e)
    else:
        raise AssertionError("an in-place write to a saved tensor was not seen")

    def grads(ctx_factory):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(4, 8))
        inp = torch.randn(4, 8, requires_grad=True)
        with ctx_factory():
            loss = (inp.exp() * w).sum()   # mul saves the leaf w itself
        w.data = w.data * 2   # a new storage, between forward and backward
        loss.backward()
        return inp.grad, w.grad

    import contextlib
    got, want = grads(lambda: off), grads(contextlib.nullcontext)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    off.close()


def test_keep_step_counts_no_tensor_saved_inside_backward():
    """A backward run inside the step (``create_graph``: a gradient penalty)
    saves tensors for the second backward: kept, and not counted in the
    step's stats, which count the forward's saved tensors."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, MLP.D_IN, requires_grad=True)

    def run(penalty: bool):
        off = tiermem.Offloader(policy="keep", min_offload_bytes=0)
        with off:
            out = model(x).sum()
            if penalty:
                (g,) = torch.autograd.grad(out, x, create_graph=True)
                out = out + g.square().sum()
        out.backward()
        off.close()
        return off.stats

    plain, with_penalty = run(False), run(True)
    # The forward's one more saved tensor: g, saved by square().
    assert with_penalty.count_by_tier["keep"] == plain.count_by_tier["keep"] + 1
    assert with_penalty.param_count == plain.param_count
