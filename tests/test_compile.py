"""tiermem around a torch.compile'd model: the hooks run eagerly when the
compiled function saves its tensors (NOTE [Hooks under torch.compile]), and
gradients stay bit-identical to the compiled model without tiermem."""

import pytest
import torch
import torch.nn.functional as F

import tiermem


@pytest.mark.parametrize("policy", ["keep", "cpu", "recompute,cpu", None])
def test_compiled_function_under_an_offloader(policy):
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 128), torch.nn.Linear(128, 8)
    x = torch.randn(32, 64)

    def grads(ctx):
        # Compiled afresh under ``ctx``: tracing happens with its hooks active.
        torch._dynamo.reset()
        fn = torch.compile(lambda x: lin2(F.gelu(lin1(x))).square().mean(),
                           backend="aot_eager")
        for p in (*lin1.parameters(), *lin2.parameters()):
            p.grad = None
        with ctx:
            loss = fn(x)
        loss.backward()
        return [p.grad.clone() for p in (*lin1.parameters(), *lin2.parameters())]

    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    got = grads(off)
    ref = grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    if policy in ("cpu", "recompute,cpu"):
        assert off.stats.count_by_tier["cpu"] > 0   # the compiled graph's saved tensors moved


def test_no_offload_inside_compiled_region_context():
    torch._dynamo.reset()
    lin = torch.nn.Linear(16, 16)
    fn = torch.compile(lambda x: lin(x).relu().sum(), backend="aot_eager")
    with tiermem.Offloader(policy="cpu", min_offload_bytes=0), tiermem.no_offload():
        loss = fn(torch.randn(4, 16))
    loss.backward()
    assert lin.weight.grad is not None
