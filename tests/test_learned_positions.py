"""Records learned by position (NOTE [Records learned by position] in
tiermem/tiers/positions.py): after a learning step, the steps of a named
policy record in full only the ops their recipes use, train bit-identically,
recompute the same tensors and report the same refusals as steps that record
everything; a forward of other shapes, another op sequence, a new candidate
or a failed forward sends the next step back to learning.

Runtime: ~10 s on 2 shared cores (measured 2026-12-04; ~20 s with a CI run beside it).
"""

import contextlib

import pytest
import torch
import torch.nn as nn

import tiermem
import tiermem.testing
from helpers import compare_records, offloader, reference_steps, run_step
from models import make_case
from tiermem.tiers.positions import MAX_FOLLOWING, MAX_KINDS, NOT_RECORDED
from tiermem.tracking.producers import ProducerMode


class _Counting(ProducerMode):
    """A producer mode that keeps, per instance made, the number of ops it
    recorded in full, taken when its step cleared it (class attribute ``full``)."""

    full: list = []

    def clear(self) -> None:
        type(self).full.append(tiermem.testing.ops_in_full(self))
        super().clear()


@pytest.fixture
def counting(monkeypatch):
    monkeypatch.setattr(_Counting, "full", [])
    with tiermem.testing.step_producer_mode(_Counting):
        yield _Counting


def _stats(s) -> tuple:
    return (dict(s.count_by_tier), dict(s.bytes_by_tier), s.recompute_input_bytes,
            s.recompute_fallbacks, dict(s.recompute_fallback_reasons))


class _Noting(contextlib.AbstractContextManager):
    """``off`` as a step's context, noting in ``followed`` whether the step
    followed learned positions (known once its first op has run)."""

    def __init__(self, off, followed: list) -> None:
        self.off, self.followed = off, followed

    def __enter__(self):
        self.off.__enter__()

    def __exit__(self, *exc):
        self.followed.append(tiermem.testing.following_learned_positions(self.off))
        return self.off.__exit__(*exc)


def _train(name: str, policy: str, steps: int, follow: bool, counting):
    """``steps`` AdamW steps of case ``name``: the records to compare, and per
    step (stats, whether it followed, ops recorded in full)."""
    off = offloader(policy)
    tiermem.testing.follow_learned_positions(off, follow)
    case = make_case(name)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    records, per_step = [], []
    for i in range(steps):
        counting.full = []
        followed = []
        loss, grads = run_step(case.model, case.inputs, _Noting(off, followed), seed=10 + i,
                               loss_fn=case.loss_fn)
        opt.step()
        records.append((loss, grads, {n: p.detach().clone()
                                      for n, p in case.model.named_parameters()}))
        per_step.append((_stats(off.stats), followed[0], sum(counting.full)))
    off.close()
    return records, per_step


@pytest.mark.parametrize("name,policy", [("mlp", "recompute"), ("block", "recompute"),
                                         ("embed_gather", "recompute,cpu"),
                                         ("block_bf16", "recompute")])
def test_following_steps_record_less_and_choose_as_learning_steps_do(name, policy, counting):
    steps = MAX_FOLLOWING + 3
    ref = reference_steps(name, steps=steps)
    got, per_step = _train(name, policy, steps, True, counting)
    learned, learned_steps = _train(name, policy, steps, False, counting)
    compare_records(got, ref, f"{name} following")
    compare_records(learned, ref, f"{name} learning")
    # Step 0 learns, MAX_FOLLOWING steps follow, then one learns again (rule 3).
    assert [f for _, f, _ in per_step] == \
        [False] + [True] * MAX_FOLLOWING + [False] + [True]
    assert not any(f for _, f, _ in learned_steps)
    assert per_step[0][0][0]["recompute"] > 0, f"{name}: nothing recomputed, nothing tested"
    for i, ((stats, followed, full), (ref_stats, _, ref_full)) in enumerate(
            zip(per_step, learned_steps)):
        assert stats == ref_stats, f"{name} step {i}: {stats} != {ref_stats}"
        assert NOT_RECORDED not in stats[4]
        if followed:
            assert full < ref_full, f"{name} step {i}: {full} ops in full, learning {ref_full}"
        else:
            assert full == ref_full


