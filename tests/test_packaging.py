"""A wheel of tiermem carries the C++ engine's sources (tiermem/_csrc), so the
engine builds outside a source checkout too."""

import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import tiermem.testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_wheel_contains_the_engine_sources_and_the_engine_compiled_for_this_torch(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
         ROOT, "-w", str(tmp_path)], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "No module named pip" in proc.stderr:
        pytest.skip("pip is not available in this interpreter")
    assert proc.returncode == 0, proc.stderr
    (wheel,) = glob.glob(str(tmp_path / "tiermem-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in ("io_engine.cpp", "io_engine.h", "tensor_release.h", "tensor_release.cpp",
                "bindings.cpp", "checks.h", "cuda_chain.h", "cuda_chain.cpp", "cuda_bindings.h",
                "cuda_bindings.cpp"):
        assert f"tiermem/_csrc/{src}" in names, sorted(names)
    # Every module of the source tree is in the wheel (packages are discovered,
    # so a new subpackage cannot be left out).
    pkg = os.path.join(ROOT, "tiermem")
    for dirpath, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")
                assert rel in names, f"{rel} missing from the wheel"
    assert any(n.endswith("licenses/LICENSE") for n in names), sorted(names)
    # Built without isolation where a compiler is: the engine is compiled in,
    # stamped with this torch and these sources (NOTE [Engine build identity]).
    if shutil.which(os.environ.get("CXX", "c++").split()[0]) is None:
        return
    from tiermem.io import buildkey
    assert any(n.startswith("tiermem/_C.") and n.endswith(".so") for n in names), sorted(names)
    stamp = json.loads(zipfile.ZipFile(wheel).read("tiermem/" + buildkey.PREBUILT_STAMP))
    assert buildkey.stamp_mismatch(stamp, torch.__version__, buildkey.variant_sha256(
        os.path.join(ROOT, "csrc"), stamp["cuda"])) is None, stamp


def test_source_checkout_uses_its_csrc():
    assert os.path.samefile(tiermem.testing.engine_source_dir(), os.path.join(ROOT, "csrc"))


def test_version_has_one_source_and_the_cli_prints_it():
    import ast
    import tiermem
    with open(os.path.join(ROOT, "tiermem", "_version.py")) as f:   # what pyproject reads
        (assign,) = [n for n in ast.parse(f.read()).body if isinstance(n, ast.Assign)]
    __version__ = ast.literal_eval(assign.value)
    assert tiermem.__version__ == __version__
    proc = subprocess.run([sys.executable, "-m", "tiermem", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"tiermem {__version__}"
