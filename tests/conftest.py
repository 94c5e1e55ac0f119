"""Shared pytest setup: markers, a clean environment, and the fixtures over
tiers, engines and models.

- Tests marked ``gpu`` are skipped when ``torch.cuda.is_available()`` is false.
  Tests marked ``slow`` (over ~1.5 s here, and the long sweeps) are left out
  by default (pyproject's ``addopts``); ``-m slow`` runs them (CI runs both).
- ``clean_env`` (autouse): no ``TIERMEM_*`` variable is set while a test runs,
  so that a developer's settings cannot change what it checks, except
  ``TIERMEM_TAIL_HOLD_BYTES=0`` (see the fixture). A test that
  needs one sets it with ``monkeypatch.setenv`` (applied after the clearing).
- ``tier``: each policy string of :data:`helpers.TIERS` (keep, cpu, nvme,
  recompute, recompute,cpu); ``storage_tier``: keep, cpu, nvme.
- ``make_off(policy, **settings)``: an Offloader (``helpers.offloader``: every
  tensor through the policy, the Python engine) closed at teardown; a named
  policy that mentions nvme gets ``nvme_dir``, a fresh directory of the test
  (a callable policy that may answer nvme passes ``nvme_dir=nvme_dir``).
- ``nvme_dir``: that directory (a path string, not created yet).
- ``engine``: ``"python"`` and ``"cpp"`` (skipped with the reason when the C++
  engine cannot be built).
- ``model_case``: a fresh :class:`models.Case` of each of
  :data:`models.MODEL_NAMES` (same parameters and inputs as
  ``make_case(case.name)``).
- ``deterministic``: deterministic kernels for the test (GPU bit-exactness;
  ``CUBLAS_WORKSPACE_CONFIG`` is set at import, before CUDA starts).
- ``TIERMEM_TEST_TIMEOUT_S`` (read once, at start; benchmarks/gpu_suite.sh sets
  it): a test running longer fails with ``TimeoutError`` and the run goes on
  (SIGALRM, main thread; a test stuck in C code without the GIL is only
  stopped by the suite's own limit).
"""

from __future__ import annotations

import os
import signal
import sys

# cuBLAS under deterministic algorithms (the ``deterministic`` fixture) needs
# this set before CUDA starts: here, so that any one test file run alone has
# it (tests/test_gpu.py and test_gpu_engine.py set it too, for themselves).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import helpers  # noqa: E402  (tests/helpers.py, not collected)
import models  # noqa: E402  (tests/models.py, not collected)

_TEST_TIMEOUT_S = int(os.environ.get("TIERMEM_TEST_TIMEOUT_S", "0") or 0)


@pytest.fixture(autouse=True)
def _per_test_timeout():
    """``TIERMEM_TEST_TIMEOUT_S`` (see the module docstring); no-op when unset."""
    if _TEST_TIMEOUT_S <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"test ran over TIERMEM_TEST_TIMEOUT_S={_TEST_TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(_TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Every ``TIERMEM_*`` variable removed for the test (restored after it),
    but ``TIERMEM_TAIL_HOLD_BYTES=0``: tests written for the restore paths
    (prefetch counts, restores from disk after landing, in-place checks of
    copies) keep exercising them on models small enough that the default
    tail hold would keep every moved source (NOTE [Tail hold] in
    tiermem/runtime/tailhold.py). tests/test_tail_hold.py turns it on explicitly."""
    for key in list(os.environ):
        if key.startswith("TIERMEM_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("TIERMEM_TAIL_HOLD_BYTES", "0")


@pytest.fixture(params=helpers.TIERS)
def tier(request) -> str:
    return request.param


@pytest.fixture(params=helpers.STORAGE_TIERS)
def storage_tier(request) -> str:
    return request.param


@pytest.fixture(params=helpers.ENGINES)
def engine(request) -> str:
    if request.param == "cpp":
        reason = helpers.cpp_engine_unavailable()
        if reason:
            pytest.skip(f"C++ engine unavailable: {reason}")
    return request.param


@pytest.fixture(params=models.MODEL_NAMES)
def model_case(request) -> models.Case:
    return models.make_case(request.param)


@pytest.fixture
def nvme_dir(tmp_path) -> str:
    return str(tmp_path / "spill")


@pytest.fixture
def make_off(nvme_dir):
    made = []

    def make(policy, **settings):
        if helpers.names_nvme(policy):
            settings.setdefault("nvme_dir", nvme_dir)
        off = helpers.offloader(policy, **settings)
        made.append(off)
        return off

    yield make
    for off in made:
        off.close()


@pytest.fixture
def deterministic():
    """Bit-exact comparisons across runs on a GPU need deterministic kernels."""
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(old)
