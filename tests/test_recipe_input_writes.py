"""A parameter or leaf that a recipe holds as it is, written in place later in
the same forward (autograd does not mind: it did not save it), is copied just
before the write, so the recipe regenerates what the forward computed
(issue 14 #10; NOTE [Writes to recipe inputs] in tiermem/tracking/writes.py)."""

import contextlib

import pytest
import torch

import tiermem

POLICIES = ["recompute", "recompute,cpu"]


def _embedding_twice(ctx):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 64, max_norm=1.0)   # renorms its weight in place per call
    ln = torch.nn.LayerNorm(64)
    i1, i2 = torch.randint(0, 50, (32,)), torch.randint(0, 50, (32,))
    with ctx:
        a = ln(emb(i1) * 3)
        b = ln(emb(i2) * 3)
        loss = (a * b).sum()
    loss.backward()
    return [p.grad.clone() for p in (*emb.parameters(), *ln.parameters())]


def _leaf_written_through_an_alias(ctx):
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with ctx:
        y = (x * w[0]).sin().cos()
        w.detach()[0].add_(1.0)          # the leaf changes during the forward
        loss = (y * (x @ w)).sum()
    loss.backward()
    return [w.grad.clone()]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", [_embedding_twice, _leaf_written_through_an_alias])
def test_in_place_writes_to_recipe_inputs_keep_gradients_exact(policy, case):
    ref = case(contextlib.nullcontext())
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    got = case(off)
    assert off.stats.count_by_tier["recompute"] > 0, "nothing was recomputed: the test tests nothing"
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    off.close()
