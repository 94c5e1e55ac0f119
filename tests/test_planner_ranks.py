"""Every rank plans from the same numbers (issue 13 #3, NOTE [Ranks agree once]
in tiermem/planner/agree.py).

Two gloo ranks under DDP whose injected rates and whose budgets differ on
purpose agree once, at the second step, on the smallest budgets, the slowest
rates and one rank's profile timeline, and then make the identical first plan
(tier, window and predicted cost per tensor); a shape change on one rank only
re-plans there without a collective (the group would hang, and the bounded
run fail); parameters stay bit-identical to the same DDP run without tiermem;
``agree_ranks=False`` and ``TIERMEM_AGREE_RANKS=0`` plan each rank alone. The
rest checks the pure parts (combining the rows, the collective's device, the
structure hash, the timeline's round trip) in this process.

Runtime here (2 cores): 10 to 20 s for the spawned group.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import traceback

import pytest
import torch
import torch.nn.functional as F

import tiermem
import tiermem.testing
from distributed import TinyLM, init_gloo, run_ranks, shutdown
from tiermem.config import BudgetShare
from tiermem.planner import agree
from tiermem.planner.profile import Profile, TensorRecord
from tiermem.planner.rates import Rates

WORLD = 2
STEPS = 5
SEQ = 16


def _rates(rank: int) -> Rates:
    """Rank 1's disk is slower, rank 0's host copy: the agreement takes each minimum."""
    if rank == 0:
        return Rates(host_copy=2e9, pointwise=3e9, disk_write=1.0e9, disk_read=2.0e9,
                     disk_engine="python", disk_write_latency_s=1e-4, disk_read_latency_s=2e-4)
    return Rates(host_copy=5e9, pointwise=1e9, disk_write=0.25e9, disk_read=0.5e9,
                 disk_engine="python", disk_write_latency_s=3e-4, disk_read_latency_s=1e-4)


def _train(rank: int, make_ctx, seqs, observe=None):
    """DDP training of TinyLM for ``len(seqs)`` steps, the sequence length of
    step i ``seqs[i]``; ``observe(step)`` runs inside each step's context."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    ddp = DDP(TinyLM())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step, seq in enumerate(seqs):
        tokens = torch.randint(0, 64, (4, seq + 1), generator=gen)
        torch.manual_seed(1000 * rank + step)
        with make_ctx():
            logits = ddp(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            if observe is not None:
                observe(step)
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, [p.detach().clone() for p in ddp.parameters()]


def _train_fsdp2(rank: int, off=None):
    """FSDP2 (``fully_shard`` per block and on the root) for STEPS steps,
    ``off`` attached to the root (its hook runs after FSDP2's pre-forward,
    whose all-gathers are issued before the exchange); the first plan as
    seen inside step 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if off is not None:
        off.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, tiers = [], None
    for step in range(STEPS):
        tokens = torch.randint(0, 64, (4, SEQ + 1), generator=gen)
        torch.manual_seed(1000 * rank + step)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        if step == 1 and off is not None:
            tiers = [p.tier for p in off.plan.tensors]
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    if off is not None:
        off.detach()
    return (losses, [p.detach().to_local().clone() for p in model.parameters()]), tiers


def _fsdp2_case(rank, nvme_dir) -> dict:
    ref, _ = _train_fsdp2(rank)
    off = tiermem.Offloader(policy="auto", device_budget="40%", min_offload_bytes=0,
                            nvme_dir=nvme_dir, engine="python")
    try:
        got, tiers = _train_fsdp2(rank, off)
        a = tiermem.testing.planner_of(off).agreement
    finally:
        off.close()
    return {"exact": _exact(got, ref), "tiers": tiers,
            "agreement": None if a is None else a.as_dict()}


def _exact(got, ref) -> str:
    for i, (a, b) in enumerate(zip(got[0] + got[1], ref[0] + ref[1])):
        if not torch.equal(a, b):
            return f"tensor {i} (losses, then parameters) differs from the run without tiermem"
    return ""


def _auto_case(rank, nvme_dir, seqs, ref, **settings) -> dict:
    """One auto training; what the rank saw, JSON-ready."""
    budgets = {0: ("60%", "1GiB"), 1: ("35%", "512MiB")}[rank]
    settings = {"device_budget": budgets[0], "cpu_budget": budgets[1], "min_offload_bytes": 0,
                "nvme_dir": nvme_dir, "engine": "python", **settings}
    off = tiermem.Offloader(policy="auto", **settings)
    out = {}

    def observe(step):
        if step == 1:   # the first plan, made at this step's entry
            plan = off.plan
            out["first_plan"] = None if plan is None else {
                "tiers": [p.tier for p in plan.tensors],
                "windows": [p.window_s for p in plan.tensors],
                "costs": [p.cost_s for p in plan.tensors],
                "budget_bytes": plan.budget_bytes, "rates": plan.rates,
                "predicted_stall_s": plan.predicted_stall_s, "notes": plan.notes}

    try:
        got = _train(rank, lambda: off, seqs, observe)
        planner = tiermem.testing.planner_of(off)
        a = planner.agreement
        out.update(agreement=None if a is None else a.as_dict(), profiles=planner.profiles,
                   plans=len(planner.plans), exact=_exact(got, ref))
    finally:
        off.close()
    return out


def _plan_after_first_backward(rank, nvme_dir, **settings) -> bool:
    """Whether ``off.plan`` is there right after the first step's backward."""
    off = tiermem.Offloader(policy="auto", device_budget="50%", min_offload_bytes=0,
                            nvme_dir=nvme_dir, engine="python", **settings)
    try:
        seen = []
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        ddp = DDP(TinyLM())
        for _ in range(2):
            with off:
                loss = ddp(torch.randint(0, 64, (4, SEQ))).sum()
            loss.backward()
            seen.append(off.plan is not None)
        return seen
    finally:
        off.close()


def _worker(rank: int, world: int, port: int, nvme_dir: str) -> dict:
    init_gloo(rank, world, port)
    import tiermem.planner.planning as planning
    planning.measure_rates = lambda nvme_store=None, cuda=False: _rates(rank)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("tiermem")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    results = {}
    try:
        same = [SEQ] * STEPS
        # Rank 0 changes its sequence length at step 2 (off its plan: the safe
        # order), profiles it at step 3 and plans it alone at step 4; rank 1
        # never changes.
        changed = same if rank == 1 else [SEQ, SEQ, 12, 12, 12]
        for name, seqs, settings, env in (
                ("agreed", same, {}, None),
                ("one_rank_changes_shape", changed, {}, None),
                ("off_by_argument", same, {"agree_ranks": False}, None),
                ("off_by_env", same, {}, "0")):
            try:
                if env is not None:
                    os.environ["TIERMEM_AGREE_RANKS"] = env
                ref = _train(rank, contextlib.nullcontext, seqs)
                results[name] = _auto_case(rank, nvme_dir, seqs, ref, **settings)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            finally:
                os.environ.pop("TIERMEM_AGREE_RANKS", None)
        try:
            results["fsdp2_attached"] = _fsdp2_case(rank, nvme_dir)
        except Exception:
            results["fsdp2_attached"] = {"error": traceback.format_exc()}
        for name, settings in (("plan_seen_agreed", {}), ("plan_seen_off", {"agree_ranks": False})):
            try:
                results[name] = _plan_after_first_backward(rank, nvme_dir, **settings)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
        results["log"] = [m for m in records if "agreed by" in m]
    finally:
        log.removeHandler(handler)
        shutdown()
    return results


@pytest.fixture(scope="module")
def ranks_results(tmp_path_factory):
    nvme_dir = str(tmp_path_factory.mktemp("shared-nvme"))
    return run_ranks(_worker, WORLD, nvme_dir, timeout_s=240)


def _case(results, name):
    for rank, res in enumerate(results):
        assert "error" not in res[name], f"rank {rank}, {name}:\n{res[name]['error']}"
    return [res[name] for res in results]


@pytest.mark.slow
def test_ranks_with_different_rates_and_budgets_agree_on_the_smallest_and_slowest(
        ranks_results):
    r0, r1 = _case(ranks_results, "agreed")
    assert r0["agreement"] == r1["agreement"]
    a = r0["agreement"]
    assert a["ranks"] == 2 and a["device_budget"] == "35%"
    assert a["cpu_budget_bytes"] == 512 << 20
    rates = a["rates"]
    assert (rates["host_copy"], rates["pointwise"]) == (2e9, 1e9)
    assert (rates["disk_write"], rates["disk_read"]) == (0.25e9, 0.5e9)
    assert (rates["disk_write_latency_s"], rates["disk_read_latency_s"]) == (3e-4, 2e-4)
    assert a["timeline_rank"] in (0, 1) and a["timeline_note"] == ""


@pytest.mark.slow
def test_agreeing_ranks_make_the_identical_first_plan_and_stay_exact(ranks_results):
    r0, r1 = _case(ranks_results, "agreed")
    p0, p1 = r0["first_plan"], r1["first_plan"]
    assert p0 is not None and p1 is not None
    assert {t for t in p0["tiers"]} - {"keep"}, "the plan moves nothing: the test shows nothing"
    for key in ("tiers", "windows", "costs", "budget_bytes", "predicted_stall_s"):
        assert p0[key] == p1[key], key
    for key in ("host_copy", "disk_write", "disk_read"):
        assert p0["rates"][key] == p1["rates"][key] == r0["agreement"]["rates"][key]
    assert any("agreed by 2 ranks" in n for n in p0["notes"])
    assert r0["exact"] == r1["exact"] == ""


@pytest.mark.slow
def test_the_exchange_is_logged_with_its_numbers(ranks_results):
    for res in ranks_results:
        line = res["log"][0]
        assert "agreed by 2 ranks" in line and "device budget 35%" in line, line
        assert "disk write 0.25 GB/s" in line, line


@pytest.mark.slow
def test_a_shape_change_on_one_rank_replans_there_without_a_collective(ranks_results):
    """Rank 0 profiles its new shape and plans alone (the group would hang on a
    collective it entered alone: run_ranks' timeout fails the test)."""
    r0, r1 = _case(ranks_results, "one_rank_changes_shape")
    assert (r0["profiles"], r1["profiles"]) == (2, 1)
    assert (r0["plans"], r1["plans"]) == (2, 1)
    assert r0["agreement"] == r1["agreement"] is not None
    assert r0["exact"] == r1["exact"] == ""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["off_by_argument", "off_by_env"])
