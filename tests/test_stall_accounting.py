"""``stats.stall_seconds`` counts the whole wait of an unpack that reads its
tensor on demand: starting the read (a buffer, the submission) as well as
waiting for it. The closed loop (NOTE [Closed loop] in planner/lifecycle.py)
compares this figure with the plan's predicted stall."""

from __future__ import annotations

import pytest
import torch

import tiermem.testing
from helpers import land_moves, offloader

START_DELAY_S = 0.03


@pytest.mark.parametrize("policy", ["nvme", "cpu"])
def test_starting_a_read_on_demand_counts_as_stall(nvme_dir, policy):
    """Every restore is read on demand (no prefetch) and each start is made
    to take START_DELAY_S: the stall counts at least that per read."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    off = offloader(policy, nvme_dir=nvme_dir, prefetch_bytes=0, tail_hold_bytes=0)
    with off:
        loss = torch.tanh(lin(x)).sum()
    land_moves(off)
    with tiermem.testing.slow_restore_starts(START_DELAY_S):
        loss.backward()
    s = off.stats
    moved = s.count_by_tier["cpu"] + s.count_by_tier["nvme"]
    assert moved > 0 and s.prefetch_misses == moved and s.prefetch_hits == 0, s
    assert s.stall_seconds >= moved * START_DELAY_S, (s.stall_seconds, moved)
    off.close()
