"""Repeated layers share their measured times (NOTE [Repeated layers share
their timings] in planner/profile.py): identical blocks get the median of
their forward times, identical recomputed tensors of their regeneration
times; the timeline and the bytes stay as measured."""

from __future__ import annotations

import torch

import tiermem
import tiermem.testing
from helpers import offloader, train_steps
from models import Case
from tiermem.models import Block, GPTConfig, TinyGPT
from tiermem.planner.profile import BlockInput, BlockRecord, TensorRecord, pool_repeated


def _rec(i, module, op="gelu", shape=(4, 8), recompute_s=None, pack_s=0.0):
    return TensorRecord(i, module, op, shape, "float32", "cpu", 128, pack_s,
                        recomputable=recompute_s is not None, recompute_s=recompute_s,
                        recipe_ops=((module, op),), first_use_s=1.0 + i)


def _block(i, start, end, forward_s, module=None, shape=(4, 8)):
    return BlockRecord(i, module or f"m.blocks.{i}", start, end, start, end, forward_s, 128,
                       start_s=0.1 * i,
                       inputs=(BlockInput(0, shape, "float32", "cpu", 128, "movable"),))


def test_identical_blocks_and_tensors_get_the_median_of_their_kind():
    recs = [_rec(0, "m.blocks.0.fc", recompute_s=0.010, pack_s=0.1),
            _rec(1, "m.blocks.1.fc", recompute_s=0.050, pack_s=0.2),
            _rec(2, "m.blocks.2.fc", recompute_s=0.020, pack_s=0.3),
            _rec(3, "m.blocks.2.fc", op="relu", recompute_s=0.7),   # another op: alone
            _rec(4, "m.head", recompute_s=0.9),                      # another module: alone
            _rec(5, "m.blocks.3.fc", shape=(4, 16), recompute_s=0.3)]  # another shape
    blocks = [_block(0, 0, 1, 0.056), _block(1, 1, 2, 0.117), _block(2, 2, 3, 0.082),
              _block(3, 5, 6, 0.5, shape=(4, 16))]   # other saved tensors and input: alone
    pool_repeated(recs, blocks)
    assert [r.recompute_s for r in recs] == [0.020, 0.020, 0.020, 0.7, 0.9, 0.3]
    assert [b.forward_s for b in blocks] == [0.082, 0.082, 0.082, 0.5]
    # The timeline and bytes are not touched.
    assert [r.pack_s for r in recs[:3]] == [0.1, 0.2, 0.3]
    assert [r.first_use_s for r in recs] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [b.start_s for b in blocks] == [0.0, 0.1, 0.2, 0.30000000000000004]
    assert all(r.nbytes == 128 for r in recs)


def test_a_tensor_not_recomputed_keeps_no_time_and_one_of_a_kind_keeps_its_own():
    recs = [_rec(0, "m.blocks.0.fc"), _rec(1, "m.blocks.1.fc", recompute_s=0.04)]
    blocks = [_block(0, 0, 1, 0.03)]
    pool_repeated(recs, blocks)
    assert recs[0].recompute_s is None and recs[1].recompute_s == 0.04
    assert blocks[0].forward_s == 0.03


def test_a_real_profile_gives_the_identical_blocks_one_time():
    cfg = GPTConfig(vocab=256, layers=4, width=64, heads=4, seq_len=64, dropout=0.1)
    torch.manual_seed(0)
    model = TinyGPT(cfg).train()
    idx = torch.randint(0, cfg.vocab, (4, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    tiermem.wrap_blocks(model, Block, checkpoint="auto")
    off = offloader("auto", device_budget="40%")
    train_steps(Case("gpt", model, (idx, idx), lambda loss: loss), lambda: off, 2)
    (profile,) = tiermem.testing.kept_profiles(off).values()
    assert len(profile.blocks) == 4
    assert len({b.forward_s for b in profile.blocks}) == 1, [b.forward_s for b in profile.blocks]
    by_kind = {}
    for r in profile.records:
        if r.recompute_s is not None and ".blocks." in r.module:
            key = (r.module.split(".blocks.", 1)[1].split(".", 1)[-1], r.op, r.shape)
            by_kind.setdefault(key, set()).add(r.recompute_s)
    assert by_kind and all(len(v) == 1 for v in by_kind.values()), by_kind
