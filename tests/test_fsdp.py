"""FSDP2 (``fully_shard``) and tensor-parallel DTensors under tiermem, on two
CPU ranks with gloo (issue 13).

One process group runs every case (spawning one per case would cost more than
the cases): for each variant of the FSDP2 setup (mixed precision,
``reshard_after_forward`` True/False, activation checkpointing inside the
model, ``tiermem.wrap_blocks``) a reference training of a few AdamW steps
without tiermem, then the same training under each tier (keep, cpu, nvme with
both engines, recompute, recompute,cpu). Every rank compares its losses and
its local shards of the parameters bit for bit with the reference. Each case
is reported as a test of its own.

The model ends each block with ``h * gain``: the next block's LayerNorm saves
that product, so under ``recompute`` its recipe would need the previous
block's ``gain``, an unsharded parameter FSDP2 frees after that block's
forward (NOTE [Sharded parameters] in tiermem/runtime/hooks.py).

Runtime here (2 cores): 9 to 20 s for the whole group (42 cases), most of it
in the fixture that runs the ranks.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import helpers
from distributed import Block, TinyLM, init_gloo, run_ranks, shutdown

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 3
TIER_CASES = ("keep", "cpu", "nvme-python", "nvme-cpp", "recompute", "recompute,cpu")
VARIANTS = {
    "fp32": {},
    "no-reshard": {"reshard": False},
    "bf16": {"mp": torch.bfloat16},
    "checkpoint": {"checkpoint": True},
    "wrap_blocks": {"wrap": True},
    "block-twice": {"twice": True},
    # Rule 5 of NOTE [Sharded parameters]: a saved alias of an unsharded parameter.
    "param-alias": {"alias": True},
}
CASES = [f"{v}/{t}" for v in VARIANTS for t in TIER_CASES]
TP_CASES = [f"tp/{t}" for t in TIER_CASES]


def _sharded_model(variant: dict, device: str = "cpu"):
    import tiermem
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = TinyLM(checkpoint=variant.get("checkpoint", False),
                   twice=variant.get("twice", False),
                   alias=variant.get("alias", False)).to(device)
    if variant.get("wrap"):
        tiermem.wrap_blocks(model, Block, checkpoint=True)
    mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    mp = variant.get("mp")
    kw = {"mesh": mesh, "reshard_after_forward": variant.get("reshard", True)}
    if mp is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _train(model, rank: int, ctx_factory, on_step=None):
    device = next(model.parameters()).device
    """AdamW steps on this rank's own data; losses and local parameter shards."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(0, 64, (4, 16), generator=gen).to(device)
        torch.manual_seed(1000 * rank + step)   # dropout: same stream in both runs
        with ctx_factory():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        if on_step is not None:
            on_step()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    params = [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
              for p in model.parameters()]
    return losses, params


def _compare(got, ref) -> str:
    """'' when the losses and parameters are bit-identical, else what differs."""
    (losses, params), (rlosses, rparams) = got, ref
    for i, (a, b) in enumerate(zip(losses, rlosses)):
        if not torch.equal(a, b):
            return f"loss of step {i}: {a.item()!r} != {b.item()!r}"
    for i, (a, b) in enumerate(zip(params, rparams)):
        if not torch.equal(a, b):
            return f"parameter {i} differs (max {(a.double() - b.double()).abs().max().item():g})"
    if all(torch.equal(a, torch.zeros_like(a)) for a in params):
        return "the parameters are all zero: nothing was compared"
    return ""


def _offloader(tier_case: str, nvme_dir: str):
    import tiermem
    policy, _, engine = tier_case.partition("-")
    settings = {"min_offload_bytes": 0}
    if policy == "nvme":
        settings.update(nvme_dir=nvme_dir, engine=engine)
    return tiermem.Offloader(policy=policy, **settings)


def _rank_dirs(nvme_dir: str, rank: int) -> list:
    return [d for d in os.listdir(nvme_dir) if d.startswith("tiermem-")
            and d.endswith(f"-rank{rank}")]


def _fsdp_case(rank, variant, tier_case, ref, nvme_dir, device="cpu") -> str:
    off = _offloader(tier_case, nvme_dir)
    seen_dirs = []

    def on_step():
        if tier_case.startswith("nvme"):
            seen_dirs.append(len(_rank_dirs(nvme_dir, rank)))
    try:
        got = _train(_sharded_model(variant, device), rank, lambda: off, on_step)
        moved = sum(n for t, n in off.stats.count_by_tier.items() if t != "keep")
    finally:
        off.close()
    if tier_case != "keep" and moved == 0:
        return f"nothing left the keep tier ({off.stats})"
    if seen_dirs and seen_dirs != [1] * STEPS:
        return f"this rank's private nvme directories during the steps: {seen_dirs}, not 1"
    if tier_case.startswith("nvme") and _rank_dirs(nvme_dir, rank):
        return f"left after close: {_rank_dirs(nvme_dir, rank)}"
    return _compare(got, ref)


