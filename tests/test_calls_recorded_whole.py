"""Torch calls recorded whole, without the dispatch mode (NOTE [Calls recorded
whole] in tiermem/tracking/producers.py): what the profile marks, what a record of a
call holds and declines, when the gate still uses the mode, and that steps
following plans that record calls whole train exactly as without tiermem.

Runtime: a few seconds on 2 shared cores.
"""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tiermem.testing

from helpers import assert_same_step, compare_records, offloader, reference_steps, run_step, \
    train_steps
from models import make_case
from test_call_tracking import LnLinear
from tiermem.models import GPTConfig, TinyGPT
from tiermem.tracking.producers import CallRecorder, ProducerMode
from tiermem.tracking.modules import CallGate, ModuleStack


class _Calls(nn.Module):
    """One module running a call of each kind the profile tells apart."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.randn(10, 8))
        self.fc = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.emb, max_norm=1.0)   # renorms in place, then looks up
        h = F.gelu(self.fc(h))                         # linear: several ops on 3-d input
        h = F.dropout(h, 0.5, training=True)           # random
        return F.layer_norm(h, (8,)) + 1.0             # one op each


def test_the_profile_marks_the_calls_that_ran_one_recomputable_op():
    mode = ProducerMode(module_names=True)
    mode.op_counts = {}
    with ModuleStack(), mode, CallRecorder(mode):
        _Calls()(torch.randint(0, 10, (2, 3)))
    single = mode.single_op_calls
    assert single[("_Calls", "gelu")] == "gelu"
    assert single[("_Calls", "layer_norm")] == "native_layer_norm"
    assert single[("_Calls", "add")] == "add"
    assert single[("_Calls", "embedding")] is False, "max_norm writes the weight first"
    # On the CPU (input requiring grad) F.dropout runs empty_like, bernoulli_,
    # div_ and mul: not one op (on CUDA one native_dropout: tests/test_gpu.py).
    assert single[("_Calls", "dropout")] is False
    assert single[("_Calls.fc", "linear")] is False


def test_a_record_of_a_call_replays_the_call_with_its_arguments_as_they_were():
    mode = ProducerMode(names=False)
    x = torch.randn(4, 6)
    y = mode.record_call(F.gelu, (x,), {"approximate": "tanh"}, "gelu")
    rec = mode.record_of(y)
    assert rec is not None and rec.func is F.gelu and rec.kwargs == {"approximate": "tanh"}
    assert rec.args[0].record is None and rec.args[0].alive() is x
    assert torch.equal(rec.func(x, **rec.kwargs), y)
    shape = [24]
    v = mode.record_call(torch.Tensor.view, (y, shape), {}, "view")
    shape[0] = 2                           # the program reuses its list
    vrec = mode.record_of(v)
    assert vrec.is_view and vrec.args[1] == [24] and vrec.args[0].record is rec
    assert vrec.values_op == "gelu"        # a view: the values are gelu's
    parts = mode.record_call(torch.Tensor.split, (x, 3, 1), {}, "split")
    assert [mode.record_of(p).out_index for p in parts] == [0, 1]


class _Handle:
    tainted = False


def test_a_call_that_writes_or_returns_an_argument_is_not_recorded():
    """Rule 3: the call of this step is not the profile's; what it wrote is
    tainted as the mode would taint it."""
    mode = ProducerMode(names=False)
    x = torch.randn(4, 6)
    dropped = x.view(24)
    h = _Handle()
    mode.watch(dropped, h)
    out = mode.record_call(torch.Tensor.relu_, (x,), {}, "relu")
    assert out is x and mode.record_of(x) is None and tiermem.testing.records_held(mode) == 0
    assert h.tainted, "a write to a dropped tensor's storage must taint it"
    z = torch.randn(3)
    assert mode.record_call(lambda t: t, (z,), {}, "alias") is z
    assert mode.record_of(z) is None
    with torch.inference_mode():
        w = mode.record_call(torch.sin, (torch.randn(3),), {}, "sin")
    assert mode.record_of(w) is None


def test_a_random_call_replays_the_generator_state_it_drew_from():
    """Rule 5: F.dropout recorded whole replays the default generator's state
    of before the call, and leaves the generator as it finds it."""
    mode = ProducerMode(names=False)
    x = torch.randn(64, 64)
    torch.manual_seed(7)
    y = mode.record_call(F.dropout, (x, 0.5, True), {}, "native_dropout")
    rec = mode.record_of(y)
    assert rec.rng is not None and rec.rng[0] is torch.default_generator
    after = torch.rand(3)                  # the generator moved on since
    state = torch.get_rng_state()
    assert torch.equal(tiermem.testing.replay_call(rec, (x, 0.5, True)), y)
    assert torch.equal(torch.get_rng_state(), state), "the generator is left as it was"
    torch.manual_seed(7)
    torch.nn.functional.dropout(x, 0.5, True)
    assert torch.equal(torch.rand(3), after)


def _replayed(rec, args) -> torch.Tensor:
    return tiermem.testing.replay_call(rec, args)


def test_a_call_that_draws_where_the_profile_did_not_replays_its_draw():
    """Rule 6: the profile saw ``torch.rrelu`` run one op that draws nothing
    (``leaky_relu``, ``training=False``); this step's call of it draws
    (``training=True``): its record replays the generator's state of before
    the call, so the recompute gives this step's values. A call that draws
    nothing holds no state."""
    mode = ProducerMode(names=False)
    x = torch.randn(256)
    y = mode.record_call(torch.rrelu, (x, 0.1, 0.3, True), {}, "leaky_relu")
    rec = mode.record_of(y)
    assert rec is not None and rec.rng is not None and rec.rng[0] is torch.default_generator
    torch.rand(5)                           # the generator moves on
    assert torch.equal(_replayed(rec, (x, 0.1, 0.3, True)), y)
    z = mode.record_call(torch.rrelu, (x, 0.1, 0.3, False), {}, "leaky_relu")
    assert mode.record_of(z).rng is None
    parts = [torch.randn(3), torch.randn(2)]   # the device read inside a list
    c = mode.record_call(torch.cat, (parts,), {}, "cat")
    assert mode.record_of(c) is not None and mode.record_of(c).rng is None
    meta = torch.empty(3, device="meta")       # no generator known: not recorded
    assert mode.record_of(mode.record_call(torch.sin, (meta,), {}, "sin")) is None


def test_a_device_argument_names_the_generator_drawn_from():
    """``torch.rand_like(x, device=...)`` draws on that device, not on
    ``x``'s: its generator is the one captured (a device with no known
    generator: none, so the op is not recomputable)."""
    x = torch.randn(3)
    assert tiermem.testing.generator_of_call((x,), {}) is torch.default_generator
    assert tiermem.testing.generator_of_call((x,), {"device": torch.device("meta")}) is None
    assert tiermem.testing.generator_of_call((x,), {"device": "cpu"}) is torch.default_generator
    assert tiermem.testing.generator_of_call((x,), {"device": None}) is torch.default_generator


def test_the_gate_records_whole_unless_autocast_is_active():
    mode = ProducerMode(names=False)
    gate = CallGate(mode)
    gate.allowed, gate.direct = frozenset({"gelu"}), {"gelu": "gelu"}
    x = torch.randn(4, 6)
    with gate:
        y = F.gelu(x)
        assert gate.calls_direct == 1 and gate.calls_tracked == 0
        assert mode.record_of(y).func is F.gelu
        with torch.autocast("cpu", dtype=torch.bfloat16):   # rule 2: through the mode
            z = F.gelu(x)
        assert gate.calls_direct == 1 and gate.calls_tracked == 1
        assert mode.record_of(z).func is torch.ops.aten.gelu.default
        w = torch.tanh(x)                                    # not allowed: untracked
    assert mode.record_of(w) is None


def _direct_calls(contexts) -> int:
    return sum(c.tracking.gate.calls_direct for c in contexts
               if c.tracking is not None and c.tracking.gate is not None)


@pytest.mark.parametrize("name", ["mlp", "block", "convnet", "embed_gather"])
def test_plans_recording_calls_whole_train_exactly(name):
    off = offloader("auto", device_budget="10%")
    contexts = []

    class _Ctx:
        def __enter__(self):
            self.ctx = off.__enter__()
            contexts.append(self.ctx)
            return self.ctx

        def __exit__(self, *exc):
            return off.__exit__(*exc)

    records = train_steps(make_case(name), _Ctx, steps=4)
    compare_records(records, reference_steps(name, steps=4), name)
    if name != "convnet":   # its plan frees the budget without recompute
        assert off.plan.recomputes and off.stats.count_by_tier["recompute"] > 0
    if name in ("mlp", "block"):   # their activations are one-op calls
        assert off.plan.tracking_direct, off.plan.tracking_calls
        assert _direct_calls(contexts) > 0
    off.close()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_tiny_gpt_records_its_one_op_calls_whole_and_stays_exact(dropout):
    """With the default min_offload_bytes the LayerNorm's mean and rstd are not
    planned, so every layer_norm call is recorded whole; with dropout the
    dropout call (four ops on the CPU) and the decomposed attention still go
    through the mode. The same recompute bytes as with every call under the mode."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, layers=2, width=64, heads=4, seq_len=32, dropout=dropout)
    idx = torch.randint(0, cfg.vocab, (2, 32))
    got, stats = {}, {}
    for how in ("direct", "mode", "plain"):
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        if how == "plain":
            got[how] = run_step(model, (idx, idx), contextlib.nullcontext(), seed=3,
                                loss_fn=lambda loss: loss)
            continue
        off = offloader("auto", device_budget="10%", min_offload_bytes=4096)
        for _ in range(3):
            run_step(model, (idx, idx), off, loss_fn=lambda loss: loss)
        plan = off.plan
        assert plan.recomputes
        if how == "mode":
            plan.tracking_direct = None
        else:
            direct = plan.tracking_direct
            assert direct["TinyGPT.blocks.0.ln1"] == {"layer_norm": "native_layer_norm"}
            assert direct["TinyGPT.blocks.0.mlp"] == {"gelu": "gelu"}
            assert "TinyGPT.drop" not in direct   # CPU dropout: four ops, through the mode
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        with off as ctx:
            loss = model(idx, idx)
        loss.backward()
        got[how] = (loss.detach().clone(), {n: p.grad.clone() for n, p in
                                            model.named_parameters() if p.grad is not None})
        gate = ctx.tracking.gate
        stats[how] = (dict(ctx.stats.bytes_by_tier), gate.calls_direct, gate.calls_tracked)
        off.close()
    assert_same_step(got["direct"], got["plain"], "direct")
    assert_same_step(got["mode"], got["plain"], "mode")
    assert stats["direct"][0] == stats["mode"][0], stats
    assert stats["direct"][1] > 0 and stats["mode"][1] == 0, stats
    assert stats["direct"][2] < stats["mode"][2], stats
    if dropout == 0.0:
        assert stats["direct"][2] == 0, "every tracked call ran one op"


