"""How producer tracking's dispatch mode stays out of what it watches: the
ops it handles run as they would without a mode (:func:`_run_as_without_mode`),
and tiermem's own pack hook runs with the mode off the dispatch stack
(:func:`untracked_pack`)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["untracked_pack"]

# NOTE [Ops run as without a mode]
# Tracking must not change the forward's values. PyTorch runs a dispatch mode's
# handler with the Conjugate, Negative and ZeroTensor keys excluded, and the op
# the handler calls runs under that exclusion: a kernel that makes a lazy
# conjugate (or negative) view inside and hands it to another op would consume
# it as a plain tensor (complex ``linalg.pinv`` gives wrong values under any
# mode). So the handler runs the op with those keys allowed again, as without a
# mode, and excludes them again after; its arguments are already resolved, so
# only what the kernel makes inside meets them. Only when ours is the last mode
# and no argument is a tensor subclass: otherwise the op goes on as PyTorch
# hands it over, as it would without tiermem.
_KEY = torch._C.DispatchKey
_CONJ, _NEG = _KEY.Conjugate, _KEY.Negative
_ZERO = getattr(_KEY, "ZeroTensor", None)
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
_modes_below = torch._C._len_torch_dispatch_stack   # inside a handler: the modes under it
_dispatch_at = torch._C._get_dispatch_stack_at


def _run_as_without_mode(func, types, args, kwargs):
    """``func(*args, **kwargs)`` with NOTE [Ops run as without a mode]. Runs
    per op of a tracked forward: the keys are tested and set one by one,
    without a loop."""
    if types or _modes_below():   # a subclass or another mode handles it: as PyTorch does
        return func(*args, **kwargs)
    conj = _is_excluded(_CONJ)
    neg = _is_excluded(_NEG)
    zero = _ZERO is not None and _is_excluded(_ZERO)
    if not (conj or neg or zero):
        return func(*args, **kwargs)
    if conj:
        _set_excluded(_CONJ, False)
    if neg:
        _set_excluded(_NEG, False)
    if zero:
        _set_excluded(_ZERO, False)
    try:
        return func(*args, **kwargs)
    finally:
        if conj:
            _set_excluded(_CONJ, True)
        if neg:
            _set_excluded(_NEG, True)
        if zero:
            _set_excluded(_ZERO, True)


# NOTE [The pack hook runs untracked]
# Tiermem's own ops in the pack hook (the ``detach`` of each handle, a staging
# copy, a recipe input's copy) never go through the step's mode: autograd calls
# the pack hook after the op's kernel, with the mode back on the stack, but none
# of those ops is the model's (a saved tensor's record is the op's that made it,
# recorded before its pack) and they write only tiermem's own new tensors. So
# while the pack hook runs, the mode is taken off the dispatch stack when it is
# the innermost mode, and put back after: one pop and one push instead of a
# Python call per op. The same in the profiled step, so the profile's op counts
# (NOTE [Tracking priced] in planner/runtime.py) are the followed step's.
_pop_dispatch = torch._C._pop_torch_dispatch_stack
_push_dispatch = torch._C._push_on_torch_dispatch_stack


def untracked_pack(mode: TorchDispatchMode, pack):
    """``pack`` run with ``mode`` off the dispatch stack: NOTE [The pack hook
    runs untracked]."""
    def run(t):
        n = _modes_below()
        if not n or _dispatch_at(n - 1) is not mode:
            return pack(t)
        popped = _pop_dispatch(None)
        try:
            return pack(t)
        finally:
            _push_dispatch(popped)
    return run
