"""tiermem combined with PyTorch's activation checkpointing.

Checkpoint variants (each wraps sub-modules of a model from ``models.py``):

- ``checkpoint``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``;
- ``reentrant``: ``checkpoint(use_reentrant=True)``;
- ``sac``: selective activation checkpointing, ``context_fn`` from
  ``create_selective_checkpoint_contexts`` with a policy that saves matmuls
  (``aten.mm/addmm/bmm``: MUST_SAVE) and recomputes everything else;
- ``sequential`` / ``sequential_reentrant``: ``checkpoint_sequential`` with two
  segments on the ``mlp`` case (an ``nn.Sequential``): the first segment is
  checkpointed, the rest runs plainly, so checkpointed and tiermem-managed
  tensors mix.

Models: ``block`` (the transformer block with dropout, both sublayers
checkpointed), ``block_attn`` (only its attention sublayer checkpointed, the
MLP sublayer saves its tensors through tiermem, so the recompute tier has
tensors it can drop next to a checkpoint) and ``mlp`` (its middle Linear/Tanh
pair checkpointed: the checkpoint's input is a GELU output that the recompute
tier drops and regenerates when the checkpoint unpacks it; or
``checkpoint_sequential``). The wrappers run the very ops of the plain model in
the same order, and checkpoint preserves the RNG state, so everything is
compared with ``torch.equal`` against two references: the same checkpointed
model without tiermem, and the plain model without checkpointing.

Tiers: the ``tier`` fixture (``keep``, ``cpu``, ``nvme`` (Python engine),
``recompute`` and ``recompute,cpu``), all with ``min_offload_bytes=0``
(``make_off``, see conftest.py).

What tiermem sees of a checkpointed region: only its boundary, the inputs the
checkpoint saves (``_NoopSaveInputs``/``SavedTensor`` for the non-reentrant
variants, ``ctx.save_for_backward`` for the reentrant one); the internals are
saved by the checkpoint's own (innermost) saved-tensor hooks, and what it
regenerates in backward is either under its hooks (non-reentrant) or saved
while autograd's engine runs (reentrant), which tiermem keeps as is.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

import tiermem
import tiermem.testing
from helpers import assert_same_tensors, compare_records
from models import make_case

STEPS = 3
_aten = torch.ops.aten
_MATMULS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default)


# ---------------------------------------------------------------------------
# Checkpoint variants and checkpointed models
# ---------------------------------------------------------------------------

def _sac_policy(ctx, op, *args, **kwargs):
    """Save matmul outputs, recompute the rest (the usual SAC recipe)."""
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


_SAC_CONTEXT = functools.partial(create_selective_checkpoint_contexts, _sac_policy)

#: variant -> function ``ck(fn, x)`` running ``fn(x)`` under that checkpoint.
_CHECKPOINTS = {
    "checkpoint": functools.partial(checkpoint, use_reentrant=False),
    "reentrant": functools.partial(checkpoint, use_reentrant=True),
    "sac": functools.partial(checkpoint, use_reentrant=False, context_fn=_SAC_CONTEXT),
}
_REENTRANT = {"reentrant", "sequential_reentrant"}


def _input_grad(model_name, variant) -> bool:
    """The reentrant checkpoint gives parameter gradients only if an input of the
    checkpointed region requires grad (its autograd.Function hides the
    parameters from the graph): where the model's input itself enters a
    reentrant checkpoint, the runs and their references use an input that
    requires grad (a leaf: kept like a parameter, never offloaded)."""
    if variant == "reentrant":
        return model_name != "mlp"   # mlp: the checkpoint's input is an activation
    return variant == "sequential_reentrant"


class CheckpointedBlock(nn.Module):
    """``models.Block`` with the sublayers in ``sublayers`` under ``ck``: the
    same ops as ``Block.forward``, in the same order."""

    def __init__(self, block: nn.Module, ck, sublayers=("attn", "mlp")) -> None:
        super().__init__()
        self.block, self.ck, self.sublayers = block, ck, sublayers

    def _attn(self, x):
        b = self.block
        return b.drop(b.attn(b.ln1(x)))

    def _mlp(self, x):
        b = self.block
        return b.drop(b.mlp(b.ln2(x)))

    def _run(self, name, fn, x):
        return self.ck(fn, x) if name in self.sublayers else fn(x)

    def forward(self, x):
        x = x + self._run("attn", self._attn, x)
        return x + self._run("mlp", self._mlp, x)


class CheckpointedMLP(nn.Module):
    """``models.MLP`` with its middle pair (Linear, Tanh) under ``ck``: the
    checkpoint's input is the GELU output, which the recompute tier can drop
    (regenerated from the Linear output that GELU saved)."""

    def __init__(self, mlp: nn.Sequential, ck) -> None:
        super().__init__()
        self.mlp, self.ck = mlp, ck

    def _middle(self, x):
        return self.mlp[3](self.mlp[2](x))

    def forward(self, x):
        m = self.mlp
        return m[4](self.ck(self._middle, m[1](m[0](x))))


class SequentialCheckpointed(nn.Module):
    """``checkpoint_sequential(mlp, 2, x)``: the first segment checkpointed."""

    def __init__(self, seq: nn.Sequential, use_reentrant: bool) -> None:
        super().__init__()
        self.seq, self.use_reentrant = seq, use_reentrant

    def forward(self, x):
        return checkpoint_sequential(self.seq, 2, x, use_reentrant=self.use_reentrant)


_BASE = {"block": "block", "block_attn": "block", "mlp": "mlp"}


def _wrap(model_name: str, variant, model: nn.Module) -> nn.Module:
    """``model`` (the plain one of ``make_case``) under checkpoint ``variant``;
    ``variant=None``: the plain model itself."""
    if variant is None:
        return model
    if variant.startswith("sequential"):
        assert model_name == "mlp"
        return SequentialCheckpointed(model, variant == "sequential_reentrant")
    if model_name == "mlp":
        return CheckpointedMLP(model, _CHECKPOINTS[variant])
    sublayers = ("attn",) if model_name == "block_attn" else ("attn", "mlp")
    return CheckpointedBlock(model, _CHECKPOINTS[variant], sublayers)


#: (model, variant) pairs: every variant on a model it suits.
COMBOS = [
    ("block", "checkpoint"), ("block", "reentrant"), ("block", "sac"),
    ("block_attn", "checkpoint"), ("block_attn", "reentrant"), ("block_attn", "sac"),
    ("mlp", "checkpoint"), ("mlp", "reentrant"), ("mlp", "sac"),
    ("mlp", "sequential"), ("mlp", "sequential_reentrant"),
]
COMBO_IDS = [f"{m}-{v}" for m, v in COMBOS]

#: Where the checkpoint's input (the GELU output) is dropped by the recompute tier.
_CKPT_INPUT_RECOMPUTED = {("mlp", "checkpoint"), ("mlp", "reentrant"), ("mlp", "sac")}

# ---------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------

class _Setup:
    """A fresh case (same init, inputs and seeds every time), wrapped."""

    def __init__(self, model_name: str, variant, input_grad=None) -> None:
        if input_grad is None:
            input_grad = _input_grad(model_name, variant)
        self.case = make_case(_BASE[model_name])
        self.model = _wrap(model_name, variant, self.case.model)
        self.x = self.case.inputs[0].detach().clone().requires_grad_(input_grad)
        # Named as in the plain model, whatever the wrapper.
        self.params = dict(self.case.model.named_parameters())

    def loss(self):
        return self.case.loss_fn(self.model(self.x))

    def grad_inputs(self):
        """What gradients are taken of: the parameters (and the input if it
        requires grad)."""
        return list(self.params.values()) + ([self.x] if self.x.requires_grad else [])

    def grads(self):
        grads = {n: p.grad.detach().clone() for n, p in self.params.items()}
        if self.x.requires_grad:
            grads["<input>"] = self.x.grad.detach().clone()
        return grads

    def zero_grad(self):
        for p in self.params.values():
            p.grad = None
        self.x.grad = None


def _train(model_name, variant, input_grad, ctx_factory, steps=STEPS, seed=10,
           backward_inside=False, on_step=None):
    """``steps`` AdamW steps, the forward of each under ``ctx_factory()``.

    ``backward_inside``: the backward runs inside the context too (with
    ``torch.autograd.grad`` where the variant allows it, else ``backward()``).
    ``on_step(phase)`` is called with ``"forward"`` after the forward and
    ``"backward"`` after the backward (inside the context when
    ``backward_inside``). Returns ``[(loss, grads, params after the step)]``.
    """
    s = _Setup(model_name, variant, input_grad)
    opt = torch.optim.AdamW(s.params.values(), lr=1e-2)
    records = []
    for i in range(steps):
        s.zero_grad()
        torch.manual_seed(seed + i)
        with ctx_factory():
            loss = s.loss()
            if on_step:
                on_step("forward")
            if backward_inside:
                _backward(s, loss, variant)
                if on_step:
                    on_step("backward")
        if not backward_inside:
            loss.backward()
            if on_step:
                on_step("backward")
        grads = s.grads()
        opt.step()
        params = {n: p.detach().clone() for n, p in s.params.items()}
        records.append((loss.detach().clone(), grads, params))
    return records


def _backward(s: _Setup, loss, variant):
    if variant in _REENTRANT:
        loss.backward()    # the reentrant checkpoint does not support autograd.grad
        return
    inputs = s.grad_inputs()
    for t, g in zip(inputs, torch.autograd.grad(loss, inputs)):
        t.grad = g


@functools.lru_cache(maxsize=None)
def _reference(model_name, variant, input_grad):
    """Training records without tiermem (cached: the tests never modify them)."""
    return _train(model_name, variant, input_grad, contextlib.nullcontext)


def _offloaded_counts(stats):
    return {t: stats.count_by_tier[t] for t in ("cpu", "nvme", "recompute")}


# ---------------------------------------------------------------------------
# 1. Exact gradients, every variant x every tier
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_name,variant", COMBOS, ids=COMBO_IDS)
def test_checkpointed_reference_equals_plain_model(model_name, variant):
    """The premise of the other tests: the checkpointed model without tiermem is
    bit-identical to the plain model (same ops, RNG state preserved)."""
    ig = _input_grad(model_name, variant)
    records = _reference(model_name, variant, ig)
    compare_records(records, _reference(model_name, None, ig), f"{model_name}/{variant} vs plain")
    # The steps changed the parameters: not a frozen model.
    first, last = records[0][2], records[-1][2]
    assert any(not torch.equal(first[n], last[n]) for n in first)


@pytest.mark.parametrize("model_name,variant", COMBOS, ids=COMBO_IDS)
def test_exact_gradients(model_name, variant, tier, make_off):
    policy = tier
    ig = _input_grad(model_name, variant)
    off = make_off(policy)
    seen = []
    records = _train(model_name, variant, ig, lambda: off,
                     on_step=lambda phase: phase == "backward" and seen.append(off.stats))
    what = f"{model_name}/{variant}/{policy}"
    compare_records(records, _reference(model_name, variant, ig),
                    what + " vs checkpoint without tiermem")
    compare_records(records, _reference(model_name, None, ig), what + " vs plain model")

    assert len(seen) == STEPS
    for stats in seen:
        counts = stats.count_by_tier
        assert sum(counts.values()) > 0, "nothing went through tiermem"
        if policy == "keep":
            assert _offloaded_counts(stats) == {"cpu": 0, "nvme": 0, "recompute": 0}
        elif policy in ("cpu", "recompute,cpu"):
            assert counts["cpu"] > 0 and counts["nvme"] == 0, str(stats)
        elif policy == "nvme":
            assert counts["nvme"] > 0 and counts["cpu"] == 0, str(stats)
        elif policy == "recompute":
            assert counts["cpu"] == counts["nvme"] == 0, str(stats)
        if policy.startswith("recompute"):
            # Every tensor dropped in forward was regenerated in backward.
            assert stats.recompute_count >= counts["recompute"]
            if model_name == "block_attn" or (model_name, variant) in _CKPT_INPUT_RECOMPUTED:
                # block_attn: the plain MLP sublayer has tensors the tier can
                # drop; mlp: the checkpoint's own input is dropped, and
                # regenerated when the checkpoint asks for it in backward.
                assert counts["recompute"] > 0 and stats.recompute_count > 0, str(stats)


def test_sac_policy_saves_matmuls(make_off):
    """The SAC policy is not degenerate: matmuls are saved, other ops recomputed."""
    decisions = []

    def policy(ctx, op, *args, **kwargs):
        out = _sac_policy(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:
            decisions.append(out)
        return out

    s = _Setup("block", None, False)
    b = s.case.model
    ctx_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    with make_off("cpu"):
        out = checkpoint(lambda x: b.drop(b.mlp(b.ln2(x))), s.x, use_reentrant=False,
                         context_fn=ctx_fn)
    out.sum().backward()
    assert CheckpointPolicy.MUST_SAVE in decisions
    assert CheckpointPolicy.PREFER_RECOMPUTE in decisions


# ---------------------------------------------------------------------------
# 2. The checkpoint's boundary tensors go through tiermem's policy
# ---------------------------------------------------------------------------

def _recorded_forward(model_name, variant, answer="cpu"):
    """One forward + backward under a callable policy that records what it is
    asked; returns (infos, stats)."""
    infos = []

    def policy(info):
        infos.append(info)
        return answer

    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    s = _Setup(model_name, variant)
    torch.manual_seed(3)
    with off:
        loss = s.loss()
    loss.backward()
    off.close()
    return infos, off.stats


@pytest.mark.parametrize("variant", ["checkpoint", "reentrant", "sac"])
def test_boundary_tensors_go_through_policy(variant):
    plain_infos, plain_stats = _recorded_forward("block", None)
    infos, stats = _recorded_forward("block", variant)
    width_shape = (2, 16, 32)   # the block's input/output: (batch, seq, width)

    # Checkpointed: the policy saw only the boundary: the inputs of the
    # checkpointed sublayers (and the loss's input, saved outside any module),
    # all of the block's input shape. The reentrant run's input is a leaf that
    # requires grad: kept like a parameter, never asked about.
    boundary = [i for i in infos if i.module == "CheckpointedBlock"]
    expect = 1 if variant == "reentrant" else 2
    assert len(boundary) == expect, infos
    assert all(tuple(i.shape) == width_shape for i in infos), infos
    assert {i.module for i in infos} == {"CheckpointedBlock", ""}, infos
    # The second sublayer's input is the residual sum of the first.
    assert boundary[-1].op == "add"
    if variant != "reentrant":
        assert boundary[0].op is None    # the raw input: no recorded producer
    assert [i.index for i in infos] == list(range(len(infos)))
    # Tiermem stored them where the policy said.
    assert stats.count_by_tier["cpu"] == len(infos) > 0
    assert stats.bytes_by_tier["cpu"] == sum(i.nbytes for i in infos)

    # Without checkpointing the policy sees the internals too (attention and
    # MLP intermediates, dropout masks, ...), several times more tensors.
    assert len(plain_infos) >= 5 * len(infos), (len(plain_infos), len(infos))
    assert plain_stats.count_by_tier["cpu"] >= 5 * stats.count_by_tier["cpu"]
    inner = {tuple(i.shape) for i in plain_infos} - {width_shape}
    assert (2, 16, 128) in inner     # the MLP's hidden activation
    assert not inner & {tuple(i.shape) for i in infos}
    assert any(i.module.startswith("Block.") for i in plain_infos)


@pytest.mark.parametrize("reentrant", [False, True], ids=["sequential", "sequential_reentrant"])
def test_checkpoint_sequential_boundary_and_rest_go_through_policy(reentrant):
    """checkpoint_sequential(mlp, 2): the first segment (Linear, GELU) is
    hidden behind its input; the second segment runs plainly and its tensors
    reach the policy with their module names (under the wrapper's)."""
    variant = "sequential_reentrant" if reentrant else "sequential"
    infos, stats = _recorded_forward("mlp", variant)
    modules = [i.module for i in infos]
    prefix = "SequentialCheckpointed.seq."
    assert not {prefix + "0", prefix + "1"} & set(modules), modules
    # MLP.2 saves the GELU output (the first segment's output), MLP.3 (Tanh) its
    # output, which MLP.4 saves again (a dedup hit, not a second policy call).
    assert {prefix + "2", prefix + "3"} <= set(modules), modules
    assert stats.dedup_hits >= 1
    if not reentrant:   # the raw input, saved by the checkpoint of segment 1
        assert infos[0].module == "SequentialCheckpointed" and infos[0].op is None
        assert tuple(infos[0].shape) == (32, 24)
    assert stats.count_by_tier["cpu"] == len(infos)


# ---------------------------------------------------------------------------
# 3. What backward regenerates is not offloaded again
# ---------------------------------------------------------------------------

_FORWARD_FIELDS = ("bytes_by_tier", "count_by_tier", "dedup_hits", "param_count",
                   "small_count", "unsupported_count", "budget_fallbacks",
                   "recompute_fallbacks", "recompute_input_bytes")

_ANSWERS = {"cpu": "cpu", "nvme": "nvme", "recompute,cpu": ["recompute", "cpu"]}


def _forward_fields(stats):
    d = stats.as_dict()
    return {k: d[k] for k in _FORWARD_FIELDS}


@pytest.mark.parametrize("answer", list(_ANSWERS))
@pytest.mark.parametrize("model_name,variant", COMBOS, ids=COMBO_IDS)
def test_backward_does_not_consult_policy_or_change_stats(model_name, variant, answer,
                                                          make_off, nvme_dir):
    """Backward outside the context (what training does): the checkpoints'
    recomputation neither asks the policy nor adds to the step's stats."""
    calls = []

    def policy(info):
        calls.append(info)
        return _ANSWERS[answer]

    off = make_off(policy, nvme_dir=nvme_dir)
    snap = {}

    def on_step(phase):
        snap[phase] = (len(calls), _forward_fields(off.stats))
        if phase == "backward":
            assert snap["backward"] == snap["forward"], f"backward changed stats: {snap}"
            snap.clear()

    ig = _input_grad(model_name, variant)
    records = _train(model_name, variant, ig, lambda: off, steps=2, on_step=on_step)
    compare_records(records, _reference(model_name, variant, ig)[:2], f"{model_name}/{variant}")
    assert calls, "the policy was never asked"


@pytest.mark.parametrize("policy", ["cpu", "nvme", "recompute,cpu"])
@pytest.mark.parametrize("model_name,variant", COMBOS, ids=COMBO_IDS)
def test_backward_inside_context(model_name, variant, policy, make_off, nvme_dir):
    """Backward inside ``with off:`` (autograd.grad, or backward() for the
    reentrant variants): the tensors a reentrant checkpoint regenerates are
    saved while tiermem's hooks are active; they are kept on the device (the
    policy is not asked, nothing more is offloaded) and gradients stay exact."""
    calls = []

    def counting(info):
        calls.append(info)
        return policy.split(",")

    off = make_off(counting, nvme_dir=nvme_dir)
    snap = {}

    def on_step(phase):
        snap[phase] = (len(calls), _offloaded_counts(off.stats),
                       {t: off.stats.bytes_by_tier[t] for t in ("cpu", "nvme", "recompute")})
        if phase == "backward":
            assert snap["backward"] == snap["forward"], f"backward offloaded: {snap}"
            snap.clear()

    ig = _input_grad(model_name, variant)
    records = _train(model_name, variant, ig, lambda: off, steps=2, backward_inside=True,
                     on_step=on_step)
    what = f"{model_name}/{variant}/{policy} backward inside"
    compare_records(records, _reference(model_name, variant, ig)[:2], what)
    compare_records(records, _reference(model_name, None, ig)[:2], what + " vs plain")
    assert calls


# Saves made while backward runs (here: a reentrant checkpoint regenerating its
# region) are kept and are not part of the step's statistics.
def test_backward_inside_context_leaves_forward_stats_alone():
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    s = _Setup("block", "reentrant", True)
    torch.manual_seed(3)
    with off:
        loss = s.loss()
        before = _forward_fields(off.stats)
        loss.backward()
        after = _forward_fields(off.stats)
    off.close()
    assert before["count_by_tier"]["cpu"] > 0
    assert after == before


@pytest.mark.parametrize("variant", ["checkpoint", "reentrant", "sac"])
def test_offloader_inside_checkpointed_function(variant, make_off):
    """The other nesting: the context entered inside the checkpointed function.
    tiermem's hooks are then the innermost. Non-reentrant (and SAC): in forward
    tiermem stores the region's tensors itself and the checkpoint has nothing
    to recompute. Reentrant: the forward runs under no_grad (nothing saved) and
    the context is entered again while backward recomputes, where everything is
    kept: the policy is never asked. Gradients are exact either way."""
    calls = []
    off = make_off(lambda info: calls.append(info) or "cpu")
    s = _Setup("block", variant)
    b = s.case.model

    def region(x):
        with off:
            return b(x)

    torch.manual_seed(3)
    loss = s.case.loss_fn(_CHECKPOINTS[variant](region, s.x))
    asked = len(calls)
    stats = off.stats
    loss.backward()
    grads = s.grads()
    ref = _Setup("block", None, s.x.requires_grad)
    torch.manual_seed(3)
    ref.loss().backward()
    assert_same_tensors(grads, ref.grads(), f"offloader inside {variant}")
    if variant == "reentrant":
        assert asked == 0 and calls == []
        # The step's stats are those of the context entered during backward.
        assert off.stats is not stats
        assert _offloaded_counts(off.stats) == {"cpu": 0, "nvme": 0, "recompute": 0}
    else:
        assert asked > 5 and len(calls) == asked   # the region's internals, in forward only
        assert stats.count_by_tier["cpu"] == asked and off.stats is stats


# ---------------------------------------------------------------------------
# 4. Double backward (gradient penalty)
# ---------------------------------------------------------------------------

def _penalty_step(model_name, variant, ctx, grad_inside=False):
    """loss, first-order grads with their graph, penalty = sum of their squares,
    second-order grads (of the penalty). Returns cloned results."""
    s = _Setup(model_name, variant)
    inputs = s.grad_inputs()
    torch.manual_seed(7)
    with ctx:
        loss = s.loss()
        if grad_inside:
            g1 = torch.autograd.grad(loss, inputs, create_graph=True)
    if not grad_inside:
        g1 = torch.autograd.grad(loss, inputs, create_graph=True)
    penalty = sum(g.square().sum() for g in g1)
    g2 = torch.autograd.grad(penalty, inputs)
    names = list(s.params) + (["<input>"] if s.x.requires_grad else [])
    return (loss.detach().clone(), penalty.detach().clone(),
            {n: g.detach().clone() for n, g in zip(names, g1)},
            {n: g.clone() for n, g in zip(names, g2)})


def _expect_same(result, ref, what):
    loss, penalty, g1, g2 = result
    rloss, rpenalty, rg1, rg2 = ref
    assert torch.equal(loss, rloss), what
    assert torch.equal(penalty, rpenalty), what
    assert_same_tensors(g1, rg1, what + " first order")
    assert_same_tensors(g2, rg2, what + " second order")


# Double backward through a checkpoint: the non-reentrant variants support it;
# the reentrant checkpoint does not support autograd.grad at all, and selective
# activation checkpointing allows one backward per region. For those, torch must
# raise the same error with and without tiermem.
_DOUBLE_OK = {"checkpoint", "sequential"}
_DOUBLE_COMBOS = [("block", "checkpoint"), ("block", "reentrant"), ("block", "sac"),
                  ("mlp", "sequential"), ("mlp", "sequential_reentrant")]


@pytest.mark.parametrize("model_name,variant", _DOUBLE_COMBOS,
                         ids=[f"{m}-{v}" for m, v in _DOUBLE_COMBOS])
def test_double_backward(model_name, variant, tier, make_off):
    policy = tier
    off = make_off(policy)
    if variant not in _DOUBLE_OK:
        errors = []
        for ctx in (contextlib.nullcontext(), off):
            with pytest.raises(RuntimeError) as info:
                _penalty_step(model_name, variant, ctx)
            errors.append(str(info.value))
        assert errors[0] == errors[1]
        assert ("incompatible with .grad()" in errors[0]
                or "backward once" in errors[0]), errors[0]
        return
    ref = _penalty_step(model_name, variant, contextlib.nullcontext())
    plain = _penalty_step(model_name, None, contextlib.nullcontext())
    _expect_same(ref, plain, f"{model_name}/{variant} without tiermem vs plain")
    got = _penalty_step(model_name, variant, off)
    _expect_same(got, ref, f"{model_name}/{variant}/{policy}")
    assert any(g.abs().sum() > 0 for g in ref[3].values()), "no second-order signal"
    counts = off.stats.count_by_tier
    if policy in ("cpu", "nvme"):
        assert counts[policy] > 0


@pytest.mark.parametrize("policy", ["cpu", "nvme", "recompute,cpu"])
@pytest.mark.parametrize("model_name,variant", [("block", "checkpoint"), ("mlp", "sequential")])
def test_double_backward_first_grad_inside_context(model_name, variant, policy, make_off,
                                                   nvme_dir):
    """create_graph=True inside the context: the tensors the first backward saves
    for the second are kept (the policy is not asked for them)."""
    calls = []
    off = make_off(lambda info: calls.append(info) or policy.split(","), nvme_dir=nvme_dir)
    ref = _penalty_step(model_name, variant, contextlib.nullcontext())
    got = _penalty_step(model_name, variant, off, grad_inside=True)
    _expect_same(got, ref, f"{model_name}/{variant}/{policy} grad inside")
    asked = len(calls)
    # As many policy calls as a forward alone makes.
    calls.clear()
    off2 = make_off(lambda info: calls.append(info) or policy.split(","), nvme_dir=nvme_dir)
    s = _Setup(model_name, variant, False)
    torch.manual_seed(7)
    with off2:
        s.loss()
    assert asked == len(calls) > 0


# ---------------------------------------------------------------------------
# retain_graph: several backwards through one checkpointed graph
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["cpu", "nvme", "recompute,cpu"])
@pytest.mark.parametrize("model_name,variant", [("block", "checkpoint"), ("block", "reentrant"),
                                                ("block_attn", "checkpoint"),
                                                ("mlp", "sequential")])
