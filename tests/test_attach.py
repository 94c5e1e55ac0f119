"""``off.attach(model)`` / ``off.detach()``: each forward of the module under
the Offloader, without touching the training loop (NOTE [Attaching] in
tiermem/attach.py, whose rules these tests follow)."""

from __future__ import annotations

import contextlib
import copy
import gc
import pickle

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import tiermem
import tiermem.testing
from helpers import compare_records, moved_count, reference_steps, run_step, train_steps
from models import Block, make_case


class _Boom(Exception):
    pass


def _raise_in(module, exc_type):
    """Make ``module``'s forward raise a new ``exc_type`` (a forward hook);
    returns the handle. (A new one each time: an exception object kept alive
    keeps its traceback, and so the partial graph.)"""
    def hook(mod, args, out):
        raise exc_type("raised in the forward")
    return module.register_forward_hook(hook)


def _counts(off):
    return dict(off.stats.count_by_tier)


# -- rule 1: one forward, one step; bit-identical --------------------------------

def test_attached_training_bit_identical(tier, make_off):
    """Three AdamW steps with the model attached (the loop has no ``with``):
    loss, gradients and parameters bit-identical to plain autograd."""
    ref = reference_steps("block", 3)
    case = make_case("block")
    off = make_off(tier)
    seen = []

    def no_ctx():
        if seen:
            seen[-1] = off.stats
        seen.append(None)
        return contextlib.nullcontext()

    with off.attach(case.model):
        records = train_steps(case, no_ctx, 3)
    seen[-1] = off.stats
    compare_records(records, ref, f"attached/{tier}")
    assert len({id(s) for s in seen}) == 3, "each forward is a step of its own"
    for s in seen:
        assert (moved_count(s) == 0) == (tier == "keep"), s


def test_each_forward_is_one_step_and_saves_outside_it_are_plain():
    """The step is the forward of the module: ops run after it returns (the
    loss) are not under the Offloader, exactly as with ``with off: model(x)``."""
    case = make_case("block")
    x = case.inputs[0]
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    with off:
        case.model(x)
    expected = _counts(off)
    off.attach(case.model)
    out = case.model(x)
    first = off.stats
    assert not tiermem.testing.in_forward(off)
    (out.sin() * out).sum()        # saves tensors after the forward: not counted
    assert off.stats is first and _counts(off) == expected
    case.model(x)
    assert off.stats is not first and _counts(off) == expected
    off.close()


# -- rule 2: a forward that raises ---------------------------------------------------

def test_forward_that_raises_leaves_the_offloader(make_off):
    case = make_case("block")
    off = make_off("cpu")
    off.attach(case.model)
    handle = _raise_in(case.model.mlp, _Boom)
    try:      # (not pytest.raises: it keeps the traceback, and so the partial graph)
        case.loss()
        raise AssertionError("the forward did not raise")
    except _Boom:
        pass
    handle.remove()
    assert not tiermem.testing.in_forward(off)
    gc.collect()
    assert off.host_bytes_in_use == 0 and not off.in_use   # the partial graph freed its buffers
    with off:                      # usable as a context again (would raise if still entered)
        pass
    got = run_step(case.model, case.inputs, contextlib.nullcontext(), seed=3)
    ref = run_step(make_case("block").model, case.inputs, contextlib.nullcontext(), seed=3)
    assert torch.equal(got[0], ref[0])
    assert off.stats.count_by_tier["cpu"] > 0


