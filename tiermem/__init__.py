"""tiermem: per-tensor activation offloading for PyTorch training.

Wrap the forward pass in an :class:`Offloader`; each tensor autograd saves for
backward is kept on its device, copied to host memory (and prefetched back
before backward needs it), or, in later versions, spilled to NVMe or dropped
and recomputed. Importing tiermem does not initialise CUDA.
"""

from .config import Config, env_table_markdown
from .errors import ConfigError, TierMemError
from .offloader import Offloader, OffloadContext, no_offload, offload
from .policy import TensorInfo, Tier
from .telemetry import StepStats

__all__ = [
    "Config",
    "ConfigError",
    "OffloadContext",
    "Offloader",
    "StepStats",
    "TensorInfo",
    "Tier",
    "TierMemError",
    "env_table_markdown",
    "no_offload",
    "offload",
]

__version__ = "0.1.0"
