"""The demo fails only when tiermem changed a result: run repeatedly beside a busy
process, with tiermem disabled and under every policy, it never reports a
mismatch (NOTE [What the demo compares] in tiermem/demo.py)."""

import subprocess
import sys

import pytest

from tiermem.__main__ import main


@pytest.fixture
def cpu_hog():
    """A process spinning on a CPU core for the whole test."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


@pytest.mark.slow
def test_the_demo_never_fails_beside_a_busy_process(cpu_hog, capsys, monkeypatch, tmp_path):
    runs = [("disabled", "keep")] + [("on", p) for p in ("keep", "cpu", "nvme", "recompute",
                                                         "auto")]
    outputs = []
    for round_ in range(2):
        for mode, policy in runs:
            if mode == "disabled":
                monkeypatch.setenv("TIERMEM_DISABLE", "1")
            else:
                monkeypatch.delenv("TIERMEM_DISABLE", raising=False)
            nvme = ["--nvme-dir", str(tmp_path / "nvme")] if policy == "nvme" else []
            status = main(["demo", "--steps", "2", "--batch", "2", "--policy", policy, *nvme,
                           "--no-progress", "--seed", str(round_)])
            out = capsys.readouterr().out
            outputs.append((mode, policy, status, out))
    failed = [(m, p, out) for m, p, status, out in outputs if status != 0 or "FAILED" in out]
    assert not failed, failed
    assert all("bit for bit (torch.equal)" in out for *_, out in outputs)


def test_the_demo_runs_both_models_on_one_thread_and_restores_the_setting():
    import torch

    from tiermem.demo import run_demo

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    try:
        result = run_demo(steps=1, batch=2, policy="keep", progress=False,
                          on_step=lambda r: seen.append(torch.get_num_threads()))
        assert result.ok and seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
