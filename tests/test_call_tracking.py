"""Tracking inside the torch calls a plan's recipes use (NOTE [Tracking inside
torch calls] in tiermem/tracking/modules.py) and the records a scoped step makes for
views made inside untracked calls (NOTE [Views made inside untracked calls]
in tiermem/tracking/producers.py): what the profile records, what the plan tracks,
that a step following it recomputes what the plan chose, and that gradients
stay bit-identical to a run without tiermem.

Runtime: a few seconds on 2 shared cores.
"""

import contextlib

import torch
import torch.nn as nn

import tiermem
import tiermem.testing
from helpers import assert_same_step, offloader, run_step
from tiermem.tracking.producers import ProducerMode


class LnLinear(nn.Module):
    """LayerNorm then Linear on a 3-d input: F.linear saves ``ln_out.view(-1, 32)``,
    a view it makes itself of the LayerNorm's (recomputable) output."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(self.ln(x))))


class DirectOp(nn.Module):
    """Runs an op with torch-function handling disabled (as a C++ extension's
    op would run): no function mode sees the call around it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        with torch._C.DisableTorchFunction():   # no function mode sees this call
            h = torch.nn.functional.gelu(h)
        return self.fc2(h)


def _model(cls, seed=0):
    torch.manual_seed(seed)
    return cls()


def _planned(model, x, **settings):
    """An auto Offloader at a budget only recompute reaches (no nvme_dir),
    settled on its plan."""
    off = offloader("auto", device_budget="10%", **settings)
    for _ in range(3):
        run_step(model, (x,), off)
    assert off.plan is not None and off.plan.recomputes
    return off


def test_profile_names_the_calls_and_the_plan_tracks_only_those():
    x = torch.randn(8, 16, 32)
    model = _model(LnLinear)
    off = _planned(model, x)
    calls = off.plan.tracking_calls
    assert calls is not None
    assert calls.get("LnLinear.ln") == frozenset({"layer_norm"}), calls
    # The view F.linear saves of the LayerNorm's output is made again from
    # the LayerNorm's record: that linear (its matmul) is not tracked. (The
    # view ``out`` saves of tanh's output is rebuilt from tanh's own saved
    # handle, not a regenerated node: that call stays tracked.)
    assert "LnLinear.fc" not in calls, calls
    with off as ctx:
        loss = model(x).square().mean()
    gate = ctx.tracking.gate
    assert gate is not None and gate.calls_tracked >= 1
    loss.backward()
    assert off.stats.count_by_tier["recompute"] >= 1
    off.close()


def test_a_view_made_in_an_untracked_call_is_recomputed_as_planned():
    """The planned step recomputes as many bytes with the calls as tracking
    whole modules does; without the alias record (NOTE [Views made inside
    untracked calls]) it could not recompute the view F.linear saved."""
    x = torch.randn(8, 16, 32)
    got = {}
    for how in ("calls", "modules", "no_alias"):
        model = _model(LnLinear)
        off = _planned(model, x)
        if how == "modules":
            off.plan.tracking_calls = None
        with (tiermem.testing.no_alias_records() if how == "no_alias"
              else contextlib.nullcontext()):
            run_step(model, (x,), off)
        got[how] = off.stats.bytes_by_tier["recompute"]
        off.close()
    assert got["calls"] == got["modules"] > 0, got
    assert got["no_alias"] < got["calls"], got


def test_gradients_bit_identical_with_call_tracking():
    x = torch.randn(8, 16, 32)
    for cls in (LnLinear, DirectOp):
        xin = x if cls is LnLinear else x.reshape(-1, 32)
        model = _model(cls)
        off = _planned(model, xin)
        ref_model = _model(cls)
        ref_model.load_state_dict(model.state_dict())
        got = run_step(model, (xin,), off, seed=5)
        ref = run_step(ref_model, (xin,), contextlib.nullcontext(), seed=5)
        assert off.stats.count_by_tier["recompute"] >= 1, cls.__name__
        assert_same_step(got, ref, cls.__name__)
        off.close()