def _tp_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    mesh = init_device_mesh("cpu", (WORLD,))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(output_layouts=None),
                                            "2": RowwiseParallel()})


def _tp_train(ctx_factory):
    model = _tp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 32, generator=gen)
        with ctx_factory():
            y = model(x)
            loss = y.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return losses, [p.detach().to_local().clone() for p in model.parameters()]


def _tp_case(tier_case, ref, nvme_dir) -> str:
    from torch.distributed.tensor import DTensor
    saved = []

    def note(t):
        saved.append(isinstance(t, DTensor))
        return t
    off = _offloader(tier_case, nvme_dir)
    try:
        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            _tp_model()(torch.randn(8, 32))   # what the model saves, seen plainly
        got = _tp_train(lambda: off)
    finally:
        off.close()
    if not any(saved):
        return "the model saved no DTensor: the case checks nothing"
    if tier_case != "keep" and off.stats.unsupported_count == 0:
        return f"no DTensor was kept as unsupported ({off.stats})"
    return _compare(got, ref)


def _fsdp_cases(rank: int, nvme_dir: str, cpp_ok: bool, device: str, results: dict) -> None:
    """Every FSDP2 variant x tier on ``device``, into ``results``."""
    for name, variant in VARIANTS.items():
        ref = _train(_sharded_model(variant, device), rank, contextlib.nullcontext)
        for tier_case in TIER_CASES:
            if tier_case == "nvme-cpp" and not cpp_ok:
                results[f"{name}/{tier_case}"] = "skip"
                continue
            try:
                results[f"{name}/{tier_case}"] = _fsdp_case(rank, variant, tier_case, ref,
                                                            nvme_dir, device)
            except Exception:
                results[f"{name}/{tier_case}"] = traceback.format_exc()


def _worker(rank: int, world: int, port: int, nvme_dir: str, cpp_ok: bool) -> dict:
    init_gloo(rank, world, port)
    results = {}
    try:
        _fsdp_cases(rank, nvme_dir, cpp_ok, "cpu", results)
        ref = _tp_train(contextlib.nullcontext)
        for tier_case in TIER_CASES:
            if tier_case == "nvme-cpp" and not cpp_ok:
                results[f"tp/{tier_case}"] = "skip"
                continue
            try:
                results[f"tp/{tier_case}"] = _tp_case(tier_case, ref, nvme_dir)
            except Exception:
                results[f"tp/{tier_case}"] = traceback.format_exc()
    finally:
        shutdown()
    return results


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    nvme_dir = str(tmp_path_factory.mktemp("shared-nvme"))
    cpp_ok = helpers.cpp_engine_unavailable() is None   # built here, once, before the ranks
    return run_ranks(_worker, WORLD, nvme_dir, cpp_ok, timeout_s=240)


def _check(results, case):
    for rank, res in enumerate(results):
        outcome = res[case]
        if outcome == "skip":
            pytest.skip(f"C++ engine unavailable: {helpers.cpp_engine_unavailable()}")
        assert outcome == "", f"rank {rank}, {case}: {outcome}"


@pytest.mark.parametrize("case", CASES)
def test_fsdp2_training_is_bit_identical(fsdp_results, case):
    """Losses and local parameter shards after AdamW steps equal the same FSDP2
    run without tiermem; the tier moved something; nvme: one private
    directory per rank while training, none after close."""
    _check(fsdp_results, case)


@pytest.mark.parametrize("case", TP_CASES)
def test_tensor_parallel_dtensor_activations_are_kept(fsdp_results, case):
    """A saved DTensor activation (tensor parallelism) is kept as it is
    (``stats.unsupported_count``), and training is bit-identical."""
    _check(fsdp_results, case)


def _gpu_worker(rank: int, world: int, port: int, nvme_dir: str, cpp_ok: bool) -> dict:
    """The FSDP2 cases on CUDA with NCCL (a world of one rank per GPU)."""
    init_gloo(rank, world, port, backend="nccl")
    results = {}
    try:
        _fsdp_cases(rank, nvme_dir, cpp_ok, "cuda", results)
    finally:
        shutdown()
    return results


@pytest.fixture(scope="module")
def fsdp_gpu_results(tmp_path_factory):
    nvme_dir = str(tmp_path_factory.mktemp("gpu-nvme"))
    cpp_ok = helpers.cpp_engine_unavailable() is None
    return run_ranks(_gpu_worker, 1, nvme_dir, cpp_ok, timeout_s=240)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_fsdp2_on_cuda_with_nccl_is_bit_identical(fsdp_gpu_results, case):
    """The same checks on a GPU: FSDP2 with a world of 1 under NCCL (issue 13),
    every tier, bit-identical to the same FSDP2 run without tiermem."""
    _check(fsdp_gpu_results, case)
