"""A real client: Hugging Face ``transformers`` GPT-2 trained under tiermem.

The model comes from a tiny ``GPT2Config`` with random initialisation (no
download), dropout on everywhere with fixed seeds; two AdamW steps with each
policy must give losses and gradients bit-identical (``torch.equal``) to the
same steps without tiermem. The training code is ``examples/hf_gpt2.py``.
"""

import contextlib
import copy
import os
import sys

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[test]')")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import hf_gpt2  # noqa: E402

STEPS = 2
DEV = torch.device("cpu")


@pytest.fixture(scope="module")
def setup():
    # width 64, seq 64, batch 2: the largest saved tensors are 64 KiB-1 MiB, so
    # min_offload_bytes=4096 makes the policy move nearly all of them.
    cfg = hf_gpt2.tiny_config(layers=2, width=64, heads=4, seq=64, vocab=256, dropout=0.1)
    base = hf_gpt2.make_model(cfg, seed=0, device=DEV)
    batches = hf_gpt2.make_batches(cfg, batch=2, seq=64, n=STEPS, seed=1, device=DEV)
    ref = hf_gpt2.train(copy.deepcopy(base), batches, contextlib.nullcontext, seed=0)
    return base, batches, ref


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_attention_dropout_is_on(attn):
    cfg = hf_gpt2.tiny_config(layers=1, width=32, heads=2, seq=16, vocab=64, dropout=0.1,
                              attn=attn)
    model = hf_gpt2.make_model(cfg, seed=0, device=DEV)
    ids = torch.randint(0, 64, (1, 16))
    torch.manual_seed(1)
    a = model(input_ids=ids).logits
    torch.manual_seed(2)
    b = model(input_ids=ids).logits
    assert cfg.attn_pdrop == 0.1 and not torch.equal(a, b)  # dropout draws from the seed


def test_gradients_bit_identical(setup, tier, make_off):
    base, batches, ref = setup
    policy = tier
    # The engine the environment would choose (auto: the C++ one where it builds).
    off = make_off(policy, min_offload_bytes=4096, engine="auto")
    try:
        got = hf_gpt2.train(copy.deepcopy(base), batches, lambda: off, seed=0)
        stats = off.stats
    finally:
        off.close()
    assert hf_gpt2.compare(ref, got) == []
    assert len(got[1]) == STEPS and len(got[1][0]) == len(list(base.parameters()))
    if policy == "keep":
        assert stats.offloaded_bytes == 0
    elif policy.startswith("recompute"):
        # GPT-2's tanh-approximated GELU is a chain of pointwise ops whose
        # saved intermediates are recomputable from the saved input.
        assert stats.count_by_tier["recompute"] > 10, stats
        if policy == "recompute,cpu":
            assert stats.count_by_tier["cpu"] > 10
        else:
            assert stats.count_by_tier["cpu"] == stats.count_by_tier["nvme"] == 0, stats
    else:
        # The policy really moved the activations (not a silent no-op).
        assert stats.count_by_tier[policy] > 10
        assert stats.bytes_by_tier[policy] > stats.bytes_by_tier["keep"]


def test_example_main_runs(capsys):
    assert hf_gpt2.main(["--layers", "1", "--width", "32", "--heads", "2", "--seq", "32",
                         "--batch", "2", "--min-offload-bytes", "4096", "--device", "cpu",
                         "--policy", "cpu"]) == 0
    assert "policy cpu: bit-identical" in capsys.readouterr().out
