"""PyTorch's ``torch.utils.checkpoint.CheckpointPolicy`` as a tiermem policy's
answer (issue 12 item 4; NOTE [CheckpointPolicy answers] in tiermem/policy.py):
each member places on the tier the README's table states, under a callable
policy and under ``wrap_blocks(..., policy=...)``, with gradients bit-identical
to plain autograd; lists mixing members and tier names; MUST_RECOMPUTE that
cannot be honoured raises; what the planner reads (``must``, ``hint``,
``is_constraint``); answers of the wrong type; and the same decisions taken by
PyTorch's selective checkpointing give the same gradients.

Runtime on 2 shared cores: 2-11 s for the file (50 tests; the first one pays
for the warm-up), measured while other work shared the cores.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import tiermem
import tiermem.testing
from helpers import assert_same_step, offloader, run_step
from models import make_case
from tiermem.policy import CHECKPOINT_POLICY_TIERS, TierOrder, is_constraint, tier_order

C = CheckpointPolicy
K, P, N, R = (tiermem.Tier.KEEP, tiermem.Tier.CPU, tiermem.Tier.NVME, tiermem.Tier.RECOMPUTE)

#: The README's table: the tier each member places a tensor on.
STATED = {"MUST_SAVE": "keep", "PREFER_SAVE": "keep", "MUST_RECOMPUTE": "recompute",
          "PREFER_RECOMPUTE": "recompute", "MUST_CPU_OFFLOAD": "cpu", "PREFER_CPU_OFFLOAD": "cpu"}
MEMBERS = list(CheckpointPolicy)

#: Ops of models.Block whose saved outputs tiermem can always recompute there.
CHEAP = ("gelu", "native_layer_norm")


def _ids(m):
    return m.name


# ---------------------------------------------------------------------------
# The mapping itself, and what the planner reads
# ---------------------------------------------------------------------------

def test_every_member_of_this_torch_has_a_stated_tier():
    """A member a later torch adds fails here until its meaning is decided."""
    assert {m.name for m in CheckpointPolicy} <= set(STATED)
    assert {m.name: t.value for m, t in CHECKPOINT_POLICY_TIERS.items()} == {
        m.name: STATED[m.name] for m in CheckpointPolicy}


@pytest.mark.parametrize("member", MEMBERS, ids=_ids)
def test_order_must_and_hint_of_each_member(member):
    order = tier_order(member, source="the policy")
    assert isinstance(order, TierOrder)
    assert order[0].value == STATED[member.name]
    assert order.hint is member
    assert order.must is member.name.startswith("MUST_")
    assert is_constraint(member) is order.must
    assert is_constraint([member, "cpu"]) is order.must
    # Recompute values leave the rest to the device's default; others end in keep.
    assert order.then_default is (order[0] is R)
    if not order.then_default:
        assert order[-1] is K


@pytest.mark.parametrize("choice, tiers, must, hint", [
    ([C.PREFER_RECOMPUTE, "nvme"], (R, N, P, K), False, C.PREFER_RECOMPUTE),
    ([C.MUST_RECOMPUTE, "cpu"], (R, P, K), True, C.MUST_RECOMPUTE),
    (["recompute", C.PREFER_CPU_OFFLOAD], (R, P, K), False, None),
    ([C.PREFER_CPU_OFFLOAD, "nvme"], (P, N, K), False, C.PREFER_CPU_OFFLOAD),
    ([tiermem.Tier.NVME, C.PREFER_SAVE], (N, K), False, None),
    ("recompute,cpu", (R, P, K), False, None),
])
def test_lists_mixing_members_and_tier_names(choice, tiers, must, hint):
    order = tier_order(choice, source="the policy")
    assert tuple(order) == tiers and not order.then_default
    assert order.must is must and order.hint is hint
    assert order == tiers   # still a tuple for everything that reads orders


def test_tier_names_are_hints_not_constraints():
    for choice in ("keep", "cpu", ["recompute", "cpu"], tiermem.Tier.NVME):
        order = tier_order(choice, source="the policy")
        assert not order.must and order.hint is None and not is_constraint(choice)


@pytest.mark.parametrize("member", [C.PREFER_RECOMPUTE, C.MUST_RECOMPUTE], ids=_ids)
@pytest.mark.parametrize("device, with_nvme, tiers", [
    ("cuda", False, (R, P, K)),
    ("cpu", False, (R, K)),
    ("cpu", True, (R, N, P, K)),
])
def test_recompute_is_followed_by_the_devices_default_tier(member, device, with_nvme, tiers,
                                                          nvme_dir):
    """cpu for CUDA tensors; for CPU tensors nvme when the Offloader has an nvme
    tier, else keep (torch.device("cuda") is only a name here: no CUDA needed)."""
    settings = {"nvme_dir": nvme_dir} if with_nvme else {}
    off = offloader(lambda info: member, **settings)
    try:
        info = tiermem.TensorInfo(torch.Size([4]), torch.float32, torch.device(device), 16,
                                  "", "gelu", 0, False)
        order = tiermem.testing.order_for(off, info)
        assert tuple(order) == tiers
        assert order.must is (member is C.MUST_RECOMPUTE) and order.hint is member
        assert not order.then_default
    finally:
        off.close()


# ---------------------------------------------------------------------------
# Under a callable policy: stated tier, exact gradients
# ---------------------------------------------------------------------------

def _reference(name="block", seed=3):
    case = make_case(name)
    return run_step(case.model, case.inputs, contextlib.nullcontext(), seed=seed,
                    loss_fn=case.loss_fn)


@pytest.mark.parametrize("member", MEMBERS, ids=_ids)
def test_callable_answer_places_on_the_stated_tier(member):
    """models.Block (attention and residual dropout): the member for LayerNorm
    and GELU outputs, "cpu" for the rest."""
    asked = []

    def policy(info):
        asked.append(info.op)
        return member if info.op in CHEAP else "cpu"

    case = make_case("block")
    off = offloader(policy)
    got = run_step(case.model, case.inputs, off, seed=3, loss_fn=case.loss_fn)
    assert_same_step(got, _reference(), member.name)
    counts = off.stats.count_by_tier
    n = sum(op in CHEAP for op in asked)
    assert n >= 6, asked   # two LayerNorms (output, mean, rstd) and a GELU at least
    stated = STATED[member.name]
    if stated == "cpu":
        assert counts == {"keep": 0, "cpu": len(asked), "nvme": 0, "recompute": 0}
    else:
        assert counts[stated] == n and counts["cpu"] == len(asked) - n, counts
        assert off.stats.recompute_fallbacks == 0
    off.close()


def test_list_mixing_member_and_tier_name_under_a_callable():
    """[PREFER_RECOMPUTE, "cpu"] for every tensor: the cheap ones recomputed,
    the rest (matmul outputs, dropout...) moved to cpu, none kept."""
    case = make_case("block")
    off = offloader(lambda info: [C.PREFER_RECOMPUTE, "cpu"])
    got = run_step(case.model, case.inputs, off, seed=3, loss_fn=case.loss_fn)
    assert_same_step(got, _reference(), "[PREFER_RECOMPUTE, cpu]")
    s = off.stats
    assert s.count_by_tier["recompute"] >= 6 and s.count_by_tier["cpu"] > 0
    assert s.count_by_tier["keep"] == 0
    assert s.count_by_tier["cpu"] >= s.recompute_fallbacks > 0
    off.close()


@pytest.mark.parametrize("with_nvme", [False, True], ids=["no-nvme", "nvme"])
def test_prefer_recompute_falls_back_to_the_devices_default(with_nvme, nvme_dir):
    """What cannot be recomputed goes where the default policy puts CPU
    tensors: nvme when there is an nvme tier, else keep."""
    settings = {"nvme_dir": nvme_dir} if with_nvme else {}
    case = make_case("block")
    off = offloader(lambda info: C.PREFER_RECOMPUTE, **settings)
    got = run_step(case.model, case.inputs, off, seed=3, loss_fn=case.loss_fn)
    assert_same_step(got, _reference(), "PREFER_RECOMPUTE")
    s = off.stats
    fallback = "nvme" if with_nvme else "keep"
    assert s.count_by_tier["recompute"] >= 6
    assert s.recompute_fallbacks > 0 and s.count_by_tier[fallback] > 0
    assert s.count_by_tier["cpu"] == 0
    assert s.count_by_tier["keep" if with_nvme else "nvme"] == 0
    off.close()


def test_must_recompute_of_a_non_recomputable_op_raises_naming_op_and_module():
    answer = [C.MUST_RECOMPUTE]

    def policy(info):   # MUST_RECOMPUTE for matmul outputs: not on the allow-list
        return answer[0] if info.op == "addmm" else "cpu"

    case = make_case("mlp")
    off = offloader(policy)
    with pytest.raises(tiermem.TierMemError,
                       match=r"MUST_RECOMPUTE .*made by op addmm, in module MLP\.1\)") as e:
        with off:
            case.loss()
    msg = str(e.value)
    del e   # its traceback holds the partial graph, and that graph the moved tensors
    gc.collect()
    assert off.host_bytes_in_use == 0
    assert "not recomputable" in msg and "PREFER_RECOMPUTE" in msg
    # The Offloader is usable again; with PREFER_RECOMPUTE the same tensors fall back.
    answer[0] = C.PREFER_RECOMPUTE
    got = run_step(case.model, case.inputs, off, seed=3, loss_fn=case.loss_fn)
    assert_same_step(got, _reference("mlp"), "after the refused step")
    assert off.stats.recompute_fallbacks > 0 and off.stats.count_by_tier["keep"] > 0
    off.close()
    assert off.host_bytes_in_use == 0


def test_must_recompute_error_names_the_op_the_policy_saw_through_views():
    """models.Block's matmul outputs reach the policy as "addmm" through a view."""
    case = make_case("block")
    off = offloader(lambda info: C.MUST_RECOMPUTE if info.op == "addmm" else "cpu")
    with pytest.raises(tiermem.TierMemError,
                       match=r"made by op addmm \(through view\), in module Block\."):
        with off:
            case.loss()
    off.close()


