"""``python -m tiermem demo``: train a small GPT a few steps with tiermem and
check, every step, that the gradients are bit-identical to plain autograd.

Each step runs twice from identical state: first a *reference* copy of the
model without tiermem, then the model under an :class:`~tiermem.Offloader`.
Both runs reseed the global RNG with the same per-step seed right before their
forward pass, so dropout draws the same masks. The gradients of every
parameter are compared with ``torch.equal``; then both models take an AdamW
step and their parameters are compared too, so the next step starts from
identical state again. What is compared is printed (:data:`COMPARED`).

# NOTE [What the demo compares]
# The comparison must fail only when tiermem changed a result, so both runs
# must be deterministic functions of their inputs. On the CPU, torch's kernels
# are not: reductions (layer norm's and the embedding's weight gradients)
# split their work among the threads that take part, and a different split
# sums in a different order, so the last bits depend on how many threads ran
# (and the gradients then differ between a run on 1 and one on 2 threads).
# That number is not fixed on a busy machine. So the demo runs both models on
# one intra-op thread and with ``torch.use_deterministic_algorithms`` (on CUDA
# also ``CUBLAS_WORKSPACE_CONFIG``, set if unset), restoring both afterwards.

Importing this module does not initialise CUDA.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import psutil
import torch

from .blocks import wrap_blocks
from .config import Config, parse_size
from .errors import ConfigError
from .models import Block, GPTConfig, TinyGPT
from .offloader import Offloader
from .telemetry import format_bytes

__all__ = ["add_arguments", "run", "DemoResult", "run_demo", "pick_device"]

#: The model the demo trains: ~0.9 M parameters; at batch 8 almost every saved
#: activation is 128 KiB .. 2 MiB, above the default min_offload_bytes (64 KiB).
DEMO_MODEL = GPTConfig(vocab=512, layers=4, width=128, heads=4, seq_len=128, dropout=0.1)
DEMO_BATCH = 8
#: What every step compares, and how the demo makes that comparison exact.
COMPARED = ("each step compares every parameter's gradient, then every parameter after AdamW, "
            "bit for bit (torch.equal) with plain autograd run from the same state and seed; "
            "both runs use one intra-op thread and deterministic algorithms, so only tiermem "
            "can make them differ")
#: The policies ``--policy`` takes (a preference list such as ``recompute,cpu`` is one).
DEMO_POLICIES = ("keep", "cpu", "nvme", "recompute", "recompute,cpu", "recompute,nvme", "auto")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's command-line options (used by ``python -m tiermem demo``)."""
    p.add_argument("--steps", type=int, default=5, help="training steps (default: 5)")
    p.add_argument("--policy", choices=DEMO_POLICIES, metavar="POLICY", default=None,
                   help="tiermem policy of the offloaded run: one of "
                   + ", ".join(DEMO_POLICIES) + " (default: TIERMEM_POLICY if set, else cpu; "
                   "the nvme ones need --nvme-dir or TIERMEM_NVME_DIR)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if torch.cuda.is_available(), else cpu (default: auto)")
    p.add_argument("--device-budget", default=None, metavar="BUDGET",
                   help="policy auto: device_budget, e.g. 50%% or 12GiB (default: "
                   "TIERMEM_DEVICE_BUDGET, else the device's free memory); the plan is "
                   "printed at the end")
    p.add_argument("--nvme-dir", default=None, metavar="DIR",
                   help="the nvme tier's directory, e.g. a path on an NVMe drive "
                   "(default: TIERMEM_NVME_DIR, else no nvme tier)")
    p.add_argument("--checkpoint-blocks", choices=("auto", "off"), default="auto",
                   help="auto: the model's blocks are wrapped with wrap_blocks(..., "
                   "checkpoint='auto'), so policy auto may checkpoint a whole block; other "
                   "policies run them plainly (default: auto)")
    p.add_argument("--seed", type=int, default=0, help="base random seed (default: 0)")
    p.add_argument("--batch", type=int, default=DEMO_BATCH,
                   help=f"sequences per batch (default: {DEMO_BATCH})")
    p.add_argument("--min-offload-bytes", default=None, metavar="SIZE",
                   help="tiermem min_offload_bytes, e.g. 0, 4096, 64KiB "
                        "(default: TIERMEM_MIN_OFFLOAD_BYTES, else 64KiB)")
    p.add_argument("--no-progress", action="store_true",
                   help="plain lines instead of a tqdm progress bar")


def pick_device(choice: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu. Raises ConfigError for
    ``cuda`` on a machine without one."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "tiermem: --device cuda, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); use --device cpu")
    return torch.device(choice)


@dataclass
class StepReport:
    """What one demo step measured."""

    step: int
    loss_ref: float
    loss: float
    grads_equal: bool
    params_equal: bool
    mismatched: list
    bytes_by_tier: dict
    count_by_tier: dict
    peak_host_bytes: int
    peak_device_bytes_ref: Optional[int]
    peak_device_bytes: Optional[int]
    rss_bytes: int
    max_rss_bytes: int
    seconds_ref: float
    seconds: float