def test_agreement_can_be_turned_off(ranks_results, name):
    r0, r1 = _case(ranks_results, name)
    assert r0["agreement"] is None and r1["agreement"] is None
    p0, p1 = r0["first_plan"], r1["first_plan"]
    assert p0["budget_bytes"] > p1["budget_bytes"], "each rank planned from its own budget"
    assert p0["rates"]["disk_write"] == 1.0e9 and p1["rates"]["disk_write"] == 0.25e9
    assert r0["exact"] == r1["exact"] == ""


@pytest.mark.slow
def test_fsdp2_ranks_with_an_attached_auto_offloader_agree_and_stay_exact(ranks_results):
    r0, r1 = _case(ranks_results, "fsdp2_attached")
    assert r0["agreement"] == r1["agreement"] is not None
    assert r0["agreement"]["timeline_rank"] is not None
    assert r0["tiers"] == r1["tiers"] and set(r0["tiers"]) - {"keep"}
    assert r0["exact"] == r1["exact"] == ""


@pytest.mark.slow
def test_the_first_plan_waits_for_the_exchange(ranks_results):
    """``off.plan`` right after the first backward: ``None`` while the ranks
    have not agreed yet (planning then would need a collective), there at once
    when agreement is off."""
    for res in ranks_results:
        assert res["plan_seen_agreed"] == [False, True]
        assert res["plan_seen_off"] == [True, True]


