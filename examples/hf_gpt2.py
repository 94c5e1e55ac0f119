"""Train a Hugging Face ``transformers`` GPT-2 under tiermem and check it bit for bit.

The model is built from a small :class:`transformers.GPT2Config` with random
initialisation (nothing is downloaded), dropout on everywhere (embeddings,
attention probabilities, residuals). The same steps run twice from the same
seed — once plainly, once with the forward pass under ``tiermem.Offloader`` —
and every gradient of every step must be bit-identical (``torch.equal``), as
must the losses.

    python examples/hf_gpt2.py                       # policies keep and cpu
    python examples/hf_gpt2.py --policy nvme --nvme-dir /mnt/nvme --steps 3

Uses a GPU when there is one (``--device``). Exit status 1 if anything differs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import tempfile
from typing import Callable, Dict, List, Tuple

import torch

import tiermem

__all__ = ["tiny_config", "make_model", "make_batches", "train", "compare"]


def tiny_config(layers: int = 2, width: int = 128, heads: int = 4, seq: int = 128,
                vocab: int = 512, dropout: float = 0.1, attn: str = "sdpa"):
    """A GPT-2 config small enough for a CPU test (no download, random init)."""
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers,
                     n_head=heads, resid_pdrop=dropout, embd_pdrop=dropout,
                     attn_pdrop=dropout, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                     use_cache=False)
    cfg._attn_implementation = attn
    return cfg


def make_model(cfg, seed: int, device: torch.device):
    """``GPT2LMHeadModel`` initialised from ``seed`` (in training mode)."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).to(device)
    model.loss_type = "ForCausalLM"  # what it falls back to anyway, without a warning
    model.train()
    return model


def make_batches(cfg, batch: int, seq: int, n: int, seed: int,
                 device: torch.device) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device)
            for _ in range(n)]


def train(model, batches: List[torch.Tensor], ctx: Callable[[], contextlib.AbstractContextManager],
          seed: int) -> Tuple[List[torch.Tensor], List[Dict[str, torch.Tensor]]]:
    """One AdamW step per batch with the forward pass under ``ctx()``; returns the
    losses and, per step, a copy of every gradient (taken before the update)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for i, ids in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(seed * 1000 + i)  # the dropout masks of step i
        with ctx():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    return losses, grads


def compare(ref, got) -> List[str]:
    """Differences between two ``train`` results (empty when bit-identical)."""
    problems = []
    (rl, rg), (gl, gg) = ref, got
    for i, (a, b) in enumerate(zip(rl, gl)):
        if not torch.equal(a, b):
            problems.append(f"step {i}: loss {a.item()!r} != {b.item()!r}")
    for i, (a, b) in enumerate(zip(rg, gg)):
        if a.keys() != b.keys():
            problems.append(f"step {i}: gradients for different parameters")
            continue
        for n in a:
            if not torch.equal(a[n], b[n]):
                diff = (a[n].float() - b[n].float()).abs().max().item()
                problems.append(f"step {i}: grad of {n} differs (max abs diff {diff:g})")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", action="append",
                   choices=("keep", "cpu", "nvme", "recompute", "recompute,cpu", "recompute,nvme"),
                   help="repeatable (default: keep and cpu)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    p.add_argument("--min-offload-bytes", type=int, default=None,
                   help="tiermem min_offload_bytes (default: tiermem's, 64 KiB)")
    p.add_argument("--nvme-dir", default=None, help="for --policy nvme (default: a temp dir)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if a.device == "auto" else a.device))
    if device.type == "cuda":
        # Bitwise comparisons need deterministic kernels (cuBLAS workspace, attention).
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = tiny_config(a.layers, a.width, a.heads, a.seq, dropout=0.1, attn=a.attn)
    base = make_model(cfg, a.seed, device)
    batches = make_batches(cfg, a.batch, a.seq, a.steps, a.seed + 1, device)
    ref = train(copy.deepcopy(base), batches, contextlib.nullcontext, a.seed)
    print(f"GPT-2 ({sum(p.numel() for p in base.parameters()) / 1e6:.2f} M parameters, "
          f"{a.layers} layers, attention {a.attn}) on {device}; plain losses: "
          + ", ".join(f"{l.item():.4f}" for l in ref[0]))
    failed = False
    for policy in a.policy or ["keep", "cpu"]:
        kw = {}
        if a.min_offload_bytes is not None:
            kw["min_offload_bytes"] = a.min_offload_bytes
        tmp = None
        if "nvme" in policy:
            tmp = tempfile.TemporaryDirectory(prefix="tiermem-hf-") if not a.nvme_dir else None
            kw["nvme_dir"] = a.nvme_dir or tmp.name
        off = tiermem.Offloader(policy=policy, **kw)
        try:
            got = train(copy.deepcopy(base), batches, lambda: off, a.seed)
            stats = off.stats
        finally:
            off.close()
            if tmp is not None:
                tmp.cleanup()
        problems = compare(ref, got)
        status = "bit-identical" if not problems else "DIFFERENT"
        print(f"policy {policy}: {status}; last step: {stats}")
        for msg in problems[:10]:
            print("   ", msg)
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
