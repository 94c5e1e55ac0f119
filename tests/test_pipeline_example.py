"""``examples/pipeline_torchrun.py`` runs under torchrun with 2 CPU ranks (gloo),
one pipeline stage each, through ``python -m torch.distributed.run --standalone``
(its rendezvous takes a free port), bounded in time; the example itself checks
its training against the same pipeline without tiermem. Runtime here: about 5 s."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def _run(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + env.get("PYTHONPATH", "").split(os.pathsep))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", os.path.join(ROOT, "examples", "pipeline_torchrun.py"), *args]
    try:
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the example did not finish in 120 s:\n{e.stdout}\n{e.stderr}")


def test_pipeline_example_trains_two_stages_bit_identically_with_recompute_and_nvme(tmp_path):
    nvme_dir = tmp_path / "nvme"
    run = _run(tmp_path, "--policy", "recompute,nvme", "--nvme-dir", str(nvme_dir),
               "--engine", "python", "--steps", "2")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    for rank in (0, 1):
        loss = r" loss [0-9.]+" if rank == 1 else ""   # the last stage has the loss
        steps = re.findall(rf"\[rank {rank}/2\] stage {rank} step (\d){loss} \| (\d) microbatch "
                           r"steps: keep \d+ \([^)]*\), nvme [1-9]\d* \([^)]*\), recompute "
                           r"[1-9]\d* \([^)]*\) \| recomputed [1-9]", run.stdout)
        assert steps == [("0", "5"), ("1", "4")], out[-4000:]   # step 0: + the shape inference
        assert f"[rank {rank}/2] OK: stage {rank} bit-identical" in run.stdout, out[-4000:]
    assert nvme_dir.is_dir() and list(nvme_dir.iterdir()) == []   # both ranks cleaned up


def test_pipeline_example_exits_nonzero_when_a_tier_is_not_used(tmp_path):
    # Every tensor is under the default min_offload_bytes when the model is tiny:
    # nothing moves, which the example must report as a failure.
    run = _run(tmp_path, "--policy", "cpu", "--width", "8", "--seq-len", "4", "--steps", "1",
               "--no-check")
    assert run.returncode != 0, (run.stdout + run.stderr)[-4000:]
    assert "FAILED: step 0: a microbatch step did not use cpu" in run.stdout
