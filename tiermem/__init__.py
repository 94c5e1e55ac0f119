"""tiermem: per-tensor activation offloading for PyTorch training.

Wrap the forward pass in an :class:`Offloader`; each tensor autograd saves for
backward is kept on its device, copied to host memory, or written to an NVMe
file, and brought back ahead of need in backward (dropping and recomputing
comes later). Importing tiermem does not initialise CUDA.
"""

from .config import Config, env_table_markdown
from .errors import ConfigError, TierMemError
from .io import engine_info
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
    "engine_info",
    "env_table_markdown",
    "no_offload",
    "offload",
]

__version__ = "0.1.0"
