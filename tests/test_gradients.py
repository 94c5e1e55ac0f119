"""Gradients are bit-identical with and without tiermem, for every model and policy.

The core matrix of the suite: every tier (the ``tier`` fixture: keep, cpu,
nvme, recompute, recompute,cpu) times every model (the ``model_case``
fixture: MLP, transformer block with dropout, conv net, embedding/gather, and
bf16 MLP and block). Every parameter's gradient and the loss are compared with
``torch.equal``, over three AdamW steps in a row (parameters compared after
each step too), against a reference model trained without tiermem from the
same initialisation and the same RNG seeds. ``min_offload_bytes=0`` makes
every activation go through the policy, and each step's stats show that the
tier was really used. Callable policies mixing tiers run over every model too.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import tiermem
from helpers import assert_same_tensors, compare_records, reference_steps, run_step, train_steps
from models import make_case

STEPS = 3

#: Models that save GELU/tanh/LayerNorm outputs, whose inputs are saved
#: anyway: the recompute tier drops them.
RECOMPUTABLE = {"mlp", "block", "mlp_bf16", "block_bf16"}


def _train(case, off):
    """:func:`train_steps` under ``off``; also returns the stats of each step
    (each complete: taken after its backward)."""
    seen = []

    def ctx():
        if seen:  # stats of the previous step, complete now that its backward ran
            seen[-1] = off.stats
        seen.append(None)
        return off

    records = train_steps(case, ctx, STEPS)
    seen[-1] = off.stats
    return records, seen


def _expect_tier_used(stats, tier, model_name):
    """What one step's stats must show for a run with policy ``tier``."""
    counts = stats.count_by_tier
    assert stats.param_count > 0, "parameters are saved by every model here"
    if tier == "keep":
        assert counts["keep"] > 0
        assert counts["cpu"] == counts["nvme"] == counts["recompute"] == 0, stats
        assert stats.offloaded_bytes == 0
    elif tier in ("cpu", "nvme"):
        assert counts[tier] > 0, "nothing moved: the test would pass vacuously"
        assert stats.bytes_by_tier[tier] > 0
        assert stats.offloaded_bytes == stats.bytes_by_tier[tier]
        other = "nvme" if tier == "cpu" else "cpu"
        assert counts[other] == counts["recompute"] == 0, stats
    else:  # recompute, recompute,cpu
        assert counts["nvme"] == 0, stats
        if model_name in RECOMPUTABLE:
            assert counts["recompute"] > 0, stats
            assert stats.recompute_count > 0, stats
            assert stats.recompute_seconds > 0
        if tier == "recompute,cpu":
            assert counts["cpu"] > 0, "what is not eligible goes to the next choice"
        else:
            assert counts["cpu"] == 0, stats


def test_bit_identical_over_adamw_steps(model_case, tier, make_off):
    name = model_case.name
    ref = reference_steps(name, STEPS)
    off = make_off(tier)
    records, seen = _train(model_case, off)
    compare_records(records, ref, f"{name}/{tier}")
    for stats in seen:
        _expect_tier_used(stats, tier, name)
    # All graphs are gone: once the copies in flight are finished (close), no
    # host buffer and no disk extent is in use. (Without close, see
    # test_semantics' test_host_buffers_freed_with_graph_when_copies_land_late.)
    off.close()
    assert off.host_bytes_in_use == 0
    assert off.disk_bytes_in_use == 0


def _alternate(info: tiermem.TensorInfo):
    """Mixed policy: even packing indices stay, odd ones go to the cpu tier."""
    return tiermem.Tier.KEEP if info.index % 2 == 0 else tiermem.Tier.CPU


def _strings(info: tiermem.TensorInfo):
    """A policy answering with strings in any case: every third tensor "Keep",
    the others "CPU"."""
    return "Keep" if info.index % 3 == 0 else "CPU"


def _keep_cpu_nvme(info: tiermem.TensorInfo):
    """keep, cpu and nvme in turn."""
    return ("keep", "cpu", "nvme")[info.index % 3]


