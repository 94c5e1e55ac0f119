"""Scoped producer tracking (NOTE [Scoped tracking] in tiermem/tracking/modules.py):
a step that follows an auto plan tracks producers only while the innermost
running module is one that ran its recipes' ops in the profile, and a
wrapped block whose policy recomputes only while it runs; gradients stay bit-identical to a run without tiermem,
also when a recipe's chain reaches a tensor made outside the scope (stored
as a recipe input, or the next tier), and ops outside the scope are never
dispatched to the mode.

Runtime: ~15 s on 2 shared cores (measured 2026-12-01).
"""

import collections
import contextlib

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy as C

import tiermem
import tiermem.offloader
from helpers import compare_records, offloader, reference_steps, train_steps
from models import make_case
from tiermem.tracking.producers import CallRecorder, ProducerMode
from tiermem.tracking.modules import ModuleStack, current_module


class _Seen(ProducerMode):
    """ProducerMode that notes the running module of every op dispatched to it
    (class attribute ``ops``: a list of module names, reset per test)."""

    ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        type(self).ops.append(current_module())
        return super().__torch_dispatch__(func, types, args, kwargs)


class _ModuleOfEachOp(torch.utils._python_dispatch.TorchDispatchMode):
    """The reference: the running module of every op of a plain forward."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(current_module())
        return func(*args, **(kwargs or {}))


@pytest.fixture
def seen(monkeypatch):
    monkeypatch.setattr(_Seen, "ops", [])
    with tiermem.testing.step_producer_mode(_Seen):
        yield _Seen


@pytest.mark.parametrize("name", ["mlp", "block", "embed_gather", "block_bf16"])
def test_plan_that_recomputes_tracks_only_its_recipe_modules_and_is_exact(name):
    """At 25% (no nvme_dir: only recompute frees RAM) the plan recomputes a
    part of the model; its steps scope tracking to the modules its profile saw
    running the recipes' ops, keep the kept bytes it predicted, and train
    exactly as without tiermem."""
    off = offloader("auto", device_budget="25%")
    case = make_case(name)
    contexts = []

    def ctx():
        contexts.append(off)
        return off

    records = train_steps(case, ctx, steps=4)
    compare_records(records, reference_steps(name, steps=4), name)
    plan = off.plan
    assert plan.recomputes
    scope = plan.tracking_scope
    assert scope, f"{name}: the plan recomputes, so it names modules to track"
    every = {m for m, _ in case.model.named_modules()}
    root = type(case.model).__name__
    assert all(s.startswith(root + ".") and s[len(root) + 1:] in every
               for s in scope - {""}), scope
    # block_bf16's loss casts to float32 after the model (outside every
    # module, ``""``); that cast is recomputed, so it is in the scope.
    assert ("" in scope) is (name == "block_bf16"), scope
    assert off.stats.count_by_tier["recompute"] > 0
    assert plan.measured_kept_bytes == plan.predicted_kept_bytes
    off.close()


class _ModuleAndCallOfEachOp(torch.utils._python_dispatch.TorchDispatchMode):
    """The reference: (running module, running torch call) of every op of a
    plain forward (``call`` kept by a :class:`~tiermem.tracking.producers.CallRecorder`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []
        self.call = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((current_module(), self.call))
        return func(*args, **(kwargs or {}))


def test_ops_outside_the_scope_are_not_dispatched_to_the_mode(seen):
    """Count dispatches: a step following the plan hands the mode the ops
    whose innermost module is in the scope and, with the plan's calls (NOTE
    [Tracking inside torch calls]), only those run inside the torch calls it
    names there: every one a plain forward runs there, and no op of another
    module. Without the calls, every op of the scope: more."""
    off = offloader("auto", device_budget="25%")
    case = make_case("block")
    for _ in range(2):   # profile, then plan
        with off:
            loss = case.loss()
        loss.backward()
    plan = off.plan
    scope = plan.tracking_scope
    calls = plan.tracking_calls
    assert calls and set(calls) == set(scope), (calls, scope)
    assert all(c for c in calls.values()), calls   # every recipe op ran inside a named call
    ref = _ModuleAndCallOfEachOp()
    # Under saved-tensor hooks, as a step runs (without any, autograd runs a
    # detach of its own when it saves an op's output).
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with ModuleStack(), ref, CallRecorder(ref):
            case.loss()
    in_scope = collections.Counter(m for m, _ in ref.ops if m in scope)
    assert 0 < sum(in_scope.values()) < len(ref.ops)
    in_calls = collections.Counter(m for m, c in ref.ops
                                   if m in scope and c in (calls.get(m) or ()))
    assert 0 < sum(in_calls.values()) < sum(in_scope.values()), (in_calls, in_scope)
    # The calls recorded whole (NOTE [Calls recorded whole] in tracking/producers.py)
    # do not reach the mode at all.
    direct = plan.tracking_direct
    assert direct, "the block's GELU ran one op: recorded whole"
    in_mode = collections.Counter(m for m, c in ref.ops if m in scope
                                  and c in (calls.get(m) or ()) and c not in direct.get(m, {}))
    assert sum(in_mode.values()) < sum(in_calls.values()), (in_mode, in_calls)
    got = {}
    for by_call, expected in (("direct", in_mode), (True, in_calls), (False, in_scope)):
        plan.tracking_calls = calls if by_call else None
        plan.tracking_direct = direct if by_call == "direct" else None
        seen.ops = []
        with off:
            loss = case.loss()
        assert seen.ops and set(seen.ops) <= scope, set(seen.ops) - scope
        # Every op the model runs in the scope (in its calls), and none of the
        # pack hook's own (NOTE [The pack hook runs untracked] in tracking/dispatch.py).
        got[by_call] = collections.Counter(seen.ops)
        assert got[by_call] == expected, (got, expected)
        loss.backward()
        assert off.stats.count_by_tier["recompute"] > 0
    # The calls not named ran untracked: fewer dispatches, none more.
    assert all(got[True][m] <= n for m, n in got[False].items()), got
    assert sum(got[True].values()) < sum(got[False].values()), got
    assert sum(got["direct"].values()) < sum(got[True].values()), got
    off.close()


def test_a_plan_that_recomputes_nothing_tracks_nothing(seen):
    off = offloader("auto", device_budget="100%")
    case = make_case("block")
    for _ in range(3):
        seen.ops = []
        with off:
            loss = case.loss()
        loss.backward()
    assert not off.plan.recomputes and off.plan.tracking_scope == frozenset()
    assert seen.ops == []
    off.close()


class _Chain(nn.Module):
    """``u = -sigmoid(lin(x))`` made outside the block; inside, the block
    saves ``v = cat([u, u])`` (by ``sin``). Tracked everywhere, ``v``'s recipe
    reaches back through ``u``'s (to the saved sigmoid output, no bytes);
    tracked in the block only, ``u`` has no record: the recipe stores ``u``
    (half of ``v``'s bytes), which the forward then modifies in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.block = _Cat()

    def forward(self, x):
        u = torch.neg(torch.sigmoid(self.lin(x)))
        out = self.block(u)
        u.mul_(2.0)   # after the save: the stored input is a copy of u as it was
        return out + u.sum()


class _Cat(nn.Module):
    def forward(self, u):
        return torch.cat([u, u], dim=1).sin()


def _chain_step(ctx, wrap):
    torch.manual_seed(0)
    model = _Chain()
    w = tiermem.wrap_blocks(model, _Cat, checkpoint=False, policy=wrap) if wrap else None
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    try:
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
    finally:
        if w is not None:
            w.unwrap()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["x"] = x.grad.clone()
    return loss.detach(), grads


def test_a_recipe_reaching_a_tensor_made_outside_the_scope_stores_it_and_stays_exact(seen):
    ref = _chain_step(contextlib.nullcontext(), None)
    off = offloader("keep")
    got = _chain_step(off, "recompute")
    assert torch.equal(got[0], ref[0])
    for n in ref[1]:
        assert torch.equal(got[1][n], ref[1][n]), n
    s = off.stats
    assert s.count_by_tier["recompute"] == 1, s.count_by_tier
    assert s.recompute_input_bytes == 8 * 16 * 4, "u is stored for the recipe"
    assert seen.ops and all(m == "_Chain.block" for m in seen.ops), set(seen.ops)
    # Tracked everywhere (a fixed recompute policy), the chain needs no bytes.
    off2 = offloader("recompute,keep")
    got2 = _chain_step(off2, None)
    assert torch.equal(got2[0], ref[0])
    assert all(torch.equal(got2[1][n], ref[1][n]) for n in ref[1])
    assert off2.stats.recompute_input_bytes == 0
    off.close()
    off2.close()


def test_an_input_gone_outside_the_scope_goes_to_the_next_tier():
    """The block saves ``v = cat([u, u])`` whose ``u`` was made outside the
    block and modified in place before the save: no record, no usable input,
    so ``v`` is not recomputed (``recompute_fallbacks``) and goes to cpu."""

    class Block(nn.Module):
        def forward(self, u):
            v = torch.cat([u, u], dim=1)
            u.mul_(2.0)
            return v.sin()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.block = Block()

        def forward(self, x):
            return self.block(torch.sigmoid(self.lin(x)) * 3.0)

    def step(ctx, wrap):
        torch.manual_seed(0)
        model = Net()
        w = tiermem.wrap_blocks(model, Block, checkpoint=False, policy=wrap) if wrap else None
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
        if w is not None:
            w.unwrap()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref = step(contextlib.nullcontext(), None)
    off = offloader("keep")
    got = step(off, ["recompute", "cpu"])
    assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    assert off.stats.count_by_tier["recompute"] == 0
    assert off.stats.count_by_tier["cpu"] == 1
    assert off.stats.recompute_fallbacks == 1
    off.close()


def test_a_scoped_module_that_raises_leaves_the_mode():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.boom = Boom()

        def forward(self, x):
            return self.boom(torch.relu(x))

    model = Net()
    w = tiermem.wrap_blocks(model, Boom, checkpoint=False, policy="recompute")
    off = offloader("keep")
    with pytest.raises(RuntimeError, match="boom"):
        with off:
            model(torch.randn(4, 4, requires_grad=True))
    assert torch._C._len_torch_dispatch_stack() == 0
    w.unwrap()
    off.close()


def test_must_recompute_blocks_keep_whole_forward_tracking(seen):
    """With MUST_RECOMPUTE, whether a tensor can be recomputed (else
    TierMemError) must not depend on where its producer ran: tracking
    covers the whole forward, as before scoping."""
    ref = _chain_step(contextlib.nullcontext(), None)
    off = offloader("keep")
    got = _chain_step(off, C.MUST_RECOMPUTE)
    assert torch.equal(got[0], ref[0])
    assert all(torch.equal(got[1][n], ref[1][n]) for n in ref[1])
    assert off.stats.count_by_tier["recompute"] == 1
    assert "_Chain" in seen.ops and "_Chain.lin" in seen.ops and "_Chain.block" in seen.ops
    off.close()


def test_the_context_says_how_it_tracks():
    """``OffloadContext.tracking``: None for whole-forward tracking (a fixed
    recompute policy) and for none (keep); a TrackingScope naming the block
    for a wrapped block whose policy recomputes."""
    model = _Chain()
    for policy, tracks in (("recompute", True), ("keep", False)):
        off = offloader(policy)
        with off as ctx:
            assert ctx.tracking is None and (ctx.producers is not None) is tracks
            model(torch.randn(8, 16))
        off.close()
    w = tiermem.wrap_blocks(model, _Cat, checkpoint=False, policy="recompute,cpu")
    off = offloader("keep")
    with off as ctx:
        assert ctx.tracking is not None and ctx.tracking.blocks and not ctx.tracking.names
        model(torch.randn(8, 16))
        assert ctx.tracking.entries == 1 and not ctx.tracking.active
    w.unwrap()
    off.close()


def test_an_auto_offloader_with_hints_tracks_the_whole_forward():
    """Its hints callable may read ``TensorInfo.op`` in any step that leaves
    its plan, so every op is recorded even in steps of a recomputing plan."""
    off = offloader("auto", device_budget="25%", hints=lambda info: None)
    case = make_case("mlp")
    for _ in range(3):
        with off as ctx:
            loss = case.loss()
        loss.backward()
    assert off.plan.recomputes and off.plan.tracking_scope
    assert ctx.tracking is None and off.stats.count_by_tier["recompute"] > 0
    off.close()


class _UserFunctionMode(torch.overrides.TorchFunctionMode):
    """A mode of the user's, entered inside a module's forward: counts the calls it sees."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class _UserDispatchMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("user_mode", [_UserFunctionMode, _UserDispatchMode])
@pytest.mark.parametrize("tracked_by", ["mode", "gate_parent", "gate_child"])
@pytest.mark.parametrize("parent_in_scope", [True, False])
def test_a_user_mode_entered_inside_a_module_keeps_its_nesting(user_mode, tracked_by,
                                                                parent_in_scope):
    """The scope enters and leaves its mode (or gate) at module boundaries,
    also inside a ``with`` of the user's own mode in a module's forward: the
    user's mode sees nothing after its block ends (ours never sits above it
    when it exits, else its exit would pop ours and leave it on), and the
    stacks are empty after the step."""

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = nn.Linear(4, 4)
            self.user = user_mode()
            self.after = None

        def forward(self, x):
            with self.user:
                y = self.child(x)
            seen = self.user.n
            z = torch.relu(y) * 2
            self.after = self.user.n - seen
            return z

    model = Parent()
    names = {"Parent.child"} | ({"Parent"} if parent_in_scope else set())
    calls = {"mode": None,
             "gate_parent": {"Parent": frozenset({"relu", "mul"}), "Parent.child": None},
             "gate_child": {"Parent": None, "Parent.child": frozenset({"linear"})}}[tracked_by]
    mode = _Seen(names=False)
    _Seen.ops = []
    with ModuleStack(scope=tiermem.tracking.modules.TrackingScope(mode, names, calls=calls)):
        model(torch.randn(2, 4))
    assert model.user.n > 0
    assert model.after == 0
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._len_torch_function_stack() == 0
    if not (parent_in_scope and tracked_by == "gate_parent" and user_mode is _UserFunctionMode):
        assert "Parent.child" in _Seen.ops   # the child's linear ran under ours
    # (else the parent's gate, under the user's function mode, cannot be left
    # at the child's start: it stays, and the child runs untracked, its
    # tensors without recipes: NOTE [Scoped tracking])
    if parent_in_scope:   # and ours is on again after the user's block: relu and mul
        assert _Seen.ops.count("Parent") >= 2, _Seen.ops
    else:
        assert "Parent" not in _Seen.ops
