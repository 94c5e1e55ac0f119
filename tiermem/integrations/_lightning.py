"""What :class:`TierMemCallback` does, written once for both Lightning packages
(``lightning.pytorch`` and ``pytorch_lightning``, whose ``Callback`` classes
differ): this module imports neither. The public classes are in
``lightning.py`` and ``pytorch_lightning.py`` next to it.
"""

# NOTE [Lightning training step]
# Under automatic optimization Lightning calls pl_module.training_step (through
# the strategy, maybe through a wrapper's forward) and runs backward on its loss
# after it returns. For the fit, an instance attribute wraps training_step (as
# Lightning's own forward redirection patches forward), so each call is one step,
# as ``with off:`` around it would be: every tensor saved in it, loss included,
# and backward runs after the step was left. Under manual optimization backward
# and the optimizer run inside training_step, so one step would span several
# forwards and updates: the module is attached instead (each ``self(...)`` is
# one step). Validation, test and predict run with grad off: nothing is entered.

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import torch

from ..errors import ConfigError
from ..offloader import Offloader
from ..telemetry import StepStats

__all__ = ["CallbackLogic", "stats_metrics"]


def stats_metrics(stats: StepStats) -> dict:
    """The metrics ``log_stats=True`` logs for one step: ``tiermem/<tier>_bytes``
    for each tier (``keep`` is what stayed on the device), ``tiermem/offloaded_bytes``
    (not kept) and ``tiermem/stall_seconds``, as floats."""
    out = {f"tiermem/{tier}_bytes": float(n) for tier, n in stats.bytes_by_tier.items()}
    out["tiermem/offloaded_bytes"] = float(stats.offloaded_bytes)
    out["tiermem/stall_seconds"] = float(stats.stall_seconds)
    return out


def _wrap_training_step(off: Offloader, module: torch.nn.Module) -> Callable[[], None]:
    """Put each grad-mode call of ``module.training_step`` under ``off``
    (NOTE [Lightning training step]); returns what undoes it."""
    own = vars(module)
    had, before = "training_step" in own, own.get("training_step")
    method = module.training_step

    @functools.wraps(method)
    def training_step(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return method(*args, **kwargs)
        with off:
            return method(*args, **kwargs)

    module.training_step = training_step

    def undo() -> None:
        if vars(module).get("training_step") is not training_step:
            return   # replaced by someone else since: theirs stays
        if had:
            module.training_step = before
        else:
            del module.training_step

    return undo


class CallbackLogic:
    """The body of ``TierMemCallback`` (see its docstring in ``lightning.py``)."""

    def __init__(self, policy: Any = None, *, log_stats: bool = False,
                 hints: Optional[Callable] = None, **settings: Any) -> None:
        if not isinstance(log_stats, bool):
            raise ConfigError(f"tiermem: log_stats={log_stats!r} must be True or False")
        super().__init__()
        self.log_stats = log_stats
        self._policy, self._hints, self._settings = policy, hints, dict(settings)
        self._offloader: Optional[Offloader] = self._build()   # bad settings raise here
        self._undo: Optional[Callable[[], None]] = None

    def _build(self) -> Offloader:
        off = Offloader(self._policy, hints=self._hints, **self._settings)
        self._pid = os.getpid()
        return off

    @property
    def offloader(self) -> Optional[Offloader]:
        """The Offloader of the current fit, or of the last one (closed then;
        its ``stats`` are the last training step's). ``None`` in a copy sent
        to another process (``ddp_spawn``) until its fit starts."""
        return self._offloader

    # -- Lightning's hooks ----------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        if self._undo is not None:   # a fit that never reached its end hooks
            self._finish()
        off = self._offloader
        if off is None or off.closed or self._pid != os.getpid():
            off = self._offloader = self._build()
        if pl_module.automatic_optimization:
            self._undo = _wrap_training_step(off, pl_module)
        else:
            self._undo = off.attach(pl_module).detach

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.log_stats and self._offloader is not None:
            pl_module.log_dict(stats_metrics(self._offloader.stats), on_step=True,
                               on_epoch=False)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._finish()

    def _finish(self) -> None:
        """Undo the wrapping or attachment, then close the Offloader (idempotent)."""
        undo, self._undo = self._undo, None
        try:
            if undo is not None:
                undo()
        finally:
            off = self._offloader
            if off is not None and not off.closed and self._pid == os.getpid():
                off.close()

    # -- copies -----------------------------------------------------------------------
    def __getstate__(self) -> dict:
        # An Offloader's threads and pools are its process's: a copy sent to
        # another process builds its own at fit start.
        state = dict(self.__dict__)
        state["_offloader"], state["_undo"] = None, None
        return state
