"""The model zoo (not collected): real ``transformers`` architectures built
from tiny configs with random initialisation (nothing is downloaded), the
AdamW steps that train them, and the exact comparison of two runs.

Each :class:`Arch` builds its model from a seed in training mode, with
dropout on wherever the architecture has it, and makes its batches; the loss
is the model's own (``labels=``). ``tests/test_model_zoo.py`` runs the matrix.

- Decoders: ``llama`` (RoPE, grouped-query attention), ``mistral`` (a sliding
  window shorter than the sequence, eager attention), ``mixtral`` (MoE with
  router jitter noise and the auxiliary loss), ``qwen2_moe`` (MoE with a
  gated shared expert), ``gpt_neox`` (parallel residual, partial rotary).
- ``t5`` (encoder-decoder, cross-attention), ``bert`` (encoder, masked LM),
  ``vit`` (vision transformer), ``mamba`` (state-space model, its pure-torch
  path: no dropout in the architecture).
- Conv nets (no HF gradient checkpointing): ``convnext`` (stochastic depth),
  ``resnet`` (BatchNorm, whose running statistics are compared too; no
  dropout; tiermem recomputes none of its tensors: convolution and BatchNorm
  are not recomputable, and a ReLU's input costs as much as its output).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

from helpers import assert_same_tensors

__all__ = ["Arch", "ARCHS", "ARCH_NAMES", "GC_MODES", "build", "batches", "train", "compare"]

VOCAB, SEQ, BATCH, WIDTH, HEADS = 64, 16, 2, 32, 4
DROPOUT = 0.1

#: HF gradient checkpointing modes: off, ``use_reentrant=False`` and ``True``.
GC_MODES = ("no_gc", "gc_nonreentrant", "gc_reentrant")


@dataclass(frozen=True)
class Arch:
    """How to build one architecture and feed it."""

    name: str
    make: Callable[[], torch.nn.Module]          # the model, from the current seed
    batch: Callable[[torch.Generator], Dict[str, torch.Tensor]]
    gc: bool = True                              # supports HF gradient checkpointing
    recomputes: bool = True                      # has tensors tiermem can recompute


def _tokens(g: torch.Generator) -> Dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _masked_lm(g: torch.Generator) -> Dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]   # at least one label per row
    return {"input_ids": ids, "labels": labels}


def _seq2seq(g: torch.Generator) -> Dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=g),
            "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}


def _image(g: torch.Generator) -> Dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 5, (BATCH,), generator=g)}


def _decoder(config_cls, model_cls, **extra):
    def make():
        import transformers
        cfg = getattr(transformers, config_cls)(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
            num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
            max_position_embeddings=2 * SEQ, attention_dropout=DROPOUT, use_cache=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
        return getattr(transformers, model_cls)(cfg)
    return make


def _gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
                        num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                        max_position_embeddings=2 * SEQ, attention_dropout=DROPOUT,
                        hidden_dropout=DROPOUT, use_parallel_residual=True, use_cache=False,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return GPTNeoXForCausalLM(cfg)


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=2 * WIDTH,
                   num_layers=2, num_decoder_layers=2, num_heads=HEADS, dropout_rate=DROPOUT,
                   relative_attention_num_buckets=8, decoder_start_token_id=0,
                   pad_token_id=0, eos_token_id=1, use_cache=False)
    return T5ForConditionalGeneration(cfg)


def _bert():
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
                     num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                     max_position_embeddings=2 * SEQ, hidden_dropout_prob=DROPOUT,
                     attention_probs_dropout_prob=DROPOUT, use_cache=False)
    return BertForMaskedLM(cfg)


def _vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=WIDTH,
                    num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                    hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT,
                    num_labels=5)
    return ViTForImageClassification(cfg)


def _mamba():
    from transformers import MambaConfig, MambaForCausalLM
    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=WIDTH, state_size=8, num_hidden_layers=2,
                      expand=2, conv_kernel=4, use_cache=False, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    return MambaForCausalLM(cfg)


def _convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification
    cfg = ConvNextConfig(num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16],
                         depths=[1, 1], drop_path_rate=DROPOUT, image_size=16, num_labels=5)
    return ConvNextForImageClassification(cfg)


def _resnet():
    from transformers import ResNetConfig, ResNetForImageClassification
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic", num_labels=5)
    return ResNetForImageClassification(cfg)


ARCHS: Dict[str, Arch] = {a.name: a for a in [
    Arch("llama", _decoder("LlamaConfig", "LlamaForCausalLM"), _tokens),
    Arch("mistral", _decoder("MistralConfig", "MistralForCausalLM", sliding_window=SEQ // 2,
                             attn_implementation="eager"), _tokens),
    Arch("mixtral", _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                             num_experts_per_tok=2, router_jitter_noise=DROPOUT,
                             output_router_logits=True, router_aux_loss_coef=0.01), _tokens),
    Arch("qwen2_moe", _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=WIDTH,
                               shared_expert_intermediate_size=WIDTH,
                               output_router_logits=True, router_aux_loss_coef=0.01), _tokens),
    Arch("gpt_neox", _gpt_neox, _tokens),
    Arch("t5", _t5, _seq2seq),
    Arch("bert", _bert, _masked_lm),
    Arch("vit", _vit, _image),
    Arch("mamba", _mamba, _tokens),
    Arch("convnext", _convnext, _image, gc=False),
    Arch("resnet", _resnet, _image, gc=False, recomputes=False),
]}
ARCH_NAMES = tuple(ARCHS)


def build(name: str, gc: str, seed: int = 0) -> torch.nn.Module:
    """A fresh ``name`` model initialised from ``seed``, in training mode, with
    HF gradient checkpointing as ``gc`` (one of :data:`GC_MODES`) says."""
    torch.manual_seed(seed)
    model = ARCHS[name].make()
    if gc != "no_gc":
        kwargs = {"use_reentrant": gc == "gc_reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):   # its name since transformers 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        on = getattr(model, "is_activation_checkpointing", None)
        if on is None:   # before transformers 5
            on = model.is_gradient_checkpointing
        assert on, f"{name}: the model's checkpointing did not turn on"
    model.train()
    return model


def batches(name: str, n: int, seed: int = 1) -> List[Dict[str, torch.Tensor]]:
    """``n`` batches for ``name`` (keyword arguments of its forward, labels
    included), the same for the same ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [ARCHS[name].batch(g) for _ in range(n)]