# -- the pure parts, in this process ---------------------------------------------------
def _profile(step_s=0.01, shapes=((4, 8), (4, 8)), device="cpu", pack=(0.001, 0.002)):
    keys = tuple((torch.Size(s), torch.float32, torch.device(device)) for s in shapes)
    records = [TensorRecord(i, "m", "gelu", tuple(s), "float32", device, 128, pack[i],
                            first_use_s=step_s / 2 + i * 1e-3, recompute_s=None if i else 1e-5,
                            recomputable=i == 0)
               for i, s in enumerate(shapes)]
    return Profile(records, keys, 64, step_s / 3, step_s / 2, step_s, 320)


def _row(rank, rates=None, budget=None, default=None, cpu=1 << 30, nvme=None, profile=None):
    return agree.local_row(rank, rates, budget, default, cpu, nvme, profile)


def test_rows_combine_to_the_smallest_budgets_and_slowest_rates():
    a = agree.combine([_row(0, _rates(0), BudgetShare(0.6), cpu=3 << 30, nvme=8 << 30),
                       _row(1, _rates(1), BudgetShare(0.35), cpu=2 << 30, nvme=9 << 30)])
    assert a.ranks == 2 and a.device_budget == BudgetShare(0.35)
    assert (a.cpu_budget_bytes, a.nvme_budget_bytes) == (2 << 30, 8 << 30)
    assert (a.rates.host_copy, a.rates.pointwise, a.rates.disk_write) == (2e9, 1e9, 0.25e9)
    assert (a.rates.disk_write_latency_s, a.rates.disk_read_latency_s) == (3e-4, 2e-4)
    assert a.rates.d2h is None


