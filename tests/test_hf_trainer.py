"""A Hugging Face ``Trainer`` run with tiermem attached (``off.attach(trainer.model)``,
no change to the loop) matches the same run without tiermem, loss for loss
(exact float equality of the logged losses) and parameter for parameter
(``torch.equal`` of the final parameters), under keep, cpu, nvme,
recompute and auto (50% and 25% of a plain step). A small random-init GPT-2
with dropout on the CPU, with gradient accumulation (two forwards per
optimizer step); a Llama (RoPE, grouped-query attention) under recompute and
auto. The training code is
``examples/hf_trainer.py``; the last test runs it as a script.
"""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf_trainer.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))
import hf_gpt2  # noqa: E402
import hf_trainer  # noqa: E402

pytestmark = pytest.mark.slow   # Trainer start-up: a few seconds per run

STEPS, BATCH, ACCUM = 3, 2, 2
VOCAB, SEQ = 256, 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = hf_gpt2.tiny_config(layers=2, width=64, heads=2, seq=SEQ, vocab=VOCAB, dropout=0.1)
    data = hf_trainer.make_dataset(VOCAB, STEPS * BATCH * ACCUM, SEQ, seed=1)
    out = str(tmp_path_factory.mktemp("trainer"))
    ref = hf_trainer.train(None, cfg, data, out, steps=STEPS, batch=BATCH, grad_accum=ACCUM)
    return cfg, data, ref


@pytest.fixture(scope="module")
def llama_setup(tmp_path_factory):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ, attention_dropout=0.1, use_cache=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    data = hf_trainer.make_dataset(VOCAB, STEPS * BATCH * ACCUM, SEQ, seed=1)
    out = str(tmp_path_factory.mktemp("trainer_llama"))
    ref = hf_trainer.train(None, cfg, data, out, steps=STEPS, batch=BATCH, grad_accum=ACCUM)
    return cfg, data, ref


@pytest.mark.parametrize("arch, policy", [
    *(("gpt2", p) for p in ("keep", "cpu", "nvme", "recompute", "auto@50%", "auto@25%")),
    ("llama", "recompute"), ("llama", "auto@25%")])
def test_trainer_with_attached_offloader_matches_plain_run(arch, policy, tmp_path, request):
    cfg, data, (ref_losses, ref_params, _) = request.getfixturevalue(
        "setup" if arch == "gpt2" else "llama_setup")
    policy, _, budget = policy.partition("@")
    losses, params, stats = hf_trainer.train(
        policy, cfg, data, str(tmp_path), steps=STEPS, batch=BATCH, grad_accum=ACCUM,
        min_offload_bytes=4096, nvme_dir=str(tmp_path / "nvme"), device_budget=budget or None)
    assert len(ref_losses) == STEPS
    assert losses == ref_losses, (losses, ref_losses)
    differ = [n for n in ref_params if not (params[n] == ref_params[n]).all()
              or params[n].dtype != ref_params[n].dtype]
    assert not differ, f"final parameters differ: {differ[:5]}"
    # Every optimizer step ran under the Offloader with the policy's tier (auto:
    # the last micro-batch of each step follows a plan that moves tensors).
    assert len(stats) == STEPS, stats
    for line in stats:
        if policy == "auto":
            moved = re.findall(r"\b(?:cpu|nvme|recompute) (\d+) \(", line)
            assert sum(map(int, moved)) > 0, line
        else:
            m = re.search(rf"\b{policy} (\d+) \(", line)
            assert m and int(m.group(1)) > 10, line


def test_example_script_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env = {k: v for k, v in env.items() if not k.startswith("TIERMEM_")}
    res = subprocess.run(
        [sys.executable, EXAMPLE, "--policy", "cpu", "--steps", "1", "--layers", "1",
         "--width", "32", "--seq", "16", "--batch", "2", "--vocab", "64"],
        capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "policy cpu: bit-identical" in res.stdout, res.stdout


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_hf_gradient_checkpointing_inside_attached_model(use_reentrant):
    """GPT-2's own activation checkpointing inside an attached model: gradients
    bit-identical to the same checkpointed model without tiermem."""
    import contextlib
    import copy

    import torch

    import tiermem

    cfg = hf_gpt2.tiny_config(layers=2, width=64, heads=2, seq=SEQ, vocab=VOCAB, dropout=0.1)
    base = hf_gpt2.make_model(cfg, seed=0, device=torch.device("cpu"))
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(base, "activation_checkpointing_enable"):   # its name since transformers 5
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    batches = hf_gpt2.make_batches(cfg, batch=2, seq=SEQ, n=2, seed=1, device=torch.device("cpu"))
    ref = hf_gpt2.train(copy.deepcopy(base), batches, contextlib.nullcontext, seed=0)
    model = copy.deepcopy(base)
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=4096)
    with off.attach(model):
        got = hf_gpt2.train(model, batches, contextlib.nullcontext, seed=0)
    off.close()
    assert hf_gpt2.compare(ref, got) == []
    assert off.stats.count_by_tier["cpu"] > 0   # the block inputs were moved
