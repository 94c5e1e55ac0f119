"""tiermem under ``torch.distributed.pipelining`` (issue 32, item 1): one
Offloader attached per stage with ``tiermem.integrations.pipelining.attach_stage``,
each microbatch's forward its own step.

One process group runs every case of a world size (spawning one per case would
cost more than the cases): for each schedule a reference training of two SGD
steps without tiermem, then the same training under each policy. Every rank
compares, bit for bit, the losses (last stage), each of its stages' gradients
at both steps and its parameters after them with the reference, and checks
that the tier was used in every microbatch step of each of its stages. Each
case is reported as a test of its own.

The stage modules are small transformer-ish blocks (Linear, GELU, Linear,
dropout, residual, LayerNorm); dropout is on, with the same seed per rank and
step in both runs. Stages infer their shapes from the first microbatch
(PipelineStage without ``input_args``): that inference forward, run once per
stage at the first schedule step, is a step of the Offloader too.

In one process, a schedule driver runs three stage modules' microbatch
forwards and backwards in GPipe and 1F1B order (no torch.distributed), one
attached Offloader per stage, against the same order without tiermem.

Runtime here (2 cores): 9 to 20 s for the 2-rank group (18 cases), as loaded;
``slow``: about 26 s for the 4-rank group and 20 s for the zero-bubble,
frontend, static and shared cases; the one-process driver 1 to 5 s.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tiermem
from distributed import init_gloo, run_ranks, shutdown
from tiermem.integrations.pipelining import StageAttachment, attach_stage

WIDTH, SEQ, BATCH, MICROBATCHES, STEPS = 32, 8, 8, 4, 2
POLICIES = ("keep", "cpu", "nvme", "recompute", "recompute,nvme", "auto")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
CASES = [f"{s}/{p}" for s in SCHEDULES for p in POLICIES]
SLOW_CASES = ([f"zbv/{p}" for p in POLICIES] + [f"frontend/{p}" for p in ("cpu", "recompute")]
              + [f"static/{p}" for p in ("cpu", "recompute")]
              + [f"shared/{p}" for p in ("cpu", "auto")])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.fc2(F.gelu(self.fc1(x))), 0.1, self.training)
        return self.ln(x + h)


def _stage_modules(n_stages: int) -> list:
    torch.manual_seed(0)   # the same model on every rank and in every run
    return [nn.Sequential(Block(), Block()) for _ in range(n_stages)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _layout(schedule: str, rank: int, world: int):
    """(number of stages, this rank's stage indices)."""
    if schedule == "interleaved":
        return 2 * world, [rank, rank + world]
    if schedule == "zbv":   # the V: rank r holds stages r and 2W-1-r
        return 2 * world, [rank, 2 * world - 1 - rank]
    return world, [rank]


def _build(schedule: str, rank: int, world: int, offloaders):
    """This rank's stage modules, their attachments, the schedule, and whether
    this rank holds the first and the last stage; ``offloaders(i)`` gives stage
    ``i``'s Offloader (``None``: none), attached to the module before the stage
    is built (``pipeline()`` and ``static``: to the stage, after)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleZBVZeroBubble,
                                              SplitPoint, pipeline)
    cpu = torch.device("cpu")
    attached = []
    if schedule == "frontend":   # the tracing frontend: pipeline() splits one model
        full = nn.Sequential(*_stage_modules(world))
        pipe = pipeline(full, mb_args=(torch.zeros(BATCH // MICROBATCHES, SEQ, WIDTH),),
                        split_spec={str(i): SplitPoint.BEGINNING for i in range(1, world)})
        stage = pipe.build_stage(rank, cpu)
        off = offloaders(rank)
        if off is not None:
            attached.append(attach_stage(off, stage))
        return ([stage.submod], attached, ScheduleGPipe(stage, MICROBATCHES, loss_fn=_loss),
                rank == 0, rank == world - 1)
    n_stages, indices = _layout(schedule, rank, world)
    every = _stage_modules(n_stages)
    modules = [copy.deepcopy(every[i]) for i in indices]
    static = schedule == "static"   # shapes given: no inference forward
    for i, m in zip(indices, modules):
        off = offloaders(i)
        if off is not None and not static:
            attached.append(attach_stage(off, m))
    kw = {}
    stages = []
    for i, m in zip(indices, modules):
        if static:
            example = torch.zeros(BATCH // MICROBATCHES, SEQ, WIDTH)
            grad_example = example.clone().requires_grad_()   # requires_grad marks "has a gradient"
            kw = {"input_args": example if i == 0 else grad_example, "output_args": grad_example}
        stages.append(PipelineStage(m, i, n_stages, cpu, **kw))
        if static and offloaders(i) is not None:   # the built PipelineStage, attached after
            attached.append(attach_stage(offloaders(i), stages[-1]))
    ends = (0 in indices, n_stages - 1 in indices)
    if schedule in ("interleaved", "zbv"):
        cls = ScheduleInterleaved1F1B if schedule == "interleaved" else ScheduleZBVZeroBubble
        return (modules, attached, cls(stages, MICROBATCHES, loss_fn=_loss)) + ends
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return (modules, attached, cls(stages[0], MICROBATCHES, loss_fn=_loss)) + ends


def _train(schedule: str, rank: int, world: int, offloaders):
    """Two SGD steps of the pipeline; (losses, grads per step, params, stats
    of each attached stage per step)."""
    modules, attached, sched, first, last = _build(schedule, rank, world, offloaders)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(7)   # the same batches on every rank
    losses, grads, stats = [], [], [[] for _ in attached]
    for step in range(STEPS):
        x = torch.randn(BATCH, SEQ, WIDTH, generator=gen)
        y = torch.randn(BATCH, SEQ, WIDTH, generator=gen)
        torch.manual_seed(1000 * rank + step)   # dropout: the same stream in both runs
        opt.zero_grad(set_to_none=True)
        step_losses: list = []
        args = (x,) if first else ()
        if last:
            sched.step(*args, target=y, losses=step_losses)
        else:
            sched.step(*args)
        losses += [t.detach().clone() for t in step_losses]
        grads.append([p.grad.clone() for m in modules for p in m.parameters()])
        for out, a in zip(stats, attached):
            out.append(a.take_stats())
        opt.step()
    for a in attached:
        a.detach()
    params = [p.detach().clone() for m in modules for p in m.parameters()]
    return losses, grads, params, stats


def _compare(got, ref) -> str:
    """'' when losses, gradients and parameters are bit-identical, else what differs."""
    (losses, grads, params, _), (rlosses, rgrads, rparams, _) = got, ref
    if len(losses) != len(rlosses):
        return f"{len(losses)} losses, the reference has {len(rlosses)}"
    for i, (a, b) in enumerate(zip(losses, rlosses)):
        if not torch.equal(a, b):
            return f"loss {i}: {a.item()!r} != {b.item()!r}"
    for s, (g, rg) in enumerate(zip(grads, rgrads)):
        for i, (a, b) in enumerate(zip(g, rg)):
            if not torch.equal(a, b):
                return f"gradient {i} of step {s} differs"
    for i, (a, b) in enumerate(zip(params, rparams)):
        if not torch.equal(a, b):
            return f"parameter {i} differs"
    if all(torch.equal(g, torch.zeros_like(g)) for g in grads[-1]):
        return "the gradients are all zero: nothing was compared"
    return ""


def _used(policy: str, st) -> bool:
    """Whether one microbatch step used the policy's tiers."""
    c = st.count_by_tier
    if policy == "keep":
        return c["keep"] > 0 and st.offloaded_bytes == 0
    if policy == "cpu":
        return c["cpu"] > 0
    if policy == "nvme":
        return c["nvme"] > 0
    if policy == "recompute":
        return c["recompute"] > 0 and st.recompute_count > 0
    if policy == "recompute,nvme":
        return st.recompute_count > 0 and c["nvme"] > 0
    return st.offloaded_bytes > 0   # auto, once planned


def _check_stats(policy: str, stats, inferred: bool) -> str:
    """'' when every stage ran one step per microbatch (and, ``inferred``, one
    for the shape inference at the first schedule step) and used the tiers,
    else what did not."""
    for stage, per_step in enumerate(stats):
        for step, steps in enumerate(per_step):
            inference = 1 if step == 0 and inferred else 0
            if len(steps) != MICROBATCHES + inference:
                return (f"stage {stage}, step {step}: {len(steps)} microbatch steps recorded, "
                        f"expected {MICROBATCHES + inference}")
        real = [st for steps in per_step for st in steps[-MICROBATCHES:]]
        check = real[-1:] if policy == "auto" else real   # auto profiles first, then plans
        for st in check:
            if not _used(policy, st):
                return f"stage {stage}: a microbatch step did not use {policy}: {st}"
    return ""


def _offloader(policy: str, nvme_dir: str) -> tiermem.Offloader:
    settings = {"min_offload_bytes": 0}
    if "nvme" in policy or policy == "auto":
        settings.update(nvme_dir=nvme_dir, engine="python")
    if policy == "auto":
        settings.update(device_budget="50%", agree_ranks=False)
    return tiermem.Offloader(policy=policy, **settings)


def _case(schedule: str, policy: str, rank: int, world: int, ref, nvme_dir: str) -> str:
    offs: dict = {}
    shared = schedule == "shared"
    base = "interleaved" if shared else schedule

    def offloader_of(stage: int):
        key = 0 if shared else stage
        if key not in offs:
            offs[key] = _offloader(policy, nvme_dir)
        return offs[key]
    try:
        got = _train(base, rank, world, offloader_of)
    finally:
        for off in offs.values():
            off.close()
    inferred = base not in ("static", "frontend")   # shapes given, or traced
    return _compare(got, ref) or _check_stats(policy, got[3], inferred)


def _worker(rank: int, world: int, port: int, nvme_dir: str, cases) -> dict:
    init_gloo(rank, world, port)
    results, refs = {}, {}
    try:
        for case in cases:
            schedule, policy = case.split("/")
            base = "interleaved" if schedule == "shared" else schedule
            try:
                if base not in refs:
                    refs[base] = _train(base, rank, world, lambda stage: None)
                results[case] = _case(schedule, policy, rank, world, refs[base], nvme_dir)
            except Exception:
                results[case] = traceback.format_exc()
    finally:
        shutdown()
    return results


def _check(results, case: str) -> None:
    for rank, res in enumerate(results):
        assert res[case] == "", f"rank {rank}, {case}: {res[case]}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    nvme_dir = str(tmp_path_factory.mktemp("pp-nvme"))
    return run_ranks(_worker, 2, nvme_dir, CASES, timeout_s=90)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    nvme_dir = str(tmp_path_factory.mktemp("pp-nvme-four"))
    return run_ranks(_worker, 4, nvme_dir, CASES, timeout_s=150)


@pytest.fixture(scope="module")
def two_ranks_more(tmp_path_factory):
    nvme_dir = str(tmp_path_factory.mktemp("pp-nvme-more"))
    return run_ranks(_worker, 2, nvme_dir, SLOW_CASES, timeout_s=90)


@pytest.mark.parametrize("case", CASES)
def test_pipeline_on_two_ranks_is_bit_identical(two_ranks, case):
    """Under GPipe, 1F1B and interleaved 1F1B, each policy gives the losses,
    gradients and parameters of the same schedule without tiermem, and every
    microbatch's forward is a step that used the policy's tiers."""
    _check(two_ranks, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_pipeline_on_four_ranks_is_bit_identical(four_ranks, case):
    """The same on four ranks (eight stages under interleaved 1F1B)."""
    _check(four_ranks, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES)
def test_zero_bubble_frontend_static_and_shared_cases(two_ranks_more, case):
    """ZBV zero bubble (split input and weight backward), a stage built by
    the ``pipeline()`` frontend (attached after it was built; its shapes were
    traced: no inference forward), ``PipelineStage``s given static shapes and
    attached after they were built (no inference forward either), and one
    Offloader for both stages of a rank under interleaved 1F1B: bit-identical,
    tiers used."""
    _check(two_ranks_more, case)


# -- in one process: the wrapper's contract ------------------------------------------

def test_attach_stage_refuses_auto_with_agree_ranks():
    off = tiermem.Offloader(policy="auto")
    try:
        with pytest.raises(tiermem.ConfigError, match="agree_ranks=True"):
            attach_stage(off, nn.Linear(2, 2))
    finally:
        off.close()


def test_attach_stage_refuses_what_is_not_a_stage():
    off = tiermem.Offloader(policy="keep")
    try:
        with pytest.raises(TypeError, match="PipelineStage or the nn.Module"):
            attach_stage(off, object())
    finally:
        off.close()


def test_attach_stage_records_one_step_per_forward_with_grad():
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    module = Block()
    x = torch.randn(2, SEQ, WIDTH)
    try:
        with attach_stage(off, module) as att:
            assert isinstance(att, StageAttachment) and att.attached
            outs = [module(x) for _ in range(3)]
            with torch.no_grad():
                module(x)   # not a step
            with off:
                module(x)   # part of the outer step, not a step of its own
            for out in reversed(outs):   # backwards in any order
                out.sum().backward()
            stats = att.take_stats()
            assert len(stats) == 3 and len(att.microbatch_stats) == 0
            assert all(st.count_by_tier["cpu"] > 0 and st.prefetch_hits + st.prefetch_misses > 0
                       for st in stats)
        assert not att.attached
    finally:
        off.close()


def test_attach_stage_remembers_only_the_newest_steps(monkeypatch):
    import tiermem.integrations.pipelining as pipelining
    monkeypatch.setattr(pipelining, "MAX_RECORDED_STEPS", 2)
    off = tiermem.Offloader(policy="keep")
    module = nn.Linear(4, 4)
    try:
        att = attach_stage(off, module)
        outs = [module(torch.randn(2, 4)) for _ in range(3)]
        last = off.stats
        stats = att.take_stats()
        assert len(stats) == 2 and stats[-1] is last
        att.detach()
        del outs
    finally:
        off.close()


# -- in one process: a schedule driver over stage modules ------------------------------

def _one_f_one_b(stage: int, n_stages: int) -> list:
    """Stage ``stage``'s actions under 1F1B: ("F" or "B", microbatch)."""
    warmup = min(n_stages - stage - 1, MICROBATCHES)
    acts = [("F", m) for m in range(warmup)]
    for m in range(warmup, MICROBATCHES):
        acts += [("F", m), ("B", m - warmup)]
    return acts + [("B", m) for m in range(MICROBATCHES - warmup, MICROBATCHES)]


def _drive(order: str, modules: list, batches: list) -> list:
    """One training step of ``modules`` (stages in one process) in GPipe or
    1F1B order: each stage runs its own list of actions, an action as soon as
    what it needs has run (the activation from the stage before, the gradient
    from the stage after). Returns the losses."""
    n = len(modules)
    acts = [[("F", m) for m in range(MICROBATCHES)] + [("B", m) for m in range(MICROBATCHES)]
            if order == "gpipe" else _one_f_one_b(s, n) for s in range(n)]
    ins, outs, grads, losses = {}, {}, {}, [None] * MICROBATCHES
    while any(acts):
        progressed = False
        for s in range(n):
            if not acts[s]:
                continue
            kind, m = acts[s][0]
            if kind == "F" and (s == 0 or (s - 1, m) in outs):
                x = batches[m][0] if s == 0 else outs[(s - 1, m)].detach().requires_grad_()
                torch.manual_seed(100 * s + m)   # dropout: the same stream in both runs
                ins[(s, m)], outs[(s, m)] = x, modules[s](x)
                if s == n - 1:
                    losses[m] = F.mse_loss(outs[(s, m)], batches[m][1]) / MICROBATCHES
            elif kind == "B" and (s == n - 1 or (s + 1, m) in grads):
                if s == n - 1:
                    losses[m].backward()
                else:
                    outs[(s, m)].backward(grads[(s + 1, m)])
                grads[(s, m)] = ins[(s, m)].grad
            else:
                continue
            acts[s].pop(0)
            progressed = True
        assert progressed, f"the {order} schedule is stuck: {acts}"
    return [loss.detach() for loss in losses]


def _drive_training(order: str, policy, tmp_path):
    """Two SGD steps of 3 stages under ``order``; (losses, grads, params, stats)."""
    modules = _stage_modules(3)
    offs, attached = [], []
    for m in modules:
        if policy is not None:
            offs.append(_offloader(policy, str(tmp_path / "nvme")))
            attached.append(attach_stage(offs[-1], m))
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(7)
    losses, grads, stats = [], [], [[] for _ in attached]
    try:
        for _ in range(STEPS):
            batches = [(torch.randn(2, SEQ, WIDTH, generator=gen),
                        torch.randn(2, SEQ, WIDTH, generator=gen)) for _ in range(MICROBATCHES)]
            losses += _drive(order, modules, batches)
            grads.append([p.grad.clone() for m in modules for p in m.parameters()])
            for out, a in zip(stats, attached):
                out.append(a.take_stats())
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        for a, off in zip(attached, offs):
            a.detach()
            off.close()
    return losses, grads, [p.detach().clone() for m in modules for p in m.parameters()], stats


@pytest.mark.parametrize("order", ("gpipe", "1f1b"))
def test_one_process_schedule_driver_is_bit_identical(order, tmp_path):
    """Three stage modules in one process, microbatch forwards and backwards in
    GPipe and 1F1B order, one attached Offloader per stage: for every policy
    the losses, gradients and parameters equal the same order without tiermem,
    and every microbatch step used the policy's tiers."""
    ref = _drive_training(order, None, tmp_path)
    failures = {}
    for policy in POLICIES:
        got = _drive_training(order, policy, tmp_path)
        problem = _compare(got, ref) or _check_stats(policy, got[3], inferred=False)
        if problem:
            failures[policy] = problem
    assert not failures, failures