def test_a_call_whose_other_outputs_the_plan_recomputes_goes_through_the_mode():
    """With min_offload_bytes=0 the plan recomputes the LayerNorm's mean and
    rstd too, which F.layer_norm does not return: layer_norm is then not
    recorded whole (its mean and rstd would have no record), and the step
    recomputes every byte the plan chose."""
    x = torch.randn(8, 16, 32)
    for min_bytes, whole in ((0, False), (1024, True)):
        torch.manual_seed(0)
        model = LnLinear()
        off = offloader("auto", device_budget="10%", min_offload_bytes=min_bytes)
        for _ in range(3):
            run_step(model, (x,), off)
        plan = off.plan
        prof = tiermem.testing.kept_profiles(off)[plan.keys]
        unreturned = {p for r in prof.records for p in r.recipe_unreturned}
        assert (("LnLinear.ln", "layer_norm") in unreturned) is not whole, unreturned
        assert ("layer_norm" in plan.tracking_direct.get("LnLinear.ln", {})) is whole
        with off as ctx:
            loss = model(x).square().mean()
        loss.backward()
        assert not ctx.stats.recompute_fallbacks, ctx.stats.recompute_fallback_reasons
        assert ctx.stats.bytes_by_tier["keep"] == plan.predicted_kept_bytes
        off.close()


