"""NOTE [Interleaving must fit the device] in benchmarks/suite/configs.py: on
CUDA the suite times each configuration alone where one process could not
hold every configuration's model and AdamW states.

Runtime: under a second (no model is run; the parameter count is built on the
meta device)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.suite import configs  # noqa: E402
from benchmarks.suite.orchestrate import Suite  # noqa: E402

GB = 10 ** 9


def _gpu_a_parameter_bytes() -> int:
    import torch
    from benchmarks.models_bench import ModelSpec, build_model
    spec = {k: v for k, v in configs.PRESETS["gpu-a"].items()
            if k in ModelSpec.__dataclass_fields__}
    m = build_model(ModelSpec(**spec), torch.device("meta"), 0)
    return sum(p.numel() * p.element_size() for p in m.parameters())


def test_gpu_a_interleaves_on_an_h200_and_not_on_an_h100():
    pbytes = _gpu_a_parameter_bytes()
    assert 1.1e9 < pbytes < 1.4e9   # ~625 M bf16 parameters
    n = len(configs.ALL_CONFIGS)
    assert configs.interleaved_state_bytes(pbytes, n) > 70 * 2 ** 30
    assert not configs.interleave_fits(pbytes, n, 80 * GB)       # H100
    assert configs.interleave_fits(pbytes, n, 141 * GB)          # H200
    assert configs.interleave_fits(pbytes, 8, 80 * GB)
    order = configs.PRESETS["gpu-a"]["configs"].split(",")
    assert sorted(order) == sorted(configs.ALL_CONFIGS), "every configuration, once"
    assert order[:2] == ["baseline", "tiermem_auto_50"], "the bar's rows first"


def test_a_timing_from_a_run_that_shared_the_machine_is_not_taken():
    """NOTE [Timings of runs that shared the machine]."""
    opts = {"spec": {"batch": 2, "seq_len": 8}}
    iso = {"status": "ok", "times": [0.5, 0.5], "shared_device": True}
    e = {"interleaved": {"status": "ok", "times": []}, "isolated": dict(iso)}
    configs.merge_config(e, opts)
    assert e["status"] == "partial" and "shared the machine" in e["reason"]
    assert "step_seconds" not in e
    e = {"interleaved": {"status": "error", "reason": "boom"}, "isolated": dict(iso)}
    configs.merge_config(e, opts)
    assert e["status"] == "partial" and "boom" in e["reason"]
    alone = dict(iso, shared_device=False)
    e = {"interleaved": {"status": "ok", "times": []}, "isolated": alone}
    configs.merge_config(e, opts)
    assert e["status"] == "ok" and e["timing_mode"] == "isolated"


def test_a_configuration_too_slow_to_time_and_not_run_alone_is_reported_not_a_crash():
    # The interleaved run dropped it (a warm-up step over --max-step-seconds)
    # and no isolated run followed: the report says why instead of raising.
    opts = {"spec": {"batch": 2, "seq_len": 8}}
    e = {"status": "pending",
         "interleaved": {"status": "too_slow", "times": [], "reason": "warm-up step 1 took 33 s"}}
    configs.merge_config(e, opts)
    assert e["status"] == "too_slow" and "33 s" in e["reason"]
    assert "step_seconds" not in e


def _suite(interleave: bool = True, device: str = "cuda") -> Suite:
    s = Suite.__new__(Suite)
    s.opts = {"interleave": interleave, "device": device, "repeat_baseline": True,
              "steps": 8, "warmup": 2}
    return s


def _res(total, pbytes):
    return {"machine": {"cuda_device": {"memory_bytes": total}},
            "model": {"parameter_bytes": pbytes}, "settings": {"interleave": True},
            "notes": []}


def test_the_suite_times_each_configuration_alone_where_they_do_not_fit():
    runnable = list(configs.ALL_CONFIGS)
    s, res = _suite(), _res(80 * GB, 1_250_000_000)
    s._fit_interleaving(res, runnable)
    assert s.opts["interleave"] is False and res["settings"]["interleave"] is False
    assert s.opts["solo_steps"] == res["settings"]["solo_steps"] == configs.SOLO_STEPS_CUDA
    assert "timed each configuration alone" in res["notes"][0]
    s, res = _suite(), _res(141 * GB, 1_250_000_000)
    s._fit_interleaving(res, runnable)
    assert s.opts["interleave"] is True and not res["notes"]
    for s, res in ((_suite(device="cpu"), _res(1, 1 << 30)), (_suite(), _res(None, 1 << 30))):
        s._fit_interleaving(res, runnable)   # the CPU, or no device size known: as asked
        assert s.opts["interleave"] is True and not res["notes"]
