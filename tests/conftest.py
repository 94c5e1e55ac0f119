"""Shared pytest setup: the ``gpu`` marker and helpers for the CPU tests.

Tests marked ``gpu`` are skipped when ``torch.cuda.is_available()`` is false.
``run_step`` (a fixture returning :func:`models.run_step`) does one training
step under a context and returns the loss and cloned gradients; the
reference run uses ``contextlib.nullcontext()``.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import models  # noqa: E402  (tests/models.py, not collected)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_step():
    """``run_step(model, inputs, ctx, seed=1, loss_fn=...) -> (loss, {name: grad})``."""
    return models.run_step


@pytest.fixture
def reference():
    """A fresh ``contextlib.nullcontext()`` (the run without tiermem)."""
    return contextlib.nullcontext()


@pytest.fixture
def clean_env(monkeypatch):
    """A clean ``TIERMEM_*`` environment, so that a developer's settings cannot
    change what a test checks. Use with ``pytest.mark.usefixtures``."""
    for key in list(os.environ):
        if key.startswith("TIERMEM_"):
            monkeypatch.delenv(key)