class _Branchy(nn.Module):
    """Recomputable work whose op sequence a test changes between steps
    (``extra``: one more op, which saves nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.extra = False

    def forward(self, x):
        s = x.sin()
        c = s.cos()
        h = self.a(x).relu()
        if self.extra:
            h = h + 1.0   # saves nothing
        h = (h * 2.0).sigmoid()
        return (self.b(h).exp() * c).mean()


def _step(model, off, x, seed):
    return run_step(model, (x,), off, seed=seed, loss_fn=lambda y: y)


def test_another_op_sequence_records_everything_from_where_it_differs():
    """An op inserted mid-forward (one that saves nothing) shifts the positions:
    the mode records every op from the first learned one that differs, so the
    step chooses what a fresh Offloader does, and the next step learns."""
    torch.manual_seed(0)
    model = _Branchy()
    x = torch.randn(8, 16)
    off = offloader("recompute")
    followed = []
    for i in range(6):
        model.extra = i == 3
        ref = _step(model, contextlib.nullcontext(), x, i)
        fresh = offloader("recompute")
        want = _step(model, fresh, x, i)
        model.zero_grad(set_to_none=True)
        with _Noting(off, followed):
            loss = model(x)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        assert torch.equal(loss.detach(), ref[0]) and torch.equal(want[0], ref[0])
        assert all(torch.equal(grads[n], ref[1][n]) for n in ref[1])
        assert _stats(off.stats) == _stats(fresh.stats), i
        assert off.stats.recompute_count > 0
        fresh.close()
    off.close()
    assert followed == [False, True, True, True, False, True]


class _Pairs(nn.Module):
    """``mm(x.sin(), x.cos().t())``: its arguments are saved only when ``x``
    requires grad, and no recipe uses their producers (mm is not recomputable)."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        p = torch.mm(x.sin(), x.cos().t())
        return (p @ self.b(x).relu().exp()).mean()


def test_a_new_candidate_while_following_is_refused_once_then_learned():
    torch.manual_seed(0)
    model = _Pairs()
    off = offloader("recompute")
    seen = []
    for i in range(5):
        x = torch.randn(8, 16, requires_grad=i >= 1)   # from step 1, mm saves sin's output
        ref = _step(model, contextlib.nullcontext(), x, i)
        fresh = offloader("recompute")
        _step(model, fresh, x, i)
        model.zero_grad(set_to_none=True)
        followed = []
        with _Noting(off, followed):
            loss = model(x)
        loss.backward()
        seen.append((followed[0], _stats(off.stats), _stats(fresh.stats)))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        assert torch.equal(loss.detach(), ref[0])
        assert all(torch.equal(grads[n], ref[1][n]) for n in ref[1])
        fresh.close()
    off.close()
    assert [f for f, _, _ in seen] == [False, True, False, True, True]
    # Step 1: sin's and cos's outputs are candidates at positions step 0 did not
    # record: refused, and not for a reason of their own; a fresh Offloader
    # recomputes them.
    stats, ref = seen[1][1], seen[1][2]
    assert stats[4].get(NOT_RECORDED, 0) >= 2, stats
    assert stats[0]["recompute"] < ref[0]["recompute"]
    # Step 2 learns them; the steps after follow and choose as a fresh Offloader.
    for following, stats, ref in seen[2:]:
        assert stats == ref


def test_a_failed_forward_sends_the_next_step_back_to_learning():
    torch.manual_seed(0)
    model = _Branchy()
    x = torch.randn(8, 16)
    off = offloader("recompute")
    followed = []
    for i in range(4):
        try:
            with _Noting(off, followed):
                loss = model(x)
                if i == 1:
                    raise KeyError("stop")
        except KeyError:
            continue
        loss.backward()
    off.close()
    assert followed == [False, True, False, True]


@pytest.mark.parametrize("policy", ["auto", "callable"])
def test_only_named_policies_follow(policy):
    torch.manual_seed(0)
    model = _Branchy()
    x = torch.randn(8, 16)
    off = offloader((lambda info: ["recompute", "keep"]) if policy == "callable" else policy)
    followed = []
    for i in range(4):
        with _Noting(off, followed):
            loss = model(x)
        loss.backward()
    off.close()
    assert followed == [False] * 4


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, 1))


@pytest.mark.parametrize("pattern", ["ABABAB", "AEAEAE"])
def test_alternating_forwards_choose_as_recording_everything(pattern):
    """Two models in turn (or a forward under no_grad, ``E``, between two of
    one model): each model is a kind of forward of its own (their first ops
    take weights of other shapes), and a forward without candidates counts for
    nothing; the choices are those of steps that record everything."""
    torch.manual_seed(0)
    models = {"A": (_mlp(32), torch.randn(8, 32)), "B": (_mlp(48), torch.randn(8, 48))}

    def run(follow: bool):
        off = offloader("recompute")
        tiermem.testing.follow_learned_positions(off, follow)
        out = []
        for kind in pattern:
            model, x = models["A" if kind == "E" else kind]
            with off:
                if kind == "E":
                    with torch.no_grad():
                        model(x)
                    continue
                loss = model(x).sum()
            loss.backward()
            model.zero_grad(set_to_none=True)
            out.append((kind, _stats(off.stats)))
        off.close()
        return out

    got, want = run(True), run(False)
    assert got == want
    assert all(s[0]["recompute"] > 0 for _, s in got)


