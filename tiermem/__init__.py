"""tiermem: per-tensor activation offloading for PyTorch training.

Wrap the forward pass in an :class:`Offloader`; each tensor autograd saves for
backward is kept on its device, copied to host memory, written to an NVMe
file (and brought back ahead of need in backward), or dropped and recomputed
from its producer op. :func:`wrap_blocks` combines this with checkpointing.
Importing tiermem does not initialise CUDA.
"""

from ._version import __version__
from .attach import Attachment
from .blocks import BlockWrapping, wrap_blocks
from .config import Config, env_table_markdown
from .errors import ConfigError, TierMemError
from .io import engine_info
from .offloader import Offloader, OffloadContext
from .oneshot import no_offload, offload
from .policy import TensorInfo, Tier
from .telemetry import StepStats

__all__ = [
    "Attachment",
    "BlockWrapping",
    "Config",
    "ConfigError",
    "OffloadContext",
    "Offloader",
    "StepStats",
    "TensorInfo",
    "Tier",
    "TierMemError",
    "engine_info",
    "env_table_markdown",
    "no_offload",
    "offload",
    "wrap_blocks",
]
