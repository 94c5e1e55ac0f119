"""The auto planner's cost model (NOTE [Planner cost model] in
tiermem/planner/solver.py), on profiles and rates built by hand
(deterministic): recompute chosen where it is cheaper per freed byte than a
move, the CPU charge of moves on a CPU device, the first restore's wait, the
both-directions rate only where directions overlap, the prefetch window a
plan sizes and a followed step uses; and the rates that feed it."""

import pytest
import torch

import tiermem
import tiermem.testing
from tiermem.planner.profile import Profile, TensorRecord
from tiermem.planner.rates import Rates, measure_rates
from tiermem.planner.solver import cpu_charge_s, make_plan, plan_window_bytes
from tiermem.policy import Tier
from tiermem.runtime.prefetch import AUTO_MIN_BYTES

MB = 1_000_000


def _rec(index, nbytes, pack_s, use_s, *, recompute_s=None, device="cpu"):
    return TensorRecord(index, f"m{index}", None, (nbytes // 4,), "float32", device, nbytes,
                        pack_s, recomputable=recompute_s is not None, recompute_s=recompute_s,
                        first_use_s=use_s)


def _profile(records, bwd_start):
    keys = tuple(((r.nbytes // 4,), torch.float32, torch.device(r.device)) for r in records)
    return Profile(records, keys, 0, bwd_start, bwd_start, bwd_start + 1.0,
                   sum(r.nbytes for r in records))


def _rates(**kw):
    base = dict(host_copy=1e10, pointwise=1e9, disk_write=1e9, disk_read=1e9,
                disk_engine="fake")
    base.update(kw)
    return Rates(**base)


def _plan(profile, rates, budget=0, **kw):
    return make_plan(profile, rates, budget, "test", has_nvme=True, cpu_budget_bytes=0,
                     nvme_budget_bytes=None, **kw)


def test_recompute_is_chosen_where_cheaper_per_freed_byte_than_a_move():
    # Two recomputable 10 MB tensors with long windows (a restore hides
    # entirely): A regenerates in 2 ms, B in 20 ms. A move costs its CPU
    # charge: 10 MB / 1 GB/s over 2 threads = 5 ms. So A is recomputed, B
    # goes to nvme; without the CPU charge (move_cpu unmeasured) a move looks
    # free and nothing is recomputed (the plans of 2026-12-01-cpu-auto).
    recs = [_rec(0, 10 * MB, 0.0, 3.0, recompute_s=0.002),
            _rec(1, 10 * MB, 0.1, 2.9, recompute_s=0.020)]
    prof = _profile(recs, bwd_start=1.0)
    plan = _plan(prof, _rates(move_cpu=1e9, compute_threads=2.0))
    assert [p.tier for p in plan.tensors] == ["recompute", "nvme"]
    assert "cheaper per freed byte than nvme" in plan.tensors[0].reason
    assert plan.tensors[1].cpu_s == pytest.approx(0.005)
    free = _plan(prof, _rates())
    assert [p.tier for p in free.tensors] == ["nvme", "nvme"]
    assert free.predicted_cpu_s == 0.0


def test_cpu_charge_appears_in_the_prediction_on_cpu_devices_only():
    rates = _rates(move_cpu=2e9, move_fixed_cpu_s=0.001, compute_threads=2.0,
                   d2h=1e10, h2d=1e10)
    assert cpu_charge_s(8 * MB, "cpu", Tier.NVME, rates) == pytest.approx((0.004 + 0.001) / 2)
    assert cpu_charge_s(8 * MB, "cuda:0", Tier.NVME, rates) == 0.0
    assert cpu_charge_s(8 * MB, "cpu", Tier.CPU, rates) == 0.0
    recs = [_rec(0, 8 * MB, 0.0, 3.0), _rec(1, 8 * MB, 0.1, 2.9)]
    plan = _plan(_profile(recs, 1.0), rates)
    assert [p.tier for p in plan.tensors] == ["nvme", "nvme"]
    assert plan.predicted_cpu_s == pytest.approx(2 * 0.0025)
    assert plan.predicted_step_cost_s == pytest.approx(
        plan.predicted_stall_s + plan.predicted_cpu_s)
    assert "CPU 2.50 ms" in plan.tensors[0].reason
    assert "CPU charge of moves: predicted 5.00 ms" in str(plan)
    assert plan.as_dict()["predicted_cpu_s"] == plan.predicted_cpu_s
    cuda = [_rec(0, 8 * MB, 0.0, 3.0, device="cuda:0")]
    on_gpu = _plan(_profile(cuda, 1.0), rates)
    assert on_gpu.tensors[0].tier in ("cpu", "nvme") and on_gpu.predicted_cpu_s == 0.0


def test_the_first_restore_backward_needs_waits_its_whole_read():
    # A long window does not hide the first restore: the prefetcher starts
    # only at the first unpack of a moved tensor (tiermem/runtime/prefetch.py).
    recs = [_rec(0, 10 * MB, 0.0, 5.0), _rec(1, 10 * MB, 0.1, 4.0)]
    plan = _plan(_profile(recs, 1.0), _rates(disk_read_latency_s=0.001))
    first_read = 0.001 + 10 * MB / 1e9
    assert plan.tensors[1].cost_s == pytest.approx(first_read)   # needed first
    assert plan.tensors[0].cost_s == 0.0                           # prefetched behind it
    assert plan.predicted_stall_s == pytest.approx(first_read)


def _overlap_profile(late_pack):
    # A: 100 MB saved at 0, needed first (at 0.6 s); C: 200 MB saved at
    # ``late_pack``, needed last. At 1 GB/s C's move out takes 0.2 s: saved at
    # 0.55 it is still being written while A is read back (0.6-0.7 s); saved
    # at 0.1 it landed long before. C is packed after A: the prefetcher's
    # cursor goes down the packing order from A, so C is read on demand at
    # its use (0.2 s), after every write: the same in both profiles.
    recs = [_rec(0, 100 * MB, 0.0, 0.6), _rec(1, 200 * MB, late_pack, 3.0)]
    return _profile(recs, bwd_start=0.58)


def test_both_directions_rate_applies_only_where_directions_overlap():
    alone, both = _rates(), _rates(disk_both=0.5e9)   # half the read rate when both run
    overlapping = _overlap_profile(late_pack=0.55)
    separate = _overlap_profile(late_pack=0.1)
    # Separate: A's read (0.1 s) overlaps no write: same prediction.
    assert (_plan(separate, both).predicted_stall_s
            == pytest.approx(_plan(separate, alone).predicted_stall_s)
            == pytest.approx(0.1 + 0.2))
    # Overlapping: A's read runs 0.1 s beside C's write, at half rate: 0.1 s more.
    assert _plan(overlapping, alone).predicted_stall_s == pytest.approx(0.1 + 0.2)
    assert _plan(overlapping, both).predicted_stall_s == pytest.approx(0.2 + 0.2)


def test_the_plan_sizes_its_prefetch_window_from_the_budget_room():
    assert plan_window_bytes(100 << 20, 60 << 20, 500 << 20) == 40 << 20
    assert plan_window_bytes(100 << 20, 99 << 20, 500 << 20) == AUTO_MIN_BYTES
    assert plan_window_bytes(1 << 30, 0, 30 << 20) == 30 << 20     # no more than moved
    assert plan_window_bytes(100 << 20, 60 << 20, 500 << 20, 3 << 20) == 3 << 20   # set
    recs = [_rec(i, 10 * MB, 0.01 * i, 2.0 - 0.01 * i) for i in range(5)]
    plan = _plan(_profile(recs, 1.0), _rates(), budget=0)
    assert plan.suggested_prefetch_bytes == AUTO_MIN_BYTES   # no room under a 0 budget
    given = _plan(_profile(recs, 1.0), _rates(), budget=0, prefetch_bytes=12 * MB)
    assert given.suggested_prefetch_bytes == 12 * MB


def test_a_small_window_delays_restores_in_the_prediction():
    # Five 10 MB tensors (a read: 10 ms): one needed at 1.0 s, then a gap,
    # then four needed 1 ms apart from 1.5 s. With room for all of them the
    # four are read during the gap: only the first read stalls. With room for
    # one, each read waits for the previous tensor's use: the burst stalls.
    uses = [1.503, 1.502, 1.501, 1.5, 1.0]
    recs = [_rec(i, 10 * MB, 0.01 * i, uses[i]) for i in range(5)]
    prof = _profile(recs, 0.9)
    wide = _plan(prof, _rates(), prefetch_bytes=50 * MB)
    narrow = _plan(prof, _rates(), prefetch_bytes=10 * MB)
    assert wide.predicted_stall_s == pytest.approx(0.010)
    assert narrow.predicted_stall_s > wide.predicted_stall_s + 0.02


def _pair_profile():
    # C (needed first, at 1.0 s) and a node's saved pair A, B (packed 0.1 and
    # 0.2, unpacked in packing order: A at 1.5 s, B at 1.501 s), 16 MiB each,
    # read at 1 GB/s (16.8 ms). The prefetcher restores in reverse packing
    # order: after C's unpack it starts B; with a one-tensor window A is not
    # started before its use and is read on demand (what the auto plans of
    # 2026-12-02-cpu-auto-williams did: benchmarks/results/
    # 2026-12-02-cpu-stall-predict.md).
    mib16 = 16 << 20
    recs = [_rec(0, mib16, 0.1, 1.5), _rec(1, mib16, 0.2, 1.501), _rec(2, mib16, 0.3, 1.0)]
    return _profile(recs, bwd_start=1.0)


def test_a_restore_the_prefetcher_reaches_too_late_waits_its_whole_read():
    read = (16 << 20) / 1e9
    plan = _plan(_pair_profile(), _rates(), prefetch_bytes=16 << 20)   # one tensor
    a, b, c = plan.tensors
    assert c.cost_s == pytest.approx(read)   # needed first: on demand
    assert b.cost_s == 0.0                   # started at C's unpack
    assert a.cost_s == pytest.approx(read)   # behind B in the window: on demand
    start, end, need = a.restore_s
    assert start == pytest.approx(need) and end == pytest.approx(need + read)
    assert plan.predicted_stall_s == pytest.approx(2 * read)


def test_the_plan_widens_its_window_where_packing_order_reads_on_demand():
    read = (16 << 20) / 1e9
    plan = _plan(_pair_profile(), _rates())   # a 0 budget: no room, 16 MiB floor
    assert plan.suggested_prefetch_bytes == 32 << 20    # A and B at once
    assert [p.cost_s for p in plan.tensors] == [0.0, 0.0, pytest.approx(read)]
    assert any(n.startswith("prefetch window raised from 16.0 MiB to 32.0 MiB")
               for n in plan.notes)
    # A set window is obeyed, and the prediction says what it costs.
    assert _plan(_pair_profile(), _rates(),
                 prefetch_bytes=16 << 20).predicted_stall_s == pytest.approx(2 * read)


def test_the_plan_widens_its_window_where_slower_reads_would_stall():
    # K (kept, the kick) at 1.0 s; X then Y needed 20 ms apart (1.2, 1.22 s),
    # 16 MiB each (a read: 16.8 ms). A one-tensor window starts Y at X's use:
    # in time at the measured rate, 13.55 ms late at half of it. Two tensors
    # start both at the kick: the plan takes that, and predicts no stall.
    mib16 = 16 << 20
    recs = [_rec(0, mib16, 0.1, 1.22), _rec(1, mib16, 0.2, 1.2), _rec(2, mib16, 0.3, 1.0)]
    plan = _plan(_profile(recs, bwd_start=1.0), _rates(), budget=mib16)
    assert [p.tier for p in plan.tensors] == ["nvme", "nvme", "keep"]
    assert plan.suggested_prefetch_bytes == 2 * mib16
    assert plan.predicted_stall_s == 0.0
    assert any("with reads at 1/2 of the measured rate: predicted stall 13.55 -> 0.00 ms"
               in n for n in plan.notes)
    narrow = _plan(_profile(recs, bwd_start=1.0), _rates(), budget=mib16,
                   prefetch_bytes=mib16)
    assert narrow.predicted_stall_s == 0.0 and not narrow.notes


def test_a_move_not_landed_at_its_use_reads_nothing():
    # Saved at 0.9 s, needed at 1.0 s, its write takes 0.1 s + : the unpack
    # finds the source still there (MovingStore.take): no read, no stall.
    recs = [_rec(0, 200 * MB, 0.9, 1.0)]
    plan = _plan(_profile(recs, bwd_start=1.0), _rates())
    assert plan.predicted_stall_s == 0.0


def test_backward_needs_moved_tensors_earlier_than_the_profile_saw():
    # The profile's backward read K (kept by the plan) for 0.4 s before it
    # needed A (at 1.45 s); a followed step keeps K, so it needs A at 1.05 s.
    # A (100 MB, 0.1 s read) starts at K's unpack (the kick, 1.0 s): it waits
    # 0.05 s. Read from the profile's timeline it would look free.
    k = _rec(1, 10 * MB, 0.5, 1.0)
    k.unpack_s = 0.4
    recs = [_rec(0, 100 * MB, 0.0, 1.45), k]
    plan = _plan(_profile(recs, bwd_start=1.0), _rates(), budget=10 * MB)
    assert [p.tier for p in plan.tensors] == ["nvme", "keep"]
    assert plan.kick_index == 1
    assert plan.tensors[0].restore_s == pytest.approx((0.0, 0.1, 0.05))
    assert plan.predicted_stall_s == pytest.approx(0.05)
    k.unpack_s = None   # no record of the profile's unpack: its timeline as it was
    assert _plan(_profile(recs, bwd_start=1.0), _rates(),
                 budget=10 * MB).predicted_stall_s == 0.0


def test_reads_the_profile_made_and_the_plan_does_not_are_taken_off_its_timeline():
    # The profile read K (400 MB) back from nvme; reading costs CPU the
    # compute lost (half a round trip: 400 MB / 1 GB per CPU second / 2 =
    # 0.2 s on one thread). The plan keeps K: A is needed 0.2 s earlier.
    k = _rec(1, 400 * MB, 0.5, 1.0)
    k.profile_tier = "nvme"
    recs = [_rec(0, 100 * MB, 0.0, 1.45), k]
    rates = _rates(move_cpu=1e9, compute_threads=1.0)
    plan = _plan(_profile(recs, bwd_start=1.0), rates, budget=400 * MB)
    assert [p.tier for p in plan.tensors] == ["nvme", "keep"]
    assert plan.tensors[0].restore_s[2] == pytest.approx(0.25)
    k.profile_tier = "keep"   # not read in the profile: its timeline as it was
    plan = _plan(_profile(recs, bwd_start=1.0), rates, budget=400 * MB)
    assert plan.tensors[0].restore_s[2] == pytest.approx(0.45)


def test_the_profile_records_how_long_each_first_unpack_took(nvme_dir):
    # Under the safe order everything movable went to nvme: each first
    # unpack waited for a read or copied; the record keeps that time.
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    off = tiermem.Offloader(policy="auto", device_budget="50%", nvme_dir=nvme_dir,
                            min_offload_bytes=1024)
    _tiny_step(off, x, lin)
    assert off.plan is not None   # planned from the profile
    prof = next(iter(tiermem.testing.kept_profiles(off).values()))
    used = [r for r in prof.records if r.first_use_s is not None]
    assert used and all(r.unpack_s is not None and r.unpack_s >= 0 for r in used)
    first = min(used, key=lambda r: r.first_use_s)
    last = max(used, key=lambda r: r.first_use_s)
    assert last.first_use_s >= first.first_use_s + first.unpack_s
    off.close()


def test_the_profile_records_a_regeneration_reading_a_saved_tensor_first(nvme_dir):
    # s (softmax: not recomputable, to nvme under the safe order) is the
    # recipe's leaf of d = s * 2 (recomputed). Backward regenerates d first
    # (for sin's backward), which reads s before softmax's backward unpacks
    # it: a followed step that recomputes d needs s then.
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)
    off = tiermem.Offloader(policy="auto", device_budget="50%", nvme_dir=nvme_dir,
                            min_offload_bytes=1024)

    def forward():   # no reference to s or d outlives it
        s = (x @ w).softmax(-1)
        return (s * 2.0).sin().sum()
    with off:
        loss = forward()
    loss.backward()
    assert off.plan is not None
    s, d = next(iter(tiermem.testing.kept_profiles(off).values())).records
    assert (s.profile_tier, d.profile_tier) == ("nvme", "recompute")
    assert d.first_use_s <= s.leaf_use_s <= d.first_use_s + d.recompute_s < s.first_use_s
    assert s.leaf_reader == d.index and d.leaf_use_s is None
    off.close()


def test_a_tensor_read_by_a_planned_regeneration_is_needed_then():
    # A (moved) was read at 1.05 s by the regeneration of R, before its own
    # unpack at 1.4 s. Recomputed by the plan, R reads it then: A's read
    # (0.1 s, started at K's unpack, the kick, at 1.0 s) is 0.05 s late.
    a = _rec(0, 100 * MB, 0.0, 1.4)
    a.leaf_use_s, a.leaf_reader = 1.05, 1
    r = _rec(1, 10 * MB, 0.2, 1.05, recompute_s=0.001)
    k = _rec(2, 10 * MB, 0.3, 1.0)
    prof = _profile([a, r, k], bwd_start=1.0)
    rates = _rates(move_cpu=1e9, compute_threads=1.0)   # a move costs CPU: R recomputed
    plan = _plan(prof, rates, budget=10 * MB)
    assert [p.tier for p in plan.tensors] == ["nvme", "recompute", "keep"]
    assert plan.tensors[0].restore_s == pytest.approx((0.0, 0.1, 0.05))
    a.leaf_reader = 2   # read by a tensor the plan keeps: needed at its unpack
    plan = _plan(prof, rates, budget=10 * MB)
    assert plan.tensors[0].restore_s[2] == pytest.approx(0.4 + 0.001)   # after R's regeneration


def _tiny_step(off, x, lin):
    with off:
        y = lin(x).relu()
        y = lin(y).sin()
        loss = y.sum()
    loss.backward()


def test_a_step_following_a_plan_uses_the_plans_prefetch_window(nvme_dir):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(512, 256)
    off = tiermem.Offloader(policy="auto", device_budget="25%", nvme_dir=nvme_dir,
                            min_offload_bytes=0)
    for _ in range(3):   # profile, plan, (maybe) one correction
        _tiny_step(off, x, lin)
    plan = off.plan
    assert plan is not None and plan.bytes_by_tier()["nvme"] > 0
    # On a model this small the plan's window is AUTO_MIN_BYTES, which the
    # unset default would also give: make the plan's distinct, then a step
    # that follows the plan must use it, from its first restore.
    assert plan.suggested_prefetch_bytes == AUTO_MIN_BYTES
    plan.suggested_prefetch_bytes = 5 << 20
    ctx = _entered(off, x, lin)
    assert ctx.prefetcher.budget_bytes == 5 << 20
    off.close()


def test_a_set_prefetch_window_wins_over_the_plans(nvme_dir):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(512, 256)
    off = tiermem.Offloader(policy="auto", device_budget="25%", nvme_dir=nvme_dir,
                            min_offload_bytes=0, prefetch_bytes=3 << 20)
    for _ in range(3):
        _tiny_step(off, x, lin)
    assert off.plan.suggested_prefetch_bytes == 3 << 20
    ctx = _entered(off, x, lin)
    assert ctx.prefetcher.budget_bytes == 3 << 20
    off.close()


def _entered(off, x, lin):
    """One more step like ``_tiny_step``; returns its context."""
    plan = off.plan
    with off as ctx:
        y = lin(x).relu()
        y = lin(y).sin()
        loss = y.sum()
    assert ctx.planning.plan is plan, "the step followed the plan"
    loss.backward()
    return ctx


def test_rates_measure_the_move_cpu_and_both_directions(nvme_dir):
    off = tiermem.Offloader(policy="nvme", nvme_dir=nvme_dir)
    store = tiermem.testing.store_of(off, Tier.NVME)
    rates = measure_rates(store)
    assert rates.move_cpu and rates.move_cpu > 0
    assert rates.move_fixed_cpu_s > 0
    assert rates.disk_both and rates.disk_both > 0
    assert rates.compute_threads == float(torch.get_num_threads())
    halved = rates.scaled(0.5)
    assert halved.disk_both == rates.disk_both * 0.5
    assert halved.move_cpu == rates.move_cpu   # CPU time is not a copy rate
    for f in ("link_both", "disk_both", "move_cpu", "move_fixed_cpu_s", "compute_threads"):
        assert isinstance(getattr(rates, f), (float, type(None))), f
    off.close()


@pytest.mark.gpu
def test_rates_measure_both_link_directions_at_once_on_cuda():
    rates = measure_rates(cuda=True)
    assert rates.d2h and rates.h2d and rates.link_both
    # Each direction while both run is no faster than alone (some slack for noise).
    assert rates.link_both <= 1.2 * max(rates.d2h, rates.h2d)
    # The model's device named (a profile's record says "cuda:N"): the same
    # cached figures for the current device, its free memory read.
    here = f"cuda:{torch.cuda.current_device()}"
    assert measure_rates(cuda=here) is rates
    from tiermem.planner.rates import default_device_budget_bytes
    assert default_device_budget_bytes("cuda", device=here) >= 0


def test_the_planner_reads_the_device_of_the_model_not_the_current_one():
    """A profile's first CUDA record names the device whose links and free
    memory the planner reads; none: the CPU's. Without CUDA a device name
    reads as no device (nothing is initialised)."""
    from types import SimpleNamespace as NS
    planned, probed = tiermem.testing.planned_device, tiermem.testing.probed_device
    assert planned([NS(device="cpu"), NS(device="cuda:1"), NS(device="cuda:0")]) == "cuda:1"
    assert planned([NS(device="cpu")]) is None and planned([]) is None
    assert probed(False) is None and probed("cpu") is None
    if not torch.cuda.is_available():
        assert probed("cuda:1") is None and probed(True) is None
    else:
        assert probed("cuda:0") == torch.device("cuda", 0)
        assert probed(True).index == torch.cuda.current_device()


def test_move_cpu_probe_makes_the_nvme_tiers_cpu_round_trip():
    """The ``move_cpu`` probe writes each tensor as it is (the nvme tier
    stages CUDA tensors only) and reads it back into a new page-aligned
    tensor (no bounce copy): no copy of its own, so it prices what the tier
    does (it copied twice before, over-pricing nvme moves of CPU tensors)."""
    class _Done:
        def wait(self):
            return None

    class _File:
        def __init__(self):
            self.writes, self.reads = [], []

        def write(self, t, offset):
            self.writes.append((t.data_ptr(), offset))
            return _Done()

        def read(self, t, offset):
            self.reads.append((t.data_ptr(), offset))
            return _Done()

    srcs = [torch.full((1024,), 1.5), torch.full((1024,), 2.5)]
    f = _File()
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, *args, **kwargs):
        copies.append(self.shape)
        return real_copy(self, *args, **kwargs)

    torch.Tensor.copy_ = counting_copy
    try:
        tiermem.testing.move_cpu_round_trip(f, srcs)
    finally:
        torch.Tensor.copy_ = real_copy
    assert not copies, copies
    assert f.writes == [(s.data_ptr(), i * 4096) for i, s in enumerate(srcs)]
    assert [o for _, o in f.reads] == [0, 4096]
    assert all(p % 4096 == 0 and p not in {s.data_ptr() for s in srcs} for p, _ in f.reads)


@pytest.mark.gpu
def test_a_profiled_cuda_step_is_timed_on_the_gpus_timeline(monkeypatch):
    """NOTE [Profile times on a GPU]: the host runs ahead of the kernels, so
    a profile stamped on host times saw a forward of launches only. With
    the compute stream synchronized at each stamp, the profiled forward is
    at least the GPU's time for the same forward (measured with events),
    and its packs come in order."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4096, 4096),
                                                       torch.nn.GELU()) for _ in range(8)])
    layers = layers.to(dev)
    x = torch.randn(2048, 4096, device=dev, requires_grad=True)
    for _ in range(2):   # warm-up: kernels chosen, allocator filled
        layers(x).sum().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    layers(x).sum().backward()
    end.record()
    end.synchronize()
    gpu_step_s = start.elapsed_time(end) / 1e3
    syncs = []
    real_sync = torch.cuda.Stream.synchronize
    monkeypatch.setattr(torch.cuda.Stream, "synchronize",
                        lambda self: syncs.append(self) or real_sync(self))
    off = tiermem.Offloader(policy="auto", device_budget="50%")
    with off:
        loss = layers(x).sum()
    loss.backward()
    profiled_syncs = len(syncs)
    profile = next(iter(tiermem.testing.kept_profiles(off).values()), None)
    if profile is None:   # the plan is made when the next step starts
        with off:
            loss = layers(x).sum()
        loss.backward()
        profile = next(iter(tiermem.testing.kept_profiles(off).values()))
    packs = [r.pack_s for r in profile.records]
    assert packs == sorted(packs)
    # A stamp per pack and per first unpack at least, on the compute stream.
    assert profiled_syncs >= 2 * len(profile.records), (profiled_syncs, len(profile.records))
    # The forward is about a third of the step's GPU time; host launches of
    # 16 ops take a small fraction of it.
    assert profile.forward_end_s >= 0.2 * gpu_step_s, (profile.forward_end_s, gpu_step_s)
    off.close()
