"""``examples/fsdp2_torchrun.py`` runs under torchrun with 2 CPU ranks (gloo),
through ``python -m torch.distributed.run --standalone`` (its rendezvous takes
a free port), bounded in time. Runtime here: about 6 s."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def test_fsdp2_example_trains_on_two_ranks_with_the_nvme_tier(tmp_path):
    nvme_dir = tmp_path / "nvme"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + env.get("PYTHONPATH", "").split(os.pathsep))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", os.path.join(ROOT, "examples", "fsdp2_torchrun.py"), "--policy", "nvme",
           "--nvme-dir", str(nvme_dir), "--steps", "2", "--engine", "python"]
    try:
        run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the example did not finish in 120 s:\n{e.stdout}\n{e.stderr}")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    for rank in (0, 1):
        steps = re.findall(rf"\[rank {rank}/2\] step (\d) loss [0-9.]+ \| tiermem step: "
                           r"keep \d+ \([^)]*\), nvme \d+", run.stdout)
        assert steps == ["0", "1"], out[-4000:]
    assert nvme_dir.is_dir() and list(nvme_dir.iterdir()) == []   # both ranks cleaned up
