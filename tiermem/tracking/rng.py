"""The generator a random op draws from, and its state: what a recipe of a
random op replays (``Record.rng``, a ``(generator, state)`` pair captured just
before the op ran, without a device sync)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["capture_rng", "drew_nothing"]


def capture_rng(args, kwargs) -> Optional[tuple]:
    """(generator, state) of the generator the op will draw from; ``None``
    if unknown (the op is then not recomputable). ``get_state`` copies the
    host-side state (CUDA: seed and offset), no device sync. A ``device``
    argument (``torch.rand_like(x, device="cuda")``) names the device the
    op draws on, before its tensors'."""
    device = kwargs.get("device")
    if device is not None:
        device = torch.device(device)
    else:
        device = _first_device(args)
    if device is None:
        device = _first_device(kwargs.values())
    if device is None:
        return None
    gen = _generator_for(device, kwargs.get("generator"))
    if gen is None:
        return None
    return gen, gen.get_state()


def drew_nothing(rng: tuple) -> bool:
    """Whether the generator of ``rng`` (generator, state before a call) is
    still in that state: NOTE [Calls recorded whole] in tracking/producers.py,
    rule 6."""
    gen, before = rng
    return gen.get_state().numpy().tobytes() == before.numpy().tobytes()


def _first_device(args) -> Optional[torch.device]:
    """The device of the first tensor in ``args`` (lists and tuples looked
    into), ``None`` if there is none."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    return x.device
    return None


def _generator_for(device: torch.device, explicit) -> Optional[torch.Generator]:
    if explicit is not None:
        return explicit
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None
