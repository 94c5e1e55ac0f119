"""tiermem around a torch.compile'd model: the hooks run eagerly when the
compiled function saves its tensors (NOTE [Hooks under torch.compile]), and
gradients stay bit-identical to the compiled model without tiermem.

Each test compiles afresh (``torch._dynamo.reset()``) once under tiermem and
once for the reference: no loop of recompiles under one Offloader (issue 14:
those can crash intermittently inside Dynamo).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import tiermem
from helpers import assert_same_step, moved_count

POLICIES = ["keep", "cpu", "recompute,cpu", None]


def _compiled_step(params, fn_of_x, x, ctx):
    """Compile ``fn_of_x`` afresh, run it under ``ctx`` (tracing happens with
    its hooks active) and backward outside; ``(loss, [grads of params])``."""
    torch._dynamo.reset()
    fn = torch.compile(fn_of_x, backend="aot_eager")
    for p in params:
        p.grad = None
    with ctx:
        loss = fn(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_function_under_an_offloader(policy):
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 128), torch.nn.Linear(128, 8)
    params = [*lin1.parameters(), *lin2.parameters()]
    x = torch.randn(32, 64)

    def f(x):
        return lin2(F.gelu(lin1(x))).square().mean()

    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    got = _compiled_step(params, f, x, off)
    # The reference: the same compiled function with identity hooks (traced the
    # same way, with saved-tensor hooks active).
    ref = _compiled_step(params, f, x,
                         torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    assert_same_step(got, ref, f"compiled, policy {policy}")
    if policy in ("cpu", "recompute,cpu"):
        assert off.stats.count_by_tier["cpu"] > 0   # the compiled graph's saved tensors moved
    off.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_no_offload_inside_compiled_region_context(policy):
    """``tiermem.no_offload()`` inside an Offloader around a compiled function:
    nothing is moved, and the gradients are those of the same compiled
    function run without tiermem."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    params = list(lin.parameters())
    x = torch.randn(4, 16)

    def f(x):
        return lin(x).relu().sum()

    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)

    @contextlib.contextmanager
    def quiet():
        with off, tiermem.no_offload():
            yield
    got = _compiled_step(params, f, x, quiet())
    ref = _compiled_step(params, f, x, contextlib.nullcontext())
    assert_same_step(got, ref, f"no_offload, policy {policy}")
    assert moved_count(off.stats) == 0, off.stats
    off.close()


def _recompile_loop(ctx_of):
    """Six freshly compiled models, three shapes each, every step under the
    context ``ctx_of()``: ``[(loss, [grads])]``."""
    out = []
    torch._dynamo.reset()
    for i in range(6):
        torch.manual_seed(i)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                    torch.nn.Linear(128, 8))
        fn = torch.compile(model, backend="aot_eager")
        for j in range(3):
            x = torch.randn(8 + i + j, 64)
            with ctx_of():
                loss = fn(x).square().mean()
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad()
    return out


@pytest.mark.parametrize("policy", ["keep", "cpu"])
def test_recompiles_under_one_offloader_stay_exact(policy):
    """Issue 14 #8: the module tracker's global forward hooks, traced by
    Dynamo, broke recompiles under an Offloader ("already tracked for
    mutation" from the 5th compile). NOTE [Tracker under torch.compile]."""
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    got = _recompile_loop(lambda: off)
    ref = _recompile_loop(lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                          lambda t: t))
    assert len(got) == len(ref) == 18
    for k, (g, r) in enumerate(zip(got, ref)):
        assert_same_step(g, r, f"compile loop step {k}, policy {policy}")
    off.close()


@pytest.mark.parametrize("policy", ["recompute", "recompute,cpu"])
def test_a_compiled_function_with_a_graph_break_under_tracking(policy):
    """Producer tracking's dispatch handler is hidden from Dynamo (NOTE [The
    handler hidden from Dynamo] in tracking/producers.py): a compiled function
    with a graph break, run inside a step that tracks, neither has the handler
    traced (a TorchRuntimeError from a fake-tensor call when it is not hidden)
    nor changes a gradient."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 128), torch.nn.Linear(128, 8)
    params = [*lin1.parameters(), *lin2.parameters()]
    x = torch.randn(32, 64)

    def f(x):
        h = F.gelu(lin1(x))
        torch._dynamo.graph_break()
        return lin2(h).square().mean()

    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    got = _compiled_step(params, f, x, off)
    ref = _compiled_step(params, f, x,
                         torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    assert_same_step(got, ref, f"compiled with a graph break, policy {policy}")
    assert off.stats.count_by_tier["recompute"] > 0   # tracked: a tensor was dropped
    off.close()
