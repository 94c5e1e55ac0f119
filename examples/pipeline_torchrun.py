"""Pipeline-parallel training under tiermem, one stage per rank, launched by torchrun.

    torchrun --nproc-per-node 2 examples/pipeline_torchrun.py [--policy cpu] [--schedule 1f1b]

A small random-init language model split into one stage per rank
(``torch.distributed.pipelining``: ``PipelineStage`` and ``ScheduleGPipe`` or
``Schedule1F1B``), a few SGD steps of several microbatches each. Each rank
attaches one Offloader to its stage's module with
``tiermem.integrations.pipelining.attach_stage``: every microbatch's forward is
a step of that Offloader. Each rank prints, per step, its stage's microbatch
steps and what tiermem did in them; the last stage prints the loss.

With ``--check`` (the default) the same training runs first without tiermem,
and every rank compares its losses and parameters with it bit for bit. The
exit status is 1 when a loss is not finite, when the runs differ, or when a
microbatch step did not use the policy's tiers. On GPUs each rank uses its own
device (``LOCAL_RANK``) and NCCL; without GPUs the CPU and gloo.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import tiermem
from tiermem.integrations.pipelining import attach_stage


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
        return x + F.dropout(self.down(F.gelu(self.up(self.ln2(x)))), 0.1, self.training)


class Stage(nn.Module):
    """One stage: the embedding on the first, the head on the last, blocks on all."""

    def __init__(self, vocab: int, width: int, layers: int, first: bool, last: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width) if first else None
        self.blocks = nn.ModuleList(Block(width, heads=4) for _ in range(layers))
        self.ln = nn.LayerNorm(width) if last else None
        self.head = nn.Linear(width, vocab) if last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            h = self.emb(h)
        for block in self.blocks:
            h = block(h)
        if self.head is not None:
            h = self.head(self.ln(h))
        return h


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _used(policy: str, stats: tiermem.StepStats) -> bool:
    """Whether one microbatch step used the policy's tiers."""
    if policy == "keep":
        return stats.offloaded_bytes == 0
    return stats.offloaded_bytes > 0 or stats.recompute_count > 0


def _summary(steps: list) -> str:
    """What tiermem did in a stage's microbatch steps, added up."""
    count = {t: sum(s.count_by_tier[t] for s in steps) for t in steps[0].count_by_tier}
    nbytes = {t: sum(s.bytes_by_tier[t] for s in steps) for t in count}
    tiers = ", ".join(f"{t} {count[t]} ({nbytes[t] / 2**10:.0f} KiB)" for t in count if count[t])
    recomputed = sum(s.recompute_count for s in steps)
    stall_ms = 1e3 * sum(s.stall_seconds for s in steps)
    return (f"{len(steps)} microbatch steps: {tiers} | recomputed {recomputed} | "
            f"stall {stall_ms:.2f} ms")


def train(args, rank: int, world: int, device: torch.device, off):
    """The pipeline's training; (losses on the last stage, parameters, problems)."""
    first, last = rank == 0, rank == world - 1
    vocab = 256
    torch.manual_seed(0)   # the same whole model on every rank: take this rank's part
    stages = [Stage(vocab, args.width, args.layers, i == 0, i == world - 1) for i in range(world)]
    module = stages[rank].to(device)
    attached = attach_stage(off, module) if off is not None else None
    stage = PipelineStage(module, rank, world, device)
    cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = cls(stage, args.microbatches, loss_fn=_loss)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)   # the same batches on every rank
    losses, problems = [], []
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=gen).to(device)
        torch.manual_seed(1000 * rank + step)   # dropout: the same stream in both runs
        mb_losses: list = []
        if first:
            schedule.step(tokens[:, :-1])
        elif last:
            schedule.step(target=tokens[:, 1:], losses=mb_losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        line = f"[rank {rank}/{world}] stage {rank} step {step}"
        if last:
            loss = torch.stack(mb_losses).mean().item()
            losses.append(loss)
            line += f" loss {loss:.4f}"
            if not math.isfinite(loss):
                problems.append(f"step {step}: loss {loss}")
        if attached is not None:
            steps = attached.take_stats()
            line += f" | {_summary(steps)}"
            planned = step == args.steps - 1 or args.policy != "auto"   # auto profiles first
            if planned and not all(_used(args.policy, s) for s in steps[-args.microbatches:]):
                problems.append(f"step {step}: a microbatch step did not use {args.policy}")
        # One write per line: the ranks share the terminal.
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    if attached is not None:
        attached.detach()
    return losses, [p.detach().clone() for p in module.parameters()], problems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="cpu", help="tiermem policy (default: cpu)")
    p.add_argument("--device-budget", default="50%", help="policy auto's device budget")
    p.add_argument("--nvme-dir", default=None, help="NVMe dir (needed by policy nvme)")
    p.add_argument("--engine", default=None, help="NVMe I/O engine: auto, cpp, python")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="blocks per stage")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with the same training without tiermem (default: on)")
    args = p.parse_args()

    if "RANK" not in os.environ:
        raise SystemExit("run me with torchrun, e.g. torchrun --nproc-per-node 2 "
                         "examples/pipeline_torchrun.py")
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

    settings = {"nvme_dir": args.nvme_dir, "engine": args.engine}
    if args.policy == "auto":   # pipeline ranks plan alone (attach_stage's contract)
        settings.update(device_budget=args.device_budget, agree_ranks=False)
    problems = []
    try:
        ref = train(args, rank, world, device, None) if args.check else None
        off = tiermem.Offloader(policy=args.policy, **settings)
        try:
            losses, params, problems = train(args, rank, world, device, off)
        finally:
            off.close()
        if ref is not None:
            if losses != ref[0]:
                problems.append(f"losses {losses} differ from the run without tiermem {ref[0]}")
            if not all(torch.equal(a, b) for a, b in zip(params, ref[1])):
                problems.append("parameters differ from the run without tiermem")
        for problem in problems:
            sys.stdout.write(f"[rank {rank}/{world}] FAILED: {problem}\n")
        if not problems:
            what = "bit-identical to the run without tiermem" if args.check else "done"
            sys.stdout.write(f"[rank {rank}/{world}] OK: stage {rank} {what}\n")
        sys.stdout.flush()
        failed = torch.tensor([float(bool(problems))], device=device)
        dist.all_reduce(failed)   # every rank exits 1 when one failed
    finally:
        dist.destroy_process_group()
    if failed.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
