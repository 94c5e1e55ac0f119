"""The configurations and presets of the suite, and the merge of one
configuration's runs (interleaved timing, isolated memory) into its headline
fields. What each configuration does is in ``benchmarks/models_bench.py``."""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from ..common import summarize

ALL_CONFIGS = ["baseline", "checkpoint", "sac", "save_on_cpu", "torchtune", "deepspeed",
               "tiermem_keep", "tiermem_cpu", "tiermem_nvme", "tiermem_mixed",
               "ckpt_tiermem_cpu", "tiermem_recompute", "tiermem_recompute_cpu",
               "tiermem_recompute_nvme", "tiermem_auto", "tiermem_auto_50", "tiermem_auto_25"]

_GPU_MODEL = dict(layers=12, width=2048, heads=16, seq_len=2048, vocab=8192,
                  dtype="bfloat16", dropout=0.1)

PRESETS: Dict[str, dict] = {
    # CI smoke: every configuration end to end, tiny sizes (no figure is meaningful).
    # The limit has room for a first run that builds the C++ engine (about a
    # minute here) on a slow shared machine: at 240 s a clean CI run on
    # 2026-12-02 reached it before the last (auto) rows.
    "cpu-smoke": dict(device="cpu", layers=2, width=128, heads=4, seq_len=128, batch=2,
                      vocab=512, dtype="float32", dropout=0.1, warmup=1, steps=2,
                      memory_steps=1, interleave=True, memory_jobs=2,
                      ceiling_bytes=16 << 20, ceiling_chunk=4 << 20, timeline="baseline,tiermem_cpu",
                      configs=",".join(ALL_CONFIGS), time_limit=420, max_step_seconds=30.0),
    # The recorded CPU table: small enough for 2 cores in a few minutes.
    "cpu": dict(device="cpu", layers=4, width=256, heads=4, seq_len=256, batch=4,
                vocab=2048, dtype="float32", dropout=0.1, warmup=3, steps=20,
                memory_steps=2, interleave=True, memory_jobs=1,
                ceiling_bytes=256 << 20, ceiling_chunk=16 << 20,
                timeline="baseline,tiermem_cpu", configs=",".join(ALL_CONFIGS),
                time_limit=600, max_step_seconds=30.0),
    # GPU size A: the baseline fits comfortably (~21 GiB estimated, bf16) and
    # activations (~14 GiB) dominate parameters + AdamW states (~5 GiB).
    # Configurations in the order of the bar's rows (auto at 50% against the
    # baseline and the peers first): where each runs alone (NOTE [Interleaving
    # must fit the device]) and the time limit cuts the run, the last go.
    "gpu-a": dict(device="cuda", batch=8, **_GPU_MODEL, warmup=2, steps=8, memory_steps=2,
                  interleave=True, memory_jobs=3, ceiling_bytes=2 << 30,
                  ceiling_chunk=64 << 20, timeline="baseline,tiermem_cpu",
                  configs="baseline,tiermem_auto_50,checkpoint,sac,save_on_cpu,torchtune,"
                          "deepspeed,tiermem_cpu,tiermem_recompute_cpu,tiermem_auto,"
                          "tiermem_auto_25,ckpt_tiermem_cpu,tiermem_mixed,tiermem_nvme,"
                          "tiermem_recompute,tiermem_recompute_nvme,tiermem_keep",
                  time_limit=200, max_step_seconds=8.0),
    # GPU size B: the same model at twice the batch under a 24 GiB device budget
    # (a 24 GB card): the baseline (~36 GiB estimated) does not fit. Each
    # configuration runs alone under the budget (no interleaving possible).
    "gpu-b": dict(device="cuda", batch=16, **_GPU_MODEL, warmup=1, steps=3, memory_steps=3,
                  interleave=False, memory_jobs=1, device_budget="24GiB",
                  ceiling_bytes=1 << 30, ceiling_chunk=64 << 20,
                  timeline="checkpoint,tiermem_cpu",
                  # Run order = this order (one after another): if the time limit
                  # cuts the run short, the last ones are reported as not run.
                  configs="baseline,tiermem_cpu,checkpoint,tiermem_mixed,ckpt_tiermem_cpu,"
                          "tiermem_recompute_cpu,sac,deepspeed,torchtune,save_on_cpu",
                  time_limit=170, max_step_seconds=8.0),
}

# Without --preset; any option on the command line overrides (cli.resolve).
DEFAULTS = dict(device="auto", layers=4, width=256, heads=4, seq_len=256, batch=4,
                vocab=2048, dtype="float32", dropout=0.1, warmup=3, steps=10,
                memory_steps=2, interleave=True, memory_jobs=1, ceiling_bytes=256 << 20,
                ceiling_chunk=16 << 20, timeline="baseline,tiermem_cpu",
                configs=",".join(ALL_CONFIGS), time_limit=1800, max_step_seconds=30.0,
                device_budget=None)


# NOTE [Interleaving must fit the device]
# The interleaved child holds every configuration's model and AdamW states at
# once (a runner each), and one step's activations on top. For gpu-a (625 M
# parameters in bf16) that is 4.7 GiB of state per configuration, 79 GiB for
# 17: more than an 80 GB card holds, and the configurations timed last in a
# round ran out of memory and were reported as such, though each fits alone.
# So on CUDA, where the states of all configurations would take more than
# INTERLEAVE_STATE_SHARE of the device's memory, the suite times each
# configuration alone instead (each in its own process, one after another,
# as gpu-b always does), and says so in the JSON's notes.
INTERLEAVE_STATE_SHARE = 0.75

