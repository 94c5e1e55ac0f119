"""The hand-written loop of docs/integrations.md ("Hand-written loops"), run as
the page writes it: three optimizer steps of two micro-batches each, under the
Offloader it builds, give parameters bit-identical to the same block run with
a stand-in Offloader that does nothing; the cpu tier was used, and the
Offloader is closed at the end."""

import os
import re
import types

import torch

import tiermem

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "integrations.md")


def _loop_block() -> str:
    text = open(DOC, encoding="utf-8").read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
              if "for step in range(steps)" in b]
    assert len(blocks) == 1, f"expected one loop block in {DOC}, found {len(blocks)}"
    return blocks[0]


class _Nothing:
    """An Offloader that offloads nothing (the plain run)."""

    def __init__(self, **settings):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def close(self):
        pass


def _run(block: str, offloader_cls) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(128, 1))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g))
            for _ in range(6)]
    scope = {
        "tiermem": types.SimpleNamespace(Offloader=offloader_cls),
        "model": model,
        "loss_fn": torch.nn.functional.mse_loss,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "steps": 3,
        "batches": lambda step: data[2 * step: 2 * step + 2],
    }
    exec(compile(block, DOC, "exec"), scope)
    scope["params"] = [p.detach().clone() for p in model.parameters()]
    return scope


def test_documented_loop_matches_the_plain_loop():
    block = _loop_block()
    made = []

    def offloader(**settings):
        off = tiermem.Offloader(min_offload_bytes=1024, **settings)
        made.append(off)
        return off

    plain = _run(block, _Nothing)
    got = _run(block, offloader)
    assert all(torch.equal(a, b) for a, b in zip(got["params"], plain["params"]))
    assert len(made) == 1 and made[0].closed
    assert made[0].stats.count_by_tier["cpu"] > 0
