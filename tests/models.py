"""Small real models shared by the CPU tests (not collected); the steps that
train them and the exact comparisons are in ``helpers.py``.

Every model is cheap on two CPU cores yet saves a varied mix of tensors for
backward: matmul inputs, views of parameters (``weight.t()``), activation
outputs, dropout masks, LayerNorm/BatchNorm statistics, attention
intermediates, max-pool indices and int64 gather/embedding indices.

A *case* bundles a freshly initialised model (from a seed), its inputs and its
loss, so that a reference run without tiermem and a run with tiermem start
from identical parameters and identical RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "MLP", "Attention", "Block", "ConvNet", "EmbedGather", "Case", "CASES", "MODEL_NAMES",
    "make_case", "square_mean", "SaveIt",
]


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------

class MLP(nn.Sequential):
    """Linear/GELU/Linear/Tanh/Linear. An ``nn.Sequential`` subclass, so the
    qualified module names are ``MLP.0``, ``MLP.1``, ...

    Widths are chosen so that no activation has the shape of a transposed
    weight (``(24, 40)``, ``(40, 40)``, ``(40, 8)``) for a batch of 32.
    """

    D_IN, D_HIDDEN, D_OUT = 24, 40, 8

    def __init__(self) -> None:
        super().__init__(
            nn.Linear(self.D_IN, self.D_HIDDEN),
            nn.GELU(),
            nn.Linear(self.D_HIDDEN, self.D_HIDDEN),
            nn.Tanh(),
            nn.Linear(self.D_HIDDEN, self.D_OUT),
        )


class Attention(nn.Module):
    """Causal multi-head self-attention through ``F.scaled_dot_product_attention``
    with attention dropout in training."""

    def __init__(self, width: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        hd = w // self.heads
        q, k, v = self.qkv(x).split(w, dim=-1)
        q = q.view(b, s, self.heads, hd).transpose(1, 2)
        k = k.view(b, s, self.heads, hd).transpose(1, 2)
        v = v.view(b, s, self.heads, hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        return self.proj(a.transpose(1, 2).reshape(b, s, w))


class Block(nn.Module):
    """Pre-LN transformer block: LayerNorm, attention (SDPA with dropout),
    residual dropout, LayerNorm, GELU MLP. Dropout draws from the global RNG, so
    ``torch.manual_seed`` before the forward makes it reproducible."""

    def __init__(self, width: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, p)
        self.drop = nn.Dropout(p)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class ConvNet(nn.Module):
    """Conv2d/BatchNorm2d/ReLU/MaxPool twice, then a Linear classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class EmbedGather(nn.Module):
    """``nn.Embedding`` (saves its int64 ids), a Linear + tanh, and
    ``torch.gather`` along the sequence with int64 indices (saved too)."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.lin = nn.Linear(width, width)

    def forward(self, ids: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(self.emb(ids)))      # (B, T, W)
        return torch.gather(h, 1, idx)               # (B, K, W)


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    model: nn.Module
    inputs: Tuple[torch.Tensor, ...]
    loss_fn: Callable[[torch.Tensor], torch.Tensor]

    def loss(self) -> torch.Tensor:
        """Forward and loss (the part that runs under the context)."""
        return self.loss_fn(self.model(*self.inputs))


def square_mean(out: torch.Tensor) -> torch.Tensor:
    """The default loss: mean of squares, in float32."""
    return out.float().square().mean()


def _mlp(g: torch.Generator):
    return MLP(), (torch.randn(32, MLP.D_IN, generator=g),), square_mean


def _mlp_bf16(g: torch.Generator):
    model, (x,), loss = _mlp(g)
    return model.to(torch.bfloat16), (x.to(torch.bfloat16),), loss


def _block(g: torch.Generator):
    return Block(), (torch.randn(2, 16, 32, generator=g),), square_mean


def _block_bf16(g: torch.Generator):
    model, (x,), loss = _block(g)
    return model.to(torch.bfloat16), (x.to(torch.bfloat16),), loss


def _convnet(g: torch.Generator):
    x = torch.randn(4, 3, 16, 16, generator=g)
    target = torch.randint(0, 10, (4,), generator=g)
    return ConvNet(), (x,), lambda out: F.cross_entropy(out, target)


def _embed_gather(g: torch.Generator):
    ids = torch.randint(0, 50, (4, 12), generator=g)
    idx = torch.randint(0, 12, (4, 5, 16), generator=g)
    return EmbedGather(), (ids, idx), square_mean


CASES: Dict[str, Callable] = {
    "mlp": _mlp,
    "block": _block,
    "convnet": _convnet,
    "embed_gather": _embed_gather,
    "mlp_bf16": _mlp_bf16,
    "block_bf16": _block_bf16,
}
MODEL_NAMES: List[str] = list(CASES)


def make_case(name: str, seed: int = 0) -> Case:
    """A fresh model initialised from ``seed`` with inputs drawn from ``seed + 1``.
    Two calls with the same arguments give identical parameters and inputs."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model, inputs, loss_fn = CASES[name](g)
    model.train()
    return Case(name, model, inputs, loss_fn)


# ---------------------------------------------------------------------------
# A Function that saves exactly the tensor it is given
# ---------------------------------------------------------------------------

class SaveIt(torch.autograd.Function):
    """``SaveIt.apply(t, w)`` saves ``t`` for backward (nothing else) and returns
    ``w * 1``. Its backward appends what ``ctx.saved_tensors`` gives back to
    ``sink`` (the unpacked tensor itself, so its values, sizes, strides and
    storage can be inspected) and passes the gradient through to ``w``."""

    @staticmethod
    def forward(ctx, t, w, sink):
        ctx.save_for_backward(t)
        ctx.sink = sink
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        ctx.sink.append(t)
        return None, grad, None