def test_must_cpu_offload_over_a_full_cpu_tier_falls_back_with_a_warning(caplog):
    """Capacity is not a broken MUST: a full tier passes tensors on (one warning)."""
    case = make_case("block")
    off = offloader(lambda info: C.MUST_CPU_OFFLOAD, cpu_budget=4096)
    with caplog.at_level("WARNING", logger="tiermem"):
        got = run_step(case.model, case.inputs, off, seed=3, loss_fn=case.loss_fn)
    assert_same_step(got, _reference(), "MUST_CPU_OFFLOAD over budget")
    s = off.stats
    assert s.budget_fallbacks > 0 and s.count_by_tier["keep"] == s.budget_fallbacks
    assert sum("cpu tier is full" in r.getMessage() for r in caplog.records) == 1
    off.close()


@pytest.mark.parametrize("answer, shown", [
    (3, "3 (int)"),
    (None, "None (NoneType)"),
    (True, "True (bool)"),
    ({"cpu"}, "{'cpu'} (set)"),
    ([["cpu"]], "['cpu'] (list)"),
    ("gpu", "'gpu' (str)"),
])
def test_an_answer_of_the_wrong_kind_raises_naming_it_and_the_accepted_kinds(answer, shown):
    case = make_case("mlp")
    off = offloader(lambda info: answer)
    with pytest.raises(tiermem.TierMemError) as e:
        with off:
            case.loss()
    msg = str(e.value)
    assert msg.startswith("tiermem: the policy returned " + shown), msg
    assert "CheckpointPolicy value" in msg and "tier name" in msg
    off.close()