Record = Tuple[torch.Tensor, Dict[str, torch.Tensor], Dict[str, torch.Tensor]]


def train(model: torch.nn.Module, data, ctx: Callable[[], contextlib.AbstractContextManager],
          after_backward: Callable[[], None] = lambda: None, seed: int = 0) -> List[Record]:
    """One AdamW step per batch of ``data``, the forward (with the loss) under
    ``ctx()``. The RNG is seeded once, before the first step, as a user
    would: the later steps' dropout masks and router jitter are the same as
    the plain run's only if nothing tiermem did drew from the generator.
    ``after_backward`` runs after each backward. Returns per step ``(loss,
    grads, state after the step)``, the state being every parameter and
    buffer (BatchNorm's running statistics)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    records = []
    torch.manual_seed(seed)
    for batch in data:
        opt.zero_grad(set_to_none=True)
        with ctx():
            loss = model(**batch).loss
        loss.backward()
        after_backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        opt.step()
        state = {n: t.detach().clone() for n, t in model.state_dict().items()}
        records.append((loss.detach().clone(), grads, state))
    return records


def compare(got: List[Record], ref: List[Record], what: str) -> None:
    """Every step's loss, gradients and state bit-identical (``torch.equal``);
    the steps trained (the state changed)."""
    assert len(got) == len(ref), f"{what}: {len(got)} steps vs {len(ref)}"
    for i, ((loss, grads, state), (rloss, rgrads, rstate)) in enumerate(zip(got, ref)):
        assert torch.equal(loss, rloss), f"{what} step {i}: loss {loss.item()!r} != {rloss.item()!r}"
        assert_same_tensors(grads, rgrads, f"{what} step {i} grads")
        assert_same_tensors(state, rstate, f"{what} step {i} state")
    first, last = ref[0][2], ref[-1][2]
    assert any(not torch.equal(first[n], last[n]) for n in first), f"{what}: nothing trained"
