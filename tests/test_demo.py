"""``python -m tiermem demo`` trains TinyGPT with the cpu tier and its gradients
match plain autograd bit-for-bit (exit status 0)."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_two_steps_gradients_match_plain_autograd():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    proc = subprocess.run(
        [sys.executable, "-m", "tiermem", "demo", "--steps", "2", "--device", "cpu",
         "--policy", "cpu", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr}"
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 2, out
    assert all("grads match bit-for-bit" in line for line in step_lines), out
    assert all("cpu " in line for line in step_lines), out  # something went to the cpu tier
    assert "gradients match plain autograd bit-for-bit in all 2 steps" in out, out


@pytest.mark.slow
def test_demo_recompute_cpu_policy_runs_and_matches():
    from tiermem.demo import run_demo

    result = run_demo(steps=2, policy="recompute,cpu", device="cpu", progress=False)
    assert len(result.steps) == 2 and result.ok
    assert all(r.count_by_tier["recompute"] > 0 for r in result.steps)
