"""Producer tracking priced by the planner (NOTE [Tracking priced] in
tiermem/planner/runtime.py): the profile counts the ops of each (module,
torch call), a recompute option carries its share of the tracking its recipe
needs, a plan states what its tracking costs, a plan whose tracking does not
pay is declined for the plan without it, and a step following a plan tracks
the ops its price counted."""

import functools
import time

import pytest
import torch

import tiermem
import tiermem.testing
import tiermem.tracking.producers as producers
from tiermem.models import GPTConfig, TinyGPT
from tiermem.planner.profile import Profile, TensorRecord
from tiermem.planner import rates as rates_mod
from tiermem.planner.rates import Rates, measure_rates
from tiermem.planner.tracking_cost import priced_plan as _priced_plan
from tiermem.planner.tracking_cost import tracked_op_count, tracking_shares
from tiermem.planner.solver import make_plan

MB = 1_000_000


def _rec(index, nbytes, pack_s, use_s, calls, recompute_s=0.002):
    return TensorRecord(index, f"m{index}", None, (nbytes // 4,), "float32", "cpu", nbytes,
                        pack_s, recomputable=True, recompute_s=recompute_s,
                        first_use_s=use_s, recipe_modules=tuple(sorted({m for m, _ in calls})),
                        recipe_calls=tuple(calls))


def _profile(records, call_ops, bwd_start=1.0):
    keys = tuple(((r.nbytes // 4,), torch.float32, torch.device(r.device)) for r in records)
    return Profile(records, keys, 0, bwd_start, bwd_start, bwd_start + 1.0,
                   sum(r.nbytes for r in records), call_ops=call_ops)


def _rates(track_op_s):
    # An nvme move of 10 MB costs its CPU charge: 10 MB / 1 GB/s over 2 threads = 5 ms.
    return Rates(host_copy=1e10, pointwise=1e9, disk_write=1e9, disk_read=1e9,
                 disk_engine="fake", move_cpu=1e9, compute_threads=2.0, track_op_s=track_op_s)


def _plan(profile, rates, budget, has_nvme=True):
    make = functools.partial(make_plan, profile, rates, budget, "test", has_nvme=has_nvme,
                             cpu_budget_bytes=0, nvme_budget_bytes=None)
    return _priced_plan(profile, rates, make)


ATTN = ("m0", "scaled_dot_product_attention")
GELU = ("m1", "gelu")


def test_a_recompute_pays_its_share_of_the_tracking_its_recipe_needs():
    # A's recipe is inside a 1000-op call: 2 ms to regenerate + 10 ms of
    # tracking > 5 ms for nvme. B's is a 2-op call: recomputed.
    recs = [_rec(0, 10 * MB, 0.0, 3.0, [ATTN]), _rec(1, 10 * MB, 0.1, 2.9, [GELU])]
    prof = _profile(recs, {ATTN: 1000, GELU: 2, ("m1", "linear"): 7})
    plan = _plan(prof, _rates(10e-6), budget=0)
    assert [p.tier for p in plan.tensors] == ["nvme", "recompute"]
    assert plan.tracked_ops == 2
    assert plan.predicted_tracking_s == pytest.approx(2 * 10e-6)
    assert plan.predicted_step_cost_s == pytest.approx(
        plan.predicted_stall_s + plan.predicted_cpu_s + plan.predicted_recompute_s + 2e-5)
    assert "(+0.02 ms: its share of producer tracking)" in plan.tensors[1].reason
    assert "producer tracking 0.02 ms (2 ops)" in str(plan)
    assert plan.as_dict()["predicted_tracking_s"] == plan.predicted_tracking_s
    # Free tracking (unmeasured): both recomputed, as before pricing.
    free = _plan(prof, _rates(0.0), budget=0)
    assert [p.tier for p in free.tensors] == ["recompute", "recompute"]
    assert free.predicted_tracking_s == 0.0


def test_a_call_shared_by_recipes_is_paid_once_and_shared():
    recs = [_rec(i, 10 * MB, 0.1 * i, 3.0 - 0.1 * i, [ATTN]) for i in range(4)]
    prof = _profile(recs, {ATTN: 1000})
    shares = tracking_shares(prof, _rates(10e-6))
    assert shares == {i: pytest.approx(10e-3 / 4) for i in range(4)}
    plan = _plan(prof, _rates(10e-6), budget=0)
    # 2 ms + 2.5 ms share < 5 ms per tensor: all recomputed; the call is paid once.
    assert {p.tier for p in plan.tensors} == {"recompute"}
    assert plan.tracked_ops == 1000
    assert any(n.startswith("tracking: recomputing 4 tensors") and "worth it" in n
               for n in plan.notes)


def test_a_plan_whose_tracking_does_not_pay_is_declined():
    # Ten recipes share a 1000-op call (1 ms share each, so recompute looks
    # cheaper than nvme's 5 ms), but the budget needs one tensor only: that
    # plan pays the whole 10 ms of tracking; the plan without it moves it.
    recs = [_rec(i, 10 * MB, 0.01 * i, 3.0 - 0.01 * i, [ATTN]) for i in range(10)]
    prof = _profile(recs, {ATTN: 1000})
    plan = _plan(prof, _rates(10e-6), budget=90 * MB)
    assert [p.tier for p in plan.tensors].count("recompute") == 0
    assert [p.tier for p in plan.tensors].count("nvme") == 1
    assert plan.tracked_ops == 0 and plan.predicted_tracking_s == 0.0
    assert plan.tracking_scope == frozenset()
    note = [n for n in plan.notes if n.startswith("tracking: the plan recomputing them was "
                                                  "declined: recomputing 1 tensors")]
    assert note and "over 1000 ops" in note[0]


def test_tracking_is_kept_where_the_budget_needs_it():
    # No nvme tier: recompute is the only way to the budget.
    recs = [_rec(i, 10 * MB, 0.01 * i, 3.0 - 0.01 * i, [ATTN]) for i in range(10)]
    prof = _profile(recs, {ATTN: 1000})
    plan = _plan(prof, _rates(10e-6), budget=90 * MB, has_nvme=False)
    assert [p.tier for p in plan.tensors].count("recompute") == 1
    assert plan.tracked_ops == 1000
    assert any("the budget is not reachable without them" in n for n in plan.notes)


def test_a_recipe_without_calls_or_modules_counts_its_module_or_the_forward():
    whole = _rec(0, 10 * MB, 0.0, 3.0, [("m0", None)])
    prof = _profile([whole], {ATTN: 30, ("m0", "linear"): 5, ("m2", "gelu"): 4})
    plan = _plan(prof, _rates(0.0), budget=0)
    assert plan.tensors[0].tier == "recompute"
    assert tracked_op_count(plan, prof) == 35   # all of m0
    unknown = TensorRecord(0, "m0", None, (10 * MB // 4,), "float32", "cpu", 10 * MB, 0.0,
                           recomputable=True, recompute_s=0.002, first_use_s=3.0)
    prof = _profile([unknown], {ATTN: 30, ("m0", "linear"): 5, ("m2", "gelu"): 4})
    plan = _plan(prof, _rates(0.0), budget=0)
    assert plan.tracking_scope is None and tracked_op_count(plan, prof) == 39


def test_tracking_cost_per_op_is_measured():
    rates = measure_rates(None)
    assert rates.track_op_s > 0 and rates.track_call_s > 0
    assert rates.as_dict()["track_op_s"] == rates.track_op_s
    assert rates.as_dict()["track_call_s"] == rates.track_call_s


def _scripted_best(script):
    """The tracking probe, its runs taking the times ``script(way, n)`` gives
    (``way``: chain, tracked or gated; ``n``: that way's run count so far):
    ``probe()`` gives its prices, ``runs`` counts the runs of each way."""
    runs: dict = {}

    def best(fn, repeats=1, clock=None):
        assert clock is time.thread_time
        n = runs[fn.__name__] = runs.get(fn.__name__, 0) + 1
        return script(fn.__name__, n)
    return (lambda: tiermem.testing.tracking_prices(best)), runs


def test_a_disturbed_tracking_probe_runs_on_until_its_prices_are_positive():
    # NOTE [A tracking price of 0]: in the first 6 runs every plain one was
    # disturbed (1.0 s) and a gated one lucky (0.95 s): no price yet; the
    # next runs give the plain chain its undisturbed time (0.8 s).
    times = {"chain": (1.0, 0.8), "tracked": (1.5, 1.3), "gated": (0.95, 0.9)}
    probe, runs = _scripted_best(lambda way, n: times[way][n > 6])
    op_s, call_s = probe()
    links = rates_mod.TRACK_PROBE_LINKS
    assert op_s == pytest.approx((1.3 - 0.8) / (3 * links))
    assert call_s == pytest.approx((0.9 - 0.8) / (2 * links))
    assert runs == {"chain": 12, "tracked": 12, "gated": 12}


def test_a_tracking_probe_never_positive_reads_the_op_price_or_0():
    """After its attempts a call price not positive reads the op price; an
    op price not positive reads 0. The probe runs on one thread, by that
    thread's CPU clock, and gives the thread count back."""
    clocks = []
    probe, runs = _scripted_best(lambda way, n: (
        clocks.append(torch.get_num_threads()) or
        {"chain": 1.0, "tracked": 1.5, "gated": 0.9}[way]))
    torch.set_num_threads(2)
    op_s = pytest.approx(0.5 / (3 * rates_mod.TRACK_PROBE_LINKS))
    assert probe() == (op_s, op_s)
    assert set(clocks) == {1} and torch.get_num_threads() == 2
    per_way = rates_mod.TRACK_PROBE_ATTEMPTS * 2 * rates_mod.REPEATS
    assert runs == {"chain": per_way, "tracked": per_way, "gated": per_way}
    probe, _ = _scripted_best(
        lambda way, n: {"chain": 1.0, "tracked": 0.9, "gated": 0.9}[way])
    assert probe() == (0.0, 0.0)


def test_a_call_recorded_whole_is_priced_per_call():
    # GELU's pair ran one recomputable op per call in the profile: the plan
    # records it whole, priced at track_call_s, not handed to the mode.
    recs = [_rec(0, 10 * MB, 0.0, 3.0, [GELU])]
    rates = Rates(host_copy=1e10, pointwise=1e9, compute_threads=2.0, track_op_s=10e-6,
                  track_call_s=3e-6)
    single = _profile(recs, {GELU: 4})
    single.single_op_calls = {GELU: "gelu"}
    assert tracking_shares(single, rates) == {0: pytest.approx(4 * 3e-6)}
    plan = _plan(single, rates, budget=0, has_nvme=False)
    assert plan.tensors[0].tier == "recompute"
    assert plan.tracked_ops == 0 and plan.direct_calls == 4
    assert plan.tracking_direct == {"m1": {"gelu": "gelu"}}
    assert plan.predicted_tracking_s == pytest.approx(4 * 3e-6)
    assert "(0 ops, 4 calls recorded whole)" in str(plan)
    many = _profile(recs, {GELU: 4})   # not single-op: through the mode
    plan = _plan(many, rates, budget=0, has_nvme=False)
    assert plan.tracked_ops == 4 and plan.direct_calls == 0 and not plan.tracking_direct
    assert plan.predicted_tracking_s == pytest.approx(4 * 10e-6)


def _gpt():
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(layers=2, width=32, heads=2, seq_len=16, dropout=0.1, vocab=64))


def test_the_profile_counts_ops_per_call_and_a_followed_step_tracks_what_was_priced(
        monkeypatch):
    model = _gpt()
    idx = torch.randint(0, 64, (2, 16))
    off = tiermem.Offloader(policy="auto", device_budget="10%", min_offload_bytes=0)
    for _ in range(2):
        with off:
            loss = model(idx, idx)
        loss.backward()
    plan = off.plan
    prof = tiermem.testing.kept_profiles(off)[plan.keys]
    ops = prof.call_ops
    attn = [n for (m, c), n in ops.items() if c == "scaled_dot_product_attention"]
    assert len(attn) == 2 and attn[0] == attn[1] > 5   # one call per block, same ops
    assert plan.tracked_ops == tracked_op_count(plan, prof) > 0
    assert plan.tracked_ops < sum(ops.values())        # scoped: not the whole forward
    # A step that follows the plan hands its mode the ops the price counted.
    seen = []
    real = producers.ProducerMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return real(self, func, types, args, kwargs)
    monkeypatch.setattr(producers.ProducerMode, "__torch_dispatch__", counting)
    with off as ctx:
        loss = model(idx, idx)
    loss.backward()
    assert off.plan is plan
    # The calls recorded whole (one op each in the profile) are priced apart:
    # NOTE [Calls recorded whole] in tracking/producers.py.
    direct = ctx.tracking.gate.calls_direct
    assert direct > 0 and seen
    assert len(seen) == plan.tracked_ops and direct == plan.direct_calls
    assert plan.predicted_tracking_s == pytest.approx(
        plan.tracked_ops * plan.rates["track_op_s"]
        + plan.direct_calls * plan.rates["track_call_s"])


def test_a_prefer_recompute_hint_keeps_its_recompute_where_tracking_is_declined():
    from tiermem.policy import Tier, TierOrder
    recs = [_rec(i, 10 * MB, 0.01 * i, 3.0 - 0.01 * i, [ATTN]) for i in range(10)]
    recs[0].hint = (TierOrder([Tier.RECOMPUTE, Tier.KEEP]), "PREFER_RECOMPUTE")
    prof = _profile(recs, {ATTN: 1000})
    plan = _plan(prof, _rates(10e-6), budget=90 * MB)
    assert plan.tensors[0].tier == "recompute"
    assert [p.tier for p in plan.tensors[1:]].count("recompute") == 0


class _UserMode(torch.utils._python_dispatch.TorchDispatchMode):
    """A mode of the user's, entered inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_the_pack_hook_runs_with_the_step_mode_off_the_dispatch_stack(monkeypatch):
    # NOTE [The pack hook runs untracked] in tracking/dispatch.py: while tiermem packs,
    # its producer mode is not on the stack (its own ops are not the model's);
    # a user's mode above it stays, and both are back after.
    import tiermem.runtime.hooks as hooks
    stacks = []
    real = hooks.Packer.__call__

    def spy(self, t):
        n = torch._C._len_torch_dispatch_stack()
        stacks.append(tuple(type(torch._C._get_dispatch_stack_at(i)) for i in range(n)))
        return real(self, t)
    monkeypatch.setattr(hooks.Packer, "__call__", spy)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    ref = (torch.tanh(x @ w).sin()).sum()
    ref.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
    user = _UserMode()
    with off:
        h = torch.tanh(x @ w)
        with user:
            y = h.sin()
            assert type(torch._C._get_dispatch_stack_at(
                torch._C._len_torch_dispatch_stack() - 1)) is _UserMode
        loss = y.sum()
    loss.backward()
    assert torch.equal(x.grad, gx) and torch.equal(w.grad, gw)
    assert stacks and user.ops > 0
    plain = [s for s in stacks if _UserMode not in s]
    assert plain and all(producers.ProducerMode not in s for s in plain), stacks
    # The user's mode on top: the stack is left as it is.
    above = [s for s in stacks if _UserMode in s]
    assert above and all(s[-1] is _UserMode and producers.ProducerMode in s for s in above)