def test_a_nan_argument_does_not_stop_following():
    torch.manual_seed(0)
    lin, lin2 = nn.Linear(16, 16), nn.Linear(16, 16)
    off = offloader("recompute")
    x, mask = torch.randn(4, 16), torch.zeros(4, 16, dtype=torch.bool)
    followed = []
    for _ in range(4):
        with _Noting(off, followed):
            h = lin(x).relu().masked_fill(mask, float("nan"))   # a new NaN float each call
            loss = lin2(h.sin()).sum()
        loss.backward()
    off.close()
    assert followed == [False, True, True, True]


def test_a_tier_before_recompute_never_follows():
    """With cpu first, which tensors reach the recompute tier depends on the
    cpu pool's state, not only on the forward: such a policy always learns."""
    torch.manual_seed(0)
    model, x = _mlp(32), torch.randn(8, 32)
    off = offloader("cpu,recompute", cpu_budget=4000)
    followed = []
    for _ in range(3):
        with _Noting(off, followed):
            loss = model(x).sum()
        loss.backward()
    assert off.stats.recompute_count > 0, "nothing reached the recompute tier"
    off.close()
    assert followed == [False, False, False]


class _CompiledFirst(nn.Module):
    """A compiled head first (its saved tensors are packed before the
    producer mode sees an op), then a TinyGPT."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.head = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                                  backend="aot_eager", dynamic=False)
        self.gpt = gpt
        self.z = torch.randn(4, 8)
        self.head_calls = 1   # tensors saved before the first tracked op: 2 per call

    def forward(self, idx, targets):
        h = self.z
        for _ in range(self.head_calls):
            h = self.head(h)
        return self.gpt(idx, targets) + h.sum()


def _gpt_kinds(pattern: str, follow: bool, lengths: dict, compiled_first: bool = False,
               head_calls: dict = None):
    """A TinyGPT trained (AdamW) on sequences of the lengths ``pattern`` names,
    in its order: per step (loss, grads, stats, followed, refusals planned),
    and the kinds of forward ``off`` keeps at the end. ``head_calls``: per
    name, the calls of the compiled head (``compiled_first``)."""
    from tiermem.models import GPTConfig, TinyGPT
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, layers=2, width=32, heads=4, seq_len=16, dropout=0.1))
    if compiled_first:
        model = _CompiledFirst(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 16))
    off = offloader("recompute") if follow is not None else None
    if off is not None:
        tiermem.testing.follow_learned_positions(off, follow)
    out = []
    for i, kind in enumerate(pattern):
        x = tokens[:, :lengths[kind]].contiguous()
        if head_calls:
            model.head_calls = head_calls[kind]
        followed = []
        ctx = contextlib.nullcontext() if off is None else _Noting(off, followed)
        loss, grads = run_step(model, (x, x), ctx, seed=i, loss_fn=lambda y: y)
        opt.step()
        out.append((loss, grads, None if off is None else _stats(off.stats),
                    bool(followed and followed[0]),
                    None if off is None else tiermem.testing.refusals_planned(off)))
    kept = None
    if off is not None:
        kept = tiermem.testing.forward_kinds_kept(off)
        off.close()
    return out, kept


@pytest.mark.parametrize("compiled_first", [False, True], ids=["gpt", "compiled_first"])
def test_forwards_of_two_shapes_in_turn_follow_the_positions_learned_for_each(compiled_first):
    """Sequences of two lengths in turn (NOTE [Records learned by position],
    rule 4): each length is a kind of forward with its own learned positions
    and remembered refusals, so after one learning step of each, the steps
    follow, plan no refusal again, and train, recompute and refuse exactly as
    steps that record everything. ``compiled_first``: tensors are saved
    before the first tracked op (their refusals go to the forward's kind too)."""
    pattern, lengths = "ABABABAB", {"A": 16, "B": 12}
    ref, _ = _gpt_kinds(pattern, None, lengths, compiled_first)
    got, _ = _gpt_kinds(pattern, True, lengths, compiled_first)
    want, _ = _gpt_kinds(pattern, False, lengths, compiled_first)
    for i, (r, g, w) in enumerate(zip(ref, got, want)):
        assert torch.equal(g[0], r[0]) and torch.equal(w[0], r[0]), i
        assert all(torch.equal(g[1][n], r[1][n]) for n in r[1]), i
        assert g[2] == w[2], f"step {i}: {g[2]} != {w[2]}"
    assert got[0][2][0]["recompute"] > 0 and got[0][2][4], "nothing recomputed or refused"
    assert [g[3] for g in got] == [False, False] + [True] * 6
    assert not any(w[3] for w in want)
    assert got[0][4] > 0 and got[1][4] > 0, "the learning steps planned no refusal"
    planned = [g[4] for g in got[2:]]
    assert planned == [w[4] for w in want[2:]], "refusals planned again, or answered wrongly"
    if not compiled_first:   # the compiled head's outputs (no record) are planned: no cost
        assert planned == [0] * 6, "a refusal remembered per kind was planned again"


def test_more_tensors_saved_before_the_first_tracked_op_leave_the_refusals_in_place():
    """One kind (the first tracked op is the same), but a compiled head before
    it saves 2 or 4 tensors: the refusals' keys count from the kind's first op,
    so the following steps still find them and choose as recording everything."""
    pattern, lengths, calls = "AABBA", {"A": 16, "B": 16}, {"A": 1, "B": 2}
    ref, _ = _gpt_kinds(pattern, None, lengths, True, calls)
    got, _ = _gpt_kinds(pattern, True, lengths, True, calls)
    want, _ = _gpt_kinds(pattern, False, lengths, True, calls)
    for i, (r, g, w) in enumerate(zip(ref, got, want)):
        assert torch.equal(g[0], r[0]) and all(torch.equal(g[1][n], r[1][n]) for n in r[1]), i
        assert g[2] == w[2], f"step {i}: {g[2]} != {w[2]}"
    assert [g[3] for g in got] == [False] + [True] * 4


def test_more_kinds_than_kept_in_turn_all_learn_and_stay_exact():
    """MAX_KINDS + 1 lengths in turn: each kind is dropped before it comes
    again, so every step learns, and no more than MAX_KINDS are kept; with
    MAX_KINDS lengths, the second round follows."""
    names = "ABCDEFGHIJ"[:MAX_KINDS + 1]
    lengths = {k: 16 - i for i, k in enumerate(names)}
    too_many, kept = _gpt_kinds(names * 2, True, lengths)
    assert not any(g[3] for g in too_many)
    assert kept == MAX_KINDS
    ref, _ = _gpt_kinds(names * 2, None, lengths)
    for i, (r, g) in enumerate(zip(ref, too_many)):
        assert torch.equal(g[0], r[0]) and all(torch.equal(g[1][n], r[1][n]) for n in r[1]), i
    fits, _ = _gpt_kinds(names[:-1] * 2, True, lengths)
    assert [g[3] for g in fits] == [False] * MAX_KINDS + [True] * MAX_KINDS


def test_the_least_recently_seen_kind_is_dropped_first():
    """Kinds 0..7, then 0 again, then a ninth kind: it drops kind 1 (the least
    recently seen), not kind 0 (the first one made)."""
    names = "ABCDEFGHI"[:MAX_KINDS + 1]
    lengths = {k: 16 - i for i, k in enumerate(names)}
    first, second, new = names[0], names[1], names[MAX_KINDS]
    pattern = names[:MAX_KINDS] + first + new + first + second
    got, _ = _gpt_kinds(pattern, True, lengths)
    assert [g[3] for g in got] == [False] * MAX_KINDS + [True, False, True, False]


def test_forwards_without_candidates_do_not_count_as_following_steps():
    """Evaluation forwards under ``no_grad`` between training steps follow
    (same kind) but have no candidate: they age no refusal and end nothing,
    so the training steps still follow MAX_FOLLOWING times in a row before
    one learns again (rule 3)."""
    torch.manual_seed(0)
    model, x = _mlp(32), torch.randn(8, 32)
    off = offloader("recompute")
    trained = []
    for i in range(MAX_FOLLOWING + 3):
        followed = []
        with _Noting(off, followed):
            loss = model(x).sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        trained.append(followed[0])
        with off, torch.no_grad():
            model(x)   # one op fewer (no sum): it follows, diverges, and counts for nothing
    off.close()
    assert trained == [False] + [True] * MAX_FOLLOWING + [False, True]


def test_forwards_without_candidates_take_no_kind():
    """MAX_KINDS forwards of new lengths under ``no_grad`` (nothing offered to
    the tier) between training steps: they keep no kind, so the training
    kind is still there and its steps go on following."""
    from tiermem.models import GPTConfig, TinyGPT
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, layers=2, width=32, heads=4, seq_len=16))
    tokens = torch.randint(0, 64, (2, 16))
    off = offloader("recompute")
    trained = []
    for i in range(4):
        followed = []
        with _Noting(off, followed):
            loss = model(tokens, tokens)
        loss.backward()
        trained.append(followed[0])
        if i == 1:
            for n in range(4, 4 + MAX_KINDS):
                with off, torch.no_grad():
                    model(tokens[:, :n].contiguous())
    assert tiermem.testing.forward_kinds_kept(off) == 1
    off.close()
    assert trained == [False, True, True, True]