#: Callable policies: name -> (policy, the tiers each step must use).
MIXED = {
    "alternate": (_alternate, ("keep", "cpu")),
    "strings": (_strings, ("keep", "cpu")),
    "keep_cpu_nvme": (_keep_cpu_nvme, ("keep", "cpu", "nvme")),
}


@pytest.mark.parametrize("policy", list(MIXED))
def test_mixed_callable_policies_bit_identical(model_case, policy, make_off, nvme_dir):
    fn, used = MIXED[policy]
    name = model_case.name
    ref = reference_steps(name, STEPS)
    off = make_off(fn, nvme_dir=nvme_dir if "nvme" in used else None)
    records, seen = _train(model_case, off)
    compare_records(records, ref, f"{name}/{policy}")
    for stats in seen:
        assert stats.param_count > 0
        for t in ("keep", "cpu", "nvme", "recompute"):
            if t in used:
                assert stats.count_by_tier[t] > 0, f"mixed policy should use {t}: {stats}"
            else:
                assert stats.count_by_tier[t] == 0, stats
    off.close()
    assert off.host_bytes_in_use == 0
    assert off.disk_bytes_in_use == 0


@pytest.mark.parametrize("model_name", ["mlp", "block"])
def test_one_shot_offload_bit_identical(model_name):
    """``tiermem.offload(...)`` (the one-shot form) gives the same gradients and
    reuses one Offloader for identical settings."""
    ref = reference_steps(model_name, STEPS)
    case = make_case(model_name)
    used = []

    def ctx():
        off = tiermem.offload(policy="cpu", min_offload_bytes=0)
        used.append(off)
        return off

    records = train_steps(case, ctx, STEPS)
    compare_records(records, ref, f"{model_name}/offload()")
    assert all(o is used[0] for o in used)
    assert used[0].stats.count_by_tier["cpu"] > 0


def test_mixed_policy_places_by_index():
    """The alternating policy really puts even indices on keep and odd on cpu:
    counts split accordingly."""
    case = make_case("mlp")
    infos = []

    def policy(info):
        infos.append(info)
        return _alternate(info)

    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    with off:
        loss = case.loss()
    loss.backward()
    n = len(infos)
    assert n >= 4
    assert off.stats.count_by_tier["keep"] == (n + 1) // 2
    assert off.stats.count_by_tier["cpu"] == n // 2


def test_policy_returning_enum_and_strings_agree():
    """``"cpu"``, ``"CPU"`` and ``Tier.CPU`` from a callable are the same tier."""
    counts = []
    for answer in ("cpu", "CPU", tiermem.Tier.CPU):
        case = make_case("mlp")
        off = tiermem.Offloader(policy=lambda info, a=answer: a, min_offload_bytes=0)
        with off:
            loss = case.loss()
        loss.backward()
        counts.append(dict(off.stats.count_by_tier))
    assert counts[0] == counts[1] == counts[2]
    assert counts[0]["cpu"] > 0 and counts[0]["keep"] == 0


def test_policy_returning_nonsense_raises():
    """A policy answer that is not a tier raises TierMemError naming the answer,
    the context exits, and the same Offloader is usable again."""
    case = make_case("mlp")
    answer = ["gpu"]
    off = tiermem.Offloader(policy=lambda info: answer[0], min_offload_bytes=0)
    with pytest.raises(tiermem.TierMemError, match="gpu"):
        with off:
            case.loss()
    answer[0] = "cpu"
    loss, grads = run_step_case(case, off)
    rloss, rgrads = run_step_case(make_case("mlp"), None)
    assert torch.equal(loss, rloss)
    assert_same_tensors(grads, rgrads, "after a failed step")
    assert off.stats.count_by_tier["cpu"] > 0


def run_step_case(case, off):
    ctx = off if off is not None else contextlib.nullcontext()
    return run_step(case.model, case.inputs, ctx, seed=3, loss_fn=case.loss_fn)
