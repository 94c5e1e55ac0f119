"""The side-by-side benchmark suite runs end to end on the CPU (its smoke form).

``python -m benchmarks.suite --preset cpu-smoke`` runs every configuration at a tiny
size in fresh processes (probe + ceilings, interleaved timing, one process per
configuration for peak memory). No figure is asserted: only that the matrix
ran, that configurations which must run here did, that their losses and final
states are bit-identical to the baseline, and that the outputs are complete.
About 30-40 s on 2 cores.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a module from the repository root (as documented); the suite starts
# its children by the path of benchmarks/suite/__main__.py, which works from any
# directory (test_runs_by_path_from_any_directory).
SUITE = [sys.executable, "-m", "benchmarks.suite"]

MUST_RUN = ["baseline", "checkpoint", "sac", "save_on_cpu", "tiermem_keep", "tiermem_cpu",
            "tiermem_nvme", "tiermem_mixed", "ckpt_tiermem_cpu", "tiermem_auto_50",
            "tiermem_auto_25"]


def _has(mod):
    try:
        __import__(mod)
        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    nvme = tmp_path_factory.mktemp("nvme")
    cmd = SUITE + ["--preset", "cpu-smoke", "--out-dir", str(out),
                   "--name", "smoke", "--nvme-dir", str(nvme), "--progress", "none",
                   "--device", "cpu", "--repeat-baseline"]
    # The preset's time limit (420 s) plus the C++ engine's build, which the
    # suite does not count against it (NOTE [The engine is built before the
    # clock] in benchmarks/suite/orchestrate.py): a bound, not the expected time.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "smoke.json") as f:
        res = json.load(f)
    return out, res, proc


@pytest.mark.slow
def test_the_engine_is_built_before_the_timed_probe(smoke):
    _, res, _ = smoke
    assert list(res["phases"])[:2] == ["build", "probe"]
    assert res["engine_build"]["status"] in ("ok", "failed")
    if res["engine_build"]["status"] == "ok":
        assert res["io_engine"]["engine"] == "cpp", res["io_engine"]
    else:
        assert any("engine was not built" in n for n in res["notes"])
    assert "probe_error" not in res, res.get("probe_error")


@pytest.mark.slow
def test_every_config_reported(smoke):
    _, res, _ = smoke
    assert set(res["configs"]) == set(res["configs_requested"])
    for name, e in res["configs"].items():
        assert e["status"] in ("ok", "skipped", "oom", "too_slow", "error", "partial",
                               "timeout", "not_run"), name
        if e["status"] != "ok":
            assert e.get("reason"), f"{name}: status {e['status']} without a reason"


@pytest.mark.slow
def test_must_run_configs_ran_and_are_exact(smoke):
    _, res, _ = smoke
    assert res["exactness_reference"] == "baseline"
    for name in MUST_RUN:
        e = res["configs"][name]
        assert e["status"] == "ok", (name, e.get("reason"))
        assert e["timing_mode"] == "interleaved"
        st = e["step_seconds"]
        assert st["n"] == res["settings"]["steps"] and 0 < st["min"] <= st["median"] <= st["max"]
        assert e["tokens_per_second"] > 0
        assert e["peak_host_bytes"] > 0 and e["peak_host_increase_bytes"] is not None
        ex = e["exact"]
        assert ex["bit_identical"] is True, (name, ex)
        assert ex["interleaved_losses_equal"] and ex["interleaved_state_equal"], (name, ex)
        assert ex["isolated_losses_equal"] and ex["isolated_state_equal"], (name, ex)


@pytest.mark.slow
def test_tiermem_rows_moved_what_their_policy_says(smoke):
    _, res, _ = smoke
    c = res["configs"]
    assert c["tiermem_keep"]["tiermem"]["last_step"]["bytes_by_tier"]["cpu"] == 0
    assert c["tiermem_cpu"]["tiermem"]["last_step"]["bytes_by_tier"]["cpu"] > 0
    nv = c["tiermem_nvme"]["tiermem"]["last_step"]["bytes_by_tier"]
    assert nv["nvme"] > 0
    mixed = c["tiermem_mixed"]["tiermem"]["last_step"]["bytes_by_tier"]
    assert 0 < mixed["cpu"] < c["tiermem_cpu"]["tiermem"]["last_step"]["bytes_by_tier"]["cpu"]
    assert mixed["keep"] > 0
    for name in ("tiermem_cpu", "tiermem_nvme"):
        a = res["link_analysis"]["configs"][name]
        assert a["moved_bytes"] > 0 and a["d2h_seconds"] > 0 and a["bound_step_seconds"] > 0
    assert res["link_analysis"]["configs"]["tiermem_nvme"]["disk_write_seconds"] > 0


@pytest.mark.slow
def test_baseline_repeat_control(smoke):
    _, res, _ = smoke
    rep = res["interleaved"]["baseline_repeat"]
    assert rep["reproducible"] is True and rep["steps_compared"] >= 2
    assert "_baseline_repeat" not in res["configs"]


@pytest.mark.slow
def test_ceilings_and_machine(smoke):
    _, res, _ = smoke
    ceil = res["ceilings"]
    assert ceil["host_copy"]["gbps"] > 0
    assert "skipped" in ceil["cuda"]  # CPU-only: said so, not invented
    assert ceil["disk"]["write_gbps"] > 0 and ceil["disk"]["read_gbps"] > 0
    m = res["machine"]
    for k in ("cpu_model", "ram_total_bytes", "torch", "nvme_dir", "date"):
        assert m.get(k), k


@pytest.mark.slow
def test_peers_say_whether_they_ran(smoke):
    _, res, _ = smoke
    for peer in ("torchtune", "deepspeed"):
        p = res["peers"][peer]
        assert p["ran"] in (True, False)
        if not p["ran"]:
            assert p["reason"]
    # torchtune's offloading needs CUDA: it can never run on this machine.
    assert res["peers"]["torchtune"]["ran"] is False
    assert res["configs"]["tiermem_recompute"]["status"] == "ok"
    assert res["configs"]["tiermem_auto"]["status"] == "ok"   # the planner runs (issue 12)


@pytest.mark.slow
def test_outputs(smoke):
    out, res, _ = smoke
    md = (out / "smoke.md").read_text()
    assert "| tiermem_cpu | ok |" in md and "Ceilings measured in this run" in md
    # The planner's budgets: saved bytes left in RAM per configuration.
    assert "Saved bytes left in RAM against the planner's budgets" in md
    assert "| tiermem_auto_50 |" in md.split("planner's budgets")[1]
    assert res["configs"]["baseline"]["forward_held_bytes"] > 0
    plan = res["configs"]["tiermem_auto_50"]["extra"]["plan"]
    assert plan["budget_setting"] == "50%" and plan["profiles"] == 1
    tl = res["configs"]["baseline"]["isolated"]["timeline"]
    assert len(tl["t_seconds"]) == len(tl["host_bytes"]) > 2
    if _has("matplotlib"):
        assert res["plots"]["written"] == ["smoke-pareto.png", "smoke-timeline.png"]
        for f in res["plots"]["written"]:
            assert (out / f).stat().st_size > 10_000
    else:
        assert "matplotlib" in res["plots"]["skipped"]


@pytest.mark.slow
def test_plots_and_rerender_from_json(smoke, tmp_path):
    out, res, _ = smoke
    src = tmp_path / "again.json"
    src.write_text(json.dumps(res))
    proc = subprocess.run(SUITE + ["--rerender", str(src), "--no-plots"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| baseline | ok |" in (tmp_path / "again.md").read_text()
    if not _has("matplotlib"):
        pytest.skip("matplotlib not installed")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plots.py"),
                           str(src)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "again-pareto.png").exists()


def test_runs_by_path_from_any_directory(smoke, tmp_path):
    """``python PATH/benchmarks/suite`` (the suite starts its children by such a
    path) works outside the repository root."""
    _, res, _ = smoke
    src = tmp_path / "elsewhere.json"
    src.write_text(json.dumps(res))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "suite"),
                           "--rerender", str(src), "--no-plots"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| baseline | ok |" in (tmp_path / "elsewhere.md").read_text()


def test_gpu_suite_script_parses():
    proc = subprocess.run(["bash", "-n", os.path.join(ROOT, "benchmarks", "gpu_suite.sh")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
