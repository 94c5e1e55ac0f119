"""Exception types of tiermem.

Every message starts with ``tiermem:``, says what happened, shows the observed
values and, where there is one, names the setting to change.
"""

__all__ = ["ConfigError", "TierMemError"]


class ConfigError(ValueError):
    """A setting (argument or ``TIERMEM_*`` variable) has a bad value.

    The message names the setting and the value, e.g.
    ``tiermem: TIERMEM_MIN_OFFLOAD_BYTES='abc' is not a size ...``.
    """


class TierMemError(RuntimeError):
    """A runtime failure of tiermem (a tier could not store or restore a tensor,
    a saved tensor was modified in place, an internal invariant broke)."""
