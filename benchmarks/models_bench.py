"""The configurations the side-by-side suite compares, and how one training step runs.

A *configuration* is a way to hold (or not hold) the activations of a
:class:`tiermem.models.TinyGPT` training step: plain autograd, activation
checkpointing (full or selective), ``torch.autograd.graph.save_on_cpu``, the
peers (torchtune, DeepSpeed) when importable, and tiermem with each policy it
provides. Every configuration trains the same model (same seed, same batches,
same dropout seeds), so losses must be bit-identical to the baseline.

This module is imported by the suite (``benchmarks/suite/``, as
``benchmarks.models_bench``); it does not initialise CUDA on import.

Semantics of the non-tiermem rows (so that the table compares like with like):

- ``checkpoint``: ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``
  around every transformer block (the embeddings, final LayerNorm and head are
  not checkpointed, as in most training code).
- ``sac``: selective activation checkpointing around every block
  (``create_selective_checkpoint_contexts``): outputs of ``aten.mm``,
  ``aten.addmm``, ``aten.bmm`` and the fused SDPA ops are saved, everything else
  (LayerNorm, GELU, dropout, views, adds) is recomputed in backward.
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (on a
  CPU-only machine ``pin_memory=False``: pinning needs CUDA) around the forward.
- ``torchtune``: ``torchtune.training.OffloadActivations()`` with its defaults
  (pinned memory, a side stream) around the forward.
- ``deepspeed``: DeepSpeed's asynchronous activation-offload engine as its
  ``CheckpointHiddenStatesOffload`` context drives it: non-reentrant
  checkpointing per block, each block's input marked for offload (what its
  Hugging Face integration marks), the context around forward *and* backward
  (it clears its tracker on exit).
- ``ckpt_tiermem_cpu``: the ``checkpoint`` row with tiermem's ``cpu`` policy
  around the forward: tiermem then moves the block inputs (the like-for-like
  comparison with the ``deepspeed`` row).
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch
from torch import nn

import tiermem
import tiermem.testing
from tiermem.models import GPTConfig, TinyGPT

from .common import rss_bytes

__all__ = ["ModelSpec", "ConfigSpec", "CONFIGS", "build_model", "Runner", "make_runner",
           "probe_config", "peer_versions", "state_fingerprint", "tensor_state_bytes",
           "BigToCpu", "DTYPES"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the benchmark model and batch."""

    layers: int = 4
    width: int = 256
    heads: int = 4
    seq_len: int = 256
    batch: int = 4
    vocab: int = 2048
    dtype: str = "float32"
    dropout: float = 0.1

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(vocab=self.vocab, layers=self.layers, width=self.width,
                         heads=self.heads, seq_len=self.seq_len, dropout=self.dropout)

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPES)}") from None

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    def as_dict(self) -> dict:
        return asdict(self)


