"""Seams for tests: what a test may see and change inside tiermem.

Tests (ours, and a user's checking their own setup) use these functions
instead of private attributes and names, so that the inside can change
without rewriting the tests (tests/test_public_seams.py keeps tiermem's own
tests to them). Nothing here is needed to train. Each function says what it
returns; those that patch the process do so only inside a ``with`` block.

- :mod:`~tiermem.testing.runtime`: an Offloader's stores, moves and copies;
- :mod:`~tiermem.testing.planner`: the ``policy="auto"`` planner;
- :mod:`~tiermem.testing.tracking`: producer tracking and recomputation;
- :mod:`~tiermem.testing.system`: I/O engines, memory, settings, the doctor.

Not imported by ``import tiermem``; use ``import tiermem.testing``.
"""

from .planner import *   # noqa: F401,F403
from .planner import __all__ as _planner
from .runtime import *   # noqa: F401,F403
from .runtime import __all__ as _runtime
from .system import *    # noqa: F401,F403
from .system import __all__ as _system
from .tracking import *  # noqa: F401,F403
from .tracking import __all__ as _tracking

__all__ = _runtime + _planner + _tracking + _system