def test_a_must_after_the_first_entry_is_refused():
    off = offloader(lambda info: ["cpu", C.MUST_SAVE])
    with pytest.raises(tiermem.TierMemError, match="MUST_SAVE may only be the first entry"):
        with off:
            make_case("mlp").loss()
    off.close()


# ---------------------------------------------------------------------------
# Under wrap_blocks(..., policy=...)
# ---------------------------------------------------------------------------

class Pre(nn.Module):
    """LayerNorm and GELU: everything it saves (mean, rstd, the LayerNorm
    output) is recomputable when its input is a leaf."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.ln(x))


class Net(nn.Module):
    """``[Linear ->] Pre -> Dropout -> Linear``; with ``lead`` the block's
    input is a matmul output (not recomputable). Outside the block three
    tensors are saved: the dropout mask and output, the head's output (by the
    loss). Dropout stays outside the block: on the CPU its mask is made by an
    in-place op, which tiermem does not recompute."""

    def __init__(self, lead: bool = False, width: int = 16) -> None:
        super().__init__()
        self.lead = nn.Linear(width, width) if lead else nn.Identity()
        self.pre = Pre(width)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.drop(self.pre(self.lead(x))))


def _net_step(ctx, wrap=None, lead=False):
    """One step of a fresh Net (same seed each time); returns (loss, grads
    including the input's)."""
    torch.manual_seed(0)
    model = Net(lead)
    if wrap is not None:
        w = tiermem.wrap_blocks(model, Pre, checkpoint=False, policy=wrap)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(5)
    try:
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
    finally:
        if wrap is not None:
            w.unwrap()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["x"] = x.grad.clone()
    return loss.detach(), grads


@pytest.mark.parametrize("member", MEMBERS, ids=_ids)
def test_wrap_blocks_member_places_on_the_stated_tier(member):
    """Inside the block: mean, rstd, LayerNorm output (3) on the stated tier;
    the 3 saved outside it on the Offloader's cpu."""
    off = offloader("cpu")
    got = _net_step(off, wrap=member)
    assert_same_step(got, _net_step(contextlib.nullcontext()), member.name)
    stated = STATED[member.name]
    expected = {"keep": 0, "cpu": 3, "nvme": 0, "recompute": 0}
    expected[stated] += 3
    assert off.stats.count_by_tier == expected
    off.close()


def test_wrap_blocks_list_mixing_member_and_tier_name():
    """[PREFER_RECOMPUTE, "cpu"] on a block whose input a matmul made: that
    input is moved to cpu, the rest of the block recomputed; outside, the
    Offloader's keep."""
    off = offloader("keep")
    got = _net_step(off, wrap=[C.PREFER_RECOMPUTE, "cpu"], lead=True)
    assert_same_step(got, _net_step(contextlib.nullcontext(), lead=True), "mixed list")
    s = off.stats
    assert s.count_by_tier == {"keep": 3, "cpu": 1, "nvme": 0, "recompute": 3}
    assert s.recompute_fallbacks == 1


def test_wrap_blocks_must_recompute_of_a_non_recomputable_input_raises():
    off = offloader("cpu")
    with pytest.raises(tiermem.TierMemError,
                       match=r"MUST_RECOMPUTE .*made by op addmm, in module Net\.pre"):
        _net_step(off, wrap=C.MUST_RECOMPUTE, lead=True)
    # The same block with the soft form runs, exactly.
    got = _net_step(off, wrap=C.PREFER_RECOMPUTE, lead=True)
    assert_same_step(got, _net_step(contextlib.nullcontext(), lead=True), "PREFER after MUST")
    off.close()


@pytest.mark.parametrize("policy, match", [
    ([C.PREFER_SAVE, "gpu"], "'gpu'"),
    (["cpu", C.MUST_RECOMPUTE], "MUST_RECOMPUTE may only be the first entry"),
])
def test_wrap_blocks_refuses_bad_lists_with_config_error(policy, match):
    with pytest.raises(tiermem.ConfigError, match=match):
        tiermem.wrap_blocks(Net(), Pre, checkpoint=False, policy=policy)


# ---------------------------------------------------------------------------
# The same decisions under PyTorch's selective checkpointing
# ---------------------------------------------------------------------------

def _decide(op_name: str) -> CheckpointPolicy:
    """One decision function for both: save matmuls and attention, recompute the rest."""
    if op_name in ("addmm", "mm", "bmm", "_scaled_dot_product_flash_attention_for_cpu"):
        return C.MUST_SAVE
    return C.PREFER_RECOMPUTE


def _sac_policy(ctx, op, *args, **kwargs):
    return _decide(op.overloadpacket.__name__)


def test_same_decisions_under_selective_checkpointing_give_the_same_gradients():
    ref = _reference()
    case = make_case("block")
    body = case.model.forward

    def sac_forward(x):
        return checkpoint(body, x, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, _sac_policy))

    case.model.forward = sac_forward
    sac = run_step(case.model, case.inputs, contextlib.nullcontext(), seed=3,
                   loss_fn=case.loss_fn)
    assert_same_step(sac, ref, "selective checkpointing")

    case = make_case("block")
    off = offloader(lambda info: _decide(info.op or ""))
    got = run_step(case.model, case.inputs, off, seed=3, loss_fn=case.loss_fn)
    assert_same_step(got, ref, "tiermem, same decisions")
    s = off.stats
    assert s.count_by_tier["recompute"] >= 6 and s.count_by_tier["keep"] > 0
    assert s.count_by_tier["cpu"] == s.count_by_tier["nvme"] == 0
    off.close()
