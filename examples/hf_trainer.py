"""A Hugging Face ``Trainer`` run with tiermem attached, checked against the same run without it.

The loop belongs to ``Trainer``, so there is no ``with off:`` to write:
``off.attach(trainer.model)`` puts each forward of the model under the
Offloader (NOTE [Attaching] in tiermem/attach.py), and ``detach()`` undoes it.
The model is a small random-init GPT-2 (``hf_gpt2.tiny_config``, dropout on,
nothing downloaded), trained on random tokens on the CPU. Each policy's run
must give the same logged losses (exact float equality) and bit-identical
final parameters as the plain run.

    python examples/hf_trainer.py                         # policies keep, cpu, nvme, recompute
    python examples/hf_trainer.py --policy cpu --steps 20 --grad-accum 2
    python examples/hf_trainer.py --policy auto --device-budget 25%

Needs ``transformers`` and ``accelerate``. Exit status 1 if anything differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Dict, List, Optional

import torch

import tiermem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_gpt2  # noqa: E402  (examples/hf_gpt2.py: the model)

__all__ = ["make_dataset", "make_model", "train", "StatsCallback"]


def make_dataset(vocab: int, n: int, seq: int, seed: int) -> List[Dict[str, torch.Tensor]]:
    """``n`` random sequences for causal LM training (labels = inputs)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, vocab, (n, seq), generator=g)]


def _callback_base():
    from transformers import TrainerCallback
    return TrainerCallback


class StatsCallback(_callback_base()):
    """Records ``str(off.stats)`` at the end of each optimizer step (the last
    micro-batch's step: its backward has run, so its stats are complete)."""

    def __init__(self, off: tiermem.Offloader) -> None:
        self.off = off
        self.lines: List[str] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.lines.append(f"step {state.global_step}: {self.off.stats}")


def make_model(cfg, seed: int):
    """A causal LM of ``cfg`` (GPT-2 as ``hf_gpt2`` builds it, or any other
    ``transformers`` config) initialised from ``seed``, in training mode."""
    if cfg.model_type == "gpt2":
        return hf_gpt2.make_model(cfg, seed=seed, device=torch.device("cpu"))
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).train()


def train(policy: Optional[str], cfg, data, out_dir: str, *, steps: int, batch: int,
          grad_accum: int = 1, seed: int = 0, nvme_dir: Optional[str] = None,
          min_offload_bytes: Optional[int] = None, device_budget: Optional[str] = None):
    """One ``Trainer.train()`` of a fresh model (:func:`make_model` of ``cfg``,
    initialised from ``seed``), with an Offloader of ``policy`` attached
    (``None``: plain; ``device_budget`` for ``"auto"``, which also gets the
    NVMe directory). Returns the logged losses, the final parameters and the
    per-step stats lines."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    model = make_model(cfg, seed)
    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, report_to=[], save_strategy="no",
        dataloader_num_workers=0, seed=seed, max_steps=steps,
        per_device_train_batch_size=batch, gradient_accumulation_steps=grad_accum,
        logging_steps=1, disable_tqdm=True, learning_rate=1e-3)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    stats = []
    if policy is not None:
        kw = {}
        if min_offload_bytes is not None:
            kw["min_offload_bytes"] = min_offload_bytes
        if device_budget is not None:
            kw["device_budget"] = device_budget
        if "nvme" in policy or policy == "auto":
            kw["nvme_dir"] = nvme_dir or os.path.join(out_dir, "nvme")
        off = tiermem.Offloader(policy=policy, **kw)
        callback = StatsCallback(off)
        trainer.add_callback(callback)
        stats = callback.lines
        off.attach(trainer.model)          # the whole integration
        try:
            trainer.train()
        finally:
            off.detach()
            off.close()
    else:
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", action="append",
                   choices=("keep", "cpu", "nvme", "recompute", "recompute,cpu", "recompute,nvme",
                            "auto"),
                   help="repeatable (default: keep, cpu, nvme, recompute)")
    p.add_argument("--device-budget", default="50%", help="for --policy auto (default 50%%)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--min-offload-bytes", type=int, default=4096,
                   help="tiermem min_offload_bytes (small: this model's tensors are small)")
    p.add_argument("--nvme-dir", default=None, help="for nvme policies (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = hf_gpt2.tiny_config(a.layers, a.width, a.heads, a.seq, a.vocab, dropout=0.1)
    data = make_dataset(a.vocab, a.steps * a.batch * a.grad_accum, a.seq, a.seed + 1)
    failed = False
    with tempfile.TemporaryDirectory(prefix="tiermem-trainer-") as tmp:
        ref_losses, ref_params, _ = train(None, cfg, data, tmp, steps=a.steps, batch=a.batch,
                                          grad_accum=a.grad_accum, seed=a.seed)
        print("plain Trainer: losses " + ", ".join(f"{x:.6f}" for x in ref_losses))
        for policy in a.policy or ["keep", "cpu", "nvme", "recompute"]:
            losses, params, stats = train(
                policy, cfg, data, tmp, steps=a.steps, batch=a.batch, grad_accum=a.grad_accum,
                seed=a.seed, nvme_dir=a.nvme_dir, min_offload_bytes=a.min_offload_bytes,
                device_budget=a.device_budget if policy == "auto" else None)
            same_params = all(torch.equal(params[n], ref_params[n]) for n in ref_params)
            ok = losses == ref_losses and same_params
            failed |= not ok
            print(f"policy {policy}: {'bit-identical' if ok else 'DIFFERENT'} "
                  f"(losses {'equal' if losses == ref_losses else 'differ'}, final parameters "
                  f"{'equal' if same_params else 'differ'}); losses "
                  + ", ".join(f"{x:.6f}" for x in losses))
            print("    " + (stats[-1] if stats else "no step"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