class _MaybeInplace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 4)
        self.inplace = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sin(self.fc1(x))             # sin saves its input
        b = F.relu(s, inplace=self.inplace)    # cos saves b: relu(sin(fc1 out)) regenerates it
        return self.fc2(torch.cos(b))


def test_a_call_that_writes_in_place_where_the_profile_did_not_stays_exact():
    """Rule 3: the step's relu runs in place where the profile's did not (same
    name, same shapes): not recorded, so its output is not recomputed, and
    the gradients are those of a run without tiermem."""
    x = torch.randn(16, 32)
    torch.manual_seed(0)
    model = _MaybeInplace()
    ref_model = _MaybeInplace()
    ref_model.load_state_dict(model.state_dict())
    off = offloader("auto", device_budget="10%")
    for _ in range(3):
        run_step(model, (x,), off)
    assert "relu" in off.plan.tracking_direct.get("_MaybeInplace", {}), off.plan.tracking_direct
    model.inplace = ref_model.inplace = True
    got = run_step(model, (x,), off, seed=4)
    ref = run_step(ref_model, (x,), contextlib.nullcontext(), seed=4)
    assert_same_step(got, ref, "relu in place")
    assert off.stats.recompute_fallback_reasons.get("no recorded producer", 0) >= 1, \
        off.stats.recompute_fallback_reasons
    off.close()
