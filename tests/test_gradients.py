"""Gradients are bit-identical with and without tiermem, for every model and policy.

Every parameter's gradient and the loss are compared with ``torch.equal``, over
three AdamW steps in a row (parameters compared after each step too), against a
reference model trained without tiermem from the same initialisation and the
same RNG seeds. ``min_offload_bytes=0`` makes every activation go through the
policy, and the ``cpu`` runs assert that tensors really moved.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import tiermem
from helpers import assert_same_tensors, reference_steps, run_step, train_steps
from models import MODEL_NAMES, make_case

STEPS = 3


def _alternate(info: tiermem.TensorInfo):
    """Mixed policy: even packing indices stay, odd ones go to the cpu tier."""
    return tiermem.Tier.KEEP if info.index % 2 == 0 else tiermem.Tier.CPU


def _strings(info: tiermem.TensorInfo):
    """A policy answering with strings in any case: every third tensor "Keep",
    the others "CPU"."""
    return "Keep" if info.index % 3 == 0 else "CPU"


POLICIES = {
    "keep": "keep",
    "cpu": "cpu",
    "alternate": _alternate,
    "strings": _strings,
}


def _compare(records, ref, name):
    assert len(records) == len(ref) == STEPS
    for step, ((loss, grads, params), (rloss, rgrads, rparams)) in enumerate(zip(records, ref)):
        assert torch.equal(loss, rloss), f"{name} step {step}: loss {loss} != {rloss}"
        assert_same_tensors(grads, rgrads, f"{name} step {step} grads")
        assert_same_tensors(params, rparams, f"{name} step {step} params")
    # The steps changed the parameters: the comparison is not of a frozen model.
    first, last = records[0][2], records[-1][2]
    assert any(not torch.equal(first[n], last[n]) for n in first)


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_bit_identical_over_adamw_steps(model_name, policy):
    ref = reference_steps(model_name, STEPS)
    off = tiermem.Offloader(policy=POLICIES[policy], min_offload_bytes=0)
    case = make_case(model_name)
    seen = []

    def ctx():
        if seen:  # stats of the previous step, complete now that its backward ran
            seen[-1] = off.stats
        seen.append(None)
        return off

    records = train_steps(case, ctx, STEPS)
    seen[-1] = off.stats
    _compare(records, ref, f"{model_name}/{policy}")

    for stats in seen:
        cpu, keep = stats.count_by_tier["cpu"], stats.count_by_tier["keep"]
        assert stats.param_count > 0, "parameters are saved by every model here"
        if policy == "keep":
            assert cpu == 0 and keep > 0
        elif policy == "cpu":
            assert cpu > 0, "nothing moved: the test would pass vacuously"
            assert stats.bytes_by_tier["cpu"] > 0
            assert stats.offloaded_bytes == stats.bytes_by_tier["cpu"]
        else:
            assert cpu > 0 and keep > 0, f"mixed policy should use both tiers: {stats}"
    # All graphs are gone: once the copies in flight are finished (close), no
    # host buffer is in use. (Without close, see test_semantics'
    # test_host_buffers_freed_with_graph_when_copies_land_late.)
    off.close()
    assert off.host_bytes_in_use == 0


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
    _compare(records, ref, f"{model_name}/offload()")
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