def test_an_op_outside_every_call_tracks_its_module_whole():
    """gelu run with torch-function handling disabled ran outside every torch
    call: the module is tracked whole (``None``), and its output is still
    recomputed."""
    x = torch.randn(64, 32)
    model = _model(DirectOp)
    off = _planned(model, x)
    calls = off.plan.tracking_calls
    assert "DirectOp" in calls and calls["DirectOp"] is None, calls
    run_step(model, (x,), off)
    assert off.stats.count_by_tier["recompute"] >= 1
    off.close()


# -- the alias record itself -------------------------------------------------------

def _recorded(make):
    """A tensor made by ``make()`` under a ProducerMode indexing aliases."""
    mode = ProducerMode(names=False)
    mode.alias_index = True
    with mode:
        y = make()
    return mode, y


def test_alias_record_regenerates_a_contiguous_view_of_a_recorded_tensor():
    x = torch.randn(4, 6)
    mode, y = _recorded(lambda: torch.relu(x))
    v = y.view(24)                       # made outside the mode: no record of its own
    rec = mode.record_of(v)
    assert rec is not None and rec.is_view and rec.args[0].record is mode.record_of(y)
    regen = rec.func(rec.args[0].record.func(x), *rec.args[1:])
    assert torch.equal(regen, v)


def test_alias_record_refuses_what_is_not_the_same_elements():
    x = torch.randn(4, 6)
    mode, y = _recorded(lambda: torch.relu(x))
    assert mode.record_of(y.t()) is None                     # not contiguous
    assert mode.record_of(y.view(24)[6:]) is None            # starts elsewhere
    assert mode.record_of(y.view(torch.int32)) is None       # other dtype
    assert mode.record_of(y.view(24)[:12]) is None           # fewer elements
    v = y.view(24)
    y.add_(1)                                                # written after the op
    assert mode.record_of(v) is None
    mode2, z = _recorded(lambda: torch.relu(x))
    assert mode2.record_of(z.clone().view(24)) is None       # same values, another storage


def test_alias_index_is_off_unless_asked():
    x = torch.randn(4, 6)
    mode = ProducerMode(names=False)
    with mode:
        y = torch.relu(x)
    assert mode.record_of(y) is not None
    assert mode.record_of(y.view(24)) is None
    assert tiermem.testing.alias_index_size(mode) == 0


def test_module_names_record_the_call():
    x = torch.randn(4, 6)
    mode = ProducerMode(module_names=True)
    with mode, tiermem.tracking.producers.CallRecorder(mode):
        y = torch.nn.functional.gelu(x)
        with torch._C.DisableTorchFunction():
            z = torch.relu(x)
    assert mode.record_of(y).call == "gelu"
    assert mode.record_of(z).call is None


# -- the scope's states ------------------------------------------------------------

class _Counting(ProducerMode):
    """Counts the ops dispatched to it."""

    def __init__(self) -> None:
        super().__init__(names=False)
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.LayerNorm(8)
        self.b = nn.LayerNorm(8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_scope_with_calls_gates_inside_named_modules_and_tracks_whole_blocks():
    """In a module of ``names`` with calls, only the named calls reach the
    mode; a recomputing block (track_block) tracks everything until it ends,
    then the gate is back; outside the names nothing is tracked; the context's
    exit leaves whatever is entered."""
    from tiermem.tracking.modules import ModuleStack, TrackingScope, track_block, untrack_block

    model = _Two()
    x = torch.randn(4, 8)
    mode = _Counting()
    scope = TrackingScope(mode, {"_Two.a", ""}, blocks=True,
                          calls={"_Two.a": frozenset({"layer_norm"}), "": frozenset({"relu"})})
    with ModuleStack(scope=scope):
        assert scope.state == 2                # "" is named: the gate
        assert torch._C._len_torch_dispatch_stack() == 0
        model(x)                               # a's layer_norm only: _Two and b are not named
        assert scope.gate.calls_tracked == 1 and mode.seen >= 1
        seen = mode.seen
        torch.relu(x)                          # a named call of "": tracked
        assert mode.seen == seen + 1
        torch.tanh(x)                          # not named: untracked
        assert mode.seen == seen + 1
        entered = track_block()
        assert scope.state == 1                # a recomputing block: the mode itself
        torch.tanh(x)
        assert mode.seen == seen + 2
        untrack_block(entered)
        assert scope.state == 2                # the gate again
        torch.tanh(x)
        assert mode.seen == seen + 2
    assert scope.state == 0
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._len_torch_function_stack() == 0
