"""torch.compile under every policy: compiled blocks (``torch.compile(block)``)
a compiled whole model and ``module.compile()`` (in place), backends eager, aot_eager and inductor, static and
dynamic shapes, a sequence length that changes at every step: three AdamW
steps bit-identical (losses, every gradient, the parameters after) to the same
compiled model without tiermem, and the tiers really used where compile
leaves saved tensors to see (NOTE [Compiled regions run without our modes] in
tracking/modestack.py: a compiled region's saved tensors go to a storage tier,
the eager ops around it may be recomputed).

The default run has a slice; the full cross product is ``slow``. Each run
compiles afresh (``torch._dynamo.reset()``).
"""

import contextlib
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from helpers import moved_count, offloader

POLICIES = ("keep", "cpu", "nvme", "recompute", "recompute,nvme", "auto")
BACKENDS = ("eager", "aot_eager", "inductor")
TARGETS = ("blocks", "model")
DYNAMIC = (False, True, None)   # None: Dynamo's default (dynamic after a shape changes)
LENGTHS = (8, 12, 16)


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """An eager stem (recomputable ops), two blocks, a head."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(target, backend, dynamic, ctx_of, steps=3):
    """``steps`` AdamW steps of a fresh Net compiled afresh; per step (loss,
    grads, params after), and the graphs Dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = Net()
    if target == "blocks":
        for i, b in enumerate(net.blocks):
            net.blocks[i] = torch.compile(b, backend=backend, dynamic=dynamic)
        fn = net
    elif target == "in place":   # module.compile(): no boundary tiermem sees
        for b in net.blocks:
            b.compile(backend=backend, dynamic=dynamic)
        fn = net
    else:
        fn = torch.compile(net, backend=backend, dynamic=dynamic)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    out = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        x = torch.randn(2, LENGTHS[i % len(LENGTHS)], 32)
        with ctx_of():
            loss = fn(x).square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
        out.append((loss.detach(), grads, [p.detach().clone() for p in net.parameters()]))
    return out, counters["stats"]["unique_graphs"]


_refs: dict = {}


def _reference(target, backend, dynamic):
    key = (target, backend, dynamic)
    if key not in _refs:
        _refs.clear()   # one kept: the parametrization runs a configuration's policies in a row
        _refs[key] = _train(target, backend, dynamic, contextlib.nullcontext)
    return _refs[key]


def _check(target, backend, dynamic, policy, nvme_dir):
    ref, ref_graphs = _reference(target, backend, dynamic)
    settings = {"nvme_dir": nvme_dir} if "nvme" in policy or policy == "auto" else {}
    if policy == "auto":
        settings["device_budget"] = "25%"
    off = offloader(policy, **settings)
    used = {"moved": 0, "recompute": 0}

    @contextlib.contextmanager
    def step():
        with off:
            yield
        used["moved"] += moved_count(off.stats)
        used["recompute"] += off.stats.count_by_tier["recompute"]
    try:
        got, graphs = _train(target, backend, dynamic, step)
    finally:
        off.close()
    what = f"{target} {backend} dynamic={dynamic} {policy}"
    if target == "in place":   # under tracking modes Dynamo runs it eagerly (docs/compile.md)
        assert ref_graphs > 0
    else:
        assert graphs == ref_graphs > 0, f"{what}: {graphs} graphs, {ref_graphs} without tiermem"
    for k, ((gl, gg, gp), (rl, rg, rp)) in enumerate(zip(got, ref)):
        assert torch.equal(gl, rl), f"{what}, step {k}: loss {gl} != {rl}"
        for i, (a, b) in enumerate(zip(gg, rg)):
            assert torch.equal(a, b), f"{what}, step {k}: gradient {i} differs"
        for i, (a, b) in enumerate(zip(gp, rp)):
            assert torch.equal(a, b), f"{what}, step {k}: parameter {i} differs"
    if policy == "keep":
        assert used["moved"] == 0
    elif target == "in place":
        pass
    elif policy in ("cpu", "nvme") or (policy == "recompute,nvme" and target == "model"):
        assert used["moved"] > 0, f"{what}: nothing moved"
    elif target == "blocks" or policy == "auto":
        # The eager stem's tensors are recomputable; auto moves or recomputes.
        assert used["recompute" if policy != "auto" else "moved"] > 0, f"{what}: {used}"
    assert torch._C._len_torch_function_stack() == 0
    assert torch._C._len_torch_dispatch_stack() == 0


#: The default run's slice: every policy but cpu and keep once, both targets,
#: static and dynamic shapes; inductor (a cold compile: about 25 s) only slow,
#: and there with static shapes only (dynamic ones are the same hooks and
#: tiers through the same compiled-region path, at twice the CI time).
SLICE = [
    ("blocks", "aot_eager", None, "auto"),
    ("blocks", "aot_eager", None, "recompute,nvme"),
    ("blocks", "eager", True, "recompute"),
    ("model", "eager", True, "auto"),
    ("model", "aot_eager", False, "nvme"),
    ("in place", "eager", True, "auto"),
]


@pytest.mark.parametrize("target,backend,dynamic,policy", SLICE)
def test_compiled_training_is_exact(target, backend, dynamic, policy, nvme_dir):
    _check(target, backend, dynamic, policy, nvme_dir)


@pytest.mark.slow
@pytest.mark.parametrize("target,backend,dynamic,policy",
                         [c for c in itertools.product(TARGETS, BACKENDS, DYNAMIC[:2], POLICIES)
                          if c not in SLICE and not (c[1] == "inductor" and c[2])])
def test_compiled_training_is_exact_everywhere(target, backend, dynamic, policy, nvme_dir):
    _check(target, backend, dynamic, policy, nvme_dir)


class Attention(nn.Module):
    """qkv in one matmul, split and permuted: the compiled forward saves
    views of q, k and v whose strides skip the other two (span 3x numel)."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_inductor_backward_gets_the_saved_strides(policy, nvme_dir):
    """Inductor's compiled backward asserts the strides of what its forward
    saved: a moved view restored dense (NOTE [Layout of a moved tensor] in
    tiers/base.py) failed there (AssertionError in assert_size_stride)."""
    def steps(ctx_of):
        torch._dynamo.reset()
        torch.manual_seed(0)
        att = Attention()
        fn = torch.compile(att, backend="inductor", dynamic=False)
        out = []
        for i in range(2):
            torch.manual_seed(i)
            with ctx_of():
                loss = fn(torch.randn(2, 16, 32)).square().mean()
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in att.parameters()]))
            att.zero_grad()
        return out
    ref = steps(contextlib.nullcontext)
    off = offloader(policy, **({"nvme_dir": nvme_dir} if policy == "nvme" else {}))
    try:
        got = steps(lambda: off)
        assert moved_count(off.stats) > 0
    finally:
        off.close()
    for (gl, gg), (rl, rg) in zip(got, ref):
        assert torch.equal(gl, rl)
        assert all(torch.equal(a, b) for a, b in zip(gg, rg))
