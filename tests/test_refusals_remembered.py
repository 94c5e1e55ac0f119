"""The recompute tier remembers its refusals from one forward to the next
(NOTE [Refusals remembered] in tiermem/tiers/refusals.py): the next forward
of a kind refuses the same tensors for the same reasons without planning them
again, re-plans them after MAX_AGE forwards, and a different forward is planned."""

import pytest
import torch

import tiermem
import tiermem.testing
from tiermem.models import GPTConfig, TinyGPT
from tiermem.tiers.refusals import MAX_AGE


def _model():
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab=64, layers=2, width=32, heads=2, seq_len=16))


def _step(model, off, seq=16, seed=0):
    torch.manual_seed(seed)
    x = torch.randint(0, 64, (2, seq))
    with off:
        loss = model(x, x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return loss.detach(), grads, off.stats


def _reasons(stats):
    return dict(stats.recompute_fallback_reasons), stats.recompute_count, stats.count_by_tier


@pytest.mark.parametrize("policy", ["recompute", "recompute,cpu"])
def test_a_like_forward_answers_refusals_without_planning_and_stays_exact(policy):
    model = _model()
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    first = _step(model, off)
    planned_first = tiermem.testing.refusals_planned(off)
    assert planned_first > 0, "nothing was refused: the test tests nothing"
    fresh = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    for i in range(1, MAX_AGE + 2):
        loss, grads, stats = _step(model, off, seed=i)
        planned = tiermem.testing.refusals_planned(off)
        ref_loss, ref_grads, ref_stats = _step(model, fresh, seed=i)   # plans everything
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
        assert _reasons(stats) == _reasons(ref_stats) == _reasons(first[2])
        # Forward MAX_AGE + 1 plans its refusals again; those before it do not.
        assert planned == (planned_first if i == MAX_AGE else 0), (i, planned)
        fresh.close()
        fresh = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    off.close()
    fresh.close()


def test_another_forward_is_planned():
    """Other shapes are other keys: planned, and what a fresh Offloader does."""
    model = _model()
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    _step(model, off, seq=16)
    _, _, stats = _step(model, off, seq=8)
    assert tiermem.testing.refusals_planned(off) > 0
    fresh = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    _, _, ref = _step(model, fresh, seq=8)
    assert _reasons(stats) == _reasons(ref)
    off.close()
    fresh.close()


@pytest.mark.parametrize("policy", ["recompute", "recompute,cpu"])
def test_forwards_of_two_kinds_in_turn_each_answer_their_own_refusals(policy):
    """Sequence lengths 16 and 8 in turn: each is a kind of forward with its
    own remembered refusals (NOTE [Records learned by position], 4), so from
    the third step on none is planned again, and each step refuses what a
    fresh Offloader does."""
    model = _model()
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    planned = []
    for i, seq in enumerate([16, 8] * 4):
        _, _, stats = _step(model, off, seq=seq, seed=i)
        planned.append(tiermem.testing.refusals_planned(off))
        fresh = tiermem.Offloader(policy=policy, min_offload_bytes=0)
        _, _, ref = _step(model, fresh, seq=seq, seed=i)
        assert _reasons(stats) == _reasons(ref), i
        fresh.close()
    off.close()
    assert planned[0] > 0 and planned[1] > 0, planned
    assert planned[2:] == [0] * 6, planned


def test_must_recompute_is_always_planned_and_raises():
    """A MUST_RECOMPUTE answer for a tensor that cannot be recomputed raises
    at every forward, with its reason, even after the key was refused."""
    from torch.utils.checkpoint import CheckpointPolicy

    calls = []

    def policy(info):
        calls.append(info.op)
        return CheckpointPolicy.MUST_RECOMPUTE if calls[-1] in ("mm", "addmm") else "keep"

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    for _ in range(2):
        with pytest.raises(tiermem.TierMemError, match="MUST_RECOMPUTE"):
            with off:
                model(torch.randn(4, 8, requires_grad=True)).sum()
    off.close()