#: Measured steps of each configuration's own process in that case (with
#: ``warmup`` before them): the suite's budget on a GPU machine is minutes.
SOLO_STEPS_CUDA = 4

# NOTE [Timings of runs that shared the machine]
# The isolated runs measure memory, ``memory_jobs`` of them at a time. When a
# configuration's interleaved run gave no times, its timing used to fall
# back to its isolated run, which may have shared the GPU (and PCIe, disk,
# cores) with two others: not a step time. Such a run says so
# (``shared_device``) and gives no timing; the row reads "partial".

#: Bytes of training state per parameter byte: the parameter, its gradient and
#: AdamW's two states, all in the model's dtype (pure low-precision training).
STATE_BYTES_PER_PARAMETER_BYTE = 4


def interleaved_state_bytes(parameter_bytes: int, n_runners: int) -> int:
    """Bytes of model and optimizer state the interleaved child holds at once."""
    return STATE_BYTES_PER_PARAMETER_BYTE * parameter_bytes * n_runners


def interleave_fits(parameter_bytes: int, n_runners: int, device_total_bytes: int) -> bool:
    """Whether ``n_runners`` configurations fit in one process on a device of
    ``device_total_bytes``: NOTE [Interleaving must fit the device]."""
    return (interleaved_state_bytes(parameter_bytes, n_runners)
            <= INTERLEAVE_STATE_SHARE * device_total_bytes)


def merge_config(e: dict, opts: dict) -> None:
    """Fill the headline fields of one configuration from its runs."""
    inter, iso = e.get("interleaved"), e.get("isolated")
    spec_tokens = opts["spec"]["batch"] * opts["spec"]["seq_len"]
    for k in ("status", "reason", "failed_at_step"):
        if e.get("status") != "skipped" and k != "status":
            e.pop(k, None)
    if e.get("status") == "skipped":
        return
    timing = None
    if inter and inter.get("status") == "ok" and inter.get("times"):
        timing, mode = inter, "interleaved"
    elif iso and iso.get("status") == "ok" and iso.get("times"):
        timing, mode = iso, "isolated"
    statuses = [r.get("status") for r in (inter, iso) if r]
    if timing is not None and timing is iso and iso.get("shared_device"):   # NOTE [Timings of runs that shared the machine]
        timing = None
    if "oom" in statuses:
        e["status"] = "oom"
        src = inter if (inter and inter.get("status") == "oom") else iso
        e["reason"] = src.get("reason")
        e["failed_at_step"] = src.get("failed_at_step")
    elif timing is None and iso and iso.get("shared_device") and iso.get("status") == "ok":
        e["status"] = "partial"
        why = ("the interleaved run gave none" if not inter or inter.get("status") == "ok"
               else f"the interleaved run: {inter.get('status')}: {inter.get('reason')}")
        e["reason"] = (f"no timing: {why}, and the isolated run shared the machine with "
                       "other configurations' runs")
    elif timing is not None and all(s == "ok" for s in statuses):
        e["status"] = "ok"
    elif timing is not None:
        bad = [r for r in (inter, iso) if r and r.get("status") != "ok"][0]
        e["status"] = "partial"
        e["reason"] = f"{bad.get('status')}: {bad.get('reason')}"
    else:
        bad = [r for r in (inter, iso) if r and r.get("status") != "ok"]
        e["status"] = bad[0].get("status") if bad else "not_run"
        e["reason"] = bad[0].get("reason") if bad else "no run"
    if timing is not None:
        e["timing_mode"] = mode
        e["step_seconds"] = summarize([float(t) for t in timing["times"]], mean=False)
        e["tokens_per_second"] = spec_tokens / e["step_seconds"]["median"]
        ph = timing.get("phases") or []
        if ph:
            e["phase_seconds_median"] = {k: statistics.median([p[k] for p in ph])
                                         for k in ph[0]}
        src_stats = timing
        e["tiermem"] = _tiermem_summary(src_stats.get("tiermem_last_step"),
                                        src_stats.get("tiermem_steps") or [])
        if timing.get("peer_stats"):
            e["peer_stats"] = timing["peer_stats"]
        if timing.get("extra"):
            e["extra"] = timing["extra"]
    if iso:
        for k in ("peak_device_bytes", "peak_device_reserved_bytes", "peak_host_bytes",
                  "peak_host_increase_bytes", "host_peak_method", "state_bytes",
                  "device_allocated_after_setup_bytes"):
            if iso.get(k) is not None:
                e[k] = iso[k]
        held = [b for b in iso.get("forward_held_bytes") or [] if b is not None]
        if held:
            e["forward_held_bytes"] = int(statistics.median(held))
        pin = iso.get("pinned_host") or {}
        if pin.get("allocated_bytes_peak") is not None:
            e["peak_pinned_host_bytes"] = pin["allocated_bytes_peak"]
        if e.get("tiermem") is None and iso.get("tiermem_last_step"):
            e["tiermem"] = _tiermem_summary(iso["tiermem_last_step"], iso.get("tiermem_steps") or [])


def _tiermem_summary(stats_last: Optional[dict], per_step: List[dict]) -> Optional[dict]:
    if stats_last is None:
        return None
    out = {"last_step": stats_last}
    if per_step:
        out["stall_seconds"] = summarize([float(s["stall_seconds"]) for s in per_step],
                                         mean=False)
        out["late_restores_max"] = max(s["late_restores"] for s in per_step)
        out["late_restores_last"] = per_step[-1]["late_restores"]
        out["prefetch_misses_max"] = max(s["prefetch_misses"] for s in per_step)
    return out
