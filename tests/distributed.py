"""Helpers of the distributed tests (not collected): spawn a process group of
ranks on the CPU with gloo, bounded in time, and collect what each rank reports.

- :func:`free_port`: a TCP port nobody listens on now (bound to port 0).
- :func:`run_ranks`: ``fn(rank, world_size, port, *args)`` in ``world_size``
  spawned processes; each rank returns a JSON-ready dict, written to a file and
  returned here as a list indexed by rank. A rank that raises fails the test
  with its traceback; a group still running after ``timeout_s`` is killed and
  fails the test (a hang must fail, not stall CI).
- :func:`init_gloo` / :func:`shutdown`: what a rank calls first and last.
- :class:`TinyLM` (a stack of :class:`Block`): the small language model the
  distributed tests train. Each block ends with ``h * gain``, a product the
  next block saves (its recipe would need the previous block's parameter).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from typing import Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["free_port", "run_ranks", "init_gloo", "shutdown", "Block", "TinyLM"]


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, backend: str = "gloo") -> None:
    """Join the group as torchrun would have set it up (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE in the environment), with one thread of
    intra-op work per rank (two ranks share two cores). ``backend="nccl"``:
    rank ``r`` uses CUDA device ``r`` (the GPU tests)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    for key in [k for k in os.environ if k.startswith("TIERMEM_")]:
        del os.environ[key]   # a developer's settings must not change what is checked
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args) -> None:
    result = fn(rank, world_size, port, *args)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Done: leave without the interpreter's finalization. A gloo rank there
    # sometimes aborted (``terminate called without an active exception``, no
    # Python frame running, about 1 module run in 30), after its results were
    # written and its group destroyed: a failure of no test.
    os._exit(0)


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 120.0) -> List[dict]:
    """Run ``fn(rank, world_size, port, *args)`` on ``world_size`` spawned ranks;
    their results, by rank. Raises ``AssertionError`` on a timeout (after
    killing the ranks) and re-raises a rank's exception."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tiermem-dist-") as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, port, out_dir, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join(5)
                raise AssertionError(f"{fn.__name__}: {world_size} ranks still running after "
                                     f"{timeout_s:.0f} s (a hang); killed")
        out = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                out.append(json.load(f))
        return out


class Block(nn.Module):
    def __init__(self, width: int, heads: int, alias: bool = False) -> None:
        super().__init__()
        self.heads, self.alias = heads, alias
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        if self.alias:   # saves an alias of the unsharded gain, not a parameter nor a view
            x = x * self.gain.detach()
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, w // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        h = x + self.proj(a.transpose(1, 2).reshape(b, s, w))
        h = h + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(h)))), 0.1, self.training)
        return h * self.gain


class TinyLM(nn.Module):
    def __init__(self, vocab=64, width=32, heads=2, layers=2, checkpoint=False,
                 twice=False, alias=False) -> None:
        super().__init__()
        self.checkpoint, self.twice = checkpoint, twice
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, alias) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        if self.twice:   # FSDP2 frees block 0's parameters and gathers them again
            h = self.blocks[0](h)
        for block in self.blocks:
            if self.checkpoint:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.head(self.ln(h))
