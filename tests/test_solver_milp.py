"""The auto planner's choice as a mixed-integer program (NOTE [Planner
choice] in tiermem/planner/milp.py), through the public API: constraints a
plan must obey whatever the prices."""

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import tiermem


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.inner, self.post = nn.Linear(64, 64), _Inner(), nn.Linear(64, 64)

    def forward(self, x):
        return self.post(torch.tanh(self.inner(torch.tanh(self.pre(x)))))


def test_a_nested_must_save_block_keeps_its_auto_block_from_being_checkpointed():
    # Blocks wrapped with policy=MUST_SAVE inside auto blocks: a checkpoint of
    # the auto block would run their forward again in backward and not save
    # what the policy says to save. At a budget that wants checkpoints, the
    # plan checkpoints none of them, says why, and each inner forward runs
    # once per step.
    torch.manual_seed(0)
    model = nn.Sequential(*[_Outer() for _ in range(4)])
    tiermem.wrap_blocks(model, _Inner, checkpoint=False, policy=CheckpointPolicy.MUST_SAVE)
    tiermem.wrap_blocks(model, _Outer, checkpoint="auto")
    calls = []
    for m in model.modules():
        if isinstance(m, _Inner):
            m.register_forward_pre_hook(lambda mod, args: calls.append(1))
    off = tiermem.Offloader(policy="auto", device_budget="5%", min_offload_bytes=0)
    x = torch.randn(256, 64, requires_grad=True)
    per_step = []
    for _ in range(4):
        calls.clear()
        with off:
            loss = model(x).square().mean()
        loss.backward()
        per_step.append(len(calls))
    plan = off.plan
    assert plan.blocks and not any(b.checkpoint for b in plan.blocks), str(plan)
    assert all("MUST_SAVE" in b.reason for b in plan.blocks), [b.reason for b in plan.blocks]
    assert per_step[1:] == [4, 4, 4], per_step
    off.close()
