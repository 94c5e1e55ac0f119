"""Builds of the C++ engine are keyed by torch and sources, announced, and shared
(NOTE [Engine build identity] in tiermem/io/buildkey.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tiermem.io import build, buildkey

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")


def _copy_csrc(dest):
    shutil.copytree(CSRC, dest, ignore=shutil.ignore_patterns("tests"))
    return str(dest)


@pytest.mark.parametrize("cuda", [False, True])
def test_the_same_sources_anywhere_have_the_same_build_name(tmp_path, cuda):
    a, b = _copy_csrc(tmp_path / "a"), _copy_csrc(tmp_path / "b" / "deeper")
    names = {buildkey.build_name(torch.__version__, cuda, buildkey.variant_sha256(d, cuda))
             for d in (CSRC, a, b)}
    assert len(names) == 1


@pytest.mark.parametrize("changed", ["io_engine.cpp", "checks.h"])
def test_a_changed_source_or_header_changes_the_build_name(tmp_path, changed):
    d = _copy_csrc(tmp_path / "src")
    before = buildkey.build_name(torch.__version__, False, buildkey.variant_sha256(d, False))
    with open(os.path.join(d, changed), "a") as f:
        f.write("\n// changed\n")
    after = buildkey.build_name(torch.__version__, False, buildkey.variant_sha256(d, False))
    assert before != after


def test_the_torch_version_and_the_cuda_variant_change_the_build_name():
    sha = buildkey.variant_sha256(CSRC, False)
    names = {buildkey.build_name("2.13.0+cpu", False, sha),
             buildkey.build_name("2.14.1+cu128", False, sha),
             buildkey.build_name("2.13.0+cpu", True, sha)}
    assert len(names) == 3
    assert all(n.isidentifier() for n in names)


def _fake_prebuilt(tmp_path, monkeypatch, stamp):
    """A package whose ``_C`` stands for an installed engine, with ``stamp`` beside it."""
    name = f"fakeinstall_{abs(hash(str(tmp_path)))}"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_C.py").write_text("WITH_CUDA = False\n")
    if stamp is not None:
        (pkg / buildkey.PREBUILT_STAMP).write_text(json.dumps(stamp))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(buildkey, "PREBUILT_MODULE", f"{name}._C")


def test_the_install_build_is_used_when_it_fits_this_torch_and_these_sources(
        tmp_path, monkeypatch):
    stamp = buildkey.make_stamp(torch.__version__, False, buildkey.variant_sha256(CSRC, False),
                                "torch is a CPU-only build")
    _fake_prebuilt(tmp_path, monkeypatch, stamp)
    mod, note = build.prebuilt(CSRC)
    assert mod is not None and mod.__name__ == buildkey.PREBUILT_MODULE
    assert note == "built at install: torch is a CPU-only build"


@pytest.mark.parametrize("stamp, why", [
    (buildkey.make_stamp("1.99.0", False, buildkey.variant_sha256(CSRC, False)),
     f"it was built for torch 1.99.0, this is torch {torch.__version__}"),
    (buildkey.make_stamp(torch.__version__, False, "0" * 64),
     "it was built from other sources than the ones installed"),
    (None, "it has no readable build stamp"),
])
def test_an_install_build_that_does_not_fit_is_not_used_and_says_why(
        tmp_path, monkeypatch, stamp, why):
    _fake_prebuilt(tmp_path, monkeypatch, stamp)
    mod, reason = build.prebuilt(CSRC)
    assert mod is None
    assert reason.endswith(why) and "built at install" in reason


_LOAD = """
from tiermem.io import build, buildkey, cpp, get_engine
buildkey.PREBUILT_MODULE = "tiermem._not_installed"   # the run-time build is tested here
cpp.load_extension()
get_engine("cpp", 2).close()
print(cpp.extension_path())
"""


@pytest.mark.slow
def test_a_runtime_build_is_announced_once_and_shared_by_the_next_process(tmp_path):
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    first, second = (subprocess.run([sys.executable, "-c", _LOAD], capture_output=True,
                                    text=True, env=env, timeout=900) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stderr.count(build.BUILD_MESSAGE) == 1, first.stderr
    assert len(first.stderr.strip().splitlines()) == 1, first.stderr   # that line alone
    assert build.BUILD_MESSAGE not in second.stderr, second.stderr
    assert first.stdout == second.stdout
    name = buildkey.build_name(torch.__version__, False, buildkey.variant_sha256(CSRC, False))
    assert os.path.basename(os.path.dirname(first.stdout.strip())) == name
