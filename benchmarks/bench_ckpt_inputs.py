"""What ``wrap_blocks(..., checkpoint="auto")`` reaches when the planner may
move a checkpointed block's inputs (rule 6 of NOTE [Blocks the planner may
checkpoint] in tiermem/planner/runtime.py), against the fixed recipes.

Configurations, one TinyGPT + AdamW each (same seed, same batches), run
round-robin (a slow period of a shared machine hits all alike):

- ``plain``: no tiermem, blocks unwrapped;
- ``ckpt+keep``: every block checkpointed, ``policy="keep"`` (checkpointing
  alone: the block inputs stay);
- ``ckpt+nvme``: every block checkpointed, ``policy="nvme"`` (the classic
  recipe: the inputs go to disk);
- ``auto``: ``checkpoint="auto"``, ``policy="auto"`` with ``--budget`` and
  ``--nvme-budget`` (the planner chooses checkpoints and tiers).

Per measured step: wall seconds (forward + backward + optimizer step), the
step's kept and nvme bytes and stall (tiermem configurations), and for
``auto`` the plan's figures (budget, predicted and measured kept bytes,
blocks checkpointed, inputs moved, notes, re-plans, profiles). Losses are
compared bit for bit with ``plain``'s.

Run: ``python benchmarks/bench_ckpt_inputs.py --nvme-dir DIR --budget 3%
--nvme-budget 4MiB [--label X] [--out x.json]``; with ``PYTHONPATH`` set to
another tree it measures that tree's tiermem. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiermem  # noqa: E402
import tiermem.testing  # noqa: E402
from common import emit, machine  # noqa: E402
from tiermem.models import Block, GPTConfig, TinyGPT  # noqa: E402


def _model(cfg: GPTConfig) -> TinyGPT:
    torch.manual_seed(0)
    m = TinyGPT(cfg)
    m.train()
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--budget", default="3%")
    ap.add_argument("--nvme-budget", default="4MiB")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    info = machine()   # the load average at the start; the end's is added below
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="tiermem-bench-")
    cfg = GPTConfig(vocab=256, seq_len=args.seq, width=args.width, heads=4,
                    layers=args.layers, dropout=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=g)
               for _ in range(args.warmup + args.steps)]

    configs = {}
    for name in ("plain", "ckpt+keep", "ckpt+nvme", "auto"):
        model = _model(cfg)
        off = None
        if name == "ckpt+keep":
            tiermem.wrap_blocks(model, Block, checkpoint=True)
            off = tiermem.Offloader(policy="keep")
        elif name == "ckpt+nvme":
            tiermem.wrap_blocks(model, Block, checkpoint=True)
            off = tiermem.Offloader(policy="nvme", nvme_dir=nvme_dir)
        elif name == "auto":
            tiermem.wrap_blocks(model, Block, checkpoint="auto")
            off = tiermem.Offloader(policy="auto", device_budget=args.budget,
                                    nvme_budget=args.nvme_budget, nvme_dir=nvme_dir)
        configs[name] = dict(model=model, off=off,
                             opt=torch.optim.AdamW(model.parameters(), lr=1e-3), rows=[])

    for i, idx in enumerate(batches):
        for name, c in configs.items():
            model, off = c["model"], c["off"]
            model.zero_grad(set_to_none=True)
            torch.manual_seed(100 + i)
            t0 = time.perf_counter()
            with (off if off is not None else contextlib.nullcontext()):
                loss = model(idx, idx)
            loss.backward()
            c["opt"].step()
            wall = time.perf_counter() - t0
            row = {"step": i, "wall_s": wall, "loss": loss.item()}
            if off is not None:
                s = off.stats
                row.update(kept_bytes=s.bytes_by_tier["keep"], nvme_bytes=s.bytes_by_tier["nvme"],
                           stall_s=s.stall_seconds)
            c["rows"].append(row)

    plain_losses = [r["loss"] for r in configs["plain"]["rows"]]
    out = {"bench": "ckpt_inputs", "label": args.label, "machine": info,
           "tiermem_file": tiermem.__file__,
           "model": dict(layers=cfg.layers, width=cfg.width, seq=cfg.seq_len, batch=args.batch,
                         dropout=cfg.dropout, dtype="float32"),
           "budget": args.budget, "nvme_budget": args.nvme_budget,
           "warmup": args.warmup, "steps": args.steps, "configs": {}}
    for name, c in configs.items():
        measured = c["rows"][args.warmup:]
        entry = {"rows": c["rows"],
                 "median_step_ms": statistics.median(r["wall_s"] for r in measured) * 1e3,
                 "losses_equal_plain": [r["loss"] for r in c["rows"]] == plain_losses}
        if c["off"] is not None:
            entry["median_kept_bytes"] = statistics.median(r["kept_bytes"] for r in measured)
            entry["max_kept_bytes"] = max(r["kept_bytes"] for r in measured)
        plan = c["off"].plan if c["off"] is not None else None
        if plan is not None:
            blocks = [b for b in plan.blocks if b.checkpoint]
            entry["plan"] = {
                "baseline_bytes": plan.baseline_bytes, "budget_bytes": plan.budget_bytes,
                "predicted_kept_bytes": plan.predicted_kept_bytes,
                "measured_kept_bytes": plan.measured_kept_bytes,
                "met": entry["max_kept_bytes"] <= plan.budget_bytes * 1.05,
                "blocks_checkpointed": len(blocks), "blocks": len(plan.blocks),
                "inputs_moved": sum(getattr(x, "tier", "keep") != "keep"
                                    for b in blocks for x in getattr(b, "inputs", ())),
                "bytes_by_tier": plan.bytes_by_tier(), "notes": plan.notes,
                "replans": plan.replans, "profiles": tiermem.testing.planner_of(c["off"]).profiles,
                "table": str(plan)}
        out["configs"][name] = entry
    out["machine"]["load_average_end"] = list(os.getloadavg())
    emit(out, args.out)


if __name__ == "__main__":
    main()
