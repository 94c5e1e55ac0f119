"""Integrations with training frameworks that own the loop.

Each lives in its own submodule and imports its framework there, so that
``import tiermem`` imports none of them: ``tiermem.integrations.lightning``
(``lightning.pytorch``) and ``tiermem.integrations.pytorch_lightning`` (the
``pytorch_lightning`` package) hold :class:`TierMemCallback`;
``tiermem.integrations.pipelining`` holds :func:`attach_stage` for
``torch.distributed.pipelining`` stages.
"""
