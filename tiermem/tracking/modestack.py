"""tiermem's torch-function and dispatch modes on torch's mode stacks.

A class of ours says so with ``tiermem_mode = True``. :func:`suspend` takes
ours off both stacks while a compiled module runs and :func:`resume` puts them
back; :func:`take_off` leaves one mode wherever it is on its stack (the modes
above it are put back unchanged). :func:`region` is the compiled region running
on this thread.
"""

from __future__ import annotations

import sys
import threading
from typing import List, Optional, Tuple

import torch

__all__ = ["is_ours", "is_compiled_module", "suspend", "resume", "is_innermost", "take_off",
           "region", "set_region", "in_compiled_region", "dynamo_ran"]

_fn_depth = torch._C._len_torch_function_stack
_fn_at = torch._C._get_function_stack_at
_fn_pop = torch._C._pop_torch_function_stack
_fn_push = torch._C._push_on_torch_function_stack
_dispatch_depth = torch._C._len_torch_dispatch_stack
_dispatch_at = torch._C._get_dispatch_stack_at
_dispatch_pop = torch._C._pop_torch_dispatch_stack
_dispatch_push = torch._C._push_on_torch_dispatch_stack

_compiled_type: Optional[type] = None
_tls = threading.local()


def region() -> Optional[list]:
    """The compiled region running on this thread: ``[its index on the module
    stack, compiled modules open in it, the modes suspend() left]``, or None."""
    return _tls.__dict__.get("region")


def set_region(r: Optional[list]) -> None:
    _tls.region = r


def in_compiled_region() -> bool:
    """Whether a compiled module (NOTE [Compiled regions run without our
    modes]) runs on this thread now: the tensors packed now are saved by
    compiled code."""
    return _tls.__dict__.get("region") is not None


def is_ours(mode) -> bool:
    """Whether ``mode`` (on a mode stack) is one of tiermem's."""
    return getattr(type(mode), "tiermem_mode", False) is True


def is_compiled_module(module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (Dynamo's
    ``OptimizedModule``); ``False`` while Dynamo was never imported."""
    global _compiled_type
    t = _compiled_type
    if t is None:
        t = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
        if t is None:
            return False
        _compiled_type = t
    return isinstance(module, t)


def _stack_of(function: bool):
    return ((_fn_depth, _fn_at, _fn_pop, _fn_push) if function else
            (_dispatch_depth, _dispatch_at, lambda: _dispatch_pop(None), _dispatch_push))


# NOTE [Compiled regions run without our modes]
# Dynamo runs eagerly every frame started under a dispatch mode, and traces the
# torch-function modes on the stack into its graph (its code then takes them off
# around the graph at run time). tiermem's modes are bookkeeping, not model
# code: under them compile was silently off, or crashed (a CallGate left at a
# hook inside the graph popped an empty stack). So when a compiled module
# (``torch.compile(module)``) starts, the module tracker takes our modes off
# both stacks, ignores the module hooks inside it (the graph's own modules) and
# puts the modes back when it ends (its post-hook runs also when it raised).
# Inside, no op is tracked: the tensors the compiled code saves are packed with
# no producer, so they go to a storage tier, never to recompute. Only modes
# innermost on their stack are taken off (under a user's mode, ours stay).
def suspend() -> Tuple[List, List]:
    """Leave the run of tiermem's modes innermost on each stack (function,
    dispatch), innermost first; what :func:`resume` is to be given."""
    out: Tuple[List, List] = ([], [])
    for function, left in ((True, out[0]), (False, out[1])):
        depth, at = _stack_of(function)[:2]
        while True:
            n = depth()
            if not n or not is_ours(at(n - 1)):
                break
            mode = at(n - 1)
            mode.__exit__(None, None, None)
            left.append(mode)
    return out


def resume(left: Tuple[List, List]) -> None:
    """Enter again the modes :func:`suspend` left, in their order."""
    for modes in left:
        for mode in reversed(modes):
            mode.__enter__()


def is_innermost(mode, function: bool) -> bool:
    """Whether ``mode`` is the innermost mode of its stack."""
    depth, at = _stack_of(function)[:2]
    n = depth()
    return bool(n) and at(n - 1) is mode


def take_off(mode, function: bool) -> bool:
    """Leave ``mode`` (a function mode if ``function``, else a dispatch mode)
    wherever it is on its stack: the modes above it are taken off and put
    back unchanged. ``False`` if it is not on the stack (nothing popped)."""
    depth, at, pop, push = _stack_of(function)
    n = depth()
    for i in range(n - 1, -1, -1):
        if at(i) is mode:
            break
    else:
        return False
    above = [pop() for _ in range(n - 1 - i)]
    try:
        mode.__exit__(None, None, None)
    finally:
        for m in reversed(above):
            push(m)
    return True


_dynamo_seen = False


def dynamo_ran() -> bool:
    """Whether Dynamo has considered a frame in this process (sticky; read
    from its counters, never importing it): NOTE [Hooks held between steps]
    in tracking/modules.py."""
    global _dynamo_seen
    if not _dynamo_seen:
        utils = sys.modules.get("torch._dynamo.utils")
        frames = None if utils is None else utils.counters.get("frames")
        _dynamo_seen = bool(frames and frames.get("total"))
    return _dynamo_seen