def test_a_rate_one_rank_could_not_measure_is_absent_for_all():
    no_disk = Rates(host_copy=1e9, pointwise=1e9)
    a = agree.combine([_row(0, _rates(0)), _row(1, no_disk)])
    assert a.rates.disk_write is None and a.rates.disk_read is None


def test_a_rank_without_figures_is_neutral():
    """A rank whose first profile is not finished takes part with no rates
    and no default budget: the others' figures are agreed."""
    a = agree.combine([_row(0, _rates(0), default=5 << 30), _row(1)])
    assert a.rates.disk_write == 1.0e9 and a.device_budget == 5 << 30
    assert a.timeline_rank is None and "not every rank" in a.timeline_note


def test_default_and_size_budgets_agree_in_bytes():
    a = agree.combine([_row(0, budget=4 << 30), _row(1, default=3 << 30)])
    assert a.device_budget == 3 << 30


def test_a_percentage_on_one_rank_and_a_size_on_another_is_a_config_error():
    with pytest.raises(tiermem.ConfigError, match="device_budget differs in kind"):
        agree.combine([_row(0, budget=BudgetShare(0.5)), _row(1, budget=1 << 30)])


def test_the_timeline_comes_from_the_shortest_profiled_step_lowest_rank_on_a_tie():
    rows = [_row(r, profile=_profile(step_s=s)) for r, s in enumerate((0.03, 0.01, 0.01))]
    assert agree.combine(rows).timeline_rank == 1
    rows[1] = _row(1, profile=_profile(shapes=((4, 8), (4, 9))))
    a = agree.combine(rows)
    assert a.timeline_rank is None and "differ in structure" in a.timeline_note


def test_the_structure_ignores_which_gpu():
    a = _profile(device="cuda:0").keys
    b = tuple((s, d, torch.device("cuda:1")) for s, d, _ in a)
    assert agree.structure_hash(a) == agree.structure_hash(b)
    assert agree.structure_hash(a) != agree.structure_hash(_profile().keys)


