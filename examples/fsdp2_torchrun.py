"""FSDP2 training under tiermem, one process per rank, launched by torchrun.

    torchrun --nproc-per-node 2 examples/fsdp2_torchrun.py [--policy cpu] [--steps 4]

A small random-init transformer, ``fully_shard`` on each block and on the
root, a few AdamW steps with the forward under an :class:`tiermem.Offloader`;
each rank prints its loss and its tiermem stats per step. On GPUs each rank
uses its own device (``LOCAL_RANK``) and NCCL; without GPUs the CPU and gloo.

Per rank (NOTE [Per-rank budgets] in tiermem/memory/ranks.py): default budgets are
the node's divided by ``LOCAL_WORLD_SIZE``, explicit ones are per rank, and
with ``--nvme-dir`` (or ``TIERMEM_NVME_DIR``) every rank writes to its own
private directory there.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tiermem


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, w // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, w))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class SmallLM(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h).flatten(0, 1))   # (batch * seq, vocab)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="cpu", help="tiermem policy (default: cpu)")
    p.add_argument("--nvme-dir", default=None, help="NVMe dir (needed by policy nvme)")
    p.add_argument("--engine", default=None, help="NVMe I/O engine: auto, cpp, python")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()

    if "RANK" not in os.environ:
        raise SystemExit("run me with torchrun, e.g. torchrun --nproc-per-node 2 "
                         "examples/fsdp2_torchrun.py")
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)   # same initial model on every rank
    vocab = 256
    model = SmallLM(vocab, args.width, heads=4, layers=args.layers).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    off = tiermem.Offloader(policy=args.policy, nvme_dir=args.nvme_dir, engine=args.engine)
    gen = torch.Generator().manual_seed(1 + rank)   # each rank its own data
    try:
        for step in range(args.steps):
            tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1),
                                   generator=gen).to(device)
            with off:
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits, tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            # One write per line: the ranks share the terminal.
            sys.stdout.write(f"[rank {rank}/{world}] step {step} loss {loss.item():.4f} | "
                             f"{off.stats}\n")
            sys.stdout.flush()
    finally:
        off.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
