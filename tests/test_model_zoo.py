"""The model zoo: real ``transformers`` architectures (``tests/zoo.py``: Llama,
Mistral with a sliding window, Mixtral with router jitter, Qwen2-MoE,
GPT-NeoX, T5, BERT, ViT, Mamba, ConvNeXt, ResNet; tiny configs, random init,
dropout on) trained for three AdamW steps under every policy (keep, cpu, nvme,
recompute, recompute+nvme, auto at 50% and 25% of a plain step), with and
without HF gradient checkpointing (non-reentrant and reentrant, where the
architecture has it). Losses, every gradient of every step and the parameters and buffers
after each step are ``torch.equal`` to the same run without tiermem, and the
Offloader's stats show that each step really used the policy's tiers.

The default run has one case per architecture (:data:`DEFAULT`, the policies
and checkpointing modes spread over them); the rest of the cross product is
marked ``slow``. T5, BERT, ViT and the conv nets enter through
``off.attach(model)`` and write to disk through the engine the environment
chooses (``engine="auto"``); the others enter through ``with off:`` and use
the Python engine.
"""

import contextlib

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

import zoo  # noqa: E402  (tests/zoo.py)
from helpers import moved_count  # noqa: E402

POLICIES = ("keep", "cpu", "nvme", "recompute", "recompute,nvme", "auto@50%", "auto@25%")
ATTACHED = ("t5", "bert", "vit", "convnext", "resnet")
STEPS = 3
#: The planner re-plans when kept bytes exceed the budget by more than this
#: (docs/planner.md, "Closed loop"); a planned step stays within it.
KEPT_TOLERANCE = 0.05

#: The default run's slice: every architecture once, every policy and
#: checkpointing mode at least once.
DEFAULT = {
    ("llama", "no_gc", "auto@25%"),
    ("mistral", "gc_nonreentrant", "cpu"),
    ("mixtral", "no_gc", "recompute,nvme"),
    ("qwen2_moe", "no_gc", "auto@50%"),
    ("gpt_neox", "gc_reentrant", "recompute,nvme"),
    ("t5", "no_gc", "nvme"),
    ("bert", "gc_reentrant", "keep"),
    ("vit", "no_gc", "auto@50%"),
    ("mamba", "no_gc", "recompute"),
    ("convnext", "no_gc", "recompute"),
    ("resnet", "no_gc", "cpu"),
}


def _cases():
    for name in zoo.ARCH_NAMES:
        for gc in (zoo.GC_MODES if zoo.ARCHS[name].gc else ("no_gc",)):
            for policy in POLICIES:
                marks = () if (name, gc, policy) in DEFAULT else (pytest.mark.slow,)
                yield pytest.param(name, gc, policy, marks=marks,
                                   id=f"{name}-{gc}-{policy.replace(',', '+').replace('@', '')}")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread while the zoo runs: these models' ops are tiny, and
    threads that spin in each of them cost far more than they compute on a
    loaded 2-core machine (both runs of a comparison use the same setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_REFERENCES = {}


def _reference(name, gc):
    """The plain run of ``name`` with ``gc`` (computed once per module)."""
    key = (name, gc)
    if key not in _REFERENCES:
        _REFERENCES[key] = zoo.train(zoo.build(name, gc), zoo.batches(name, STEPS),
                                     contextlib.nullcontext)
    return _REFERENCES[key]


def _offloader(make_off, nvme_dir, name, policy):
    # The attached models write to disk through the engine the environment
    # chooses (the C++ one where it builds), the others through the Python one.
    engine = "auto" if name in ATTACHED else "python"
    if policy.startswith("auto@"):
        return make_off("auto", device_budget=policy.split("@")[1], nvme_dir=nvme_dir,
                        engine=engine)
    return make_off(policy, engine=engine)


def _check_tiers_used(name, policy, steps, off):
    """Each step's stats show the policy's tiers at work (not a silent no-op)."""
    arch = zoo.ARCHS[name]
    for i, s in enumerate(steps):
        count, what = s.count_by_tier, f"{name} {policy} step {i}: {s}"
        used = {t for t, n in count.items() if n}
        if policy == "keep":
            assert used == {"keep"} and s.offloaded_bytes == 0, what
        elif policy in ("cpu", "nvme"):
            assert count[policy] > 0 and used <= {policy, "keep"}, what
            assert s.bytes_by_tier[policy] > s.bytes_by_tier["keep"], what
        elif policy.startswith("recompute"):
            if arch.recomputes:
                assert count["recompute"] > 0 and s.recompute_count > 0, what
            else:   # the policy was asked and refused each tensor, with reasons
                assert count["recompute"] == 0 and s.recompute_fallbacks > 0, what
            rest = "nvme" if policy == "recompute,nvme" else "keep"
            assert count[rest] > 0 and used <= {"recompute", rest}, what
        elif i > 0:   # auto: the steps after the profile follow a plan
            assert moved_count(s) > 0, what
    if policy.startswith("auto@"):
        plan = off.plan
        kept = steps[-1].bytes_by_tier["keep"]
        assert kept <= plan.budget_bytes * (1 + KEPT_TOLERANCE), (kept, str(plan))


def test_default_slice_has_every_architecture_policy_and_checkpointing_mode():
    every = {tuple(p.values) for p in _cases()}
    assert DEFAULT <= every, DEFAULT - every   # no misspelt case
    assert {n for n, _, _ in DEFAULT} == set(zoo.ARCH_NAMES)
    assert {p for _, _, p in DEFAULT} == set(POLICIES)
    assert {g for _, g, _ in DEFAULT} == set(zoo.GC_MODES)


@pytest.mark.parametrize("name, gc, policy", list(_cases()))
def test_training_is_bit_identical_and_uses_the_tiers(name, gc, policy, make_off, nvme_dir):
    ref = _reference(name, gc)
    off = _offloader(make_off, nvme_dir, name, policy)
    model = zoo.build(name, gc)
    steps = []
    record = lambda: steps.append(off.stats)   # noqa: E731  (after each backward)
    if name in ATTACHED:
        with off.attach(model):
            got = zoo.train(model, zoo.batches(name, STEPS), contextlib.nullcontext, record)
    else:
        got = zoo.train(model, zoo.batches(name, STEPS), lambda: off, record)
    zoo.compare(got, ref, f"{name} {gc} {policy}")
    assert len(steps) == STEPS and len({id(s) for s in steps}) == STEPS, steps
    _check_tiers_used(name, policy, steps, off)
