"""Under varying shapes the cpu tier's idle pooled memory stays bounded by
what one step moves (issue 14 #5; NOTE [Idle pageable buffers])."""

import random

import torch

import tiermem
import tiermem.testing


def test_idle_host_buffers_stay_bounded_with_varying_batch_sizes():
    torch.manual_seed(0)
    rng = random.Random(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    pool = tiermem.testing.store_of(off, tiermem.Tier.CPU).pool
    idle, moved = [], []
    for _ in range(120):
        x = torch.randn(rng.randint(64, 1024), 64)
        with off:
            loss = model(x).square().mean()
        moved.append(off.stats.bytes_by_tier["cpu"])
        loss.backward()
        del loss
        idle.append(pool.held_bytes - pool.in_use_bytes)
    assert pool.in_use_bytes == 0
    most_moved = max(moved)
    # Idle buffers never hold more than one step's worth of moved bytes (the
    # budget, half the RAM, would allow gigabytes).
    assert max(idle[20:]) <= most_moved, (max(idle[20:]), most_moved)
    assert pool.pageable_peak_bytes <= most_moved + (1 << 20)
    off.close()
