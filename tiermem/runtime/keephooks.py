"""The saved-tensor hooks of a step that keeps every tensor (NOTE [Steps that
keep everything] in offloader.py): :func:`keep_step_hooks`."""

# NOTE [Hooks of a step that keeps everything]
# Such a step only counts what it keeps and checks versions at unpack, so its
# pack hook is its own, not the Packer's walk of NOTE [Pack order of checks]:
# 1. a handle is the pair ``(t.detach(), t._version)`` (a leaf: ``t`` itself,
#    as ``Kept`` holds it), made without a Python constructor; its unpack
#    compares the version as ``Kept``'s does (NOTE [In-place check]);
# 2. the step's first pack is a ``MarkedKept``, which tells the step its
#    backward runs (NOTE [Backward order] in runtime/schedule.py);
# 3. stats count as the Packer counts in such a step (``StepStats.param_count``);
#    a tensor saved inside backward is kept and not counted;
# 4. both hooks are hidden from torch.compile (NOTE [Hooks under torch.compile]).
# A pair never reaches another step's unpack: autograd stores each saved
# tensor's unpack hook with it.

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch

from ..policy import Tier
from ..tiers.keep import Kept, MarkedKept, check_version
from ..tracking.hidden import hidden_hook, opaque
from .hooks import unpack as unpack_handle

__all__ = ["keep_step_hooks"]

_KEEP = Tier.KEEP.value
_in_backward = torch._C._current_graph_task_id   # -1 outside autograd's engine
_Parameter = torch.nn.Parameter
_strided = torch.strided


def _unpack(handle: Any) -> torch.Tensor:
    """A pair's tensor after the in-place check; any other handle (the first,
    a ``MarkedKept``) as every step unpacks it."""
    if type(handle) is tuple:
        t, version = handle
        if t._version != version:
            check_version(t, version, "")
        return t
    return unpack_handle(handle)


def keep_step_hooks(step, min_offload_bytes: int) -> Tuple[Callable, Callable]:
    """``(pack, unpack)`` of ``step``, a step that keeps every tensor and
    counts them in ``step.stats`` (tensors under ``min_offload_bytes`` also
    in ``small_count``): NOTE [Hooks of a step that keeps everything]."""
    stats = step.stats
    bytes_kept = stats.bytes_by_tier
    count_kept = stats.count_by_tier
    first = [True]   # emptied by the first pack

    def pack(t: torch.Tensor) -> Any:
        # The Packer's order (NOTE [Pack order of checks] in runtime/hooks.py).
        held = None
        if _in_backward() != -1:   # rule 3: consumed at once, not the step's
            pass
        elif t.layout is not _strided:
            stats.unsupported_count += 1
            bytes_kept[_KEEP] += t.numel() * t.element_size()
            count_kept[_KEEP] += 1
        else:
            base = t._base
            if base is None:
                base = t
            if (base.requires_grad and base.is_leaf) or issubclass(type(base), _Parameter):
                stats.param_count += 1
                if base is t and t.is_leaf:   # rule 1: the leaf itself
                    held = t
            else:
                nbytes = t.nbytes
                if nbytes < min_offload_bytes or nbytes == 0:
                    stats.small_count += 1
                bytes_kept[_KEEP] += nbytes
                count_kept[_KEEP] += 1
        if held is None:
            held = t.detach()
        if first:
            return _first(t, held)
        return (held, t._version)

    def _first(t: torch.Tensor, held: torch.Tensor) -> Any:
        """The step's first handle (rule 2), as ``Packer._pack_first`` makes it."""
        first.clear()
        kept = Kept(t, "")
        kept.tensor = held
        handle: Any = kept
        if step.order is not None and _in_backward() == -1:
            handle = MarkedKept(kept, step)
        step.saved_first(handle)
        return handle

    return opaque(pack), hidden_hook("keep step unpack", _unpack)