@pytest.mark.parametrize("then", ["next_forward", "detach"])
def test_keyboard_interrupt_in_forward_is_left_later(then, make_off):
    """torch runs no ``always_call`` hook for a BaseException: the context is
    left at the next forward of the module, or by ``detach()``."""
    case = make_case("block")
    off = make_off("cpu")
    off.attach(case.model)
    case.loss().backward()
    normal = _counts(off)
    handle = _raise_in(case.model.mlp, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        case.loss()
    handle.remove()
    assert tiermem.testing.in_forward(off)      # what torch leaves us
    if then == "detach":
        off.detach()
        assert not tiermem.testing.in_forward(off)
        return
    loss = case.loss()
    assert not tiermem.testing.in_forward(off)
    loss.backward()
    assert _counts(off) == normal              # a fresh step: the stale one was left
    with off:                                  # and the Offloader may be entered again
        pass


# -- rule 3: nesting ----------------------------------------------------------------------

def test_attached_submodule_inside_attached_model_runs_in_the_outer_step():
    case = make_case("block")
    x = case.inputs[0]
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    with off:
        case.model(x)
    whole = _counts(off)
    off.attach(case.model.mlp)
    case.model.mlp(x)
    alone = _counts(off)
    assert 0 < alone["cpu"] < whole["cpu"]       # only the submodule's forward
    off.attach(case.model)
    first = off.stats
    case.model(x)
    assert off.stats is not first
    assert _counts(off) == whole                # one step for the whole forward
    assert not tiermem.testing.in_forward(off)
    off.close()


class _Recursive(nn.Module):
    """Applies one Linear + tanh ``depth`` times by calling itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, depth: int = 3):
        y = torch.tanh(self.lin(x))
        return y if depth == 1 else self(y, depth - 1)


def test_re_entrant_module_is_one_step_bit_identical():
    torch.manual_seed(0)
    ref_model = _Recursive()
    model = copy.deepcopy(ref_model)
    x = torch.randn(8, 16)
    ref = run_step(ref_model, (x,), contextlib.nullcontext())
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    off.attach(model)
    first = off.stats
    got = run_step(model, (x,), contextlib.nullcontext())
    assert off.stats is not first
    assert torch.equal(got[0], ref[0])
    for n in ref[1]:
        assert torch.equal(got[1][n], ref[1][n]), n
    # The three levels saved their tensors in one step: x and the 3 tanh
    # outputs, two of which are also the next level's Linear input (deduplicated,
    # which happens only within one step).
    assert off.stats.count_by_tier["cpu"] == 4 and off.stats.dedup_hits == 2, off.stats
    off.close()


def test_attached_forward_inside_the_users_with_block_is_part_of_it():
    case = make_case("block")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    off.attach(case.model)
    with off as ctx:
        case.model(case.inputs[0])
        case.model(case.inputs[0])
    assert off.stats is ctx.stats
    assert ctx.stats.count_by_tier["cpu"] > 0 and ctx.stats.dedup_hits == 0
    off.close()


def test_another_offloader_attached_inside_wins_there():
    case = make_case("block")
    outer = tiermem.Offloader(policy="keep", min_offload_bytes=0)
    inner = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    outer.attach(case.model)
    inner.attach(case.model.mlp)
    case.model(case.inputs[0]).sum()
    assert inner.stats.count_by_tier["cpu"] > 0 and inner.stats.count_by_tier["keep"] == 0
    assert outer.stats.count_by_tier["keep"] > 0 and outer.stats.count_by_tier["cpu"] == 0
    inner.close()
    outer.close()


# -- rule 4: grad mode off, backward ----------------------------------------------------

@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_forward_without_grad_enters_nothing(mode):
    case = make_case("block")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    off.attach(case.model)
    case.loss().backward()
    train_stats = off.stats
    with getattr(torch, mode)():
        case.model(case.inputs[0])
    assert off.stats is train_stats and not tiermem.testing.in_forward(off)
    off.close()


class _Checkpointed(nn.Module):
    """Two transformer blocks, each run under ``torch.utils.checkpoint``."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.use_reentrant)
        return x


@pytest.mark.parametrize("attached", ["model", "model_and_block"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_inside_attached_model_bit_identical(use_reentrant, attached, make_off):
    """Checkpointed blocks inside the attached model (and, second case, one of
    them attached too: its regeneration in backward enters nothing)."""
    torch.manual_seed(0)
    ref_model = _Checkpointed(use_reentrant)
    model = copy.deepcopy(ref_model)
    x = torch.randn(2, 16, 32, requires_grad=True)
    ref = run_step(ref_model, (x,), contextlib.nullcontext(), seed=7)
    off = make_off("cpu")
    off.attach(model)
    if attached == "model_and_block":
        off.attach(model.blocks[1])
    got = run_step(model, (x,), contextlib.nullcontext(), seed=7)
    assert torch.equal(got[0], ref[0])
    for n in ref[1]:
        assert torch.equal(got[1][n], ref[1][n]), n
    assert off.stats.count_by_tier["cpu"] > 0   # the block inputs were moved
    assert not tiermem.testing.in_forward(off)


# -- rule 5: attach / detach ---------------------------------------------------------------

def test_attach_twice_raises_and_detach_removes_the_hooks():
    case = make_case("block")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    pre, post = len(case.model._forward_pre_hooks), len(case.model._forward_hooks)
    att = off.attach(case.model)
    assert att.attached and att.module is case.model
    with pytest.raises(tiermem.TierMemError, match="already attached"):
        off.attach(case.model)
    off.detach(case.model)
    assert not att.attached
    assert (len(case.model._forward_pre_hooks), len(case.model._forward_hooks)) == (pre, post)
    before = off.stats
    case.loss().backward()
    assert off.stats is before                  # detached: plain autograd
    off.detach()
    att.detach()                                # idempotent
    with pytest.raises(tiermem.TierMemError, match="not attached"):
        off.detach(case.model)
    off.attach(case.model)                      # may be attached again
    case.loss()
    assert off.stats is not before
    off.close()


def test_with_attach_detaches_on_the_way_out():
    case = make_case("block")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    with pytest.raises(_Boom):
        with off.attach(case.model) as att:
            case.loss()
            raise _Boom()
    assert not att.attached and not case.model._forward_hooks
    off.close()


def test_attach_refuses_a_closed_offloader_and_a_non_module():
    off = tiermem.Offloader(policy="cpu")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        off.attach(lambda x: x)
    off.close()
    with pytest.raises(tiermem.TierMemError, match="closed"):
        off.attach(nn.Linear(2, 2))


def test_closing_an_attached_offloader_makes_the_forward_raise():
    case = make_case("block")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    off.attach(case.model)
    off.close()
    with pytest.raises(tiermem.TierMemError, match="closed"):
        case.loss()
    off.detach()
    case.loss()                                 # plain again


# -- rule 6: copies -----------------------------------------------------------------------

@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_of_an_attached_module_are_not_attached(how):
    case = make_case("block")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    off.attach(case.model)
    case.loss()
    before = off.stats
    dup = (copy.deepcopy(case.model) if how == "deepcopy"
           else pickle.loads(pickle.dumps(case.model)))
    out = dup(case.inputs[0])
    assert off.stats is before and out.grad_fn is not None
    off.close()