def test_the_agreed_timeline_replaces_every_planned_number():
    src, mine = _profile(step_s=0.01), _profile(step_s=0.05, pack=(0.004, 0.009))
    a = agree.combine([_row(0, profile=src), _row(1, profile=mine)])
    assert a.timeline_rank == 0
    a.timeline = tiermem.testing.agreed_timeline(src)   # what the broadcast carries
    got = a.apply(mine)
    assert got.records == src.records
    for f in ("fixed_kept_bytes", "forward_end_s", "backward_start_s", "backward_end_s",
              "measured_kept_bytes"):
        assert getattr(got, f) == getattr(src, f), f
    other = _profile(shapes=((2, 2), (2, 2)))
    assert a.apply(other) is other


@pytest.mark.parametrize("backend,device", [
    ("gloo", "cpu"), ("mpi", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cpu"),
    ("xccl", None)])
def test_the_exchange_runs_on_the_device_the_backend_takes(backend, device):
    assert agree.collective_device_type(backend) == device


def test_without_a_process_group_nothing_is_agreed():
    assert not agree.active(True) and not agree.active(False)


def test_agree_ranks_setting(monkeypatch):
    assert tiermem.Config.from_env().agree_ranks is True
    monkeypatch.setenv("TIERMEM_AGREE_RANKS", "off")
    assert tiermem.Config.from_env().agree_ranks is False
    monkeypatch.setenv("TIERMEM_AGREE_RANKS", "maybe")
    with pytest.raises(tiermem.ConfigError, match="TIERMEM_AGREE_RANKS='maybe'"):
        tiermem.Config.from_env()


def test_nan_marks_a_missing_figure():
    row = _row(0)
    named = tiermem.testing.agreement_row(row)
    assert named["rank"] == 0 and math.isnan(named["structure_hash"])


def _nccl_worker(rank: int, world: int, port: int) -> dict:
    """The exchange itself over NCCL (its tensors on the current CUDA device)."""
    init_gloo(rank, world, port, backend="nccl")
    try:
        profile = _profile(device=f"cuda:{rank}")
        a = agree.exchange(_row(rank, _rates(rank), BudgetShare(0.5), profile=profile),
                           profile)
        def json_ready(values):   # NaN (no figure) as None: NaN != NaN
            return [None if math.isnan(v) else v for v in values]
        return {"agreement": a.as_dict(), "timeline": json_ready(a.timeline),
                "sent": json_ready(tiermem.testing.agreed_timeline(profile))}
    finally:
        shutdown()


@pytest.mark.gpu
def test_the_exchange_runs_over_nccl_on_the_current_cuda_device():
    (res,) = run_ranks(_nccl_worker, 1, timeout_s=120)
    assert res["agreement"]["timeline_rank"] == 0
    assert res["agreement"]["device_budget"] == "50%"
    assert res["timeline"] == res["sent"]


def test_the_cost_model_rates_agree_too():
    """Every field of Rates the solver reads is agreed: the CPU charge of
    moves and the both-directions rates as the slowest, the fixed CPU cost as
    the longest, the compute threads as the fewest (the largest charge)."""
    import dataclasses
    r0 = dataclasses.replace(_rates(0), move_cpu=2e9, move_fixed_cpu_s=1e-5,
                             compute_threads=4.0, disk_both=0.8e9, link_both=None)
    r1 = dataclasses.replace(_rates(1), move_cpu=1e9, move_fixed_cpu_s=3e-5,
                             compute_threads=2.0, disk_both=0.2e9, link_both=None)
    a = agree.combine([_row(0, r0), _row(1, r1)])
    assert (a.rates.move_cpu, a.rates.move_fixed_cpu_s, a.rates.compute_threads,
            a.rates.disk_both, a.rates.link_both) == (1e9, 3e-5, 2.0, 0.2e9, None)
    solver_fields = {f.name for f in dataclasses.fields(Rates)} - {"disk_engine",
                                                                    "disk_probe_error"}
    assert solver_fields == tiermem.testing.agreed_rate_fields()