def test_retain_graph_backwards_through_checkpoint(model_name, variant, policy, make_off):
    """Each backward re-runs the checkpoint and unpacks its inputs again."""
    def three_backwards(ctx):
        s = _Setup(model_name, variant)
        torch.manual_seed(5)
        with ctx:
            loss = s.loss()
        out = []
        for retain in (True, True, False):
            s.zero_grad()
            loss.backward(retain_graph=retain)
            out.append(s.grads())
        return out

    ref = three_backwards(contextlib.nullcontext())
    off = make_off(policy)
    got = three_backwards(off)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_same_tensors(g, r, f"backward {i}")
    assert_same_tensors(ref[0], ref[2], "reference backward 1 vs 3")


# ---------------------------------------------------------------------------
# 5. Memory really moves
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["checkpoint", "reentrant", "sac"])
def test_boundary_tensors_held_in_host_memory_until_backward(variant):
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    s = _Setup("block", variant)
    torch.manual_seed(3)
    with off:
        loss = s.loss()
    cpu_bytes = off.stats.bytes_by_tier["cpu"]
    assert cpu_bytes > 0
    assert off.host_bytes_in_use >= cpu_bytes
    loss.backward()
    grads = s.grads()
    del loss
    off.close()
    assert off.host_bytes_in_use == 0
    ref = _Setup("block", variant)
    torch.manual_seed(3)
    ref.loss().backward()
    assert_same_tensors(grads, ref.grads(), variant)


