"""A Lightning fit with ``TierMemCallback``, checked against the same fit without it.

The loop belongs to Lightning's ``Trainer``, so there is no ``with off:`` to
write: ``Trainer(callbacks=[TierMemCallback(policy=...)])`` puts each
``training_step`` under a tiermem Offloader for the fit and closes it at the
end. The model is a small transformer encoder block with dropout and a
regression head, trained on random data on the CPU (nothing downloaded), with
a validation batch before training and after every second step. Each policy's
fit must end with parameters bit-identical (``torch.equal``) to the plain
fit's, and its steps must have used the policy's tiers.

    python examples/lightning_callback.py                      # keep, cpu, nvme, recompute, auto
    python examples/lightning_callback.py --policy cpu --steps 10 --grad-accum 2
    python examples/lightning_callback.py --policy auto --device-budget 25%

Needs ``lightning`` (``pip install lightning``). Exit status 1 if anything differs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from typing import Dict, Optional, Tuple

import torch

__all__ = ["Block", "make_data", "fit"]

POLICIES = ("keep", "cpu", "nvme", "recompute", "auto")


def _pl():
    import lightning.pytorch as pl
    return pl


class Block(_pl().LightningModule):
    """A transformer encoder layer (dropout on) and a linear head, trained
    with AdamW on the mean squared error; ``manual=True``: the same step under
    manual optimization (``self.manual_backward``)."""

    def __init__(self, width: int = 64, heads: int = 2, manual: bool = False,
                 fail_at_step: Optional[int] = None) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=2 * width, dropout=0.1, batch_first=True)
        self.head = torch.nn.Linear(width, 1)
        self.automatic_optimization = not manual
        self.fail_at_step = fail_at_step   # a test's way to make a training step raise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x)).squeeze(-1)

    def training_step(self, batch, batch_idx):
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise RuntimeError("training_step failed on purpose")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_data(n: int, batch: int, seq: int, width: int, seed: int):
    """A DataLoader of ``n`` random (x, y) pairs in batches of ``batch``, in order."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, seq, width, generator=g)
    y = torch.randn(n, seq, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def fit(callback, *, steps: int = 3, grad_accum: int = 1, batch: int = 8, seq: int = 16,
        width: int = 64, seed: int = 0, manual: bool = False,
        fail_at_step: Optional[int] = None,
        validate: bool = True) -> Tuple[Dict[str, torch.Tensor], object, Block]:
    """One ``Trainer.fit`` of a :class:`Block` initialised from ``seed`` on
    the CPU, with ``callback`` (``None``: none). Returns the final parameters,
    the Trainer and the model."""
    pl = _pl()
    pl.seed_everything(seed, verbose=False)
    model = Block(width, manual=manual, fail_at_step=fail_at_step)
    data = make_data(steps * grad_accum * batch, batch, seq, width, seed + 1)
    val = make_data(batch, batch, seq, width, seed + 2) if validate else None
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True, accumulate_grad_batches=grad_accum,
        callbacks=[callback] if callback is not None else [],
        limit_val_batches=1, num_sanity_val_steps=1 if validate else 0,
        val_check_interval=2 * grad_accum if validate and steps * grad_accum > 2 * grad_accum
        else None)
    trainer.fit(model, data, val)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, trainer, model


def tiers_used(policy: str, stats) -> bool:
    """Whether the last step's ``stats`` show ``policy``'s tier at work (auto:
    anything moved or recomputed)."""
    if policy == "auto":
        return stats.offloaded_bytes > 0
    return stats.count_by_tier[policy] > 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", action="append", choices=POLICIES,
                   help="repeatable (default: all of them)")
    p.add_argument("--device-budget", default="50%", help="for --policy auto (default 50%%)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-offload-bytes", type=int, default=4096,
                   help="tiermem min_offload_bytes (small: this model's tensors are small)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)   # its start-up notes
    from tiermem.integrations.lightning import TierMemCallback

    kw = dict(steps=a.steps, grad_accum=a.grad_accum, batch=a.batch, seq=a.seq,
              width=a.width, seed=a.seed)
    ref, _, _ = fit(None, **kw)
    failed = False
    with tempfile.TemporaryDirectory(prefix="tiermem-lightning-") as tmp:
        for policy in a.policy or POLICIES:
            settings = {"min_offload_bytes": a.min_offload_bytes}
            if policy in ("nvme", "auto"):
                settings["nvme_dir"] = os.path.join(tmp, policy)
            if policy == "auto":
                settings["device_budget"] = a.device_budget
            cb = TierMemCallback(policy=policy, log_stats=True, **settings)
            params, trainer, _ = fit(cb, **kw)
            same = all(torch.equal(params[n], ref[n]) for n in ref)
            used = tiers_used(policy, cb.offloader.stats)
            failed |= not (same and used)
            logged = trainer.callback_metrics.get("tiermem/offloaded_bytes")
            print(f"policy {policy}: final parameters "
                  f"{'bit-identical' if same else 'DIFFERENT'}; tiers "
                  f"{'used' if used else 'NOT USED'}; logged tiermem/offloaded_bytes "
                  f"{int(logged) if logged is not None else 'missing'}")
            print(f"    last step: {cb.offloader.stats}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
