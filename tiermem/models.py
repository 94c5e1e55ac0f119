"""Small reference models for the demo, the benchmarks and the tests.

:class:`TinyGPT` is a plain-PyTorch, GPT-style decoder (pre-LayerNorm blocks,
causal self-attention through ``F.scaled_dot_product_attention``, GELU MLP,
learned positional embeddings, tied or untied output head). It is small enough
to train a few steps on a laptop CPU, and large enough that most of the tensors
autograd saves are above tiermem's default ``min_offload_bytes`` at the sizes
the demo uses.

Importing this module does not initialise CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "TinyGPT", "CausalSelfAttention", "MLP", "Block"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`TinyGPT`.

    ``width`` must be divisible by ``heads``. ``dropout`` applies to the
    embeddings, the attention probabilities, and the outputs of attention and
    MLP. ``tied_head``: the output projection shares the token embedding's
    weight.
    """

    vocab: int = 512
    layers: int = 4
    width: int = 128
    heads: int = 4
    seq_len: int = 128
    dropout: float = 0.1
    tied_head: bool = True
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.width % self.heads != 0:
            raise ValueError(
                f"GPTConfig: width={self.width} is not divisible by heads={self.heads}")
        for name in ("vocab", "layers", "width", "heads", "seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig: {name}={getattr(self, name)} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout} must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Linear -> GELU -> Linear -> Dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.width
        self.fc = nn.Linear(cfg.width, hidden)
        self.proj = nn.Linear(hidden, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder. ``forward(idx, targets=None)`` returns logits, or the
    mean cross-entropy loss over all positions when ``targets`` is given.

    ``idx`` and ``targets`` are ``(batch, seq)`` integer tensors with
    ``seq <= cfg.seq_len``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.width)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        if cfg.tied_head:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"TinyGPT: sequence length {t} exceeds seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def num_parameters(self) -> int:
        """Parameters counted once (a tied head is not counted twice)."""
        return sum(p.numel() for p in self.parameters())
