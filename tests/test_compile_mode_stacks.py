"""tiermem's modes and module hooks around compiled modules: never left on
torch's mode stacks (after normal steps, after a step that raised inside a
compiled module, after ``close()``), never making Dynamo recompile (NOTE
[Compiled regions run without our modes] in tracking/modestack.py, NOTE
[Hooks held between steps] in tracking/modules.py).

Issue 31: a compiled block under ``policy="auto"`` crashed at step 2 with
aot_eager ("trying to pop from empty mode stack") and left a CallGate on the
torch-function mode stack after ``close()``; with ``backend="eager"`` and a
changing sequence length Dynamo failed on fake tensors; every step
recompiled every compiled module.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.modules import module as nn_module

from helpers import offloader


def _stacks():
    """The torch-function and dispatch mode stacks, innermost last."""
    return ([torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())],
            [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())])


def _global_hooks() -> int:
    return (len(nn_module._global_forward_pre_hooks) + len(nn_module._global_forward_hooks))


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, backend: str, dynamic=None) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.blocks = nn.ModuleList(
            [torch.compile(Block(), backend=backend, dynamic=dynamic) for _ in range(2)])

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend,dynamic", [("aot_eager", None), ("eager", True)])
def test_auto_with_compiled_blocks_leaves_no_mode(backend, dynamic):
    """Four auto steps (a profile, then plans), the length changing: they
    run, and no mode of any kind is on a stack between steps or after
    ``close()``; the module hooks are gone after ``close()``."""
    torch.manual_seed(0)
    net = Net(backend, dynamic)
    hooks_before = _global_hooks()
    off = offloader("auto", device_budget="25%")
    for i in range(4):
        with off:
            loss = net(torch.randn(2, 8 + 4 * i, 32))
        assert _stacks() == ([], []), f"step {i}: modes left on the stacks: {_stacks()}"
        loss.backward()
    off.close()
    assert _stacks() == ([], [])
    assert _global_hooks() == hooks_before, "module hooks left installed after close()"


@pytest.mark.parametrize("policy", ["auto", "recompute", "cpu"])
def test_a_step_that_raised_inside_a_compiled_module_leaves_no_mode(policy):
    """A compiled block raises (a width it cannot take) in the third step, a
    planned one under auto: the context's exit leaves no mode, the next step
    runs, and ``close()`` leaves none either."""
    torch.manual_seed(0)
    net = Net("aot_eager")
    off = offloader(policy, device_budget="25%") if policy == "auto" else offloader(policy)
    for i in range(2):
        with off:
            loss = net(torch.randn(2, 8, 32))
        loss.backward()
    with pytest.raises(Exception):
        with off:
            x = net.stem(torch.randn(2, 8, 32))
            net.blocks[0](x[..., :31])   # fc1 takes 32 features
    assert _stacks() == ([], []), f"modes left after a step that raised: {_stacks()}"
    with off:
        loss = net(torch.randn(2, 8, 32))
    loss.backward()
    off.close()
    assert _stacks() == ([], [])


def test_steps_under_an_offloader_do_not_recompile():
    """Five steps of one shape: one graph per compiled code, as without
    tiermem (the hooks' dictionary keys, guarded by Dynamo, stay the same)."""
    torch.manual_seed(0)
    net = Net("eager")
    off = offloader("cpu")
    counters.clear()
    for _ in range(5):
        with off:
            loss = net(torch.randn(2, 8, 32))
        loss.backward()
    off.close()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