def build_model(spec: ModelSpec, device: torch.device, seed: int) -> TinyGPT:
    """The benchmark model, initialised from ``seed`` directly on ``device``
    (fast for large models on a GPU; the same values in every process), then
    cast to ``spec.dtype`` (pure low-precision training: parameters, gradients
    and AdamW states all in that dtype)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = TinyGPT(spec.gpt_config())
    return model.to(dtype=spec.torch_dtype)


def tensor_state_bytes(model: nn.Module, opt: Optional[torch.optim.Optimizer]) -> dict:
    """Bytes of parameters, gradients and optimizer states now alive."""
    params = {id(p): p for p in model.parameters()}
    pb = sum(p.numel() * p.element_size() for p in params.values())
    gb = sum(p.grad.numel() * p.grad.element_size() for p in params.values()
             if p.grad is not None)
    ob = 0
    if opt is not None:
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    ob += v.numel() * v.element_size()
    return {"parameter_bytes": pb, "gradient_bytes": gb, "optimizer_state_bytes": ob}


def state_fingerprint(model: nn.Module, opt: Optional[torch.optim.Optimizer]) -> str:
    """A bitwise fingerprint of the parameters and optimizer states.

    Each tensor's bytes, read as int32 words (or bytes), are summed with
    position weights in int64 on the tensor's device (wrapping is fine: the
    same bits give the same sum), then the per-tensor sums are hashed. Two runs
    with bit-identical gradients at every step give the same fingerprint; any
    changed bit almost surely changes it.
    """
    import hashlib

    sums = []
    params = [p for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0])]
    tensors = list(params)
    if opt is not None:
        for p in params:
            st = opt.state.get(p, {})
            tensors += [v for k, v in sorted(st.items()) if torch.is_tensor(v)]
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().contiguous().view(-1)
            nbytes = flat.numel() * flat.element_size()
            if nbytes == 0:
                sums.append(0)
                continue
            raw = flat.view(torch.uint8)
            aligned = nbytes % 4 == 0 and raw.storage_offset() % 4 == 0
            words = raw.view(torch.int32) if aligned else raw
            w = words.to(torch.int64)
            pos = torch.arange(w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
            sums.append(int((w * pos).sum().item()))
    return hashlib.sha256(",".join(map(str, sums)).encode()).hexdigest()[:16]


class BigToCpu:
    """Mixed tiermem policy: tensors of ``min_bytes`` or more go to the cpu
    tier, the rest stay on the device (``keep``)."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = int(min_bytes)

    def __call__(self, info) -> str:
        return "cpu" if info.nbytes >= self.min_bytes else "keep"

    def __repr__(self) -> str:
        return f"BigToCpu(min_bytes={self.min_bytes})"


# ---------------------------------------------------------------------------
# Checkpointing wrappers
# ---------------------------------------------------------------------------

