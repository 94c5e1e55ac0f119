"""benchmarks/bench_host_cost.py (issue 33) runs end to end at a tiny size and
reports what its docstring promises: every configuration, paired ratios to
plain and to SAC, and the per-op and per-saved-tensor figures. No figure is
asserted (timings belong to benchmarks/results/, not to tests)."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_host_cost.py")


def test_host_cost_bench_reports_every_configuration(tmp_path):
    out = tmp_path / "hc.json"
    subprocess.run([sys.executable, BENCH, "--widths", "32", "--layers", "1", "--seq-len", "8",
                    "--batch", "2", "--rounds", "4", "--warmup", "1", "--threads", "1",
                    "--clock", "cpu", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300, capture_output=True)
    data = json.loads(out.read_text())
    assert len(data["load_average_before_after"]) == 2
    (row,) = data["results"]
    assert row["counts"]["aten_ops"] > 0 and row["counts"]["saved_tensors"] > 0
    configs = row["configs"]
    assert set(configs) == {"plain", "sac_all_save", "sac_usual", "hooks_floor", "dispatch_floor",
                            "tracking_only", "keep", "recompute", "recompute_learning",
                            "recompute_nocheck",
                            "recompute_cpu", "auto_scoped", "auto_whole"}
    # The two configurations that split recompute's cost ran (no timing is compared here).
    assert configs["tracking_only"]["forward_s"] > 0 and configs["dispatch_floor"]["forward_s"] > 0
    for name, c in configs.items():
        assert len(c["forward_samples_s"]) == 4 and c["forward_s"] > 0
        assert 0 < c["setup_s"] < c["forward_s"]
        if name == "plain":
            continue
        assert c["forward_ratio"]["n"] == 4
        assert "forward_extra_us_per_op" in c and "forward_extra_us_per_saved_tensor" in c
        if name != "sac_all_save":
            assert c["forward_ratio_to_sac_all_save"]["n"] == 4
    table = subprocess.run([sys.executable, BENCH, "--summarize", str(out)], check=True,
                           cwd=ROOT, timeout=120, capture_output=True, text=True).stdout
    assert "| recompute |" in table and "/ SAC all-save" in table and "setup µs" in table


def test_cuda_without_a_device_is_refused_clearly():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: nothing to refuse")
    r = subprocess.run([sys.executable, BENCH, "--device", "cuda", "--widths", "32"],
                       cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert r.returncode == 2
    assert "--device cuda: no CUDA device here" in r.stderr


def test_results_record_the_commit_given(tmp_path):
    """A copied tree (a lent GPU machine's) keeps a stale HEAD: TIERMEM_BENCH_COMMIT
    names the commit measured, and the files say their dirtiness is unknown."""
    out = tmp_path / "hc.json"
    env = dict(os.environ, TIERMEM_BENCH_COMMIT="0123abc")
    subprocess.run([sys.executable, BENCH, "--widths", "16", "--layers", "1", "--seq-len", "4",
                    "--batch", "1", "--rounds", "1", "--warmup", "0", "--configs", "plain,keep",
                    "--out", str(out)], check=True, cwd=ROOT, timeout=300, capture_output=True,
                   env=env)
    m = json.loads(out.read_text())["machine"]
    assert m["commit"] == "0123abc" and m["tiermem_dirty"] is None
