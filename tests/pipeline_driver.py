"""A pipeline schedule in one process: S stage modules, N micro-batches, the
forwards and backwards of each stage in the order that stage would run them
under GPipe or 1F1B, activations passed between stages as a real pipeline
passes them (``detach().requires_grad_()`` in, ``.backward(grad)`` out).

Each stage may run under its own context (an Offloader, one per stage, or
``torch.utils.checkpoint`` per block): the driver only decides the order.
Used by tests/test_pipeline_schedule.py and benchmarks/bench_pipeline.py.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tiermem.models import Block, GPTConfig

#: ``("F" | "B", micro-batch)``.
Op = Tuple[str, int]


def stage_ops(kind: str, stages: int, micro_batches: int) -> List[List[Op]]:
    """Per stage, its forwards and backwards in the order it runs them.
    ``gpipe``: every forward, then every backward (in micro-batch order);
    ``1f1b``: stage s runs ``stages - s - 1`` forwards ahead (warm-up), then
    one forward and one backward in turn, then the remaining backwards."""
    if kind not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule {kind!r}: expected 'gpipe' or '1f1b'")
    out = []
    for s in range(stages):
        fs = [("F", i) for i in range(micro_batches)]
        bs = [("B", i) for i in range(micro_batches)]
        if kind == "gpipe":
            out.append(fs + bs)
            continue
        warm = min(micro_batches, stages - s - 1)
        ops = fs[:warm]
        for i in range(micro_batches - warm):
            ops += [fs[warm + i], bs[i]]
        out.append(ops + bs[micro_batches - warm:])
    return out


class Stage(nn.Module):
    """``blocks`` transformer blocks (attention and residual dropout); the
    last stage also has the head whose output is the loss's input."""

    def __init__(self, cfg: GPTConfig, blocks: int, last: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(blocks))
        self.head = nn.Sequential(nn.LayerNorm(cfg.width), nn.Linear(cfg.width, cfg.width)) \
            if last else None
        #: Run each block under torch.utils.checkpoint (full checkpointing).
        self.checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)
        return x if self.head is None else self.head(x)


def make_stages(stages: int, cfg: GPTConfig, blocks_per_stage: int = 1,
                seed: int = 0) -> List[Stage]:
    """The stage modules, initialised from ``seed`` (same seed: same values)."""
    torch.manual_seed(seed)
    return [Stage(cfg, blocks_per_stage, s == stages - 1) for s in range(stages)]


def make_batches(micro_batches: int, batch: int, cfg: GPTConfig, seed: int = 1):
    """``(inputs, targets)`` per micro-batch, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, cfg.seq_len, cfg.width)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
            for _ in range(micro_batches)]


ContextFactory = Callable[[], contextlib.AbstractContextManager]


def run_schedule(stages: Sequence[Stage], batches, kind: str,
                 contexts: Optional[Sequence[ContextFactory]] = None, seed: int = 100,
                 on_op: Optional[Callable[[int, Op, object], None]] = None
                 ) -> Dict[int, torch.Tensor]:
    """One optimizer step's forwards and backwards of every micro-batch in
    ``kind`` order (:func:`stage_ops`); stage s's forwards run under
    ``contexts[s]()`` when given. Dropout of stage s on micro-batch i draws
    from ``torch.manual_seed(seed + 1000 * s + i)``. The stages' ops are
    interleaved as a pipeline would run them: each stage runs its next op as
    soon as its input (activation or gradient) has arrived. ``on_op(s, op,
    ctx)`` is called after each op (``ctx``: what the forward's context gave).
    Returns the loss of each micro-batch (detached); gradients accumulate."""
    n_stages, n = len(stages), len(batches)
    ops = stage_ops(kind, n_stages, n)
    nxt = [0] * n_stages
    acts: Dict[Tuple[int, int], torch.Tensor] = {}    # (stage, i) -> output sent on
    grads: Dict[Tuple[int, int], torch.Tensor] = {}   # (stage, i) -> grad of its input
    held: Dict[Tuple[int, int], tuple] = {}           # (stage, i) -> (input, output)
    losses: Dict[int, torch.Tensor] = {}
    while any(nxt[s] < len(ops[s]) for s in range(n_stages)):
        progressed = False
        for s in range(n_stages):
            if nxt[s] >= len(ops[s]):
                continue
            kind_op, i = ops[s][nxt[s]]
            if kind_op == "F":
                if s > 0 and (s - 1, i) not in acts:
                    continue
                x = batches[i][0] if s == 0 else acts.pop((s - 1, i)).detach().requires_grad_()
                torch.manual_seed(seed + 1000 * s + i)
                ctx = contexts[s]() if contexts is not None else contextlib.nullcontext()
                with ctx as entered:
                    out = stages[s](x)
                    if s == n_stages - 1:
                        out = F.mse_loss(out, batches[i][1])
                        losses[i] = out.detach()
                held[(s, i)] = (x, out)
                if s < n_stages - 1:
                    acts[(s, i)] = out
            else:
                if s < n_stages - 1 and (s + 1, i) not in grads:
                    continue
                x, out = held.pop((s, i))
                if s == n_stages - 1:
                    out.backward()
                else:
                    out.backward(grads.pop((s + 1, i)))
                if s > 0:
                    grads[(s, i)] = x.grad
                entered = None
                del x, out
            nxt[s] += 1
            progressed = True
            if on_op is not None:
                on_op(s, (kind_op, i), entered)
        if not progressed:
            raise RuntimeError("pipeline_driver: the schedule deadlocked (this is a bug)")
    return losses


def train(stages: Sequence[Stage], batches, kind: str, steps: int = 2, lr: float = 0.1,
          contexts=None, on_op=None) -> List[dict]:
    """``steps`` optimizer steps (SGD) of :func:`run_schedule`. Returns, per
    step, its losses, the gradients before the update and the parameters after."""
    params = [p for st in stages for p in st.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    record = []
    for k in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = run_schedule(stages, batches, kind, contexts, seed=100 + 7919 * k,
                              on_op=on_op)
        grads = [p.grad.clone() for p in params]
        opt.step()
        record.append({"losses": losses, "grads": grads,
                       "params": [p.detach().clone() for p in params]})
    return record
