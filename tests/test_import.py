"""`import tiermem` is lean: it must not initialise CUDA (checked in a fresh process)."""

import subprocess
import sys

import tiermem


def test_import_does_not_initialise_cuda():
    code = ("import torch, tiermem; "
            "import tiermem.offloader, tiermem.tiers.host, tiermem.tiers.nvme, tiermem.runtime.copier; "
            "tiermem.Offloader(policy='cpu'); "
            "print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_public_names_are_exported():
    for name in tiermem.__all__:
        assert hasattr(tiermem, name), name
    for name in ("Offloader", "offload", "no_offload", "Tier", "TensorInfo", "Config",
                 "ConfigError", "TierMemError", "StepStats", "engine_info"):
        assert name in tiermem.__all__
    assert issubclass(tiermem.ConfigError, ValueError)
    assert issubclass(tiermem.TierMemError, RuntimeError)
    assert [t.value for t in tiermem.Tier] == ["keep", "cpu", "nvme", "recompute"]


def test_import_does_not_import_the_integrations_frameworks():
    """``tiermem.integrations`` imports its frameworks only in their submodules."""
    code = ("import sys, tiermem, tiermem.integrations; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
