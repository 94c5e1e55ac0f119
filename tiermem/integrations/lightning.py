"""Lightning (``lightning.pytorch``): :class:`TierMemCallback` runs each
training step under a tiermem Offloader. Importing this module imports
Lightning; ``import tiermem`` does not. For the standalone
``pytorch_lightning`` package: ``tiermem.integrations.pytorch_lightning``.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from ._lightning import CallbackLogic, stats_metrics

__all__ = ["TierMemCallback", "stats_metrics"]


class TierMemCallback(CallbackLogic, Callback):
    """Offloads the saved activations of each training step of a Lightning fit.

    ``Trainer(callbacks=[TierMemCallback(policy="auto", device_budget="50%")])``:
    the keyword arguments are the :class:`~tiermem.Offloader`'s (``policy``,
    ``hints`` and every setting of :class:`~tiermem.Config`); bad ones raise
    :class:`~tiermem.ConfigError` here, not at fit. ``log_stats=True`` logs
    each training batch's step stats with ``pl_module.log_dict`` after its
    backward (``tiermem/<tier>_bytes``, ``tiermem/offloaded_bytes``,
    ``tiermem/stall_seconds``).

    At fit start the callback takes an open Offloader (``offloader``; a new one
    when the last fit closed it) and, under automatic optimization, puts each
    call of ``pl_module.training_step`` under it: one call is one step, its
    loss included, and backward runs after it. Under manual optimization it
    attaches the Offloader to the LightningModule instead
    (:meth:`tiermem.Offloader.attach`): each ``self(...)`` forward is one step,
    and work done on other modules is not offloaded. At fit end, and when the
    fit raises (``on_exception``), it undoes this and closes the Offloader,
    whose ``stats`` stay readable. Validation, test and predict (grad off) are
    left alone. Gradients and parameters are bit-identical to the same fit
    without the callback.
    """