def _sac_save_ops() -> set:
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable"]
    ops = set()
    for n in names:
        packet = getattr(aten, n, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _sac_context_fn():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _sac_save_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class CheckpointedBlock(nn.Module):
    """Runs ``block`` under non-reentrant checkpointing (full or selective).

    ``marker``: a DeepSpeed ``CheckpointHiddenStatesOffload`` whose ``mark`` is
    called on the block input first (the input is then packed by its hook when
    checkpointing saves it)."""

    def __init__(self, block: nn.Module, selective: bool = False, marker=None) -> None:
        super().__init__()
        self.block = block
        self.selective = selective
        self.marker = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        kwargs = {"use_reentrant": False}
        if self.selective:
            kwargs["context_fn"] = _sac_context_fn
        marker = self.marker
        if marker is not None and torch.is_grad_enabled():
            marker.mark(x)
            try:
                return checkpoint(self.block, x, **kwargs)
            finally:
                # DeepSpeed's own HF wrapper drops a mark its hook did not consume.
                marker._consume_mark(x)
        return checkpoint(self.block, x, **kwargs)


def _wrap_blocks(model: TinyGPT, selective: bool = False, marker=None) -> None:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = CheckpointedBlock(block, selective=selective, marker=marker)


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ConfigSpec:
    name: str
    description: str
    family: str              # "reference" | "recompute" | "peer" | "tiermem"
    tiermem_policy: Optional[str] = None
    wrap: Optional[str] = None   # None | "checkpoint" | "sac"
    #: tiermem ``device_budget`` (policy auto): bytes or a share of a plain step's saved bytes.
    device_budget: Optional[str] = None


CONFIGS: Dict[str, ConfigSpec] = {c.name: c for c in [
    ConfigSpec("baseline", "plain autograd: every saved activation stays on the device",
               "reference"),
    ConfigSpec("checkpoint", "torch.utils.checkpoint (non-reentrant) around every block",
               "recompute", wrap="checkpoint"),
    ConfigSpec("sac", "selective activation checkpointing per block: matmul and SDPA "
               "outputs saved, the rest recomputed", "recompute", wrap="sac"),
    ConfigSpec("save_on_cpu", "torch.autograd.graph.save_on_cpu(pin_memory=True on CUDA)",
               "peer"),
    ConfigSpec("torchtune", "torchtune.training.OffloadActivations() (defaults: pinned, "
               "side stream)", "peer"),
    ConfigSpec("deepspeed", "DeepSpeed async activation offload (CheckpointHiddenStatesOffload: "
               "checkpoint per block, block inputs offloaded)", "peer", wrap="checkpoint"),
    ConfigSpec("tiermem_keep", "tiermem policy=keep (hooks only, nothing moved)", "tiermem",
               tiermem_policy="keep"),
    ConfigSpec("tiermem_cpu", "tiermem policy=cpu", "tiermem", tiermem_policy="cpu"),
    ConfigSpec("tiermem_nvme", "tiermem policy=nvme", "tiermem", tiermem_policy="nvme"),
    ConfigSpec("tiermem_mixed", "tiermem callable policy: tensors >= the MLP hidden activation "
               "to cpu, the rest keep", "tiermem", tiermem_policy="mixed"),
    ConfigSpec("ckpt_tiermem_cpu", "checkpoint per block + tiermem policy=cpu (moves the block "
               "inputs)", "tiermem", tiermem_policy="cpu", wrap="checkpoint"),
    ConfigSpec("tiermem_recompute", "tiermem policy=recompute: cheap ops' outputs dropped "
               "and recomputed, the rest kept", "tiermem", tiermem_policy="recompute"),
    ConfigSpec("tiermem_recompute_cpu", "tiermem policy=recompute,cpu: recompute what is "
               "eligible, the rest to cpu", "tiermem", tiermem_policy="recompute,cpu"),
    ConfigSpec("tiermem_recompute_nvme", "tiermem policy=recompute,nvme: recompute what is "
               "eligible, the rest to nvme", "tiermem", tiermem_policy="recompute,nvme"),
    ConfigSpec("tiermem_auto", "tiermem policy=auto (planner), default device budget "
               "(on the CPU: free RAM less headroom)", "tiermem", tiermem_policy="auto"),
    ConfigSpec("tiermem_auto_50", "tiermem policy=auto, device_budget=50% (of a plain "
               "step's saved bytes)", "tiermem", tiermem_policy="auto", device_budget="50%"),
    ConfigSpec("tiermem_auto_25", "tiermem policy=auto, device_budget=25%", "tiermem",
               tiermem_policy="auto", device_budget="25%"),
]}


def peer_versions() -> dict:
    """Installed versions of the peers (without importing them)."""
    from importlib import metadata

    out = {}
    for name in ("torchtune", "torchao", "deepspeed", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _tiermem_settings(opts: dict, spec: ModelSpec, cs: ConfigSpec) -> dict:
    kw = {}
    policy = cs.tiermem_policy
    if opts.get("min_offload_bytes") is not None:
        kw["min_offload_bytes"] = int(opts["min_offload_bytes"])
    if opts.get("tiermem_cpu_budget"):
        kw["cpu_budget"] = opts["tiermem_cpu_budget"]
    # auto gets the nvme tier where the run has a directory: on the CPU only
    # recompute and nvme free RAM.
    if "nvme" in policy or (policy == "auto" and opts.get("nvme_dir")):
        kw["nvme_dir"] = opts["nvme_dir"]
    if cs.device_budget is not None:
        kw["device_budget"] = cs.device_budget
    return kw


def mixed_threshold(spec: ModelSpec, opts: dict) -> int:
    """Bytes of one MLP hidden activation (batch x seq x 4 width), unless set."""
    if opts.get("mixed_min_bytes"):
        return int(opts["mixed_min_bytes"])
    elt = torch.empty((), dtype=spec.torch_dtype).element_size()
    return spec.batch * spec.seq_len * spec.gpt_config().mlp_ratio * spec.width * elt


def probe_config(name: str, device: torch.device, opts: dict) -> Optional[str]:
    """``None`` if ``name`` can run here, else the reason it cannot (measured by
    trying: importing the peer, constructing the context or Offloader)."""
    cs = CONFIGS[name]
    try:
        if name == "torchtune":
            from torchtune.training import OffloadActivations  # noqa: F401
            if device.type != "cuda":
                try:
                    OffloadActivations(use_pin_memory=False, use_streams=False)
                except Exception as e:  # what it says on a CPU machine
                    return (f"needs CUDA: OffloadActivations() raised {type(e).__name__}: {e} "
                            f"(it calls torch.cuda.default_stream() in __init__)")
            return None
        if name == "deepspeed":
            from deepspeed.runtime.activation_checkpointing.offload_activations import (  # noqa: F401
                CheckpointHiddenStatesOffload)
            return None
        if cs.family == "tiermem":
            pol = cs.tiermem_policy
            if pol in ("recompute", "auto"):
                off = tiermem.Offloader(policy=pol)
                off.close()
            if "nvme" in pol and not opts.get("nvme_dir"):
                return "no --nvme-dir"
        return None
    except ImportError as e:
        return f"not importable: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


class _Phases:
    """Phase boundaries of one step: CUDA events on the compute stream (no host
    sync inside the step), or host clocks on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.n = 4
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(self.n)]
        self.times = [0.0] * self.n

    def mark(self, i: int) -> None:
        if self.cuda:
            self.events[i].record()
        else:
            self.times[i] = time.perf_counter()

    def seconds(self) -> dict:
        """forward/backward/optimizer seconds; call after the step synchronized."""
        if self.cuda:
            ms = [self.events[0].elapsed_time(self.events[i]) for i in range(self.n)]
            t = [m / 1e3 for m in ms]
        else:
            t = [x - self.times[0] for x in self.times]
        return {"forward": t[1] - t[0], "backward": t[2] - t[1], "optimizer": t[3] - t[2]}


class Runner:
    """One configuration: model, AdamW and the context around the step.

    ``step(x, y, seed)`` runs zero_grad, forward, backward and AdamW's step and
    returns ``(loss, wall_seconds, phase_seconds)``; ``wall_seconds`` is host time
    between two device synchronizations.
    """

    def __init__(self, name: str, model: TinyGPT, spec: ModelSpec, device: torch.device,
                 opts: dict) -> None:
        self.name = name
        self.cs = CONFIGS[name]
        self.spec = spec
        self.device = device
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.off: Optional[tiermem.Offloader] = None
        self.peer_ctx = None
        self.step_scope = "forward"          # or "step": the context also wraps backward
        self.extra: dict = {}
        cs = self.cs
        marker = None
        if name == "torchtune":
            from torchtune.training import OffloadActivations
            self.peer_ctx = OffloadActivations()
        elif name == "deepspeed":
            from deepspeed.runtime.activation_checkpointing.offload_activations import (
                CheckpointHiddenStatesOffload)
            marker = self.peer_ctx = CheckpointHiddenStatesOffload()
            self.step_scope = "step"
            # Its first __enter__ imports transformers (to patch HF layers) when
            # installed: do that now, so that it is not inside a measured step.
            try:
                from transformers import GradientCheckpointingLayer  # noqa: F401
            except Exception:
                pass
        elif name == "save_on_cpu":
            self.extra["pin_memory"] = device.type == "cuda"
        if cs.wrap == "checkpoint":
            _wrap_blocks(model, selective=False, marker=marker)
        elif cs.wrap == "sac":
            _wrap_blocks(model, selective=True)
        if cs.family == "tiermem":
            pol = cs.tiermem_policy
            policy = BigToCpu(mixed_threshold(spec, opts)) if pol == "mixed" else pol
            if pol == "mixed":
                self.extra["mixed_policy"] = repr(policy)
            self.off = tiermem.Offloader(policy=policy, **_tiermem_settings(opts, spec, cs))
            self.extra["cpu_budget_bytes"] = getattr(self.off, "cpu_budget_bytes", None)
            self.extra["min_offload_bytes"] = self.off.config.min_offload_bytes
        self.phases = _Phases(device)
        #: CPU only: RSS after the last forward less RSS before it (one read of
        #: /proc/self/statm each). With MALLOC_MMAP_THRESHOLD_ set low (the
        #: suite's --malloc-mmap-threshold) every large tensor is its own
        #: mapping, so this is the bytes the forward left alive in RAM: what a
        #: configuration keeps of the saved activations, for any configuration
        #: (tiermem, checkpointing, plain), measured the same way.
        self.forward_held_bytes: Optional[int] = None

    def _ctx(self):
        if self.off is not None:
            return self.off
        if self.name == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=self.extra["pin_memory"])
        if self.peer_ctx is not None:
            return self.peer_ctx
        return contextlib.nullcontext()

    def step(self, x: torch.Tensor, y: torch.Tensor, seed: int, on_phase=None):
        ph = self.phases
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        ph.mark(0)
        self.opt.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        ctx = self._ctx()
        if on_phase:
            on_phase("forward")
        # step_scope "step": the context wraps forward and backward; else forward only.
        whole = self.step_scope == "step"
        rss0 = None if cuda else rss_bytes()
        with ctx if whole else contextlib.nullcontext():
            with contextlib.nullcontext() if whole else ctx:
                loss = self.model(x, y)
            ph.mark(1)
            if not cuda:
                # What the forward left allocated (saved activations held in RAM,
                # the loss, moves not landed yet): see forward_held_bytes.
                self.forward_held_bytes = rss_bytes() - rss0
            if on_phase:
                on_phase("backward")
            loss.backward()
        ph.mark(2)
        if on_phase:
            on_phase("optimizer")
        self.opt.step()
        ph.mark(3)
        if cuda:
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        if on_phase:
            on_phase("end")
        return loss.detach(), dt, ph.seconds()

    def tiermem_stats(self) -> Optional[dict]:
        if self.off is None:
            return None
        out = self.off.stats.as_dict()
        # Since the Offloader was made: drops of pinned buffers from a full pool,
        # each a device sync on CUDA (NOTE [Trimming pinned buffers]).
        out["pinned_returns_total"] = sum(
            tier["pinned_returns"] for tier in self.off.store_stats().values())
        plan = self.off.plan   # auto: settled between steps (NOTE [Closed loop])
        if plan is not None:
            self.extra["plan"] = {
                "budget_bytes": plan.budget_bytes, "budget_setting": plan.budget_setting,
                "baseline_bytes": plan.baseline_bytes,
                "predicted_kept_bytes": plan.predicted_kept_bytes,
                "measured_kept_bytes": plan.measured_kept_bytes,
                "predicted_stall_s": plan.predicted_stall_s,
                "predicted_recompute_s": plan.predicted_recompute_s,
                "measured_stall_s": plan.measured_stall_s,
                "predicted_cpu_s": getattr(plan, "predicted_cpu_s", None),
                "prefetch_window_bytes": plan.suggested_prefetch_bytes,
                "replans": plan.replans, "replan_reason": plan.replan_reason,
                "bytes_by_tier": plan.bytes_by_tier(),
                "notes": list(plan.notes),
                "profiles": tiermem.testing.planner_of(self.off).profiles}
        return out

    def peer_stats(self) -> Optional[dict]:
        st = getattr(self.peer_ctx, "stats", None)
        if st is None:
            return None
        try:
            return dict(vars(st))
        except TypeError:
            return None

    def close(self) -> None:
        if self.off is not None:
            self.off.close()
            self.off = None

    def release(self) -> None:
        """Drop the model and optimizer (after an OOM: give the memory back)."""
        self.close()
        self.model = None
        self.opt = None
        self.peer_ctx = None


def make_runner(name: str, base: TinyGPT, spec: ModelSpec, device: torch.device,
                opts: dict) -> Runner:
    """A runner over a deep copy of ``base`` (same parameters bit for bit)."""
    return Runner(name, copy.deepcopy(base), spec, device, opts)


def make_batches(spec: ModelSpec, device: torch.device, n: int, seed: int) -> List[tuple]:
    """``n`` synthetic (tokens, targets) batches, the same in every process."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(n):
        x = torch.randint(0, spec.vocab, (spec.batch, spec.seq_len), generator=gen)
        out.append((x.to(device), torch.roll(x, -1, dims=1).to(device)))
    return out


def step_seed(seed: int, i: int) -> int:
    return seed * 1_000_003 + i
