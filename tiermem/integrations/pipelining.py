"""tiermem under ``torch.distributed.pipelining``: :func:`attach_stage`.

A pipeline stage calls its module once per microbatch, and runs each
microbatch's backward later, in the order its schedule gives (GPipe: every
forward, then every backward; 1F1B and the interleaved schedules: forwards and
backwards alternate). :func:`attach_stage` attaches an Offloader to the module
the stage calls, so that each microbatch's forward is one step of that
Offloader with its own saved tensors, stats and restores, and records the
stats of every microbatch step (:attr:`StageAttachment.microbatch_stats`).
"""

# NOTE [Pipeline stages do not agree ranks]
# An auto Offloader with agree_ranks on exchanges budgets and rates over the
# default group when its second step begins, and waits there for every rank.
# Pipeline ranks reach their second step (after a shape inference, their first
# microbatch) at different times, and the next rank is blocked in the
# schedule's receive of the activation the waiting rank has not sent yet: the
# group never completes the exchange (a hang, seen with 2 gloo ranks). Stages also run different modules, so one
# agreed timeline would be wrong for all but one. attach_stage therefore
# refuses an auto Offloader unless agree_ranks is False.

from __future__ import annotations

from collections import deque
from typing import List, Union

import torch

from ..attach import Attachment
from ..errors import ConfigError
from ..telemetry import StepStats

__all__ = ["StageAttachment", "attach_stage"]

#: Most microbatch steps a :class:`StageAttachment` remembers (the newest).
MAX_RECORDED_STEPS = 1024


class StageAttachment:
    """An Offloader attached to one pipeline stage's module (made by
    :func:`attach_stage`).

    ``microbatch_stats`` lists the :class:`~tiermem.StepStats` of each forward
    of the module that ran as a step of the Offloader, oldest first, until
    :meth:`take_stats` empties it (at most the newest 1024: a loop that never
    takes them holds no more). A microbatch's forward fields are final when
    its forward returns; its backward fields (restores, stalls, recomputes)
    when the schedule has run that microbatch's backward. ``detach()`` removes
    the hooks (idempotent); ``with attach_stage(off, stage): ...`` detaches on
    the way out.
    """

    def __init__(self, offloader, module: torch.nn.Module) -> None:
        #: The Offloader each microbatch's forward runs under.
        self.offloader = offloader
        #: The module the stage calls (``PipelineStage.submod``).
        self.module = module
        #: The :class:`~tiermem.Attachment` that enters the Offloader.
        self.attachment: Attachment = offloader.attach(module)
        #: Stats of the microbatch steps since the last :meth:`take_stats`
        #: (a deque of the newest ``MAX_RECORDED_STEPS``).
        self.microbatch_stats: deque = deque(maxlen=MAX_RECORDED_STEPS)
        self._last = offloader.stats   # the step before ours: not recorded
        # Registered after the attachment's hooks: runs once it has left the step.
        self._hook = module.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        off = self.offloader
        stats = off.stats
        # A forward that was not a step of its own (grad mode off, inside
        # backward, inside an outer ``with off:``) left ``off.stats`` alone or
        # is still under the Offloader.
        if stats is self._last or off._active_here():
            return
        self._last = stats
        self.microbatch_stats.append(stats)

    def take_stats(self) -> List[StepStats]:
        """The stats of the microbatch steps recorded so far, oldest first;
        the list starts empty again."""
        out = list(self.microbatch_stats)
        self.microbatch_stats.clear()
        return out

    @property
    def attached(self) -> bool:
        """Whether the hooks are installed."""
        return self.attachment.attached

    def detach(self) -> None:
        """Remove the hooks (the Offloader is left open: ``close()`` it after
        the last backward). Idempotent."""
        self._hook.remove()
        self.attachment.detach()

    def __enter__(self) -> "StageAttachment":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def __repr__(self) -> str:
        return (f"<tiermem StageAttachment of {type(self.module).__name__} to "
                f"{self.offloader!r}, attached={self.attached}>")


def _stage_module(stage) -> torch.nn.Module:
    if isinstance(stage, torch.nn.Module):
        return stage
    submod = getattr(stage, "submod", None)
    if isinstance(submod, torch.nn.Module):   # a PipelineStage, or one built by pipeline()
        return submod
    raise TypeError(
        f"tiermem: attach_stage() takes a torch.distributed.pipelining PipelineStage or "
        f"the nn.Module given to it, got {type(stage).__name__}")


def attach_stage(offloader, stage: Union[torch.nn.Module, "object"]) -> StageAttachment:
    """Run each microbatch forward of a pipeline stage under ``offloader``.

    ``stage`` is a ``torch.distributed.pipelining.PipelineStage`` (its
    ``submod`` is attached), a stage built by ``pipeline(...).build_stage``, or
    the module you give to ``PipelineStage`` (before or after building it: the
    stage calls that same module). Each call of the module with grad mode on is
    one step of ``offloader``, exactly as ``with offloader:`` around it would
    be (:meth:`tiermem.Offloader.attach`); its saved tensors come back when the
    schedule runs that microbatch's backward, in whatever order it runs them.
    The loss the schedule computes from the last stage's output is plain
    autograd's. Give each stage of a rank its own Offloader: restores follow
    the order of backwards per Offloader (oldest microbatch first), and one
    shared by two stages, while exact, mixes their microbatches in that order.

    Returns a :class:`StageAttachment` (its ``microbatch_stats`` are each
    microbatch step's :class:`~tiermem.StepStats`). Raises ``TypeError`` for
    anything else than a stage or a module, :class:`~tiermem.ConfigError` for
    ``policy="auto"`` with ``agree_ranks`` on (make the Offloader with
    ``agree_ranks=False``: pipeline ranks cannot agree on a plan), and
    :class:`~tiermem.TierMemError` as :meth:`~tiermem.Offloader.attach` does
    (the module already attached to this Offloader, a closed Offloader).
    """
    # NOTE [Pipeline stages do not agree ranks]: why auto needs agree_ranks off.
    module = _stage_module(stage)
    cfg = offloader.config
    if cfg.policy == "auto" and cfg.agree_ranks and not cfg.disable:
        raise ConfigError(
            "tiermem: attach_stage(): policy='auto' with agree_ranks=True cannot run under a "
            "pipeline schedule: the ranks' exchange at the second step would wait for a rank "
            "blocked in the schedule's receive (a hang), and stages plan different modules. "
            "Make the Offloader with agree_ranks=False (or TIERMEM_AGREE_RANKS=0)")
    return StageAttachment(offloader, module)
