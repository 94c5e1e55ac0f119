"""tiermem.wrap_blocks: checkpointing and per-block policies, exact gradients,
and a wrapping that behaves like the plain model everywhere else."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import tiermem
import tiermem.testing
from tiermem.models import Block, GPTConfig, TinyGPT

from helpers import assert_same_step

CFG = GPTConfig(vocab=64, seq_len=32, width=32, heads=2, layers=3, dropout=0.1)


def _model():
    torch.manual_seed(0)
    return TinyGPT(CFG)


def _step(model, off=None, seed=7):
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG.vocab, (4, CFG.seq_len), generator=g)
    torch.manual_seed(seed)
    if off is None:
        loss = model(idx, idx)
    else:
        with off:
            loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint", [True, "selective"])
def test_checkpointed_blocks_bit_identical(checkpoint, tier, make_off):
    ref = _step(_model())
    model = _model()
    wrapped = tiermem.wrap_blocks(model, Block, checkpoint=checkpoint)
    assert wrapped.names == ["blocks.0", "blocks.1", "blocks.2"]
    off = make_off(tier)
    assert_same_step(_step(model, off), ref)
    # Two steps in a row: the wrapping is reusable.
    assert_same_step(_step(model, off), ref)


def test_checkpoint_saves_far_less_and_block_inputs_go_to_the_policy():
    plain = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    _step(_model(), plain)
    model = _model()
    tiermem.wrap_blocks(model, Block, checkpoint=True)
    modules = []

    def policy(info):
        modules.append(info.module)
        return "cpu"

    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    _step(model, off)
    packed = sum(off.stats.count_by_tier.values())
    assert packed < sum(plain.stats.count_by_tier.values()) / 3
    # Each block's input was saved by the checkpoint, through tiermem's policy.
    assert sum(m.startswith("TinyGPT.blocks.") for m in modules) >= CFG.layers
    assert off.stats.count_by_tier["cpu"] >= CFG.layers


def test_block_policy_overrides_the_offloader_policy_inside_blocks():
    ref = _step(_model())
    model = _model()
    tiermem.wrap_blocks(model, Block, checkpoint=False, policy="cpu")
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    with tiermem.testing.record_placements(off) as where:
        assert_same_step(_step(model, off), ref)
    inside = {tier for m, tier in where if m.startswith("TinyGPT.blocks.")}
    outside = {tier for m, tier in where if not m.startswith("TinyGPT.blocks.")}
    assert inside == {"cpu"} and outside == {"recompute"}
    assert off.stats.count_by_tier["cpu"] > 0


def test_unwrap_restores_the_plain_model_and_state_dict_is_unchanged():
    model = _model()
    keys = list(model.state_dict())
    w = tiermem.wrap_blocks(model, Block)
    assert list(model.state_dict()) == keys
    assert all("forward" in b.__dict__ for b in model.blocks)
    w.unwrap()
    assert all("forward" not in b.__dict__ for b in model.blocks)
    w.unwrap()   # idempotent
    tiermem.wrap_blocks(model, Block)   # wrappable again


def test_deepcopy_and_pickle_keep_the_wrapping_on_the_copy():
    model = _model()
    tiermem.wrap_blocks(model, Block, checkpoint=True)
    twin = copy.deepcopy(model)
    assert twin.blocks[0].forward.module is twin.blocks[0]
    clone = pickle.loads(pickle.dumps(model))
    assert clone.blocks[1].forward.module is clone.blocks[1]
    assert_same_step(_step(twin), _step(model))


def test_selectors_names_and_predicates():
    model = _model()
    w = tiermem.wrap_blocks(model, ["blocks.0", "blocks.2"])
    assert w.names == ["blocks.0", "blocks.2"]
    w.unwrap()
    w = tiermem.wrap_blocks(model, lambda name, m: name.endswith("mlp"))
    assert w.names == [f"blocks.{i}.mlp" for i in range(CFG.layers)]
    w.unwrap()
    # Nested matches: the outer block is wrapped, its insides are not.
    w = tiermem.wrap_blocks(model, lambda name, m: name.startswith("blocks."))
    assert w.names == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(blocks=torch.nn.Conv2d), "no module"),
    (dict(blocks=Block, checkpoint="sometimes"), "checkpoint='sometimes'"),
    (dict(blocks=Block, policy="gpu"), "policy='gpu'"),
    (dict(blocks=Block, checkpoint=False), "nothing to do"),
    (dict(blocks=Block, checkpoint="selective", use_reentrant=True), "use_reentrant"),
    (dict(blocks=42), "blocks=42"),
])
def test_bad_arguments_raise_config_error(kwargs, match):
    with pytest.raises(tiermem.ConfigError, match=match):
        tiermem.wrap_blocks(_model(), **kwargs)


def test_wrapping_twice_is_refused():
    model = _model()
    tiermem.wrap_blocks(model, Block)
    with pytest.raises(tiermem.ConfigError, match="already wrapped"):
        tiermem.wrap_blocks(model, Block)


def test_inference_runs_plainly():
    model = _model().eval()
    tiermem.wrap_blocks(model, Block, checkpoint=True)
    idx = torch.randint(0, CFG.vocab, (2, 8))
    with torch.no_grad():
        out = model(idx)
    model.eval()
    plain = _model().eval()
    with torch.no_grad():
        assert torch.equal(out, plain(idx))


def test_block_policy_with_recompute_turns_producer_tracking_on():
    ref = _step(_model())
    model = _model()
    w = tiermem.wrap_blocks(model, Block, checkpoint=False, policy="recompute,cpu")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    assert_same_step(_step(model, off), ref)
    assert off.stats.count_by_tier["recompute"] > 0     # inside the blocks
    twin = copy.deepcopy(model)                          # the copy's blocks count too
    w.unwrap()
    with tiermem.Offloader(policy="cpu") as ctx:
        assert ctx.producers is not None                 # the twin still needs it
    del twin
    import gc
    gc.collect()
    with tiermem.Offloader(policy="cpu") as ctx:
        assert ctx.producers is None                     # nothing recomputes any more