@dataclass
class DemoResult:
    steps: list

    @property
    def ok(self) -> bool:
        return all(r.grads_equal and r.params_equal for r in self.steps)


def _max_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _enable_determinism(device: torch.device) -> Callable[[], None]:
    """One intra-op thread and deterministic algorithms (NOTE [What the demo
    compares]); returns a function restoring the previous settings."""
    threads = torch.get_num_threads()
    prev = (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())
    if device.type == "cuda":
        # Must be set before cuBLAS creates its first handle, i.e. before any matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Strict: flash / memory-efficient attention use their deterministic
    # backward only then (warn_only keeps the atomics).
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    def restore() -> None:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
    return restore


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(model: TinyGPT, x: torch.Tensor, y: torch.Tensor, seed: int,
             device: torch.device, offloader: Optional[Offloader]):
    """One forward + backward; returns (loss, seconds, peak device bytes or None)."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    if offloader is None:
        loss = model(x, y)
    else:
        with offloader:
            loss = model(x, y)
    loss.backward()
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return loss.detach().item(), seconds, peak


def _mismatches(ref: TinyGPT, model: TinyGPT, what: Callable) -> list:
    bad = []
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        a, b = what(p_ref), what(p)
        if a is None or b is None:
            if a is not b:
                bad.append(name)
        elif not torch.equal(a, b):
            bad.append(name)
    return bad


def run_demo(steps: int = 5, policy: str = "cpu", device: str = "auto", seed: int = 0,
             batch: int = DEMO_BATCH, min_offload_bytes: Optional[int] = None,
             model_cfg: GPTConfig = DEMO_MODEL,
             on_start: Optional[Callable[[TinyGPT, torch.device, Offloader], None]] = None,
             on_step: Optional[Callable[[StepReport], None]] = None,
             progress: bool = True, device_budget=None, nvme_dir: Optional[str] = None,
             checkpoint_blocks: bool = False) -> DemoResult:
    """Train ``steps`` steps; see the module docstring. ``on_start`` is called
    with the model, device and Offloader once they exist, ``on_step`` with each
    :class:`StepReport` as it is measured. ``device_budget``: the Offloader's
    (policy auto), ``None`` for the environment's; ``nvme_dir`` likewise.
    ``checkpoint_blocks``: wrap the tiermem model's blocks with
    ``wrap_blocks(model, Block, checkpoint="auto")`` (the planner may then
    checkpoint whole blocks; any other policy runs them plainly). The
    reference model is never wrapped."""
    dev = pick_device(device)
    restore_determinism = _enable_determinism(dev)
    try:
        return _train(steps, policy, dev, seed, batch, min_offload_bytes, model_cfg,
                      on_start, on_step, progress, device_budget, nvme_dir, checkpoint_blocks)
    finally:
        restore_determinism()


def _train(steps, policy, dev, seed, batch, min_offload_bytes, model_cfg, on_start, on_step,
           progress, device_budget=None, nvme_dir=None, checkpoint_blocks=False) -> DemoResult:
    torch.manual_seed(seed)
    model = TinyGPT(model_cfg).to(dev)
    ref = copy.deepcopy(model)
    if checkpoint_blocks:
        wrap_blocks(model, Block, checkpoint="auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    off = Offloader(policy=policy, min_offload_bytes=min_offload_bytes,
                    device_budget=device_budget, nvme_dir=nvme_dir)
    data_gen = torch.Generator().manual_seed(seed + 1)
    if on_start is not None:
        on_start(model, dev, off)

    bar = _progress(steps) if progress else None
    results = []
    try:
        for step in range(steps):
            # Inputs come from their own generator (on the host), so the global
            # RNG state seen by dropout depends only on the per-step seed.
            x = torch.randint(0, model_cfg.vocab, (batch, model_cfg.seq_len), generator=data_gen)
            y = torch.roll(x, -1, dims=1)
            x, y = x.to(dev), y.to(dev)
            step_seed = seed * 1_000_003 + step
            loss_ref, sec_ref, peak_ref = _fwd_bwd(ref, x, y, step_seed, dev, None)
            loss, sec, peak = _fwd_bwd(model, x, y, step_seed, dev, off)
            bad_grads = _mismatches(ref, model, lambda p: p.grad)
            opt_ref.step()
            opt.step()
            bad_params = _mismatches(ref, model, lambda p: p.detach())
            stats = off.stats
            report = StepReport(
                step=step, loss_ref=loss_ref, loss=loss,
                grads_equal=not bad_grads, params_equal=not bad_params,
                mismatched=bad_grads + [f"{n} (param)" for n in bad_params],
                bytes_by_tier=dict(stats.bytes_by_tier), count_by_tier=dict(stats.count_by_tier),
                peak_host_bytes=stats.peak_host_bytes,
                peak_device_bytes_ref=peak_ref, peak_device_bytes=peak,
                rss_bytes=psutil.Process().memory_info().rss, max_rss_bytes=_max_rss_bytes(),
                seconds_ref=sec_ref, seconds=sec)
            results.append(report)
            if on_step is not None:
                on_step(report)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", grads="equal" if report.grads_equal else "DIFF")
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        off.close()
    return DemoResult(results)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="tiermem demo", unit="step", file=sys.stderr,
                dynamic_ncols=True, leave=False, disable=None)  # None: off unless a tty


def _tiers_text(r: StepReport) -> str:
    parts = [f"{t} {r.count_by_tier[t]} ({format_bytes(r.bytes_by_tier[t])})"
             for t in r.bytes_by_tier if r.count_by_tier[t]]
    return ", ".join(parts) or "nothing saved"


def format_step(r: StepReport) -> str:
    """One line per step: loss, bytes per tier, peak memory, gradient check."""
    if r.peak_device_bytes is not None:
        mem = (f"peak cuda {format_bytes(r.peak_device_bytes)} "
               f"(plain autograd {format_bytes(r.peak_device_bytes_ref)})")
    else:
        mem = (f"cpu-tier host peak {format_bytes(r.peak_host_bytes)}, "
               f"rss {format_bytes(r.rss_bytes)} (process peak {format_bytes(r.max_rss_bytes)})")
    check = ("grads match bit-for-bit" if r.grads_equal
             else "GRADS DIFFER: " + ", ".join(r.mismatched))
    if r.grads_equal and not r.params_equal:
        check += "; PARAMS DIFFER after AdamW: " + ", ".join(r.mismatched)
    return (f"step {r.step}: loss {r.loss:.4f} (plain {r.loss_ref:.4f}) | {_tiers_text(r)} | "
            f"{mem} | {r.seconds * 1e3:.0f} ms (plain {r.seconds_ref * 1e3:.0f} ms) | {check}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m tiermem demo``; returns the exit status
    (0: gradients matched every step, 1: a mismatch, 2: bad arguments)."""
    if args.steps < 1 or args.batch < 1:
        print("tiermem demo: --steps and --batch must be at least 1", file=sys.stderr)
        return 2
    try:
        min_bytes = (None if args.min_offload_bytes is None
                     else parse_size(args.min_offload_bytes, name="--min-offload-bytes"))
        dev = pick_device(args.device)
        if args.device_budget is not None:   # checked now, named as the option
            from .config import parse_device_budget
            parse_device_budget(args.device_budget, name="--device-budget")
        if args.policy is None:   # the environment's, as every Offloader would take it
            args.policy = Config.from_env().policy or "cpu"
        if "nvme" in args.policy and not (args.nvme_dir or Config.from_env().nvme_dir):
            raise ConfigError(f"tiermem demo: --policy {args.policy} needs an NVMe directory: "
                              "pass --nvme-dir DIR or set TIERMEM_NVME_DIR")
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    progress = not args.no_progress
    bar_holder: dict = {}

    def emit(line: str) -> None:
        writer = bar_holder.get("write")
        (writer or print)(line)

    if progress:
        try:
            from tqdm import tqdm
            bar_holder["write"] = lambda s: tqdm.write(s, file=sys.stdout)
        except ImportError:
            progress = False

    def header(model: TinyGPT, device: torch.device, off: Offloader) -> None:
        c = model.cfg
        emit(f"tiermem demo: TinyGPT {c.layers} layers, width {c.width}, {c.heads} heads, "
             f"seq {c.seq_len}, vocab {c.vocab}, dropout {c.dropout}, "
             f"{model.num_parameters() / 1e6:.2f} M params | batch {args.batch} | "
             f"device {device} | policy {args.policy} | steps {args.steps} | seed {args.seed}")
        emit(f"tiermem demo: {COMPARED}")
        if off.config.disable:
            emit("tiermem demo: WARNING: TIERMEM_DISABLE is set, so the Offloader does nothing "
                 "and the comparison below is trivially equal; unset it to test tiermem")

    offs: list = []

    def start(model: TinyGPT, device: torch.device, off: Offloader) -> None:
        offs.append(off)
        header(model, device, off)

    result = run_demo(steps=args.steps, policy=args.policy, device=dev.type, seed=args.seed,
                      batch=args.batch, min_offload_bytes=min_bytes, on_start=start,
                      on_step=lambda r: emit(format_step(r)), progress=progress,
                      device_budget=args.device_budget, nvme_dir=args.nvme_dir,
                      checkpoint_blocks=args.checkpoint_blocks == "auto")
    plan = offs[0].plan if offs else None
    if plan is not None:
        emit(str(plan))
    bad = [r.step for r in result.steps if not (r.grads_equal and r.params_equal)]
    if bad:
        emit(f"tiermem demo: FAILED: gradients or parameters differ from plain autograd "
             f"at step(s) {bad}")
        return 1
    n = len(result.steps)
    emit(f"tiermem demo: OK: gradients match plain autograd bit-for-bit in "
         f"{'the one step' if n == 1 else f'all {n} steps'} (and parameters after AdamW)")
    return 0
