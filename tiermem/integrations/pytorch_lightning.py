"""The standalone ``pytorch_lightning`` package: :class:`TierMemCallback`, the
same callback as ``tiermem.integrations.lightning`` (Lightning's two packages
have different ``Callback`` classes, and a Trainer takes only its own).
"""

from __future__ import annotations

from pytorch_lightning import Callback

from ._lightning import CallbackLogic, stats_metrics

__all__ = ["TierMemCallback", "stats_metrics"]


class TierMemCallback(CallbackLogic, Callback):
    """:class:`tiermem.integrations.lightning.TierMemCallback` for
    ``pytorch_lightning.Trainer``: the same arguments and behaviour."""