@pytest.mark.parametrize("variant", ["checkpoint", "reentrant", "sac"])
def test_boundary_tensors_held_on_disk_until_backward(variant, make_off):
    off = make_off("nvme")
    s = _Setup("block", variant)
    torch.manual_seed(3)
    with off:
        loss = s.loss()
    assert off.stats.bytes_by_tier["nvme"] > 0
    assert off.disk_bytes_in_use >= off.stats.bytes_by_tier["nvme"]
    # Let the writes land first, so that backward reads from the disk (see the
    # xfail test below for a backward that comes before its writes land).
    tiermem.testing.store_of(off, tiermem.Tier.NVME).drain()
    loss.backward()
    del loss
    assert off.stats.prefetch_hits + off.stats.prefetch_misses == off.stats.count_by_tier["nvme"]
    assert off.disk_bytes_in_use == 0
    off.close()
    assert off.disk_bytes_in_use == 0
    ref = _Setup("block", variant)
    torch.manual_seed(3)
    ref.loss().backward()
    assert_same_tensors(s.grads(), ref.grads(), variant)


@pytest.fixture
def held_writes():
    """Holds every chunk of the Python I/O engine until ``.set()`` (10 s at most)."""
    gate = threading.Event()
    with tiermem.testing.before_python_engine_chunks(lambda: gate.wait(10)):
        yield gate
        gate.set()


# Extents of handles released before their write landed are freed later (when
# the write is done); close() must give them back too, not leave them counted.
def test_nvme_extents_of_early_backward_given_back_at_close(held_writes, make_off):
    off = make_off("nvme")
    s = _Setup("block", "reentrant")
    torch.manual_seed(3)
    with off:
        loss = s.loss()
    assert off.stats.count_by_tier["nvme"] == 2
    loss.backward()          # the writes are held: backward uses the sources
    del loss                 # the handles die before their writes landed
    assert off.stats.prefetch_hits + off.stats.prefetch_misses == 0
    held_writes.set()
    off.close()
    assert off.disk_bytes_in_use == 0
